"""Checkpoints (chapter 14): read what the chapter's script saved, resumed and refused.

The chapter's script (``runs/14/train_checkpoint.py``, written by the notebook) calls DeepSpeed itself:
``engine.save_checkpoint`` after its steps, SIGKILL on every rank of a ZeRO-3 run, ``engine.load_checkpoint``
in fresh processes, ``engine.save_16bit_model``, and a load of the multi-rank checkpoints on 1 rank. This module
reads what it left: the records and printed lines (:func:`load_runs`, :func:`load_one_rank`), the checkpoint
files (:func:`files_per_rank`), the tables and figure of the chapter, and its exercises' checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import statistics
from pathlib import Path
from typing import Any, Mapping

import torch

from helpers.core import ds, exercises, launch, models, plots, records

#: The ZeRO stages the chapter's script trains, saves and resumes.
STAGES = (0, 1, 2, 3)
#: The ZeRO-3 switch that makes ``save_16bit_model`` gather the shards (DeepSpeed's default: false).
GATHER_KEY = "stage3_gather_16bit_weights_on_model_save"
#: The stages the script also trains in bf16 (stage 3: the run with the gather switch).
BF16_STAGES = (0, 2)
#: What DeepSpeed answers ``load_checkpoint`` with, per stage, on 1 rank, for a multi-rank checkpoint as saved.
OUTCOMES = ("loads", "refused")


def tag_of(step: int) -> str:
    """The tag the chapter's script saves the checkpoint of ``step`` optimizer steps under."""
    return f"step{step}"


def printed(output: str, name: str) -> list[str]:
    """What the chapter's script printed about run ``name`` (its lines ``[name] ...``), prefix removed."""
    prefix = f"[{name}] "
    return [line.split(prefix, 1)[1].strip() for line in output.splitlines() if prefix in line]


# --- the records of the chapter's launches -------------------------------------------------------

@dataclasses.dataclass
class ChapterRuns:
    """The records of the chapter's first two launches (see :func:`load_runs`)."""

    folder: Path  # the script's --out: a record per run, and checkpoints/<run>/<tag>
    uninterrupted: dict[int, records.Record]  # stage -> trained every step, saving after each
    resumed: dict[int, records.Record]  # stage -> resumed from the step-crash_after checkpoint, fresh processes
    bf16: dict[int, records.Record]  # stage -> trained in bf16, saving after step crash_after (3: with the gather switch)
    model16: dict[bool, records.Record]  # the gather switch -> the bf16 ZeRO-3 run that called save_16bit_model
    model16_returned: dict[bool, list[bool]]  # the gather switch -> what save_16bit_model returned, rank by rank

    @property
    def steps(self) -> int:
        """Optimizer steps of an uninterrupted run."""
        return len(self.uninterrupted[STAGES[0]].losses)

    @property
    def crash_after(self) -> int:
        """The step whose checkpoint the resumed runs loaded (the killed run's last one)."""
        return self.steps - len(self.resumed[STAGES[0]].losses)

    def checkpoint_dir(self, stage: int) -> Path:
        """Where the checkpoints each stage resumed from are (ZeRO-3: the killed run's)."""
        return self.folder / "checkpoints" / ("zero3-killed" if stage == 3 else f"zero{stage}")

    def bf16_checkpoint_dir(self, stage: int) -> Path:
        """Where the bf16 run of ``stage`` saved its checkpoint."""
        return self.folder / "checkpoints" / (f"zero{stage}-bf16" if stage < 3 else "zero3-bf16-gather-true")

    def model16_dir(self, gather: bool) -> Path:
        """The folder the bf16 ZeRO-3 run with or without the gather switch gave ``save_16bit_model``."""
        return self.folder / "checkpoints" / f"zero3-bf16-gather-{str(gather).lower()}-16bit"


