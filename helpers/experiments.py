"""The experiments chapters repeat, as single calls: a stage against its baseline and its knobs in one
launch (:func:`stage_chapter_runs`), a knob's effect (:func:`knob_runs`).

Each function launches real runs through :func:`helpers.launch.sweep` and returns their records;
the ``*_table`` functions turn records into the plain-text tables the notebooks print.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

from helpers import environment, launch, records, theory

#: Results measured on GPU machines, committed with the course (one JSON file per experiment and device).
REFERENCE_DIR = environment.REPO_ROOT / "notebooks" / "reference"
#: Where a GPU run saves its own results for an instructor to commit.
NEW_REFERENCE_DIR = launch.RUNS_DIR / "reference"
#: Set by ``benchmarks/reference.py``: under what conditions references were measured (alone on the
#: machine, or beside other notebooks), stored with each reference.
CONDITIONS_VARIABLE = "COURSE_REFERENCE_CONDITIONS"


def _baseline_specs(stage: int, model: str, steps: int, precisions: Sequence[str], also: Sequence[int],
                    env: environment.Environment) -> dict[tuple[int, str], launch.RunSpec]:
    """{(stage, precision): spec}: ``stage`` and stage 0 in each precision ``env`` supports (saying which it
    skips), and fp32 runs of the ``also`` stages."""
    specs: dict[tuple[int, str], launch.RunSpec] = {}
    for precision in precisions:
        if not env.supports(precision):
            print(f"{precision}: not supported on {env.device_name}, skipped")
            continue
        overrides = {precision: {"enabled": True}} if precision != "fp32" else None
        for s in (0, stage):
            specs[(s, precision)] = launch.RunSpec(f"zero{s}", model=model, steps=steps, overrides=overrides,
                                                   name=f"zero{s}-{precision}")
    for s in also:
        specs[(s, "fp32")] = launch.RunSpec(f"zero{s}", model=model, steps=steps, name=f"zero{s}-fp32")
    return specs


def _knob_specs(stage: int, settings: Mapping[str, dict], model: str, steps: int) -> dict[str, launch.RunSpec]:
    """{setting: spec}: ``ds_configs/zero<stage>.json`` with each setting's ``zero_optimization`` knobs."""
    return {name: launch.RunSpec(f"zero{stage}", model=model, steps=steps, name=f"zero{stage}-{name}",
                                 overrides={"zero_optimization": knobs} if knobs else None)
            for name, knobs in settings.items()}


def stage_chapter_runs(stage: int, knobs: Mapping[str, dict], model: str = "mlp", steps: int = 4,
                       precisions: Sequence[str] = ("fp32", "bf16"), also: Sequence[int] = (), env=None
                       ) -> tuple[dict[tuple[int, str], records.Record], dict[str, records.Record]]:
    """ZeRO ``stage`` and stage 0 with the same seed and data in each precision the device supports, fp32
    runs of the ``also`` stages (to compare with the neighbouring stage), and one run per ``knobs`` setting
    (see :func:`knob_runs`), all in ONE launch (:func:`helpers.launch.sweep`): a chapter's runs for the price
    of one launch's start-up (about 10 s on a 2-core CPU, tens of seconds on GPUs).

    Returns ``(runs, knob_records)``: {(stage, precision): record} and {setting: record}, the records each
    run would get from a launch of its own. Precisions the device refuses are left out (and said so).
    """
    base = _baseline_specs(stage, model, steps, precisions, also, env or environment.detect())
    tuned = _knob_specs(stage, knobs, model, steps)
    results = launch.sweep([*base.values(), *tuned.values()], name=f"zero{stage}-chapter")
    return ({key: results[spec.name] for key, spec in base.items()},
            {name: results[spec.name] for name, spec in tuned.items()})


def agreement_table(runs: Mapping[tuple[int, str], records.Record], stage: int) -> str:
    """Per precision: do stage 0 and ``stage`` land on the same losses, within that precision's tolerance
    (:data:`helpers.records.LOSS_TOLERANCE`)? The same text on every processor while they do."""
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


def knob_runs(stage: int, settings: Mapping[str, dict], model: str = "mlp", steps: int = 4) -> dict[str, records.Record]:
    """One run per named setting of ``zero_optimization`` knobs on top of ``ds_configs/zero<stage>.json``,
    all in one launch."""
    specs = _knob_specs(stage, settings, model, steps)
    results = launch.sweep(list(specs.values()), name=f"zero{stage}-knobs")
    return {name: results[spec.name] for name, spec in specs.items()}


