"""Offload (chapter 06): ZeRO-Offload and ZeRO-Infinity, where model states live and what moving them costs.

The chapter's script (``runs/06/train_offload.py``, written by the notebook) trains every setting in one
launch with :mod:`helpers.measure`, then calls :func:`adam_benchmark`; this module reads what they wrote
(:func:`chapter_records`) and turns it into tables, verdicts and formulas.

- The core's probe ``placement`` (:class:`helpers.core.probes.Placement`) measures each rank's model-state
  bytes on the accelerator side and on the host side, pinned host bytes, bytes per physical device and
  dtypes; this chapter's tables read it.
- :func:`adam_benchmark`: the optimizers the script hands it (DeepSpeed's CPU Adam, torch's AdamW) stepped
  by every rank at once on its share of the parameters, as offload's ranks share the host's cores; on a GPU
  also the bandwidth of copies between host and device (pinned and not).
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed

from helpers.core import configs, ds, exercises, load_guard, plots, records, references, theory
from helpers.core.configs import merged
from helpers.core.records import format_bytes

#: Kinds of model state the placement tables show (buffers are shown apart).
STATE_NAMES = {"params": "params", "grads": "grads", "optimizer": "Adam states", "master": "fp32 master"}
#: The name the chapter's script gives its first run trained again at the end of the launch.
AGAIN = " (again)"


# --- the chapter's runs ---------------------------------------------------------------------------

#: DeepSpeed's own Adam where the optimizer is offloaded: the course's zero configs ask for torch's AdamW
#: (``torch_adam``), which offload would run on the CPU instead of DeepSpeed's CPU Adam (the checker warns:
#: rule ``offload-torch-adam``).
DEEPSPEED_ADAM = {"optimizer": {"params": {"torch_adam": None}}}
PRECISION = {"bf16": {"enabled": True}}
#: The file the chapter's script writes its :func:`adam_benchmark` into, inside its records' folder.
BENCHMARK_FILE = "adam_benchmark.json"


def chapter_records(folder: str | Path, since: float = 0.0) -> tuple[dict[str, records.Record], records.Record, dict]:
    """What the chapter's script wrote into ``folder`` since ``since`` (a ``time.time()``): ``(runs, again,
    benchmark)``, the runs by the names the script gave them in the order they trained, the first run
    trained again at the end (named ``<first> (again)``), and the :func:`adam_benchmark` result."""
    loaded, _ = records.load_all(folder)
    found = sorted((Path(folder, key, "summary.json").stat().st_mtime, record) for key, record in loaded.items()
                   if Path(folder, key, "summary.json").stat().st_mtime >= since)
    bench_path = Path(folder, BENCHMARK_FILE)
    if not found or not bench_path.is_file() or bench_path.stat().st_mtime < since:
        raise FileNotFoundError(f"no records and benchmark in {folder} newer than the launch: did the script run?")
    runs = {record.name: record for _, record in found}
    again = next(name for name in runs if name.endswith(AGAIN))
    return runs, runs.pop(again), json.loads(bench_path.read_text())


# --- the Adam benchmark ---------------------------------------------------------------------------

#: Parameters the benchmark steps in all, shared by the ranks (flat fp32 tensors, like ZeRO partitions):
#: 8,388,608, big enough that the step streams from memory rather than from cache.
BENCHMARK_PARAMS = 2**23
BENCHMARK_REPEATS = 5


def _time_steps(step, repeats: int, synchronize=lambda: None, together: bool = False) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``step()``, after one warm-up call; with ``together``, every
    rank starts each call at once (a barrier before it)."""
    step()
    synchronize()
    times = []
    for _ in range(repeats):
        if together:
            torch.distributed.barrier()
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def adam_benchmark(optimizers: Mapping[str, Callable[[list], torch.optim.Optimizer]], out: str | Path | None = None,
                   numel: int = BENCHMARK_PARAMS, repeats: int = BENCHMARK_REPEATS, seed: int = 0) -> dict:
    """Step each of ``optimizers`` (name -> a function building it from a parameter list) on ``numel`` fp32
    parameters with gradients, shared by the ranks of the launch: every rank steps its ``numel / ranks`` at
    the same time, as offload's ranks step their partitions on one host. A step's time is the slowest
    rank's (the host is done when every partition is). The first optimizer is timed again at the end
    (``again_s``: did the machine warm up meanwhile?). Also: each optimizer's weights after one step against
    AdamW's formula (:func:`adamw_first_step`), and on a GPU torch's fused AdamW on the device (the step
    offload replaces) and :func:`transfer_bandwidth`. Rank 0 writes the result to ``out`` and returns it."""
    together = torch.distributed.is_initialized()
    rank, ranks = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if together else (0, 1)
    share = numel // ranks
    gen = torch.Generator().manual_seed(seed + rank)
    weights = torch.randn(share, generator=gen)
    grads = torch.randn(share, generator=gen) * 1e-2
    settings = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    formula = adamw_first_step(weights, grads, **settings)

    def prepared(device: str = "cpu") -> torch.nn.Parameter:
        p = torch.nn.Parameter(weights.clone().to(device))
        p.grad = grads.clone().to(device)
        return p

    def timed(name: str) -> tuple[list[float], float]:
        p = prepared()
        optimizer = optimizers[name]([p])
        optimizer.step()
        difference = float((p.detach() - formula).abs().max())
        return _time_steps(optimizer.step, repeats, together=together), difference

    steps, differences = {}, {}
    for name in optimizers:
        steps[name], differences[name] = timed(name)
    again, _ = timed(next(iter(optimizers)))
    device_steps = None
    if torch.cuda.is_available():
        p = prepared("cuda")
        device_steps = _time_steps(torch.optim.AdamW([p], fused=True, **settings).step, repeats, torch.cuda.synchronize)
    mine = {"steps": steps, "again": again, "differences": differences}
    gathered = [mine]
    if together:
        gathered = [None] * ranks
        torch.distributed.all_gather_object(gathered, mine)
    slowest = lambda lists: [max(times) for times in zip(*lists)]  # per step, the slowest rank's time
    steps_s = {name: slowest([g["steps"][name] for g in gathered]) for name in optimizers}
    result = {"task": "benchmark", "device": "cuda" if torch.cuda.is_available() else "cpu", "ranks": ranks,
              "adam": {"params": share * ranks, "ranks": ranks, "repeats": repeats, "threads": torch.get_num_threads(),
                       "steps_s": steps_s, "again_s": slowest([g["again"] for g in gathered]),
                       "seconds": {name: statistics.median(times) for name, times in steps_s.items()},
                       "max_difference_from_formula": {name: max(g["differences"][name] for g in gathered)
                                                       for name in optimizers},
                       "accelerator_adamw_seconds": statistics.median(device_steps) if device_steps else None,
                       "accelerator_params": share,
                       "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
              "transfers": transfer_bandwidth()}
    if rank == 0 and out is not None:
        Path(out).write_text(json.dumps(result, indent=1))
    return result


def adamw_first_step(weights: torch.Tensor, grads: torch.Tensor, lr: float, betas: tuple[float, float], eps: float,
                     weight_decay: float) -> torch.Tensor:
    """The weights after AdamW's first step, in closed form (Loshchilov and Hutter, arXiv 1711.05101,
    Algorithm 2, computed in float64): from zero moments the bias-corrected moments are g and g², so the
    step is ``w (1 - lr wd) - lr g / (|g| + eps)`` whatever the betas. Independent of every optimizer
    the benchmark times."""
    w, g = weights.double(), grads.double()
    del betas  # they cancel in the first step's bias correction
    return (w * (1 - lr * weight_decay) - lr * g / (g.abs() + eps)).float()


def transfer_bandwidth(numel: int = 2**26, repeats: int = BENCHMARK_REPEATS) -> dict | None:
    """On a GPU: bytes/s of host-to-device and device-to-host copies of ``numel`` fp16 values (128 MiB),
    from pinned and from ordinary (pageable) host memory, on this rank's GPU. None without a GPU."""

    if not torch.cuda.is_available():
        return None
    device = torch.empty(numel, dtype=torch.half, device="cuda")
    found = {}
    for pinned in (True, False):
        host = torch.empty(numel, dtype=torch.half, pin_memory=pinned)
        label = "pinned" if pinned else "pageable"
        found[f"host_to_device_{label}"] = host.nbytes / statistics.median(
            _time_steps(lambda: device.copy_(host), repeats, torch.cuda.synchronize))
        found[f"device_to_host_{label}"] = host.nbytes / statistics.median(
            _time_steps(lambda: host.copy_(device), repeats, torch.cuda.synchronize))
    return {"bytes": numel * 2, "bytes_per_s": found}


# --- tables ---------------------------------------------------------------------------------------

def _where(placement: dict, key: str) -> str:
    parts = [f"{side[0].upper()} {format_bytes(placement[side][key])}" for side in ("accelerator", "host")
             if placement[side][key]]
    return " + ".join(parts) or "-"


def placement_table(runs: Mapping[str, object], rank: int = 0) -> str:
    """Per run: where each kind of model state lives on ``rank`` (A = accelerator side, H = host side),
    the totals of each side (buffers apart), and the pinned host bytes."""

    rows = []
    for name, r in runs.items():
        p = r.memory.placement(rank)
        totals = {side: sum(p[side][k] for k in STATE_NAMES) for side in ("accelerator", "host")}
        rows.append([name, *(_where(p, k) for k in STATE_NAMES), records.format_bytes(totals["accelerator"]),
                     records.format_bytes(totals["host"]), _where(p, "buffers"), records.format_bytes(p["pinned_bytes"])])
    return records.format_table(rows, ["run", *STATE_NAMES.values(), "accelerator", "host", "buffers", "pinned"])


def buffers_note(runs: Mapping[str, records.Record], rank: int = 0) -> str:
    """What the ``buffers`` of a stage 2 optimizer-offload run in ``runs`` are, from its placement on ``rank``: the
    accelerator's gradient staging buffer, and on the host its twin plus a working-precision copy of the rank's
    parameter partition (checked: host minus accelerator buffer bytes = the partition's bytes)."""
    for name, r in runs.items():
        p = r.memory.placement(rank)
        if r.stage != 2 or not p["host"]["buffers"]:
            continue
        a, h = p["accelerator"]["buffers"], p["host"]["buffers"]
        partition = r.params // r["world_size"] * theory.BYTES_PER_ELEMENT[r["precision"]]
        if h - a != partition:
            return f"{name}'s buffers: A {records.format_bytes(a)}, H {records.format_bytes(h)} (staging buffers)."
        return (f"{name}'s buffers: A {records.format_bytes(a)} is the gradient staging buffer (one largest "
                f"parameter in {r['precision']}); H {records.format_bytes(h)} is its host twin plus a {r['precision']} "
                f"copy of the rank's parameter partition ({records.format_bytes(partition)}) that the updated weights "
                "go up from.")
    return "No stage 2 optimizer-offload run: no staging buffers to explain."


def theory_table(runs: Mapping[str, object], rank: int = 0) -> str:
    """Per run: measured model-state bytes of each side on ``rank`` beside the offload formula
    (:func:`helpers.core.theory.offload_bytes_per_device`, the run's precision), and their ratio. Sides that
    hold nothing, in the formula and measured, are left out; runs whose rows are the same (a run and its
    unpinned twin) share one row."""

    cases: dict[tuple, list[str]] = {}
    for name, r in runs.items():
        p = r.memory.placement(rank)
        mode = offload_mode(r)
        expected = theory.offload_bytes_per_device(r.params, r.stage, r["world_size"], mode, r["precision"])
        figures = []
        for side in ("accelerator", "host"):
            measured = sum(p[side][k] for k in STATE_NAMES)
            paper = expected[side]["total"]
            if measured or paper:
                figures.append((side, f"{measured:,}", f"{paper:,.0f}",
                                f"{measured / paper:.2f}" if paper else "(not in formula)"))
        cases.setdefault(tuple(figures), []).append(name)
    rows = []
    for figures, names in cases.items():
        label = "; ".join(names)
        if len(names) == 2 and names[1] == f"{names[0]}, unpinned":
            label = f"{names[0]}, pinned or not"
        rows += [[label, *row] for row in figures]
    return records.format_table(rows, ["run", "side", "measured bytes", "formula bytes", "measured/formula"])


def offload_mode(record) -> str:
    """"none", "optimizer" or "optimizer+params" (:data:`helpers.core.theory.OFFLOAD_MODES`), from the run's config
    as DeepSpeed applies it (parameter offload only counts at stage 3)."""
    zero = record["config"].get("zero_optimization", {})
    optimizer = zero.get("offload_optimizer", {}).get("device", "none") != "none"
    params = zero.get("offload_param", {}).get("device", "none") != "none" and record.stage == 3
    return "optimizer+params" if optimizer and params else "optimizer" if optimizer else "none"


def _steps(record) -> list[float]:
    """A run's step times after its first (which warms up), the ones every verdict compares."""
    return record.timing.all_s[1:] or record.timing.all_s


def timing_table(runs: Mapping[str, object], rank: int = 0) -> str:
    """Per run: median of the steps after the first (as the verdicts), accelerator peak (GPU: allocator peak)
    and host peak RSS of ``rank``, one column where they are the same (CPU ranks). Timings depend on the
    machine: print this where nbval does not compare."""

    rows = [[name, f"{statistics.median(_steps(r)) * 1000:.1f}", records.format_peak(r, rank),
             records.format_bytes(r.memory.host_peak(rank))] for name, r in runs.items()]
    if all(row[2] == row[3] for row in rows):  # CPU ranks: the accelerator is the host, one peak
        return records.format_table([row[:3] for row in rows], ["run", "step ms (median after the 1st)",
                                                                "peak RSS (accelerator = host)"])
    return (records.format_table(rows, ["run", "step ms (median after the 1st)", "accelerator peak", "host peak RSS"])
            + f"\n(accelerator peak: {runs[next(iter(runs))].memory.peak_source})")


def _benchmark_conditions(adam: dict) -> str:
    """How the benchmark ran: parameters, ranks stepping together (a reference from before the ranks shared
    it: rank 0 alone), steps and threads."""
    ranks = adam.get("ranks")
    who = (f"{ranks} rank(s) stepping {adam['params'] // ranks:,} each at the same time" if ranks
           else "rank 0 alone, the other ranks waiting")
    return (f"{adam['params']:,} fp32 parameters in all, {who}; median of {adam['repeats']} steps, "
            f"{adam['threads']} CPU thread(s) per rank")


def adam_table(bench: dict) -> str:
    """The Adam benchmark: milliseconds per step (every rank's share stepped), nanoseconds per parameter of the
    host (or, for the GPU row, of one GPU's share), and each step time against DeepSpeed's CPU Adam's.
    Timings: print where nbval does not compare."""

    adam = bench["adam"]
    base = adam["seconds"]["DeepSpeedCPUAdam"]
    rows = [[name, f"{s * 1000:.1f}", f"{s / adam['params'] * 1e9:.2f}", f"{s / base:.1f}x"]
            for name, s in adam["seconds"].items()]
    if adam["accelerator_adamw_seconds"]:
        s = adam["accelerator_adamw_seconds"]
        rows.append([f"torch.optim.AdamW(fused=True) on {adam['accelerator']}", f"{s * 1000:.2f}",
                     f"{s / adam.get('accelerator_params', adam['params']) * 1e9:.3f}", f"{s / base:.2f}x"])
    return (records.format_table(rows, ["optimizer", "ms per step", "ns per parameter", "vs DeepSpeedCPUAdam"])
            + f"\n({_benchmark_conditions(adam)})")


def agreement_table(bench: dict, tolerance: float = 1e-6) -> str:
    """Whether each optimizer's weights after one step agree within ``tolerance`` with AdamW's first step in
    closed form (:func:`adamw_first_step`): each kernel against the paper's formula, not against another kernel."""

    rows = [[name, f"within {tolerance:.0e}" if diff <= tolerance else f"differ by more than {tolerance:.0e}"]
            for name, diff in bench["adam"]["max_difference_from_formula"].items()]
    return records.format_table(rows, ["optimizer", "weights after one step vs AdamW's formula"])


def adam_verdicts(bench: dict, load: load_guard.Load | None, base: str = "DeepSpeedCPUAdam") -> str:
    """DeepSpeed's CPU Adam against each torch optimizer of the benchmark, through the course's load guard
    (:func:`helpers.core.load_guard.compare`, with the repeat of the first optimizer timed at the end): a
    verdict only where the launch had its devices to itself (``load``). A reference that kept medians only
    gets none."""
    adam = bench["adam"]
    if "steps_s" not in adam:
        return "No verdict: this result kept only each optimizer's median step, not the steps' spread."
    lines = [f"Load beside the launch: {load.reason() or 'none, it had its devices to itself'}." if load else
             "Load beside the launch: not recorded."]
    for name, steps in adam["steps_s"].items():
        if name != base:
            verdict = load_guard.compare({base: adam["steps_s"][base], name: steps}, load, repeat=adam["again_s"])
            lines.append(f"{name}: {load_guard.sentence(verdict)}")
    return "\n".join(lines)


def fused_sentence(bench: dict, load: load_guard.Load | None, fused: str = "torch.optim.AdamW(fused=True)",
                   base: str = "DeepSpeedCPUAdam") -> str:
    """One sentence on torch's fused AdamW against DeepSpeed's CPU Adam in the benchmark: that it stepped faster
    on this machine only where the load guard gives that verdict (:func:`helpers.core.load_guard.compare`, the
    first optimizer's repeat included); otherwise the medians and why no ranking is printed."""
    adam = bench["adam"]
    if fused not in adam["seconds"] or base not in adam["seconds"]:
        return f"The benchmark did not step both {base} and {fused}."
    if "steps_s" not in adam:
        return "No ranking: this result kept only each optimizer's median step, not the steps' spread."
    v = load_guard.compare({base: adam["steps_s"][base], fused: adam["steps_s"][fused]}, load, repeat=adam["again_s"])
    figures = f"{v.medians[1] * 1e3:.2f} ms against {v.medians[0] * 1e3:.2f} ms per step"
    if v.given:
        return (f"On this machine {v.faster} stepped faster ({fused} {figures}), beyond the steps' spread."
                if v.faster == fused else f"{fused} did not beat {base} on this machine ({figures}).")
    return f"No ranking of {fused} against {base} ({figures}) from this run: {v.withheld}."


def step_verdicts(runs: Mapping[str, records.Record], again: records.Record, load: load_guard.Load) -> str:
    """Each offloading run's step times against its stage without offload, through the course's load guard: a
    verdict only where the launch had its devices to itself (``load``), the difference exceeds the steps' spread
    and, for the first run's stage, that run trained ``again`` at the end stayed within its spread. Steps after
    each run's first (which warms up)."""
    steps = _steps
    first = next(iter(runs))
    if not load.alone:  # one line says it for every run
        return f"Every verdict below is withheld: {load.reason()}."
    lines = [f"Load beside the launch: none, it had its devices to itself.",
             f"{again.name}: the load guard's repeat, {first} trained again at the end "
             f"({statistics.median(steps(again)) * 1e3:.3g} ms against {statistics.median(steps(runs[first])) * 1e3:.3g} ms "
             f"at the start): where the two differ by more than their spread, the machine's speed changed during "
             f"the launch and every verdict against {first} is withheld."]
    for name, r in runs.items():
        base = f"stage {r.stage}"
        if name != base and base in runs:
            verdict = load_guard.compare({base: steps(runs[base]), name: steps(r)}, load,
                                         repeat=steps(again) if base == first else None)
            lines.append(f"{name}: {load_guard.sentence(verdict)}")
    return "\n".join(lines)


def reference_step_verdicts(name: str = "offload") -> str:
    """The step times of every committed GPU result of the chapter's experiment, labelled with its device and
    date: each pinned offloading run against its unpinned twin and against its stage without offload, through
    :func:`helpers.core.load_guard.compare` under the reference's written conditions
    (:meth:`~helpers.core.load_guard.Load.from_conditions`), steps after each run's first; then its pinned and
    pageable copy bandwidths (:func:`transfer_table`)."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    parts = []
    for (device, date, note, runs), conditions in zip(found, references.reference_conditions(name)):
        trained = {k: r for k, r in runs.items() if not isinstance(r, dict)}
        load = load_guard.Load.from_conditions(conditions)
        rows, reasons, both = [], set(), None
        for run, r in trained.items():
            if run.endswith("unpinned"):
                continue
            for other in (f"stage {r.stage}", f"{run}, unpinned", run.replace(" and param", "")):
                if other in trained and other != run:
                    v = load_guard.compare({run: _steps(r), other: _steps(trained[other])}, load)
                    reasons.add(v.withheld)
                    rows.append([run, other, f"{v.medians[0] * 1e3:.0f} vs {v.medians[1] * 1e3:.0f}",
                                 f"{v.spread:.0%}", f"{v.faster} faster" if v.given else "withheld"])
                    if other == run.replace(" and param", "") != run:  # parameter offload against optimizer offload
                        both = v
        lines = [f"GPU reference, {device}, {date} ({note}; medians of the steps after the first):",
                 records.format_table(rows, ["run", "against", "ms", "spread", "verdict"])]
        lines += [f"withheld: {why}" for why in sorted(reasons) if why]
        if both:
            lines.append(_offload_order_sentence(both))
        bench = next((r for r in runs.values() if isinstance(r, dict) and r.get("task") == "benchmark"), None)
        if bench and bench.get("transfers"):
            lines += ["", transfer_table(bench)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def reference_headline(name: str = "offload") -> str:
    """The chapter's timing lesson from the first committed GPU result of the experiment, labelled with its
    device, date and written conditions: optimizer offload's step against no offload at stages 2 and 3, pinned
    against unpinned, each through :func:`helpers.core.load_guard.compare` under those conditions (steps after
    each run's first), then the host-to-device copy bandwidth, pinned against pageable."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    (device, date, note, runs), conditions = found[0], references.reference_conditions(name)[0]
    load = load_guard.Load.from_conditions(conditions)
    lines = [f"GPU reference: {device}, {date} ({note}); conditions: {conditions} "
             f"({'the load guard judges these steps' if load.alone else 'not alone: every verdict withheld'})"]
    for run, other, short in (("stage 2 + optimizer offload", "stage 2", ("offload", "no offload")),
                              ("stage 3 + optimizer offload", "stage 3", ("offload", "no offload")),
                              ("stage 2 + optimizer offload", "stage 2 + optimizer offload, unpinned",
                               ("pinned", "unpinned"))):
        if run in runs and other in runs:
            v = load_guard.compare({short[0]: _steps(runs[run]), short[1]: _steps(runs[other])}, load)
            verdict = f"{v.faster} faster" if v.given else f"withheld: {v.withheld}"
            lines.append(f"  {run}: {v.medians[0] * 1e3:.0f} ms per step, {short[1]} {v.medians[1] * 1e3:.0f} ms "
                         f"({v.medians[0] / v.medians[1]:.1f}x; {verdict})")
    bench = next((r for r in runs.values() if isinstance(r, dict) and r.get("task") == "benchmark"), None)
    rates = (bench or {}).get("transfers", {}) or {}
    rates = rates.get("bytes_per_s", {})
    if "host_to_device_pinned" in rates and "host_to_device_pageable" in rates:
        pinned, pageable = rates["host_to_device_pinned"], rates["host_to_device_pageable"]
        lines.append(f"  host-to-device copies: {pinned / 1e9:.1f} GB/s pinned against {pageable / 1e9:.1f} GB/s "
                     f"pageable ({pinned / pageable:.1f}x)")
    return "\n".join(lines)


def _offload_order_sentence(verdict: load_guard.Verdict) -> str:
    """What a reference's parameter-offload run against its optimizer-only offload run says: the load guard's
    verdict, and why the chapter draws no rule from it (the guard watches GPUs; CPU Adam runs on host cores)."""
    params, optimizer = verdict.names
    figures = f"{params} {verdict.medians[0] * 1e3:.0f} ms against {optimizer} {verdict.medians[1] * 1e3:.0f} ms"
    if not verdict.given:
        return f"Parameter offload against optimizer offload alone: {figures}, withheld ({verdict.withheld})."
    return (f"Parameter offload against optimizer offload alone: {figures}, a {verdict.ratio - 1:.0%} difference "
            f"beyond the steps' spread ({verdict.spread:.0%}), so not noise in this run; but both steps run "
            "CPU Adam on host cores the guard does not watch, so the chapter draws no rule from the order.")


def stage3_bucket_bytes(dtype_bytes: int = 2) -> int:
    """Bytes of the gradient bucket stage 3 allocates on the accelerator with DeepSpeed's default
    ``reduce_bucket_size`` (read from its ``DeepSpeedZeroConfig``), in a ``dtype_bytes``-byte dtype."""
    DeepSpeedZeroConfig = ds.load("deepspeed.runtime.zero.config").DeepSpeedZeroConfig
    return DeepSpeedZeroConfig().reduce_bucket_size * dtype_bytes


def bucket_sentence(runs: Mapping[str, records.Record], rank: int = 0) -> str:
    """What the accelerator-side buffer of the stage 3 runs is: DeepSpeed's reduce bucket (``reduce_bucket_size``
    elements, made with ``torch.empty`` at start-up when ``contiguous_gradients`` is on), against the run's peak
    RSS, which on CPU ranks counts only the pages the gradients touched."""
    stage3 = {name: r for name, r in runs.items() if r.stage == 3}
    buffers = {r.memory.placement(rank)["accelerator"]["buffers"] for r in stage3.values()}
    if not stage3 or buffers == {0}:
        return "No stage 3 run holds an accelerator buffer."
    size = max(buffers)
    peak = max(r.memory.host_peak(rank) for r in stage3.values())
    elements = ds.load("deepspeed.runtime.zero.config").DeepSpeedZeroConfig().reduce_bucket_size
    rss = "ru_maxrss" in next(iter(stage3.values())).memory.peak_source
    where = ("It is larger than the runs' peak RSS because on CPU ranks torch.empty's untouched pages take no "
             "memory and these gradients fill only its start; on a GPU the allocator holds all of it."
             if rss and peak < size else "The GPU's allocator holds all of it." if not rss else
             "The runs' peak RSS holds it.")
    return (f"Stage 3's accelerator buffer ({format_bytes(size)} in every stage 3 run, with or without offload) is "
            f"DeepSpeed's reduce bucket, not a model state: {elements:,} elements of the default reduce_bucket_size, "
            f"allocated at start-up whatever the model's size. {where} The zero_optimization key "
            "reduce_bucket_size sizes it.")


def transfer_table(bench: dict) -> str:
    """Host-device copy bandwidth in GB/s (GPU only)."""

    if not bench.get("transfers"):
        return "no GPU here: no host-device copies to measure (the ranks' memory is the host's)"
    rows = [[key.replace("_", " "), f"{value / 1e9:.1f}"] for key, value in bench["transfers"]["bytes_per_s"].items()]
    return records.format_table(rows, ["copy", "GB/s"]) + f"\n({bench['transfers']['bytes'] / 2**20:.0f} MiB per copy)"


def measured_host_grad_bytes(runs: Mapping[str, object], rank: int = 0) -> dict[int, float]:
    """Stage -> host-side gradient bytes per element of the rank's partition that DeepSpeed kept in the
    offloading runs of ``runs`` (the largest, where several runs of a stage offload)."""
    found: dict[int, float] = {}
    for r in runs.values():
        grads = r.memory.placement(rank)["host"]["grads"]
        if grads:
            found[r.stage] = max(found.get(r.stage, 0.0), grads / (r.params / r["world_size"]))
    return found


def host_bytes_per_parameter(stage: int, world_size: int, mode: str, grad_bytes: float | None = None,
                             precision: str = "fp16") -> float:
    """Host model-state bytes per rank for each parameter of the model: the formula's
    (:func:`helpers.core.theory.bytes_per_parameter`, one working-precision gradient per partition element),
    or with ``grad_bytes`` host gradient bytes per partition element instead (what DeepSpeed keeps, as
    :func:`measured_host_grad_bytes` measures it)."""
    paper = theory.bytes_per_parameter(stage, world_size, mode, precision)["host"]
    if mode == "none" or grad_bytes is None:
        return paper
    return paper + (grad_bytes - theory.BYTES_PER_ELEMENT[precision]) / world_size


def _largest(accelerator_gb: float, stage: int, world_size: int, mode: str, host_gb: float | None, reserve_gb: float,
             host_slope: float, precision: str) -> tuple[float, str]:
    """(largest model in parameters, what limits it) with ``host_slope`` host bytes per parameter per rank."""
    fit = theory.largest_model(accelerator_gb * 1e9, stage, world_size, mode, None, reserve_gb * 1e9, precision)
    host_limit = host_gb * 1e9 / (host_slope * world_size) if host_gb is not None and host_slope else math.inf
    limit = "host memory" if host_limit < fit["accelerator_limit"] else "accelerator memory"
    return min(fit["accelerator_limit"], host_limit), limit


def largest_model_table(accelerator_gb: float, world_size: int, host_gb: float | None = None, reserve_gb: float = 0.0,
                        precision: str = "fp16", host_grad_bytes: Mapping[int, float] | None = None) -> str:
    """The largest model (billions of parameters) whose model states fit ``world_size`` devices of
    ``accelerator_gb`` GB each (keeping ``reserve_gb`` per device for activations and buffers), with
    ``host_gb`` of host memory in all, for each stage and offload mode, and which side limits it.

    With ``host_grad_bytes`` (stage -> host gradient bytes per partition element, as measured by
    :func:`measured_host_grad_bytes`) the host side is planned with what DeepSpeed keeps, beside the
    formula's (2 + K)Ψ/N_d."""

    rows = []
    for stage, mode in ((0, "none"), (2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"),
                        (3, "optimizer+params")):
        slopes = theory.bytes_per_parameter(stage, world_size, mode, precision)
        host_slopes = [slopes["host"]]
        if host_grad_bytes is not None:
            host_slopes.append(host_bytes_per_parameter(stage, world_size, mode, host_grad_bytes.get(stage), precision))
        row = [f"stage {stage}" + ("" if mode == "none" else f" + {mode} offload"), f"{slopes['accelerator']:.2f}",
               *(f"{slope:.2f}" for slope in host_slopes)]
        for slope in host_slopes:
            params, limit = _largest(accelerator_gb, stage, world_size, mode, host_gb, reserve_gb, slope, precision)
            row += ["unbounded" if math.isinf(params) else f"{params / 1e9:.1f}", "-" if math.isinf(params) else limit]
        rows.append(row)
    if host_grad_bytes is None:
        headers = ["ZeRO", "accelerator B/param/rank", "host B/param/rank", "largest model (B params)", "limited by"]
    else:
        headers = ["ZeRO", "accelerator B/param/rank", "host B/param/rank: formula", "host: DeepSpeed, measured",
                   "largest (B): formula", "limited by", "largest (B): measured", "limited by"]
    return records.format_table(rows, headers)


def agreement(runs: Mapping[str, object]) -> str:
    """Each offloading run's losses against its stage without offload (within the precision's tolerance)."""

    rows = []
    for name, r in runs.items():
        base_name = f"stage {r.stage}"
        if name == base_name or base_name not in runs:
            continue
        base = runs[base_name]
        rows.append([name, base_name, records.loss_agreement(base.losses, r.losses, r["precision"])])
    return records.format_table(rows, ["run", "compared with", "losses"])


def host_gradient_bytes(runs: Mapping[str, object], rank: int = 0) -> str:
    """Host-side gradient bytes per element of the rank's partition, per offloading run: what DeepSpeed keeps
    for the optimizer where the paper counts one gradient in the working precision."""
    rows = []
    for name, r in runs.items():
        p = r.memory.placement(rank)
        if not p["host"]["grads"]:
            continue
        partition = r.params / r["world_size"]
        rows.append(f"{name}: {p['host']['grads'] / partition:.2f} bytes per partition element "
                    f"(dtypes {', '.join(p['dtypes']['grads'])}; gradient_accumulation_steps {r.grad_accum})")
    return "\n".join(rows)


def _per_reference(name: str, table: Callable[[dict], str]) -> str:
    """``table`` of the runs of every committed GPU result of experiment ``name``, each labelled with its device
    and date (the conditions are printed once, by :func:`how_measured`)."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    return "\n\n".join(f"GPU reference, {device}, {date}:\n" + table({k: r for k, r in runs.items() if not isinstance(r, dict)})
                        for device, date, note, runs in found)


def reference_host_gradient_bytes(name: str = "offload") -> str:
    """:func:`host_gradient_bytes` of every committed GPU result of the chapter's experiment, labelled with its device."""
    return _per_reference(name, host_gradient_bytes)


def pinned_table(runs: Mapping[str, object], rank: int = 0) -> str:
    """Per offloading run: the host bytes (model states and buffers) on ``rank`` and how many of them are
    pinned (page-locked), with the run's ``pin_memory`` settings; where some run pins, how many pin less than
    they hold or pin unasked; then :func:`pinning_advice`."""
    rows, partly, unasked = [], 0, []
    for name, r in runs.items():
        p = r.memory.placement(rank)
        host = sum(p["host"][k] for k in STATE_NAMES) + p["host"]["buffers"]
        if not host:
            continue
        zero = r["config"].get("zero_optimization", {})
        pins = "; ".join(f"{key}.pin_memory {str(zero[key].get('pin_memory', True)).lower()}"
                         for key in ("offload_optimizer", "offload_param")
                         if zero.get(key, {}).get("device", "none") != "none" and (key != "offload_param" or r.stage == 3))
        if not pins:
            continue
        rows.append([name, pins, format_bytes(host), format_bytes(p["pinned_bytes"])])
        partly += "true" in pins and p["pinned_bytes"] < host
        if "true" not in pins and p["pinned_bytes"]:
            unasked.append(name)
    asked = sum("true" in row[1] for row in rows)
    table = records.format_table(rows, ["run", "settings", "host bytes (states + buffers)", "pinned"])
    if not any(r.memory.placement(rank)["pinned_bytes"] for r in runs.values()):  # CPU ranks: the counts say nothing
        return table + "\n" + pinning_advice(runs, rank)
    return (table + f"\nruns with pin_memory true that pin less than their host bytes: {partly} of {asked}"
            + f"\nruns with every pin_memory false that still pin bytes: {', '.join(unasked) or 'none'}"
            + "\n" + pinning_advice(runs, rank))


def pinning_advice(runs: Mapping[str, object], rank: int = 0) -> str:
    """What a user budgets as pinned memory, from the offloading runs' placement on ``rank``: the pinned bytes per
    element of the rank's partition in each run, whether Adam's states stay unpinned (every run pins at most its
    host bytes minus them), and which runs pin their host parameter shards although ``pin_memory`` is false."""
    per_element, moments_free, forced = [], True, []
    for name, r in runs.items():
        p = r.memory.placement(rank)
        host = sum(p["host"][k] for k in STATE_NAMES) + p["host"]["buffers"]
        if not host:
            continue
        per_element.append((name, p["pinned_bytes"] / (r.params / r["world_size"])))
        moments_free &= p["pinned_bytes"] <= host - p["host"]["optimizer"]
        zero = r["config"].get("zero_optimization", {})
        if p["pinned_bytes"] and not any(zero.get(k, {}).get("pin_memory", True) for k in ("offload_optimizer", "offload_param")
                                         if zero.get(k, {}).get("device", "none") != "none"):
            forced.append(f"{name} ({format_bytes(p['pinned_bytes'])}, its host parameters "
                          f"{format_bytes(p['host']['params'])})")
    if not any(b for _, b in per_element):
        return ("For a user: nothing is pinned here (DeepSpeed's CPU accelerator skips pinning); on GPUs "
                "budget pinned memory from a GPU run's table.")
    rates = ", ".join(f"{name} {b:.1f}" for name, b in per_element if b)
    return (f"For a user: pinned memory cannot be swapped out, so all ranks' pinned bytes must fit in RAM together. "
            f"Budget per rank these pinned bytes per partition element times Ψ/N_d: {rates}. "
            + ("Adam's states are never pinned (each run pins at most its host bytes minus them). "
               if moments_free else "")
            + (f"pin_memory false did not stop {'; '.join(forced)}." if forced else ""))


def zero_offload_headline(gpu_gb: float = 32, host_gb: float = 1500, pytorch_largest: float = 1.4e9,
                          offload_largest: float = 13e9, host_grad_bytes: float | None = None) -> str:
    """The ZeRO-Offload paper's headline recomputed: one V100 of ``gpu_gb`` GB, ``host_gb`` GB of host memory (a
    DGX-2), against the largest models the paper trained (1.4B with PyTorch alone, 13B with ZeRO-Offload).
    With ``host_grad_bytes`` (host gradient bytes per element, as measured), the host side is also planned
    with what DeepSpeed keeps."""

    rows = []
    for label, stage, mode, trained in (("PyTorch / stage 0, no offload", 0, "none", pytorch_largest),
                                        ("ZeRO-Offload (stage 2 + optimizer offload)", 2, "optimizer", offload_largest)):
        fit = theory.largest_model(gpu_gb * 1e9, stage, 1, mode, host_gb * 1e9)
        slopes = theory.bytes_per_parameter(stage, 1, mode)
        row = [label, f"{slopes['accelerator']:.0f}", f"{slopes['host']:.0f}"]
        if host_grad_bytes is not None:
            host = host_bytes_per_parameter(stage, 1, mode, host_grad_bytes)
            row += [f"{host:.0f}", "-" if not host else f"{host_gb * 1e9 / host / 1e9:.0f}"]
        rows.append(row + [f"{fit['params'] / 1e9:.1f}", f"{trained / 1e9:.1f}", f"{trained / fit['params']:.0%}"])
    measured = [] if host_grad_bytes is None else ["host B/param: DeepSpeed, measured", "host limit (B), measured"]
    return records.format_table(rows, ["1 GPU", "GPU B/param", "host B/param: formula", *measured,
                                       "GPU limit (B), formula", "paper trained (B)", "share of the GPU limit"])


def headline_sentence(host_grad_bytes: float, host_gb: float = 1500, offload_largest: float = 13e9,
                      pytorch_largest: float = 1.4e9, gpu_gb: float = 32) -> str:
    """The tenfold claim in bytes, from the formulas and the measured host gradient bytes per element:
    what one GPU keeps per parameter without and with optimizer offload, how far ``host_gb`` of host memory
    goes at the host bytes DeepSpeed keeps, and which side limited the paper's trained size."""
    before = theory.bytes_per_parameter(0, 1, "none")["accelerator"]
    after = theory.bytes_per_parameter(2, 1, "optimizer")["accelerator"]
    paper_host = theory.bytes_per_parameter(2, 1, "optimizer")["host"]
    host = host_bytes_per_parameter(2, 1, "optimizer", host_grad_bytes)
    fits = host_gb * 1e9 / host
    gpu_limit = theory.largest_model(gpu_gb * 1e9, 2, 1, "optimizer")["params"]
    side = (f"the GPU, not the host, limited the paper's {offload_largest / 1e9:.0f}B ({gpu_gb:g} GB at {after:.0f} "
            f"bytes per parameter hold {gpu_limit / 1e9:.0f}B before activations)" if gpu_limit < fits else
            f"the host limited it first ({fits / 1e9:.0f}B against the GPU's {gpu_limit / 1e9:.0f}B)")
    return (f"One GPU keeps {before:.0f} bytes per parameter without offload and {after:.0f} with optimizer offload "
            f"({before / after:.0f}x fewer; the paper's {offload_largest / 1e9:.0f}B against PyTorch's "
            f"{pytorch_largest / 1e9:.1f}B is {offload_largest / pytorch_largest:.1f}x). The host keeps {host:.0f} bytes "
            f"per parameter as DeepSpeed runs it (the formula: {paper_host:.0f}), so {host_gb / 1000:g} TB of host "
            f"memory holds the model states of {fits / 1e9:.0f}B parameters: {side}.")


def reference_pinned_report(name: str = "offload") -> str:
    """:func:`pinned_table` of every committed GPU result of the chapter's experiment, labelled with its device."""
    return _per_reference(name, pinned_table)


def pinning_rule(name: str = "offload", rank: int = 0) -> str:
    """A rule of thumb for pinned host memory from the first committed GPU result of the experiment: what
    ``pin_memory`` pinned (never Adam's states), and the most pinned bytes per element of the rank's
    partition among its runs with optimizer offload alone and with parameter offload, to budget per rank."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    device, date, _, runs = found[0]
    worst: dict[str, float] = {}
    moments_free, forced = True, False
    for run, r in runs.items():
        if isinstance(r, dict):
            continue
        p = r.memory.placement(rank)
        if not p["pinned_bytes"]:
            continue
        moments_free &= p["pinned_bytes"] <= sum(p["host"][k] for k in STATE_NAMES) + p["host"]["buffers"] - p["host"]["optimizer"]
        mode = offload_mode(r)
        worst[mode] = max(worst.get(mode, 0.0), p["pinned_bytes"] / (r.params / r["world_size"]))
        zero = r["config"].get("zero_optimization", {})
        forced |= not any(zero.get(k, {}).get("pin_memory", True) for k in ("offload_optimizer", "offload_param")
                          if zero.get(k, {}).get("device", "none") != "none")
    if not worst:
        return f"GPU reference, {device}, {date}: no run pinned anything."
    budget = ", ".join(f"{b:.1f}" + (" pinned bytes per partition element (times Ψ/N_d)" if i == 0 else "")
                       + f" with {mode} offload" for i, (mode, b) in enumerate(sorted(worst.items())))
    return (f"Rule of thumb (GPU reference, {device}, {date}): pin_memory pins the host buffers the GPU copies "
            f"to and from (the fp32 master, its gradient, staging buffers, with parameter offload the parameter "
            f"shards){', never Adam' + chr(39) + 's states' if moments_free else ''}. Budget per rank up to "
            f"{budget}; all ranks' pinned bytes must fit in "
            f"RAM together: pinned pages cannot be swapped out."
            + (" pin_memory false does not stop parameter offload pinning its shards." if forced else ""))


def reference_report(name: str = "offload") -> str:
    """Every committed GPU result of the chapter's experiment: placement, step time and peaks, the Adam
    benchmark and host-device bandwidth, each labelled with its device."""

    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    parts = []
    for device, date, note, runs in found:
        trained = {k: r for k, r in runs.items() if not isinstance(r, dict)}
        bench = next((r for r in runs.values() if isinstance(r, dict) and r.get("task") == "benchmark"), None)
        parts.append(f"Measured on {device}, {date} ({note}):\n{placement_table(trained)}\n\n{timing_table(trained)}"
                     + (f"\n\n{adam_table(bench)}\n\n{transfer_table(bench)}" if bench else ""))
    return "\n\n".join(parts)


def when_to_use_table(runs: Mapping[str, object], baseline: str, rank: int = 0) -> str:
    """Per run against ``baseline``: accelerator-side model states (ratio), host-side model states (bytes),
    the parameters kept on the accelerator (ratio), and whether the losses agree."""

    def side(r, name: str) -> int:
        p = r.memory.placement(rank)
        return sum(p[name][k] for k in STATE_NAMES)

    base = runs[baseline]
    rows = []
    for name, r in runs.items():
        p = r.memory.placement(rank)
        b = base.memory.placement(rank)
        rows.append([name, f"{side(r, 'accelerator') / side(base, 'accelerator'):.2f}x",
                     records.format_bytes(side(r, "host")),
                     f"{p['accelerator']['params'] / b['accelerator']['params']:.2f}x",
                     records.loss_agreement(base.losses, r.losses, r["precision"])])
    return records.format_table(rows, ["run", f"accelerator states vs {baseline}", "host states",
                                       f"accelerator params vs {baseline}", "losses"])


# --- figures ----------------------------------------------------------------------------------------

def placement_bars(runs: Mapping[str, records.Record], rank: int = 0, title: str | None = None):
    """Per run, two stacked bars of model-state MiB on ``rank``: the accelerator side and the host side,
    by kind of state (buffers left out: the tables show them)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(1.8 + 1.4 * len(runs), 4.0))
    width, labelled = 0.38, set()
    for i, (name, run) in enumerate(runs.items()):
        placement = run.memory.placement(rank)
        for offset, side, hatch in ((-width / 2, "accelerator", ""), (width / 2, "host", "..")):
            bottom = 0.0
            for key in records.MODEL_STATE_KEYS:
                value = placement[side][key] / 2**20
                if value:
                    ax.bar(i + offset, value, width, bottom=bottom, color=plots.STATE_COLOURS[key], hatch=hatch,
                           edgecolor="white", label=None if key in labelled else key)
                    labelled.add(key)
                    bottom += value
    ax.set_xticks(range(len(runs)), [textwrap.fill(name, 16) + "\nA | H" for name in runs], fontsize=7)
    ax.set_ylabel(f"MiB on rank {rank}")
    ax.set_title(title or "Model states: accelerator side (A) | host side (H, dotted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def largest_model(accelerator_gb: Sequence[float], world_size: int, reserve_gb: float = 0.0,
                  host_gb: float | None = None, host_grad_bytes: Mapping[int, float] | None = None,
                  modes: Sequence[tuple[int, str]] = ((0, "none"), (2, "none"), (2, "optimizer"), (3, "none"),
                                                      (3, "optimizer"), (3, "optimizer+params")),
                  precision: str = "bf16"):
    """Largest model (billions of parameters) whose model states fit, against the memory per device, one line
    per stage and offload mode: the smaller of the accelerator's limit and, with ``host_gb`` of host memory in
    all, the host's (planned with ``host_grad_bytes`` as :func:`largest_model_table` does), so a line turns flat
    where the host limits it."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    accelerator_gb = [gb for gb in accelerator_gb if gb > reserve_gb]  # a device smaller than the reserve fits nothing
    plotted: dict[str, list[float]] = {}
    for i, (stage, mode) in enumerate(modes):
        grad = None if host_grad_bytes is None else host_grad_bytes.get(stage)
        slope = host_bytes_per_parameter(stage, world_size, mode, grad, precision)
        sizes = [_largest(gb, stage, world_size, mode, host_gb, reserve_gb, slope, precision)[0] / 1e9
                 for gb in accelerator_gb]
        label = f"stage {stage}" + ("" if mode == "none" else f" + {mode} offload")
        same = next((other for other, drawn in plotted.items() if drawn == sizes), None)
        plotted[label] = sizes
        ax.plot(accelerator_gb, sizes, marker="os^vDx"[i % 6], linestyle=["-", "--", ":", "-."][i % 4],
                linewidth=1.5 if same is None else 3.0, alpha=1.0 if same is None else 0.5,
                label=label if same is None else f"{label} (same as {same})", zorder=1 if same else 2)
    host = "" if host_gb is None else f", {host_gb:g} GB host"
    ax.set(xlabel="accelerator memory per device (GB)", ylabel="largest model (B parameters)", yscale="log",
           title=f"Model states that fit {world_size} device(s){host} ({precision} mixed precision, K=12)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- formulas ---------------------------------------------------------------------------------------

def offload_traffic_bytes(psi: float, world_size: int, offload: str, precision: str = "fp16",
                          grad_bytes: int = 4) -> dict[str, float]:
    """Bytes each rank moves between accelerator and host per optimizer step (the ZeRO-Offload design):
    its gradient partition down (``grad_bytes`` per element: DeepSpeed 0.19 keeps the host copy in fp32;
    the paper counts 2) and its updated parameter partition up in the working precision. With parameter
    offload the updated shard stays on the host and goes up twice instead, for the forward and for the
    backward (stage 3 gathers it each time)."""
    if offload not in theory.OFFLOAD_MODES:
        raise ValueError(f"offload {offload!r}: choose one of {', '.join(theory.OFFLOAD_MODES)}")
    if offload == "none":
        return {"to_host": 0.0, "to_accelerator": 0.0}
    width = theory.BYTES_PER_ELEMENT[precision]
    shard = psi / world_size
    up = width * shard * (2 if offload == "optimizer+params" else 1)
    return {"to_host": grad_bytes * shard, "to_accelerator": up}


def offload_step_cost_s(psi: float, world_size: int, offload: str, to_host_bytes_per_s: float,
                        to_accelerator_bytes_per_s: float, host_adam_s_per_param: float,
                        accelerator_adam_s_per_param: float = 0.0, precision: str = "fp16") -> dict[str, float]:
    """Seconds an optimizer step gains by offloading, if nothing overlaps, for ``world_size`` GPUs on ONE host.

    - copies: each rank's :func:`offload_traffic_bytes` at the measured bandwidths, every GPU over a link of
      its own (so the ranks copy side by side);
    - Adam: the host steps every rank's partition, ``psi`` parameters in all, on the cores the ranks share:
      ``psi * host_adam_s_per_param``, the host's seconds per parameter as :func:`adam_benchmark` measures
      them (all ranks stepping together, or one process using every core); minus one GPU's Adam step of
      its partition, which the GPUs would have run side by side.

    An upper bound for a host like the benchmark's: DeepSpeed overlaps some copies with the backward, and a
    host with more cores (or memory bandwidth) steps faster."""
    traffic = offload_traffic_bytes(psi, world_size, offload, precision)
    shard = psi / world_size
    copies = traffic["to_host"] / to_host_bytes_per_s + traffic["to_accelerator"] / to_accelerator_bytes_per_s
    adam = psi * host_adam_s_per_param - shard * accelerator_adam_s_per_param
    return {"copies_s": copies, "adam_s": adam, "total_s": copies + adam}


def host_adam_s_per_param(bench: dict) -> float:
    """The host's seconds per parameter of DeepSpeed's CPU Adam in a benchmark result: the step time of all
    the parameters the ranks stepped together (or rank 0 alone stepped, in a result from before they shared it)."""
    return bench["adam"]["seconds"]["DeepSpeedCPUAdam"] / bench["adam"]["params"]


def cost_lines(bench: dict, label: str, gpus: int = 8, psis: Sequence[float] = (1e9, 7e9),
               load: load_guard.Load | None = None) -> str:
    """:func:`offload_step_cost_s` for ``psis`` parameters on ``gpus`` GPUs of one host, from one benchmark
    result (``label`` names where it was measured): its host's CPU Adam rate and, where it ran on a GPU, its
    copy bandwidths and the GPU's fused AdamW. Without a GPU, the Adam part alone. With the ``load`` recorded
    beside the benchmark, the first line says when other processes shared the machine (the rate is then low)."""
    adam = bench["adam"]
    host = host_adam_s_per_param(bench)
    shared = f"; measured while {load.reason()}, so alone it may step faster" if load and not load.alone else ""
    old = ("; the older method: one rank stepped every parameter while the others waited, so this rate does not "
           "compare with one measured with every rank stepping at once") if not adam.get("ranks") else ""
    lines = [f"{label}: DeepSpeedCPUAdam {host * 1e9:.2f} ns per parameter for the host "
             f"({_benchmark_conditions(adam)}{shared}{old})"]
    return "\n".join(lines + _cost_rows(bench, host, gpus, psis))


def _cost_rows(bench: dict, host: float, gpus: int, psis: Sequence[float], bound: bool = False) -> list[str]:
    """One line per ``psis`` (and offload mode, where ``bench`` ran on a GPU) of :func:`offload_step_cost_s` at
    ``host`` seconds per parameter for the host's CPU Adam; ``bound``: that rate is an upper bound."""
    lines = []
    transfers = (bench.get("transfers") or {}).get("bytes_per_s")
    for psi in psis:
        if not transfers:
            lines.append(f"  {psi / 1e9:.0f}B parameters: the host's CPU Adam takes {psi * host:.2f} s per step, "
                         f"however many GPUs share it (no GPU here: copies not measured)")
            continue
        adam = bench["adam"]
        device = adam["accelerator_adamw_seconds"] / adam.get("accelerator_params", adam["params"])
        for mode in ("optimizer", "optimizer+params"):
            cost = offload_step_cost_s(psi, gpus, mode, transfers["device_to_host_pinned"],
                                       transfers["host_to_device_pinned"], host, device)
            lines.append(f"  {psi / 1e9:.0f}B parameters on {gpus} GPUs of one such host, {mode} offload: "
                         f"{'at most' if bound else 'up to'} {cost['total_s']:.2f} s more per step "
                         f"({cost['copies_s']:.2f} s copies, {cost['adam_s']:.2f} s Adam)")
    return lines


def bounded_cost_lines(bench: dict, runs: Mapping[str, records.Record], label: str, gpus: int = 8,
                       psis: Sequence[float] = (1e9, 7e9), run: str = "stage 2 + optimizer offload") -> str:
    """:func:`offload_step_cost_s` at the CPU Adam rate the offloaded training step ``run`` bounds (its whole step,
    CPU Adam included, over its parameters: the host steps no slower), with ``bench``'s copy bandwidths; and one
    line on why ``bench``'s own CPU Adam timing reads slower (its threads per rank on shared host cores)."""
    r = runs[run]
    step = statistics.median(_steps(r))
    bound = step / r.params
    adam = bench["adam"]
    lines = [f"{label}: its '{run}' step ({step * 1e3:.0f} ms for {r.params:,} parameters) includes the host's "
             f"whole CPU Adam step, so that host steps {bound * 1e9:.2f} ns per parameter or faster:"]
    lines += _cost_rows(bench, bound, gpus, psis, bound=True)
    if host_adam_s_per_param(bench) > bound:
        lines.append(f"  (Its CPU Adam benchmark reads slower, as the how-measured cell above says: its {adam.get('ranks', 1)} ranks "
                     f"ran {adam['threads']} threads each on host cores other work shared, so threads waited for cores.)")
    return "\n".join(lines)


def adam_rate_bounds(bench: dict, runs: Mapping[str, records.Record], label: str, psi: float = 7e9,
                     run: str = "stage 2 + optimizer offload") -> str:
    """Three readings of one result's CPU Adam rate, each in ns per parameter for the host: the benchmark's
    first timing (what :func:`cost_lines` uses), the benchmark's repeat at its end, and the bound the training
    run ``run`` sets (its whole step, CPU Adam included, over its parameters: the host can step no slower);
    with the host's Adam seconds for ``psi`` parameters at the slowest and the fastest of them."""
    adam = bench["adam"]
    first = host_adam_s_per_param(bench)
    rates = {"the benchmark": first}
    if adam.get("again_s"):
        rates["its repeat at the end"] = statistics.median(adam["again_s"]) / adam["params"]
    r = runs.get(run)
    if r is not None:
        rates[f"the whole '{run}' step"] = statistics.median(_steps(r)) / r.params
    text = ", ".join(f"{k} {v * 1e9:.2f}" for k, v in rates.items())
    lines = [f"{label}: DeepSpeedCPUAdam, ns per parameter for the host: {text}."]
    if r is not None:
        bound = rates[f"the whole '{run}' step"]
        lines.append(f"  That step ({statistics.median(_steps(r)) * 1e3:.0f} ms for {r.params:,} parameters) holds "
                     f"the whole CPU Adam step, so this host stepped at {bound * 1e9:.2f} ns per parameter or less, "
                     f"{first / bound:.1f}x faster than the benchmark's figure: {psi / 1e9:.0f}B parameters' Adam takes "
                     f"at most {psi * bound:.1f} s, not {psi * first:.1f} s. Read the benchmark's estimate as an "
                     f"upper bound: its {adam.get('ranks', 1)} ranks ran {adam['threads']} threads each on host cores "
                     f"other work shared, and its short steps ({adam['seconds']['DeepSpeedCPUAdam'] * 1e3:.0f} ms) leave "
                     "threads waiting for cores.")
    return "\n".join(lines)


def reference_adam_bounds(name: str = "offload") -> str:
    """:func:`bounded_cost_lines` of every committed GPU result of the chapter's experiment."""
    parts = []
    for device, date, _, runs in references.reference_runs(name):
        bench = next((r for r in runs.values() if isinstance(r, dict) and r.get("task") == "benchmark"), None)
        trained = {k: r for k, r in runs.items() if not isinstance(r, dict)}
        if bench and "stage 2 + optimizer offload" in trained:
            parts.append(bounded_cost_lines(bench, trained, f"reference: {device}, {date}"))
    return "\n".join(parts) or references.no_references(name, references.GPU_HOW)


# --- exercises ----------------------------------------------------------------------------------------

#: Exercise 2's cluster: a 13B-parameter model in bf16 on 8 GPUs of 32 GB, 8 GB of each kept for
#: activations and buffers, 512 GB of host memory for all the ranks.
FIT_TASK = {"params": 13e9, "gpus": 8, "gpu_gb": 32, "reserve_gb": 8, "host_gb": 512}


def exercise_host_bytes(answer: float, runs: Mapping[str, records.Record], name: str = "stage 3 + optimizer offload",
                        rank: int = 0) -> exercises.Verdict:
    """Exercise: predict the host bytes of model states per element of a rank's partition in run ``name``
    (checked against what the ``placement`` probe found on the host side of ``rank``)."""
    r = runs[name]
    host = r.memory.placement(rank)["host"]
    total = sum(host[k] for k in STATE_NAMES)
    shard = r.params / r["world_size"]
    formula = theory.bytes_per_parameter(r.stage, r["world_size"], offload_mode(r), r["precision"])["host"]
    per = {k: host[k] / shard for k in STATE_NAMES}
    why = (f"rank {rank} keeps {total:,} bytes of model states on the host for its {shard:,.0f} partition elements: "
           f"Adam's two moments {per['optimizer']:.0f} + the fp32 master {per['master']:.0f} + gradients "
           f"{per['grads']:.0f} per element. The paper's (2 + K) counts {formula * r['world_size']:.0f}, one 16-bit "
           "gradient; DeepSpeed keeps the fp32 gradient its CPU Adam reads and a 16-bit accumulator beside it, "
           "so plan host memory with the measured figure.")
    return exercises.number("host bytes per parameter", answer, total / shard, relative=0.01,
                            task=f"Predict the host bytes per partition element in the run '{name}'.",
                            hint="which gradients does DeepSpeed keep, and in which dtypes?",
                            why=why)


def exercise_fit_config(answer: dict, runs: Mapping[str, records.Record], task: Mapping[str, float] = FIT_TASK) -> exercises.Verdict:
    """Exercise: write a ``zero_optimization`` block that fits ``task["params"]`` parameters on the task's
    cluster. The block is checked by the course's config checker (with DeepSpeed's Adam, bf16) and read by
    DeepSpeed's own config model; the fit is the offload formulas with the host gradient bytes measured in
    ``runs`` (:func:`measured_host_grad_bytes`); and the optimizer's offload must keep host memory pinned
    (DeepSpeed's default, read from its config model)."""
    gpus, params = int(task["gpus"]), task["params"]
    measured = measured_host_grad_bytes(runs)

    def plan(stage: int, mode: str) -> tuple[float, float, str]:
        """(host bytes per parameter per rank, largest model, what limits it) of one stage and offload mode."""
        slope = host_bytes_per_parameter(stage, gpus, mode, measured.get(stage), "bf16")
        return (slope, *_largest(task["gpu_gb"], stage, gpus, mode, task["host_gb"], task["reserve_gb"], slope, "bf16"))

    fitting = [(plan(stage, mode)[0], stage, mode) for stage in (0, 1, 2, 3) for mode in theory.OFFLOAD_MODES
               if (stage == 3 or mode != "optimizer+params") and (stage or mode == "none")
               and plan(stage, mode)[1] >= params]
    least, best_stage, best_mode = min(fitting, default=(math.inf, None, None))
    without = "a stage without offload fits too" if any(m == "none" for _, _, m in fitting) else "no stage fits without offload"

    def test(zero: dict) -> tuple[bool, str]:
        if not isinstance(zero, dict):
            raise TypeError("write the zero_optimization block as a dict, e.g. {\"stage\": 1}")
        config = {**configs.merged(configs.load("zero3"), merged(DEEPSPEED_ADAM, PRECISION)), "zero_optimization": zero}
        if refused := configs.refusal(config, gpus, warnings=True):
            return False, refused
        parsed = configs.zero_section(zero)
        stage = int(parsed.stage)
        optimizer = parsed.offload_optimizer is not None and parsed.offload_optimizer.device != "none"
        param = stage == 3 and parsed.offload_param is not None and parsed.offload_param.device != "none"
        mode = "optimizer+params" if optimizer and param else "optimizer" if optimizer else "none"
        slope, fits, limit = plan(stage, mode)
        found = (f"stage {stage}, offload {mode}: {theory.bytes_per_parameter(stage, gpus, mode, 'bf16')['accelerator']:.2f} "
                 f"bytes per parameter on each GPU and {slope:.2f} on the host per rank ({slope * gpus:.2f} for all "
                 f"{gpus} ranks together, as DeepSpeed keeps gradients), so at most {fits / 1e9:.1f}B parameters fit "
                 f"({limit} limits)")
        if fits < params:
            return False, f"{found}: not the {params / 1e9:.0f}B asked for."
        if slope > least:
            return False, (f"{found}: it fits, but stage {best_stage} with {best_mode} offload also fits and keeps "
                           f"{least:.2f} bytes per parameter per rank on the host: offloading the parameters too "
                           "frees GPU memory this model does not need, and costs host memory.")
        if optimizer and not parsed.offload_optimizer.pin_memory:
            return False, (f"{found}, but offload_optimizer.pin_memory is false (DeepSpeed's default is true): unpinned "
                           "host memory cannot be copied by the GPU's DMA engines, so every copy goes through a bounce buffer.")
        return True, (f"{found}: {params / 1e9:.0f}B fits. Stage 3 divides the 16-bit parameters by the {gpus} GPUs and "
                      "optimizer offload takes gradients, Adam's states and the fp32 master to the host, which the "
                      f"{task['host_gb']:.0f} GB still hold. Offloading the parameters too would also fit, with "
                      f"more host memory; {without}.")

    return exercises.satisfies("fit with offload", answer, test,
                               task=(f"Write the zero_optimization block that fits {params / 1e9:.0f}B parameters (bf16) "
                                     f"on {gpus} GPUs of {task['gpu_gb']:.0f} GB, keeping {task['reserve_gb']:.0f} GB "
                                     f"free on each, with {task['host_gb']:.0f} GB of host memory, using the least "
                                     "host memory of the blocks that fit."),
                               hint="for each stage and offload mode, the formula's accelerator bytes per parameter "
                                    "(2Ψ or 2Ψ/N_d for the parameters, the rest offloaded) against the GPU memory left "
                                    "per parameter, then the host bytes per parameter (Exercise 1's) times Ψ against the "
                                    "host's memory. An offload block is {\"device\": \"cpu\", \"pin_memory\": True}.")


def how_measured(name: str = "offload") -> str:
    """What measured each committed GPU result of the chapter's experiment: device, date, the run's note and
    the conditions stored with it (what else ran on the machine), then its CPU Adam benchmark's estimate
    (:func:`cost_lines`) and the rates against the offloaded step's bound (:func:`adam_rate_bounds`)."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    parts = []
    for (device, date, note, runs), conditions in zip(found, references.reference_conditions(name)):
        parts.append(f"Measured on {device}, {date} ({note}).\nConditions: {conditions}")
        bench = next((r for r in runs.values() if isinstance(r, dict) and r.get("task") == "benchmark"), None)
        if bench:
            trained = {k: r for k, r in runs.items() if not isinstance(r, dict)}
            parts.append(cost_lines(bench, "Its CPU Adam benchmark's own estimate") + "\n"
                         + adam_rate_bounds(bench, trained, "Its rates"))
    return "\n".join(parts)