def _record(folder: Path, name: str) -> records.Record:
    if not (folder / name / "summary.json").is_file():
        raise FileNotFoundError(f"no record of run {name!r} in {folder}: run the chapter's launch cells above "
                                "(each launch writes its runs' records)")
    return records.load(folder / name)


def _returned(output: str, name: str) -> list[bool]:
    """What ``save_16bit_model`` returned on each rank, as run ``name`` printed it (searched in the whole
    output: the ranks print at the same moment, and one rank's line can end up inside another's)."""
    pattern = re.escape(f"[{name}] ") + r"rank (\d+): save_16bit_model returned (True|False)"
    found = {int(rank): value == "True" for rank, value in re.findall(pattern, output)}
    return [found[rank] for rank in sorted(found)]


def load_runs(folder: str | Path, output: str) -> ChapterRuns:
    """The records of the first two launches of the chapter's script (``--out folder``) and what its second
    launch printed (``output``, returned by ``launch.run_script``): the runs named as the script names them."""
    folder = Path(folder)
    runs = ChapterRuns(
        folder=folder,
        uninterrupted={s: _record(folder, f"zero{s}") for s in STAGES},
        resumed={s: _record(folder, f"zero{s}-resumed") for s in STAGES},
        bf16={**{s: _record(folder, f"zero{s}-bf16") for s in BF16_STAGES},
              3: _record(folder, "zero3-bf16-gather-true")},
        model16={g: _record(folder, f"zero3-bf16-gather-{str(g).lower()}") for g in (False, True)},
        model16_returned={g: _returned(output, f"zero3-bf16-gather-{str(g).lower()}") for g in (False, True)},
    )
    for gather, values in runs.model16_returned.items():
        name, ranks = runs.model16[gather].name, runs.model16[gather].world_size
        if len(values) != ranks:
            raise ValueError(f"the output holds what save_16bit_model returned on {len(values)} of {ranks} ranks "
                             f"for run {name}: pass what launch.run_script returned for the resume phase")
    return runs


def load_one_rank(folder: str | Path, output: str) -> tuple[dict[int, records.Record | str], dict[int, records.Record]]:
    """The third launch (1 rank): per stage, the record of the run that loaded the multi-rank checkpoint as saved,
    or DeepSpeed's refusal as the script printed it; and per stage, the run resumed from a universal checkpoint."""
    folder = Path(folder)
    as_saved: dict[int, records.Record | str] = {}
    for stage in STAGES:
        refused = [line.split(":", 1)[1].strip() for line in printed(output, f"zero{stage}-on-1-rank")
                   if line.startswith("load_checkpoint refused:")]
        as_saved[stage] = refused[0] if refused else _record(folder, f"zero{stage}-on-1-rank")
    universal = {s: _record(folder, f"zero{s}-universal") for s in STAGES
                 if (folder / f"zero{s}-universal" / "summary.json").is_file()}
    return as_saved, universal


def crash_report(failure: launch.RunFailed) -> str:
    """What the killed launch left in its output: DeepSpeed's launcher naming the rank that died and its
    return code (-9: SIGKILL), process ids and timestamps sanitized away."""
    lines = [line.strip() for line in failure.log_tail.splitlines() if "return code" in line or "Killing" in line]
    lines = [re.sub(r"^\[[^\]]*\]\s*", "", line) for line in lines]
    lines = [re.sub(r"\[['\"][^\]]*train_checkpoint\.py[^\]]*\]", "[... train_checkpoint.py ...]", line)
             for line in lines]
    lines = [re.sub(r"subprocess \d+", "subprocess PID", line) for line in lines]
    return "\n".join(dict.fromkeys(lines)) or failure.log_tail


