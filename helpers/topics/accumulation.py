"""Gradient accumulation (chapter 08): the stage x accumulation grid in one launch, and its tables.

Two ways to accumulate, both measured:

- **fixed global batch** (the math unchanged): micro batch x accumulation x ranks stays the same, so the
  micro batch shrinks as accumulation grows. Same samples, same losses (in fp32, to rounding).
- **fixed micro batch** (the source article's case, "effective batch size 64"): the global batch grows with
  accumulation: more samples per optimizer step, so per-step costs are spread over more samples.

Each run carries the ``comm`` probe (collectives per optimizer step) and ``micro_steps`` (which phase of
the step issued them: micro-step 1, 2, ... or the optimizer step).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Mapping, Sequence
from unittest import mock

import torch

from helpers.core import configs, environment, exercises, launch, models, plots, records, references
from helpers.core import probes as probe_registry

STAGES = (0, 1, 2, 3)
ACCUMULATIONS = (1, 2, 4, 8)
#: Micro batch per rank at accumulation 1 of the fixed-global-batch grid: global batch = this x ranks.
MICRO_BATCH_AT_ONE = 16
PROBES = probe_registry.DEFAULT + ("micro_steps",)


def overrides(micro_batch: int, accum: int, precision: str = "fp32") -> dict:
    """The config keys one grid point changes on top of ``ds_configs/zero<stage>.json``."""
    found: dict = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accum}
    if precision != "fp32":
        found[precision] = {"enabled": True}
    return found


@dataclasses.dataclass
class Grid:
    """Records of one launch: ``fixed_global[(stage, accum)]`` and ``fixed_micro[(stage, accum)]`` (the
    latter shares accumulation 1 with the former: the same run)."""

    fixed_global: dict[tuple[int, int], records.Record]
    fixed_micro: dict[tuple[int, int], records.Record]
    global_batch: int
    micro_batch: int  # of the fixed-micro-batch runs


def grid_specs(world_size: int, model: str = "mlp", steps: int = 2, stages: Sequence[int] = STAGES,
               accumulations: Sequence[int] = ACCUMULATIONS, micro_at_one: int = MICRO_BATCH_AT_ONE,
               fixed_micro: Sequence[int] = (4,), precision: str = "fp32",
               probes: Sequence[str] = PROBES) -> dict[str, launch.RunSpec]:
    """RunSpecs of the grid, named ``zero<s>-acc<a>`` (fixed global batch ``micro_at_one`` x ranks) and
    ``zero<s>-acc<a>-micro<m>`` (fixed micro batch ``m = micro_at_one``, global batch growing), for each
    accumulation in ``fixed_micro``. Raises ValueError when an accumulation does not divide
    ``micro_at_one``."""
    bad = [a for a in accumulations if not isinstance(a, int) or a < 1 or micro_at_one % a]
    if bad:
        raise ValueError(f"accumulations {bad}: each must be a whole number dividing the micro batch at "
                         f"accumulation 1 ({micro_at_one}), so the global batch stays {micro_at_one} x {world_size}")
    specs = {}
    for stage in stages:
        for accum in accumulations:
            specs[f"zero{stage}-acc{accum}"] = launch.RunSpec(
                f"zero{stage}", model=model, steps=steps, probes=tuple(probes),
                overrides=overrides(micro_at_one // accum, accum, precision))
        for accum in fixed_micro:
            specs[f"zero{stage}-acc{accum}-micro{micro_at_one}"] = launch.RunSpec(
                f"zero{stage}", model=model, steps=steps, probes=tuple(probes),
                overrides=overrides(micro_at_one, accum, precision))
    return specs


def run_grid(model: str = "mlp", steps: int = 2, stages: Sequence[int] = STAGES,
             accumulations: Sequence[int] = ACCUMULATIONS, micro_at_one: int = MICRO_BATCH_AT_ONE,
             fixed_micro: Sequence[int] = (4,), precision: str = "fp32", world_size: int | None = None) -> Grid:
    """Train every grid point in ONE launch (:func:`helpers.core.launch.sweep`) and return the :class:`Grid`."""

    world = environment.detect(world_size).default_world_size
    specs = grid_specs(world, model, steps, stages, accumulations, micro_at_one, fixed_micro, precision)
    results = launch.sweep(specs, name="grad-accum-grid", world_size=world_size)
    fixed_global = {(s, a): results[f"zero{s}-acc{a}"] for s in stages for a in accumulations}
    micro = {(s, a): results[f"zero{s}-acc{a}-micro{micro_at_one}"] for s in stages for a in fixed_micro}
    micro.update({(s, 1): fixed_global[(s, 1)] for s in stages if (s, 1) in fixed_global})
    return Grid(fixed_global, dict(sorted(micro.items())), micro_at_one * world, micro_at_one)


# --- tables -------------------------------------------------------------------------------------

def _calls(r: records.Record) -> float:
    return sum(row["count"] for row in r.comm_ops().values())


def _ops(r: records.Record) -> str:
    return " ".join(f"{op.split('_into')[0]}:{row['count']:g}" for op, row in sorted(r.comm_ops().items()))


def comm_table(runs: Mapping[tuple[int, int], records.Record]) -> str:
    """Per (stage, accumulation): batch shape, collectives and bytes (as the comms logger records them) per
    optimizer step and per sample, and bytes per sample relative to accumulation 1 of the same stage."""
    table = []
    for (stage, accum), r in runs.items():
        batch = r["train_batch"]
        per_step = r.comm.bytes_per_step
        base = runs.get((stage, 1))
        relative = per_step / batch / (base.comm.bytes_per_step / base["train_batch"]) if base else None
        table.append([f"ZeRO-{stage}", f"{accum}", f"{r['micro_batch']} x {accum} x {r['world_size']} = {batch}",
                      _ops(r), f"{per_step:,.0f}", f"{per_step / batch:,.0f}",
                      "-" if relative is None else f"{relative:.2f}x"])
    return records.format_table(table, ["stage", "accum", "micro x accum x ranks = batch", "collectives per step",
                                        "bytes/step", "bytes/sample", "bytes/sample vs accum 1"])


def phase_table(r: records.Record) -> str:
    """Which phase of one optimizer step issued which collectives (``micro_steps`` probe, rank 0)."""
    table = []
    for phase in r["micro_steps"]["phases"]:
        ops = r["micro_steps"]["by_phase"][phase]
        text = " ".join(f"{op.split('_into')[0]}:{row['count']:g}" for op, row in sorted(ops.items())) or "-"
        table.append([phase, text, f"{sum(row['bytes'] for row in ops.values()):,.0f}"])
    return records.format_table(table, ["phase", "collectives", "bytes"])


def where_table(runs: Mapping[tuple[int, int], records.Record], accum: int) -> str:
    """For each stage at accumulation ``accum``: collectives in a micro-step off the boundary, on the
    boundary (the last micro-step) and in the optimizer step."""
    table = []
    for (stage, a), r in runs.items():
        if a != accum:
            continue
        ms = r["micro_steps"]
        cells = []
        for phase in ("micro-step 1", ms["phases"][-2], "optimizer step"):
            ops = ms["by_phase"][phase]
            cells.append(" ".join(f"{op.split('_into')[0]}:{row['count']:g}" for op, row in sorted(ops.items())) or "-")
        table.append([f"ZeRO-{stage}", *cells])
    return records.format_table(table, ["stage", "each micro-step off the boundary", "last micro-step",
                                        "optimizer step"])


def loss_table(runs: Mapping[tuple[int, int], records.Record]) -> str:
    """Per stage and accumulation > 1: do the losses equal accumulation 1's (same global batch), within the
    precision's tolerance? The same text on every processor while they do."""
    table = []
    for (stage, accum), r in runs.items():
        base = runs.get((stage, 1))
        if accum == 1 or base is None:
            continue
        table.append([f"ZeRO-{stage}", f"{accum} vs 1", f"{len(r.losses)} steps",
                      records.loss_agreement(base.losses, r.losses, r["precision"])])
    return records.format_table(table, ["stage", "accumulation", "compared", "losses"])


