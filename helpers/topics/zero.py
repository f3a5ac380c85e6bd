"""What chapters 03-05 read from their scripts' records: the tables, the checks and the exercises.

- :func:`chapter_records` reads the records a chapter's script (``runs/0X/train_zero*.py``, written by the
  notebook) left, sorted into the stage baselines and the knob settings; :func:`timing_verdict` compares the
  settings' step times through the course's load guard.
- How the gradients were reduced (:func:`reduction_table`: the collective, the DeepSpeed function that issued
  it, and what a rank sends for it), and sentences read from a GPU run (the chapter's own, or the committed
  reference).
- Chapter 05's model built inside ``deepspeed.zero.Init``: :func:`parameter_bytes_meter` counts what the
  parameters hold during construction, :func:`save_construction` keeps a rank's findings beside its run's
  record, and :func:`construction_table` and :func:`gathered_report` read them back.

The ``*_table`` functions turn records into the plain-text tables the notebooks print.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from helpers.core import configs, ds, exercises, load_guard, models, records, references, theory


def chapter_records(folder: str | Path, since: float = 0.0, precisions: Sequence[str] = ("fp32", "bf16"),
                    stage: int = 1) -> tuple[dict[tuple[int, str], records.Record], dict[str, records.Record]]:
    """The records a chapter script wrote into ``folder`` (one sub-folder per run, named as the script names
    them) since ``since`` (a ``time.time()``; older folders, from runs a learner has since renamed, are left
    out): ``({(stage, precision): record}, {setting: record})``, the baselines ``zero<s>-<precision>`` for
    each of ``precisions``, and ``zero<stage>-<setting>`` for every other name, in the order they trained."""
    loaded, _ = records.load_all(folder)
    found = [(t, record) for t, record in ((Path(folder, name, "summary.json").stat().st_mtime, record)
                                           for name, record in loaded.items()) if t >= since]
    if not found:
        raise FileNotFoundError(f"no record in {folder} newer than the launch: did the script run?")
    runs: dict[tuple[int, str], records.Record] = {}
    settings: dict[str, records.Record] = {}
    for _, record in sorted(found, key=lambda pair: pair[0]):
        stage_name, _, rest = (record.name or "").partition("-")
        if rest in precisions:
            runs[(int(stage_name.removeprefix("zero")), rest)] = record
        elif stage_name == f"zero{stage}":
            settings[rest] = record
    return runs, settings


def _steps_ms(record: records.Record) -> list[float]:
    """A run's step times in ms after the first step (which warms up)."""
    return [t * 1000 for t in record.timing.all_s[1:]]


def timing_verdict(settings: Mapping[str, records.Record], again: records.Record, load: load_guard.Load,
                   base: str = "defaults", merge: bool = False) -> str:
    """Each setting's steps against ``base``'s, through the course's load guard (:func:`load_guard.compare`): a
    verdict only where the launch had its devices to itself (``load``), ``base`` run ``again`` at the end of the
    launch stayed within its first run's spread, and the difference exceeds the steps' spread; otherwise the
    line says why it withholds one. Steps after each run's first (which warms up). With ``merge``, verdicts all
    withheld for one reason make one sentence, the reason once and every median after it."""
    first, repeat = _steps_ms(settings[base]), _steps_ms(again)
    verdicts = {name: load_guard.compare({base: [t / 1000 for t in first], name: [t / 1000 for t in _steps_ms(record)]},
                                         load, repeat=[t / 1000 for t in repeat])
                for name, record in settings.items() if name != base}
    reasons = {verdict.withheld for verdict in verdicts.values()}
    if merge and len(reasons) == 1 and "" not in reasons:
        medians = ", ".join(f"{name} {statistics.median(_steps_ms(record)):,.3g} ms" for name, record in settings.items())
        return (f"Step-time verdicts withheld for all {len(verdicts)} settings against {base}: {reasons.pop()} "
                f"(medians without each run's first step: {medians}).")
    lines = [f"Load beside the launch: {load.reason() or 'none, it had its devices to itself'}."]
    lines += [f"{name}: {load_guard.sentence(verdict)}" for name, verdict in verdicts.items()]
    return "\n".join(lines)


def logged_table(runs: Sequence[records.Record]) -> str:
    """What DeepSpeed's comms logger recorded per optimizer step, collective by collective with the DeepSpeed
    function that issued it, and each run's total: the size of the tensor handed to each call (the whole tensor
    for all_reduce, a rank's own shard for all_gather), not what a rank sends (:func:`wire_note`)."""
    rows = []
    for r in runs:
        rows += records.collective_rows(r)
        rows.append([r.label, "total", "", "", f"{r.comm.bytes_per_step:,.0f}"])
    return records.format_table(rows, ["run", "collective", "issued by (DeepSpeed function)", "calls/step",
                                       "logged bytes/step"])


def wire_note(runs: Sequence[records.Record]) -> str:
    """The ring's factors from logged bytes to bytes one rank sends (:func:`helpers.core.theory.wire_bytes`) for
    the runs' rank count, and each run's bytes on the wire per rank and optimizer step."""
    n = runs[0].world_size
    reduce = theory.wire_bytes("all_reduce", 1.0, n)
    gather = theory.wire_bytes("all_gather_into_tensor", 1.0, n)
    sent = ", ".join(f"{r.label} {r.comm.wire_bytes_per_step:,.0f}" for r in runs)
    return (f"N_d = {n}: a rank sends {reduce:.2f}x an all_reduce's logged bytes (2(N_d-1)/N_d) and {gather:.2f}x "
            f"an all-gather's (its shard to N_d-1 = {n - 1} other rank{'s' if n > 2 else ''}). Bytes on the wire per rank and optimizer "
            f"step: {sent}.")


def agreement_table(runs: Mapping[tuple[int, str], records.Record], stage: int) -> str:
    """Per precision: do stage 0 and ``stage`` land on the same losses, within that precision's tolerance
    (:data:`helpers.core.records.LOSS_TOLERANCE`)? The same text on every processor while they do."""
    rows = []
    for precision in dict.fromkeys(p for _, p in runs):
        base, other = runs.get((0, precision)), runs.get((stage, precision))
        if base is None or other is None:
            continue
        rows.append([precision, f"{len(base.losses)} steps", records.loss_agreement(base.losses, other.losses, precision)])
    return records.format_table(rows, ["precision", "compared", f"stage {stage} vs stage 0 losses"])


def losses_side_by_side(runs: Mapping[tuple[int, str], records.Record], stage: int, digits: int = 6) -> str:
    """The losses of stage 0 and ``stage`` per precision, and their largest difference. The digits
    depend on the processor's kernels: print this in a cell nbval does not compare."""
    rows = []
    for precision in dict.fromkeys(p for _, p in runs):
        base, other = runs.get((0, precision)), runs.get((stage, precision))
        if base is None or other is None:
            continue
        diff = records.max_loss_difference(base.losses, other.losses)
        rows.append([precision, " ".join(f"{x:.{digits}f}" for x in base.losses),
                     " ".join(f"{x:.{digits}f}" for x in other.losses), "identical" if diff == 0 else f"{diff:.1e}"])
    return records.format_table(rows, ["precision", "stage 0 losses", f"stage {stage} losses", "max |difference|"])


def halving_table(numerator: records.Record, denominator: records.Record, keys: Sequence[str], rank: int = 0) -> str:
    """measured[key] of one run divided by another's, per key: the 'half of' checks of the ZeRO chapters."""
    rows = []
    for key in keys:
        a, b = numerator.states(rank)[key], denominator.states(rank)[key]
        rows.append([key, f"{numerator.label}: {a:,}", f"{denominator.label}: {b:,}", f"{a / b:.4f}"])
    return records.format_table(rows, ["state", "measured", "compared with", "ratio"])


