"""Checkpoints: save during training, crash, resume, and read what a sharded checkpoint holds.

On the ranks (no change to the training loop, see :mod:`helpers.core.train`):

- the ``checkpoint`` probe saves with ``engine.save_checkpoint`` after every ``save_every``-th optimizer
  step into ``options["save_dir"]``, tagged ``step<k>``;
- :func:`resume` is a ``before_training`` hook: it loads ``options["load_dir"]`` (tag
  ``options["load_tag"]``, default the ``latest`` file) with ``engine.load_checkpoint`` and returns the
  step training continues from;
- ``faults={"kill_after_step": k}`` (:mod:`helpers.core.faults`) ends every rank with SIGKILL after
  step k: a crash, with nothing but the files on disk left behind.

In the notebook's process: :func:`files_per_rank` lists what each rank wrote and what is inside,
:func:`consolidate` turns a sharded checkpoint into one plain PyTorch state dict with DeepSpeed's
``zero_to_fp32``, :func:`to_universal` converts it with ``ds_to_universal`` for another number of ranks,
and :func:`crash_and_resume` runs the chapter's experiment.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from helpers.core import configs, exercises, launch, models, plots, records
from helpers.core.plan import PlannedRun, reference_of
from helpers.core.probes import Probe, RunContext
from helpers.core.environment import REPO_ROOT, quiet_deepspeed_import

#: Where the chapter's checkpoints go (under ``runs/``, which git ignores).
CHECKPOINT_DIR = REPO_ROOT / "runs" / "checkpoints"
#: What every checkpoint carries for ``ds_to_universal``: DeepSpeed reads this key of the client state
#: at stages 1-2 (an empty dict: no tensor or pipeline parallelism to describe).
UNIVERSAL_INFO = {"universal_checkpoint_info": {}}


def tag_of(step: int) -> str:
    """The tag of the checkpoint saved after ``step`` optimizer steps."""
    return f"step{step}"


# --- on the ranks ----------------------------------------------------------------------------

class Checkpoint(Probe):
    """Save a checkpoint after every ``save_every``-th optimizer step (``options``: ``save_dir``,
    ``save_every`` = 1). Every rank calls ``engine.save_checkpoint``, as DeepSpeed requires: each writes
    its own shard. Section: ``checkpoint`` (folder, tags saved, seconds each save took on rank 0).
    """

    name = "checkpoint"
    keys = ("checkpoint.tags", "checkpoint.save_s")

    @classmethod
    def check_options(cls, options: dict, steps: int = 0) -> None:
        if not options.get("save_dir"):
            raise ValueError("options['save_dir']: the checkpoint probe needs a folder to save into, "
                             "e.g. options={'save_dir': 'runs/checkpoints/mine'}")
        every = options.get("save_every", 1)
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"options['save_every']={every!r}: save after every N-th step, N a whole number >= 1")

    def start(self, ctx: RunContext) -> None:
        self.check_options(ctx.options, ctx.steps)
        self.every = int(ctx.options.get("save_every", 1))
        self.tags: list[str] = []
        self.seconds: list[float] = []

    def after_step(self, ctx: RunContext, step: int) -> None:
        if (step + 1) % self.every:
            return
        started = time.perf_counter()
        ctx.engine.save_checkpoint(ctx.options["save_dir"], tag=tag_of(step + 1), client_state=UNIVERSAL_INFO)
        self.seconds.append(time.perf_counter() - started)
        self.tags.append(tag_of(step + 1))

    def finish(self, ctx: RunContext) -> dict:
        return {"tags": self.tags, "seconds": self.seconds}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"checkpoint": {"save_dir": ctx.options["save_dir"], "tags": ranks[0]["tags"],
                               "save_s": ranks[0]["seconds"]}}


class Model16bit(Probe):
    """After optimizer step ``options["model16_after"]``, call ``engine.save_16bit_model(options["model16_dir"])``
    on every rank, as DeepSpeed requires (at stage 3 it gathers each layer's shards on rank 0, and only rank
    0 writes). Section: ``model_16bit`` (folder, step, and what the call returned on each rank: ``False``
    where it saved nothing).
    """

    name = "model_16bit"
    keys = ("model_16bit.returned", "model_16bit.after_step")

    @classmethod
    def check_options(cls, options: dict, steps: int = 0) -> None:
        if not options.get("model16_dir"):
            raise ValueError("options['model16_dir']: the model_16bit probe needs a folder to save into, "
                             "e.g. options={'model16_dir': 'runs/checkpoints/model16', 'model16_after': 3}")
        after = options.get("model16_after")
        if not isinstance(after, int) or not 1 <= after <= max(steps, 1):
            raise ValueError(f"options['model16_after']={after!r}: the optimizer step after which to save, "
                             f"a whole number in 1..{steps}")

    def start(self, ctx: RunContext) -> None:
        self.check_options(ctx.options, ctx.steps)
        self.returned = None

    def after_step(self, ctx: RunContext, step: int) -> None:
        if step + 1 == ctx.options["model16_after"]:
            self.returned = bool(ctx.engine.save_16bit_model(ctx.options["model16_dir"]))

    def finish(self, ctx: RunContext) -> dict:
        return {"returned": self.returned}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"model_16bit": {"dir": ctx.options["model16_dir"], "after_step": ctx.options["model16_after"],
                                "returned": [r["returned"] for r in ranks]}}


def save_seconds(record: records.Record) -> list[float]:
    """Seconds each ``save_checkpoint`` of a run took on rank 0 (the checkpoint probe)."""
    return record.section("checkpoint")["save_s"]


def resume(engine, run: PlannedRun) -> int:
    """``before_training`` hook: load the checkpoint ``options["load_dir"]`` (tag ``options["load_tag"]``,
    else the one its ``latest`` file names) into the freshly initialized engine, model, optimizer and
    ZeRO partitions included, and return the optimizer steps it had taken: the step to continue from.

    With ``"checkpoint": {"load_universal": true}`` in the config, DeepSpeed reads a universal
    checkpoint (:func:`to_universal`) and re-partitions it for this run's number of ranks.
    """
    options = run.options
    _check_resume_options(options)
    path, _ = engine.load_checkpoint(options["load_dir"], tag=options.get("load_tag"))
    if path is None:
        raise FileNotFoundError(f"no checkpoint loaded from {options['load_dir']} (tag {options.get('load_tag')})")
    return int(engine.global_steps)


def _check_resume_options(options: dict) -> None:
    if not options.get("load_dir"):
        raise ValueError("options['load_dir']: the resume hook needs the checkpoint folder to load, "
                         "e.g. options={'load_dir': 'runs/checkpoints/zero3', 'load_tag': 'step3'}")
    if not Path(options["load_dir"]).is_dir():
        raise ValueError(f"options['load_dir']={options['load_dir']!r}: no such folder; give the save_dir of the "
                         "run whose checkpoint to resume")


resume.check_options = _check_resume_options  # the launcher checks the options before any process starts
#: How a run names the hook (``RunSpec(before_training=RESUME)``).
RESUME = reference_of(resume)


# --- in the notebook: what is on disk ---------------------------------------------------------

#: File name -> (what it holds, which rank wrote it), for DeepSpeed 0.19's checkpoint layout.
_FILE_KINDS = (
    (re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$"), "optimizer shard"),
    (re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$"), "model shard"),
    (re.compile(r"^mp_rank_\d+_model_states\.pt$"), "model"),
)


def _tensor_bytes(obj) -> int:
    """Bytes of every tensor inside a (nested) checkpoint object, each storage counted once."""

    seen: dict[int, int] = {}

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(obj)
    return sum(seen.values())


#: Where DeepSpeed 0.19 keeps each model state inside its checkpoint files -> the course's name for it
#: (the keys of helpers.core.memory.model_states).
_STATE_KEYS = {
    ("module",): "params",  # the model's state dict (full weights at stages 0-2, in their training dtype; empty at 3)
    ("optimizer", "fp32_groups"): "master",  # stage 0 in bf16/fp16 (FP16_UnfusedOptimizer): fp32 copy of every weight
    ("optimizer", "fp32_groups_flat"): "master",  # stage 0 in fp16 (FP16_Optimizer): the same, flat
    ("optimizer",): "optimizer",  # stage 0: the optimizer's own state dict (Adam's moments; less the master above)
    ("optimizer_state_dict", "base_optimizer_state"): "optimizer",  # stages 1-2: Adam's moments of the shard
    ("optimizer_state_dict", "single_partition_of_fp32_groups"): "master",  # stages 1-2: fp32 weights of the shard
    ("optimizer_state_dict", "optimizer_state_dict"): "optimizer",  # stage 3
    ("optimizer_state_dict", "fp32_flat_groups"): "master",  # stage 3
}


def _at(state: dict, path: tuple[str, ...]):
    value = state
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _contents(state: dict) -> dict[str, int]:
    """Tensor bytes of each model state a checkpoint file holds (keys as in :data:`_STATE_KEYS`; a path's
    bytes exclude those of the longer paths listed inside it)."""
    found: dict[str, int] = {}
    for path, name in _STATE_KEYS.items():
        value = _at(state, path)
        n = _tensor_bytes(value) if value is not None else 0
        for inner in _STATE_KEYS:
            if len(inner) > len(path) and inner[:len(path)] == path and _at(state, inner) is not None:
                n -= _tensor_bytes(_at(state, inner))
        if n:
            found[name] = found.get(name, 0) + n
    return found


def _dtypes(value) -> set[str]:
    """The dtypes of the tensors inside a (nested) checkpoint object."""
    if isinstance(value, torch.Tensor):
        return {str(value.dtype).removeprefix("torch.")}
    children = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return set().union(*(_dtypes(v) for v in children)) if children else set()


def files_per_rank(folder: str | Path) -> list[dict]:
    """What a checkpoint folder (one tag) holds: per file, the rank that wrote it, its kind, its bytes
    on disk, and the tensor bytes of each model state inside it (read back with ``torch.load``)."""

    rows = []
    for path in sorted(Path(folder).glob("*.pt")):
        kind, rank = "other", 0
        for pattern, name in _FILE_KINDS:
            match = pattern.match(path.name)
            if match:
                kind, rank = name, int(match.group(1)) if match.groups() else 0
                break
        state = torch.load(path, map_location="cpu", weights_only=False)
        weights = _at(state, ("module",))
        rows.append({"file": path.name, "rank": rank, "kind": kind, "bytes": path.stat().st_size,
                     "contents": _contents(state),
                     "weights_dtype": ", ".join(sorted(_dtypes(weights))) if _tensor_bytes(weights or {}) else ""})
    return rows


def files_table(folder: str | Path) -> str:
    """One row per file of a checkpoint folder: the rank that wrote it, what it is, its bytes on disk,
    and the tensor bytes of each model state inside."""
    rows = []
    for row in files_per_rank(folder):
        inside = ", ".join(f"{key} {n:,}" for key, n in row["contents"].items()) or "(no tensor data: names and shapes)"
        rows.append([row["file"], row["rank"], row["kind"], f"{row['bytes']:,}", inside])
    return records.format_table(rows, ["file", "rank", "holds", "bytes on disk", "tensor bytes inside"])


def consolidate(checkpoint_dir: str | Path, tag: str | None = None) -> dict:
    """One fp32 PyTorch state dict from a sharded ZeRO checkpoint: DeepSpeed's ``zero_to_fp32``
    (``get_fp32_state_dict_from_zero_checkpoint``, the function behind the ``zero_to_fp32.py`` script
    DeepSpeed copies into every checkpoint folder). Runs in this process; no ranks needed."""

    quiet_deepspeed_import()
    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):  # it prints progress lines
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)


def to_universal(checkpoint_dir: str | Path, tag: str) -> str:
    """Convert checkpoint ``tag`` of ``checkpoint_dir`` into a universal checkpoint (DeepSpeed's
    ``python -m deepspeed.checkpoint.ds_to_universal``, called in this process with one worker) saved as
    tag ``<tag>_universal`` beside it; return that tag. A universal checkpoint stores each parameter
    and its optimizer states whole, so a run with another number of ranks can partition them anew."""

    quiet_deepspeed_import()
    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.checkpoint import ds_to_universal

    out_tag = f"{tag}_universal"
    output = Path(checkpoint_dir) / out_tag
    shutil.rmtree(output, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(Path(checkpoint_dir) / tag), output_folder=str(output),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints every step
        ds_to_universal.main(args)
    return out_tag


def loss_of_state_dict(state_dict: dict, model: str, step: int, world_size: int, micro_batch: int,
                       grad_accum: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> float:
    """The loss a run records for optimizer step ``step`` (0-based), computed by the plain PyTorch model
    (no DeepSpeed) in ``dtype`` with ``state_dict`` loaded: the mean of the micro-batch losses of every rank
    on the samples that step trains on (:func:`helpers.core.models.sample_indices`), floating inputs cast to
    ``dtype`` as the course's runs cast them."""
    net = models.build(model, seed).to(dtype)
    net.load_state_dict(state_dict, strict=True)  # every key, every shape: the unwrapped model itself
    losses = []
    with torch.no_grad():
        for micro in range(grad_accum):
            for rank in range(world_size):
                indices = models.sample_indices(step, micro, rank, world_size, micro_batch, grad_accum)
                batch = models.make_batch(model, indices, seed).to("cpu", dtype)
                losses.append(models.loss_of(net, model, batch).item())
    return statistics.fmean(losses)


