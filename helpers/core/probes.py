"""Probes: the measurements a rank takes around its training loop.

The loop in :mod:`helpers.core.train` knows nothing about what is measured. It calls each probe of a run
at fixed moments, and each probe contributes sections to that run's ``summary.json``:

========================  =======================================================================
hook                      when the loop calls it
========================  =======================================================================
``start(ctx)``            after ``deepspeed.initialize``, before the first step
``before_step(ctx, s)``   before the first micro-step of optimizer step ``s`` (0-based)
``after_backward(ctx,     after ``engine.backward`` of micro-step ``m`` of step ``s``, before
s, m)``                   ``engine.step``: gradients exist, the optimizer has not used them yet
``after_step(ctx, s)``    after the last ``engine.step`` of optimizer step ``s``
``finish(ctx)``           after the last step, on every rank: returns this rank's findings (JSON)
``combine(ranks, ctx)``   on rank 0 only: every rank's findings -> sections of ``summary.json``
========================  =======================================================================

A run names its probes: the core's by their short names (:data:`CORE`), any other by its class or
its import path (``"helpers.topics.activations:Activations"``), so a topic's probe lives in the topic's
module and the core never imports it. A probe declares what it needs and what it gives: :attr:`Probe.config`
(merged under the run's DeepSpeed config before launch), :attr:`Probe.keys` (the summary keys it writes,
checked when the record is written and when it is read) and :attr:`Probe.trainer` (the only way of
training it can measure, if it has one).

Without ``probes=``, a run gets :func:`defaults_for` its config: :data:`DEFAULT`, plus ``placement``
where the config offloads, so the record says which bytes live on the host.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, ClassVar, Sequence

import psutil
import torch
from torch.profiler import ProfilerActivity, profile

from helpers.core import communication, ds, memory, performance
from helpers.core.plan import reference_of, resolve

#: The probes a run uses unless it names others (see :func:`defaults_for`).
DEFAULT = ("timing", "model_states", "peak_memory", "comm", "timeline")


@dataclasses.dataclass
class RunContext:
    """What a probe may read about the run in progress (one per run, on each rank)."""

    engine: Any  # the DeepSpeed engine
    rank: int
    world_size: int
    device_type: str  # "cpu" or "cuda"
    precision: str  # "fp32", "bf16" or "fp16"
    stage: int  # ZeRO stage
    micro_batch: int
    grad_accum: int
    steps: int  # optimizer steps of this run
    params: int  # trainable parameters of the model (the paper's Ψ)
    born: float  # this rank's process start (time.time() scale)
    run_started: float  # when this run's set-up began (time.time() scale)
    config: dict = dataclasses.field(default_factory=dict)
    faults: dict = dataclasses.field(default_factory=dict)  # the run's faults (RunSpec.faults)
    # Among the ranks that read different samples (all of them, unless tensor or pipeline parallelism
    # makes several ranks share a micro-batch): this rank's index, and their number.
    dp_rank: int = 0
    dp_size: int = 1
    first_step: int = 0  # 0-based step training starts from (a resumed run starts later; see train.before_training)
    options: dict = dataclasses.field(default_factory=dict)  # the run's RunSpec.options, for probes and hooks

    def synchronize(self) -> None:
        """Wait for the device to finish queued work (a no-op on CPU), so host clocks mean something."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()


class Probe:
    """One kind of measurement. Override the hooks you need; each default does nothing."""

    #: The probe's name: the key of its findings, listed in the record's ``probes``.
    name: ClassVar[str] = ""
    #: Summary keys this probe writes (dotted: ``"memory.peak_bytes_per_rank"``), checked when the record
    #: is written (a probe that forgets one fails the run) and when it is read.
    keys: ClassVar[tuple[str, ...]] = ()
    #: DeepSpeed config this probe needs (merged under the run's own config before launch).
    config: ClassVar[dict] = {}
    #: The trainer (an import path, as :class:`helpers.core.plan.PlannedRun` names it) this probe measures,
    #: if it only works with one.
    trainer: ClassVar[str | None] = None

    @classmethod
    def check_options(cls, options: dict, steps: int) -> None:
        """Raise a ValueError naming the key and the fix when the run's ``options`` cannot work for this
        probe in a run of ``steps`` optimizer steps. The launcher calls it before any process starts."""

    def start(self, ctx: RunContext) -> None:
        pass

    def before_step(self, ctx: RunContext, step: int) -> None:
        pass

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        pass

    def after_step(self, ctx: RunContext, step: int) -> None:
        pass

    def finish(self, ctx: RunContext) -> dict:
        return {}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        """Sections of summary.json made from every rank's :meth:`finish` (rank 0 only)."""
        return {}