def timing_table(runs: Mapping[tuple[int, int], records.Record]) -> str:
    """Step time, samples/s and collective time per step (numbers that depend on the machine: print them in a
    cell nbval does not compare)."""
    table = []
    for (stage, accum), r in runs.items():
        comm = r.summary.get("micro_steps", {}).get("comm_s_per_step")
        table.append([f"ZeRO-{stage}", f"{accum}", f"{r['train_batch']}", f"{r.timing.median_s * 1e3:.1f}",
                      f"{r['samples_per_s']:,.0f}", "-" if comm is None else f"{comm * 1e3:.1f}"])
    return records.format_table(table, ["stage", "accum", "batch", "step ms", "samples/s", "collectives ms/step"])


def batch_size_curves(batches: Mapping[str, int], samples: int = 4096, model: str = "mlp") -> dict[str, tuple[int, list[float]]]:
    """Train ``model`` in this process (the plain loop of :func:`helpers.core.models.plain_training`, same seed and
    samples) once per global batch size, each on the same ``samples``; {name: (batch, loss per step)}.

    Runs on one thread: small models gain nothing from more, and on a machine whose cores are busy
    (another notebook's ranks) torch's threads wait on each other (measured: 13x slower with 2 threads)."""

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: (b, models.plain_training(model, steps=samples // b, batch_size=b)) for name, b in batches.items()}
    finally:
        torch.set_num_threads(threads)


def curve_summary(curves: Mapping[str, tuple[int, Sequence[float]]], window: int = 1024) -> str:
    """Mean loss over the first optimizer steps (as many as the shortest curve has), and over the first and the
    last ``window`` samples of each curve (the digits depend on the processor)."""
    steps = min(len(losses) for _, losses in curves.values())
    table = []
    for name, (batch, losses) in curves.items():
        k = max(1, window // batch)
        table.append([name, f"{len(losses)}", f"{sum(losses[:steps]) / steps:.4f}", f"{sum(losses[:k]) / k:.4f}",
                      f"{sum(losses[-k:]) / k:.4f}"])
    return records.format_table(table, ["run", "optimizer steps", f"mean loss, first {steps} steps",
                                        f"mean loss, first {window} samples", f"mean loss, last {window} samples"])


def curve_verdict(curves: Mapping[str, tuple[int, Sequence[float]]], window: int = 1024) -> str:
    """The two comparisons the chapter draws from the curves, in figures rounded to two decimals (the same on
    every processor): per optimizer step (over the steps every curve took) and per sample (over the last
    ``window`` samples), and which curve ends lower per sample."""
    steps = min(len(losses) for _, losses in curves.values())
    by_step = {name: sum(losses[:steps]) / steps for name, (_, losses) in curves.items()}
    by_sample = {name: sum(losses[-max(1, window // batch):]) / max(1, window // batch)
                 for name, (batch, losses) in curves.items()}
    lowest = min(by_sample, key=by_sample.get)
    return (f"per optimizer step, mean loss over the first {steps} steps: "
            + ", ".join(f"{v:.2f} ({name})" for name, v in by_step.items())
            + f"\nper sample seen, mean loss over the last {window} samples: "
            + ", ".join(f"{v:.2f} ({name})" for name, v in by_sample.items())
            + f": {lowest} ends lower")


# --- the GPU claim --------------------------------------------------------------------------------

#: The source article's claim as measured on GPUs: ZeRO-2, accumulation 4 against 1, micro batch 8, bf16.
CLAIM = {"model": "llama-265m", "micro_batch": 8, "accumulations": (1, 4), "precision": "bf16"}


def claim_specs(stages: Sequence[int] = STAGES, model: str = CLAIM["model"], micro_batch: int = CLAIM["micro_batch"],
                accumulations: Sequence[int] = CLAIM["accumulations"], precision: str = CLAIM["precision"],
                steps: int = 6) -> dict[str, launch.RunSpec]:
    """Fixed micro batch, accumulation 1 and 4 for each stage, timed without the comms logger (it waits for
    every collective and would hide any overlap): probes ``timing`` and ``peak_memory`` only."""
    return {f"zero{s}-acc{a}": launch.RunSpec(f"zero{s}", model=model, steps=steps, probes=("timing", "peak_memory"),
                                              overrides=overrides(micro_batch, a, precision))
            for s in stages for a in accumulations}


def measure_claim(steps: int = 6) -> tuple[dict[str, records.Record], object]:
    """GPU machines only: the claim runs (:func:`claim_specs`) in one launch, saved with
    :func:`helpers.core.references.save_reference` as ``runs/reference/grad-accum-claim-<N>x<GPU>.json``.
    Returns the records and the file written (``python -m helpers reference grad-accum-claim`` runs this)."""

    if not environment.detect().is_gpu:
        raise RuntimeError("the claim runs on GPUs only: its model would take hours per step on CPU ranks")
    runs = launch.sweep(claim_specs(steps=steps), name="grad-accum-claim", timeout=3600)
    note = (f"ZeRO stages 0-3 at accumulation 1 and 4, {CLAIM['model']}, micro batch {CLAIM['micro_batch']}, "
            f"{CLAIM['precision']}, timed without the comms logger ({steps} steps, median)")
    return runs, references.save_reference("grad-accum-claim", runs, note=note)


#: The source article's figure: ZeRO-2 with accumulation 4 trained "approximately 30%" faster (its section 4).
ARTICLE = {"stage": 2, "accumulation": 4, "gain": 0.30}


def claim_speedups(runs: Mapping[str, records.Record]) -> dict[tuple[int, int], float]:
    """{(stage, accumulation): samples/s against the same stage's accumulation 1} of the claim runs."""
    base = {r.stage: r["samples_per_s"] for r in runs.values() if r["grad_accum"] == 1}
    return {(r.stage, r["grad_accum"]): r["samples_per_s"] / base[r.stage] for r in runs.values() if r.stage in base}


def claim_verdict(name: str = "grad-accum-claim", about: float = 0.05) -> str:
    """For each committed GPU result of the claim: the speed-up of ZeRO-2 at accumulation 4 over accumulation 1
    against the source article's 30%, as a sentence generated from the reference ("about" the article's figure
    within ``about``), and the speed-up of every stage."""

    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    tokens = models.sequence_length(CLAIM["model"])
    stage, accum, article = ARTICLE["stage"], ARTICLE["accumulation"], ARTICLE["gain"]
    lines = []
    for device, date, _, runs in found:
        speedups = claim_speedups(runs)
        by_key = {(r.stage, r["grad_accum"]): r for r in runs.values()}
        gain = speedups[(stage, accum)] - 1
        if abs(gain - article) <= about:
            verdict = f"about the article's {article:.0%}: the data supports its figure"
        elif gain > 0:
            verdict = (f"{gain / article:.1f} of the article's {article:.0%}, so the data supports a gain at ZeRO-{stage} "
                       "but not the article's figure")
        else:
            verdict = "not faster, so the data contradicts the article's claim"
        lines.append(f"On {device} ({date}): ZeRO-{stage} at accumulation {accum} trained {speedups[(stage, accum)]:.2f}x "
                     f"the tokens/s of accumulation 1 ({by_key[(stage, accum)]['samples_per_s'] * tokens:,.0f} against "
                     f"{by_key[(stage, 1)]['samples_per_s'] * tokens:,.0f}), {gain:.0%} faster: {verdict}.")
        others = {s: x for (s, a), x in sorted(speedups.items()) if a == accum}
        best, worst = max(others, key=others.get), min(others, key=others.get)
        # accumulation spreads all of stages 0 and 1's communication over more samples, part of stage 2's, none of 3's
        spread = [min(others[s] for s in (0, 1) if s in others)] + [others[s] for s in (2, 3) if s in others]
        follows = all(a >= b for a, b in zip(spread, spread[1:]))
        lines.append(f"Accumulation {accum} against 1 at every stage: "
                     + ", ".join(f"ZeRO-{s} {x:.2f}x" for s, x in others.items())
                     + f"; the largest gain at ZeRO-{best}, the smallest at ZeRO-{worst}; in the order of the "
                     f"communication per sample accumulation spreads (stages 0 and 1, then 2, then 3): "
                     f"{'yes' if follows else 'no'}.")
    return "\n".join(lines)


def claim_table(runs: Mapping[str, records.Record], tokens_per_sample: int) -> str:
    """Tokens/s per stage and accumulation, and the speed-up of each accumulation over accumulation 1."""
    table = []
    for name, r in runs.items():
        stage, accum = r.stage, r["grad_accum"]
        base = next((b for b in runs.values() if b.stage == stage and b["grad_accum"] == 1), None)
        speedup = r["samples_per_s"] / base["samples_per_s"] if base else None
        table.append([f"ZeRO-{stage}", f"{accum}", f"{r['micro_batch']} x {accum} x {r['world_size']}",
                      f"{r['samples_per_s'] * tokens_per_sample:,.0f}", "-" if speedup is None else f"{speedup:.2f}x",
                      records.format_peak(r)])
    return records.format_table(table, ["stage", "accum", "micro x accum x ranks", "tokens/s", "vs accum 1",
                                        "peak per rank"])


def same_collectives_table(grid: Grid) -> str:
    """Per stage and accumulation measured both ways: are the collectives of an optimizer step (count and bytes)
    the same whatever the micro batch? (They move gradients and parameters, whose size is the model's.)"""
    table = []
    for (stage, accum), r in grid.fixed_micro.items():
        other = grid.fixed_global.get((stage, accum))
        if accum == 1 or other is None:
            continue
        same = r.comm_ops() == other.comm_ops()
        table.append([f"ZeRO-{stage}", f"{accum}", f"{other['micro_batch']} vs {r['micro_batch']}",
                      "yes" if same else "no"])
    return records.format_table(table, ["stage", "accum", "micro batch", "same collectives and bytes per step"])


def claim_report(name: str = "grad-accum-claim") -> str:
    """The committed GPU results of the claim experiment, each labelled with its device, or a plain statement
    that none are committed yet."""

    tokens = models.sequence_length(CLAIM["model"])
    return references.references_report(name, lambda runs: claim_table(runs, tokens),
                                         how="run this notebook on a GPU machine to measure them.")


# --- figures ----------------------------------------------------------------------------------------

def comm_per_sample(runs: Mapping[tuple[int, int], records.Record], title: str = "Bytes per sample"):
    """Logged collective bytes per training sample against accumulation, one line per ZeRO stage."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for stage in sorted({s for s, _ in runs}):
        points = sorted((a, r.comm.bytes_per_step / r["train_batch"]) for (s, a), r in runs.items() if s == stage)
        ax.plot([a for a, _ in points], [b / 2**10 for _, b in points], marker="o", label=f"ZeRO-{stage}")
    accums = sorted({a for _, a in runs})
    ax.set(xscale="log", xlabel="gradient accumulation steps", ylabel="KiB per sample", title=title)
    ax.set_xticks(accums, [str(a) for a in accums])
    ax.set_xticks([], minor=True)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def loss_vs_samples(curves: Mapping[str, tuple[int, Sequence[float]]], title: str = "Loss by samples seen"):
    """Two panels: loss per optimizer step, and the same losses against samples seen; ``curves`` maps a
    name to (samples per step, losses)."""
    plt = plots.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.4))
    for name, (batch, losses) in curves.items():
        steps = range(1, len(losses) + 1)
        left.plot(steps, losses, label=name)
        right.plot([s * batch for s in steps], losses, label=name)
    left.set(xlabel="optimizer step", ylabel="loss", title="per optimizer step")
    right.set(xlabel="samples seen", ylabel="loss", title="per sample seen")
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- exercises ----------------------------------------------------------------------------------------

def exercise_stage2_bytes(answer: float, grid: Grid, stage: int = 2, accum: int = 4) -> exercises.Verdict:
    """Exercise: predict the bytes one optimizer step of ZeRO-``stage`` logs at accumulation ``accum`` (fixed
    global batch), checked against the chapter's measured record, phase by phase."""
    r = grid.fixed_global[(stage, accum)]
    by_phase = r["micro_steps"]["by_phase"]
    parts = "; ".join(f"{phase}: " + (" + ".join(f"{op.split('_into')[0]} {row['bytes']:,.0f}"
                                                  for op, row in sorted(ops.items())) or "nothing")
                      for phase, ops in by_phase.items())
    gradient = 4 * r.params
    why = (f"the record of ZeRO-{stage}, accumulation {accum}, {r['world_size']} ranks: {parts}. Each micro-step "
           f"all-reduces the whole fp32 gradient ({gradient:,} bytes) as its backward produces it, because a rank "
           "keeps only its own partition; the optimizer step adds the all_gather of the updated parameter shards "
           "(the logger records one rank's shard) and the 4-byte gradient norm.")
    return exercises.number("stage-2 bytes", answer, r.comm.bytes_per_step, relative=0.01, unit=" bytes",
                            task=f"Predict the bytes one optimizer step of ZeRO-{stage} sends at accumulation {accum} "
                                 f"(fixed global batch), as DeepSpeed's comms logger records them.",
                            hint="when does ZeRO-2 reduce gradients: once per step, or in every micro-step? The "
                                 "gradient's size is in the first cell; all_reduce logs the whole tensor, all_gather "
                                 "one rank's shard (1/N_d of the parameters)",
                            why=why)


def deepspeed_batch(config: dict, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) as DeepSpeed's own
    ``DeepSpeedConfig`` resolves ``config`` on ``world_size`` ranks (deriving what the config leaves out)."""
    environment.quiet_deepspeed_import()
    from deepspeed.runtime import config as ds_config  # deferred: after the course has chosen its accelerator

    ranks = mock.Mock(get_rank=lambda *a, **k: 0, get_world_size=lambda *a, **k: world_size)
    with mock.patch.object(ds_config, "dist", ranks):
        parsed = ds_config.DeepSpeedConfig(copy.deepcopy(config))
    return parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def exercise_batch_config(answer: dict, grid: Grid, accum: int = 8, stage: int = 2) -> exercises.Verdict:
    """Exercise: write the batch lines of a ds_config with ``accum`` accumulation steps that keep the chapter's
    global batch (``grid.global_batch``); checked by the course's checker and by DeepSpeed's own batch
    arithmetic on the chapter's ranks, and told what the chapter measured at that point."""
    world = next(iter(grid.fixed_global.values()))["world_size"]

    def test(lines: dict) -> tuple[bool, str]:
        if not isinstance(lines, dict):
            raise TypeError("write the batch lines as a dict, e.g. {\"gradient_accumulation_steps\": 2}")
        other = sorted(set(lines) - set(BATCH_KEYS))
        if other:
            return False, f"only the batch lines, please ({', '.join(BATCH_KEYS)}); not {', '.join(other)}."
        base = {k: v for k, v in configs.load(f"zero{stage}").items() if k not in BATCH_KEYS}
        config = {**base, **lines}
        if refused := configs.refusal(config, world):
            return False, refused
        train, micro, steps = deepspeed_batch(config, world)
        read = f"DeepSpeed reads train_batch_size {train} = {micro} x {steps} x {world} ranks"
        if steps != accum or train != grid.global_batch:
            return False, f"{read}; wanted accumulation {accum} and the global batch {grid.global_batch}."
        measured, one = grid.fixed_global.get((stage, accum)), grid.fixed_global.get((stage, 1))
        cost = (f" The chapter trained exactly this at ZeRO-{stage}: {_ops(measured)} per step, "
                f"{measured.comm.bytes_per_step:,.0f} bytes; losses against accumulation 1: "
                f"{records.loss_agreement(one.losses, measured.losses, measured.precision)}." if measured and one else "")
        return True, f"{read}: the same samples per optimizer step, in {steps} micro-steps of {micro}.{cost}"

    return exercises.satisfies("batch config", answer, test,
                               task=f"Write the batch lines of a ds_config with gradient_accumulation_steps {accum} "
                                    f"that keep the global batch of {grid.global_batch} samples on {world} ranks.",
                               hint="train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                                    "x ranks; DeepSpeed derives whichever one you leave out")


def how_measured(name: str = "grad-accum-claim") -> str:
    """What measured each committed GPU result of the claim experiment: device, date, note and conditions."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    return "\n".join(f"Measured on {device}, {date} ({note}).\nConditions: {conditions}"
                     for (device, date, note, _), conditions in zip(found, references.reference_conditions(name)))
