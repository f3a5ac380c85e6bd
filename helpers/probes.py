"""Probes: the measurements a rank takes around its training loop.

The loop in :mod:`helpers.train` knows nothing about what is measured. It calls each probe of a run
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

A run chooses its probes by name (:data:`DEFAULT`, or ``probes=`` in :func:`helpers.launch.run`).
A new measurement is a new subclass registered with :func:`register`; the loop does not change.
A probe that needs DeepSpeed to log something says so in :attr:`Probe.config`, which is merged
into the run's config before launch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, ClassVar

#: The probes a run uses unless it names others.
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
            import torch

            torch.cuda.synchronize()


class Probe:
    """One kind of measurement. Override the hooks you need; each default does nothing."""

    name: ClassVar[str] = ""
    #: DeepSpeed config this probe needs (merged under the run's own config before launch).
    config: ClassVar[dict] = {}
    #: The trainer (``helpers.train.TRAINERS``) this probe measures, if it only works with one.
    trainer: ClassVar[str | None] = None

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Raise a ValueError naming the key and the fix when the run's ``options`` cannot work for this
        probe. :func:`helpers.launch.run` calls it before any process starts."""

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

    @classmethod
    def check_fault(cls, key: str, value: Any, steps: int) -> None:
        """For a probe that injects a fault (:data:`FAULT_PROBES`): raise a ValueError naming ``key`` and
        the fix when ``value`` is not a valid request for a run of ``steps`` optimizer steps."""


#: name -> probe class; see :func:`register`.
PROBES: dict[str, type[Probe]] = {}
#: fault (a key of ``RunSpec.faults``) -> the probe that injects it; a run asking for the fault gets the
#: probe added (:func:`helpers.launch.run`), and the probe's ``check_fault`` validates the value.
FAULT_PROBES: dict[str, str] = {}


def register(cls: type[Probe]) -> type[Probe]:
    """Class decorator: make a probe available to runs under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name")
    PROBES[cls.name] = cls
    return cls


def check_names(names: tuple[str, ...] | list[str]) -> None:
    """Raise a ValueError naming the choices when a probe name is unknown (before any process starts)."""
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise ValueError(f"probes {unknown}: not course probes; choose from {', '.join(sorted(PROBES))}")


def check_trainer(names: tuple[str, ...] | list[str], model: str) -> None:
    """Raise a ValueError when a probe only works with another way of training than ``model``'s."""
    from helpers import models

    trainer = models.trainer_of(model)
    for name in names:
        wanted = PROBES[name].trainer
        if wanted not in (None, trainer):
            fitting = [m for m in models.MODELS if models.trainer_of(m) == wanted]
            raise ValueError(f"probe {name!r} measures {wanted} training, but model {model!r} trains with {trainer}: "
                             f"use a model such as {fitting[0]!r}, or leave the probe out")


def config_for(names: tuple[str, ...] | list[str]) -> dict:
    """The DeepSpeed config the probes ``names`` need, merged (later probes win on conflicts)."""
    from helpers.configs import merged

    result: dict = {}
    for name in names:
        result = merged(result, PROBES[name].config)
    return result


def deep_update(target: dict, sections: dict) -> dict:
    """Merge ``sections`` into ``target`` in place (nested dicts merge), so two probes can share ``memory``."""
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            deep_update(target[key], value)
        else:
            target[key] = value
    return target


def logger_off() -> None:
    """Turn DeepSpeed's comms logger off at the end of a run that used it (what it logged stays readable).
    ``deepspeed.initialize`` turns it on for a config with a ``comms_logger`` section but never off: without
    this, the next run of a sweep would still wait for and time every collective although its config asks
    for no logging."""
    import deepspeed.comm as dist

    dist.configure(enabled=False)


# --- the course's probes ----------------------------------------------------------------------

@register
class Timing(Probe):
    """Wall time of each optimizer step on rank 0 (device synchronized before and after).

    Sections: ``step_time_s`` (``median`` and ``all``) and ``samples_per_s`` (global batch / median).
    """

    name = "timing"

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