def knob_agreement(runs: Mapping[str, records.Record], base: str = "defaults") -> str:
    """One line: do every setting's losses agree with ``base``'s, within the precision's tolerance?"""
    ref = runs[base]
    verdicts = {name: records.loss_agreement(ref.losses, r.losses, r.precision) for name, r in runs.items()
                if name != base}
    if all(verdict.startswith("within") for verdict in verdicts.values()) and len(set(verdicts.values())) == 1:
        return f"losses of every setting against {base}: {next(iter(verdicts.values()))}"
    return "; ".join(f"{name} against {base}: {verdict}" for name, verdict in verdicts.items())


def knob_table(runs: Mapping[str, records.Record], timings: bool = False, bytes_label: str = "bytes/step",
               wire: bool = False, warm: bool = False, buffers: bool = True) -> str:
    """Per setting: collectives and the comms logger's bytes per step (headed ``bytes_label``), buffers (unless
    ``buffers`` is False) and gradients held; with timings, peak memory and the median step time (with ``warm``, of the steps after the
    first, the basis of :func:`timing_verdict`). With ``wire``, the logger's bytes are headed
    "logged bytes/step" and followed by the bytes one rank sends per step on a ring ("wire bytes/step").

    Counts and bytes are deterministic (nbval checks them); timings are not (print them separately).
    """
    rows = []
    for name, r in runs.items():
        ops = r.comm_ops()
        row = [name, " ".join(f"{op}:{row['count']:g}" for op, row in ops.items()), f"{r.comm.bytes_per_step:,.0f}",
               *([f"{r.comm.wire_bytes_per_step:,.0f}"] if wire else []),
               *([records.format_bytes(r.states(0)["buffers"])] if buffers else []),
               records.format_bytes(r.states(0)["grads"]), records.format_bytes(r.states(0)["params"])]
        if timings:
            median = statistics.median(_steps_ms(r)) if warm else r.timing.median_s * 1000
            row += [records.format_peak(r, 0), f"{median:.1f}"]
        rows.append(row)
    byte_headers = ["logged bytes/step", "wire bytes/step"] if wire else [bytes_label]
    headers = ["setting", "collectives per step", *byte_headers, *(["buffers"] if buffers else []), "grads", "params"]
    if timings:
        headers += ["peak (rank 0)", "step ms (median after step 1)" if warm else "step ms"]
    return records.format_table(rows, headers)


#: Collectives that carry no gradient: the gradient norm's (clipping) and the parameters' all-gather.
NOT_GRADIENT_CALLERS = ("get_grad_norm_direct", "clip_grad_norm_")


def gradient_sent_bytes(op: str, logged_bytes: float, world_size: int) -> float:
    """Bytes one rank sends, averaged over the ranks, for gradient reductions the comms logger recorded as
    ``logged_bytes`` of ``op``, on a ring as NCCL runs them. An all_reduce sends 2(n-1)/n of the tensor
    (:func:`helpers.core.theory.wire_bytes`). A ``reduce`` here is DeepSpeed sending each rank's slices of a
    bucket to that rank (``use_multi_rank_bucket_allreduce`` false): one reduce per owner, and NCCL's ring
    reduce has every rank but the root send each element once (``runRing`` in NCCL's ``src/device/reduce.h``),
    so a rank sends the (n-1)/n of the bucket it does not own: a reduce-scatter's volume. (Gloo's reduce, a
    ring reduce-scatter of the whole message and then a gather to the root, sends more.)"""
    if op == "reduce":
        return logged_bytes * (world_size - 1) / world_size
    return theory.wire_bytes(op, logged_bytes, world_size)


def zero_default(key: str):
    """DeepSpeed's default for ``zero_optimization.<key>`` (a field name or its ``stage3_`` alias), read from
    its config model (``DeepSpeedZeroConfig`` in ``deepspeed/runtime/zero/config.py``)."""
    DeepSpeedZeroConfig = ds.load("deepspeed.runtime.zero.config").DeepSpeedZeroConfig

    for name, field in DeepSpeedZeroConfig.model_fields.items():
        if key in (name, field.alias):
            return field.default
    raise KeyError(f"zero_optimization has no key {key!r}")


def _gradient_rows(record: records.Record) -> list[tuple[str, str, dict]]:
    """(op, caller, {count, bytes}) of the collectives that reduce gradients, per optimizer step."""
    return [(op, caller, row) for op, callers in (record.comm.by_caller or {}).items()
            if not op.startswith("all_gather") for caller, row in callers.items() if caller not in NOT_GRADIENT_CALLERS]


def gradient_calls(record: records.Record) -> float:
    """Collective calls per optimizer step that reduce gradients (the norm's all_reduce and the parameters'
    all-gather left out)."""
    return sum(row["count"] for _, _, row in _gradient_rows(record))


def gradient_bytes(record: records.Record) -> float:
    """Bytes per optimizer step the comms logger recorded for the collectives that reduce gradients."""
    return sum(row["bytes"] for _, _, row in _gradient_rows(record))


def bucket_note(base: records.Record, small: records.Record, small_name: str) -> str:
    """What ``reduce_bucket_size`` did in two runs: the bucket's bytes against the parameters' (rank 0), the
    gradient reductions per step (calls and logged bytes) and the other collectives the knob table counts
    beside them (the gradient norm's all_reduce, the parameters' all-gather)."""
    default = int(zero_default("reduce_bucket_size"))
    b, s = base.states(0), small.states(0)
    other = small.comm.calls_per_step - gradient_calls(small)
    return (f"DeepSpeed's default reduce_bucket_size: {default:,} elements. With it, buffers {b['buffers']:,} bytes "
            f"for {b['params']:,} bytes of parameters ({b['buffers'] / b['params']:,.0f} times the model); "
            f"with {small_name}: {s['buffers']:,} bytes. Gradient reductions per step: {gradient_calls(base):g} "
            f"call(s) against {gradient_calls(small):g}, carrying the same logged bytes ({gradient_bytes(base):,.0f} "
            f"against {gradient_bytes(small):,.0f}); the knob table's collectives add {other:g} more per step, the "
            f"gradient norm's all_reduce and the parameters' all-gather.")


def reduction_table(runs: Mapping[str, records.Record], sent_label: str = "sent per rank/step (NCCL ring)") -> str:
    """Per setting: the collectives that reduce the gradients (the DeepSpeed function that issued them),
    calls and logged bytes per optimizer step, and the bytes one rank sends for them
    (:func:`gradient_sent_bytes`, computed: ``sent_label`` heads that column). Counts and bytes are the same on
    every processor."""
    rows = [[name, f"{op} ({caller})", f"{row['count']:g}", f"{row['bytes']:,.0f}",
             f"{gradient_sent_bytes(op, row['bytes'], r.world_size):,.0f}"]
            for name, r in runs.items() for op, caller, row in _gradient_rows(r)]
    return records.format_table(rows, ["setting", "gradient collective (issued by)", "calls/step",
                                       "logged bytes/step", sent_label])


#: Settings renamed since a committed GPU reference was measured: {experiment: {name in the file: name now}}.
#: Chapter 05's "defaults" run is "course-base" (its persistence threshold is 0, not DeepSpeed's 1e5).
RENAMED_SETTINGS = {"zero3-knobs": {"defaults": "course-base", "defaults-again": "course-base-again"}}


def current_names(name: str, runs: Mapping[str, Any]) -> dict[str, Any]:
    """``runs`` of the committed reference ``name`` keyed by today's setting names (:data:`RENAMED_SETTINGS`)."""
    renamed = RENAMED_SETTINGS.get(name, {})
    return {renamed.get(setting, setting): run for setting, run in runs.items()}


