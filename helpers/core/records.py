"""The run record: the ``summary.json`` each run writes, and the tables notebooks print from it.

Every number a notebook shows about a run comes from one of these files; ``Record.out`` says
which folder, and ``runs/<name>/launch.log`` holds DeepSpeed's own log of that run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

#: Keys every summary.json has, whatever its probes (nested keys after a dot).
CORE_KEYS = (
    "world_size", "backend", "device", "zero_stage", "precision", "micro_batch", "grad_accum", "train_batch",
    "steps", "model.name", "model.params", "losses", "theory.model_states_bytes_per_rank",
    "theory.comm_bytes_per_step", "theory.comm_wire_bytes_per_step",
)
#: The probes of a summary that lists none (written before runs named their probes).
LEGACY_PROBES = ("timing", "model_states", "peak_memory", "comm")
MODEL_STATE_KEYS = ("params", "grads", "optimizer", "master")  # what the ZeRO paper partitions
STATE_KEYS = MODEL_STATE_KEYS + ("buffers",)  # as measured by helpers.core.memory


def _get(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def validate(summary: dict) -> None:
    """Raise ValueError naming every missing or inconsistent key of a summary: the core keys, and the keys
    each of its probes declared (``probe_keys``, written with the record since probes declare them)."""
    problems = []
    declared = [key for keys in (summary.get("probe_keys") or {}).values() for key in keys]
    for key in CORE_KEYS + tuple(declared):
        try:
            _get(summary, key)
        except (KeyError, TypeError):
            problems.append(f"missing {key}")
    if not problems:
        trained = summary["steps"] - summary.get("first_step", 0)  # a resumed run trains from first_step on
        if len(summary["losses"]) != trained:
            problems.append(f"losses has {len(summary['losses'])} entries for {trained} steps trained")
        per_rank = (summary.get("memory") or {}).get("model_states_bytes_per_rank")
        if per_rank is not None and len(per_rank) != summary["world_size"]:
            problems.append("memory.model_states_bytes_per_rank needs one entry per rank")
        readers = summary.get("data_parallel_size", summary["world_size"])  # ranks that read different samples
        if summary["train_batch"] != summary["micro_batch"] * summary["grad_accum"] * readers:
            problems.append("train_batch != micro_batch * grad_accum * data_parallel_size")
        for op, row in ((summary.get("comm") or {}).get("by_op") or {}).items():
            if set(row) != {"count", "bytes"}:
                problems.append(f"comm.by_op.{op} needs count and bytes")
    if problems:
        raise ValueError("summary.json: " + "; ".join(problems))


class NotMeasured(KeyError):
    """A record lacks a figure because its run did not use the probe that measures it."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Model-state bytes of one rank, by kind (as :func:`helpers.core.memory.model_states` measures them,
    or as the ZeRO paper's formula predicts them, then as floats)."""

    params: float
    grads: float
    optimizer: float
    master: float
    buffers: float = 0

    @property
    def total(self) -> float:
        """Parameters + gradients + optimizer states + master copy: what the ZeRO paper counts (no buffers)."""
        return self.params + self.grads + self.optimizer + self.master

    @classmethod
    def of(cls, found: Mapping[str, float]) -> "ModelStates":
        return cls(**{key: found.get(key, 0) for key in STATE_KEYS})

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank's model states live (the ``placement`` probe): bytes on the accelerator and on the
    host, pinned host bytes, bytes per physical device, dtypes by kind."""

    accelerator: ModelStates
    host: ModelStates
    pinned_bytes: int
    devices: dict[str, int]
    dtypes: dict[str, list[str]]
    accelerator_is_host: bool

    def __getitem__(self, key: str) -> Any:
        """``placement["host"]["grads"]``: a side as a dict of bytes by kind, or another field."""
        value = getattr(self, key)
        return value.as_dict() if isinstance(value, ModelStates) else value


class _Section:
    """A view of one section of a record, raising :class:`NotMeasured` (naming the probe) when it is absent."""

    section = ""
    probe = ""

    def __init__(self, record: "Record"):
        self._record = record

    def _data(self, key: str | None = None, probe: str | None = None) -> Any:
        summary = self._record.summary
        try:
            data = summary[self.section]
            return data if key is None else _get(data, key)
        except (KeyError, TypeError):
            where = f"{self.section}.{key}" if key else self.section
            raise NotMeasured(f"{self._record.name or 'this run'} has no {where}: its run did not use the "
                              f"{probe or self.probe!r} probe (it used {', '.join(self._record.probes)})") from None


class MemoryView(_Section):
    """``record.memory``: model states, peaks and placement, rank by rank."""

    section = "memory"
    probe = "model_states"

    def model_states(self, rank: int = 0) -> ModelStates:
        """Model-state bytes of ``rank``: mid-accumulation when the run accumulates, else at the boundary."""
        return ModelStates.of(self._data("model_states_bytes_per_rank")[rank])

    def at_boundary(self, rank: int = 0) -> ModelStates:
        """Model-state bytes of ``rank`` after the last micro-step's backward, before ``engine.step``."""
        return ModelStates.of(self._data("model_states_at_boundary_bytes_per_rank")[rank])

    @property
    def measured_at(self) -> str:
        return self._data("measured_at")

    def peak(self, rank: int | None = None) -> int:
        """Peak memory of ``rank`` (the largest of the ranks' when None)."""
        peaks = self._data("peak_bytes_per_rank", "peak_memory")
        return max(peaks) if rank is None else peaks[rank]

    @property
    def peak_source(self) -> str:
        return self._data("peak_source", "peak_memory")

    def placement(self, rank: int = 0) -> Placement:
        """Where ``rank``'s model states live (accelerator or host)."""
        found = self._data("placement_bytes_per_rank", "placement")[rank]
        return Placement(ModelStates.of(found["accelerator"]), ModelStates.of(found["host"]), found["pinned_bytes"],
                         found["devices"], found["dtypes"], found["accelerator_is_host"])

    def host_peak(self, rank: int = 0) -> int:
        """Peak host memory (peak RSS) of ``rank``."""
        return self._data("host_peak_bytes_per_rank", "placement")[rank]