# --- the chapter's experiment -------------------------------------------------------------------

@dataclasses.dataclass
class CrashAndResume:
    """Records of a crash-and-resume experiment (see :func:`crash_and_resume`)."""

    uninterrupted: dict[int, records.Record]  # stage -> the run that trained every step
    crashed: launch.RunFailed  # the launch that was killed
    crashed_out: Path  # the killed run's folder (its checkpoints are in folder / "zero3-crash")
    resumed: dict[int, records.Record]  # stage -> the run resumed in fresh processes
    folder: Path
    steps: int
    crash_after: int
    # stage -> a bf16 run of the first launch that saved a checkpoint after step crash_after (stage 3: with
    # stage3_gather_16bit_weights_on_model_save, also save_16bit_model after that step)
    bf16: dict[int, records.Record] = dataclasses.field(default_factory=dict)
    # stage3_gather_16bit_weights_on_model_save -> the bf16 ZeRO-3 run that called save_16bit_model with it
    model16: dict[bool, records.Record] = dataclasses.field(default_factory=dict)

    def checkpoint_dir(self, stage: int) -> Path:
        """Where the checkpoints each stage resumed from are."""
        return self.folder / ("zero3-crash" if stage == 3 else f"zero{stage}")

    def bf16_checkpoint_dir(self, stage: int) -> Path:
        """Where the bf16 run of ``stage`` saved its checkpoint."""
        return self.folder / f"zero{stage}-bf16"

    def model16_dir(self, gather: bool) -> Path:
        """Where the bf16 ZeRO-3 run with or without the gather flag asked ``save_16bit_model`` to write."""
        return self.folder / f"model16-{'gather' if gather else 'no-gather'}"