@register
class ModelStates(Probe):
    """Bytes of parameters, gradients, optimizer states, master copy and buckets each rank holds
    (:func:`helpers.memory.model_states`), on the second optimizer step: after the backward of the first
    micro-step (mid-accumulation) and of the last one (the boundary, just before ``engine.step``).

    Section: ``memory.model_states_bytes_per_rank`` (mid-accumulation when there is accumulation, else
    the boundary), ``memory.model_states_at_boundary_bytes_per_rank``, ``memory.measured_at``.
    """

    name = "model_states"

    def start(self, ctx: RunContext) -> None:
        # optimizer states exist once the optimizer has stepped: measure on the second step trained
        self.step = ctx.first_step + 1 if ctx.steps - ctx.first_step > 1 else ctx.first_step
        self.mid: dict | None = None
        self.boundary: dict | None = None

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        from helpers import memory

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


@register
class PeakMemory(Probe):
    """Peak memory of each rank (:func:`helpers.memory.peak_bytes`).

    On a GPU the allocator's peak is reset when the run starts and the runs before it in the same
    processes have released their engines (``train.release_zero3_references``; the record says so in
    ``memory.earlier_runs_released``), so each run of a sweep has its own. On CPU it is the process's
    peak resident set, which only grows: in a sweep, a run's figure includes the runs before it in the
    same processes. Section: ``memory.peak_bytes_per_rank``.
    """

    name = "peak_memory"

    def start(self, ctx: RunContext) -> None:
        if ctx.device_type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()

    def finish(self, ctx: RunContext) -> dict:
        from helpers import memory

        peak, source = memory.peak_bytes(ctx.device_type)
        return {"peak": peak, "source": source}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        released = {"earlier_runs_released": True} if ctx.device_type == "cuda" else {}
        return {"memory": {"peak_bytes_per_rank": [r["peak"] for r in ranks], "peak_source": ranks[0]["source"],
                           **released}}


@register
class Comm(Probe):
    """Every collective of steps 2..S, from DeepSpeed's comms logger (``deepspeed.comm.log_summary``),
    folded by :mod:`helpers.communication`: count and bytes per optimizer step, by op and by the
    DeepSpeed function that issued it. Rank 0's log is the one kept. Section: ``comm``.
    """

    name = "comm"
    # debug: the logger also records which DeepSpeed function issued each collective
    config = {"comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": True}}

    def start(self, ctx: RunContext) -> None:
        import deepspeed.comm as dist

        dist.reset_log()  # leave out set-up collectives (the initial broadcast of the weights)

    def before_step(self, ctx: RunContext, step: int) -> None:
        if step == ctx.first_step + 1:
            import deepspeed.comm as dist

            dist.reset_log()  # the first step warms up: measure the steady state

    def finish(self, ctx: RunContext) -> dict:
        import deepspeed.comm as dist

        summary = dist.log_summary(return_dict=True) or {"summary": {}}  # every rank must call it
        logger_off()
        return {"summary": summary.get("summary", {})}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        from helpers import communication

        trained = ctx.steps - ctx.first_step
        steps = trained - 1 if trained > 1 else 1
        return {"comm": communication.record_section(ranks[0]["summary"], ctx.world_size, steps)}


@register
class Timeline(Probe):
    """Where a launch's seconds go: on each rank, seconds from its process start to the end of each
    phase (imports, process group, ``deepspeed.initialize``, training, measuring). In a sweep, the
    first two phases happen once, before the first run. Section: ``timeline_s``.
    """

    name = "timeline"
    #: phases the rank script marks before any run starts (see helpers.train)
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


# --- capstone: throughput and communication share (issue 10; formulas in helpers/performance.py) ----

#: Optimizer steps the ``throughput`` probe leaves out at the start (allocator growth, compilation,
#: ZeRO-3's first trace of the parameter order); it also leaves out the last step, which ``comm_share``
#: may profile.
WARMUP_STEPS = 2


