"""Chapter 02: the DeepSpeed config and engine of a first run, and its exercise checks.

- :func:`exercise_batch_config`: the learner writes the batch block of a ``ds_config`` for a given world size;
  DeepSpeed's own config class (``DeepSpeedConfig``) resolves it, as ``deepspeed.initialize`` would.
- :func:`exercise_warmup_scheduler`: the learner writes a ``scheduler`` block; DeepSpeed's ``WarmupLR`` is
  built from it on a stand-in optimizer and stepped, and the learning rates it sets are the answer.
- :func:`exercise_stage0_bytes`: the learner predicts the bytes of stage 0's gradient all_reduce per optimizer
  step; the comms log of the chapter's stage-0 run has the real number.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any
from unittest import mock

import torch

from helpers.core import configs, environment, exercises, records

#: Exercise 1's cluster and batch: ranks, the global batch per optimizer step, the most samples a rank holds.
BATCH_WORLD, BATCH_GLOBAL, BATCH_MAX_MICRO = 8, 64, 4
#: Exercise 2's warm-up: the optimizer's learning rate, the rise per optimizer step, the steps the check follows.
WARMUP_LR, WARMUP_RISE, WARMUP_FOLLOWED = 1e-4, 1e-5, 20
#: The DeepSpeed function whose all_reduce carries stage 0's gradients (its comms log names it).
GRADIENT_CALLER = "allreduce_bucket"


def resolved_batch(config: dict, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) as DeepSpeed's own
    ``DeepSpeedConfig`` resolves ``config`` on ``world_size`` ranks (it derives the missing ones and raises on
    a combination that does not add up). No process group is needed."""
    environment.quiet_deepspeed_import()
    from deepspeed.runtime import config as ds_config  # deferred: DeepSpeed after the accelerator is chosen

    ranks = mock.Mock(get_rank=lambda *a, **k: 0, get_world_size=lambda *a, **k: world_size)
    with mock.patch.object(ds_config, "dist", ranks):
        parsed = ds_config.DeepSpeedConfig(copy.deepcopy(config))
    return parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps


def exercise_batch_config(answer: Any) -> exercises.Verdict:
    """Exercise: a batch block (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps``, any of them) that DeepSpeed accepts on :data:`BATCH_WORLD` ranks, with a
    global batch of :data:`BATCH_GLOBAL` samples and at most :data:`BATCH_MAX_MICRO` samples per rank and
    micro-step. The course's checker and ``DeepSpeedConfig`` both read it."""
    def test(config: Any) -> tuple[bool, str]:
        if not isinstance(config, dict):
            return False, f"{config!r} is not a dict of config keys."
        if refused := configs.refusal(config, BATCH_WORLD):
            return False, refused
        train, micro, accumulation = resolved_batch(config, BATCH_WORLD)
        found = (f"DeepSpeed resolves it to micro batch {micro} x accumulation {accumulation} x {BATCH_WORLD} ranks "
                 f"= train batch {train}.")
        if train != BATCH_GLOBAL:
            return False, f"{found} The global batch must be {BATCH_GLOBAL}."
        if micro > BATCH_MAX_MICRO:
            return False, f"{found} {micro} samples per micro-step do not fit a rank that holds {BATCH_MAX_MICRO}."
        return True, (f"{found} Each rank runs {accumulation} micro-step(s) of {micro} samples before every "
                      f"optimizer step, and DeepSpeed averages the gradients over all {train} samples.")

    return exercises.satisfies(
        "batch config", answer, test,
        task=(f"Write the batch keys of a ds_config for {BATCH_WORLD} GPUs: a global batch of {BATCH_GLOBAL} "
              f"samples per optimizer step, at most {BATCH_MAX_MICRO} samples per GPU per micro-step."),
        hint=("train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size; "
              "a key you leave out, DeepSpeed derives from the other two."))


def warmup_lrs(scheduler: dict, lr: float = WARMUP_LR, steps: int = WARMUP_FOLLOWED) -> list[float]:
    """The learning rates of the first ``steps`` optimizer steps under DeepSpeed's scheduler of block
    ``scheduler``, built on a stand-in optimizer whose learning rate is ``lr``: the first is what the
    scheduler's constructor sets, and the engine calls its ``step()`` after every optimizer step."""
    environment.quiet_deepspeed_import()
    from deepspeed.runtime import lr_schedules  # deferred: DeepSpeed after the accelerator is chosen

    kind = scheduler.get("type")
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise ValueError(f"DeepSpeed has no scheduler {kind!r} (it knows {', '.join(lr_schedules.VALID_LR_SCHEDULES)})")
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    from deepspeed.utils import logger  # deferred: as above

    level = logger.level
    logger.setLevel(logging.ERROR)  # its constructor warns "before it has started", as it does in every run
    try:
        built = getattr(lr_schedules, kind)(stand_in, **scheduler.get("params", {}))
    finally:
        logger.setLevel(level)
    found = [stand_in.param_groups[0]["lr"]]
    for _ in range(steps - 1):
        built.step()
        found.append(stand_in.param_groups[0]["lr"])
    return [float(x) for x in found]