#: What the bf16 runs of :func:`crash_and_resume` add to ``ds_configs/zero<N>.json``.
BF16 = {"bf16": {"enabled": True}}
#: The ZeRO-3 switch that makes ``save_16bit_model`` gather the shards (DeepSpeed's default: false).
GATHER_KEY = "stage3_gather_16bit_weights_on_model_save"


def crash_and_resume(stages: Sequence[int] = (0, 1, 2, 3), model: str = "mlp", steps: int = 6,
                     crash_after: int = 3, folder: Path = CHECKPOINT_DIR, world_size: int | None = None,
                     progress: bool = True, bf16_stages: Sequence[int] = (0, 1, 2, 3)) -> CrashAndResume:
    """The chapter's experiment, in two launches of the same ranks:

    1. every stage trains ``steps`` steps uninterrupted, saving a checkpoint after each; each of
       ``bf16_stages`` trains the same in bf16, saving after step ``crash_after``; at stage 3 twice, calling
       ``save_16bit_model`` after that step with and without :data:`GATHER_KEY`; then a ZeRO-3 run, saving
       after every step, is killed (SIGKILL on every rank) after ``crash_after`` steps. The launch dies with
       it: nothing but the files on disk survive.
    2. fresh processes resume each stage from its checkpoint of step ``crash_after`` (ZeRO-3 from the
       killed run's last one) and train to ``steps``.

    Returns the records; the losses of steps ``crash_after+1..steps`` can then be compared.
    """

    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    probes = ("timing", "model_states", Checkpoint)
    first = {f"zero{s}": launch.RunSpec(f"zero{s}", model=model, steps=steps, probes=probes, out=folder / f"run-zero{s}",
                                         options={"save_dir": str(folder / f"zero{s}")}) for s in stages}
    for s in bf16_stages:
        saving = {"save_dir": str(folder / f"zero{s}-bf16"), "save_every": crash_after}
        overrides, run_probes = dict(BF16), ("timing", Checkpoint)
        if s == 3:
            saving |= {"model16_dir": str(folder / "model16-gather"), "model16_after": crash_after}
            overrides, run_probes = {**BF16, "zero_optimization": {GATHER_KEY: True}}, run_probes + (Model16bit,)
        first[f"zero{s}-bf16"] = launch.RunSpec(f"zero{s}", model=model, steps=steps, probes=run_probes,
                                                out=folder / f"run-zero{s}-bf16", overrides=overrides, options=saving)
    if 3 in bf16_stages:
        first["zero3-bf16-no-gather"] = launch.RunSpec(
            "zero3", model=model, steps=steps, probes=("timing", Model16bit), out=folder / "run-zero3-bf16-no-gather",
            overrides={**BF16, "zero_optimization": {GATHER_KEY: False}},
            options={"model16_dir": str(folder / "model16-no-gather"), "model16_after": crash_after})
    first["zero3-crash"] = launch.RunSpec("zero3", model=model, steps=steps, probes=probes,
                                          out=folder / "run-zero3-crash", faults={"kill_after_step": crash_after},
                                          options={"save_dir": str(folder / "zero3-crash")})
    try:
        launch.sweep(first, name="checkpoints-crash", world_size=world_size, progress=progress)
    except launch.RunFailed as failure:
        crashed = failure
    else:
        raise AssertionError("the launch with a kill_after_step fault was expected to die")
    uninterrupted = {s: records.load(folder / f"run-zero{s}") for s in stages}
    result = CrashAndResume(uninterrupted, crashed, folder / "run-zero3-crash", {}, folder, steps, crash_after,
                            bf16={s: records.load(folder / f"run-zero{s}-bf16") for s in bf16_stages})
    if 3 in bf16_stages:
        result.model16 = {True: result.bf16[3], False: records.load(folder / "run-zero3-bf16-no-gather")}
    second = {f"zero{s}-resumed": launch.RunSpec(
        f"zero{s}", model=model, steps=steps, probes=("timing", "model_states"), out=folder / f"run-zero{s}-resumed",
        before_training=RESUME,
        options={"load_dir": str(result.checkpoint_dir(s)), "load_tag": tag_of(crash_after)}) for s in stages}
    resumed = launch.sweep(second, name="checkpoints-resume", world_size=world_size, progress=progress)
    result.resumed = {s: resumed[f"zero{s}-resumed"] for s in stages}
    return result