def on_disk_table(folder: str | Path) -> str:
    """What the first launch left: per run of it, the checkpoint tags in its folder, the tag its ``latest``
    file names, and whether the run wrote its record (a killed run never does)."""
    folder = Path(folder)
    rows = []
    for name in [f"zero{s}" for s in STAGES] + ["zero3-killed"]:
        directory = folder / "checkpoints" / name
        tags = sorted((p.name for p in directory.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                      key=lambda t: int(t[4:]))
        latest = (directory / "latest").read_text().strip() if (directory / "latest").exists() else "-"
        rows.append([name, " ".join(tags), latest,
                     "yes" if (folder / name / "summary.json").exists() else "no (killed)"])
    return records.format_table(rows, ["run", "checkpoints on disk", "latest", "record written"])


def resume_table(runs: ChapterRuns) -> str:
    """Per stage: the steps compared and whether the resumed run's losses equal the uninterrupted run's
    bit for bit (``identical``), else within which tolerance (:func:`helpers.core.records.loss_agreement`)."""
    rows = []
    for stage, resumed in runs.resumed.items():
        whole = runs.uninterrupted[stage].losses[runs.crash_after:]
        same = "identical" if whole == resumed.losses else records.loss_agreement(whole, resumed.losses)
        source = runs.checkpoint_dir(stage).name
        rows.append([f"ZeRO-{stage}", f"{source}/{tag_of(runs.crash_after)}",
                     f"{runs.crash_after + 1}-{runs.steps}", same])
    return records.format_table(rows, ["stage", "loaded", "steps compared", "resumed vs uninterrupted losses"])


def losses_side_by_side(runs: ChapterRuns, digits: int = 6) -> str:
    """The uninterrupted and resumed losses themselves (digits depend on the processor: an ignored cell)."""
    rows = []
    for stage, resumed in runs.resumed.items():
        whole = runs.uninterrupted[stage].losses
        rows.append([f"ZeRO-{stage}", " ".join(f"{x:.{digits}f}" for x in whole),
                     " " * (digits + 3) * runs.crash_after + " ".join(f"{x:.{digits}f}" for x in resumed.losses)])
    return records.format_table(rows, ["stage", "uninterrupted losses", "resumed losses"])


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


def consolidate(checkpoint_dir: str | Path, tag: str) -> dict:
    """One fp32 PyTorch state dict from a sharded ZeRO checkpoint: DeepSpeed's ``zero_to_fp32``
    (``get_fp32_state_dict_from_zero_checkpoint``), as the chapter calls it on its page; here for the checks
    of the 16-bit file. Runs in this process; no ranks needed."""
    zero_to_fp32 = ds.load("deepspeed.utils.zero_to_fp32")

    with contextlib.redirect_stdout(io.StringIO()):  # it prints progress lines
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)


def loss_of_model(net: torch.nn.Module, record: records.Record, step: int) -> float:
    """The loss ``record``'s run recorded for optimizer step ``step`` (0-based), computed again by the plain
    PyTorch module ``net`` (no DeepSpeed): the mean of every rank's micro-batch losses on the samples that step
    trained on (:func:`helpers.core.models.sample_indices`), inputs cast to ``net``'s dtype."""
    dtype = next(net.parameters()).dtype
    losses = []
    with torch.no_grad():
        for micro in range(record.grad_accum):
            for rank in range(record.world_size):
                indices = models.sample_indices(step, micro, rank, record.world_size, record.micro_batch,
                                                record.grad_accum)
                batch = models.make_batch(record.model_name, indices).to("cpu", dtype)
                losses.append(models.loss_of(net, record.model_name, batch).item())
    return statistics.fmean(losses)


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


def stages_table(runs: ChapterRuns) -> str:
    """Per stage and rank: what it wrote for one checkpoint (files, bytes, and the tensor bytes of
    weights, Adam's states and the fp32 master copy inside), beside the model states it held while
    training (the model_states probe of the uninterrupted run). Gradients are never saved."""
    rows = []
    for stage in STAGES:
        record = runs.uninterrupted[stage]
        held = [record.memory.model_states(rank).as_dict() for rank in range(record.world_size)]
        saved = saved_by_rank(runs.checkpoint_dir(stage) / tag_of(runs.crash_after), len(held))
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
                         f"{states['params']:,} / {states['optimizer']:,} / {states['master']:,}", same])
    return records.format_table(rows, ["stage", "rank", "files", "bytes on disk", "weights saved", "Adam saved",
                                       "master saved", "held: params / Adam / master",
                                       "Adam+master on disk = held?"])