def latest_reference(name: str) -> tuple[str, dict[str, records.Record]]:
    """(device, {setting: record}) of the newest committed GPU result of experiment ``name``."""
    found = references.reference_runs(name)
    if not found:
        raise LookupError(references.no_references(name, references.GPU_HOW))
    device, _, _, runs = found[-1]
    return device, current_names(name, runs)


def not_in_reference(name: str, settings: Sequence[str]) -> str:
    """Which of this chapter's ``settings`` the newest GPU result of ``name`` has no run for, said plainly."""
    device, runs = latest_reference(name)
    missing = [s for s in settings if s not in runs]
    if not missing:
        return f"The GPU reference ({device}) has a run for every setting above."
    return (f"The GPU reference ({device}) was measured before this chapter trained {', '.join(missing)}: "
            f"no GPU row for {'it' if len(missing) == 1 else 'them'}.")


def gpu_runs(name: str, measured: Mapping[str, records.Record] | None = None) -> tuple[str, dict[str, records.Record]]:
    """(label, {setting: record}) for a sentence about GPUs: the chapter's own ``measured`` runs where they ran on
    GPUs ("this launch on <device>"), else the newest committed GPU result of ``name`` (:func:`latest_reference`)."""
    if measured and all(r.device == "cuda" for r in measured.values()):
        return f"this launch on {next(iter(measured.values())).device_name}", dict(measured)
    device, runs = latest_reference(name)
    return f"{device} (the committed reference)", runs


def peak_contrast(name: str, base: str, other: str, times: bool = True,
                  measured: Mapping[str, records.Record] | None = None,
                  calls_label: str = "collective calls per step") -> str:
    """One sentence about a GPU run (:func:`gpu_runs`: the chapter's ``measured`` runs on GPUs, else the reference
    ``name``): rank 0's peak memory of setting ``other`` against ``base``, with their collective calls per step
    (of every kind; ``calls_label`` names them), and their median step times unless ``times`` is False."""
    label, runs = gpu_runs(name, measured)
    a, b = runs[base], runs[other]

    def calls(r: records.Record) -> str:
        return f"{r.comm.calls_per_step:g}"

    apart = records.format_bytes(abs(b.memory.peak(0) - a.memory.peak(0)))
    peaks = (f"On {label}, {other}: peak {records.format_bytes(b.memory.peak(0))} per rank against "
             f"{records.format_bytes(a.memory.peak(0))} with {base} ({apart} apart")
    if not times:
        return f"{peaks}; {calls(b)} {calls_label} against {calls(a)})."
    return (f"{peaks}), median step {b.timing.median_s * 1000:.1f} ms against {a.timing.median_s * 1000:.1f} ms "
            f"({calls(b)} {calls_label} against {calls(a)}).")


def per_micro_step_volume(runs: Mapping[str, records.Record]) -> str:
    """Per run: wire bytes one rank sends per micro-step (the record's ring wire bytes per optimizer step,
    divided by its accumulation steps) against the paper's volume for one forward and backward (the record's
    ``theory.comm_wire_bytes_per_step``: the paper counts one step without accumulation)."""
    rows = []
    for name, r in runs.items():
        per_micro = r.comm.wire_bytes_per_step / r.grad_accum
        paper = r.theory.comm_wire_bytes_per_step
        rows.append([name, f"{r.grad_accum}", f"{per_micro:,.0f}", f"{paper:,.0f}",
                     records.format_ratio(per_micro, paper, suffix="x")])
    return records.format_table(rows, ["run", "micro-steps/step", "wire bytes/micro-step", "paper, one micro-step",
                                       "measured/paper"])


def comm_table_per_optimizer_step(runs: Sequence[records.Record]) -> str:
    """:func:`helpers.core.records.comm_table`, with the paper's row counted per optimizer step
    (``theory.comm_wire_bytes_per_optimizer_step``) and labelled with its formula, and the measured wire bytes
    against it: every byte figure of the table in one unit, per optimizer step."""
    rows = []
    for r in runs:
        rows += records.collective_rows(r)
        paper = r.theory.comm_wire_bytes_per_optimizer_step
        formula = f"3Ψ(n-1)/n x {r.grad_accum} micro-steps" if r.stage == 3 else "2Ψ(n-1)/n, once"
        wire = r.comm.wire_bytes_per_step
        rows += [[r.label, "= wire bytes per rank (ring)", "", "", f"{wire:,.0f}"],
                 [r.label, f"= paper: {formula}", "", "", f"{paper:,.0f}"],
                 [r.label, "= measured/paper", "", "", records.format_ratio(wire, paper, suffix="x")]]
    return records.format_table(rows, ["run", "collective", "issued by (DeepSpeed function)", "count/step",
                                       "bytes/optimizer step"])


def model_states_note(stage3: records.Record, stage0: records.Record, rank: int = 0) -> str:
    """One sentence: ``stage3``'s model states per rank against ``stage0``'s, with and without the master copy
    of the parameters that ``stage3`` keeps (``fp32_partitioned_groups_flat``) and an fp32 ``stage0`` has none of."""
    a, b = stage3.model_state_bytes(rank), stage0.model_state_bytes(rank)
    master, base_master = stage3.states(rank)["master"], stage0.states(rank)["master"]
    without = (a - master) / (b - base_master)
    share = "1/N_d" if abs(without * stage3.world_size - 1) < 1e-3 else "not 1/N_d"
    return (f"Model states per rank: {stage3.label} {a:,} bytes against {stage0.label} {b:,} "
            f"({records.format_ratio(a, b, suffix='x')}); without the master copies ({master:,} and "
            f"{base_master:,} bytes): {records.format_ratio(a - master, b - base_master, suffix='x')}, "
            f"{share} on {stage3.world_size} ranks.")


def bucket_buffer_note(record: records.Record, rank: int = 0) -> str:
    """One sentence: ``record``'s buffers against DeepSpeed's default ``reduce_bucket_size`` (:func:`zero_default`)
    times the bytes of one element of its precision."""
    default, buffers = int(zero_default("reduce_bucket_size")), record.states(rank)["buffers"]
    element = theory.bytes_per_element(record.precision)
    return (f"{record.label} buffers: DeepSpeed's default reduce_bucket_size, {default:,} elements, x {element} bytes "
            f"({record.precision}) = {default * element:,} bytes; measured {buffers:,} bytes "
            f"({'the same' if buffers == default * element else 'not the same'}), for a model of "
            f"{record.params * element:,} bytes of parameters.")


#: The units :func:`scaled_out_table` can print in, and their bytes.
UNITS = {"GB": 1e9, "GiB": 2**30}


def scaled_out_table(psi: float, world_size: int, largest_layer_params: int = 0, k: int = theory.PAPER_K,
                     stages: Sequence[int] = theory.STAGES, estimator: bool = True, unit: str = "GB") -> str:
    """The paper's per-device ``unit`` (a key of :data:`UNITS`) for ``stages`` at ``psi`` parameters on
    ``world_size`` ranks, with DeepSpeed's estimate unless ``estimator`` is False."""
    scale = UNITS[unit]
    rows = []
    for stage in stages:
        paper = theory.paper_bytes_per_device(psi, stage, world_size, k) / scale
        row = [f"stage {stage}", f"{paper:.1f}"]
        if estimator:
            estimate = theory.deepspeed_estimate_bytes(int(psi), stage, world_size, largest_layer_params)
            row.append("-" if estimate is None else f"{estimate / scale:.1f}")
        rows.append(row)
    return records.format_table(rows, ["ZeRO", f"paper {unit}/device",
                                       *([f"DeepSpeed estimator {unit}/device"] if estimator else [])])