def crash_report(failure) -> str:
    """What the killed launch left in its log: DeepSpeed's launcher naming the rank that died and its
    return code (-9: SIGKILL), with the timestamps sanitized away."""
    lines = [line.strip() for line in failure.log_tail.splitlines() if "return code" in line or "Killing" in line]
    lines = [re.sub(r"^\[[^\]]*\]\s*", "", line) for line in lines]
    lines = [re.sub(r"\[.*?helpers\.core\.train.*?\]", "[... helpers.core.train ...]", line) for line in lines]
    lines = [re.sub(r"subprocess \d+", "subprocess PID", line) for line in lines]
    return "\n".join(dict.fromkeys(lines)) or failure.log_tail


def resume_table(result: CrashAndResume) -> str:
    """Per stage: the steps compared and whether the resumed run's losses equal the uninterrupted run's
    bit for bit (``identical``), else within which tolerance (:func:`helpers.core.records.loss_agreement`)."""
    rows = []
    for stage, resumed in result.resumed.items():
        whole = result.uninterrupted[stage].losses[result.crash_after:]
        same = "identical" if whole == resumed.losses else records.loss_agreement(whole, resumed.losses)
        rows.append([f"ZeRO-{stage}", f"{result.crash_after + 1}-{result.steps}",
                     f"from {tag_of(result.crash_after)}", resumed["first_step"], same])
    return records.format_table(rows, ["stage", "steps compared", "resumed", "first step (0-based)",
                                       "resumed vs uninterrupted losses"])


def losses_side_by_side(result: CrashAndResume, digits: int = 6) -> str:
    """The uninterrupted and resumed losses themselves (digits depend on the processor: an ignored cell)."""
    rows = []
    for stage, resumed in result.resumed.items():
        whole = result.uninterrupted[stage].losses
        rows.append([f"ZeRO-{stage}", " ".join(f"{x:.{digits}f}" for x in whole),
                     " " * (digits + 3) * result.crash_after + " ".join(f"{x:.{digits}f}" for x in resumed.losses)])
    return records.format_table(rows, ["stage", "uninterrupted losses", "resumed losses"])