def consolidation_table(runs: ChapterRuns, states: Mapping[int, dict], plain_losses: Mapping[int, float]) -> str:
    """Per stage: the state dict ``zero_to_fp32`` made of its step-``crash_after`` checkpoint (``states``) and
    the loss the plain model computed with it (``plain_losses``), against the loss the run recorded for that step."""
    rows = []
    for stage, state in states.items():
        run = runs.uninterrupted[stage]
        rows.append([f"ZeRO-{stage}", len(state), f"{sum(t.numel() for t in state.values()):,}", f"{run.params:,}",
                     ", ".join(sorted({str(t.dtype).removeprefix('torch.') for t in state.values()})),
                     records.loss_agreement([plain_losses[stage]], [run.losses[runs.crash_after]])])
    return records.format_table(rows, ["checkpoint", "tensors", "elements", "model's parameters", "dtype",
                                       f"plain model's step-{runs.crash_after + 1} loss vs the run's"])


def _who(per_rank: Mapping[int, int]) -> str:
    """Bytes per rank in words: "2,105,344 on rank 0", "1,052,672 on each rank", or "none"."""
    held = {rank: n for rank, n in per_rank.items() if n}
    if not held:
        return "none"
    if len(held) == len(per_rank) and len(set(held.values())) == 1 and len(held) > 1:
        return f"{next(iter(held.values())):,} on each rank"
    return "; ".join(f"{n:,} on rank {rank}" for rank, n in held.items())


def precision_table(runs: ChapterRuns) -> str:
    """Per stage, trained in fp32 and in bf16: the optimizer class DeepSpeed built (the run's record) and what
    one checkpoint (step ``crash_after``) holds, read back from its files: the weights in the model file(s)
    (dtype, bytes, who wrote them), the fp32 master copy, Adam's moments, and the checkpoint's bytes on disk."""
    rows = []
    for stage in sorted(runs.bf16):
        for precision, directory, run in (("fp32", runs.checkpoint_dir(stage), runs.uninterrupted[stage]),
                                          ("bf16", runs.bf16_checkpoint_dir(stage), runs.bf16[stage])):
            files = files_per_rank(directory / tag_of(runs.crash_after))
            ranks = sorted({f["rank"] for f in files} | {0})

            def per_rank(key: str) -> dict[int, int]:
                return {r: sum(f["contents"].get(key, 0) for f in files if f["rank"] == r) for r in ranks}

            dtypes = sorted({f["weights_dtype"] for f in files if f["weights_dtype"]})
            rows.append([f"ZeRO-{stage}", precision, run.summary["optimizer"],
                         f"{', '.join(dtypes)}: {_who(per_rank('params'))}" if dtypes else "none (names and shapes only)",
                         _who(per_rank("master")), _who(per_rank("optimizer")),
                         f"{sum(f['bytes'] for f in files):,}"])
    return records.format_table(rows, ["stage", "trained in", "optimizer", "weights in the model file(s)",
                                       "fp32 master copy", "Adam's moments", "checkpoint on disk, all ranks"])


def precision_ratios(runs: ChapterRuns) -> str:
    """One line: per stage, the bytes on disk of the bf16 checkpoint (all ranks) over the fp32 one's, and
    whether it is larger or smaller."""
    parts = []
    for stage in sorted(runs.bf16):
        sizes = [sum(f["bytes"] for f in files_per_rank(d / tag_of(runs.crash_after)))
                 for d in (runs.bf16_checkpoint_dir(stage), runs.checkpoint_dir(stage))]
        ratio = sizes[0] / sizes[1]
        word = "larger" if ratio > 1.005 else "smaller" if ratio < 0.995 else "the same size"
        parts.append(f"ZeRO-{stage} {ratio:.2f}x ({word})")
    return "bf16 checkpoint vs fp32 checkpoint, bytes on disk: " + ", ".join(parts)