def reference_report(name: str, bytes_label: str = "bytes/step", wire: bool = False, warm: bool = False,
                     buffers: bool = True) -> str:
    """The knob table of every committed GPU result of ``name``, timings included (and the wire bytes, with
    ``wire``; ``warm`` and ``buffers`` as in :func:`knob_table`), each labelled with its device (``bytes_label`` heads the logged
    bytes, as in :func:`knob_table`)."""
    return references.references_report(
        name, lambda runs: knob_table(current_names(name, runs), timings=True, bytes_label=bytes_label, wire=wire,
                                      warm=warm, buffers=buffers))


def calls_and_times_note(name: str, base: str) -> str:
    """One sentence on the newest committed GPU result of ``name`` (:func:`latest_reference`): each setting's
    collective calls per step and median step time (steps after the first) against ``base``'s. Figures, not a
    verdict: the reference trained each setting once, with no repeat to bound the drift."""
    device, runs = latest_reference(name)

    def said(setting: str) -> str:
        r = runs[setting]
        return f"{setting} {r.comm.calls_per_step:g} calls, {statistics.median(_steps_ms(r)):.1f} ms"

    others = "; ".join(said(setting) for setting in runs if setting != base)
    return (f"On {device} (the committed reference), collective calls per step and median step time after the "
            f"first: {said(base)}; {others}. Figures, not a verdict: each setting ran once, with no repeat.")


def comparison_table(subject: records.Record, baselines: Mapping[str, records.Record], rank: int = 0,
                     paper: bool = False) -> str:
    """One run against others, ratio by ratio: the 'when to use this stage' tables of the ZeRO chapters.

    Rows: model states, Adam states, gradients and parameters per rank (measured, ``rank``), collective
    calls and wire bytes per step, and whether the losses agree (within the precision's tolerance). With
    ``paper``, each baseline's column is followed by the paper's ratio (the records' ``theory``: model-state
    bytes per rank and wire bytes per step), "-" where the paper gives none.
    """
    def calls(r: records.Record) -> float:
        return sum(row["count"] for row in r.comm_ops().values())

    def ratio(a: float, b: float) -> str:
        return records.format_ratio(a, b, suffix="x", none="-")

    def losses(a: records.Record, b: records.Record) -> str:
        return records.loss_agreement(a.losses, b.losses, a.summary["precision"])

    s = subject

    def paper_ratio(key: str | None = None) -> list[str]:  # the paper's bytes per rank; key None: all states
        def held(r: records.Record) -> float:
            return r.theory_states.get(key or "total", 0)
        return [ratio(held(s), held(b)) for b in baselines.values()]

    none = ["-"] * len(baselines)
    paper_rows = [paper_ratio(), paper_ratio("optimizer"), paper_ratio("grads"), paper_ratio("params"), none,
                  [ratio(s.theory.comm_wire_bytes_per_step, b.theory.comm_wire_bytes_per_step) for b in baselines.values()],
                  none]
    rows = [
        ["model states per rank", *(ratio(s.model_state_bytes(rank), b.model_state_bytes(rank)) for b in baselines.values())],
        *([f"{name} per rank", *(ratio(s.states(rank)[key], b.states(rank)[key]) for b in baselines.values())]
          for key, name in (("optimizer", "Adam states"), ("grads", "gradients"), ("params", "parameters"))),
        ["collective calls per step", *(f"{calls(s):g} vs {calls(b):g}" for b in baselines.values())],
        ["wire bytes per step", *(ratio(s.comm.wire_bytes_per_step, b.comm.wire_bytes_per_step)
                                  for b in baselines.values())],
        ["losses", *(losses(s, b) for b in baselines.values())],
    ]
    headers = [s.label, *(f"vs {name}" for name in baselines)]
    if paper:  # measured, then the paper's, per baseline
        rows = [[row[0], *(cell for pair in zip(row[1:], theirs) for cell in pair)] for row, theirs in zip(rows, paper_rows)]
        headers = [s.label, *(cell for name in baselines for cell in (f"vs {name}", "paper"))]
    return records.format_table(rows, headers)


def master_note(subject: records.Record, baseline: records.Record, rank: int = 0) -> str:
    """One sentence: ``subject``'s model states per rank against ``baseline``'s, measured and by the paper's
    formula (the records' ``theory``), and how much of the gap the master copies (measured, ``rank``) make."""
    measured = subject.model_state_bytes(rank) / baseline.model_state_bytes(rank)
    paper = subject.theory_states["total"] / baseline.theory_states["total"]
    master_s, master_b = subject.states(rank).get("master", 0), baseline.states(rank).get("master", 0)
    without = (subject.model_state_bytes(rank) - master_s) / (baseline.model_state_bytes(rank) - master_b)
    said = f"Model states per rank: measured {measured:.3f}x, the paper's formula {paper:.3f}x."
    if round(measured, 3) == round(paper, 3):
        return f"{said} They agree: the paper counts every state {subject.label} holds."
    if not master_s - master_b or round(without, 3) != round(paper, 3):
        return f"{said} Master copies: {master_s:,} bytes against {master_b:,}."
    return (f"{said} The gap is the master copy: {subject.label} keeps an fp32 copy of its slice of the weights "
            f"({master_s:,} bytes on rank {rank}), {baseline.label} {'none' if not master_b else f'{master_b:,} bytes'}, "
            f"and the paper's count leaves it out; without the master copies the ratio is {without:.3f}x, the paper's.")


# --- building the model partitioned: deepspeed.zero.Init and GatheredParameters ---------------------------

def digest(tensor: torch.Tensor) -> str:
    """A short hash of a tensor's bytes: equal digests mean bit-identical tensors."""
    data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _held_bytes(param: torch.nn.Parameter) -> int:
    """Bytes of storage a parameter holds on this rank: its ``.data`` (empty while a ZeRO-3 parameter is
    partitioned) and its ZeRO-3 shard (``ds_tensor``) if it has one."""
    shard = getattr(param, "ds_tensor", None)
    return param.data.numel() * param.element_size() + (0 if shard is None else shard.numel() * shard.element_size())


@contextlib.contextmanager
def parameter_bytes_meter() -> Iterator[dict]:
    """Count, while the block builds a model, the bytes its parameters hold on this rank at their highest:
    each time a module registers a parameter (``torch.nn.modules.module.register_module_parameter_registration_hook``)
    and at the end, the sum of :func:`_held_bytes` over every parameter registered so far. Yields a dict whose
    ``"peak"`` is that count once the block ends.

    Inside ``deepspeed.zero.Init`` each module's parameters are partitioned as its ``__init__`` ends, so the
    highest count is the shards built so far plus the module being built, whole. The count is the same on
    every processor, unlike the process's resident memory, and leaves out transient tensors (the shard
    DeepSpeed allocates before it frees the whole tensor, communication buffers)."""
    params: list[torch.nn.Parameter] = []
    meter = {"peak": 0}

    def held() -> int:
        return sum(_held_bytes(p) for p in params)

    def registered(module, name, param):
        if param is not None:
            params.append(param)
            meter["peak"] = max(meter["peak"], held())

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(registered)
    try:
        yield meter
    finally:
        handle.remove()
    meter["peak"] = max(meter["peak"], held())


def _construction_file(out: str | Path, rank: int) -> Path:
    return Path(out) / f"construction-rank{rank}.json"


