"""Chapter 02: the DeepSpeed config and engine of a first run, and its exercise checks.

- :func:`exercise_batch_config`: the learner writes the batch block of a ``ds_config`` for a given world size;
  DeepSpeed's own config class (``DeepSpeedConfig``) resolves it, as ``deepspeed.initialize`` would.
- :func:`warmup_table`: the learning rates DeepSpeed's ``WarmupLR`` sets in the first optimizer steps, one column
  per scheduler block; :func:`exercise_warmup_scheduler`: the learner predicts
  the first step at which the article's warm-up uses half its peak, and DeepSpeed's scheduler has the answer.
- :func:`exercise_stage0_bytes`: the learner predicts the bytes of stage 0's gradient all_reduce per optimizer
  step; the comms log of the chapter's stage-0 run has the real number. :func:`norm_allreduce` says what the
  other, 4-byte all_reduce of that run is, from the comms log and DeepSpeed's source. :func:`first_difference`:
  the first step at which two runs' losses part (the baseline without clipping).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from pathlib import Path
from typing import Any, Mapping, Sequence
from unittest import mock

import torch

from helpers.core import configs, ds, exercises, records

#: Exercise 1's cluster and batch: ranks, the global batch per optimizer step, the most samples a rank holds.
BATCH_WORLD, BATCH_GLOBAL, BATCH_MAX_MICRO = 8, 64, 4
#: The optimizer's learning rate a stand-in optimizer starts from, and the steps :func:`warmup_lrs` follows.
WARMUP_LR, WARMUP_FOLLOWED = 1e-4, 20
#: Exercise 2: the fraction of the peak learning rate whose first optimizer step the learner predicts.
WARMUP_FRACTION = 0.5
#: The DeepSpeed functions whose all_reduce carries stage 0's gradients, and the one that reduces their norm.
GRADIENT_CALLER, NORM_CALLER = "allreduce_bucket", "clip_grad_norm_"


def resolved_batch(config: dict, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) as DeepSpeed's own
    ``DeepSpeedConfig`` resolves ``config`` on ``world_size`` ranks (it derives the missing ones and raises on
    a combination that does not add up). No process group is needed."""
    ds_config = ds.load("deepspeed.runtime.config")

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
    lr_schedules = ds.load("deepspeed.runtime.lr_schedules")

    kind = scheduler.get("type")
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise ValueError(f"DeepSpeed has no scheduler {kind!r} (it knows {', '.join(lr_schedules.VALID_LR_SCHEDULES)})")
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    logger = ds.load("deepspeed.utils").logger

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


def linear_warmup(scheduler: dict, warmup_num_steps: int) -> dict:
    """``scheduler`` (a ``WarmupLR`` block) made linear over ``warmup_num_steps`` optimizer steps, same rates."""
    params = {**scheduler.get("params", {}), "warmup_type": "linear", "warmup_num_steps": warmup_num_steps}
    return {**scheduler, "params": params}


def warmup_table(blocks: Mapping[str, dict], steps: int = 4) -> str:
    """The learning rate of each of the first ``steps`` optimizer steps under each scheduler block of ``blocks``
    (name: block), as DeepSpeed's scheduler sets it (:func:`warmup_lrs`), one column per block."""
    rates = {name: warmup_lrs(block, steps=steps) for name, block in blocks.items()}
    names = list(rates)
    width = [max(len(n), 8) for n in names]
    lines = ["step  " + "  ".join(n.rjust(w) for n, w in zip(names, width)),
             "----  " + "  ".join("-" * w for w in width)]
    for i in range(steps):
        lines.append(f"{i + 1:<4}  " + "  ".join(f"{rates[n][i]:.2g}".rjust(w) for n, w in zip(names, width)))
    return "\n".join(lines)


def first_step_at(lrs: list[float], fraction: float) -> int:
    """The first 1-based optimizer step whose learning rate in ``lrs`` is at least ``fraction`` of the largest."""
    target = fraction * max(lrs)
    return next(i for i, lr in enumerate(lrs, 1) if lr >= target or math.isclose(lr, target, rel_tol=1e-9))