def _model16_files(runs: ChapterRuns, gather: bool) -> list[Path]:
    folder = runs.model16_dir(gather)
    return sorted(p for p in folder.glob("*") if p.is_file()) if folder.is_dir() else []


def model16_table(runs: ChapterRuns) -> str:
    """The two bf16 ZeRO-3 runs that called ``save_16bit_model`` after step ``crash_after`` on every rank,
    without and with :data:`GATHER_KEY`: what the call returned on each rank (as the script printed it) and
    what the folder holds."""
    rows = []
    for gather in (False, True):
        files = _model16_files(runs, gather)
        if files:
            state = torch.load(files[0], map_location="cpu", weights_only=True)
            shown = [", ".join(p.name for p in files), f"{sum(p.stat().st_size for p in files):,}", len(state),
                     ", ".join(sorted(_dtypes(state)))]
        else:
            shown = ["nothing (no folder)" if not runs.model16_dir(gather).exists() else "nothing", "-", "-", "-"]
        returned = runs.model16_returned[gather]
        rows.append([str(gather).lower(), " / ".join(map(str, returned)), *shown])
    ranks = " / ".join(str(r) for r in range(len(runs.model16_returned[True])))
    return records.format_table(rows, [GATHER_KEY, f"returned on ranks {ranks}", "files written", "bytes on disk",
                                       "tensors", "dtype"])


def model16_sizes(runs: ChapterRuns) -> str:
    """The 16-bit model file beside the same step's sharded checkpoint (every rank's files) and
    ``zero_to_fp32``'s state dict of it (tensor bytes)."""
    directory, tag = runs.bf16_checkpoint_dir(3), tag_of(runs.crash_after)
    model16 = sum(p.stat().st_size for p in _model16_files(runs, True))
    sharded = sum(f["bytes"] for f in files_per_rank(directory / tag))
    fp32 = _tensor_bytes(consolidate(directory, tag))
    rows = [["save_16bit_model: pytorch_model.bin (bf16 weights)", "file on disk", f"{model16:,}", "1.00"],
            ["zero_to_fp32 of the same step (fp32 weights)", "tensors", f"{fp32:,}", f"{fp32 / model16:.2f}"],
            [f"the sharded checkpoint {tag} (weights, master, Adam)", "files on disk, all ranks", f"{sharded:,}",
             f"{sharded / model16:.2f}"]]
    return records.format_table(rows, ["what", "counted as", "bytes", "vs the 16-bit file"])


def model16_check(runs: ChapterRuns) -> str:
    """Two checks of the 16-bit file against what does not come from it: its tensors against ``zero_to_fp32``'s
    fp32 weights of the same step (read from the optimizer shards) rounded to bf16, and the loss of the next
    step computed by the plain model in bf16 (no DeepSpeed), loaded with the file alone, against the loss the
    run recorded for that step."""
    run = runs.model16[True]
    state = torch.load(_model16_files(runs, True)[0], map_location="cpu", weights_only=True)
    master = consolidate(runs.bf16_checkpoint_dir(3), tag_of(runs.crash_after))
    same = sum(torch.equal(state[k], master[k].to(state[k].dtype)) for k in state if k in master)
    net = models.build(run.model_name).to(torch.bfloat16)
    net.load_state_dict(state, strict=True)
    loss = loss_of_model(net, run, runs.crash_after)
    rows = [["its tensors vs zero_to_fp32's fp32 weights rounded to bf16",
             f"identical, {same} of {len(state)} tensors" if same == len(state) == len(master)
             else f"{same} of {len(state)} identical ({len(master)} in zero_to_fp32's)"],
            [f"plain model in bf16, loaded from it alone: step-{runs.crash_after + 1} loss vs the run's",
             records.loss_agreement([loss], [run.losses[runs.crash_after]], "bf16")]]
    return records.format_table(rows, ["check", "result"])