def universal_resume(result: CrashAndResume, stages: Sequence[int], world_size: int,
                     progress: bool = True) -> dict[int, records.Record]:
    """Resume each of ``stages`` from the crash experiment's step-``crash_after`` checkpoint on ``world_size``
    ranks (one launch) through a universal checkpoint: convert it (:func:`to_universal`), then train with
    ``"checkpoint": {"load_universal": true}``. The global batch stays the same: gradient accumulation
    grows as the ranks shrink (micro-batch x accumulation x ranks is unchanged)."""

    specs = {}
    for stage in stages:
        source = result.uninterrupted[stage].summary
        total = source["grad_accum"] * source["world_size"]
        if total % world_size:
            raise ValueError(f"world_size={world_size}: {total} micro-batches per step cannot be split evenly; "
                             f"use a divisor of {total}")
        directory = result.checkpoint_dir(stage)
        universal_tag = to_universal(directory, tag_of(result.crash_after))
        specs[f"zero{stage}-universal-{world_size}r"] = launch.RunSpec(
            f"zero{stage}", model=source["model"]["name"], steps=result.steps,
            out=result.folder / f"run-zero{stage}-universal",
            overrides={"gradient_accumulation_steps": total // world_size, "checkpoint": {"load_universal": True}},
            probes=("timing", "model_states"), before_training=RESUME,
            options={"load_dir": str(directory), "load_tag": universal_tag})
    runs = launch.sweep(specs, name="checkpoints-universal", world_size=world_size, progress=progress)
    return {stage: runs[f"zero{stage}-universal-{world_size}r"] for stage in stages}


def universal_table(result: CrashAndResume, universal: Mapping[int, records.Record]) -> str:
    """Per stage: saved on N ranks, resumed on M through a universal checkpoint; do the losses agree with
    the uninterrupted run's (within fp32's tolerance: M ranks add the micro-batches in another order)?"""
    rows = []
    for stage, run in universal.items():
        whole = result.uninterrupted[stage]
        rows.append([f"ZeRO-{stage}", whole["world_size"], run["world_size"],
                     f"{run['micro_batch']} x {run['grad_accum']} x {run['world_size']} = {run['train_batch']}",
                     f"{result.crash_after + 1}-{result.steps}",
                     records.loss_agreement(whole.losses[result.crash_after:], run.losses)])
    return records.format_table(rows, ["stage", "saved on ranks", "resumed on ranks", "micro x accum x ranks",
                                       "steps", "losses vs uninterrupted"])


def saved_by_rank(folder: str | Path, world_size: int) -> dict[int, dict[str, int]]:
    """Per rank: files and bytes it wrote into one checkpoint folder, and the tensor bytes of each
    model state among them (``params``, ``optimizer``, ``master``)."""
    found = {rank: {"files": 0, "bytes": 0, "params": 0, "optimizer": 0, "master": 0} for rank in range(world_size)}
    for row in files_per_rank(folder):
        mine = found[row["rank"]]
        mine["files"] += 1
        mine["bytes"] += row["bytes"]
        for key, n in row["contents"].items():
            mine[key] += n
    return found


def stages_table(result: CrashAndResume) -> str:
    """Per stage and rank: what it wrote for one checkpoint (files, bytes, and the tensor bytes of
    weights, Adam's states and the fp32 master copy inside), beside the model states it held while
    training (the model_states probe of the uninterrupted run). Gradients are never saved."""
    rows = []
    for stage in result.resumed:
        record = result.uninterrupted[stage]
        held = [record.memory.model_states(rank).as_dict() for rank in range(record.world_size)]
        saved = saved_by_rank(result.checkpoint_dir(stage) / tag_of(result.crash_after), len(held))
        for rank, states in enumerate(held):
            disk = saved[rank]
            if all(disk[k] == states[k] for k in ("optimizer", "master")):
                same = "yes: its own shard"
            elif stage == 0 and rank > 0 and not disk["bytes"]:
                same = "none: a replica of rank 0's"
            else:
                same = "differs"

            rows.append([f"ZeRO-{stage}", rank, disk["files"], f"{disk['bytes']:,}", f"{disk['params']:,}",
                         f"{disk['optimizer']:,}", f"{disk['master']:,}",
                         f"{states['params']:,} / {states['optimizer']:,} / {states['master']:,}",
                         same])
    return records.format_table(rows, ["stage", "rank", "files", "bytes on disk", "weights saved", "Adam saved",
                                       "master saved", "held: params / Adam / master",
                                       "Adam+master on disk = held?"])


def on_disk_table(result: CrashAndResume) -> str:
    """What each stage's runs of the crashed launch left: the checkpoint tags in its folder, the tag its
    ``latest`` file names, and whether the run wrote its record (a killed run never does)."""
    rows = []
    folders = [result.folder / f"zero{s}" for s in result.resumed] + [result.folder / "zero3-crash"]
    for directory in folders:
        run_dir = result.folder / f"run-{directory.name}"
        tags = sorted((p.name for p in directory.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                      key=lambda t: int(t[4:]))
        latest = (directory / "latest").read_text().strip() if (directory / "latest").exists() else "-"
        rows.append([directory.name, " ".join(tags), latest,
                     "yes" if (run_dir / "summary.json").exists() else "no (killed)"])
    return records.format_table(rows, ["run", "checkpoints on disk", "latest", "record written"])


def consolidation_table(result: CrashAndResume, stages: Sequence[int] = (1, 2, 3)) -> str:
    """Per stage: ``zero_to_fp32`` on the step-``crash_after`` checkpoint (:func:`consolidate`) gives a plain
    state dict; it loads strictly into the unwrapped model (``models.build``), whose loss on the next step's
    samples is compared with the loss the run recorded for that step (:func:`loss_of_state_dict`)."""

    rows = []
    for stage in stages:
        run = result.uninterrupted[stage]
        state = consolidate(result.checkpoint_dir(stage), tag_of(result.crash_after))
        plain = models.count_parameters(models.build(run.model_name, run.summary["seed"]))
        loss = loss_of_state_dict(state, run.model_name, result.crash_after, run.world_size,
                                  run.micro_batch, run.grad_accum, run.summary["seed"])
        rows.append([f"ZeRO-{stage}", len(state), f"{sum(t.numel() for t in state.values()):,}", f"{plain:,}",
                     ", ".join(sorted({str(t.dtype).removeprefix('torch.') for t in state.values()})),
                     records.loss_agreement([loss], [run.losses[result.crash_after]])])
    return records.format_table(rows, ["checkpoint", "tensors", "elements", "model's parameters", "dtype",
                                       f"plain model's step-{result.crash_after + 1} loss vs the run's"])


def _who(per_rank: Mapping[int, int]) -> str:
    """Bytes per rank in words: "2,105,344 on rank 0", "1,052,672 on each rank", or "none"."""
    held = {rank: n for rank, n in per_rank.items() if n}
    if not held:
        return "none"
    if len(held) == len(per_rank) and len(set(held.values())) == 1 and len(held) > 1:
        return f"{next(iter(held.values())):,} on each rank"
    return "; ".join(f"{n:,} on rank {rank}" for rank, n in held.items())


def precision_table(result: CrashAndResume) -> str:
    """Per stage, trained in fp32 and in bf16: the optimizer class DeepSpeed built (the run's record) and what
    one checkpoint (step ``crash_after``) holds, read back from its files: the weights in the model file(s)
    (dtype, bytes, who wrote them), the fp32 master copy, Adam's moments, and the checkpoint's bytes on disk."""
    rows = []
    runs = [(s, "fp32", result.checkpoint_dir(s), result.uninterrupted[s]) for s in result.resumed]
    runs += [(s, "bf16", result.bf16_checkpoint_dir(s), run) for s, run in result.bf16.items()]
    for stage, precision, directory, run in sorted(runs, key=lambda run: (run[0], run[1] != "fp32")):
        files = files_per_rank(directory / tag_of(result.crash_after))
        ranks = sorted({f["rank"] for f in files} | {0})
        def per_rank(key: str) -> dict[int, int]:
            return {r: sum(f["contents"].get(key, 0) for f in files if f["rank"] == r) for r in ranks}
        dtypes = sorted({f["weights_dtype"] for f in files if f["weights_dtype"]})
        weights = _who(per_rank("params"))
        rows.append([f"ZeRO-{stage}", precision, run.summary["optimizer"],
                     f"{', '.join(dtypes)}: {weights}" if dtypes else "none (names and shapes only)",
                     _who(per_rank("master")), _who(per_rank("optimizer")),
                     f"{sum(f['bytes'] for f in files):,}"])
    return records.format_table(rows, ["stage", "trained in", "optimizer", "weights in the model file(s)",
                                       "fp32 master copy", "Adam's moments", "checkpoint on disk, all ranks"])


def _model16_file(result: CrashAndResume, gather: bool) -> Path:
    return result.model16_dir(gather) / "pytorch_model.bin"


def model16_table(result: CrashAndResume) -> str:
    """The two bf16 ZeRO-3 runs that called ``save_16bit_model`` after step ``crash_after`` on every rank,
    without and with :data:`GATHER_KEY`: what the call returned on each rank, whether DeepSpeed's message about
    it (``Did not save the model ...`` / ``Saving model weights to ...``, logged at INFO) reached the launch's
    log, and what the folder holds."""
    rows = []
    for gather, run in sorted(result.model16.items()):
        returned = run.section("model_16bit")["returned"]
        log = Path(run["launch"]["plan"]).parent / "launch.log"
        message = "Saving model weights to" if gather else "Did not save the model"
        logged = "yes" if log.exists() and message in log.read_text(errors="replace") else "no"
        folder = result.model16_dir(gather)
        files = sorted(p for p in folder.glob("*") if p.is_file()) if folder.is_dir() else []
        if files:
            state = torch.load(files[0], map_location="cpu", weights_only=False)
            shown = [", ".join(p.name for p in files), f"{sum(p.stat().st_size for p in files):,}", len(state),
                     ", ".join(sorted(_dtypes(state)))]
        else:
            shown = ["nothing (no folder)" if not folder.exists() else "nothing", "-", "-", "-"]
        rows.append([str(gather).lower(), " / ".join(str(r) for r in returned), f"{message!r}: {logged}", *shown])
    return records.format_table(rows, [GATHER_KEY, "returned on ranks 0 / 1", "its message in the launch log",
                                       "files written", "bytes on disk", "tensors", "dtype"])


def model16_sizes(result: CrashAndResume) -> str:
    """The 16-bit model file beside the same step's sharded checkpoint (every rank's files) and
    ``zero_to_fp32``'s state dict of it (tensor bytes)."""
    directory, tag = result.bf16_checkpoint_dir(3), tag_of(result.crash_after)
    model16 = _model16_file(result, True).stat().st_size
    sharded = sum(f["bytes"] for f in files_per_rank(directory / tag))
    fp32 = _tensor_bytes(consolidate(directory, tag))
    rows = [["save_16bit_model: pytorch_model.bin (bf16 weights)", "file on disk", f"{model16:,}", "1.00"],
            ["zero_to_fp32 of the same step (fp32 weights)", "tensors", f"{fp32:,}", f"{fp32 / model16:.2f}"],
            [f"the sharded checkpoint {tag} (weights, master, Adam)", "files on disk, all ranks", f"{sharded:,}",
             f"{sharded / model16:.2f}"]]
    return records.format_table(rows, ["what", "counted as", "bytes", "vs the 16-bit file"])


def model16_check(result: CrashAndResume) -> str:
    """Two checks of the 16-bit file against what does not come from it: its tensors against ``zero_to_fp32``'s
    fp32 weights of the same step (read from the optimizer shards) rounded to bf16, and the loss of the next
    step computed by the plain model in bf16 (no DeepSpeed), loaded with the file alone, against the loss the
    run recorded for that step."""
    run = result.model16[True]
    state = torch.load(_model16_file(result, True), map_location="cpu", weights_only=True)
    master = consolidate(result.bf16_checkpoint_dir(3), tag_of(result.crash_after))
    same = sum(torch.equal(state[k], master[k].to(state[k].dtype)) for k in state if k in master)
    loss = loss_of_state_dict(state, run.model_name, result.crash_after, run.world_size, run.micro_batch,
                              run.grad_accum, run.summary["seed"], dtype=torch.bfloat16)
    rows = [["its tensors vs zero_to_fp32's fp32 weights rounded to bf16",
             f"identical, {same} of {len(state)} tensors" if same == len(state) == len(master)
             else f"{same} of {len(state)} identical ({len(master)} in zero_to_fp32's)"],
            [f"plain model in bf16, loaded from it alone: step-{result.crash_after + 1} loss vs the run's",
             records.loss_agreement([loss], [run.losses[result.crash_after]], "bf16")]]
    return records.format_table(rows, ["check", "result"])


def universal_layout(directory: str | Path, tag: str, parameter: str) -> str:
    """The files of one parameter in a universal checkpoint: its fp32 weights and each optimizer state,
    whole (not partitioned), with their shapes."""

    folder = Path(directory) / tag / "zero" / parameter
    rows = []
    for path in sorted(folder.glob("*.pt")):
        value = torch.load(path, map_location="cpu", weights_only=False)
        tensor = value.get("param") if isinstance(value, dict) else value
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else "-"
        rows.append([f"{tag}/zero/{parameter}/{path.name}", str(shape)])
    return records.format_table(rows, ["file", "shape"])


# --- figures ----------------------------------------------------------------------------------------

def resumed_losses(uninterrupted: Mapping[str, Sequence[float]], resumed: Mapping[str, Sequence[float]],
                   first_step: int, title: str = "Uninterrupted and resumed runs"):
    """Each uninterrupted run's losses (lines) with its resumed run's (markers, from step first_step + 1)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (name, losses) in enumerate(uninterrupted.items()):
        line, = ax.plot(range(1, len(losses) + 1), losses, "-", alpha=0.6, label=f"{name} uninterrupted")
        again = resumed[name]
        ax.plot(range(first_step + 1, first_step + len(again) + 1), again, "o", color=line.get_color(),
                markersize=9 - 2 * i, markerfacecolor="none", label=f"{name} resumed")
    ax.axvline(first_step + 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="optimizer step", ylabel="loss", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- exercises ---------------------------------------------------------------------------------------

def exercise_zero2_bytes_per_rank(answer: Any, result: CrashAndResume, stage: int = 2) -> exercises.Verdict:
    """Exercise: predict the bytes on disk each rank writes for one checkpoint of the ``stage`` run (fp32,
    AdamW); the answer is what the chapter's run wrote (:func:`saved_by_rank`), within 2% for each rank."""
    record = result.uninterrupted[stage]
    folder = result.checkpoint_dir(stage) / tag_of(result.crash_after)
    saved = saved_by_rank(folder, record.world_size)
    params = record.summary["model"]["params"]
    files = {rank: [row["file"] for row in files_per_rank(folder) if row["rank"] == rank] for rank in saved}
    task = (f"Predict the bytes on disk each of the {record.world_size} ranks writes for one ZeRO-{stage} "
            f"checkpoint of this {params:,}-parameter model (fp32 weights, AdamW), as {{rank: bytes}}.")
    hint = ("which rank writes the weights, and what does every rank write of Adam's two moments and of the "
            "fp32 master copy at this stage? 4 bytes a number; the files add a little of their own.")
    if answer is exercises.BLANK:
        return exercises.blank(f"ZeRO-{stage} checkpoint", task, hint)

    def test(guess: Any) -> tuple[bool, str]:
        if not isinstance(guess, Mapping) or set(guess) != set(saved):
            return False, f"write a dict with one entry per rank: {{{', '.join(f'{r}: ...' for r in saved)}}}."
        off = {rank: guess[rank] / saved[rank]["bytes"] - 1 for rank in saved}
        wrote = "; ".join(f"rank {rank}: {saved[rank]['bytes']:,} bytes in {', '.join(files[rank])}"
                          for rank in saved)
        if all(abs(x) <= 0.02 for x in off.values()):
            return True, (f"The run wrote {wrote}. Rank 0 alone writes the weights "
                          f"({saved[0]['params']:,} bytes, fp32); every rank writes its own shard of Adam's moments "
                          f"({saved[0]['optimizer']:,} bytes) and of the fp32 master copy ({saved[0]['master']:,}): "
                          "the states it held in memory while training. Gradients are never saved.")
        wrong = ", ".join(f"rank {r} {x:+.0%}" for r, x in off.items() if abs(x) > 0.02)
        return False, f"off by more than 2%: {wrong}."
    return exercises.satisfies(f"ZeRO-{stage} checkpoint", answer, test, task=task, hint=hint)


def exercise_save_16bit(answer: Any, call: Any, result: CrashAndResume) -> exercises.Verdict:
    """Exercise: write the ``zero_optimization`` block of a ZeRO-3 run (``answer``) and the line every rank
    runs (``call``, a string) so that rank 0 writes the whole weights in 16 bits. The block is read by DeepSpeed's
    config class, the call is checked against ``DeepSpeedEngine``'s methods, and the outcome for the block's
    :data:`GATHER_KEY` is what the chapter's two bf16 ZeRO-3 runs measured (``result.model16``)."""
    import ast  # the learner's line is parsed, never run

    task = ("Write the zero_optimization block of a ZeRO-3 run (answer) and, as a string, the line every rank "
            "runs (call) so that rank 0 writes the whole model's weights in 16 bits into save_dir.")
    hint = "the section above names the engine's method and the one ZeRO-3 switch it depends on."
    if answer is exercises.BLANK or call is exercises.BLANK:
        return exercises.blank("save_16bit_model", task, hint)

    def test(block: Any) -> tuple[bool, str]:
        from deepspeed.runtime.engine import DeepSpeedEngine  # deferred: DeepSpeed imports slowly

        try:
            expression = ast.parse(str(call).strip(), mode="eval").body
        except SyntaxError as error:
            return False, f"call is not a Python expression: {error.msg}."
        if not (isinstance(expression, ast.Call) and isinstance(expression.func, ast.Attribute)
                and isinstance(expression.func.value, ast.Name) and expression.func.value.id == "engine"):
            return False, "call must call a method of the engine: engine.<method>(...)."
        method = expression.func.attr
        if not hasattr(DeepSpeedEngine, method):
            return False, f"DeepSpeedEngine has no method {method!r}."
        if method != "save_16bit_model":
            return False, (f"engine.{method} is a DeepSpeedEngine method, but not the one that writes the weights "
                           "alone: save_checkpoint writes the sharded checkpoint (optimizer states included).")
        if not expression.args and not expression.keywords:
            return False, "engine.save_16bit_model needs the folder to write into (save_dir)."
        try:
            zero = configs.zero_section(block)
        except ValueError as refused:
            return False, f"{refused}."
        if zero.stage != 3:
            return False, f"stage {int(zero.stage)}: the task is a ZeRO-3 run."
        gather = bool(zero.gather_16bit_weights_on_model_save)  # the field behind GATHER_KEY
        run = result.model16[gather]
        returned = run.section("model_16bit")["returned"]
        written = _model16_file(result, gather)
        if not gather:
            return False, (f"with {GATHER_KEY} false (DeepSpeed's default) the chapter's run returned "
                           f"{' / '.join(map(str, returned))} on ranks 0 / 1 and wrote nothing: no rank holds the "
                           "whole weights at stage 3, and DeepSpeed only gathers them with the switch on.")
        return True, (f"engine.save_16bit_model(...) on every rank with {GATHER_KEY} true: the chapter's run "
                      f"returned {' / '.join(map(str, returned))} on ranks 0 / 1 and rank 0 wrote "
                      f"{written.name}, {written.stat().st_size:,} bytes, the weights gathered layer by layer. "
                      "Call it on every rank: each must hand over its shards.")
    return exercises.satisfies("save_16bit_model", answer, test, task=task, hint=hint)


def exercise_universal_config(answer: Any, result: CrashAndResume, world_size: int = 1,
                              stage: int = 3) -> exercises.Verdict:
    """Exercise: write the config changes that resume the ``stage`` run (saved on its ranks) on ``world_size``
    ranks from a universal checkpoint with the same global batch. DeepSpeed's config parser reads the merged
    config for ``world_size`` ranks; the global batch is compared with the saved run's."""
    saved = result.uninterrupted[stage]
    base = saved.summary["config"]
    micro, accum = base["train_micro_batch_size_per_gpu"], base.get("gradient_accumulation_steps", 1)
    global_batch = micro * accum * saved.world_size
    task = (f"Write the config keys that change to resume the ZeRO-{stage} run, saved on {saved.world_size} "
            f"ranks with micro-batch {micro} x accumulation {accum}, on {world_size} rank(s) from a universal "
            "checkpoint, keeping the global batch.")
    hint = ("the global batch is micro-batch x accumulation x ranks; the section above names the key that makes "
            "load_checkpoint read a universal checkpoint (a block of its own).")

    def test(changes: Any) -> tuple[bool, str]:
        if not isinstance(changes, dict):
            return False, f"{type(changes).__name__} is not a config: write a dict of the keys that change."
        config = configs.merged(base, changes)
        error = configs.deepspeed_parse(config, world_size)
        if error is not None:
            return False, f"DeepSpeed refuses it on {world_size} rank(s): {str(error).splitlines()[0]}."
        new_micro = config.get("train_micro_batch_size_per_gpu", micro)
        new_accum = config.get("gradient_accumulation_steps", 1)
        batch = config.get("train_batch_size") or new_micro * new_accum * world_size
        if batch != global_batch:
            return False, (f"global batch {batch} against the saved run's {micro} x {accum} x {saved.world_size} = "
                           f"{global_batch}: other samples per step, so not the same training.")
        if not config.get("checkpoint", {}).get("load_universal"):
            return False, ("the batch is right, but without \"checkpoint\": {\"load_universal\": true} "
                           "load_checkpoint reads the folder as a sharded checkpoint of this many ranks.")
        return True, (f"{new_micro} x {new_accum} x {world_size} = {global_batch}, the saved run's global batch, and "
                      "load_universal on: the chapter's runs below resume this way and match the uninterrupted "
                      "losses.")
    return exercises.satisfies("universal resume", answer, test, task=task, hint=hint)