class CommView(_Section):
    """``record.comm``: the collectives of one optimizer step (the ``comm`` probe, or ``torch_comm``)."""

    section = "comm"
    probe = "comm"

    @property
    def by_op(self) -> dict[str, dict[str, float]]:
        """Collective -> {count, bytes} per optimizer step."""
        return self._data("by_op")

    @property
    def by_caller(self) -> dict[str, dict[str, dict[str, float]]] | None:
        """Collective -> DeepSpeed function that issued it -> {count, bytes} per step (None where not logged)."""
        return self._data().get("by_caller")

    @property
    def callers(self) -> dict[str, dict[str, dict[str, float]]]:
        """:attr:`by_caller`, or where the functions were not logged each collective under the caller ``""``."""
        return self.by_caller or {op: {"": row} for op, row in self.by_op.items()}

    @property
    def calls_per_step(self) -> float:
        return sum(row["count"] for row in self.by_op.values())

    @property
    def bytes_per_step(self) -> float:
        """Bytes the comms logger logged per optimizer step (message sizes)."""
        return self._data("bytes_per_step")

    @property
    def wire_bytes_per_step(self) -> float:
        """Bytes one rank sends per optimizer step on a ring (:func:`helpers.core.theory.wire_bytes`)."""
        return self._data("wire_bytes_per_step")


class TimingView(_Section):
    """``record.timing``: wall time of the optimizer steps (rank 0, device synchronized)."""

    section = "step_time_s"
    probe = "timing"

    @property
    def median_s(self) -> float:
        return self._data("median")

    @property
    def all_s(self) -> list[float]:
        return self._data("all")

    @property
    def samples_per_s(self) -> float:
        return self._record.summary["samples_per_s"]


class TheoryView(_Section):
    """``record.theory``: the ZeRO paper's figures for this run's model, stage, ranks and precision."""

    section = "theory"

    @property
    def model_states(self) -> ModelStates:
        return ModelStates.of(self._data("model_states_bytes_per_rank"))

    @property
    def comm_bytes_per_step(self) -> float:
        return self._data("comm_bytes_per_step")

    @property
    def comm_wire_bytes_per_step(self) -> float:
        return self._data("comm_wire_bytes_per_step")

    @property
    def comm_wire_bytes_per_optimizer_step(self) -> float:
        """The paper's bytes one rank sends per optimizer step: its volume (:attr:`comm_wire_bytes_per_step`,
        2Ψ or 3Ψ x (n-1)/n) once at stages 0-2, whose gradients the paper reduces once per step, and once per
        micro-step at stage 3, whose parameters are gathered for every forward and backward."""
        summary = self._record.summary
        return self.comm_wire_bytes_per_step * (summary["grad_accum"] if summary["zero_stage"] == 3 else 1)


class ThroughputView(_Section):
    """``record.throughput``: tokens per second, model TFLOP/s per GPU and MFU (the ``throughput`` probe)."""

    section = "throughput"
    probe = "throughput"

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        return self._data(key)


