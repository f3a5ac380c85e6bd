"""Compressed communication in DeepSpeed 0.19.8: ZeRO++ and what was removed, as chapter 13 runs it.

- :func:`chapter_runs`: what the chapter's script (``runs/13/train_zeropp.py``, written by the notebook) recorded:
  for each ZeRO++ part, the 16-bit gradient reduction every backend has (``communication_data_type``) and the
  removed 1-bit optimizers, the real error, or a run whose collectives can be compared with plain ZeRO-3.
- :func:`gpu_passes`: on GPUs, the same script launched three times with other arguments (:class:`GpuPass`):
  step times of ZeRO-3 and each ZeRO++ part, bytes per collective (the PyTorch profiler), and the comms logger
  on ZeRO-3 as a cross-check; :func:`gpu_results` reads their records, :func:`save_gpu_reference` keeps them.
- the lines of DeepSpeed's installed code that decide what applies on one node
  (:func:`helpers.core.environment.deepspeed_source`).
- :func:`prediction_table`: the cross-node gain from :func:`zeropp_step_prediction`, by the paper's accounting.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from helpers.core import configs, ds, exercises, load_guard, plots, profiler_comm, records, references, theory
from helpers.topics import tensor_parallel
from helpers.topics.tensor_parallel import Refusal

#: The model's assumptions, stated as parameters, not measurements. The bandwidth chapter's measured
#: fits (helpers/topics/bandwidth.py) are the same class: pass one of them instead of these defaults.
#: Inside a node: NVLink-class, 300 GB/s bus bandwidth for large messages, 10 µs a call. Across nodes:
#: one 100 Gb/s NIC per GPU (12.5 GB/s), 20 µs a call: a commodity cluster, where ZeRO++ is meant to help.
DEFAULT_INTRA_NODE = theory.AlphaBeta.link(bandwidth=300e9, latency=10e-6)
DEFAULT_INTER_NODE = theory.AlphaBeta.link(bandwidth=12.5e9, latency=20e-6)


#: The optimizers DeepSpeed 0.19.8 removed (PR #8490, issue #8489), as their configs named them.
REMOVED_OPTIMIZERS = {"1-bit Adam": "OneBitAdam", "0/1 Adam": "ZeroOneAdam", "1-bit LAMB": "OneBitLamb"}

#: The chapter script's run names (``runs/13/train_zeropp.py``) and the labels its tables give them.
LABELS = {"zero3": "ZeRO-3", "qwz": "qwZ (quantized weights)", "hpz": "hpZ (node-local partition)",
          "qgz": "qgZ (quantized gradients)", "zeropp": "ZeRO++ (all three)",
          "bf16-gradients": "16-bit gradients (communication_data_type)", "onebit-adam": "1-bit Adam",
          "zero-one-adam": "0/1 Adam", "onebit-lamb": "1-bit LAMB", "zero3-again": "ZeRO-3 again"}


def chapter_runs(folder: str | Path, since: float = 0.0) -> dict[str, records.Record | Refusal]:
    """What the chapter's script wrote into ``folder`` since ``since`` (a ``time.time()``), by label
    (:data:`LABELS`; a run the script names otherwise keeps its name): its record, or the :class:`Refusal` of a
    setting DeepSpeed refused on these ranks, in the order they were written."""
    return {LABELS.get(name, name): result for name, result in tensor_parallel.chapter_runs(folder, since).items()}


def _ops(record: records.Record) -> dict[str, tuple[float, float]]:
    return {op: (row["count"], row["bytes"]) for op, row in record.comm_ops().items()}


def _changes(result: records.Record, base: records.Record) -> tuple[list[str], bool, str]:
    """How a setting's run differs from ZeRO-3's: each collective whose count or bytes per step changed (as
    "op before -> after"), whether its losses are identical, and their agreement at its precision's tolerance."""
    changed = [f"{op} {records.format_bytes(base_row[1])} -> {records.format_bytes(row[1])}"
               for op, row in _ops(result).items() for base_row in [_ops(base).get(op, (0, 0))]
               if row != base_row]
    # gradients reduced in 16 bits round like bf16 training: judge them by bf16's tolerance
    precision = result.summary["config"].get("communication_data_type") or result.summary["precision"]
    same = records.loss_agreement(base.losses, result.losses, "fp32", 0.0) == "within 0e+00"
    return changed, same, records.loss_agreement(base.losses, result.losses, precision)


def outcome_table(results: Mapping[str, records.Record | Refusal], baseline: str = "ZeRO-3") -> str:
    """Per setting: did it run, and if so did its collectives (count and bytes per step, by op) differ from
    plain ZeRO-3's, and its losses? A failure shows DeepSpeed's exception and message."""
    base = results[baseline]
    rows = []
    for name, result in results.items():
        if isinstance(result, Refusal):
            rows.append([name, f"refused: {result.type}", result.message.splitlines()[0]])
            continue
        if name == baseline:
            rows.append([name, "ran", "the baseline"])
            continue
        changed, same, losses = _changes(result, base)
        detail = ("collectives and losses identical to ZeRO-3: a no-op here" if not changed and same
                  else f"{'; '.join(changed) or 'same collectives'} per step; losses {losses} of ZeRO-3's")
        rows.append([name, "ran", detail])
    return records.format_table(rows, ["setting", "on these ranks", "what happened"])


def outcome_summary(results: Mapping[str, records.Record | Refusal], baseline: str = "ZeRO-3") -> str:
    """:func:`outcome_table` in one sentence, for the ranks that ran it: which ZeRO++ switches and 16-bit
    gradient reduction DeepSpeed refused, which changed nothing, and which changed which collectives (the removed
    optimizers are left out: DeepSpeed refuses them everywhere)."""
    base = results[baseline]
    refused, idle, cut = [], [], []
    for name, result in results.items():
        if name == baseline or name in REMOVED_OPTIMIZERS or name == AGAIN:
            continue
        short = name.split(" (")[0]
        if isinstance(result, Refusal):
            refused.append(short)
            continue
        changed, same, _ = _changes(result, base)
        if not changed and same:
            idle.append(short)
        else:
            cut.append(f"{short} ({'; '.join(changed) + ' per step' if changed else 'same collectives, other losses'})")
    parts = ([f"DeepSpeed refused {_listed(refused)}"] if refused else []) + (
        [f"{_listed(idle)} sent exactly ZeRO-3's collectives and trained to its losses"] if idle else []) + (
        [f"{_listed(cut)} changed the traffic"] if cut else [])
    return f"On these {base['world_size']} {base['backend']} ranks ({base['device']}, one node): {'; '.join(parts)}."


