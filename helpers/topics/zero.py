"""The experiments chapters repeat, as single calls: a stage against its baseline and its knobs in one
launch (:func:`stage_chapter_runs`), a knob's effect (:func:`knob_runs`).

Each function launches real runs through :func:`helpers.core.launch.sweep` and returns their records;
the ``*_table`` functions turn records into the plain-text tables the notebooks print.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from helpers.core import environment, launch, records, references, theory


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
    (see :func:`knob_runs`), all in ONE launch (:func:`helpers.core.launch.sweep`): a chapter's runs for the price
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
               f"{r.comm.bytes_per_step:,.0f}", records.format_bytes(r.states(0)["buffers"]),
               records.format_bytes(r.states(0)["grads"]), records.format_bytes(r.states(0)["params"])]
        if timings:
            row += [records.format_peak(r, 0), f"{r.timing.median_s * 1000:.1f}"]
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


def reference_report(name: str) -> str:
    """The knob table of every committed GPU result of ``name``, timings included, each labelled with its device."""
    return references.references_report(name, lambda runs: knob_table(runs, timings=True))


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
        ["wire bytes per step", *(ratio(s.comm.wire_bytes_per_step, b.comm.wire_bytes_per_step)
                                  for b in baselines.values())],
        ["losses", *(losses(s, b) for b in baselines.values())],
    ]
    return records.format_table(rows, [s.label, *(f"vs {name}" for name in baselines)])