class Record:
    """One run's summary, read through named accessors: ``record.memory.model_states(rank=0).grads``,
    ``record.comm.wire_bytes_per_step``, ``record.timing.median_s``, ``record.theory.model_states``; a
    topic's own section through :meth:`section` (its module has accessors for it)."""

    def __init__(self, summary: dict, out: Path | None = None):
        validate(summary)
        self.summary = summary
        self.out = out
        self.wall_s: float | None = None  # set by helpers.core.launch.run: launch to exit, seconds
        self.memory = MemoryView(self)
        self.comm = CommView(self)
        self.timing = TimingView(self)
        self.theory = TheoryView(self)
        self.throughput = ThroughputView(self)

    def __getitem__(self, key: str) -> Any:
        """The raw summary by key (dotted for nested keys): for figures no accessor covers."""
        return _get(self.summary, key)

    def section(self, name: str, probe: str | None = None) -> dict:
        """The section ``name`` of the summary, written by a probe (``probe``, default: the same name)."""
        try:
            return self.summary[name]
        except KeyError:
            raise NotMeasured(f"{self.name or 'this run'} has no {name}: its run did not use the {probe or name!r} "
                              f"probe (it used {', '.join(self.probes)})") from None

    @property
    def probes(self) -> list[str]:
        """The names of the probes that measured this run."""
        return list(self.summary.get("probes", LEGACY_PROBES))

    @property
    def name(self) -> str | None:
        return self.summary.get("name")

    @property
    def losses(self) -> list[float]:
        return self.summary["losses"]

    @property
    def stage(self) -> int:
        return self.summary["zero_stage"]

    @property
    def precision(self) -> str:
        return self.summary["precision"]

    @property
    def world_size(self) -> int:
        return self.summary["world_size"]

    @property
    def device(self) -> str:
        return self.summary["device"]

    @property
    def device_name(self) -> str:
        return self.summary.get("device_name", self.device)

    @property
    def micro_batch(self) -> int:
        return self.summary["micro_batch"]

    @property
    def grad_accum(self) -> int:
        return self.summary["grad_accum"]

    @property
    def train_batch(self) -> int:
        """Samples one optimizer step consumes (all data-parallel ranks)."""
        return self.summary["train_batch"]

    @property
    def steps(self) -> int:
        return self.summary["steps"]

    @property
    def model_name(self) -> str:
        return self.summary["model"]["name"]

    @property
    def params(self) -> int:
        return self.summary["model"]["params"]

    @property
    def config(self) -> dict:
        """The DeepSpeed config the run used (as checked and written by the launcher)."""
        return self.summary["config"]

    @property
    def label(self) -> str:
        """``"ZeRO-2 fp32"``, or the strategy of a run that did not use DeepSpeed (``"DDP fp32"``)."""
        s = self.summary
        return f"{s.get('strategy') or 'ZeRO-' + str(s['zero_stage'])} {s['precision']}"

    def timeline(self, rank: int = 0) -> dict[str, float]:
        """Seconds from ``rank``'s process start to the end of each phase of the launch (``timeline`` probe)."""
        return self.section("timeline_s", "timeline")["per_rank"][rank]

    def states(self, rank: int = 0) -> dict[str, int]:
        """Measured model-state bytes of ``rank``, by kind (:meth:`MemoryView.model_states` as a dict)."""
        return self.memory.model_states(rank).as_dict()

    def model_state_bytes(self, rank: int = 0) -> int:
        """Measured parameters + gradients + optimizer states + master copy of ``rank`` (not buffers)."""
        return self.memory.model_states(rank).total

    @property
    def theory_states(self) -> dict[str, float]:
        return self.summary["theory"]["model_states_bytes_per_rank"]

    def comm_ops(self) -> dict[str, dict[str, float]]:
        """Collective -> {count, bytes} per optimizer step."""
        return self.comm.by_op

    def __repr__(self) -> str:
        s = self.summary
        return (f"<Record {self.label}, {s['model']['name']} ({s['model']['params']:,} params), "
                f"{s['world_size']} x {s['device']}, {s['steps']} steps>")


def load(out: str | Path) -> Record:
    """Read ``out/summary.json`` (``out`` is a run's folder or the file itself)."""
    path = Path(out)
    if path.is_dir():
        path = path / "summary.json"
    return Record(json.loads(path.read_text()), path.parent)