def one_rank_table(runs: ChapterRuns, as_saved: Mapping[int, records.Record | str],
                   universal: Mapping[int, records.Record]) -> str:
    """Per stage: what ``load_checkpoint`` did on 1 rank with the multi-rank checkpoint as saved (DeepSpeed's
    refusal, shortened to its first sentence, or the resumed losses against the uninterrupted run's), and the
    same through a universal checkpoint where the chapter converted one."""
    rows = []
    for stage in STAGES:
        whole = runs.uninterrupted[stage].losses[runs.crash_after:]

        def outcome(run: records.Record | str | None) -> str:
            if run is None:
                return "-"
            if isinstance(run, str):
                return "refused: " + run.split(". ")[0].strip().rstrip(".")
            return f"loads; losses {records.loss_agreement(whole, run.losses)}"

        sample = next((r for r in (as_saved.get(stage), universal.get(stage)) if isinstance(r, records.Record)), None)
        batch = f"{sample.micro_batch} x {sample.grad_accum} x {sample.world_size}" if sample else "-"
        rows.append([f"ZeRO-{stage}", outcome(as_saved.get(stage)), outcome(universal.get(stage)), batch])
    saved_on = runs.uninterrupted[STAGES[0]].world_size
    return records.format_table(rows, ["stage", f"the {saved_on}-rank checkpoint as saved", "through a universal checkpoint",
                                       "micro x accum x ranks"])


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

def resumed_losses(runs: ChapterRuns, title: str = "Uninterrupted and resumed runs"):
    """Each stage's uninterrupted losses (lines) with its resumed run's (markers, from step crash_after + 1)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, stage in enumerate(STAGES):
        losses, again = runs.uninterrupted[stage].losses, runs.resumed[stage].losses
        line, = ax.plot(range(1, len(losses) + 1), losses, "-", alpha=0.6, label=f"ZeRO-{stage} uninterrupted")
        ax.plot(range(runs.crash_after + 1, runs.crash_after + len(again) + 1), again, "o", color=line.get_color(),
                markersize=9 - 2 * i, markerfacecolor="none", label=f"ZeRO-{stage} resumed")
    ax.axvline(runs.crash_after + 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="optimizer step", ylabel="loss", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- exercises ---------------------------------------------------------------------------------------

def exercise_zero2_bytes_per_rank(answer: Any, runs: ChapterRuns, stage: int = 2) -> exercises.Verdict:
    """Exercise: predict the bytes on disk each rank writes for one checkpoint of the ``stage`` run (fp32,
    AdamW); the answer is what the chapter's run wrote (:func:`saved_by_rank`), within 2% for each rank."""
    record = runs.uninterrupted[stage]
    folder = runs.checkpoint_dir(stage) / tag_of(runs.crash_after)
    saved = saved_by_rank(folder, record.world_size)
    files = {rank: [row["file"] for row in files_per_rank(folder) if row["rank"] == rank] for rank in saved}
    task = (f"Predict the bytes on disk each of the {record.world_size} ranks writes for one ZeRO-{stage} "
            f"checkpoint of this {record.params:,}-parameter model (fp32 weights, AdamW), as {{rank: bytes}}.")
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