def resolve_probe(probe: "str | type[Probe]") -> type[Probe]:
    """A probe class from its short name (a core probe), its import path or itself; a ValueError naming
    the choices otherwise (before any process starts)."""
    if isinstance(probe, type) and issubclass(probe, Probe):
        return probe
    if isinstance(probe, str) and probe in CORE:
        return CORE[probe]
    if isinstance(probe, str) and ":" in probe:
        found = resolve(probe)
        if isinstance(found, type) and issubclass(found, Probe):
            return found
        raise ValueError(f"probe {probe!r}: {found!r} is not a Probe class")
    raise ValueError(f"probe {probe!r}: not a core probe ({', '.join(CORE)}); name another by its class or "
                     "its import path, 'package.module:Class'")


def reference(probe: "str | type[Probe]") -> str:
    """What a plan keeps of a probe: a core probe's short name, another's import path."""
    cls = resolve_probe(probe)
    return cls.name if CORE.get(cls.name) is cls else reference_of(cls)


def config_for(probes: Sequence["str | type[Probe]"]) -> dict:
    """The DeepSpeed config the probes need, merged (later probes win on conflicts)."""
    result: dict = {}
    for probe in probes:
        deep_update(result, resolve_probe(probe).config)
    return result


def offloads(config: dict) -> bool:
    """Whether ``config`` offloads optimizer states or parameters (to the CPU or NVMe) at a stage that does."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    devices = [(zero.get(key) or {}).get("device", "none") for key in ("offload_optimizer", "offload_param")]
    return stage > 0 and any(device not in (None, "none") for device in devices)


def defaults_for(config: dict) -> tuple[str, ...]:
    """The probes of a run that names none: :data:`DEFAULT`, and ``placement`` where the config offloads
    (so the record says which bytes live on the accelerator and which on the host)."""
    return DEFAULT + (("placement",) if offloads(config) else ())


def deep_update(target: dict, sections: dict) -> dict:
    """Merge ``sections`` into ``target`` in place (nested dicts merge), so two probes can share ``memory``."""
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            deep_update(target[key], value)
        else:
            target[key] = value
    return target


def missing_keys(summary: dict, keys: Sequence[str]) -> list[str]:
    """The dotted ``keys`` that ``summary`` lacks."""
    missing = []
    for key in keys:
        data: Any = summary
        for part in key.split("."):
            if not isinstance(data, dict) or part not in data:
                missing.append(key)
                break
            data = data[part]
    return missing


def logger_off() -> None:
    """Turn DeepSpeed's comms logger off at the end of a run that used it (what it logged stays readable).
    ``deepspeed.initialize`` turns it on for a config with a ``comms_logger`` section but never off: without
    this, the next run of a sweep would still wait for and time every collective although its config asks
    for no logging."""
    dist = ds.load("deepspeed.comm")

    dist.configure(enabled=False)


# --- the course's probes ----------------------------------------------------------------------

class Timing(Probe):
    """Wall time of each optimizer step on rank 0 (device synchronized before and after).

    Sections: ``step_time_s`` (``median`` and ``all``) and ``samples_per_s`` (global batch / median).
    """

    name = "timing"
    keys = ("step_time_s.median", "step_time_s.all", "samples_per_s")

    def start(self, ctx: RunContext) -> None:
        self.times: list[float] = []

    def before_step(self, ctx: RunContext, step: int) -> None:
        ctx.synchronize()
        self.started = time.perf_counter()

    def after_step(self, ctx: RunContext, step: int) -> None:
        ctx.synchronize()
        self.times.append(time.perf_counter() - self.started)

    def finish(self, ctx: RunContext) -> dict:
        return {"times": self.times}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        times = ranks[0]["times"]
        median = statistics.median(times)
        return {"step_time_s": {"median": median, "all": times},
                "samples_per_s": ctx.micro_batch * ctx.grad_accum * ctx.dp_size / median}


class ModelStates(Probe):
    """Bytes of parameters, gradients, optimizer states, master copy and buckets each rank holds
    (:func:`helpers.core.memory.model_states`), on the second optimizer step: after the backward of the first
    micro-step (mid-accumulation) and of the last one (the boundary, just before ``engine.step``).

    Section: ``memory.model_states_bytes_per_rank`` (mid-accumulation when there is accumulation, else
    the boundary), ``memory.model_states_at_boundary_bytes_per_rank``, ``memory.measured_at``.
    """

    name = "model_states"
    keys = ("memory.model_states_bytes_per_rank", "memory.model_states_at_boundary_bytes_per_rank")

    def start(self, ctx: RunContext) -> None:
        # optimizer states exist once the optimizer has stepped: measure on the second step trained
        self.step = ctx.first_step + 1 if ctx.steps - ctx.first_step > 1 else ctx.first_step
        self.mid: dict | None = None
        self.boundary: dict | None = None

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        if step != self.step:
            return
        if micro_step == 0 and ctx.grad_accum > 1:
            self.mid = memory.model_states(ctx.engine)
        if micro_step == ctx.grad_accum - 1:
            self.boundary = memory.model_states(ctx.engine)

    def finish(self, ctx: RunContext) -> dict:
        return {"states": self.mid or self.boundary, "boundary": self.boundary}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        accum = ctx.grad_accum
        where = (f"step {self.step + 1}, after the backward of micro-step 1 of {accum} (mid-accumulation)"
                 if accum > 1 else f"step {self.step + 1}, after the backward, before the optimizer step")
        return {"memory": {"model_states_bytes_per_rank": [r["states"] for r in ranks],
                           "model_states_at_boundary_bytes_per_rank": [r["boundary"] for r in ranks],
                           "measured_at": where}}


class PeakMemory(Probe):
    """Peak memory of each rank (:func:`helpers.core.memory.peak_bytes`).

    On a GPU the allocator's peak is reset when the run starts and the runs before it in the same
    processes have released their engines (``train.release_zero3_references``; the record says so in
    ``memory.earlier_runs_released``), so each run of a sweep has its own. On CPU it is the process's
    peak resident set, which only grows: in a sweep, a run's figure includes the runs before it in the
    same processes. Section: ``memory.peak_bytes_per_rank``.
    """

    name = "peak_memory"
    keys = ("memory.peak_bytes_per_rank",)

    def start(self, ctx: RunContext) -> None:
        if ctx.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def finish(self, ctx: RunContext) -> dict:
        peak, source = memory.peak_bytes(ctx.device_type)
        return {"peak": peak, "source": source}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        released = {"earlier_runs_released": True} if ctx.device_type == "cuda" else {}
        return {"memory": {"peak_bytes_per_rank": [r["peak"] for r in ranks], "peak_source": ranks[0]["source"],
                           **released}}


class Comm(Probe):
    """Every collective of steps 2..S, from DeepSpeed's comms logger (``deepspeed.comm.log_summary``),
    folded by :mod:`helpers.core.communication`: count and bytes per optimizer step, by op and by the
    DeepSpeed function that issued it. Rank 0's log is the one kept. Section: ``comm``.
    """

    name = "comm"
    keys = ("comm.by_op", "comm.bytes_per_step", "comm.wire_bytes_per_step")
    # debug: the logger also records which DeepSpeed function issued each collective
    config = {"comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": True}}

    def start(self, ctx: RunContext) -> None:
        dist = ds.load("deepspeed.comm")

        dist.reset_log()  # leave out set-up collectives (the initial broadcast of the weights)

    def before_step(self, ctx: RunContext, step: int) -> None:
        if step == ctx.first_step + 1:
            dist = ds.load("deepspeed.comm")

            dist.reset_log()  # the first step warms up: measure the steady state

    def finish(self, ctx: RunContext) -> dict:
        dist = ds.load("deepspeed.comm")

        summary = dist.log_summary(return_dict=True) or {"summary": {}}  # every rank must call it
        logger_off()
        return {"summary": summary.get("summary", {})}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        trained = ctx.steps - ctx.first_step
        steps = trained - 1 if trained > 1 else 1
        return {"comm": communication.record_section(ranks[0]["summary"], ctx.world_size, steps)}


class Timeline(Probe):
    """Where a launch's seconds go: on each rank, seconds from its process start to the end of each
    phase (imports, process group, ``deepspeed.initialize``, training, measuring). In a sweep, the
    first two phases happen once, before the first run. Section: ``timeline_s``.
    """

    name = "timeline"
    keys = ("timeline_s.per_rank",)
    #: phases the rank script marks before any run starts (see helpers.core.train)
    process_marks: ClassVar[dict[str, float]] = {}

    def start(self, ctx: RunContext) -> None:
        self.marks = dict(self.process_marks)
        self.marks["initialize"] = round(time.time() - ctx.born, 3)

    def after_step(self, ctx: RunContext, step: int) -> None:
        if step == ctx.steps - 1:
            self.marks["train"] = round(time.time() - ctx.born, 3)

    def finish(self, ctx: RunContext) -> dict:
        self.marks["measure"] = round(time.time() - ctx.born, 3)
        return {"marks": self.marks}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"timeline_s": {"phases": list(ranks[0]["marks"]), "per_rank": [r["marks"] for r in ranks],
                               "note": "seconds from each rank's process start to the end of each phase"}}


# --- throughput and communication share (the capstone; formulas in helpers/core/performance.py) ----

#: Optimizer steps the ``throughput`` probe leaves out at the start (allocator growth, compilation,
#: ZeRO-3's first trace of the parameter order); it also leaves out the last step, which ``comm_share``
#: may profile.
WARMUP_STEPS = 2


class Throughput(Timing):
    """Tokens per second, model TFLOP/s per GPU and MFU (:func:`helpers.core.performance.throughput`), from
    rank 0's step times (device synchronized before and after each step), steps ``WARMUP_STEPS`` + 1 to
    the last but one (all but the first when a run has fewer than ``WARMUP_STEPS`` + 2 steps). Tokens per
    step = micro batch x accumulation x ranks x sequence length (samples for models without one).
    Section: ``throughput``.
    """

    name = "throughput"  # steps timed as the timing probe does; only what is made of them differs
    keys = ("throughput.tokens_per_s", "throughput.tflops_per_gpu", "throughput.mfu", "throughput.step_time_s")

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        times = ranks[0]["times"]
        first, last = (WARMUP_STEPS, len(times) - 1) if len(times) >= WARMUP_STEPS + 2 else (min(1, len(times) - 1), len(times))
        shape = performance.model_shape(ctx.engine.module)
        seq = shape["seq_len"] if shape else 1
        flops = (performance.flops_per_token(ctx.params, shape["layers"], shape["hidden"], seq, shape["lookup_params"])
                 if shape else None)
        device_name = "cpu"
        if ctx.device_type == "cuda":
            device_name = torch.cuda.get_device_name(0)
        section = performance.throughput(times[first:last], ctx.micro_batch * ctx.grad_accum * ctx.world_size * seq,
                                         flops["total"] if flops else None, ctx.world_size, device_name)
        section.update({"measured_steps": list(range(first + 1, last + 1)), "all_step_times_s": times,
                        "seq_len": seq if shape else None, "flops_per_token": flops,
                        "formula": "6*(N - untied input embedding) + 12*layers*hidden*seq_len model FLOPs per "
                                   "token (PaLM, appendix B)"})
        return {"throughput": section}


class CommShare(Probe):
    """Share of one optimizer step spent communicating, from a ``torch.profiler`` trace of the last step
    on every rank (:func:`helpers.core.performance.comm_share`): on GPUs, NCCL kernel time not hidden behind
    other kernels. Profiling slows that step, so ``throughput`` leaves it out. Section: ``comm_share``
    (rank 0's figures, every rank's exposed share, or why none could be taken).
    """

    name = "comm_share"
    keys = ("comm_share.available",)

    def start(self, ctx: RunContext) -> None:
        self.profile_step = ctx.steps - 1
        self.profiler = None
        self.result: dict = {"available": False, "reason": "the profiled step did not run"}

    def before_step(self, ctx: RunContext, step: int) -> None:
        if step != self.profile_step:
            return

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device_type == "cuda" else [])
        try:
            ctx.synchronize()
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
        except Exception as error:  # a profiler refused by the driver or the sandbox: say so, train on
            self.profiler = None
            self.result = {"available": False, "reason": f"torch.profiler failed: {type(error).__name__}: {error}"}
        self.started = time.perf_counter()

    def after_step(self, ctx: RunContext, step: int) -> None:
        if step != self.profile_step or self.profiler is None:
            return
        ctx.synchronize()
        seconds = time.perf_counter() - self.started
        try:
            self.profiler.__exit__(None, None, None)
            events = [(e.name, e.time_range.start, e.time_range.end, e.device_type.name != "CPU")
                      for e in self.profiler.events()]
            self.result = {"available": True, **performance.comm_share(events, seconds)}
        except Exception as error:
            self.result = {"available": False, "reason": f"reading the trace failed: {type(error).__name__}: {error}"}
        self.profiler = None

    def finish(self, ctx: RunContext) -> dict:
        return self.result

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        section = dict(ranks[0])
        section["profiled_step"] = self.profile_step + 1
        section["exposed_share_per_rank"] = [r.get("exposed_share") for r in ranks]
        return {"comm_share": section}


# --- collectives phase by phase (chapters 08 gradient accumulation and 09 collective bandwidth) ----

def _call_seconds(event) -> float:
    """Seconds of one call as DeepSpeed's comms-logger timer kept it: a host duration (CPU) or a pair
    of device events (GPU), whose end the logger has already waited for."""
    return float(event) if isinstance(event, (int, float)) else event.get_elapsed_msec() / 1000.0


class MicroSteps(Probe):
    """Collectives and wall time of each phase of an optimizer step: micro-step 1, 2, ... (forward and
    backward, with the previous micro-step's ``engine.step``, which does no work off the boundary), and
    the optimizer step (the last ``engine.step``). Steps 2..S are kept; the first warms up.

    Every call DeepSpeed's comms logger records is captured as it is logged, with its own duration.
    The logger's ``latency`` column cannot serve: in DeepSpeed 0.19.8 it is the running total of every
    earlier call of the same name (``timers(log_name).elapsed(reset=False)`` in ``deepspeed/comm/comm.py``),
    so the probe reads the duration of the call itself from the logger's timer. The logger waits for
    each collective to finish before timing it, so overlap of communication with computation is lost
    in a run with this probe: time steps in runs without it (``probes=("timing",)``).

    A collective's time on a rank includes waiting for the others to reach it; the rank that arrived
    last waited least, so each call's time is the smallest over the ranks: the collective's own.

    Section ``micro_steps``: ``phases`` (names), ``by_phase`` (phase -> op -> count, logged bytes and
    seconds per optimizer step), ``wall_s_by_phase`` (rank 0), ``comm_s_per_step`` (the collectives' own
    seconds per step; ``comm_s_each_step``: the same for each measured step) and
    ``comm_s_per_step_with_waiting_per_rank`` (each rank's, waiting included).
    """

    name = "micro_steps"
    keys = ("micro_steps.by_phase", "micro_steps.comm_s_per_step")
    config = Comm.config

    def start(self, ctx: RunContext) -> None:
        dist = ds.load("deepspeed.comm")
        ds_comm = ds.load("deepspeed.comm.comm")

        self.calls: list[tuple[str, int, float]] = []  # (logger's record name, logged bytes, seconds), in order
        self.marks: list[tuple[int, str, int, float]] = []  # (step, phase, calls so far, time)
        logger = dist.comms_logger
        timers = ds_comm.timers
        # The logger sums every earlier call of a name at each call (see above): start each run with no
        # earlier calls, or a long sweep on GPUs slows down quadratically.
        timers.timers.clear()
        vars(logger).pop("append", None)  # a wrapper left by a run that failed before its finish
        original = logger.append

        def append(raw_name, record_name, latency, msg_size):  # the logger's own hook, wrapped
            original(raw_name, record_name, latency, msg_size)
            self.calls.append((record_name, int(msg_size), _call_seconds(timers(record_name).event_timers[-1])))

        logger.append = append
        self.restore = lambda: vars(logger).pop("append", None)

    def _mark(self, ctx: RunContext, step: int, phase: str) -> None:
        ctx.synchronize()
        self.marks.append((step, phase, len(self.calls), time.perf_counter()))

    def before_step(self, ctx: RunContext, step: int) -> None:
        self._mark(ctx, step, "start")

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        self._mark(ctx, step, f"micro-step {micro_step + 1}")

    def after_step(self, ctx: RunContext, step: int) -> None:
        self._mark(ctx, step, "optimizer step")

    def finish(self, ctx: RunContext) -> dict:
        self.restore()
        logger_off()
        first = 1 if ctx.steps > 1 else 0
        steps: list[list[dict]] = []
        for (step, _, begin, t0), (_, phase, end, t1) in zip(self.marks, self.marks[1:]):
            if phase == "start" or step < first:
                continue
            if phase == "micro-step 1":
                steps.append([])
            calls = [[communication.split_name(name)[0], size, seconds]
                     for name, size, seconds in self.calls[begin:end]
                     if communication.split_name(name)[0] not in communication.IGNORED_OPS]
            steps[-1].append({"phase": phase, "wall_s": t1 - t0, "calls": calls})
        return {"steps": steps}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        measured = ranks[0]["steps"]
        phases = [p["phase"] for p in measured[0]]
        by_phase: dict[str, dict[str, dict[str, float]]] = {phase: {} for phase in phases}
        each_step = [0.0] * len(measured)
        for s, step in enumerate(measured):
            for i, phase in enumerate(step):
                theirs = [r["steps"][s][i]["calls"] for r in ranks]
                matched = all(len(c) == len(phase["calls"]) for c in theirs)
                for j, (op, size, seconds) in enumerate(phase["calls"]):
                    # the rank that arrived last waited least: its time is the collective's own
                    own = min(c[j][2] for c in theirs) if matched else seconds
                    row = by_phase[phase["phase"]].setdefault(op, {"count": 0, "bytes": 0, "seconds": 0.0})
                    row["count"] += 1 / len(measured)
                    row["bytes"] += size / len(measured)
                    row["seconds"] += own / len(measured)
                    each_step[s] += own
        waiting = [statistics.fmean(sum(c[2] for p in step for c in p["calls"]) for step in r["steps"]) for r in ranks]
        return {"micro_steps": {
            "phases": phases,
            "by_phase": by_phase,
            "wall_s_by_phase": {phase: statistics.fmean(step[i]["wall_s"] for step in measured)
                                for i, phase in enumerate(phases)},
            "comm_s_per_step": sum(row["seconds"] for ops in by_phase.values() for row in ops.values()),
            "comm_s_per_step_with_waiting_per_rank": waiting,
            "comm_s_each_step": each_step,
            "measured_steps": len(measured),
        }}


# --- where model states live (chapter 06; default for every run whose config offloads) -------------

class Placement(Probe):
    """Where each rank's model states live (:func:`helpers.core.memory.placement`): on the second optimizer
    step, after the backward of the last micro-step (the boundary, just before ``engine.step``), like
    ``model_states``. Also the host's peak memory (peak RSS) and current RSS at the end of the run.

    Sections: ``memory.placement_bytes_per_rank`` (per rank: ``accelerator`` and ``host`` bytes by kind,
    ``pinned_bytes``, ``devices``, ``dtypes``, ``accelerator_is_host``), ``memory.host_peak_bytes_per_rank``,
    ``memory.host_rss_bytes_per_rank``.
    """

    name = "placement"
    keys = ("memory.placement_bytes_per_rank", "memory.host_peak_bytes_per_rank")

    def start(self, ctx: RunContext) -> None:
        self.step = 1 if ctx.steps > 1 else 0
        self.found: dict | None = None

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        if step == self.step and micro_step == ctx.grad_accum - 1:
            self.found = memory.placement(ctx.engine)

    def finish(self, ctx: RunContext) -> dict:
        return {"placement": self.found, "host_peak": memory.peak_bytes("cpu")[0],
                "host_rss": psutil.Process().memory_info().rss}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"memory": {"placement_bytes_per_rank": [r["placement"] for r in ranks],
                           "host_peak_bytes_per_rank": [r["host_peak"] for r in ranks],
                           "host_rss_bytes_per_rank": [r["host_rss"] for r in ranks],
                           "placement_measured_at": f"step {self.step + 1}, after the backward of the last "
                                                    "micro-step, before the optimizer step"}}


#: The core's probes, by the short names runs use for them.
CORE: dict[str, type[Probe]] = {cls.name: cls for cls in (Timing, ModelStates, PeakMemory, Comm, Timeline, Throughput,
                                                          CommShare, MicroSteps, Placement)}