def format_ratio(a: float, b: float, digits: int = 2, suffix: str = "",
                 none: str = "- (one rank sends nothing)") -> str:
    """``a / b`` with ``digits`` decimals and ``suffix``, or ``none`` where ``b`` is 0 (one rank moves no bytes)."""
    return f"{a / b:.{digits}f}{suffix}" if b else none


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, three significant digits."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    for i, unit in enumerate(units):
        if unit == "B" and abs(n) < 1024:
            return f"{n:.0f} B"
        # switch unit once the value would print as 1000 or more
        if abs(n) < 999.5 or i == len(units) - 1:
            return f"{n:.3g} {unit}" if abs(n) >= 1 else f"{n:.3f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table (fixed width, right-aligned numbers): deterministic, so nbval can check it.
    A table with a peak marked by :data:`UPPER_BOUND` ends with :data:`PEAK_NOTE`."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    marked = any(c.startswith(UPPER_BOUND) for row in cells[1:] for c in row)
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
                     + ([PEAK_NOTE] if marked else []))


#: Marks a GPU peak that may include memory of earlier runs (:func:`peak_may_include_earlier_runs`).
UPPER_BOUND = "<= "
PEAK_NOTE = ("<= : an upper bound: an earlier run of the same launch may still have held GPU memory when this "
             "run peaked (measured before the course released each run's engine; docs/results.md).")


def peak_may_include_earlier_runs(record: "Record | dict") -> bool:
    """Whether a GPU run's peak may include earlier runs of its launch: it was not the first run of its
    launch, and its record does not say the earlier runs' engines were released (``peak_memory`` probe,
    ``memory.earlier_runs_released``, written since ``train.release_zero3_references``). Before that,
    ZeRO-3 engines lived as long as their processes and the others until Python's next full collection."""
    s = getattr(record, "summary", record)  # a Record, or a summary as a reference keeps it
    return (s.get("device") == "cuda" and (s.get("launch") or {}).get("position", 1) > 1
            and not (s.get("memory") or {}).get("earlier_runs_released"))


def format_peak(record: "Record | dict", rank: int | None = None) -> str:
    """A run's peak memory (``rank``'s, else the largest of its ranks), marked :data:`UPPER_BOUND` where it
    may include earlier runs of its launch."""
    peaks = _get(getattr(record, "summary", record), "memory.peak_bytes_per_rank")
    return format_bytes_bound(max(peaks) if rank is None else peaks[rank], peak_may_include_earlier_runs(record))


def format_bytes_bound(n: float, upper_bound: bool) -> str:
    """:func:`format_bytes`, marked :data:`UPPER_BOUND` when ``upper_bound``."""
    return (UPPER_BOUND if upper_bound else "") + format_bytes(n)


def loss_table(runs: dict[str, Iterable[float]], digits: int = 4) -> str:
    """Losses per optimizer step, one column per run, rounded to ``digits`` decimals."""
    names = list(runs)
    columns = [list(v) for v in runs.values()]
    rows = [[i + 1] + [f"{c[i]:.{digits}f}" if i < len(c) else "" for c in columns]
            for i in range(max(len(c) for c in columns))]
    return format_table(rows, ["step"] + names)


def max_loss_difference(a: Iterable[float], b: Iterable[float]) -> float:
    """Largest absolute difference between two runs' losses, step by step."""
    return max(abs(x - y) for x, y in zip(a, b))


#: How close two runs' losses must be to count as "the same arithmetic", by precision. Rounding of
#: float32 sums differs between processors (seen: identical on an AVX-512 machine, 3e-08 on an
#: AVX2-only one), so checked outputs state the tolerance, never the digits.
LOSS_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 1e-2}
#: Runs that cut the same batch differently (pipeline micro-batches of another size, tensor-parallel partial
#: sums) add the same numbers in another order and through other kernel shapes: a few float32 ulps of the
#: loss apart (one ulp of a loss near 5.6 is 4.8e-07), which LOSS_TOLERANCE does not allow on every processor.
REORDERED_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}


def loss_agreement(a: Iterable[float], b: Iterable[float], precision: str = "fp32",
                   tolerance: float | None = None) -> str:
    """``"within 1e-06"`` when two runs' losses agree to ``tolerance`` (default: the precision's, from
    :data:`LOSS_TOLERANCE`), else ``"differ by more than 1e-06"``.

    No digits of the difference itself: they depend on the processor. This is what a checked notebook
    cell prints; :func:`max_loss_difference` gives the number for a cell nbval ignores.
    """
    tolerance = LOSS_TOLERANCE[precision] if tolerance is None else tolerance
    agree = max_loss_difference(a, b) <= tolerance
    return f"within {tolerance:.0e}" if agree else f"differ by more than {tolerance:.0e}"