def _listed(names: Sequence[str]) -> str:
    """Names in a sentence: "a", "a and b", "a, b and c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def checker_findings(kinds: Sequence[str] = tuple(REMOVED_OPTIMIZERS.values()), world_size: int = 2) -> str:
    """What the course's config checker says about each removed optimizer, before any process starts."""
    lines = []
    for kind in kinds:
        config = configs.merged(configs.load("zero0"), {"optimizer": {"type": kind, "params": {"lr": 1e-3}}})
        for finding in configs.check(config, world_size):
            if finding.key.startswith("optimizer"):
                lines.append(str(finding))
    return "\n".join(lines)


def supported_optimizers() -> list[str]:
    """The optimizer types DeepSpeed 0.19.8 builds from a config (``DEEPSPEED_OPTIMIZERS``)."""
    DEEPSPEED_OPTIMIZERS = ds.load("deepspeed.runtime.config").DEEPSPEED_OPTIMIZERS

    return list(DEEPSPEED_OPTIMIZERS)


def removed_config_keys() -> dict[str, str]:
    """Config keys DeepSpeed 0.19.8 refuses because their feature was removed, with its own message."""
    ds_config = ds.load("deepspeed.runtime.config")
    _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS = ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS, ds_config._REMOVED_ZERO_CONFIG_KEYS

    found = dict(_REMOVED_TOP_LEVEL_CONFIG_KEYS)
    found.update({f"zero_optimization.{k}": v for k, v in _REMOVED_ZERO_CONFIG_KEYS.items()})
    return found


def removed_features_issue() -> str:
    """The issue DeepSpeed 0.19.8's messages about removed features point to."""
    _REMOVED_FEATURES_ISSUE = ds.load("deepspeed.runtime.config")._REMOVED_FEATURES_ISSUE

    return _REMOVED_FEATURES_ISSUE


# --- on GPUs ----------------------------------------------------------------------------------

