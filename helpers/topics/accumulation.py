"""Gradient accumulation (chapter 08): the stage x accumulation grid, its tables, and the speed claim.

The chapter's own script (written by the notebook, ``runs/08/train_accumulation.py``) trains the grid in one
launch and measures each run with :mod:`helpers.measure`; :func:`load_grid` reads the records back. Two ways to
accumulate, both measured:

- **fixed global batch** (the math unchanged): micro batch x accumulation x ranks stays the same, so the
  micro batch shrinks as accumulation grows. Same samples, same losses (in fp32, to rounding).
- **fixed micro batch** (the source article's case, "effective batch size 64"): the global batch grows with
  accumulation: more samples per optimizer step, so per-step costs are spread over more samples.

Each run carries the ``comm`` probe (collectives per optimizer step) and ``micro_steps`` (which phase of
the step issued them: micro-step 1, 2, ... or the optimizer step). Every timing verdict goes through
:mod:`helpers.core.load_guard`.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path
from typing import Mapping, Sequence

import torch

from helpers.core import environment, exercises, launch, load_guard, models, plots, records, references

STAGES = (0, 1, 2, 3)
ACCUMULATIONS = (1, 2, 4, 8)
#: Micro batch per rank at accumulation 1 of the fixed-global-batch grid: global batch = this x ranks.
MICRO_BATCH_AT_ONE = 16
#: The probes the chapter's script attaches (``measure.attach(..., probes=PROBES)``).
PROBES = ("timing", "model_states", "peak_memory", "comm", "micro_steps")
#: Fewest timed steps per run (after the first, which warms up) for a timing verdict: fewer have no spread.
MIN_TIMED_STEPS = 3


def overrides(micro_batch: int, accum: int, precision: str = "fp32") -> dict:
    """The config keys one grid point changes on top of ``ds_configs/zero<stage>.json``."""
    found: dict = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accum}
    if precision != "fp32":
        found[precision] = {"enabled": True}
    return found


def run_name(stage: int, accum: int, micro_batch: int | None = None) -> str:
    """The record's folder name the chapter's script gives a grid point: ``zero<s>-acc<a>`` (fixed global
    batch) or ``zero<s>-acc<a>-micro<m>`` (fixed micro batch ``m``)."""
    return f"zero{stage}-acc{accum}" + (f"-micro{micro_batch}" if micro_batch else "")


@dataclasses.dataclass
class Grid:
    """Records of one launch: ``fixed_global[(stage, accum)]`` and ``fixed_micro[(stage, accum)]`` (the
    latter shares accumulation 1 with the former: the same run)."""

    fixed_global: dict[tuple[int, int], records.Record]
    fixed_micro: dict[tuple[int, int], records.Record]
    global_batch: int
    micro_batch: int  # of the fixed-micro-batch runs


def load_grid(folder: str | Path, stages: Sequence[int] = STAGES, accumulations: Sequence[int] = ACCUMULATIONS,
              micro_at_one: int = MICRO_BATCH_AT_ONE, fixed_micro: Sequence[int] = (4,)) -> Grid:
    """The :class:`Grid` of the records the chapter's script wrote under ``folder`` (one folder per run,
    named by :func:`run_name`). Raises ValueError naming the runs missing, and where a run's global batch is
    not the grid's (an edited script that changed the batch keys)."""
    found, _ = records.load_all(folder)
    wanted = [run_name(s, a) for s in stages for a in accumulations]
    wanted += [run_name(s, a, micro_at_one) for s in stages for a in fixed_micro]
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ValueError(f"no record of {', '.join(missing)} in {folder}: run the chapter's script first")
    fixed_global = {(s, a): found[run_name(s, a)] for s in stages for a in accumulations}
    batches = {r["train_batch"] for r in fixed_global.values()}
    if len(batches) != 1:
        raise ValueError(f"the fixed-global-batch runs trained global batches {sorted(batches)}: one was expected")
    micro = {(s, a): found[run_name(s, a, micro_at_one)] for s in stages for a in fixed_micro}
    micro.update({(s, 1): fixed_global[(s, 1)] for s in stages if (s, 1) in fixed_global})
    return Grid(fixed_global, dict(sorted(micro.items())), batches.pop(), micro_at_one)