def exercise_warmup_scheduler(answer: Any) -> exercises.Verdict:
    """Exercise: a ``scheduler`` block under which DeepSpeed's learning rate starts at 0 and rises linearly, by
    :data:`WARMUP_RISE` per optimizer step, to the optimizer's :data:`WARMUP_LR` (the article's takes 1000
    steps, logarithmically). The check builds DeepSpeed's scheduler from the block and follows the learning
    rates it sets over :data:`WARMUP_FOLLOWED` optimizer steps."""
    def test(block: Any) -> tuple[bool, str]:
        if not isinstance(block, dict):
            return False, f"{block!r} is not a dict with a 'type' and its 'params'."
        config = {"train_micro_batch_size_per_gpu": 4, "scheduler": block,
                  "optimizer": {"type": "AdamW", "params": {"lr": WARMUP_LR}}}
        if refused := configs.refusal(config, 1):
            return False, refused
        lrs = warmup_lrs(block)
        top = max(lrs)
        reached = next(i for i, lr in enumerate(lrs, 1) if math.isclose(lr, top, rel_tol=1e-9))
        rises = [b - a for a, b in zip(lrs, lrs[1:]) if b - a > 1e-15]
        found = (f"Under DeepSpeed's {block['type']} optimizer steps 1, 2 and 3 use learning rates {lrs[0]:.3g}, "
                 f"{lrs[1]:.3g} and {lrs[2]:.3g}; the rate peaks at {top:.3g} from step {reached}.")
        if not math.isclose(lrs[0], 0.0, abs_tol=1e-15):
            return False, f"{found} It must start at 0."
        if not math.isclose(top, WARMUP_LR, rel_tol=1e-6) or not math.isclose(lrs[-1], WARMUP_LR, rel_tol=1e-6):
            return False, f"{found} It must rise to {WARMUP_LR:g} and stay there."
        if not rises or not all(math.isclose(r, WARMUP_RISE, rel_tol=1e-6) for r in rises):
            return False, f"{found} Its rises are not all {WARMUP_RISE:g} per step."
        return True, (f"{found} WarmupLR computes the rate after the scheduler's n-th step() from n - 1 (the first "
                      f"two steps both use warmup_min_lr), then adds (max - min) / warmup_num_steps a step. The "
                      f"article's log warm-up over 1000 steps moves far more slowly.")

    return exercises.satisfies(
        "warm-up scheduler", answer, test,
        task=(f"Write a scheduler block: WarmupLR from 0 to the optimizer's {WARMUP_LR:g}, rising linearly by "
              f"{WARMUP_RISE:g} per optimizer step."),
        hint=("WarmupLR's params are warmup_min_lr, warmup_max_lr, warmup_num_steps and warmup_type "
              "(\"log\", its default, or \"linear\"); the rise per step is (max - min) / warmup_num_steps."))


def gradient_allreduce_bytes(record: records.Record) -> float:
    """Bytes per optimizer step of the all_reduce that carries the gradients (:data:`GRADIENT_CALLER`), as the
    run's comms logger recorded them."""
    return record.comm.by_caller["all_reduce"][GRADIENT_CALLER]["bytes"]


def exercise_stage0_bytes(answer: Any, stage0: records.Record) -> exercises.Verdict:
    """Exercise: predict the bytes stage 0's gradient all_reduce carries per optimizer step in the chapter's
    stage-0 run ``stage0`` (its comms log has the answer)."""
    expected = gradient_allreduce_bytes(stage0)
    return exercises.number(
        "stage 0 bytes", answer, expected, unit=" bytes",
        task=(f"Predict the bytes stage 0's gradient all_reduce carries per optimizer step ({stage0.params:,} "
              f"fp32 parameters, {stage0.summary['grad_accum']} micro-steps per optimizer step)."),
        hint="one gradient element per parameter, 4 bytes each in fp32; does accumulation multiply it?",
        why=(f"{stage0.params:,} parameters x 4 bytes: the gradients accumulate locally over the "
             f"{stage0.summary['grad_accum']} micro-steps, and the engine all-reduces them once, at the boundary "
             f"({GRADIENT_CALLER} in the comms log)."))