def save_construction(out: str | Path, rank: int, init: str, model: torch.nn.Module, peak_bytes: int,
                      gathered: Mapping[str, Any]) -> Path:
    """Keep what one rank found while it built ``model`` (``init``: "plain" or "zero.Init") beside its run's
    record, in ``out/construction-rank<rank>.json``: the bytes its parameters held at their highest during
    construction (``peak_bytes``, from :func:`parameter_bytes_meter`) and once it ended, the whole model's and
    the largest module's parameter bytes, and what the script found of the first weight (``gathered``)."""
    params = list(model.parameters())

    def whole(p: torch.nn.Parameter) -> int:  # a partitioned parameter's full size is its ds_numel
        return getattr(p, "ds_numel", p.numel()) * p.element_size()

    found = {"init": init, "peak_bytes": int(peak_bytes), "held_bytes": sum(_held_bytes(p) for p in params),
             "full_bytes": sum(whole(p) for p in params),
             "largest_module_bytes": max(sum(whole(p) for p in m.parameters(recurse=False)) for m in model.modules()),
             "gathered": dict(gathered)}
    path = _construction_file(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=1))
    return path


def _construction_ranks(record: records.Record) -> list[dict]:
    """Every rank's findings of :func:`save_construction` for ``record``, read from its folder (or from its
    summary's ``construction`` section, where one holds them)."""
    if "construction" in record.summary:
        return record.summary["construction"]["per_rank"]
    if record.out is None:
        raise FileNotFoundError(f"{record.name or 'this run'}: a record read from its folder holds its construction files")
    files = [_construction_file(record.out, rank) for rank in range(record.world_size)]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"no construction file {missing[0]}: the script saves one per rank "
                                "(zero.save_construction)")
    return [json.loads(f.read_text()) for f in files]


def construction(record: records.Record, rank: int = 0) -> dict:
    """What one rank found while building the model (:func:`save_construction`)."""
    return _construction_ranks(record)[rank]


def construction_table(built: Mapping[str, records.Record]) -> str:
    """Per way of building ({"plain": record, "zero.Init": record}): the parameter bytes one rank held at their highest during
    construction and once it ended, as a share of the whole model's, rank 0's figures and whether every rank
    measured the same."""
    rows = []
    for init, r in built.items():
        ranks = _construction_ranks(r)
        first = ranks[0]
        same = all((x["peak_bytes"], x["held_bytes"]) == (first["peak_bytes"], first["held_bytes"]) for x in ranks)
        rows.append([init, f"{first['full_bytes']:,}",
                     f"{first['peak_bytes']:,} ({first['peak_bytes'] / first['full_bytes']:.2f})",
                     f"{first['held_bytes']:,} ({first['held_bytes'] / first['full_bytes']:.2f})",
                     "yes" if same else "no"])
    return records.format_table(rows, ["built", "whole model", "highest during construction (share)",
                                       "held after it (share)", "every rank the same"])


def construction_check(record: records.Record, rank: int = 0) -> str:
    """Does the highest count under ``zero.Init`` equal what partitioning module by module predicts: the
    shards held once construction ends plus the largest module whole, less its own shard? Both sides from
    the record, the prediction from other measured figures than the peak."""
    found = construction(record, rank)
    n = record.world_size
    largest = found["largest_module_bytes"]
    predicted = found["held_bytes"] + largest - largest // n
    verdict = "as measured" if predicted == found["peak_bytes"] else f"measured {found['peak_bytes']:,}"
    return (f"held after construction {found['held_bytes']:,} + largest module whole {largest:,} "
            f"- its shard {largest // n:,} = {predicted:,}: {verdict}")


def gathered_report(built: Mapping[str, records.Record]) -> str:
    """What ``GatheredParameters`` did with the first parameter on each rank of the ``zero.Init`` run, beside
    the same parameter of the model built whole (``plain``)."""
    plain, init = _construction_ranks(built["plain"]), _construction_ranks(built["zero.Init"])
    lines = []
    for rank, (p, z) in enumerate(zip(plain, init)):
        g = z["gathered"]
        whole = "identical to" if g["digest"] == p["gathered"]["digest"] else "DIFFERENT from"
        lines += [f"rank {rank}: outside the context the parameter's shape is {tuple(g['shape_outside'])} "
                  f"(its shard: {g['shard_elements']:,} elements in ds_tensor); inside, {tuple(g['shape_inside'])}, "
                  f"{whole} the tensor built whole",
                  f"        rank 0 doubled it inside GatheredParameters(p): "
                  f"{'kept' if g['change_kept_without_modifier_rank'] else 'lost'} in this rank's shard",
                  f"        rank 0 doubled it inside GatheredParameters(p, modifier_rank=0): "
                  f"{'kept' if g['change_kept_with_modifier_rank'] else 'lost'} in this rank's shard; "
                  f"halved the same way: {'shard as built' if g['restored'] else 'shard NOT as built'}"]
    return "\n".join(lines)


def init_weights_note(built: Mapping[str, records.Record]) -> str:
    """Whether the model built inside ``zero.Init`` started from the same weights as the one built whole (the first
    weight's digest on rank 0) and trained to the same losses, and, where it did not on GPUs, why: inside
    ``zero.Init`` DeepSpeed creates each tensor on the rank's GPU, so ``nn.Linear`` draws its initial weights from
    the CUDA generator, which ``torch.manual_seed`` seeds too but whose random stream differs from the CPU's."""
    plain, init = built["plain"], built["zero.Init"]
    same = construction(init)["gathered"]["digest"] == construction(plain)["gathered"]["digest"]
    losses = records.loss_agreement(plain.losses, init.losses, init.summary["precision"])
    text = (f"On these {init.device} ranks: the first weight built inside zero.Init is "
            f"{'identical to' if same else 'different from'} the one built whole; losses {losses}.")
    if not same and init.device == "cuda":
        text += (" Inside zero.Init DeepSpeed creates every tensor on the rank's GPU, so the initial weights come "
                 "from the CUDA generator: torch.manual_seed seeds it as well, but its random stream is not the CPU's.")
    return text


def construction_estimate(psi: int, world_size: int, largest_module_params: int,
                          bytes_per_param: int) -> tuple[float, float]:
    """Parameter bytes one rank holds at their highest while it builds a model of ``psi`` parameters:
    whole on every rank, and inside ``deepspeed.zero.Init`` (its shard of everything, plus the largest
    module whole less its shard, as :func:`construction_check` measures)."""
    plain = psi * bytes_per_param
    partitioned = psi * bytes_per_param / world_size + largest_module_params * bytes_per_param * (1 - 1 / world_size)
    return plain, partitioned


def construction_estimate_table(psi: int, world_size: int, largest_module_params: int) -> str:
    """:func:`construction_estimate` in fp32 and bf16, GB per rank and per node of ``world_size`` ranks."""
    rows = []
    for precision in ("fp32", "bf16"):
        plain, partitioned = construction_estimate(psi, world_size, largest_module_params,
                                                   theory.bytes_per_element(precision))
        rows.append([precision, f"{plain / 1e9:.1f}", f"{plain * world_size / 1e9:.1f}", f"{partitioned / 1e9:.2f}",
                     f"{partitioned * world_size / 1e9:.1f}"])
    return records.format_table(rows, ["parameters in", "built whole: GB/rank", "GB/node",
                                       "zero.Init: GB/rank", "GB/node"])


# --- exercises: predict, then check against the chapters' runs ----------------------------------------------

def model_parameter_sizes(name: str = "mlp") -> list[int]:
    """Elements of each parameter of the course model ``name``, in ``model.parameters()`` order (the order
    DeepSpeed's ZeRO optimizer walks them)."""
    return [p.numel() for p in models.build(name).parameters()]