def exercise_warmup_scheduler(answer: Any, scheduler: dict) -> exercises.Verdict:
    """Exercise: predict the first optimizer step at which DeepSpeed's ``WarmupLR`` of block ``scheduler`` (the
    article's: log, 1000 steps) uses at least :data:`WARMUP_FRACTION` of its peak learning rate. The check
    builds DeepSpeed's scheduler from the block, follows it to its peak, and compares with linear warm-ups to
    the same peak; one step either side is accepted (the first steps' offset is the chapter's other lesson)."""
    params = scheduler.get("params", {})
    warmup = int(params.get("warmup_num_steps", 1000))
    follow = warmup + 2  # the rate reaches its peak at optimizer step warmup_num_steps + 1
    lrs = warmup_lrs(scheduler, steps=follow)
    expected = first_step_at(lrs, WARMUP_FRACTION)
    linear = first_step_at(warmup_lrs(linear_warmup(scheduler, warmup), steps=follow), WARMUP_FRACTION)
    peak = first_step_at(lrs, 1.0)
    kind = params.get("warmup_type", "log")
    return exercises.number(
        "warm-up", answer, expected, absolute=1,
        task=(f"Predict the first optimizer step at which the article's WarmupLR ({kind}, {warmup} steps to "
              f"{max(lrs):g}) uses at least {WARMUP_FRACTION:g} of its peak learning rate."),
        hint=f"the chapter's rule for the learning rate of optimizer step k under \"{kind}\".",
        why=(f"DeepSpeed's WarmupLR sets {lrs[expected - 1]:.3g} at optimizer step {expected}. A linear warm-up over "
             f"the same {warmup} steps gets there only at step {linear}, yet both reach the peak only after "
             f"{warmup} steps (the log one at step {peak}): a log warm-up rises fast at first and slowly at the end."))


def norm_allreduce(record: records.Record) -> str:
    """What the small all_reduce of a run without ZeRO is: its count and bytes per optimizer step in ``record``'s
    comms log (issued by :data:`NORM_CALLER`), and where DeepSpeed issues it, read from DeepSpeed's source (the
    comment that says why, the line that divides the norm by the ranks, the all_reduce itself)."""
    deepspeed = ds.load()
    ds_utils = ds.load("deepspeed.runtime.utils")

    call = record.comm.by_caller.get("all_reduce", {}).get(NORM_CALLER)
    if call is None:
        return f"no all_reduce issued by {NORM_CALLER} in this run's comms log"
    lines, first = inspect.getsourcelines(ds_utils.clip_grad_norm_)
    path = Path(inspect.getsourcefile(ds_utils)).relative_to(Path(deepspeed.__file__).parent.parent)
    why = next(i for i, line in enumerate(lines) if line.strip().startswith("#") and "moe" in line.lower())
    divide = next(i for i in range(why, len(lines)) if "get_world_size" in lines[i])
    reduce = next(i for i in range(divide, len(lines)) if "all_reduce(" in lines[i])
    source = "\n".join(f"  {path}:{first + i}: {lines[i].strip()}" for i in (why, divide, reduce))
    return (f"{NORM_CALLER}: {call['count']:g} all_reduce of {call['bytes']:g} bytes per optimizer step "
            f"({call['bytes'] / 4:g} fp32 number), over the {record.world_size} data-parallel ranks; in DeepSpeed's "
            f"source:\n{source}")


def first_difference(a: Sequence[float], b: Sequence[float], tolerance: float) -> int | None:
    """The first 1-based step at which two runs' losses differ by more than ``tolerance``; None if none does."""
    return next((i for i, (x, y) in enumerate(zip(a, b), 1) if abs(x - y) > tolerance), None)


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
        task=("Predict the bytes stage 0's gradient all_reduce carries per optimizer step, as an expression of "
              f"stage0.params (the model's parameter count; fp32, {stage0.summary['grad_accum']} micro-steps per "
              "optimizer step)."),
        hint=("the bytes of one copy of the gradients, and how often engine.backward and engine.step all-reduce "
              "it (the chapter's list of the script's DeepSpeed lines)."),
        why=(f"{stage0.params:,} parameters x 4 bytes: the gradients accumulate locally over the "
             f"{stage0.summary['grad_accum']} micro-steps, and the engine all-reduces them once, at the boundary "
             f"({GRADIENT_CALLER} in the comms log)."))