# --- tables -------------------------------------------------------------------------------------

def _ops(r: records.Record, short: bool = False) -> str:
    """The run's collectives per step, ``name:count``; ``all_gather_into_tensor`` shortened to ``all_gather``, and
    with ``short`` every ``_tensor`` suffix dropped (``reduce_scatter_tensor`` -> ``reduce_scatter``)."""
    def name(op: str) -> str:
        op = op.split("_into")[0]
        return op.removesuffix("_tensor") if short else op
    return " ".join(f"{name(op)}:{row['count']:g}" for op, row in sorted(r.comm_ops().items()))


def comm_table(runs: Mapping[tuple[int, int], records.Record], short_names: bool = False) -> str:
    """Per (stage, accumulation): batch shape, collectives and bytes (as the comms logger records them) per
    optimizer step and per sample, and bytes per sample relative to accumulation 1 of the same stage.
    ``short_names``: every collective named without its ``_tensor`` suffix (chapter 09)."""
    table = []
    for (stage, accum), r in runs.items():
        batch = r["train_batch"]
        per_step = r.comm.bytes_per_step
        base = runs.get((stage, 1))
        relative = per_step / batch / (base.comm.bytes_per_step / base["train_batch"]) if base else None
        table.append([f"ZeRO-{stage}", f"{accum}", f"{r['micro_batch']} x {accum} x {r['world_size']} = {batch}",
                      _ops(r, short_names), f"{per_step:,.0f}", f"{per_step / batch:,.0f}",
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
    """Step time, samples/s and collective time per step, each the median over the steps after the first (it
    warms up), the basis of the verdicts (numbers that depend on the machine: print them in a cell nbval does
    not compare)."""
    table = []
    for (stage, accum), r in runs.items():
        comm = r.summary.get("micro_steps", {}).get("comm_s_per_step")
        per_sample = statistics.median(seconds_per_sample(r))
        table.append([f"ZeRO-{stage}", f"{accum}", f"{r['train_batch']}", f"{per_sample * r['train_batch'] * 1e3:.1f}",
                      f"{1 / per_sample:,.0f}", "-" if comm is None else f"{comm * 1e3:.1f}"])
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


# --- timing verdicts (through load_guard) and the GPU claim ---------------------------------------

def seconds_per_sample(r: records.Record) -> list[float]:
    """Wall seconds per training sample of each timed optimizer step but the first (it warms up), from the
    ``timing`` probe: a run's steps at different global batches compare per sample."""
    times = r.timing.all_s
    return [t / r["train_batch"] for t in (times[1:] if len(times) > 1 else times)]


def speed_verdict(one: records.Record, many: records.Record, load: load_guard.Load | None) -> load_guard.Verdict:
    """:func:`helpers.core.load_guard.compare` of the seconds per sample of ``one`` (accumulation 1) and
    ``many`` (more accumulation, same stage), named by their accumulation, under ``load``; also withheld where a
    run has fewer than :data:`MIN_TIMED_STEPS` timed steps (no spread to judge a difference by)."""
    lists = {f"accumulation {r['grad_accum']}": seconds_per_sample(r) for r in (one, many)}
    verdict = load_guard.compare(lists, load)
    fewest = min(len(v) for v in lists.values())
    if fewest < MIN_TIMED_STEPS and (verdict.given or verdict.withheld.startswith("the difference")):
        verdict = dataclasses.replace(verdict, withheld=f"{fewest} timed step{'s' if fewest != 1 else ''} per run after "
                                                        f"the first, fewer than the {MIN_TIMED_STEPS} a spread needs")
    return verdict


def load_of(runs: Mapping[object, records.Record]) -> load_guard.Load | None:
    """The load :func:`measure_claim` recorded with ``runs`` (in each record's ``load`` section), or None where
    nothing recorded it (the committed reference of 2026-11-26 predates the load guard)."""
    found = next((r.summary.get("load") for r in runs.values() if r.summary.get("load")), None)
    return None if found is None else load_guard.Load.from_dict(found)


#: The source article's figure: ZeRO-2 with accumulation 4 trained "approximately 30%" faster (its section 4).
ARTICLE = {"stage": 2, "accumulation": 4, "gain": 0.30}


def _against_article(gain: float, about: float = 0.05) -> str:
    """How a measured gain in samples/s (a verdict given) stands against the article's 30% (within ``about``
    counts as its figure)."""
    article = ARTICLE["gain"]
    if abs(gain - article) <= about:
        return f"about the article's {article:.0%}, so the data supports its figure"
    if gain > 0:
        return (f"{gain:.0%} faster, {gain / article:.1f} of the article's {article:.0%}, so the data supports a gain "
                "but not the article's figure")
    return "slower, so the data contradicts the article's claim"


def _stage_names(stages: Sequence[int]) -> str:
    """``ZeRO-0``, ``ZeRO-0 and ZeRO-2``, ``ZeRO-0, ZeRO-1 and ZeRO-3``."""
    names = [f"ZeRO-{s}" for s in stages]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _by_reason(withheld: Mapping[int, str]) -> dict[str, list[int]]:
    """The stages of ``withheld`` (stage -> reason) grouped by reason, in the order first met."""
    grouped: dict[str, list[int]] = {}
    for stage, reason in withheld.items():
        grouped.setdefault(reason.rstrip("."), []).append(stage)
    return grouped


#: The reason :func:`helpers.core.load_guard.compare` gives where no load was recorded.
UNRECORDED = "nothing recorded what else used the devices during the run"


def unrecorded_reason(conditions: str) -> str:
    """Why a committed result saved without a recorded load has no verdict, from its written ``conditions``:
    the load guard took no samples, and what the conditions say of other work on the machine."""
    if not conditions or conditions == "not stated":
        return "the load guard took no samples during that run, and no conditions were stated with it"
    if re.search(r"at the same time|while|beside|shared|another", conditions):
        return "the load guard took no samples during that run; its stated conditions name another job on the machine"
    return "the load guard took no samples during that run; only its stated conditions say what else ran"


def claim_verdict(runs: Mapping[object, records.Record], load: load_guard.Load | None, label: str,
                  accum: int = ARTICLE["accumulation"], about: float = 0.05, unrecorded: str = UNRECORDED) -> str:
    """The sentences on ``runs`` (each stage at accumulation 1 and ``accum``, the micro batch fixed) measured
    under ``load``, opening with ``label`` (device and date): per stage, samples/s at ``accum`` against 1 and,
    where :func:`speed_verdict` gives one, the verdict (for ZeRO-2, against the source article's 30%; within
    ``about`` counts as its figure); then one sentence per reason a verdict is withheld, naming its stages
    (``unrecorded`` stands for the reason where no load was recorded)."""
    by_key = {(r.stage, r["grad_accum"]): r for r in runs.values()}
    lines = [f"{label}: samples/s at accumulation {accum} against 1, the micro batch fixed (steps after the first):"]
    withheld = {}
    for stage in sorted({s for s, a in by_key if a == accum and (s, 1) in by_key}):
        verdict = speed_verdict(by_key[(stage, 1)], by_key[(stage, accum)], load)
        speedup = verdict.medians[0] / verdict.medians[1]
        if not verdict.given:
            withheld[stage] = unrecorded if verdict.withheld == UNRECORDED else verdict.withheld
            lines.append(f"- ZeRO-{stage}: {speedup:.2f}x")
            continue
        text = f"- ZeRO-{stage}: {speedup:.2f}x, beyond the steps' spread ({verdict.spread:.0%})"
        if stage == ARTICLE["stage"] and accum == ARTICLE["accumulation"]:
            text += ": " + _against_article(speedup - 1, about)
        lines.append(text + ".")
    lines += [f"Verdict withheld for {_stage_names(stages)}: {reason}."
              for reason, stages in _by_reason(withheld).items()]
    return "\n".join(lines)


def reference_verdicts(name: str = "grad-accum-claim") -> str:
    """:func:`claim_verdict` of each committed GPU result of the claim, labelled with its device and date, under
    the load recorded with it (none recorded: every verdict withheld, :func:`unrecorded_reason` says why, and the
    reference's conditions are quoted)."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    lines = []
    for (device, date, _, runs), conditions in zip(found, references.reference_conditions(name)):
        lines.append(claim_verdict(runs, load_of(runs), f"Committed reference, {device} ({date})",
                                   unrecorded=unrecorded_reason(conditions)))
        if load_of(runs) is None:
            lines.append(f"  Its conditions, as stated by whoever measured it: {conditions}")
    return "\n".join(lines)


def _reading(step: float, once: float, accum: int) -> str:
    """What a stage's fit says, in words: ``step`` (a step at ``accum`` over one at 1) and ``once`` (the share
    of a step at 1 paid once per optimizer step, clamped to 0..1)."""
    if once >= 0.5:
        return (f"most of a step is paid once, so {accum}x the samples took only {step:.2f}x the time: accumulation "
                "spread that cost")
    if once > 0:
        return f"a step is mostly micro-steps; accumulation spread only the {once:.0%} paid once"
    return f"the fit finds nothing paid once: {accum}x the samples took {step:.2f}x the time, no gain"


def step_cost_reading(runs: Mapping[object, records.Record], load: load_guard.Load | None,
                      accum: int = ARTICLE["accumulation"], label: str = "") -> str:
    """Where the step time of ``runs`` (each stage at accumulation 1 and ``accum``, the micro batch fixed) goes:
    per stage, a step at ``accum`` against one at 1 and samples/s (median step times after the first), and the
    share of an accumulation-1 step paid once per optimizer step, from the line t(a) = once + a x per micro-step
    through both; opening with ``label`` (device and date) where given. Where :func:`speed_verdict` under
    ``load`` is given, what the stage's fit means; where withheld, one sentence per reason saying that those
    stages' timings cannot be read; a line on a negative fitted share where one was printed as 0%; the closing
    line sets the largest given gain beside the article's 30%."""
    by_key = {(r.stage, r["grad_accum"]): r for r in runs.values()}
    lines = [(f"{label}: a" if label else "A") + f" step at accumulation {accum} ({accum}x the samples) against one "
             f"at 1, samples/s, and the share of a step at 1 paid once per optimizer step (once / t(1) in the fit):"]
    given, withheld, negative = [], {}, False
    for stage in sorted({s for s, a in by_key if a == accum and (s, 1) in by_key}):
        one, many = by_key[(stage, 1)], by_key[(stage, accum)]
        verdict = speed_verdict(one, many, load)
        step = (verdict.medians[1] * many["train_batch"]) / (verdict.medians[0] * one["train_batch"])
        fitted = (accum - step) / (accum - 1)
        once = min(1.0, max(0.0, fitted))
        negative = negative or fitted < 0
        line = f"- ZeRO-{stage}: {step:.2f}x as long, {accum / step:.2f}x samples/s; {once:.0%} paid once"
        if verdict.given:
            given.append((stage, verdict.medians[0] / verdict.medians[1] - 1))
            line += f": {_reading(step, once, accum)}"
        else:
            withheld[stage] = verdict.withheld
        lines.append(line)
    # what cannot be read comes first, before the figures it applies to
    lines[1:1] = [f"The timings of {_stage_names(stages)} cannot be read: {reason}."
                  for reason, stages in _by_reason(withheld).items()]
    if negative:
        lines.append(f"0% stands for a negative fit: a step at {accum} took more than {accum}x as long as at 1, so "
                     f"each micro-step cost more at {accum} than at 1 (load or caches), and nothing is paid once.")
    if given:
        stage, gain = max(given, key=lambda g: g[1])
        lines.append(f"The largest gain with a verdict, ZeRO-{stage}'s {gain:+.0%} samples/s, measures this small "
                     f"model on these ranks, not the article's {ARTICLE['gain']:.0%}.")
    return "\n".join(lines)


def bytes_per_sample_ratios(runs: Mapping[tuple[int, int], records.Record], accum: int = ARTICLE["accumulation"]
                            ) -> dict[int, float]:
    """Per stage, the logged bytes per training sample at ``accum`` over those at accumulation 1 (the last column
    of :func:`comm_table`), for the stages measured at both."""
    per_sample = {key: r.comm.bytes_per_step / r["train_batch"] for key, r in runs.items()}
    return {stage: per_sample[(stage, accum)] / per_sample[(stage, 1)]
            for stage, a in runs if a == accum and (stage, 1) in runs}


def _order_reading(speedups: Mapping[int, float], ratios: Mapping[int, float]) -> str:
    """Whether ``speedups`` (stage -> samples/s at accumulation a over 1) follow the order ``ratios`` (stage ->
    bytes per sample at a over 1) predict: fewer bytes per sample, a larger speed-up."""
    stages = [s for s in sorted(speedups) if s in ratios]
    shown = ", ".join(f"ZeRO-{s} {ratios[s]:.2f}x" for s in stages)
    follows = all(speedups[a] > speedups[b] for a in stages for b in stages if ratios[a] < ratios[b] - 1e-9)
    if not follows:
        return (f"they do not follow the order the CPU grid's bytes per sample predict ({shown}): bytes do not set "
                "them alone")
    falling = all(speedups[a] > speedups[b] for a, b in zip(stages, stages[1:]))
    where = f"they fall from ZeRO-{stages[0]} to ZeRO-{stages[-1]} " if falling else "they follow "
    return f"{where}in the order the CPU grid's bytes per sample predict ({shown}: fewer bytes, a larger speed-up)"


def reference_conclusion(name: str = "grad-accum-claim", stage: int = ARTICLE["stage"],
                         accum: int = ARTICLE["accumulation"], ratios: Mapping[int, float] | None = None) -> str:
    """A plain reading of each committed GPU result of the claim: every stage's samples/s at ``accum`` against 1,
    whether they follow the order the bytes per sample ``ratios`` (stage -> factor, :func:`bytes_per_sample_ratios`)
    predict, and the article's stage against the article's 30%, with the verdict of :func:`speed_verdict` under
    the load recorded with the result or why it is withheld."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    lines = []
    for (device, date, _, runs), conditions in zip(found, references.reference_conditions(name)):
        by_key = {(r.stage, r["grad_accum"]): r for r in runs.values()}
        if (stage, 1) not in by_key or (stage, accum) not in by_key:
            continue
        speedups = {s: statistics.median(seconds_per_sample(by_key[(s, 1)]))
                    / statistics.median(seconds_per_sample(by_key[(s, accum)]))
                    for s, a in by_key if a == accum and (s, 1) in by_key}
        text = (f"So the committed {device} run ({date}) measured, in samples/s at accumulation {accum} against 1: "
                + ", ".join(f"ZeRO-{s} {speedups[s]:.2f}x" for s in sorted(speedups)))
        if ratios:
            text += f"; {_order_reading(speedups, ratios)}"
        verdict = speed_verdict(by_key[(stage, 1)], by_key[(stage, accum)], load_of(runs))
        gain = verdict.medians[0] / verdict.medians[1] - 1
        head = f"ZeRO-{stage} gained {gain:+.0%}, where the article reports about {ARTICLE['gain']:.0%}"
        if verdict.given:
            lines.append(f"{text}. {head}: {_against_article(gain)}.")
        else:
            why = unrecorded_reason(conditions) if verdict.withheld == UNRECORDED else verdict.withheld.rstrip(".")
            lines.append(f"{text}. {head}: figures, not a verdict, because {why}.")
    return "\n".join(lines)


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
    """GPU machines only: the claim runs (:func:`claim_specs`) in one launch, watched by
    :func:`helpers.core.load_guard.watch` (the load is kept in each record's ``load`` section, for
    :func:`load_of`), saved with :func:`helpers.core.references.save_reference` as
    ``runs/reference/grad-accum-claim-<N>x<GPU>.json``. Returns the records and the file written
    (``python -m helpers reference grad-accum-claim`` runs this)."""

    env = environment.detect()
    if not env.is_gpu:
        raise RuntimeError("the claim runs on GPUs only: its model would take hours per step on CPU ranks")
    with load_guard.watch(ranks=env.default_world_size) as watched:
        runs = launch.sweep(claim_specs(steps=steps), name="grad-accum-claim", timeout=3600)
    for r in runs.values():
        r.summary["load"] = dataclasses.asdict(watched.load)
    note = (f"ZeRO stages 0-3 at accumulation 1 and 4, {CLAIM['model']}, micro batch {CLAIM['micro_batch']}, "
            f"{CLAIM['precision']}, timed without the comms logger ({steps} steps; the load on the GPUs recorded)")
    return runs, references.save_reference("grad-accum-claim", runs, note=note)


def claim_table(runs: Mapping[str, records.Record], tokens_per_sample: int) -> str:
    """Tokens/s per stage and accumulation, and the speed-up of each accumulation over accumulation 1, both from
    the median seconds per sample of the steps after the first (:func:`seconds_per_sample`), the verdicts' basis."""
    per_sample = {name: statistics.median(seconds_per_sample(r)) for name, r in runs.items()}
    table = []
    for name, r in runs.items():
        stage, accum = r.stage, r["grad_accum"]
        base = next((b for b, x in runs.items() if x.stage == stage and x["grad_accum"] == 1), None)
        speedup = per_sample[base] / per_sample[name] if base else None
        table.append([f"ZeRO-{stage}", f"{accum}", f"{r['micro_batch']} x {accum} x {r['world_size']}",
                      f"{tokens_per_sample / per_sample[name]:,.0f}", "-" if speedup is None else f"{speedup:.2f}x",
                      records.format_peak(r)])
    return records.format_table(table, ["stage", "accum", "micro x accum x ranks", "tokens/s after step 1",
                                        "vs accum 1", "peak per rank"])


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

def _factors(exercise: str, answer: object, expected: Mapping[int, float], why: str, *, task: str,
             hint: str, relative: float = 0.02) -> exercises.Verdict:
    """Check ``answer``, a {stage: factor} dict, against ``expected`` (each within ``relative``)."""

    def test(given: object) -> tuple[bool, str]:
        if not isinstance(given, dict) or set(given) != set(expected):
            raise TypeError(f"write one factor per stage as a dict, {{{', '.join(f'{s}: ...' for s in expected)}}}")
        wrong = [f"ZeRO-{s}: {given[s]!r}" for s, x in expected.items()
                 if isinstance(given[s], bool) or not isinstance(given[s], (int, float))
                 or abs(given[s] - x) > relative * x]
        if wrong:
            return False, f"not within {relative:.0%} of the measured factor: {', '.join(wrong)}."
        return True, "measured: " + ", ".join(f"ZeRO-{s} {x:.2f}x" for s, x in expected.items()) + f". {why}"

    return exercises.satisfies(exercise, answer, test, task=task, hint=hint)


def _phases(r: records.Record) -> str:
    """One run's bytes per phase of an optimizer step, as the ``micro_steps`` probe recorded them."""
    by_phase = r["micro_steps"]["by_phase"]
    return "; ".join(f"{phase} {sum(row['bytes'] for row in ops.values()):,.0f}" for phase, ops in by_phase.items())


def exercise_step_growth(answer: object, grid: Grid, stages: Sequence[int] = (1, 2), accum: int = 8) -> exercises.Verdict:
    """Exercise: predict, per stage in ``stages``, the factor by which the bytes of one optimizer step grow from
    accumulation 1 to ``accum`` at the fixed global batch; checked against the chapter's records."""
    runs = grid.fixed_global
    expected = {s: runs[(s, accum)].comm.bytes_per_step / runs[(s, 1)].comm.bytes_per_step for s in stages}
    why = " ".join(f"ZeRO-{s}, bytes per phase at accumulation 1: {_phases(runs[(s, 1)])}; at {accum}: "
                   f"{_phases(runs[(s, accum)])}." for s in stages)
    return _factors("step growth", answer, expected, why + " A phase that repeats in every micro-step multiplies "
                    "with the accumulation; one paid once per optimizer step does not.",
                    task=f"Predict the factor by which the bytes of one optimizer step grow from accumulation 1 to "
                         f"{accum} at the fixed global batch, for " + " and ".join(f"ZeRO-{s}" for s in stages) + ".",
                    hint="bytes per optimizer step = the sum of its phases' bytes (the phase tables above); count "
                         f"how many times each phase occurs in a step of {accum} micro-steps, then divide by the "
                         "same sum at accumulation 1")


def exercise_bytes_floor(answer: object, grid: Grid, stage: int = 2, accum: int = 4,
                         relative: float = 0.02) -> exercises.Verdict:
    """Exercise: predict the factor that ``stage``'s bytes per training sample approach, against accumulation 1,
    as the accumulation grows without bound at the fixed micro batch. Checked against the records: the bytes of
    one micro-step (they repeat with every micro-step, from the run at ``accum``) over the bytes of a whole step
    at accumulation 1."""
    one, many = grid.fixed_micro[(stage, 1)], grid.fixed_micro[(stage, accum)]
    by_phase = {p: sum(row["bytes"] for row in ops.values()) for p, ops in many["micro_steps"]["by_phase"].items()}
    micro, step = by_phase["micro-step 1"], by_phase["optimizer step"]
    expected = micro / one.comm.bytes_per_step
    measured = (many.comm.bytes_per_step / many["train_batch"]) / (one.comm.bytes_per_step / one["train_batch"])

    def test(given: object) -> tuple[bool, str]:
        if isinstance(given, bool) or not isinstance(given, (int, float)):
            raise TypeError("write the factor as one number, e.g. 0.5")
        if abs(given - expected) > relative * expected:
            return False, f"{given!r} is not within {relative:.0%} of the factor the records give."
        return True, (f"ZeRO-{stage} logs {micro:,.0f} bytes in every micro-step and {step:,.0f} in the optimizer step; "
                      f"at accumulation a a step serves a x {grid.micro_batch} x {one['world_size']} samples, so its "
                      f"bytes per sample fall towards those of the micro-steps alone: {micro:,.0f} / "
                      f"{one.comm.bytes_per_step:,.0f} = {expected:.2f}x accumulation 1's. Measured at accumulation "
                      f"{accum}: {measured:.2f}x, on the way there.")

    return exercises.satisfies(
        "bytes floor", answer, test,
        task=f"At the fixed micro batch of {grid.micro_batch}, predict the factor ZeRO-{stage}'s bytes per training "
             "sample approach, against accumulation 1, as the accumulation grows without bound.",
        hint=f"in ZeRO-{stage}'s phase table, which phases serve more samples as the accumulation a grows, and which "
             "grow with a?")


def how_measured(name: str = "grad-accum-claim") -> str:
    """What measured each committed GPU result of the claim experiment: device, date, note and conditions."""
    return references.each_reference(
        name, lambda device, date, note, _, conditions: f"Measured on {device}, {date} ({note}).\nConditions: {conditions}",
        sep="\n")