def bucket_calls(sizes: Sequence[int], bucket_size: int) -> int:
    """Gradient reductions for parameters of ``sizes`` elements with ``reduce_bucket_size`` = ``bucket_size``,
    by DeepSpeed's rule (``reduce_independent_p_g_buckets_and_remove_grads`` in ``stage_1_and_2.py``): a
    gradient that would overflow the bucket first sends what it holds, and the rest goes at the end. Only for
    buckets at least as large as the largest parameter (a larger one is reduced outside the bucket)."""
    calls, filled = 0, 0
    for n in sizes:
        if filled + n > bucket_size:
            calls, filled = calls + 1, 0
        filled += n
    return calls + (filled > 0)


def bucket_sizes_for_calls(sizes: Sequence[int], calls: int) -> tuple[int, int | None]:
    """The smallest and largest ``reduce_bucket_size`` (from the largest parameter's size up) for which
    :func:`bucket_calls` gives ``calls`` buckets (largest None for one bucket: any larger size); the calls only
    fall as the bucket grows. ValueError if no size gives ``calls``."""
    def first_at_most(target: int) -> int:  # the smallest size giving at most target buckets
        low, high = max(sizes), sum(sizes)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if bucket_calls(sizes, middle) <= target else (middle + 1, high)
        return low
    smallest = first_at_most(calls)
    if bucket_calls(sizes, smallest) != calls:
        raise ValueError(f"no reduce_bucket_size gives {calls} bucket(s) for parameters of these sizes")
    return smallest, first_at_most(calls - 1) - 1 if calls > 1 else None


def exercise_state_bytes(answer: Any, record: records.Record) -> exercises.Verdict:
    """Exercise: predict the model-state bytes per rank (parameters, gradients, optimizer states and the fp32
    master copy; not buffers) of ``record``, as its rank 0 measured them."""
    s, n = record.summary, record.world_size
    return exercises.number(
        "state bytes", answer, record.model_state_bytes(0), relative=0.01, unit=" bytes",
        task=(f"Predict the model-state bytes one rank holds in the {record.label} run: Ψ = {record.params:,} "
              f"parameters, N_d = {n}, stage {s['zero_stage']}, {s['precision']} (parameters + gradients + Adam's "
              f"states + fp32 master copy; within 1%)."),
        hint=("add up the bytes per parameter of each of the four states in bf16 training (the chapter's first "
              "paragraph says which precision each is kept in), dividing by N_d the ones stage 1 partitions."),
        why=(f"The paper's formula for stage {s['zero_stage']} with K = 12, measured on rank 0: "
             + ", ".join(f"{k} {v:,}" for k, v in record.states(0).items() if k != "buffers")
             + " (Adam's step counters add a few bytes)."))


#: What makes up a stage's bytes on the wire per optimizer step, for the hint of :func:`exercise_wire_bytes`.
WIRE_HINTS = {
    1: ("the bytes on the wire per rank: take the two collectives this section says DeepSpeed's stage 1 issues "
        "once per optimizer step, the tensor each one moves (fp32 here), and the share of it a rank sends on a "
        "ring, from the formulas of this section"),
    3: ("the paper's stage-3 volume of the section above, for one forward and backward, in fp32 bytes; then how "
        "many of those an optimizer step holds"),
}


def exercise_wire_bytes(answer: Any, record: records.Record, name: str = "") -> exercises.Verdict:
    """Exercise: predict the bytes one rank sends per optimizer step in ``record`` (the comms log, counted on a
    ring: :attr:`records.CommView.wire_bytes_per_step`), within 1%; ``name`` says which run it is."""
    s = record.summary
    parts = ", ".join(f"{op} x{row['count']:g}" for op, row in record.comm_ops().items())
    return exercises.number(
        "wire bytes", answer, record.comm.wire_bytes_per_step, relative=0.01, unit=" bytes",
        task=(f"Predict the bytes one rank sends per optimizer step in the {name or record.label} run: Ψ = {record.params:,} "
              f"parameters, N_d = {record.world_size}, {s['grad_accum']} micro-steps per optimizer step (within 1%)."),
        hint=WIRE_HINTS.get(s["zero_stage"], "count each collective of a step and what a ring sends for it"),
        why=(f"The comms log of the run, per optimizer step: {parts}; on a ring that is what one rank sends "
             f"(the 4 or 8 bytes of the gradient norm's all_reduce are in it)."))