@register
class Throughput(Timing):
    """Tokens per second, model TFLOP/s per GPU and MFU (:func:`helpers.performance.throughput`), from
    rank 0's step times (device synchronized before and after each step), steps ``WARMUP_STEPS`` + 1 to
    the last but one (all but the first when a run has fewer than ``WARMUP_STEPS`` + 2 steps). Tokens per
    step = micro batch x accumulation x ranks x sequence length (samples for models without one).
    Section: ``throughput``.
    """

    name = "throughput"  # steps timed as the timing probe does; only what is made of them differs

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        from helpers import performance

        times = ranks[0]["times"]
        first, last = (WARMUP_STEPS, len(times) - 1) if len(times) >= WARMUP_STEPS + 2 else (min(1, len(times) - 1), len(times))
        shape = performance.model_shape(ctx.engine.module)
        seq = shape["seq_len"] if shape else 1
        flops = (performance.flops_per_token(ctx.params, shape["layers"], shape["hidden"], seq, shape["lookup_params"])
                 if shape else None)
        device_name = "cpu"
        if ctx.device_type == "cuda":
            import torch

            device_name = torch.cuda.get_device_name(0)
        section = performance.throughput(times[first:last], ctx.micro_batch * ctx.grad_accum * ctx.world_size * seq,
                                         flops["total"] if flops else None, ctx.world_size, device_name)
        section.update({"measured_steps": list(range(first + 1, last + 1)), "all_step_times_s": times,
                        "seq_len": seq if shape else None, "flops_per_token": flops,
                        "formula": "6*(N - untied input embedding) + 12*layers*hidden*seq_len model FLOPs per "
                                   "token (PaLM, appendix B)"})
        return {"throughput": section}


@register
class CommShare(Probe):
    """Share of one optimizer step spent communicating, from a ``torch.profiler`` trace of the last step
    on every rank (:func:`helpers.performance.comm_share`): on GPUs, NCCL kernel time not hidden behind
    other kernels. Profiling slows that step, so ``throughput`` leaves it out. Section: ``comm_share``
    (rank 0's figures, every rank's exposed share, or why none could be taken).
    """

    name = "comm_share"

    def start(self, ctx: RunContext) -> None:
        self.profile_step = ctx.steps - 1
        self.profiler = None
        self.result: dict = {"available": False, "reason": "the profiled step did not run"}

    def before_step(self, ctx: RunContext, step: int) -> None:
        if step != self.profile_step:
            return
        from torch.profiler import ProfilerActivity, profile

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
        from helpers import performance

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


# --- offload and mixed precision (chapters 06-07): their probes live in their own modules ----------
from helpers import offload as _offload, precision as _precision  # noqa: E402,F401  (register on import)


# --- parallelism (chapters 10-12): probes defined beside the code they measure, registered on import
from helpers import activations, pipeline, tensor_parallel  # noqa: E402,F401


# --- chapters 13-15: checkpoints, PyTorch beside DeepSpeed ------------------------------------
# Their probes live in their own modules; importing them here registers them wherever probes are
# looked up (in the notebook before a launch, and on every rank).
from helpers import checkpoints, pytorch_train  # noqa: E402,F401


# --- bandwidth chapters (08 gradient accumulation, 09 collective bandwidth) -------------------

def _call_seconds(event) -> float:
    """Seconds of one call as DeepSpeed's comms-logger timer kept it: a host duration (CPU) or a pair
    of device events (GPU), whose end the logger has already waited for."""
    return float(event) if isinstance(event, (int, float)) else event.get_elapsed_msec() / 1000.0


@register
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
    seconds per step) and ``comm_s_per_step_with_waiting_per_rank`` (each rank's, waiting included).
    """

    name = "micro_steps"
    config = Comm.config

    def start(self, ctx: RunContext) -> None:
        import deepspeed.comm as dist
        from deepspeed.comm import comm as ds_comm

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
        from helpers import communication

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
        waiting = [statistics.fmean(sum(c[2] for p in step for c in p["calls"]) for step in r["steps"]) for r in ranks]
        return {"micro_steps": {
            "phases": phases,
            "by_phase": by_phase,
            "wall_s_by_phase": {phase: statistics.fmean(step[i]["wall_s"] for step in measured)
                                for i, phase in enumerate(phases)},
            "comm_s_per_step": sum(row["seconds"] for ops in by_phase.values() for row in ops.values()),
            "comm_s_per_step_with_waiting_per_rank": waiting,
            "measured_steps": len(measured),
        }}
