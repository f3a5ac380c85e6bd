"""PyTorch's collectives measured with its profiler: what DeepSpeed's comms logger cannot see (PyTorch DDP,
FSDP2), and a second measurement of DeepSpeed's own collectives to check the logger against.

- :func:`collectives_from_profile`: the collectives of a profile, shaped as DeepSpeed's ``log_summary`` shapes them.
- :class:`TorchComm`: the probe (``torch_comm``) that profiles steps 2..S of a run and writes its ``comm``
  section (``comm_profiler`` beside the comms logger's in a DeepSpeed run).
- :func:`profiler_check_table`: for runs measured both ways, the logger's and the profiler's figures side by side.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from torch.profiler import ProfilerActivity, profile

from helpers.core import communication, records
from helpers.core.probes import Probe, RunContext

#: Collective ops as the PyTorch profiler names them -> the name DeepSpeed's comms logger gives the
#: same collective (so tables of both frameworks line up). ``_c10d_functional`` ops are DTensor's.
COLLECTIVES = {
    "c10d::allreduce_": "all_reduce", "_c10d_functional::all_reduce": "all_reduce",
    "c10d::_allgather_base_": "all_gather_into_tensor",
    "_c10d_functional::all_gather_into_tensor": "all_gather_into_tensor", "c10d::allgather_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter_tensor",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter_tensor", "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::broadcast_": "broadcast", "_c10d_functional::broadcast": "broadcast",
    "c10d::alltoall_base_": "all_to_all_single", "c10d::barrier": "barrier",
}
#: Bytes per element of the dtype names the profiler records.
DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
               "signed char": 1, "unsigned char": 1, "bool": 1, "short int": 2}
#: Which of a collective's tensors is the message DeepSpeed's logger records: the whole tensor for
#: all_reduce and reduce_scatter (their input), each rank's own shard for all_gather (its input too).
_MESSAGE_ARGUMENT = {"c10d::_allgather_base_": 1, "c10d::_reduce_scatter_base_": 1}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _caller(event, enclosing: list) -> str:
    """The code that issued a collective: the tightest enclosing profiler range that is not the
    collective machinery itself (FSDP2's ``FSDP::all_gather``, DDP's autograd hook, an aten op of DTensor)."""
    for outer in sorted(enclosing, key=lambda e: e.duration_ns()):
        name = outer.name()
        if name == "PythonSubclass" or name in COLLECTIVES:
            continue
        name = re.sub(r"\s*\(\d+\)$", "", name)  # FSDP2 numbers its parameter groups
        name = re.sub(r" for \d+$", "", name)
        return name.replace("autograd::engine::evaluate_function: ", "backward: ")
    return ""


def _shapes(event) -> list:
    """An event's input shapes, a list of tensors as a list of shapes where this torch records them."""
    return event.structured_input_shapes() if hasattr(event, "structured_input_shapes") else event.shapes()


#: The events a communication backend records for the work it runs (``nccl:all_reduce``, ``gloo:broadcast``).
_BACKEND_EVENT = re.compile(r"(nccl|gloo|mpi|ucc|xccl):")
#: The c10d ops that take a list of tensors -> the name their backend gives its own event (``nccl:<name>``).
_BACKEND_NAMES = {"c10d::allreduce_": "all_reduce", "c10d::broadcast_": "broadcast", "c10d::allgather_": "all_gather",
                  "c10d::reduce_scatter_": "reduce_scatter"}


def _backend_events(events) -> dict[int, Any]:
    """Each list-taking c10d op (by ``id``) -> the event its backend recorded for it (``gloo:all_reduce``,
    ``nccl:all_reduce``: one tensor, with shape and dtype). Every ``c10d::`` op makes one backend event,
    in the order the ops were issued (gloo starts them on a thread of its own after the op returned, and
    names them by what it runs: a reduce-scatter is a ``gloo:all_reduce``), so the i-th op pairs with the
    i-th event. Nothing is paired where the counts differ (an op cut by the profile's window) or where a
    list op's partner has another name."""
    def by_start(name_matches) -> list:
        return sorted((e for e in events if name_matches(e.name())), key=lambda e: e.start_ns())

    ops = by_start(lambda n: n.startswith("c10d::"))
    own = by_start(lambda n: _BACKEND_EVENT.match(n) is not None)
    pairs = [(op, event) for op, event in zip(ops, own) if op.name() in _BACKEND_NAMES]
    if len(ops) != len(own) or any(event.name().split(":", 1)[1] != _BACKEND_NAMES[op.name()] for op, event in pairs):
        return {}
    return {id(op): event for op, event in pairs}


def _collectives_in_context(events: list) -> list[tuple[Any, list]]:
    """Every collective op of a profile with the events of its thread that enclose it, outermost first.
    One pass per thread over its events in start order, keeping a stack of those still open (a thread's
    ranges nest), so a profile of a whole model's steps (10^5-10^6 events) takes seconds. A backend's
    events are left out: NCCL ends them when the work completes, not where the op returns."""
    threads: dict[int, list] = {}
    for e in events:
        if not _BACKEND_EVENT.match(e.name()):
            threads.setdefault(e.start_thread_id(), []).append(e)
    found = []
    for chain in threads.values():
        chain.sort(key=lambda e: (e.start_ns(), -e.duration_ns()))
        stack: list = []
        for e in chain:
            end = e.start_ns() + e.duration_ns()
            while stack and stack[-1].start_ns() + stack[-1].duration_ns() < end:
                stack.pop()  # ended before this event did: encloses neither it nor anything after it
            if e.name() in COLLECTIVES:
                found.append((e, list(stack)))
            if e.duration_ns() > 0:
                stack.append(e)
    return sorted(found, key=lambda pair: pair[0].start_ns())


