"""DeepSpeed beside PyTorch's own DDP and FSDP2 (chapter 15): the same model, data, seed and
hyperparameters, each framework launched its own way, every run with the same record.

- :func:`compare`: two launches: PyTorch's strategies under ``torchrun`` (:mod:`helpers.pytorch_train`) and
  DeepSpeed's ZeRO stages under DeepSpeed's launcher. PyTorch's collectives are measured with the PyTorch
  profiler (the ``torch_comm`` probe); DeepSpeed's with its comms logger and, as a cross-check of the
  profiler method, with the profiler too.
- tables of model states, collectives, losses and step time; the "which to pick" table.
- :func:`gpu_compare`: on GPUs, the same comparison at a size where time means something.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from helpers import experiments, launch, probes as probe_registry, records

#: PyTorch strategies (helpers.pytorch_train.STRATEGIES), in the order tables show them.
PYTORCH = ("ddp", "fsdp2-grad-op", "fsdp2")
STAGES = (0, 1, 2, 3)
#: The probes of a PyTorch run: the DeepSpeed runs' own, with the profiler in place of the comms logger.
TORCH_PROBES = ("timing", "model_states", "peak_memory", "torch_comm", "timeline")
#: DeepSpeed runs keep the comms logger and add the profiler (its section: ``comm_profiler``).
DEEPSPEED_PROBES = probe_registry.DEFAULT + ("torch_comm",)


def _label(record: records.Record) -> str:
    return record.summary.get("strategy") or f"ZeRO-{record.stage}"


def compare(model: str = "mlp", steps: int = 4, overrides: dict | None = None, world_size: int | None = None,
            timing_only: bool = False, progress: bool = True, tag: str = "") -> dict[str, records.Record]:
    """Train ``model`` with DDP, FSDP2 (both reshard settings) and ZeRO 0-3 from ``ds_configs/zero<N>.json``
    (the PyTorch runs read ``zero0.json`` for the same hyperparameters), ``overrides`` applied to all; two
    launches. ``timing_only`` leaves out the probes that measure communication (they slow a step).
    Returns {label: record}, labels such as ``"DDP"``, ``"FSDP2 full"``, ``"ZeRO-2"``."""
    torch_probes = ("timing", "peak_memory") if timing_only else TORCH_PROBES
    ds_probes = ("timing", "peak_memory") if timing_only else DEEPSPEED_PROBES
    suffix = f"-{tag}" if tag else ""
    torch_specs = {f"torch-{s}{suffix}": launch.RunSpec("zero0", model=model, steps=steps, overrides=overrides,
                                                        probes=torch_probes, task="helpers.pytorch_train:train_run",
                                                        options={"strategy": s}) for s in PYTORCH}
    ds_specs = {f"deepspeed-zero{s}{suffix}": launch.RunSpec(f"zero{s}", model=model, steps=steps,
                                                             overrides=overrides, probes=ds_probes) for s in STAGES}
    runs = dict(launch.sweep(torch_specs, name=f"frameworks-torchrun{suffix}", world_size=world_size,
                             launcher="torchrun", progress=progress))
    runs.update(launch.sweep(ds_specs, name=f"frameworks-deepspeed{suffix}", world_size=world_size, progress=progress))
    return {_label(r): r for r in runs.values()}


def ddp_first_bucket_bytes() -> int:
    """The cap of DDP's first gradient bucket in this torch (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``):
    kept small so that the first all-reduce starts early in backward."""
    import torch.distributed as dist

    return dist._DEFAULT_FIRST_BUCKET_BYTES


def launchers_table(runs: Mapping[str, records.Record]) -> str:
    """How each run was started: the launcher command of its launch (``command.txt``) and the backend."""
    rows = []
    for name, record in runs.items():
        command = (Path(record["launch"]["plan"]).parent / "command.txt").read_text().split()
        module = command[command.index("-m") + 1] if "-m" in command else command[0]
        rows.append([name, f"python -m {module}", record.summary["backend"], record.summary["world_size"]])
    return records.format_table(rows, ["run", "launched with", "backend", "ranks"])


def losses_table(runs: Mapping[str, records.Record], baseline: str = "DDP") -> str:
    """Every run's losses against ``baseline``'s, within the precision's tolerance (no digits: checked)."""
    base = runs[baseline]
    rows = [[name, r.summary["precision"], f"{len(r.losses)} steps",
             "-" if name == baseline else records.loss_agreement(base.losses, r.losses, r.summary["precision"])]
            for name, r in runs.items()]
    return records.format_table(rows, ["run", "precision", "compared", f"losses vs {baseline}"])


def losses_digits(runs: Mapping[str, records.Record], digits: int = 6) -> str:
    """The losses themselves (their digits depend on the processor: print in an ignored cell)."""
    rows = [[name, " ".join(f"{x:.{digits}f}" for x in r.losses)] for name, r in runs.items()]
    return records.format_table(rows, ["run", "losses"])