#: The GPU runs' model: LLaMA-style, 85M parameters (``helpers.core.models``).
GPU_MODEL = "llama-medium"
#: The GPU runs' changes to the script's ZeRO-3 config, for every setting (the notebook writes them to the JSON
#: file the script's ``--config`` reads): bf16, 16 samples a micro-step, and layers released after use, as a
#: model too large to keep gathered would be (else DeepSpeed keeps them and backward gathers nothing).
GPU_OVERRIDES = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}}
#: DeepSpeed's own ZeRO-3 defaults for what :data:`GPU_OVERRIDES` and ``ds_configs/zero3.json`` set to 0
#: (``gpu_config(zero_knobs=DEEPSPEED_DEFAULTS)`` measures the settings with these instead).
DEEPSPEED_DEFAULTS = {"stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                      "stage3_param_persistence_threshold": 100_000}
#: The script's run names that the GPU runs train: plain ZeRO-3 and every ZeRO++ setting.
GPU_SETTINGS = ("zero3", "qwz", "hpz", "qgz", "zeropp")
#: The PyTorch profiler's probe, by the import path the script's ``--probes`` takes: it only watches the
#: collectives as they are issued, where DeepSpeed's comms logger synchronizes the device after every one.
TORCH_COMM = "helpers.core.profiler_comm:TorchComm"
#: Steps of a timing run: the first warms up, the medians read the rest.
TIME_STEPS = 12
#: Steps of a bytes run: one to warm up, then the profiled ones (bytes are per step). The profiler records
#: every CPU op of those steps with its shapes, read in Python when the run ends: on 4 x H200 a bytes launch of
#: five 12-step runs took 147 s for about 26 s of training, and 74 s with 4 steps each (chapter 13's check,
#: 2026-11-27).
BYTES_STEPS = 4
#: Settings also run with the comms logger beside the profiler, to compare the two methods call for call
#: (``profiler_comm.profiler_check_table``): plain ZeRO-3. Not qwZ: on 4 x H200 its logger run had printed the
#: logger's summary, its all-gathers timed at 5.0 s each on average against ZeRO-3's 0.35-0.77 s, but had not
#: ended when its deadline came, 91 s after it started (2026-11-27).
LOGGER_CHECKS = ("zero3",)
LOGGER_SUFFIX = ", comms logger"
#: Steps of a comms-logger run: one to warm up, one logged. The logger waits for the device after every
#: collective: on 2 x H200 plain ZeRO-3 took about 3 s a step with it, 0.6 s with the profiler alone.
LOGGER_STEPS = 2
#: The timing pass's last run: plain ZeRO-3 timed again, so that drift during the sweep shows.
AGAIN = "ZeRO-3 again"


@dataclasses.dataclass(frozen=True)
class GpuPass:
    """One launch of the chapter's script on GPUs: which of its settings, how many steps, which probes."""

    name: str
    settings: tuple[str, ...]
    steps: int
    probes: tuple[str, ...]

    def args(self, config: str | Path, out: str | Path) -> list[str]:
        """The script's arguments for this pass: the GPU model, the JSON file of :func:`gpu_config` and ``out``."""
        return ["--out", str(out), "--model", GPU_MODEL, "--steps", str(self.steps), "--config", str(config),
                "--settings", *self.settings, "--probes", *self.probes]


def gpu_config(zero_knobs: Mapping | None = None) -> dict:
    """What every GPU run changes in the script's ZeRO-3 config (:data:`GPU_OVERRIDES`), with ``zero_knobs``
    (e.g. :data:`DEEPSPEED_DEFAULTS`) in its ``zero_optimization``."""
    return configs.merged(GPU_OVERRIDES, {"zero_optimization": dict(zero_knobs or {})})


def gpu_passes() -> list[GpuPass]:
    """The three launches of the GPU measurement, in order:

    1. ``time``: every setting, then ZeRO-3 again (:data:`AGAIN`, the repeat the load guard checks drift with),
       timed with no probe that synchronizes the device after a collective;
    2. ``bytes``: every setting, :data:`BYTES_STEPS` steps, collectives counted by the PyTorch profiler;
    3. ``logger``: :data:`LOGGER_CHECKS` with DeepSpeed's comms logger and the profiler on the same run."""
    return [GpuPass("time", (*GPU_SETTINGS, "zero3-again"), TIME_STEPS, ("timing", "peak_memory")),
            GpuPass("bytes", GPU_SETTINGS, BYTES_STEPS, ("model_states", "peak_memory", TORCH_COMM)),
            GpuPass("logger", LOGGER_CHECKS, LOGGER_STEPS, ("comm", TORCH_COMM))]


def _as_failure(result: Refusal | Exception) -> dict:
    """A run that did not train, as a reference file keeps it: its error, message and last lines."""
    if isinstance(result, Refusal):
        return {"error_type": result.type, "message": result.message, "device": "cuda",
                "where": result.traceback.strip().splitlines()[-12:]}
    tail = getattr(result, "log_tail", "") or ""
    return {"error_type": getattr(result, "error_type", None) or type(result).__name__,
            "message": (str(result).splitlines() or [""])[0], "device": "cuda",
            "where": tail.strip().splitlines()[-12:]}


def gpu_results(folder: str | Path, since: float = 0.0, failed: Mapping[str, Exception] | None = None
                ) -> tuple[dict[str, records.Record | dict], dict[str, records.Record | dict]]:
    """The GPU passes' records (:func:`gpu_passes`, each written to ``folder/<pass>``) since ``since``, by label:
    ({setting: bytes run, "<setting>, comms logger": logger run}, {setting: timing run}). A setting DeepSpeed
    refused, or that a pass's launch ended before (``failed``: {pass: its exception}), comes back as a dict
    with its error (``error_type``, ``message``, ``where``), as :func:`save_gpu_reference` keeps it."""
    failed = failed or {}
    found: dict[str, dict[str, records.Record | dict]] = {}
    for one in gpu_passes():
        where = Path(folder) / one.name
        try:
            runs = tensor_parallel.chapter_runs(where, since)
        except FileNotFoundError:  # the pass wrote nothing (its launch failed before a run ended)
            runs = {}
        found[one.name] = {}
        for name in one.settings:
            result = runs.get(name)
            if result is None and one.name not in failed:
                continue
            label = LABELS[name] + (LOGGER_SUFFIX if one.name == "logger" else "")
            found[one.name][label] = (result if isinstance(result, records.Record)
                                      else _as_failure(result if result is not None else failed[one.name]))
    return {**found["bytes"], **found["logger"]}, found["time"]


def logger_check_table(by_bytes: Mapping[str, records.Record]) -> str:
    """The comms-logger runs beside the profiler: per collective, calls and bytes per step by each method
    on the same run (``comm`` and ``comm_profiler``); a logger run that failed says where each of its
    ranks' threads was (the innermost frame in DeepSpeed's or the course's code)."""

    rows, done = [], {}
    for key, result in by_bytes.items():  # every logger run of this measurement (older ones had more)
        if not key.endswith(LOGGER_SUFFIX):
            continue
        name = key[:-len(LOGGER_SUFFIX)]
        if _failure(result):
            where = result.get("where", [])
            # per stack (a rank's thread), its innermost frame in DeepSpeed's or the course's code, else its
            # innermost frame; an exception: its last line
            heads = [i for i, line in enumerate(where) if "most recent call first" in line]
            stacks = [where[i + 1:j] for i, j in zip(heads, heads[1:] + [len(where)])]
            frames = [next((f for f in stack if "/deepspeed/" in f or "/helpers/" in f), stack[0]).strip()
                      for stack in stacks if stack]
            for i, frame in enumerate(frames or where[-1:]):
                rows.append([name if i == 0 else "", f"failed: {_failure(result)}" if i == 0 else "",
                             re.sub(r'File "(?:[^"]*/)?([^"/]+)", line (\d+) in (\S+)', r"\3 (\1:\2)", frame)])
        else:
            done[name] = result if isinstance(result, records.Record) else records.Record(result)
    table = records.format_table(rows, ["setting", "with the comms logger", "where each stack was"]) if rows else ""
    return "\n\n".join(t for t in (profiler_comm.profiler_check_table(done) if done else "", table) if t)


def gpu_table(by_bytes: Mapping[str, records.Record], by_time: Mapping[str, records.Record] | None = None,
              baseline: str = "ZeRO-3") -> str:
    """Per setting: each collective's calls and bytes per step and the total against plain ZeRO-3's (the
    comms-logger runs), then the median step time after the first step (:func:`_median_step_s`, the figure
    :func:`one_node_reading` and :func:`drift_reading` use) against ZeRO-3's and the peak memory per rank
    (the timing runs). A side that was not measured or failed says so in its columns."""
    by_time = by_time or {}
    names = list(dict.fromkeys([*by_time, *by_bytes]))
    base = by_bytes.get(baseline)
    base_bytes = base.comm.bytes_per_step if base is not None and not _failure(base) else None
    base_time = by_time.get(baseline)
    rows = []
    for name in names:
        record, timed = by_bytes.get(name), by_time.get(name)
        if record is None:
            row = [name, "not measured", "-", "-"]
        elif _failure(record):
            row = [name, f"failed: {_failure(record)}", "-", "-"]
        else:
            ops = " ".join(f"{op}:{r['count']:g}x{records.format_bytes(r['bytes'] / max(r['count'], 1))}"
                           for op, r in record.comm_ops().items())
            row = [name, ops, records.format_bytes(record.comm.bytes_per_step),
                   records.format_ratio(record.comm.bytes_per_step, base_bytes or 0, none="-")]
        if by_time:
            if timed is None and name.endswith(LOGGER_SUFFIX):  # measured bytes only
                row += ["-", "-", "-"]
            elif timed is None or _failure(timed):
                row += [f"failed: {_failure(timed)}" if timed is not None else "not measured", "-", "-"]
            else:
                t = _median_step_s(timed)
                t0 = _median_step_s(base_time) if base_time is not None and not _failure(base_time) else None
                row += [f"{t * 1000:.1f}", records.format_ratio(t, t0 or 0, none="-"),
                        records.format_peak(timed)]
        rows.append(row)
    headers = ["setting", "collectives per step: calls x bytes per call", "bytes/step", "vs ZeRO-3"]
    if by_time:
        headers += [STEP_HEADER, "vs ZeRO-3", "peak/rank"]
    return records.format_table(rows, headers)


def _failure(result) -> str:
    """A failed run's error in a line (as :func:`gpu_results` and a reference file keep it), else ""."""
    if isinstance(result, dict) and "error_type" in result:
        return f"{result['error_type']}: {result['message']}".splitlines()[0]
    return ""


#: The step-time column of :func:`gpu_table`: what its figure is.
STEP_HEADER = "median step ms (steps 2+)"
#: The footnote under a table with a peak marked ``<=`` (why: ``docs/zeropp-references.md``).
PEAK_FOOTNOTE = "<= : an upper bound, which may include earlier runs of its launch (docs/zeropp-references.md)."


#: The words a reference's note ends with where it holds timing runs only (no bytes).
TIMING_ONLY = "timing runs only"


def reference_report(name: str = "zeropp", timing_only: bool | None = None) -> str:
    """The committed GPU results of this chapter, each labelled with its device, date and note and the
    conditions it was measured under; a peak that may include earlier runs is marked ``<=``
    (:data:`PEAK_FOOTNOTE`). ``timing_only``: None for every reference, True for only those whose note says
    they hold timing runs only (:data:`TIMING_ONLY`), False for only the others."""
    report = references.bytes_and_time_report(
        name, both_tables, how="run this notebook on a machine with 2 or more NVIDIA GPUs to measure them.")
    report = report.replace(records.PEAK_NOTE, PEAK_FOOTNOTE)
    if timing_only is None:
        return report
    blocks = report.split("\n\nMeasured on ")
    blocks = blocks[:1] + [f"Measured on {b}" for b in blocks[1:]]
    return "\n\n".join(b for b in blocks if (TIMING_ONLY in b.splitlines()[0]) == timing_only)


def bytes_reading(name: str = "zeropp") -> str:
    """Why qwZ's measured byte ratio differs from the paper's accounting, as a worked table per committed
    reference, from its records, in the accounting's unit M (the model in 16 bits, 2 x its parameters). The comms
    logger (and the profiler, counted the same way) records each call's input tensor: an all-gather's is one
    rank's shard, so ZeRO-3's forward and backward gathers add up to 2 x M/ranks; a reduce-scatter's is the whole
    gradient, M. qwZ halves only the gathers (int8 values, plus small per-block scales in a second all-gather
    per gather, ``_all_gather_coalesced`` in ``runtime/zero/partition_parameters.py``), so it saves less of the
    total than the accounting's 3M -> 2M, where every collective counts the full model."""
    rows, ratios = [], []
    accounting = (sum(v["intra"] for v in zeropp_volume(1.0, qwz=True, nodes=1).values())
                  / sum(v["intra"] for v in zeropp_volume(1.0, nodes=1).values()))
    for device, _, _, runs in references.reference_runs(name):
        plain, qwz = runs.get("bytes: ZeRO-3"), runs.get("bytes: qwZ (quantized weights)")
        if not all(isinstance(r, records.Record) and r.comm is not None for r in (plain, qwz)):
            continue
        m, ranks = 2.0 * plain.params, plain["world_size"]
        for label, run in (("ZeRO-3", plain), ("qwZ", qwz)):
            gather, scatter = run.comm_ops()["all_gather_into_tensor"], run.comm_ops()["reduce_scatter_tensor"]
            gathered = f"{gather['bytes'] / m:.2f}M"
            if run is plain:  # the gathers as shards: passes x M/ranks
                gathered = f"{gather['bytes'] * ranks / m:.0f} x M/{ranks} = {gathered}"
            rows.append([device if run is plain else "", label, f"{gather['count']:g}", gathered,
                         f"{scatter['bytes'] / m:.2f}M", f"{(gather['bytes'] + scatter['bytes']) / m:.2f}M",
                         f"{run.comm.bytes_per_step / plain.comm.bytes_per_step:.2f}x"])
        ratios.append((ranks, qwz.comm.bytes_per_step / plain.comm.bytes_per_step,
                       qwz.comm_ops()["all_gather_into_tensor"], plain.comm_ops()["all_gather_into_tensor"]))
    if not rows:
        return "No committed reference counted the bytes of ZeRO-3 and qwZ."
    table = records.format_table(rows, ["measured on", "setting", "all-gather calls", "all-gathers",
                                        "reduce-scatter", "total", "bytes vs ZeRO-3"])
    ranks, ratio, q_gather, gather = ratios[0]
    per_call = (q_gather["bytes"] / q_gather["count"]) / (gather["bytes"] / gather["count"])
    return (f"The comms logger records each call's input tensor: for an all-gather one rank's shard (M/ranks), for a "
            f"reduce-scatter the whole gradient (M). Per step, in M = 2Ψ bytes (the model in bf16):\n{table}\n"
            f"qwZ halves only the gathers, so with {ranks} ranks it sends {ratio:.2f}x ZeRO-3's bytes, not the "
            f"accounting's {accounting:.2f}x (3M -> 2M, where every collective counts the full model). Its "
            f"{q_gather['count'] / gather['count']:g}x calls: each gather sends the int8 values (0.5x ZeRO-3's call) "
            f"and, in a second call, their small scales, so the average call is {per_call:.2f}x ZeRO-3's.")


def both_tables(by_bytes: Mapping[str, records.Record], by_time: Mapping[str, records.Record] | None = None) -> str:
    """:func:`gpu_table`, then :func:`logger_check_table` where there were comms-logger runs."""
    check = logger_check_table(by_bytes)
    return gpu_table(by_bytes, by_time) + (f"\n\nThe comms logger beside the profiler:\n{check}" if check else "")


def save_gpu_reference(by_bytes: Mapping[str, records.Record | dict], by_time: Mapping[str, records.Record | dict],
                       note: str, name: str = "zeropp", load: load_guard.Load | None = None) -> Path | None:
    """Keep the GPU passes (:func:`gpu_results`) as one reference file (``runs/reference/<name>-<N>x<GPU>.json``),
    each record with the ``load`` the guard saw beside the launches (so :func:`one_node_reading` can give or
    withhold a verdict); a failure is kept as its error, so the committed file says what failed. Nothing is
    saved where no run trained (a reference needs a record to name its device)."""
    if not any(isinstance(r, records.Record) for r in [*by_bytes.values(), *by_time.values()]):
        return None

    def kept(result):
        if load is not None and isinstance(result, records.Record):
            result.summary["load"] = dataclasses.asdict(load)
        return result

    runs = {f"bytes: {k}": kept(r) for k, r in by_bytes.items()} | {f"time: {k}": kept(r) for k, r in by_time.items()}
    ordered = dict(sorted(runs.items(), key=lambda item: isinstance(item[1], dict)))  # a record first (its device)
    return references.save_reference(name, ordered, note)


# --- across nodes: the latency-bandwidth model ------------------------------------------------

def volume_table(psi: float) -> str:
    """The paper's accounting for ``psi`` 16-bit parameters, in units of the model M = 2Ψ bytes: what
    crosses nodes per GPU and step for each setting, and what one node moves (nothing crosses)."""
    m = 2.0 * psi
    rows = []
    for name, (qwz, hpz, qgz) in {"ZeRO-3": (False, False, False), "qwZ": (True, False, False),
                                  "hpZ": (False, True, False), "qgZ": (False, False, True),
                                  "ZeRO++ (all three)": (True, True, True)}.items():
        across = zeropp_volume(psi, qwz, hpz, qgz, nodes=2)
        one = zeropp_volume(psi, qwz, hpz, qgz, nodes=1)
        rows.append([name, *(f"{across[p]['inter'] / m:g}M" for p in ZEROPP_PHASES),
                     f"{sum(v['inter'] for v in across.values()) / m:g}M",
                     f"{sum(v['intra'] for v in one.values()) / m:g}M"])
    return records.format_table(rows, ["setting", *(f"{p} (across)" for p in ZEROPP_PHASES),
                                       "across nodes", "one node, in total"])


def prediction_table(psi: float, layers: int, tokens_per_gpu: int, flops_per_s: float,
                     inter_gbit: Sequence[float] = (100, 200, 400, 800),
                     intra: theory.AlphaBeta = DEFAULT_INTRA_NODE,
                     inter: theory.AlphaBeta = DEFAULT_INTER_NODE) -> str:
    """Predicted milliseconds per micro-step of ZeRO-3 and ZeRO++ (:func:`zeropp_step_prediction`) on one node,
    then on two or more nodes joined at each of ``inter_gbit`` Gbit/s per GPU (``inter``'s latency): first by
    the paper's accounting (no cost for ZeRO++'s own work). The assumptions are printed above the table."""
    rows = []
    cases = [("1 node", 1, inter)] + [(f"2+ nodes, {g:g} Gb/s per GPU", 2, theory.AlphaBeta.link(g * 1e9 / 8, inter.alpha))
                                      for g in inter_gbit]
    for label, nodes, link in cases:
        p = zeropp_step_prediction(psi, layers, tokens_per_gpu, nodes, flops_per_s, intra, link)
        row = [label, f"{p['compute_s'] * 1e3:.0f}", f"{p['zero3_s'] * 1e3:.0f}", f"{p['zeropp_s'] * 1e3:.0f}",
               f"{p['speedup']:.2f}x"]
        rows.append(row)
    header = (f"assumed: inside a node {intra.bandwidth / 1e9:g} GB/s ({intra.bandwidth * 8 / 1e9:g} Gb/s; "
              f"GB/s are bytes, Gb/s bits) and {intra.alpha * 1e6:g} µs a call; "
              f"across nodes {inter.alpha * 1e6:g} µs a call; compute {flops_per_s / 1e12:g} TFLOP/s per GPU; "
              "no overlap of communication with compute")
    headers = ["where", "compute ms", "ZeRO-3 ms", "ZeRO++ ms", "speed-up, paper's accounting"]
    return header + "\n" + records.format_table(rows, headers)


def prediction_reading(psi: float, layers: int, tokens_per_gpu: int, flops_per_s: float,
                       inter_gbit: Sequence[float] = (100, 800)) -> str:
    """What :func:`prediction_table` says, in a sentence generated from its numbers: the gain by the paper's
    accounting at the slowest and the fastest network of ``inter_gbit``."""
    def speedup(gbit: float) -> float:
        link = theory.AlphaBeta.link(gbit * 1e9 / 8, DEFAULT_INTER_NODE.alpha)
        return zeropp_step_prediction(psi, layers, tokens_per_gpu, 2, flops_per_s, inter=link)["speedup"]

    slow, fast = inter_gbit[0], inter_gbit[-1]
    return (f"By the paper's accounting, ZeRO++ is predicted {speedup(slow):.2f}x as fast as ZeRO-3 at {slow:g} "
            f"Gb/s (gigabits) per GPU and {speedup(fast):.2f}x at {fast:g} Gb/s.")


def drift_reading(name: str = "zeropp") -> str:
    """What the committed step times can separate, per reference: hpZ and qgZ send exactly ZeRO-3's bytes on one
    node, so their step-time ratios to ZeRO-3 gauge how far the sweep's times wander (drift, noise, hpZ's local
    copy); a setting's ratio points to a cost of its own only beyond both of theirs. The last line names the
    settings beyond that range on every reference (timing runs with layers released after use)."""
    lines, beyond_everywhere = [], None
    for device, _, note, runs in references.reference_runs(name):
        plain = runs.get("time: ZeRO-3")
        if TIMING_ONLY in note or not isinstance(plain, records.Record):
            continue
        ratio = {label.split(" (")[0]: _median_step_s(run) / _median_step_s(plain)
                 for label in (LABELS[k] for k in GPU_SETTINGS[1:])
                 for run in [runs.get(f"time: {label}")] if isinstance(run, records.Record)}
        same = [k for k in ("hpZ", "qgZ") if k in ratio]
        if not same:
            continue
        spread = max(ratio[k] for k in same)
        beyond = [k for k in ratio if k not in same and ratio[k] > spread]
        beyond_everywhere = set(beyond) if beyond_everywhere is None else beyond_everywhere & set(beyond)
        lines.append(f"{device}: same bytes as ZeRO-3, yet {_listed([f'{k} {ratio[k]:.2f}x' for k in same])} its step; "
                     f"beyond that range: {_listed([f'{k} {ratio[k]:.2f}x' for k in beyond]) if beyond else 'none'}.")
    if beyond_everywhere is None:
        return "No committed sweep timed hpZ or qgZ beside ZeRO-3."
    found = [k for k in ("qwZ", "ZeRO++") if k in beyond_everywhere]
    lines.append(f"Beyond the no-op switches on every machine: {_listed(found) if found else 'no setting'}"
                 + ("; one sweep each, with no repeat of ZeRO-3, so a hint of a cost, not a measure of it."
                    if found else ": these sweeps separate no cost of ZeRO++ from their drift."))
    return "\n".join(lines)


def one_node_reading(name: str = "zeropp", timing_only: bool | None = None) -> str:
    """The committed one-node step times, each switch against ZeRO-3 per reference, through the course's load
    guard (:func:`helpers.core.load_guard.compare`) with the load saved beside the runs, or, for a reference
    saved without one, the load its written conditions state (:meth:`~helpers.core.load_guard.Load.from_conditions`:
    "alone" where they say so). A reference whose sweep did not time ZeRO-3 again at its end gets no verdict.
    Verdicts withheld for the same reason are merged into one sentence naming the settings and references;
    a verdict given gets a line of its own. The medians are :func:`_median_step_s`', the figures of
    :func:`gpu_table`. ``timing_only`` selects references as in :func:`reference_report`."""
    withheld: dict[str, tuple[list[str], list[str]]] = {}  # reason -> (settings, references)
    given = []
    for (device, date, note, runs), conditions in zip(references.reference_runs(name),
                                                      references.reference_conditions(name)):
        if timing_only is not None and (TIMING_ONLY in note) != timing_only:
            continue
        plain = runs.get("time: ZeRO-3")
        if not isinstance(plain, records.Record):
            continue
        knobs = plain.summary["config"].get("zero_optimization", {})
        regime = ("layers released after use" if knobs.get("stage3_max_live_parameters") == 0
                  else "DeepSpeed's default knobs")
        saved = plain.summary.get("load")
        load = load_guard.Load.from_dict(saved) if saved else load_guard.Load.from_conditions(conditions)
        where = (f"{device}, {date} ({regime}; {'alone' if load.alone else 'not alone'}, by "
                 f"{'its saved load' if saved else 'its written conditions'})")
        again = runs.get(f"time: {AGAIN}")
        repeat = _steps_s(again) if isinstance(again, records.Record) else None
        for setting in (LABELS[name] for name in GPU_SETTINGS):
            timed = runs.get(f"time: {setting}")
            if setting == "ZeRO-3" or not isinstance(timed, records.Record):
                continue
            short = setting.split(" (")[0]
            verdict = load_guard.compare({"ZeRO-3": _steps_s(plain), short: _steps_s(timed)}, load,
                                         repeat=repeat, sweep=True)
            if verdict.given:
                given.append(f"{where}: {load_guard.sentence(verdict)}")
                continue
            settings, wheres = withheld.setdefault(verdict.withheld, ([], []))
            settings.extend([short] if short not in settings else [])
            wheres.extend([where] if where not in wheres else [])
    lines = [f"Verdict withheld for {_listed(settings)} on {_listed(wheres)}: {reason} (step times: the table above)."
             for reason, (settings, wheres) in withheld.items()]
    return "\n".join(given + lines)


def where_it_failed(failure: Refusal | records.Record, frames: int = 3) -> str:
    """The last ``frames`` frames of a rank's traceback, with paths cut to the package (``deepspeed/...``),
    so the text is the same on every machine with the same DeepSpeed. A run that did not fail (quantized
    weights on a GPU) says so instead."""
    if isinstance(failure, records.Record):
        return f"{failure.summary['name']}: no failure on {failure.summary['device_name']}: it trained"
    found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.+)', failure.traceback)
    lines = []
    for path, line, function, code in found[-frames:]:
        short = re.sub(r"^.*?/(deepspeed|torch|helpers)/", r"\1/", path)
        lines.append(f"{short}:{line} in {function}: {code.strip()}")
    return "\n".join(lines + [f"{failure.type}: {failure.message}"])