def knob_table(runs: Mapping[str, records.Record], timings: bool = False) -> str:
    """Per setting: collectives and bytes per step, buffers and gradients held; with timings, peak memory and step time.

    Counts and bytes are deterministic (nbval checks them); timings are not (print them separately).
    """
    rows = []
    for name, r in runs.items():
        ops = r.comm_ops()
        row = [name, " ".join(f"{op}:{row['count']:g}" for op, row in ops.items()),
               f"{r['comm.bytes_per_step']:,.0f}", records.format_bytes(r.states(0)["buffers"]),
               records.format_bytes(r.states(0)["grads"]), records.format_bytes(r.states(0)["params"])]
        if timings:
            row += [records.format_peak(r, 0), f"{r['step_time_s.median'] * 1000:.1f}"]
        rows.append(row)
    headers = ["setting", "collectives per step", "bytes/step", "buffers", "grads", "params"]
    if timings:
        headers += ["peak (rank 0)", "step ms"]
    return records.format_table(rows, headers)


def scaled_out_table(psi: float, world_size: int, largest_layer_params: int = 0, k: int = theory.PAPER_K) -> str:
    """The paper's per-device GB for every stage at ``psi`` parameters on ``world_size`` ranks, with DeepSpeed's estimate."""
    rows = []
    for stage in theory.STAGES:
        paper = theory.paper_bytes_per_device(psi, stage, world_size, k) / 1e9
        estimate = theory.deepspeed_estimate_bytes(int(psi), stage, world_size, largest_layer_params)
        rows.append([f"stage {stage}", f"{paper:.1f}", "-" if estimate is None else f"{estimate / 1e9:.1f}"])
    return records.format_table(rows, ["ZeRO", "paper GB/device", "DeepSpeed estimator GB/device"])


def save_reference(name: str, runs: Mapping[str, records.Record | dict], note: str = "",
                   machine: Mapping | None = None, conditions: str | None = None) -> Path | None:
    """On a GPU machine, keep ``runs`` (records, or the summary dicts of other tasks) as
    ``runs/reference/<name>-<N>x<device>.json`` for an instructor to commit to ``notebooks/reference/``,
    with the software and hardware that measured them (versions, GPUs, ``nvidia-smi topo -m``, driver, date)
    and the conditions (:data:`CONDITIONS_VARIABLE`). Runs a sweep recorded as failures
    (``RunSpec(on_error="record")``) are left out. ``machine`` ({"software": ..., "hardware": ...}) and
    ``conditions`` stand in for this machine's and the variable's where the runs were measured elsewhere
    (:func:`adopt_records`). Does nothing for CPU runs; returns the file written."""
    summaries = {k: (r.summary if isinstance(r, records.Record) else r) for k, r in runs.items()
                 if not isinstance(r, Exception)}
    first = next(iter(summaries.values()))
    if first.get("device") != "cuda":
        return None
    device = f"{first['world_size']}x{first['device_name']}".replace(" ", "-")
    NEW_REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    conditions = (conditions or os.environ.get(CONDITIONS_VARIABLE)
                  or "not stated (measured outside benchmarks/reference.py)")
    machine = machine or {"software": environment.software(), "hardware": environment.hardware()}
    payload = {"experiment": name, "device": f"{first['world_size']} x {first['device_name']}",
               "date": datetime.date.today().isoformat(), "note": note, "software": dict(machine["software"]),
               "hardware": dict(machine["hardware"]), "conditions": conditions, "runs": summaries}
    path = NEW_REFERENCE_DIR / f"{name}-{device}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def adopt_records(name: str, folders: Mapping[str, str | Path], note: str, conditions: str, why: str,
                  machine_file: str | Path | None = None) -> Path:
    """Keep GPU run records that came back without their reference file (a device call stopped before it
    wrote one) as the reference ``name``: the records are the GPU's own, as written by its ranks; the
    conditions are given; software and hardware come from ``machine_file`` (the ``device-environment.json``
    that ``benchmarks/device_run.py`` writes on the GPU machine) or, without one, are marked as not recorded,
    with ``why``. Raises a ValueError for a folder without a record or a record not measured on GPUs."""
    runs = {}
    for label, folder in folders.items():
        if not (Path(folder) / "summary.json").exists():
            raise ValueError(f"{label}: {folder} holds no summary.json (a run's record); give a run's folder")
        runs[label] = records.load(folder)
        if runs[label].summary.get("device") != "cuda":
            raise ValueError(f"{label}: {folder} was not measured on GPUs (device {runs[label].summary.get('device')})")
    if machine_file:
        found = json.loads(Path(machine_file).read_text())
        machine = {"software": found["software"], "hardware": {**found["hardware"], "adopted": why}}
    else:
        machine = {"software": {"recorded": False, "why": why}, "hardware": {"recorded": False, "why": why}}
    path = save_reference(name, runs, note, machine=machine, conditions=conditions)
    assert path is not None  # every record is a GPU's (checked above)
    return path