def exercise_bucket_for_calls(answer: Any, knobs: Mapping[str, records.Record], calls: int = 4,
                              model: str = "mlp") -> exercises.Verdict:
    """Exercise: a ``zero_optimization`` block whose ``reduce_bucket_size`` makes stage 1 reduce the gradients of
    ``model`` in ``calls`` calls per optimizer step. :func:`bucket_calls` counts them, once it reproduces the
    calls the chapter's knob runs measured (``knobs``: each setting's record, with ``defaults``)."""
    sizes = model_parameter_sizes(model)

    def calls_per_step(zero_block: Mapping, size: int, world_size: int) -> int:
        # one all_reduce per bucket, or one reduce per owner with use_multi_rank_bucket_allreduce off
        per_bucket = 1 if zero_block.get("use_multi_rank_bucket_allreduce", True) else world_size
        return bucket_calls(sizes, size) * per_bucket

    def test(block) -> tuple[bool, str]:
        if not isinstance(block, dict) or "reduce_bucket_size" not in block:
            return False, "Write a dict with the key reduce_bucket_size."
        for name, r in knobs.items():  # the rule against the measured runs
            zero_block = r.summary.get("config", {}).get("zero_optimization", {})
            size = int(zero_block.get("reduce_bucket_size", zero_default("reduce_bucket_size")))
            if size >= max(sizes) and calls_per_step(zero_block, size, r.world_size) != gradient_calls(r):
                return False, f"The bucketing rule does not reproduce the measured run {name!r}: report it."
        size = block["reduce_bucket_size"]
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size < max(sizes):
            return False, (f"{size!r}: choose a number of elements at least the largest parameter's {max(sizes):,} "
                           f"(a larger gradient skips the bucket).")
        found = calls_per_step(block, int(size), knobs["defaults"].world_size)
        said = (f"reduce_bucket_size {int(size):,} elements: {found} gradient reduction call(s) per optimizer step for "
                f"parameters of {', '.join(f'{n:,}' for n in sorted(set(sizes), reverse=True))} elements.")
        if found != calls:
            return False, said
        world_size = knobs["defaults"].world_size  # one bucket of every gradient: the calls a bucket takes
        low, high = bucket_sizes_for_calls(sizes, calls // calls_per_step(block, sum(sizes), world_size))
        measured = ", ".join(f"{gradient_calls(r):g} with {name}" for name, r in knobs.items())
        span = f"from {low:,} to {high:,}" if high else f"from {low:,} up"
        return True, (f"{said} Every size {span} elements gives {calls}. DeepSpeed fills a bucket "
                      f"parameter by parameter and sends it when the next gradient would overflow it; the same rule "
                      f"gives the calls the chapter's runs measured ({measured}).")

    return exercises.satisfies(
        "bucket size", answer, test,
        task=(f"Write a zero_optimization block with a reduce_bucket_size that makes stage 1 reduce this model's "
              f"gradients in exactly {calls} all_reduce calls per optimizer step."),
        hint=("DeepSpeed's bucketing rule, stated above the exercise, applied to the gradients in the order "
              "zero.model_parameter_sizes() lists them."))


def stage2_wire_bytes_at(record: records.Record, accumulation: int) -> float:
    """Bytes one rank would send per optimizer step if ``record`` (a stage-2 run) took ``accumulation``
    micro-steps: its gradient reductions scale with the micro-steps (one per backward, as its comms log shows),
    the parameters' all-gather and the norm's all_reduce do not."""
    per_micro_step = sum(gradient_sent_bytes(op, row["bytes"], record.world_size)
                         for op, _, row in _gradient_rows(record)) / record.summary["grad_accum"]
    rest = record.comm.wire_bytes_per_step - per_micro_step * record.summary["grad_accum"]
    return rest + per_micro_step * accumulation


def exercise_stage2_bytes(answer: Any, runs: Mapping[tuple[int, str], records.Record],
                          accumulation: int = 4) -> exercises.Verdict:
    """Exercise: predict the bytes one rank sends per optimizer step at stage 2 (fp32, the chapter's model and
    ranks) with ``accumulation`` micro-steps instead of the run's, from the chapter's measured stage-2 record."""
    r2 = runs[(2, "fp32")]
    expected = stage2_wire_bytes_at(r2, accumulation)
    return exercises.number(
        "stage 2 bytes", answer, expected, relative=0.01, unit=" bytes",
        task=(f"Predict the bytes one rank sends per optimizer step at stage 2 with {accumulation} micro-steps per "
              f"optimizer step instead of the run's {r2.summary['grad_accum']}: Ψ = {r2.params:,} parameters, "
              f"N_d = {r2.world_size}, fp32, DeepSpeed's defaults (within 1%)."),
        hint=("a rank keeps only its slice of a gradient once it is reduced: which collectives must then come once "
              "per micro-step, which once per optimizer step? Chapter 03's ring formulas give each one's bytes."),
        why=(f"Stage 2 all-reduces the gradients after every backward "
             f"({gradient_bytes(r2) / r2.summary['grad_accum']:,.0f} bytes per micro-step in the run's comms log), "
             f"so that part grows with the micro-steps; the parameters' all-gather and the gradient norm come once "
             f"per optimizer step. Stage 1 would still send its gradients once."))


def bucket_bytes(block: Mapping, element_bytes: int = 4) -> int:
    """Bytes of the gradient buckets stage 2 allocates for the ``zero_optimization`` ``block`` (DeepSpeed's
    defaults for the keys it leaves out): one bucket of ``reduce_bucket_size`` elements if
    ``contiguous_gradients`` is on, two with ``overlap_comm`` (``setup_buckets`` in ``stage_1_and_2.py``)."""
    def get(key: str):
        return block[key] if key in block else zero_default(key)

    if not get("contiguous_gradients"):
        return 0
    return (2 if get("overlap_comm") else 1) * int(get("reduce_bucket_size")) * element_bytes


def exercise_overlap_buckets(answer: Any, low: float = 50e6, high: float = 100e6) -> exercises.Verdict:
    """Exercise: a stage-2 ``zero_optimization`` block with ``overlap_comm`` and ``contiguous_gradients`` on whose
    fp32 gradient buckets take between ``low`` and ``high`` bytes per GPU (:func:`bucket_bytes`); the course's
    checker must find no error in it."""
    def test(block) -> tuple[bool, str]:
        if not isinstance(block, dict):
            return False, f"{block!r} is not a dict of zero_optimization keys."
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": block,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        if refused := configs.refusal(config, 2):
            return False, refused
        if block.get("stage") != 2:
            return False, "This is a stage-2 block: set \"stage\": 2."
        on = {key: block.get(key, zero_default(key)) for key in ("overlap_comm", "contiguous_gradients")}
        if not all(on.values()):
            return False, f"Keep overlap_comm and contiguous_gradients on (here: {on})."
        found = bucket_bytes(block)
        said = f"Two buckets (overlap_comm) of {int(block.get('reduce_bucket_size', zero_default('reduce_bucket_size'))):,} fp32 elements: {found:,} bytes per GPU."
        if not low <= found <= high:
            return False, f"{said} That is not between {low:,.0f} and {high:,.0f}."
        return True, (f"{said} DeepSpeed's default of {int(zero_default('reduce_bucket_size')):,} elements would take "
                      f"{bucket_bytes({'overlap_comm': True}):,}.")

    return exercises.satisfies(
        "overlap buckets", answer, test,
        task=(f"Write a stage-2 zero_optimization block with overlap_comm on whose fp32 gradient buckets, all of "
              f"them together, take between {low:,.0f} and {high:,.0f} bytes per GPU."),
        hint="what the GPU section found overlap_comm allocates, and the bytes of one fp32 element.")


def exercise_overlap_peak(answer: Any, name: str = "zero2-knobs",
                          measured: Mapping[str, records.Record] | None = None) -> exercises.Verdict:
    """Exercise: predict rank 0's peak memory of the ``overlap_comm=true`` run on GPUs from the ``defaults`` run's
    (:func:`gpu_runs`: the chapter's ``measured`` runs where they ran on GPUs, else the reference ``name``), within 2%."""
    label, runs = gpu_runs(name, measured)
    base, overlap = runs["defaults"].memory.peak(0), runs["overlap_comm=true"].memory.peak(0)
    bucket = 4 * int(zero_default("reduce_bucket_size"))
    return exercises.number(
        "overlap peak", answer, overlap, relative=0.02, unit=" bytes",
        task=(f"On {label}, the stage-2 defaults run peaked at {base:,} bytes per rank (rank 0). Predict the peak of "
              f"the overlap_comm=true run, which reduces one gradient bucket while backward fills the next (within 2%)."),
        hint=("the bytes of the gradient buckets that overlap_comm adds (DeepSpeed's default reduce_bucket_size: "
              "zero.zero_default('reduce_bucket_size') fp32 elements)."),
        why=(f"It peaked {overlap - base:,} bytes above defaults: {(overlap - base) / bucket:.2f} times one bucket of "
             f"{bucket // 4:,} fp32 elements ({bucket:,} bytes). To reduce one bucket while backward fills another, "
             f"DeepSpeed allocates two (setup_buckets in stage_1_and_2.py)."))


def exercise_init_peak(answer: Any, built: Mapping[str, records.Record]) -> exercises.Verdict:
    """Exercise: predict the highest parameter bytes a rank held while building the model inside
    ``deepspeed.zero.Init`` (what the ``zero.Init`` run of ``built`` saved: :func:`save_construction`)."""
    found = construction(built["zero.Init"])
    n = built["zero.Init"].world_size
    return exercises.number(
        "zero.Init peak", answer, found["peak_bytes"], unit=" bytes",
        task=(f"Predict the most parameter bytes one rank holds while it builds the model inside zero.Init on {n} "
              f"ranks (fp32, Ψ = {built['zero.Init'].params:,} parameters; the largest module is one layer)."),
        hint=("what a rank holds of the modules already built, plus the largest module while its __init__ runs "
              "(the section above)."),
        why=(f"the shards of the whole model ({found['held_bytes']:,}) plus the largest module whole while it is "
             f"built ({found['largest_module_bytes']:,}) minus its own shard ({found['largest_module_bytes'] // n:,}), "
             f"as the ranks measured it."))


def persistent_param_bytes(sizes: Sequence[int], threshold: int, world_size: int, element_bytes: int = 4) -> int:
    """Parameter bytes one rank holds at stage 3: every shard, plus each parameter of at most ``threshold``
    elements whole (``stage3_param_persistence_threshold``: ``mark_persistent_parameters`` in
    ``parameter_offload.py`` keeps a parameter with ``ds_numel <= param_threshold`` whole on every rank)."""
    shards = sum(-(-n // world_size) for n in sizes)  # DeepSpeed pads each parameter to a multiple of N_d
    whole = sum(n for n in sizes if n <= threshold)
    return (shards + whole) * element_bytes


def exercise_persistence(answer: Any, knobs: Mapping[str, records.Record], model: str = "mlp") -> exercises.Verdict:
    """Exercise: a stage-3 ``zero_optimization`` block whose ``stage3_param_persistence_threshold`` keeps the
    biases whole on every rank and partitions every weight. :func:`persistent_param_bytes` gives the bytes
    per rank, once it reproduces the parameters the chapter's knob runs measured (``knobs``)."""
    sizes = model_parameter_sizes(model)
    small, large = min(sizes), max(sizes)

    def test(block) -> tuple[bool, str]:
        if not isinstance(block, dict) or "stage3_param_persistence_threshold" not in block:
            return False, "Write a dict with the key stage3_param_persistence_threshold."
        for name, r in knobs.items():
            zero_block = r.summary.get("config", {}).get("zero_optimization", {})
            threshold = zero_block.get("stage3_param_persistence_threshold", zero_default("stage3_param_persistence_threshold"))
            if persistent_param_bytes(sizes, int(threshold), r.world_size) != r.states(0)["params"]:
                return False, f"The persistence rule does not reproduce the measured run {name!r}: report it."
        threshold = block["stage3_param_persistence_threshold"]
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            return False, f"{threshold!r} is not a number of elements."
        n = next(iter(knobs.values())).world_size
        held = persistent_param_bytes(sizes, int(threshold), n)
        whole = [s for s in sorted(set(sizes)) if s <= threshold]
        said = (f"threshold {int(threshold):,}: parameters of {', '.join(f'{s:,}' for s in whole) or 'no'} elements "
                f"stay whole; a rank holds {held:,} bytes of parameters (all shards: "
                f"{persistent_param_bytes(sizes, 0, n):,}).")
        if not small <= threshold < large:
            return False, said
        return True, (f"{said} The rule reproduces the chapter's runs (threshold 0 and DeepSpeed's default 1e5, "
                      f"the params column above).")

    return exercises.satisfies(
        "persistence", answer, test,
        task=("Write a zero_optimization block (stage 3) whose stage3_param_persistence_threshold keeps every bias "
              "whole on every rank and partitions every weight."),
        hint="the persistence rule of the memory section, and the sizes of this model's parameters (models.MODELS['mlp']).")


def optimizer_rows_note(stage0: records.Record, sharded: records.Record, tensors: int, groups: int = 1,
                        rank: int = 0) -> str:
    """Two lines on the memory table of an fp32 ``stage0`` and a ZeRO-1/2 ``sharded`` run. What each optimizer
    state holds beyond the paper's Adam states, counted in 4-byte ``step`` counters (PyTorch's Adam keeps one
    float32 counter per tensor it updates: the model's ``tensors`` parameters at stage 0, ``groups`` flat fp32
    partitions, one per parameter group, once ZeRO flattens them). And why only ``sharded`` has a master row:
    at stage 0 the optimizer updates the model's own parameters; ZeRO hands it an fp32 copy of the rank's slice
    (``single_partition_of_fp32_groups`` in ``stage_1_and_2.py``)."""
    parts = []
    for r, updated, what in ((stage0, tensors, "parameter tensors"), (sharded, groups, "flat fp32 partition(s)")):
        extra = r.states(rank)["optimizer"] - r.theory_states["optimizer"]
        parts.append(f"{r.label} {extra:,.0f} bytes = {extra / 4:g} counter(s) for {updated} {what}"
                     f"{'' if extra == 4 * updated else ' (not one per tensor: the rule does not explain it)'}")
    master, params = sharded.states(rank)["master"], sharded.states(rank)["params"]
    return (f"Optimizer bytes above the paper: Adam's float32 step counter, one per tensor it updates: {'; '.join(parts)}.\n"
            f"Master row: {stage0.label} has none ({stage0.states(rank)['master']:,} bytes), its optimizer updates the "
            f"model's parameters in place; {sharded.label}'s optimizer updates an fp32 copy of this rank's slice, "
            f"{master:,} bytes = params / N_d ({params / sharded.world_size:,.0f}).")


def bucket_count_note(record: records.Record, sizes: Sequence[int]) -> str:
    """One line: the gradient reductions per optimizer step that DeepSpeed's bucketing rule (:func:`bucket_calls`,
    whole gradients per bucket) gives for parameters of ``sizes`` elements with ``record``'s ``reduce_bucket_size``,
    once per backward at stage 2, against the calls the record logged (:func:`gradient_calls`)."""
    zero_block = record.config.get("zero_optimization", {})
    size = int(zero_block.get("reduce_bucket_size", zero_default("reduce_bucket_size")))
    per_backward, micro = bucket_calls(sizes, size), record.summary["grad_accum"]
    counts = ", ".join(f"{sizes.count(n)} x {n:,}" for n in sorted(set(sizes), reverse=True))
    a, b = sorted(sizes, reverse=True)[:2]
    measured = gradient_calls(record)
    return (f"reduce_bucket_size={size:,}: a bucket takes whole gradients ({counts} elements here) and goes out "
            f"before the next would overflow it; the two largest ({a:,} + {b:,}) {'overflow' if a + b > size else 'fit'} "
            f"one bucket: {per_backward} bucket(s) per backward x {micro} micro-steps = {per_backward * micro} "
            f"all_reduce calls per step; the record: {measured:g} "
            f"({'the same' if per_backward * micro == measured else 'not the same'}).")


def reference_step_note(name: str, base: str, settings: Sequence[str],
                        measured: Mapping[str, records.Record] | None = None) -> str:
    """Lines reading the step times of a GPU run (:func:`gpu_runs`: the chapter's ``measured`` runs on GPUs, else
    the reference ``name``): each of ``settings`` against ``base``, its median step after the first (the statistic
    of :func:`timing_verdict`) and its ratio, the range of those steps and where it lies against ``base``'s, rank
    0's peak, and its gradient reductions per step; then which of them peaked lowest and stepped fastest. Figures,
    not verdicts: :func:`timing_verdict` judges a launch's own runs through the load guard."""
    label, runs = gpu_runs(name, measured)
    a = runs[base]

    def warm(r: records.Record) -> list[float]:
        return _steps_ms(r) or [r.timing.median_s * 1000]

    def steps(r: records.Record) -> str:
        t = warm(r)
        return f"{statistics.median(t):.1f} ms (steps {min(t):.1f}-{max(t):.1f})"

    def against(r: records.Record) -> str:
        t, u = warm(r), warm(a)
        if min(t) > max(u):
            return f"every step longer than every {base} step"
        if max(t) < min(u):
            return f"every step shorter than every {base} step"
        return f"its steps overlap the {base} steps' range"

    lines = [f"Step times on {label}, median after step 1; figures, not verdicts (the load guard judges only this "
             f"launch's runs): {base} {steps(a)}, peak {records.format_bytes(a.memory.peak(0))}, "
             f"{gradient_calls(a):g} gradient-reduction calls per step"]
    for other in settings:
        b = runs[other]
        more = b.memory.peak(0) - a.memory.peak(0)
        ratio = statistics.median(warm(b)) / statistics.median(warm(a))
        lines.append(f"  {other}: {steps(b)}, {ratio:.2f}x the {base} median, {against(b)}; peak "
                     f"{records.format_bytes(b.memory.peak(0))} ({'+' if more >= 0 else '-'}"
                     f"{records.format_bytes(abs(more))}); {gradient_calls(b):g} gradient-reduction calls per step")
    shown = {setting: runs[setting] for setting in [base, *settings]}
    lowest = min(shown, key=lambda setting: shown[setting].memory.peak(0))
    fastest = min(shown, key=lambda setting: statistics.median(warm(shown[setting])))
    lines.append(f"Of these {len(shown)}: lowest peak {lowest}, shortest median step {fastest}.")
    return "\n".join(lines)