def collectives_from_profile(events, fallback_dtype_bytes: int) -> dict:
    """Every collective of a profile as DeepSpeed's ``log_summary`` shapes it: {"op | [Caller Func: x]":
    {message bytes: {"count": n}}}, so :func:`helpers.core.communication.record_section` folds both alike.

    ``events`` are the profiler's kineto events. A collective that runs inside another (DTensor's
    functional all_reduce calls ``c10d::allreduce_``) is counted once, as the outer one. The profiler
    records no dtype for an op that takes a list of tensors (``c10d::allreduce_``, DDP's buckets), and a
    torch without ``structured_input_shapes`` (2.11) no shape either: such an op takes its dtype (and
    then its shape) from its backend's own event (:func:`_backend_events`); with none paired, its width
    is ``fallback_dtype_bytes``, that of the gradients that DDP buckets.
    """
    events = list(events)
    backend = _backend_events(events)
    summary: dict[str, dict[int, dict[str, int]]] = {}
    for e, enclosing in _collectives_in_context(events):
        if any(o.name() in COLLECTIVES for o in enclosing):
            continue  # the inner half of a functional collective
        argument = _MESSAGE_ARGUMENT.get(e.name(), 0)
        shape, dtype = _shapes(e)[argument], e.dtypes()[argument]
        if dtype == "TensorList":
            numel, width = sum(_numel(s) for s in shape if isinstance(s, (list, tuple))), fallback_dtype_bytes
            inner = backend.get(id(e))
            if inner is not None and _shapes(inner):  # (a 0-dim tensor's shape is [])
                numel = numel or _numel(_shapes(inner)[0])
                width = DTYPE_BYTES.get(inner.dtypes()[0], fallback_dtype_bytes)
        else:
            numel, width = _numel(shape), DTYPE_BYTES.get(dtype, fallback_dtype_bytes)
        caller = _caller(e, enclosing)
        key = f"{COLLECTIVES[e.name()]} | [Caller Func: {caller}]" if caller else COLLECTIVES[e.name()]
        row = summary.setdefault(key, {}).setdefault(numel * width, {"count": 0})
        row["count"] += 1
    return summary


class TorchComm(Probe):
    """Every collective of steps 2..S of a run that DeepSpeed's comms logger cannot see (PyTorch DDP,
    FSDP2), from the PyTorch profiler (``record_shapes=True``): each ``c10d`` op with its tensors' shapes
    and dtypes, whoever issued it (DDP's C++ reducer, FSDP2, DTensor). Bytes follow the comms logger's
    convention; the section is the ``comm`` section the ``comm`` probe writes (:mod:`helpers.core.communication`).

    In a run that also has the ``comm`` probe (a DeepSpeed run), the section is ``comm_profiler`` instead,
    so the two measurements of the same collectives can be compared.
    """

    name = "torch_comm"
    keys = ("comm.by_op", "comm.bytes_per_step", "comm.wire_bytes_per_step")

    def start(self, ctx: RunContext) -> None:
        self.profiler = None
        self.steps = max(1, ctx.steps - ctx.first_step - 1)

    def before_step(self, ctx: RunContext, step: int) -> None:
        if step == ctx.first_step + 1 or (ctx.steps - ctx.first_step == 1 and step == ctx.first_step):

            ctx.synchronize()
            self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self.profiler.__enter__()  # the first step warms up: measure the steady state

    def finish(self, ctx: RunContext) -> dict:
        if self.profiler is None:
            return {"summary": {}}
        ctx.synchronize()
        self.profiler.__exit__(None, None, None)
        # gradients are bf16 in a bf16 run, unless the engine says it keeps them in fp32 (DDP under autocast)
        width = 2 if ctx.precision == "bf16" and not getattr(ctx.engine, "fp32_gradients", False) else 4
        events = self.profiler.profiler.kineto_results.events()
        return {"summary": collectives_from_profile(events, width)}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        summary = {key: {str(size): row for size, row in sizes.items()} for key, sizes in ranks[0]["summary"].items()}
        section = communication.record_section(summary, ctx.world_size, self.steps)
        section["source"] = "PyTorch profiler (c10d ops, record_shapes)"
        logger_on = ctx.config.get("comms_logger", {}).get("enabled", False)
        return {"comm_profiler" if logger_on else "comm": section}


def profiler_check_table(runs: Mapping[str, records.Record]) -> str:
    """For DeepSpeed's runs, measured twice: bytes per step and collective by the comms logger and by the
    PyTorch profiler (the method used for PyTorch's runs). Where they differ, by how much."""
    rows = []
    for name, r in runs.items():
        if "comm_profiler" not in r.summary:
            continue
        logger, profiler = r.summary["comm"]["by_op"], r.summary["comm_profiler"]["by_op"]
        for op in sorted(set(logger) | set(profiler)):
            a, b = logger.get(op, {"count": 0, "bytes": 0}), profiler.get(op, {"count": 0, "bytes": 0})
            same = "same" if a == b else f"differ by {b['bytes'] - a['bytes']:+,.0f} bytes"
            rows.append([name, op, f"{a['count']:g} / {b['count']:g}", f"{a['bytes']:,.0f}", f"{b['bytes']:,.0f}",
                         same])
    return records.format_table(rows, ["run", "collective", "calls: logger / profiler", "logger bytes",
                                       "profiler bytes", ""])