def states_table(runs: Mapping[str, records.Record], rank: int = 0) -> str:
    """Measured bytes per rank: parameters, gradients, Adam's states, fp32 master copy (the model states),
    communication buffers, and the model states against DDP's."""
    base = None
    rows = []
    for name, r in runs.items():
        states = r.states(rank)
        total = r.model_state_bytes(rank)
        base = base or total
        rows.append([name, *(f"{states[k]:,}" for k in records.STATE_KEYS), f"{total:,}", f"{total / base:.2f}"])
    first = next(iter(runs))
    return records.format_table(rows, ["run", "params", "grads", "Adam", "master", "buffers", "model states",
                                       f"vs {first}"])


def comm_table(runs: Mapping[str, records.Record]) -> str:
    """Per run and collective: calls and bytes per optimizer step and the code that issued them (DeepSpeed's
    function, or PyTorch's FSDP/DDP range), then the totals: bytes per step, and what one rank sends on a
    ring (wire bytes)."""
    rows = []
    for name, r in runs.items():
        comm = r.summary["comm"]
        for op, callers in comm["by_caller"].items():
            for caller, row in callers.items():
                rows.append([name, op, caller or "-", f"{row['count']:g}", f"{row['bytes']:,.0f}"])
        rows.append([name, "= total", comm.get("source", "DeepSpeed comms logger"), "",
                     f"{comm['bytes_per_step']:,.0f}"])
    return records.format_table(rows, ["run", "collective", "issued by", "calls/step", "bytes/step"])


def summary_table(runs: Mapping[str, records.Record]) -> str:
    """One row per run: collective calls per step, bytes per step, wire bytes per rank (ring), and wire bytes
    against the paper's volume for the ZeRO stage (or PyTorch strategy) it matches."""
    rows = []
    for name, r in runs.items():
        comm = r.summary["comm"]
        calls = sum(row["count"] for row in r.comm_ops().values())
        rows.append([name, f"{calls:g}", f"{comm['bytes_per_step']:,.0f}", f"{comm['wire_bytes_per_step']:,.0f}",
                     records.format_ratio(comm['wire_bytes_per_step'], r['theory.comm_wire_bytes_per_step'])])
    return records.format_table(rows, ["run", "calls/step", "bytes/step", "wire bytes/step (ring)",
                                       "wire / paper's 2Ψ or 3Ψ"])


def profiler_check_table(runs: Mapping[str, records.Record]) -> str:
    """For DeepSpeed's runs, measured twice: bytes per step and collective by the comms logger and by the
    PyTorch profiler (the method used for PyTorch's runs). Where they differ, by how much."""
    rows = []
    for name, r in runs.items():
        if "comm_profiler" not in r.summary:
            continue
        logger, profiler = r.summary["comm"]["by_op"], r.summary["comm_profiler"]["by_op"]
        for op in sorted(set(logger) | set(profiler)):
            a, b = logger.get(op, {"count": 0, "bytes": 0}), profiler.get(op, {"count": 0, "bytes": 0})
            same = "same" if a == b else f"differ by {b['bytes'] - a['bytes']:+,.0f} bytes"
            rows.append([name, op, f"{a['count']:g} / {b['count']:g}", f"{a['bytes']:,.0f}", f"{b['bytes']:,.0f}",
                         same])
    return records.format_table(rows, ["run", "collective", "calls: logger / profiler", "logger bytes",
                                       "profiler bytes", ""])


def timing_table(runs: Mapping[str, records.Record]) -> str:
    """Median step time and peak memory per rank (machine-dependent: print in an ignored cell)."""
    rows = [[name, f"{r['step_time_s.median'] * 1000:.1f}", records.format_peak(r),
             r["memory.peak_source"]] for name, r in runs.items()]
    return records.format_table(rows, ["run", "step ms (median)", "peak per rank", "peak measured as"])


#: What each strategy is, when to pick it: the stable part of the "which to pick" table (the measured
#: columns come from the runs).
ADVICE = {
    "DDP": "model, gradients and Adam's states fit one device: the simplest, one all-reduce a step",
    "ZeRO-0": "DeepSpeed's data parallelism: DDP's states and traffic, with DeepSpeed's other features",
    "ZeRO-1": "Adam's states do not fit: shard them; DDP's all-reduce plus a gather of updated weights",
    "ZeRO-2": "gradients do not fit either: a reduction every micro-step; weights stay whole",
    "FSDP2 grad-op": "weights do not fit at rest but fit for one step: no gathers in backward",
    "ZeRO-3": "weights do not fit: DeepSpeed keeps small models gathered between uses (chapter 05)",
    "FSDP2 full": "weights do not fit: PyTorch-native, every layer gathered twice a micro-step",
}