def reference_runs(name: str) -> list[tuple[str, str, str, dict[str, records.Record | dict]]]:
    """Committed GPU results of experiment ``name``: a list of (device, date, note, {setting: record}).
    Training runs come back as :class:`helpers.records.Record`, other tasks' results as dicts."""
    return [(payload["device"], payload["date"], payload.get("note", ""),
             {k: records.Record(v) if "zero_stage" in v else v for k, v in payload["runs"].items()})
            for payload in _reference_payloads(name)]


def _reference_payloads(name: str) -> list[dict]:
    """The committed reference files of experiment ``name``, oldest file name first."""
    return [json.loads(path.read_text()) for path in sorted(REFERENCE_DIR.glob(f"{name}-*.json"))]


#: How a learner gets a chapter's GPU results where none are committed.
GPU_HOW = "run this chapter on a GPU machine to measure them."


def no_references(name: str, how: str = "") -> str:
    """The plain statement that no GPU result of experiment ``name`` is committed (and ``how`` to measure one)."""
    return (f"No GPU results for {name!r} are committed yet (notebooks/reference/{name}-*.json)"
            + (f": {how}" if how else "."))


def references_report(name: str, render: Callable[[dict], str], how: str = "") -> str:
    """Every committed GPU result of experiment ``name``: a "Measured on <device>, <date> (<note>):" line with
    ``render(runs)`` below it, one block per reference; or :func:`no_references`."""
    found = reference_runs(name)
    if not found:
        return no_references(name, how)
    return "\n\n".join(f"Measured on {device}, {date} ({note}):\nConditions: {conditions}\n{render(runs)}"
                        for (device, date, note, runs), conditions in zip(found, reference_conditions(name)))


def reference_conditions(name: str) -> list[str]:
    """What else ran while each committed GPU result of ``name`` was measured, in :func:`reference_runs`' order."""
    return [payload.get("conditions", "not stated") for payload in _reference_payloads(name)]


def bytes_and_time_report(name: str, table: Callable[[dict, dict], str], how: str = "") -> str:
    """:func:`references_report` for references that keep two sets of the same runs, ``"bytes: <run>"`` (with
    the probes that measure communication) and ``"time: <run>"`` (timing only): ``table(by_bytes, by_time)``,
    ``by_time`` empty where a reference has no timing-only runs."""
    def render(runs: dict) -> str:
        by_bytes = {k.removeprefix("bytes: "): r for k, r in runs.items() if k.startswith("bytes: ")}
        by_time = {k.removeprefix("time: "): r for k, r in runs.items() if k.startswith("time: ")}
        return table(by_bytes, by_time)
    return references_report(name, render, how)


def reference_report(name: str) -> str:
    """The knob table of every committed GPU result of ``name``, timings included, each labelled with its device."""
    return references_report(name, lambda runs: knob_table(runs, timings=True))


def comparison_table(subject: records.Record, baselines: Mapping[str, records.Record], rank: int = 0) -> str:
    """One run against others, ratio by ratio: the 'when to use this stage' tables of the ZeRO chapters.

    Rows: model states, Adam states, gradients and parameters per rank (measured, ``rank``), collective
    calls and wire bytes per step, and whether the losses agree (within the precision's tolerance).
    """
    def calls(r: records.Record) -> float:
        return sum(row["count"] for row in r.comm_ops().values())

    def ratio(a: float, b: float) -> str:
        return records.format_ratio(a, b, suffix="x", none="-")

    def losses(a: records.Record, b: records.Record) -> str:
        return records.loss_agreement(a.losses, b.losses, a.summary["precision"])

    s = subject
    rows = [
        ["model states per rank", *(ratio(s.model_state_bytes(rank), b.model_state_bytes(rank)) for b in baselines.values())],
        *([f"{name} per rank", *(ratio(s.states(rank)[key], b.states(rank)[key]) for b in baselines.values())]
          for key, name in (("optimizer", "Adam states"), ("grads", "gradients"), ("params", "parameters"))),
        ["collective calls per step", *(f"{calls(s):g} vs {calls(b):g}" for b in baselines.values())],
        ["wire bytes per step", *(ratio(s["comm.wire_bytes_per_step"], b["comm.wire_bytes_per_step"])
                                  for b in baselines.values())],
        ["losses", *(losses(s, b) for b in baselines.values())],
    ]
    return records.format_table(rows, [s.label, *(f"vs {name}" for name in baselines)])