def memory_table(runs: Sequence[Record], rank: int = 0) -> str:
    """Measured model-state bytes of one rank, run by run, beside the paper's formula."""
    rows = []
    for r in runs:
        measured, paper = r.states(rank), r.theory_states
        for key in STATE_KEYS:
            if not measured.get(key) and not paper.get(key):
                continue
            expected = paper.get(key)
            ratio = f"{measured[key] / expected:.3f}" if expected else "(not in paper)"
            rows.append([r.label, key, f"{measured[key]:,}", f"{expected:,.0f}" if expected is not None else "-", ratio])
    return format_table(rows, ["run", "state", "measured bytes", "paper bytes", "measured/paper"])


def collective_rows(record: Record) -> list[list[str]]:
    """Table rows of ``record``'s collectives per optimizer step: run, collective, the DeepSpeed function that
    issued it ("-" where not logged), count and logged bytes."""
    return [[record.label, op, caller or "-", f"{row['count']:g}", f"{row['bytes']:,.0f}"]
            for op, by_caller in record.comm.callers.items() for caller, row in by_caller.items()]


def comm_table(runs: Sequence[Record], totals: bool = True) -> str:
    """Collectives per optimizer step (count and logged bytes, and the DeepSpeed function that issued them)
    run by run, with (``totals``) the wire bytes per rank and the paper's volume."""
    rows = []
    for r in runs:
        rows += collective_rows(r)
        if totals:
            comm = r.summary["comm"]
            rows.append([r.label, "= wire bytes per rank (ring)", "", "", f"{comm['wire_bytes_per_step']:,.0f}"])
            rows.append([r.label, "= paper (2Ψ or 3Ψ) x (n-1)/n", "", "", f"{r.theory.comm_wire_bytes_per_step:,.0f}"])
    return format_table(rows, ["run", "collective", "issued by (DeepSpeed function)", "count/step", "bytes/step"])


# --- many runs at once: the learner's own records (helpers.topics.widgets' "my runs") -----------------

def load_all(folder: str | Path, names: Iterable[str] | None = None) -> tuple[dict[str, Record], dict[str, str]]:
    """Every training record in ``folder/*/summary.json`` (only the folders ``names``, if given), by folder
    name and in name order, and the folders skipped with why (a task's result, an incomplete summary)."""
    found: dict[str, Record] = {}
    skipped: dict[str, str] = {}
    wanted = None if names is None else set(names)
    for path in sorted(Path(folder).glob("*/summary.json")):
        name = path.parent.name
        if wanted is not None and name not in wanted:
            continue
        try:
            found[name] = load(path)
        except (ValueError, KeyError, TypeError) as error:  # json errors are ValueErrors too
            skipped[name] = str(error).splitlines()[0]
    if wanted is not None and wanted - set(found) - set(skipped):
        raise FileNotFoundError(f"no summary.json in {folder} for {sorted(wanted - set(found) - set(skipped))}")
    return found, skipped


def runs_table(runs: Mapping[str, Record], checked: bool = False, rank: int = 0) -> str:
    """One line per run: what it was (stage, precision, model, ranks, steps), its model states per rank
    and wire bytes per step, measured beside the paper's, and (unless ``checked``) its last loss and
    median step time, whose digits depend on the processor: ``checked=True`` is what nbval can compare.
    A figure its probes did not measure reads "-"."""
    def get(r: Record, key: str) -> Any:
        try:
            return r[key]
        except (KeyError, TypeError):
            return None

    rows = []
    for name, r in runs.items():
        s = r.summary
        measured = r.model_state_bytes(rank) if get(r, "memory.model_states_bytes_per_rank") else None
        paper = sum(r.theory_states.get(key, 0) for key in MODEL_STATE_KEYS)
        wire = get(r, "comm.wire_bytes_per_step")
        row = [name, s["zero_stage"], s["precision"], f"{s['model']['name']} ({s['model']['params']:,})",
               s["world_size"], s["steps"], "-" if measured is None else format_bytes(measured), format_bytes(paper),
               "-" if wire is None else format_bytes(wire), format_bytes(r.theory.comm_wire_bytes_per_step)]
        if not checked:
            median = get(r, "step_time_s.median")
            row += [f"{r.losses[-1]:.4f}", "-" if median is None else f"{median * 1000:.1f}"]
        rows.append(row)
    headers = ["run", "ZeRO", "precision", "model (params)", "ranks", "steps", "states/rank", "paper",
               "sent/step", "paper"]
    if not checked:
        headers += ["last loss", "step ms"]
    return format_table(rows, headers)