def pick_table(runs: Mapping[str, records.Record], baseline: str = "DDP") -> str:
    """Which to pick: per run, model states per rank and wire bytes per step against ``baseline``, whether
    its losses agree, and when it is the right choice."""
    base = runs[baseline]
    rows = []
    for name, r in runs.items():
        rows.append([name, f"{r.model_state_bytes() / base.model_state_bytes():.2f}x",
                     records.format_ratio(r["comm.wire_bytes_per_step"], base["comm.wire_bytes_per_step"], suffix="x"),
                     records.loss_agreement(base.losses, r.losses, r.summary["precision"]) if name != baseline else "-",
                     ADVICE.get(name, "")])
    return records.format_table(rows, ["run", f"states vs {baseline}", f"wire bytes vs {baseline}", "losses",
                                       "pick it when"])


def ordered(runs: Mapping[str, records.Record]) -> dict[str, records.Record]:
    """Runs in the order of how much they shard: DDP, ZeRO-0, ZeRO-1, ZeRO-2, FSDP2 grad-op, ZeRO-3, FSDP2 full."""
    order = ["DDP", "ZeRO-0", "ZeRO-1", "ZeRO-2", "FSDP2 grad-op", "ZeRO-3", "FSDP2 full"]
    return {name: runs[name] for name in order if name in runs} | {k: v for k, v in runs.items() if k not in order}


# --- on GPUs ----------------------------------------------------------------------------------

GPU_MODEL = "llama-medium"
GPU_OVERRIDES = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1}


def gpu_compare(steps: int = 12, world_size: int | None = None,
                progress: bool = True) -> tuple[dict[str, records.Record], dict[str, records.Record]]:
    """On GPUs: the comparison on the 85M-parameter model in bf16, twice: with the probes that measure
    communication (bytes), and with timing only (step time without the comms logger's synchronization or
    the profiler). Four launches. Returns (by bytes, by time), each {label: record}."""
    by_bytes = compare(GPU_MODEL, steps, GPU_OVERRIDES, world_size, progress=progress, tag="gpu-bytes")
    by_time = compare(GPU_MODEL, steps, GPU_OVERRIDES, world_size, timing_only=True, progress=progress,
                      tag="gpu-time")
    return ordered(by_bytes), ordered(by_time)


def bytes_per_step(record: records.Record) -> str:
    """A run's bytes per step, or what is missing: the profiler can count a collective yet record no
    message size (seen for DDP's bucket all-reduce on NCCL), and zero bytes would then be a false figure."""
    calls = sum(row["count"] for row in record.comm_ops().values())
    if record["comm.bytes_per_step"] == 0 and calls:
        return f"? ({calls:.3g} collectives a step, no sizes recorded)"
    return records.format_bytes(record["comm.bytes_per_step"])


def gpu_table(by_bytes: Mapping[str, records.Record], by_time: Mapping[str, records.Record]) -> str:
    """Per run: model states and peak memory per rank, bytes per step, median step time, losses vs DDP."""
    base = by_bytes.get("DDP")
    rows = []
    for name, r in by_bytes.items():
        t = by_time.get(name)
        rows.append([name, records.format_bytes(r.model_state_bytes()),
                     records.format_peak(t) if t else "-",
                     bytes_per_step(r),
                     f"{t['step_time_s.median'] * 1000:.1f}" if t else "-",
                     records.loss_agreement(base.losses, r.losses, r.summary["precision"]) if base is not None else "-"])
    return records.format_table(rows, ["run", "model states/rank", "peak/rank", "bytes/step", "step ms",
                                       "losses vs DDP"])


def save_gpu_reference(by_bytes: Mapping[str, records.Record], by_time: Mapping[str, records.Record],
                       note: str) -> Path | None:
    """Keep both GPU comparisons as one reference file (``runs/reference/frameworks-<N>x<GPU>.json``)."""
    runs = {f"bytes: {k}": r for k, r in by_bytes.items()} | {f"time: {k}": r for k, r in by_time.items()}
    return experiments.save_reference("frameworks", runs, note)


def reference_report(name: str = "frameworks") -> str:
    """The committed GPU comparisons, each labelled with its device, date and note."""
    def tables(by_bytes: dict, by_time: dict) -> str:
        both = {k: r for k, r in by_bytes.items() if "comm_profiler" in r.summary}
        return gpu_table(by_bytes, by_time) + (f"\n\nDeepSpeed's runs, by its comms logger and by the profiler:\n"
                                               f"{profiler_check_table(both)}" if both else "")

    return experiments.bytes_and_time_report(
        name, tables, how="run this notebook on a machine with 2 or more NVIDIA GPUs to measure them.")