# --- figures ----------------------------------------------------------------------------------------

def zeropp_volumes(psi: float, title: str = "What crosses nodes per GPU and step (paper's accounting)"):
    """Stacked bars, one per setting: cross-node bytes of each ZeRO-3 phase in units of M = 2Ψ
    (:func:`helpers.topics.compression.zeropp_volume` on two or more nodes)."""
    plt = plots.pyplot()
    settings = {"ZeRO-3": (False, False, False), "qwZ": (True, False, False), "hpZ": (False, True, False),
                "qgZ": (False, False, True), "ZeRO++": (True, True, True)}
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, flags in enumerate(settings.values()):
        volume = zeropp_volume(psi, *flags, nodes=2)
        bottom = 0.0
        for j, phase in enumerate(ZEROPP_PHASES):
            value = volume[phase]["inter"] / (2 * psi)
            ax.bar(i, value, 0.6, bottom=bottom, color=colours[j], label=phase if i == 0 else None)
            bottom += value
        ax.text(i, bottom + 0.05, f"{bottom:g}M", ha="center", fontsize=8)
    ax.set_xticks(range(len(settings)), list(settings))
    ax.set(ylabel="model sizes M (2Ψ bytes)", title=title, ylim=(0, 3.5))
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def zeropp_speedup(psi: float, layers: int, tokens_per_gpu: int, flops_per_s: float,
                   gbits: Sequence[float] = (25, 50, 100, 200, 400, 800, 1600, 3200)):
    """Predicted ZeRO++ speed-up over ZeRO-3 on two or more nodes against the network bandwidth per GPU
    (:func:`zeropp_step_prediction`, the default links' latencies), by the paper's accounting."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    speedups = [zeropp_step_prediction(psi, layers, tokens_per_gpu, 2, flops_per_s,
                                       inter=theory.AlphaBeta.link(g * 1e9 / 8, DEFAULT_INTER_NODE.alpha))["speedup"]
                for g in gbits]
    ax.plot(gbits, speedups, marker="o", label="paper's accounting (no cost for quantization)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=7)
    ax.set(xscale="log", xlabel="network bandwidth between nodes, Gbit/s per GPU", ylabel="ZeRO++ / ZeRO-3 speed",
           title="Predicted gain of ZeRO++ across nodes")
    ax.set_xticks(list(gbits), [f"{g:g}" for g in gbits])
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- formulas ---------------------------------------------------------------------------------------

ZEROPP_PHASES = ("forward all-gather", "backward all-gather", "gradient reduce-scatter")


def zeropp_volume(psi: float, qwz: bool = False, hpz: bool = False, qgz: bool = False,
                  nodes: int = 2) -> dict[str, dict[str, float]]:
    """Bytes per GPU and optimizer step (one micro-step) of each ZeRO-3 phase, split into what crosses
    nodes (``"inter"``) and what stays inside a node (``"intra"``), for a model of ``psi`` parameters in
    16-bit. The paper's accounting: each phase moves the whole model M = 2Ψ bytes per GPU (its ring
    factor (n-1)/n taken as 1). ``nodes=1``: everything is intra-node, and only qwZ changes anything.
    """
    if nodes < 1:
        raise ValueError(f"nodes={nodes}: at least one node")
    m = 2.0 * psi  # the model in 16-bit
    gather = 0.5 * m if qwz else m
    where = "inter" if nodes > 1 else "intra"
    volume = {phase: {"inter": 0.0, "intra": 0.0} for phase in ZEROPP_PHASES}
    volume["forward all-gather"][where] += gather
    # hpZ: backward gathers from the node-local secondary partition (quantized too when qwZ is on)
    volume["backward all-gather"]["intra" if hpz else where] += gather
    if qgz and nodes > 1:
        volume["gradient reduce-scatter"]["intra"] += 0.25 * m  # int4, first hop inside the node
        volume["gradient reduce-scatter"]["inter"] += 0.25 * m  # int4, second hop across nodes
    else:
        volume["gradient reduce-scatter"][where] += m  # DeepSpeed's fallback on one node: plain reduce-scatter
    return volume


def zeropp_cross_node_bytes(psi: float, qwz: bool = False, hpz: bool = False, qgz: bool = False) -> float:
    """Bytes per GPU and step that cross nodes (two or more nodes): 3M for ZeRO-3, 0.75M with all three."""
    return sum(v["inter"] for v in zeropp_volume(psi, qwz, hpz, qgz, nodes=2).values())


def zeropp_comm_seconds(psi: float, layers: int, nodes: int, qwz: bool = False, hpz: bool = False,
                        qgz: bool = False, intra: theory.AlphaBeta = DEFAULT_INTRA_NODE,
                        inter: theory.AlphaBeta = DEFAULT_INTER_NODE) -> float:
    """Predicted communication seconds per GPU and micro-step of ZeRO-3 (with the ZeRO++ parts chosen) for
    ``psi`` 16-bit parameters in ``layers`` gathered units, on ``nodes`` nodes: bytes from
    :func:`zeropp_volume` at each link's bandwidth, plus one latency per collective call and link
    (3 phases x ``layers`` calls; qgZ's two hops). Assumes no overlap with compute (an upper bound)."""
    total = 0.0
    for phase, v in zeropp_volume(psi, qwz, hpz, qgz, nodes).items():
        for link, nbytes in ((intra, v["intra"]), (inter, v["inter"])):
            if nbytes:
                total += link.seconds(nbytes, calls=layers)
    return total


def zeropp_step_prediction(psi: float, layers: int, tokens_per_gpu: int, nodes: int, flops_per_s: float,
                           intra: theory.AlphaBeta = DEFAULT_INTRA_NODE, inter: theory.AlphaBeta = DEFAULT_INTER_NODE,
                           overhead_s: float = 0.0) -> dict[str, float]:
    """Predicted seconds per micro-step of plain ZeRO-3 and full ZeRO++ (qwZ + hpZ + qgZ): compute
    (6Ψ FLOPs a token at ``flops_per_s`` achieved per GPU) plus communication (:func:`zeropp_comm_seconds`),
    without overlap; and the speed-up. ZeRO++'s own work (quantization kernels, hpZ's copies) is
    ``overhead_s`` seconds a micro-step: 0, the paper's accounting, leaves it out; a one-node measurement of
    your own (ZeRO++'s step less ZeRO-3's, alone on the GPUs) estimates it."""
    if overhead_s < 0:
        raise ValueError(f"overhead_s={overhead_s!r}: seconds ZeRO++ adds to a micro-step, 0 or more")
    compute = 6 * psi * tokens_per_gpu / flops_per_s
    zero3 = compute + zeropp_comm_seconds(psi, layers, nodes, intra=intra, inter=inter)
    zeropp = compute + zeropp_comm_seconds(psi, layers, nodes, True, True, True, intra=intra, inter=inter) + overhead_s
    return {"compute_s": compute, "zero3_s": zero3, "zeropp_s": zeropp, "speedup": zero3 / zeropp}


# --- the key figure and the exercises ---------------------------------------------------------------

def cpu_bytes_figure(results: Mapping[str, records.Record | Refusal]):
    """Bars: bytes per step of each collective, for every setting that trained on these ranks
    (:func:`chapter_runs`); a refused setting gets no bar and says so under its name."""
    plt = plots.pyplot()
    ops = sorted({op for r in results.values() if isinstance(r, records.Record) for op in _ops(r)},
                 key=lambda op: -max(_ops(r).get(op, (0, 0))[1] for r in results.values()
                                     if isinstance(r, records.Record)))[:2]  # the two largest collectives
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    width = 0.8 / max(len(ops), 1)
    names = list(results)
    for j, op in enumerate(ops):
        values = [_ops(r).get(op, (0, 0))[1] / 2**20 if isinstance(r, records.Record) else 0 for r in results.values()]
        ax.bar([i + j * width for i in range(len(names))], values, width, label=op)
    labels = [(n.split(" (")[0] if isinstance(results[n], records.Record) else n.split(" (")[0] + "\n(refused)")
              for n in names]
    ax.set_xticks([i + width * (len(ops) - 1) / 2 for i in range(len(names))], labels, rotation=30, ha="right",
                  fontsize=8)
    ax.set(ylabel="MiB per step and rank", title="What each setting sent on these CPU ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def exercise_zeropp_block(answer: Any, gpus_per_node: int = 8, nodes: int = 2) -> exercises.Verdict:
    """Exercise: for ``nodes`` nodes of ``gpus_per_node`` GPUs, write the ``zero_optimization`` block with all
    three ZeRO++ switches, choosing hpZ's partition size, and predict (in M, the model in 16 bits) what one GPU
    would send across nodes per step if that size were every GPU of the cluster instead. ``answer`` is a dict
    ``{"zero_optimization": block, "across_if_whole_cluster": M}``. DeepSpeed's own config class parses the
    block (a misspelt key is refused as DeepSpeed refuses it); the bytes are :func:`zeropp_cross_node_bytes`."""
    cluster = gpus_per_node * nodes
    wide = zeropp_cross_node_bytes(1.0, qwz=True, hpz=False, qgz=True) / 2.0  # the backward gather crosses again

    def test(given: Any) -> tuple[bool, str]:
        if not isinstance(given, Mapping) or set(given) != {"zero_optimization", "across_if_whole_cluster"}:
            return False, 'the answer is a dict {"zero_optimization": {...}, "across_if_whole_cluster": M}.'
        try:
            zero = configs.zero_section(given["zero_optimization"])
        except ValueError as refused:
            return False, f"{refused}."
        if zero.stage != 3:
            return False, f"stage {int(zero.stage)}: ZeRO++ is built into ZeRO-3's partitioner, so only stage 3 reads it."
        qwz, qgz, hpz = zero.zero_quantized_weights, zero.zero_quantized_gradients, zero.zero_hpz_partition_size
        if not (qwz and qgz):
            return False, f"zero_quantized_weights={qwz}, zero_quantized_gradients={qgz}: not all three switches."
        if hpz <= 1 or hpz > gpus_per_node or gpus_per_node % hpz:
            where = "turns hpZ off" if hpz <= 1 else "is not a group inside one node"
            return False, f"zero_hpz_partition_size={hpz} {where}: the backward gather would still cross the network."
        if hpz < gpus_per_node:
            return False, (f"zero_hpz_partition_size={hpz} keeps the backward gather inside a node too, but each GPU "
                           f"then holds 1/{hpz} of the secondary copy instead of 1/{gpus_per_node}: more memory "
                           "for the same bytes.")
        predicted = float(given["across_if_whole_cluster"])
        if abs(predicted - wide) > 0.02 * wide:
            return False, (f"the block is right; {predicted:g}M for a partition of all {cluster} GPUs is not what "
                           "the accounting gives.")
        return True, (f"DeepSpeed reads stage 3, int8 weights, int4 gradients and a secondary partition of {hpz} "
                      f"GPUs, one node: {zeropp_cross_node_bytes(1.0, True, True, True) / 2.0:g}M across nodes per "
                      f"GPU and step instead of ZeRO-3's 3M. With all {cluster} GPUs as the partition, the secondary "
                      f"group spans both nodes, so backward gathers its int8 weights across the network again: "
                      f"{wide:g}M (0.5M forward + 0.5M backward + 0.25M gradients), as without hpZ.")
    return exercises.satisfies(
        "ZeRO++ block for a cluster", answer, test,
        task=(f"For {nodes} nodes of {gpus_per_node} GPUs: write the zero_optimization block with qwZ, hpZ and qgZ, "
              f"choosing hpZ's partition size, and predict the M one GPU would send across nodes per step if the "
              f"partition size were {cluster} instead."),
        hint=("the quantities are zero_hpz_partition_size, the GPUs per node and the nodes; the prediction is the "
              "accounting's sum over the three phases, as in Exercise 1."))


def exercise_cross_node_bytes(answer: Any, psi: float) -> exercises.Verdict:
    """Exercise: predict the bytes per GPU and step that cross nodes with qwZ and hpZ on but not qgZ, for a
    model of ``psi`` parameters in 16 bits; the answer is :func:`zeropp_cross_node_bytes`."""
    expected = zeropp_cross_node_bytes(psi, qwz=True, hpz=True)
    m = 2.0 * psi
    return exercises.number(
        "qwZ + hpZ across nodes", answer, expected, relative=0.02, unit=" bytes",
        task=f"Predict the bytes one GPU sends across nodes per step for {psi:,.0f} parameters with qwZ and hpZ on, qgZ off.",
        hint=f"the accounting's cross-node volume of each phase, summed, in M = 2 x {psi:,.0f} bytes.",
        why=(f"Forward gather 0.5M (int8), backward gather 0M across nodes (hpZ gathers inside the node), "
             f"gradient reduce-scatter 1M (qgZ off): 1.5M = 1.5 x {m:,.0f} bytes, half of ZeRO-3's 3M. "
             "The gradients are now two thirds of what crosses: qgZ is the switch that cuts them."))


def exercise_half_gradient_bytes(answer: Any, runs: Mapping[str, records.Record | Refusal]) -> exercises.Verdict:
    """Exercise: predict the bytes per optimizer step the comms logger records for ZeRO-3's gradient
    reduce-scatter with ``communication_data_type`` bf16 in this launch; the answer is the run's record."""
    half = runs["16-bit gradients (communication_data_type)"]
    if not isinstance(half, records.Record):
        raise ValueError(f"the 16-bit gradients run did not train here: {half}")
    row = half.comm_ops()["reduce_scatter_tensor"]
    psi, accumulation = half.params, half["grad_accum"]
    return exercises.number(
        "16-bit gradient bytes", answer, row["bytes"], relative=0.01, unit=" bytes",
        task=f"Predict the bytes per optimizer step the comms logger records for ZeRO-3's gradient reduce-scatter "
             f"with communication_data_type bf16 in this launch: model '{half.model_name}' (Ψ = {psi:,} parameters), "
             f"{half['world_size']} ranks, gradient accumulation {accumulation}.",
        hint="the quantity is the gradient reduce-scatter's bytes as the comms logger records them (chapter 05), "
             "summed over one optimizer step, with bf16 elements.",
        why=f"{row['count']:g} reduce-scatter calls per step (ZeRO-3 reduces at every micro-step), each logged as "
            f"the whole gradient in bf16: {row['bytes'] / row['count']:,.0f} bytes, 2 x Ψ. In fp32 it would be "
            "twice that.")


def _steps_s(record: records.Record) -> list[float]:
    """A run's step times in seconds after the first step (which warms up)."""
    return list(record.timing.all_s[1:])


def _median_step_s(record: records.Record) -> float:
    """A run's median step time in seconds after the first step: the figure every GPU table and ratio uses."""
    steps = _steps_s(record) or list(record.timing.all_s)
    return statistics.median(steps)


def timing_verdict(runs: Mapping[str, records.Record | Refusal], load: load_guard.Load,
                   base: str = "ZeRO-3", again: str = "ZeRO-3 again") -> str:
    """Each setting that trained on these ranks against plain ZeRO-3, step time by step time, through the course's
    load guard (:func:`helpers.core.load_guard.compare`, with ``runs[again]``, ZeRO-3 trained again at the end of
    the launch, as the repeat): a verdict only for a launch alone on its devices, a repeat within ZeRO-3's spread
    and a difference beyond the steps' spread; otherwise the line says why it withholds one."""
    repeat = _steps_s(runs[again]) if isinstance(runs.get(again), records.Record) else None
    lines = [f"Load beside the launch: {load.reason() or 'none, it had its devices to itself'}."]
    if not isinstance(runs.get(base), records.Record):
        return "\n".join(lines + [f"{base} did not train: no step time to compare the others with."])
    if repeat:  # the same setting twice: their gap is what the launch's drift alone does
        first, last = _median_step_s(runs[base]), _median_step_s(runs[again])
        lines.append(f"Medians: {base} {first * 1e3:.0f} ms first, {last * 1e3:.0f} ms again at the end "
                     f"({last / first:.2f}x): the same setting, so that gap is the launch's drift.")
    for name, record in runs.items():
        if name in (base, again) or not isinstance(record, records.Record):
            continue
        verdict = load_guard.compare({base: _steps_s(runs[base]), name.split(" (")[0]: _steps_s(record)}, load,
                                     repeat=repeat)
        lines.append(f"{name.split(' (')[0]}: {load_guard.sentence(verdict)}")
    return "\n".join(lines)