def exercise_save_16bit(answer: Any, runs: ChapterRuns) -> exercises.Verdict:
    """Exercise: predict the bytes of the file ``save_16bit_model`` wrote in each bf16 ZeRO-3 run of the chapter,
    without and with :data:`GATHER_KEY` (0 where it wrote none), as ``{False: bytes, True: bytes}``; right when
    each is within 2% of the files on disk (exactly 0 where there is none)."""
    written = {gather: sum(p.stat().st_size for p in _model16_files(runs, gather)) for gather in (False, True)}
    params = runs.model16[True].params
    task = (f"Predict the bytes of the file engine.save_16bit_model wrote in the two bf16 ZeRO-3 runs of this "
            f"{params:,}-parameter model, called on both ranks after step {runs.crash_after}: without and with "
            f"{GATHER_KEY}, as {{False: bytes, True: bytes}} (0 if no file).")
    hint = ("in the stages table of 'What each rank saved', how much of the weights does one rank hold at "
            "stage 3, and what would have to happen before one file could hold them all? The switch's name says "
            "what it adds. A bf16 number takes 2 bytes; the file adds a little of its own.")

    def test(guess: Any) -> tuple[bool, str]:
        if not isinstance(guess, Mapping) or set(guess) != {False, True}:
            return False, "write a dict with both runs: {False: ..., True: ...}."
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in guess.values()):
            return False, "give each run's file size as a number of bytes (0 if no file)."
        ok = {g: guess[g] == 0 if written[g] == 0 else abs(guess[g] / written[g] - 1) <= 0.02 for g in written}
        returned = {g: " / ".join(map(str, runs.model16_returned[g])) for g in written}
        if all(ok.values()):
            return True, (f"without the switch save_16bit_model returned {returned[False]} on ranks 0 / 1 and wrote "
                          f"nothing: no rank holds the whole weights at stage 3. With it, DeepSpeed gathered each "
                          f"layer on rank 0, which wrote {written[True]:,} bytes: 2 bytes x {params:,} weights and "
                          f"the file's own; it returned {returned[True]}.")
        wrong = [f"{GATHER_KEY}={str(g).lower()}" for g, right in ok.items() if not right]
        return False, f"not the file on disk for {' and '.join(wrong)}."
    return exercises.satisfies("save_16bit_model", answer, test, task=task, hint=hint)


def exercise_other_ranks(answer: Any, runs: ChapterRuns, as_saved: Mapping[int, records.Record | str]) -> exercises.Verdict:
    """Exercise: predict, per ZeRO stage, what ``load_checkpoint`` does on 1 rank with the multi-rank checkpoint as
    saved: ``"loads"`` or ``"refused"`` (:data:`OUTCOMES`); the answer is what the chapter's third launch did."""
    truth = {stage: "refused" if isinstance(run, str) else "loads" for stage, run in as_saved.items()}
    task = ("Predict, for each ZeRO stage, what engine.load_checkpoint does on 1 rank given the step-3 checkpoint "
            f"its {runs.uninterrupted[STAGES[0]].world_size}-rank run saved: {' or '.join(map(repr, OUTCOMES))}, "
            "as {stage: outcome}.")
    hint = ("in the stages table of 'What each rank saved', are the numbers one rank needs to train in rank 0's "
            "files, or split between the two ranks' files? Where they are split, would one rank get a file "
            "cut for it, and do you expect load_checkpoint to cut them anew?")

    def test(guess: Any) -> tuple[bool, str]:
        if not isinstance(guess, Mapping) or set(guess) != set(truth):
            return False, f"write a dict with one entry per stage: {{{', '.join(f'{s}: ...' for s in truth)}}}."
        if any(v not in OUTCOMES for v in guess.values()):
            return False, f"each outcome is one of {', '.join(map(repr, OUTCOMES))}."
        wrong = [s for s in truth if guess[s] != truth[s]]
        if wrong:
            return False, f"not what DeepSpeed did at {', '.join(f'ZeRO-{s}' for s in wrong)}."
        loads = [s for s, t in truth.items() if t == "loads"]
        return True, (f"ZeRO-{', ZeRO-'.join(map(str, loads))} loaded: rank 0's file holds the whole model and "
                      "optimizer, so any number of ranks can read it. The others were refused: each file holds one "
                      "rank's partition, and DeepSpeed does not re-cut partitions for another number of ranks.")
    return exercises.satisfies("another number of ranks", answer, test, task=task, hint=hint)
