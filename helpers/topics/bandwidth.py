"""Chapter 09: collective bandwidth, measured and modelled, in three parts.

1. The collectives benchmark (:func:`spec`, :func:`benchmark`), run by the ranks of a launch.
2. Slower links on one machine (:func:`rate_limited_link`, :func:`nccl_over_sockets`).
3. The latency-bandwidth model fitted to what part 1 measured (:func:`fit`, :class:`CommModel`).

--- 1. The collectives benchmark ---

A microbenchmark of the collectives ZeRO uses, run by the ranks of a launch (chapter 09).

:func:`spec` makes the :class:`helpers.core.launch.RunSpec` of a benchmark (``task=TASK``),
so it runs under DeepSpeed's launcher beside training runs of the same sweep and writes a
``summary.json`` into its own run folder. On every rank, for each message size and collective, each
implementation is called ``warmup`` times, then ``iters`` times in turn with the others (so drift of
the machine hits all alike), each call timed alone: a barrier, the call, the device synchronized.

Implementations:

- ``deepspeed.comm``: what DeepSpeed's engine calls (``all_reduce``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``broadcast``), with its comms logger off.
- ``torch.distributed``: the same collectives called on torch directly (gloo or NCCL).
- ``deepspeed shm`` (CPU only, all_reduce only): ``deepspeed.comm.inference_all_reduce``, DeepSpeed's
  shared-memory kernel (see :mod:`helpers.topics.bandwidth` for when it exists).

Conventions are nccl-tests' (``doc/PERFORMANCE.md``): the message size S is the whole tensor (for
all_gather, the gathered result); algbw = S / t; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n
for all_gather and reduce_scatter, x 1 for broadcast (:func:`helpers.core.theory.bus_bandwidth`). The bytes
one rank sends, ``wire_bytes`` (:func:`helpers.core.theory.wire_bytes`), are busbw x t: the size the
latency-bandwidth model of :mod:`helpers.topics.bandwidth` is fitted on. Inside a course network namespace
(:mod:`helpers.topics.bandwidth`) each rank also counts the bytes its network interfaces really sent.

--- 2. Slower links ---

Slower networks on one machine, for real: the links a run's collectives travel, and how to constrain them.

Two ways, both confined to this machine and undone when their ``with`` block ends:

- :func:`rate_limited_link` (CPU ranks, gloo): every rank in a network namespace of its own, the
  namespaces joined by virtual Ethernet (``veth``) cables to one bridge, each rank's cable limited to a
  rate by a token-bucket filter (``tc ... tbf``), like a node's network card. Only addresses inside
  these namespaces are used; nothing reaches the host's own network. Needs root (``CAP_NET_ADMIN`` and
  ``CAP_SYS_ADMIN``) and ``ip``/``tc`` (iproute2); :func:`link_support` says whether, and why not.
- :func:`nccl_over_sockets` (GPU ranks, NCCL): NCCL kept off NVLink/PCIe peer-to-peer and shared
  memory, so its traffic goes through TCP sockets on the loopback interface; the environment is
  restored afterwards.

What DeepSpeed does on CPU, for the record (0.19.8, ``deepspeed/comm/torch.py`` and
``csrc/cpu/comm/shm_interface.cpp``): training collectives (``deepspeed.comm.all_reduce``,
``all_gather_into_tensor``, ...) always go to ``torch.distributed``, i.e. gloo over TCP sockets, even
between two processes on one machine. DeepSpeed's shared-memory kernel serves only
``deepspeed.comm.inference_all_reduce``; it is set up when the ``LOCAL_SIZE`` variable that DeepSpeed's
launcher gives each rank equals the world size, and used when the ``deepspeed_shm_comm`` op loaded
(``torch.ops.deepspeed.inference_all_reduce_`` exists) and the processor has the kernel's instructions.
:mod:`helpers.topics.bandwidth` measures both paths and, inside these namespaces, the bytes each puts on
the wire.

--- 3. The latency-bandwidth model ---

The latency-bandwidth (alpha-beta) model of communication, fitted to measured collectives (chapter 09).

One call of a collective that makes each rank send ``w`` bytes takes

    t(w) = alpha + beta * w

``alpha`` (seconds) is what every call costs whatever its size (software, synchronisation, the
network's latency); ``1 / beta`` (bytes/s) is the bandwidth the bytes flow at. ``w`` is the ring's
wire bytes per rank (:func:`helpers.core.theory.wire_bytes`): 2(n-1)/n S for all_reduce, (n-1)/n S for
all_gather and reduce_scatter, S for broadcast, so ``1 / beta`` is nccl-tests' bus bandwidth of large
messages, and a link of B bytes/s per direction has ``beta = 1 / B``.

:func:`fit` recovers alpha and beta from (bytes, seconds) points; :class:`CommModel` holds one fit per
collective (from :mod:`helpers.topics.bandwidth`' benchmark) and predicts the communication seconds of a
training step from the collectives DeepSpeed's comms logger recorded for it. :func:`profile` and
:func:`extrapolate` split a measured step into computation and communication, phase by phase
(the ``micro_steps`` probe), so :func:`what_if` can predict step time on other links and at other
accumulation settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed
import torch.distributed as tdist

from helpers.core import configs, ds, environment, exercises, launch, load_guard, plots, records, references, theory
from helpers.core.plan import PlannedRun, emit, publish, reference_of
from helpers.topics import accumulation

# === 1. the collectives benchmark, run by the ranks ================================================

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
IMPLEMENTATIONS = ("deepspeed.comm", "torch.distributed", "deepspeed shm")
#: Message sizes (bytes): 1 KiB to 1 GiB on GPUs, 1 KiB to 4 MiB on CPU, by factors of 4.
GPU_SIZES = tuple(2**k for k in range(10, 31, 2))
CPU_SIZES = tuple(2**k for k in range(10, 23, 2))
DTYPES = ("float32", "bfloat16")
MAX_BYTES = 2**32  # 4 GiB: larger messages are refused before launch
LINK_CALLS = 2  # calls whose bytes on the network are counted, per point (course namespaces only)


def default_sizes(is_gpu: bool) -> tuple[int, ...]:
    return GPU_SIZES if is_gpu else CPU_SIZES


def spec(name: str = "collectives", sizes: Sequence[int] | None = None, ops: Sequence[str] = OPS,
         implementations: Sequence[str] | None = None, iters: int | None = None, warmup: int | None = None,
         dtype: str = "float32", is_gpu: bool | None = None, baseline_ops: Sequence[str] | None = None,
         out: str | Path | None = None, task: str | None = None):
    """The RunSpec of one benchmark (checked here, before any process starts).

    Defaults depend on the device (``is_gpu``, else :func:`helpers.core.environment.detect`): sizes
    :data:`GPU_SIZES` or :data:`CPU_SIZES`, 20 timed calls per point on GPUs and 5 on CPU, a quarter
    of that (at least 1) as warm-up, every implementation that applies. ``baseline_ops``: the collectives
    also measured with ``torch.distributed`` (default: all on GPUs; all_reduce on CPU, where both are gloo
    and the shared-memory kernel is the comparison that matters). ``out``: the run folder (default
    ``runs/<name>``). ``task``: the rank-side function, ``"module:function"`` (default :data:`TASK`, the
    course's own; a learner's version calls :func:`run_benchmark` with its own calls).
    """

    if is_gpu is None:
        is_gpu = environment.detect().is_gpu
    sizes = tuple(default_sizes(is_gpu) if sizes is None else sizes)
    implementations = tuple(IMPLEMENTATIONS if implementations is None else implementations)
    iters = (20 if is_gpu else 5) if iters is None else iters
    warmup = max(1, iters // 4) if warmup is None else warmup
    baseline_ops = tuple((OPS if is_gpu else ("all_reduce",)) if baseline_ops is None else baseline_ops)
    bad_ops = [op for op in ops if op not in OPS]
    if bad_ops or not ops:
        raise ValueError(f"ops={list(ops)!r}: choose from {', '.join(OPS)}")
    bad = [i for i in implementations if i not in IMPLEMENTATIONS]
    if bad or not implementations:
        raise ValueError(f"implementations={list(implementations)!r}: choose from {', '.join(IMPLEMENTATIONS)}")
    if not sizes or any(not isinstance(s, int) or not 64 <= s <= MAX_BYTES for s in sizes):
        raise ValueError(f"sizes={list(sizes)!r}: message sizes are whole bytes from 64 to {MAX_BYTES} (4 GiB)")
    if not isinstance(iters, int) or iters < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"iters={iters!r}, warmup={warmup!r}: at least 1 timed call, 0 or more warm-up calls")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    if any(op not in OPS for op in baseline_ops):
        raise ValueError(f"baseline_ops={list(baseline_ops)!r}: choose from {', '.join(OPS)}")
    settings = {"sizes": list(sizes), "ops": list(ops), "implementations": list(implementations), "iters": iters,
                "warmup": warmup, "dtype": dtype, "baseline_ops": list(baseline_ops)}
    return launch.RunSpec(config={"collectives": settings}, name=name, steps=len(sizes), probes=(), check=False,
                          task=task or TASK, out=out or launch.RUNS_DIR / name)


# --- rank side ----------------------------------------------------------------------------------

def _interface_bytes() -> int | None:
    """Bytes this process's network namespace has sent on all its interfaces, inside a course namespace only
    (elsewhere other programs share the counters)."""
    if not os.environ.get("COURSE_NETNS"):
        return None
    return sum(int(p.read_text()) for p in Path("/sys/class/net").glob("*/statistics/tx_bytes"))


def shm_status(world_size: int) -> dict:
    """Whether DeepSpeed's shared-memory all-reduce can run in this rank, and what decided it."""
    # on the ranks only; the module's ``cdb`` is the backend in use now
    ds_comm = ds.load("deepspeed.comm.comm")

    local_size = os.environ.get("LOCAL_SIZE")
    has_op = hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")
    level = getattr(ds_comm.cdb, "shm_vector_kernel_level", 0)
    maps = Path("/proc/self/maps").read_text()
    segments = len({line.split()[-1] for line in maps.splitlines() if "deepspeed_allreduce_buffer" in line})
    reasons = []
    if not has_op:
        reasons.append("the deepspeed_shm_comm op is not loaded (not a CPU accelerator, or it did not build)")
    if local_size != str(world_size):
        reasons.append(f"LOCAL_SIZE={local_size} is not the world size {world_size}: no segments were set up")
    if level < 1:
        reasons.append("this processor lacks the kernel's instructions (AVX2 for fp32)")
    return {"available": not reasons, "why_not": "; ".join(reasons), "local_size": local_size,
            "op_loaded": has_op, "kernel_level": level, "segments_mapped": segments}


def deepspeed_call(op: str, elements: int, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """A function making one call of ``op`` through ``deepspeed.comm`` on a message of ``elements`` elements (the
    course's own benchmark; chapter 09 writes its version on the page)."""
    dist = ds.load("deepspeed.comm")

    world = dist.get_world_size()
    shard = elements // world
    if op == "all_reduce":
        x = torch.ones(elements, dtype=dtype, device=device)
        return lambda: dist.all_reduce(x)
    if op == "all_gather":
        inp, out = torch.ones(shard, dtype=dtype, device=device), torch.empty(shard * world, dtype=dtype, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        inp, out = torch.ones(shard * world, dtype=dtype, device=device), torch.empty(shard, dtype=dtype, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    x = torch.ones(elements, dtype=dtype, device=device)
    return lambda: dist.broadcast(x, 0)


def aligned(call: Callable[[], object]) -> float:
    """Seconds of one call, every rank starting together: a barrier (raw torch, not a call being measured), then
    the call, timed to the end of its work on the device. DeepSpeed's shared-memory kernel spin-waits on its
    peers' flags, and a rank racing into the next call has deadlocked it before (DeepSpeed PR #4048 fixed one
    such case; a launch of this benchmark with back-to-back calls once hung here), so no call, warm-up
    included, goes without the barrier."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    tdist.barrier()
    sync()
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def benchmark(run: PlannedRun, position: int, count: int, born: float) -> None:
    """Rank-side task (the course's own): :func:`run_benchmark` with :func:`deepspeed_call` and :func:`aligned`."""
    run_benchmark(run, position, deepspeed_call, aligned)


def _core_wait_ns() -> dict[str, int]:
    """Thread id -> nanoseconds each of this process's threads has waited, runnable, for a core (the second field
    of Linux's ``/proc/self/task/*/schedstat``); empty where the kernel does not keep it."""
    found = {}
    with contextlib.suppress(OSError):
        for task in os.scandir("/proc/self/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                found[task.name] = int(Path(task.path, "schedstat").read_text().split()[1])
    return found


def _timed_with_core_wait(timed: Callable[[Callable[[], object]], float],
                          call: Callable[[], object]) -> tuple[float, float]:
    """``timed(call)``'s seconds, and the seconds this process's threads spent meanwhile ready to run but waiting
    for a core that another thread (of any program) held. A barrier first, so that the wait for a late peer in
    ``timed``'s own barrier stays out of it."""
    tdist.barrier()
    before = _core_wait_ns()
    seconds = timed(call)
    after = _core_wait_ns()
    return seconds, sum(ns - before.get(task, 0) for task, ns in after.items()) / 1e9


def run_benchmark(run: PlannedRun, position: int,
                  call: Callable[[str, int, torch.dtype, torch.device], Callable[[], object]],
                  timed: Callable[[Callable[[], object]], float]) -> None:
    """The harness of a rank-side benchmark task: for every (size, collective) of the plan, the
    ``deepspeed.comm`` call made by ``call(op, elements, dtype, device)`` and the comparisons
    (``torch.distributed``, DeepSpeed's shared-memory kernel), each timed by ``timed`` (warm-up calls first,
    then the implementations in turn); rank 0 publishes the table."""
    dist = ds.load("deepspeed.comm")
    get_accelerator = ds.load("deepspeed.accelerator").get_accelerator

    settings = run.read_config()["collectives"]
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():  # deepspeed.initialize picks each rank's GPU; a task before it must do so itself
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(get_accelerator().current_device_name())
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, settings["dtype"])
    width = torch.empty((), dtype=dtype).element_size()
    shm = shm_status(world) if not on_gpu else {"available": False, "why_not": "GPU ranks use NCCL"}
    logger_was = dist.comms_logger.enabled
    dist.comms_logger.enabled = False  # a training run before this one in the sweep may have turned it on

    def calls(op: str, elements: int) -> dict:
        """implementation -> a function making one call of ``op`` on ``elements`` elements (whole message)."""
        found = {"deepspeed.comm": call(op, elements, dtype, device)}
        shard = elements // world
        if op == "all_reduce":
            x = torch.ones(elements, dtype=dtype, device=device)
            found["torch.distributed"] = lambda: tdist.all_reduce(x)
            if shm["available"]:
                found["deepspeed shm"] = lambda: dist.inference_all_reduce(x)
        elif op == "all_gather":
            out = torch.empty(shard * world, dtype=dtype, device=device)
            inp = torch.ones(shard, dtype=dtype, device=device)
            found["torch.distributed"] = lambda: tdist.all_gather_into_tensor(out, inp)
        elif op == "reduce_scatter":
            inp = torch.ones(shard * world, dtype=dtype, device=device)
            out = torch.empty(shard, dtype=dtype, device=device)
            found["torch.distributed"] = lambda: tdist.reduce_scatter_tensor(out, inp)
        else:
            x = torch.ones(elements, dtype=dtype, device=device)
            found["torch.distributed"] = lambda: tdist.broadcast(x, 0)
        return found

    results = []
    try:
        for index, size in enumerate(settings["sizes"]):
            elements = max(world, size // width // world * world)  # a whole shard per rank
            message = elements * width
            for op in settings["ops"]:
                found = calls(op, elements)
                chosen = {name: fn for name, fn in found.items() if name in settings["implementations"]
                          and (name == "deepspeed.comm" or op in settings["baseline_ops"])}
                for fn in chosen.values():
                    for _ in range(settings["warmup"]):
                        timed(fn)
                times: dict[str, list[float]] = {name: [] for name in chosen}
                waits: dict[str, list[float]] = {name: [] for name in chosen}
                for _ in range(settings["iters"]):
                    for name, fn in chosen.items():
                        seconds, waited = _timed_with_core_wait(timed, fn)
                        times[name].append(seconds)
                        waits[name].append(waited)
                # per call, the seconds all ranks together waited for a core
                summed = torch.tensor([waits[name] for name in chosen], dtype=torch.float64, device=device)
                tdist.all_reduce(summed)
                core_wait = dict(zip(chosen, summed.tolist()))
                sent: dict[str, float | None] = {name: None for name in chosen}
                if _interface_bytes() is not None:  # bytes on the wire, where the counters are ours alone
                    barriers = _interface_bytes()
                    for _ in range(LINK_CALLS):
                        timed(lambda: None)
                    barriers = _interface_bytes() - barriers
                    for name, fn in chosen.items():
                        before = _interface_bytes()
                        for _ in range(LINK_CALLS):
                            timed(fn)
                        sent[name] = (_interface_bytes() - before - barriers) / LINK_CALLS
                for name, measured in times.items():
                    seconds = statistics.median(measured)
                    results.append({"implementation": name, "op": op, "bytes": message, "elements": elements,
                                    "seconds": seconds, "times": measured, "core_wait": core_wait[name],
                                    "algbw": message / seconds,
                                    "busbw": theory.bus_bandwidth(op, message, seconds, world),
                                    "wire_bytes": wire_bytes(op, message, world),
                                    "interface_bytes_sent": sent[name]})
                del found, chosen
            emit("step", run=position, rank=rank, step=index + 1, steps=len(settings["sizes"]), loss=None)
    finally:
        dist.comms_logger.enabled = logger_was
    if rank == 0:
        publish(run, position, {
            "name": run.name, "task": "collectives", "world_size": world, "backend": tdist.get_backend(),
            "device": device.type, "device_name": torch.cuda.get_device_name(0) if on_gpu else "cpu",
            "dtype": settings["dtype"], "iters": settings["iters"], "warmup": settings["warmup"],
            "implementations": sorted({r["implementation"] for r in results}),
            "shm": shm, "namespace": os.environ.get("COURSE_NETNS"), "results": results})


#: How a run names the benchmark task (:func:`spec` makes its RunSpec).
TASK = reference_of(benchmark)


# --- reading results ----------------------------------------------------------------------------

def wire_bytes(op: str, message_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for a collective on a message of ``message_bytes`` (nccl-tests' S) on a ring:
    busbw x time. Same as :func:`helpers.core.theory.wire_bytes` of the size DeepSpeed's comms logger records
    (the logger records each rank's shard for all_gather)."""
    logged = message_bytes / world_size if op.startswith("all_gather") else message_bytes
    return theory.wire_bytes(op, logged, world_size)


def rows(result: dict, implementation: str | None = None, op: str | None = None) -> list[dict]:
    """The measured points of a benchmark summary, optionally of one implementation and collective."""
    return [r for r in result["results"] if (implementation is None or r["implementation"] == implementation)
            and (op is None or r["op"] == op)]


def point(result: dict, implementation: str, op: str, size: int) -> dict:
    """The measured point nearest ``size`` bytes (sizes are rounded to whole shards)."""
    found = rows(result, implementation, op)
    if not found:
        raise KeyError(f"no {op} measured with {implementation} (measured: {sorted(result['implementations'])})")
    return min(found, key=lambda r: abs(r["bytes"] - size))


def coverage_table(result: dict) -> str:
    """Which collective was measured with which implementation, at how many sizes: deterministic (nbval checks it)."""
    table = []
    for op in dict.fromkeys(r["op"] for r in result["results"]):
        sizes = sorted({r["bytes"] for r in rows(result, op=op)})
        impls = ", ".join(i for i in IMPLEMENTATIONS if rows(result, i, op))
        table.append([op, impls, f"{len(sizes)}", f"{records.format_bytes(sizes[0])} .. {records.format_bytes(sizes[-1])}"])
    return records.format_table(table, ["collective", "implementations", "sizes", "range"])


#: A call this many times its point's fastest call is counted slow by :func:`core_wait_reading`.
SLOW_CALL = 3.0
#: A call whose ranks waited for a core longer than this share of its time "waited" (:func:`kept_cores`).
WAITED = 0.2


def _calls(p: dict) -> list[tuple[float, float | None]]:
    """(seconds, seconds all ranks waited for a core, or None where not recorded) of each timed call."""
    waits = p.get("core_wait") or [None] * len(p.get("times", []))
    return list(zip(p.get("times", []), waits))


def _waited(seconds: float, wait: float | None) -> bool:
    """Whether a call's ranks waited for a core longer than :data:`WAITED` of its time."""
    return wait is not None and wait > WAITED * seconds


#: The label of :func:`kept_cores`' points where some calls kept their cores, and where none did.
KEPT = "calls whose ranks kept their cores"
NONE_KEPT = "fastest call per point (no call kept its cores)"


def kept_cores(result: dict) -> dict:
    """A copy of a benchmark summary whose points keep only the calls whose ranks hardly waited for a core (not
    :func:`_waited`): each point's time is their median, or its fastest call where every call waited. Its
    ``selection`` label is :data:`KEPT` where every point had such calls, :data:`NONE_KEPT` where none did, else
    how many points did. A
    summary without the waits (the GPU references) comes back unchanged."""
    if not any(p.get("core_wait") for p in result["results"]):
        return result
    points, from_kept = [], 0
    for p in result["results"]:
        kept = [t for t, wait in _calls(p) if not _waited(t, wait)]
        from_kept += bool(kept)
        seconds = statistics.median(kept or [min(p["times"])])
        points.append(dict(p, times=kept or [min(p["times"])], seconds=seconds, algbw=p["bytes"] / seconds,
                           busbw=theory.bus_bandwidth(p["op"], p["bytes"], seconds, result["world_size"])))
    selection = (KEPT if from_kept == len(points) else NONE_KEPT if not from_kept else
                 f"{from_kept} of {len(points)} points from calls whose ranks kept their cores, the rest their "
                 "fastest call")
    return dict(result, results=points, selection=selection)


def kept_cores_warning(calm: dict) -> str:
    """The line printed before this run's fit table where :func:`kept_cores` found no call that kept its cores
    (its ``selection`` is :data:`NONE_KEPT`): such a fit cannot be trusted, and the GPU reference is the lesson.
    Empty where some calls kept their cores or no waits were recorded."""
    if calm.get("selection") != NONE_KEPT:
        return ""
    return ("No call of this benchmark kept its cores (every call's ranks waited for one), so each point is its "
            "fastest call, still slowed by waiting for cores: this run's fit cannot be trusted on this machine. The "
            "lesson is the GPU reference's fit ('Key result' above); the figures below show how this machine's cores "
            "served the ranks' threads (two ranks, their gloo threads and any other program), not the link.")


def core_wait_table(result: dict, op: str = "all_reduce", implementation: str = "deepspeed.comm") -> str:
    """Per message size of ``op``: how many timed calls waited for a core, and the median time of the calls that
    did and did not. (The wait itself is summed over every thread of every rank, so it is not comparable with a
    call's time and is not shown.)"""
    table = []
    for p in sorted(rows(result, implementation, op), key=lambda r: r["bytes"]):
        calls = _calls(p)
        kept = [t for t, w in calls if not _waited(t, w)]
        waited = [t for t, w in calls if _waited(t, w)]
        table.append([records.format_bytes(p["bytes"]), f"{len(waited)} of {len(calls)}",
                      f"{statistics.median(kept) * 1e6:,.0f}" if kept else "-",
                      f"{statistics.median(waited) * 1e6:,.0f}" if waited else "-"])
    return (f"{op}, {implementation} (a call 'waited' where its ranks' threads, together, waited for a core longer "
            f"than {WAITED:.0%} of the call):\n"
            + records.format_table(table, ["size", "calls that waited", "median us, kept cores", "median us, waited"]))


def core_wait_reading(result: dict, slow: float = SLOW_CALL) -> str:
    """Whether the slow calls of a benchmark (over ``slow`` times their point's fastest call) are the calls whose
    ranks waited for a core, counted over every point and implementation."""
    slow_waited = slow_kept = waited = kept = 0
    for p in result["results"]:
        fastest = min(p["times"])
        for t, wait in _calls(p):
            if wait is None:
                return "(this benchmark did not record the ranks' waits for a core)"
            is_slow = t > slow * fastest
            if _waited(t, wait):
                waited, slow_waited = waited + 1, slow_waited + is_slow
            else:
                kept, slow_kept = kept + 1, slow_kept + is_slow
    share = lambda a, b: f"{a} of {b} ({a / b:.0%})"
    said = f"Calls slower than {slow:g}x their point's fastest call: "
    if not waited:
        return said + f"{share(slow_kept, kept)}; no call waited for a core."
    if not kept:
        return said + (f"{share(slow_waited, waited)}; every call's ranks waited for a core, so the fits use the "
                       f"{NONE_KEPT}.")
    return said + (f"{share(slow_waited, waited)} of the calls whose ranks waited for a core, "
                   f"{share(slow_kept, kept)} of the others.")


def bandwidth_table(result: dict, op: str, implementations: Sequence[str] | None = None) -> str:
    """Per message size: time, algbw and busbw (GB/s = 1e9 bytes/s) of each implementation of ``op``."""
    impls = [i for i in (implementations or IMPLEMENTATIONS) if rows(result, i, op)]
    sizes = sorted({r["bytes"] for r in rows(result, op=op)})
    table = []
    for size in sizes:
        row = [records.format_bytes(size)]
        for impl in impls:
            p = point(result, impl, op, size)
            row += [f"{p['seconds'] * 1e6:,.0f}", f"{p['algbw'] / 1e9:.3g}", f"{p['busbw'] / 1e9:.3g}"]
        table.append(row)
    headers = ["size"] + [f"{i} {h}" for i in impls for h in ("us", "algbw GB/s", "busbw GB/s")]
    return f"{op} on {result['world_size']} ranks ({result['device_name']}, {result['backend']}):\n" + \
        records.format_table(table, headers)


def ratio(result: dict, op: str, subject: str, baseline: str, size: int) -> float:
    """busbw of ``subject`` over ``baseline`` for ``op`` at the measured size nearest ``size``."""
    return point(result, subject, op, size)["busbw"] / point(result, baseline, op, size)["busbw"]


def target_table(result: dict, sizes: Sequence[int] = (256 * 2**20, 2**30), op: str = "all_reduce",
                 subject: str = "deepspeed.comm", baseline: str = "torch.distributed", threshold: float = 0.95) -> str:
    """The course's GPU target: ``subject``'s busbw at least ``threshold`` of ``baseline``'s at ``sizes``."""
    table = []
    for size in sizes:
        measured = [r["bytes"] for r in rows(result, subject, op)]
        if not measured or max(measured) < size / 2:
            table.append([records.format_bytes(size), "-", "-", "-", "not measured (sizes stop at "
                          f"{records.format_bytes(max(measured or [0]))})"])
            continue
        a, b = point(result, subject, op, size), point(result, baseline, op, size)
        r = a["busbw"] / b["busbw"]
        table.append([records.format_bytes(a["bytes"]), f"{a['busbw'] / 1e9:.1f}", f"{b['busbw'] / 1e9:.1f}",
                      f"{r:.3f}", "met" if r >= threshold else "missed"])
    return records.format_table(table, ["size", f"{subject} busbw GB/s", f"{baseline} busbw GB/s", "ratio",
                                        f"target >= {threshold:.2f}"])


def wire_check_table(result: dict, op: str = "all_reduce") -> str:
    """Inside a course namespace: bytes each implementation put on the network per call, against the ring's
    wire bytes. TCP adds headers and acknowledgements; a shared-memory path puts (almost) nothing there."""
    table = []
    for impl in IMPLEMENTATIONS:
        for r in rows(result, impl, op):
            if r["interface_bytes_sent"] is None:
                continue
            table.append([impl, records.format_bytes(r["bytes"]), f"{r['wire_bytes']:,.0f}",
                          f"{r['interface_bytes_sent']:,.0f}", f"{r['interface_bytes_sent'] / r['wire_bytes']:.2f}"])
    if not table:
        return "(no interface counters: the ranks did not run in course namespaces)"
    return records.format_table(table, ["implementation", "message", "ring wire bytes", "sent on the link",
                                        "sent / wire"])


#: How far (relative) bytes sent on the link may stray from the ring's wire bytes before :func:`wire_check_notes`
#: explains the row; TCP headers alone add about 2 kB a call, so only messages of 64 KiB and more are read.
WIRE_MATCH = 0.05


def wire_check_notes(result: dict, op: str = "all_reduce", smallest: int = 2**16) -> str:
    """Sentences, from the benchmark's interface counters, on each row of :func:`wire_check_table` of at least
    ``smallest`` bytes whose bytes on the link stray more than :data:`WIRE_MATCH` from the ring's wire bytes, set
    beside the other implementation's row of the same size (both call gloo's same all_reduce)."""
    lines = []
    for r in rows(result, op=op):
        sent = r["interface_bytes_sent"]
        if sent is None or r["bytes"] < smallest or abs(sent / r["wire_bytes"] - 1) <= WIRE_MATCH:
            continue
        twins = [t for t in rows(result, op=op) if t["bytes"] == r["bytes"] and t is not r
                 and t["interface_bytes_sent"] is not None]
        twin = (f"; {twins[0]['implementation']}'s same call at that size sent "
                f"{twins[0]['interface_bytes_sent'] / twins[0]['wire_bytes']:.2f}x" if twins else "")
        lines.append(f"{r['implementation']} at {records.format_bytes(r['bytes'])}: {sent / r['wire_bytes']:.2f}x the "
                     f"ring's wire bytes ({sent - r['wire_bytes']:+,.0f} bytes a call){twin}. The counters are read on "
                     "rank 0 as soon as its last call returns, and a call can return while its last bytes still wait "
                     "in the socket's send queue: most likely a reading, not gloo sending less.")
    if not lines:
        if not any(r["interface_bytes_sent"] is not None for r in rows(result, op=op)):
            return "(no interface counters here)"
        return (f"From {records.format_bytes(smallest)} up, every row is within {WIRE_MATCH:.0%} of the ring's wire "
                "bytes.")
    return "\n".join(lines)


def shm_report(result: dict) -> str:
    """What decided DeepSpeed's shared-memory all-reduce in the benchmark's ranks (deterministic on a CPU)."""
    shm = result["shm"]
    if result["device"] != "cpu":
        return f"DeepSpeed's shared-memory all-reduce: not for {result['device']} ranks ({shm['why_not']})"
    lines = [f"LOCAL_SIZE given by DeepSpeed's launcher: {shm['local_size']} (world size {result['world_size']})",
             f"deepspeed_shm_comm op loaded: {'yes' if shm['op_loaded'] else 'no'}",
             f"shared-memory segments mapped by rank 0: {shm['segments_mapped']}",
             f"inference_all_reduce takes the shared-memory kernel: {'yes' if shm['available'] else 'no: ' + shm['why_not']}"]
    return "\n".join(lines)


# === 2. slower links on one machine ================================================================

#: Names of the course's namespaces: ``crs<pid>h`` (the bridge) and ``crs<pid>r<rank>``.
PREFIX = "crs"
_NAME = re.compile(rf"^{PREFIX}(\d+)(h|r\d+)$")
#: The namespaces' private subnet (only ever configured inside them).
SUBNET = "10.213.0"
INTERFACE = "eth0"  # each rank's cable, inside its namespace
MAX_RANKS = 200

#: NCCL's settings that keep it off NVLink, PCIe peer-to-peer, shared memory and InfiniBand.
NCCL_SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
                "NCCL_SOCKET_IFNAME": "lo"}
#: NCCL says which transport each channel uses at this log level (``... via P2P/IPC``, ``via NET/Socket/0``).
NCCL_SHOW_TRANSPORT = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}


class NotPermitted(RuntimeError):
    """This machine does not let the course build namespaces or shape traffic (the message says why)."""


def _run(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise NotPermitted(f"`{' '.join(argv)}` failed: {(result.stderr or result.stdout).strip()}")
    return result.stdout


#: Set to 1 to keep the course from building namespaces even where it could (the slow-link parts skip).
OFF_SWITCH = "COURSE_NO_NAMESPACES"


def link_support() -> tuple[bool, str]:
    """Whether :func:`rate_limited_link` can run here, and why not: the off switch, tools, privileges, and a
    test namespace with a bridge and a rate limit, created and deleted."""
    if os.environ.get(OFF_SWITCH) == "1":
        return False, f"turned off by {OFF_SWITCH}=1"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "network namespaces and traffic shaping need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}h"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "br0", "root", "tbf", "rate", "1mbit",
              "burst", "32kb", "latency", "50ms"])
    except NotPermitted as refused:
        return False, str(refused)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return True, "root, iproute2, namespaces, bridges and tbf all work here"


def remove_stale_namespaces() -> list[str]:
    """Delete the course's namespaces whose creating process is gone (a killed kernel), and name them."""
    try:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    stale = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            stale.append(name)
    return stale


@dataclasses.dataclass(frozen=True)
class Link:
    """A rate-limited network between ranks, each in its own namespace (see :func:`rate_limited_link`)."""

    prefix: str  # rank r lives in namespace f"{prefix}r{r}"
    world_size: int
    rate_mbit: float | None  # per rank and direction; None: the virtual cable's own speed

    @property
    def master_addr(self) -> str:
        """Rank 0's address: where the others find its TCP store."""
        return f"{SUBNET}.1"

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    @property
    def rank_prefix(self) -> list[str]:
        """The command DeepSpeed's launcher starts each rank through: it enters the namespace of rank
        ``$LOCAL_RANK`` and tells gloo and NCCL to use the rank's cable (``helpers.core.launch`` appends the
        rank's own command)."""
        script = ('ns="$0r$LOCAL_RANK"; exec ip netns exec "$ns" env COURSE_NETNS="$ns" '
                  f'GLOO_SOCKET_IFNAME={INTERFACE} NCCL_SOCKET_IFNAME={INTERFACE} "$@"')
        return ["sh", "-c", script, self.prefix]

    def describe(self) -> str:
        rate = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited"
        return (f"{self.world_size} ranks, one network namespace each ({self.prefix}r0..r{self.world_size - 1}), "
                f"veth cables to a bridge, {rate} per rank and direction")


#: Token-bucket size: one 64 KiB segment, the largest the kernel hands a virtual cable at once (GSO).
#: A larger bucket lets whole small messages pass at the cable's own speed (measured: a 256 KiB
#: all-reduce at 2.5x the set rate with a 500 KB bucket); a smaller one stalls on those segments.
BURST_BYTES = 64 * 1024


def shaping_command(rate_mbit: float | None) -> list[str]:
    """``tc`` arguments after ``tc qdisc replace dev IF root``: a token-bucket filter of ``rate_mbit`` with a
    bucket of :data:`BURST_BYTES` and a queue of at most 200 ms (nothing for ``None``: no limit)."""
    if rate_mbit is None:
        return []
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(BURST_BYTES), "latency", "200ms"]


def _check_rate(rate_mbit: float | None) -> None:
    if rate_mbit is not None and (isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float))
                                  or not 0.1 <= rate_mbit <= 100_000):
        raise ValueError(f"rate_mbit={rate_mbit!r}: give a rate between 0.1 and 100000 Mbit/s, or None for no limit")


@contextlib.contextmanager
def rate_limited_link(world_size: int, rate_mbit: float | None) -> Iterator[Link]:
    """Namespaces for ``world_size`` ranks joined through a bridge, each rank's cable shaped to ``rate_mbit``
    (its sending side: like a network card); all of it deleted when the block ends, whatever happens.

    Raises :class:`NotPermitted` (with the reason) where the machine does not allow it, before creating
    anything, and ValueError for a bad rate. Pass ``link.rank_prefix`` and ``link.master_addr`` to
    :func:`helpers.core.launch.sweep`.
    """
    if not isinstance(world_size, int) or not 2 <= world_size <= MAX_RANKS:
        raise ValueError(f"world_size={world_size!r}: a link joins 2 to {MAX_RANKS} ranks")
    _check_rate(rate_mbit)
    ok, why = link_support()
    if not ok:
        raise NotPermitted(why)
    remove_stale_namespaces()
    link = Link(f"{PREFIX}{os.getpid()}", world_size, rate_mbit)
    hub = f"{link.prefix}h"
    created = []
    try:
        _run(["ip", "netns", "add", hub])
        created.append(hub)
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        for rank in range(world_size):
            ns = link.namespace(rank)
            _run(["ip", "netns", "add", ns])
            created.append(ns)
            _run(["ip", "-n", hub, "link", "add", f"p{rank}", "type", "veth", "peer", "name", INTERFACE, "netns", ns])
            _run(["ip", "-n", hub, "link", "set", f"p{rank}", "master", "br0"])
            _run(["ip", "-n", hub, "link", "set", f"p{rank}", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{rank + 1}/24", "dev", INTERFACE])
            _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            shaping = shaping_command(rate_mbit)
            if shaping:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", INTERFACE, "root", *shaping])
        yield link
    finally:
        for ns in reversed(created):  # a namespace takes its cables and their shaping with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def set_rate(run: PlannedRun, position: int, count: int, born: float) -> None:
    """Rank-side task (``RunSpec(task=SET_RATE)``): reshape this rank's own cable to the
    plan's ``link.rate_mbit`` between two runs of one launch, then publish what
    ``tc`` now says. Only inside a course namespace (``COURSE_NETNS``); refused elsewhere."""

    namespace = os.environ.get("COURSE_NETNS", "")
    if not _NAME.match(namespace):
        raise RuntimeError("set_rate runs only in ranks placed in a course namespace (rate_limited_link)")
    dist = ds.load("deepspeed.comm")

    wanted = run.read_config()["link"]
    shaping = shaping_command(wanted.get("rate_mbit"))
    if shaping:
        _run(["tc", "qdisc", "replace", "dev", INTERFACE, "root", *shaping])
    else:
        subprocess.run(["tc", "qdisc", "del", "dev", INTERFACE, "root"], capture_output=True, timeout=30)
    shown = _run(["tc", "qdisc", "show", "dev", INTERFACE]).strip()
    torch.distributed.barrier()
    if dist.get_rank() == 0:
        publish(run, position, {"name": run.name, "task": "set_rate", "namespace": namespace, "tc": shown,
                                **wanted})


#: How a run names the task.
SET_RATE = reference_of(set_rate)


def set_rate_spec(name: str, rate_mbit: float | None):
    """A :class:`helpers.core.launch.RunSpec` for :func:`set_rate` (checked before anything starts)."""

    _check_rate(rate_mbit)
    return launch.RunSpec(config={"link": {"rate_mbit": rate_mbit}}, name=name, steps=1, probes=(), check=False,
                          task=SET_RATE, out=launch.RUNS_DIR / name)


@contextlib.contextmanager
def nccl_over_sockets(show_transport: bool = True) -> Iterator[dict[str, str]]:
    """Within the block, runs started by :mod:`helpers.core.launch` keep NCCL off NVLink, peer-to-peer and shared
    memory (:data:`NCCL_SOCKETS`), so collectives go through TCP sockets on this machine's loopback; with
    ``show_transport`` NCCL also logs the transport of each channel (see :func:`nccl_transports`).
    The previous environment is restored when the block ends."""
    settings = {**NCCL_SOCKETS, **(NCCL_SHOW_TRANSPORT if show_transport else {})}
    with environment_set(settings):
        yield settings


@contextlib.contextmanager
def environment_set(settings: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block (runs launched inside inherit them), then restore them."""
    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_TRANSPORT = re.compile(r"via (\S+)")


def nccl_transports(launch_log: str | Path) -> dict[str, int]:
    """Transport -> channels, from NCCL's ``Channel xx/yy : a[a] -> b[b] via P2P/CUMEM`` lines in a launch's log
    (written when ``NCCL_DEBUG=INFO``): what NCCL really used."""
    found: dict[str, int] = {}
    for line in Path(launch_log).read_text(errors="replace").splitlines():
        if "Channel" in line and " via " in line:
            match = _TRANSPORT.search(line)
            if match:
                found[match.group(1)] = found.get(match.group(1), 0) + 1
    return found


# === 3. the latency-bandwidth model ================================================================

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
GBIT = 1e9 / 8  # bytes/s in one gigabit per second

#: What-if links: bytes/s per direction. Network cards at their nominal line rate; NVLink 4 (H100/H200):
#: 18 links of 25 GB/s each way, 450 GB/s per direction.
LINKS = {"10 Gb/s": 10 * GBIT, "25 Gb/s": 25 * GBIT, "100 Gb/s": 100 * GBIT, "400 Gb/s": 400 * GBIT,
         "NVLink 4": 450e9}


def collective_of(op: str) -> str:
    """The collective an op name of DeepSpeed's comms logger is: ``all_gather_into_tensor`` -> ``all_gather``."""
    if op.startswith(("all_reduce", "inference_all_reduce")):
        return "all_reduce"
    for name in ("all_gather", "reduce_scatter", "broadcast"):
        if op.startswith(name):
            return name
    raise KeyError(f"op {op!r}: the model knows {', '.join(COLLECTIVES)} (and their DeepSpeed variants)")


#: The model itself lives in :mod:`helpers.core.theory`, beside every other formula that turns bytes into seconds.
AlphaBeta = theory.AlphaBeta


def fit(wire_bytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares alpha and beta (both >= 0) on *relative* error, so a 1 KiB point counts as much as a 1 GiB one:
    minimise sum(((alpha + beta x_i) - t_i) / t_i)^2. Needs two or more points of different sizes."""
    x, t = [float(v) for v in wire_bytes], [float(v) for v in seconds]
    if len(x) != len(t):
        raise ValueError(f"{len(x)} sizes but {len(t)} times")
    if len(set(x)) < 2:
        raise ValueError("fitting alpha and beta needs measurements at two or more different sizes")
    if any(v <= 0 for v in t) or any(v < 0 for v in x):
        raise ValueError("times must be positive and sizes non-negative")
    # Weighted normal equations of rows (1/t_i, x_i/t_i) against 1.
    s11 = sum(1 / v**2 for v in t)
    s12 = sum(a / v**2 for a, v in zip(x, t))
    s22 = sum(a * a / v**2 for a, v in zip(x, t))
    r1 = sum(1 / v for v in t)
    r2 = sum(a / v for a, v in zip(x, t))
    det = s11 * s22 - s12 * s12
    alpha = (r1 * s22 - r2 * s12) / det
    beta = (s11 * r2 - s12 * r1) / det
    if alpha < 0:  # bandwidth only: the line through the origin
        alpha, beta = 0.0, r2 / s22
    if beta < 0:  # latency only
        alpha, beta = r1 / s11, 0.0
    return AlphaBeta(alpha, beta)


def relative_errors(model: AlphaBeta, wire_bytes: Sequence[float], seconds: Sequence[float]) -> list[float]:
    """(predicted - measured) / measured at each point."""
    return [(model.seconds(x) - t) / t for x, t in zip(wire_bytes, seconds)]


@dataclasses.dataclass
class CommModel:
    """One :class:`AlphaBeta` per collective, for ``world_size`` ranks; ``source`` says where it came from."""

    fits: dict[str, AlphaBeta]
    world_size: int
    source: str = ""

    def fit_for(self, op: str) -> AlphaBeta:
        name = collective_of(op)
        if name not in self.fits:
            raise KeyError(f"no fit for {name} (fitted: {', '.join(self.fits)}); benchmark it too")
        return self.fits[name]

    def seconds(self, op: str, logged_bytes: float, calls: float = 1.0) -> float:
        """Predicted seconds of ``calls`` calls of ``op`` whose sizes, as DeepSpeed's comms logger records them,
        add up to ``logged_bytes``."""
        return self.fit_for(op).seconds(theory.wire_bytes(op, logged_bytes, self.world_size), calls)

    def predict(self, by_op: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """op -> predicted seconds, for a table of op -> {count, bytes} (a record's ``comm.by_op``)."""
        return {op: self.seconds(op, row["bytes"], row["count"]) for op, row in by_op.items()}

    def predict_total(self, by_op: Mapping[str, Mapping[str, float]]) -> float:
        return sum(self.predict(by_op).values())

    @classmethod
    def from_benchmark(cls, result: dict, implementation: str = "deepspeed.comm",
                       ops: Sequence[str] | None = None) -> "CommModel":
        """Fit every collective ``implementation`` was measured with in a :mod:`helpers.topics.bandwidth` summary."""


        fits = {}
        for op in ops or COLLECTIVES:
            points = rows(result, implementation, op)
            if len({p["wire_bytes"] for p in points}) >= 2:
                fits[op] = fit([p["wire_bytes"] for p in points], [p["seconds"] for p in points])
        if not fits:
            raise ValueError(f"no collective measured at two sizes with {implementation}")
        where = f"{result['world_size']} x {result['device_name']}" + (" in network namespaces (see 'A real slow link')"
                                                                       if result.get("namespace") else "")
        selection = f"; {result['selection']}" if result.get("selection") else ""
        return cls(fits, result["world_size"], f"{implementation} benchmark, {where}{selection}")

    @classmethod
    def for_link(cls, bandwidth: float, alpha: float, world_size: int, name: str = "") -> "CommModel":
        """Every collective on a link of ``bandwidth`` bytes/s per direction and ``alpha`` seconds per call."""
        fits = {op: AlphaBeta(alpha, 1.0 / bandwidth) for op in COLLECTIVES}
        return cls(fits, world_size, name or f"{bandwidth / 1e9:.3g} GB/s link, alpha {alpha * 1e6:.0f} us")


def fit_table(model: CommModel, result: dict | None = None, implementation: str = "deepspeed.comm") -> str:
    """alpha, 1/beta and the half-bandwidth message of each fitted collective, with the fit's worst relative
    error over the benchmark's points when ``result`` is given."""


    table = []
    for op, ab in model.fits.items():
        row = [op, f"{ab.alpha * 1e6:,.1f}", f"{ab.bandwidth / 1e9:.3g}", records.format_bytes(ab.half_bandwidth_bytes)]
        if result is not None:
            points = rows(result, implementation, op)
            errors = relative_errors(ab, [p["wire_bytes"] for p in points], [p["seconds"] for p in points])
            row.append(f"{max(abs(e) for e in errors):.0%}")
        table.append(row)
    headers = ["collective", "alpha us", "1/beta GB/s", "alpha/beta (wire bytes w)"] + (["worst fit error"] if result else [])
    return records.format_table(table, headers)


def worst_errors(model: CommModel, result: dict, implementation: str = "deepspeed.comm") -> dict[str, float]:
    """op -> the fit's largest relative error over the benchmark's points of that collective."""
    found = {}
    for op, ab in model.fits.items():
        points = rows(result, implementation, op)
        found[op] = max(abs(e) for e in relative_errors(ab, [p["wire_bytes"] for p in points],
                                                          [p["seconds"] for p in points]))
    return found


def worst_points(model: CommModel, result: dict, implementation: str = "deepspeed.comm") -> str:
    """Per collective, the benchmark point farthest from its fitted line: its size, its timed calls and their
    median against the line's time, so an outlier behind a large fit error is named."""
    lines = []
    for op, ab in model.fits.items():
        points = rows(result, implementation, op)
        errors = relative_errors(ab, [p["wire_bytes"] for p in points], [p["seconds"] for p in points])
        worst, error = max(zip(points, errors), key=lambda pe: abs(pe[1]))
        calls = ", ".join(f"{t * 1e6:,.0f}" for t in worst.get("times", []))
        lines.append(f"{op}: worst at {records.format_bytes(worst['bytes'])}, median {worst['seconds'] * 1e6:,.0f} us "
                     f"(calls: {calls} us) against the line's {ab.seconds(worst['wire_bytes']) * 1e6:,.0f} us "
                     f"({abs(error):.0%} off)")
    return "\n".join(lines)


#: Worst relative error above which the chapter calls a fit poor: the points scatter beyond the line's shape.
POOR_FIT = 0.5


def _fit_figures(model: CommModel, result: dict, implementation: str = "deepspeed.comm") -> tuple[str, float]:
    """The median and worst relative error of a fit over the benchmark's points, with the point behind the worst
    (words), and the worst error."""
    errors: list[tuple[float, str, dict]] = []
    for op, ab in model.fits.items():
        points = rows(result, implementation, op)
        errors += [(abs(e), op, p) for e, p in zip(relative_errors(ab, [p["wire_bytes"] for p in points],
                                                                   [p["seconds"] for p in points]), points)]
    worst, op, where = max(errors, key=lambda e: e[0])
    median = statistics.median(e for e, _, _ in errors)
    return (f"median fit error {median:.0%} over {len(errors)} points, worst {worst:.0%} "
            f"({op}, {records.format_bytes(where['bytes'])})"), worst


def fit_reading(model: CommModel, result: dict, implementation: str = "deepspeed.comm") -> str:
    """The figures of a fit read in one sentence, without a timing verdict: the median and worst relative error
    over the points, the point behind the worst, and whether the lines follow the points (worst error within
    :data:`POOR_FIT`) or scatter far from them."""
    figures, worst = _fit_figures(model, result, implementation)
    return figures + (": the lines follow the points within that error; small messages cost about alpha, large "
                      "ones their bytes over the bandwidth." if worst <= POOR_FIT else
                      ": the points scatter far from the lines.")


def _reference_benchmark(name: str) -> tuple[str, str, dict, CommModel] | str:
    """The first committed GPU reference of ``name``: (device, date, its collectives benchmark, the model fitted
    on it), or the sentence saying none is committed."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    device, date, _, runs = found[0]
    return device, date, runs["collectives"], CommModel.from_benchmark(runs["collectives"])


def reference_fit_reading(name: str = "bandwidth-nvlink") -> str:
    """:func:`fit_reading` of the committed GPU reference, labelled with its device, date and conditions."""
    found = _reference_benchmark(name)
    if isinstance(found, str):
        return found
    device, date, result, model = found
    return f"GPU reference ({device}, {date}, NCCL; not this run): " + fit_reading(model, result)


def fit_summary(model: CommModel, result: dict, load: load_guard.Load | None = None) -> str:
    """This run's fit through the load guard: its figures always (:func:`fit_reading`'s errors); their comment
    only where the launch's ``load`` shows the run had its devices to itself, else why it is withheld: other
    programs can slow any single call, so a busy machine's scatter says nothing about the model."""
    figures = fit_reading(model, result)
    if load is None or load.samples == 0 or not load.alone:
        why = load.reason() if load is not None and load.samples else "nothing recorded what else used the devices"
        return (f"This run ({model.source}): {_fit_figures(model, result)[0]}. Comment withheld: {why}; on a busy "
                "machine even the calls kept can be slowed by other programs, so the model is judged on the GPU "
                "reference above.")
    return f"This run ({model.source}), alone on its devices: {figures}"


def degenerate_fits(model: CommModel, result: dict, rate: float | None = None,
                    implementation: str = "deepspeed.comm") -> str:
    """Why a fit clamped a term to 0, from the benchmark's figures: alpha = 0 where even the smallest message is
    already as costly per byte as the large ones (its bytes over the set ``rate``, or the fitted bandwidth,
    account for nearly all its time: no intercept left to see); beta = 0 where the times do not rise with the
    size. One line per such collective, or one saying there is none."""
    lines = []
    for op, ab in model.fits.items():
        points = sorted(rows(result, implementation, op), key=lambda p: p["bytes"])
        first, last = points[0], points[-1]
        if ab.alpha == 0:
            bandwidth_ = rate or ab.bandwidth
            share = first["wire_bytes"] / bandwidth_ / first["seconds"]
            lines.append(f"{op}: alpha = 0 is the fit's floor, not a measured latency: its smallest message "
                         f"({records.format_bytes(first['bytes'])}) took {first['seconds'] * 1e3:.2f} ms and its bytes at "
                         f"the {'set rate' if rate else 'fitted bandwidth'} alone account for {share:.0%} of that, so "
                         "the smallest size measured is already bandwidth-bound and these sizes cannot show alpha.")
        elif ab.beta == 0:
            lines.append(f"{op}: beta = 0 is the fit's floor: its calls did not take longer as the message grew "
                         f"({records.format_bytes(first['bytes'])}: {first['seconds'] * 1e3:.2f} ms, "
                         f"{records.format_bytes(last['bytes'])}: {last['seconds'] * 1e3:.2f} ms), so these sizes "
                         "cannot show the bandwidth.")
    return "\n".join(lines) or "Every fit has alpha > 0 and beta > 0: both terms were seen in the points."


#: How close (relative) a fitted 1/beta must come to a link's set rate for the chapter to say it recovers it.
RATE_MATCH = 0.1


def rate_match(model: CommModel, rate: float) -> str:
    """A generated sentence setting each fitted 1/beta beside a link's set rate (bytes/s per direction)."""
    ratios = {op: ab.bandwidth / rate for op, ab in model.fits.items()}
    fitted = ", ".join(f"{op} {model.fits[op].bandwidth / 1e6:.1f} MB/s ({r - 1:+.1%})" for op, r in ratios.items())
    off = [f"{op} ({r - 1:+.1%})" for op, r in ratios.items() if abs(r - 1) > RATE_MATCH]
    return (f"Set rate {rate * 8 / 1e6:g} Mbit/s = {rate / 1e6:.1f} MB/s per direction; fitted 1/beta, and how far "
            f"from the set rate: {fitted}. " +
            (f"Every fit is within {RATE_MATCH:.0%} of the set rate: the fit recovers it." if not off else
             f"More than {RATE_MATCH:.0%} away: {', '.join(off)}" +
             ("; the others recover the set rate." if len(off) < len(ratios) else ".")))


def slow_alpha_note(slow: CommModel, fast: CommModel, result: dict, rate: float,
                    implementation: str = "deepspeed.comm") -> str:
    """Why a slow link's fitted alpha differs from the fast link's, from the slow benchmark's figures: per
    collective, both alphas and the smallest point's timed calls beside the time its bytes take at ``rate``."""
    lines = []
    for op, ab in slow.fits.items():
        points = sorted(rows(result, implementation, op), key=lambda p: p["bytes"])
        first = points[0]
        calls = ", ".join(f"{t * 1e3:.2f}" for t in first.get("times", []))
        lines.append(f"{op}: alpha {fast.fits[op].alpha * 1e6:,.0f} us on the fast link, {ab.alpha * 1e6:,.0f} us "
                     f"here; its smallest message ({records.format_bytes(first['bytes'])}) took {calls} ms, of which "
                     f"its bytes at the set rate account for {first['wire_bytes'] / rate * 1e3:.2f} ms")
    sizes = sorted({p["bytes"] for p in rows(result, implementation)})
    lines.append(f"alpha is the line's intercept, fitted on {len(sizes)} sizes of {result['iters']} calls each: "
                 "whatever the small calls spent beyond their bytes goes into it.")
    return "\n".join(lines)


def _largest_point_rate(result: dict, op: str, implementation: str = "deepspeed.comm") -> tuple[dict, float]:
    """A collective's largest benchmarked message and the bandwidth it got alone: wire bytes over median time."""
    largest = max(rows(result, implementation, op), key=lambda p: p["bytes"])
    return largest, largest["wire_bytes"] / largest["seconds"]


def slow_fit_reading(slow: CommModel, fast: CommModel, result: dict, rate: float,
                     implementation: str = "deepspeed.comm") -> str:
    """What to take from a slow link's fits, in lines generated from them: per collective its alpha beside the
    fast link's and its largest message read alone (wire bytes over median time: the bandwidth that call got),
    then which reading of the link's bandwidth (``rate``, bytes/s per direction) the figures support."""
    lines, kinds = [], {"recovered": [], "traded": [], "below": [], "above": []}
    for op, ab in slow.fits.items():
        largest, got = _largest_point_rate(result, op, implementation)
        lines.append(f"{op}: alpha {ab.alpha * 1e6:,.0f} us (fast link: {fast.fits[op].alpha * 1e6:,.0f} us); its "
                     f"largest message alone: {largest['wire_bytes']:,.0f} wire bytes in {largest['seconds'] * 1e3:.1f} "
                     f"ms = {got / 1e6:.1f} MB/s ({got / rate - 1:+.0%} off the set rate)")
        if abs(ab.bandwidth / rate - 1) <= RATE_MATCH:
            kinds["recovered"].append(op)
        elif abs(got / rate - 1) <= RATE_MATCH:
            kinds["traded"].append(op)
        else:
            kinds["below" if got < rate else "above"].append(op)
    said = {"recovered": "{}'s fitted 1/beta matches the set rate: gloo's bytes cross the cable at tc's rate.",
            "traded": "{}'s fitted line strays from the set rate, but its largest message comes within "
                      f"{RATE_MATCH:.0%} of it: read a link's bandwidth from its largest messages.",
            "below": "{} stayed below the set rate even at its largest message: the rate is a ceiling, not a promise.",
            "above": "{} beat the set rate at its largest message, which the cable should not allow: the last "
                     "section lists each call."}
    take = "So: " + " ".join(said[kind].format(" and ".join(ops)) for kind, ops in kinds.items() if ops)
    return "\n".join(lines + [take])


#: Wire bytes per logged byte on n ranks (the ring; nccl-tests' bus-bandwidth factors), as the worked row writes them.
WIRE_FACTORS = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)", "reduce_scatter": "(n-1)/n", "broadcast": "1"}


def worked_row(record: records.Record, model: CommModel, where: str = "this run") -> str:
    """One run's predicted collective time per step written out from its logged bytes: per op, calls x alpha
    plus beta x w, w = the op's wire factor x the logged bytes (all_gather logs one rank's shard, all_reduce and
    reduce_scatter the whole tensor), then the total that :func:`comparison_rows` predicts."""
    n, terms, total = model.world_size, [], 0.0
    for op, row in sorted(record.comm_ops().items()):
        ab, factor = model.fit_for(op), theory.wire_bytes(op, 1.0, n)
        w = theory.wire_bytes(op, row["bytes"], n)
        seconds = ab.seconds(w, row["count"])
        total += seconds
        terms.append(f"  {op}: {row['count']:g} call(s), {row['bytes']:,.0f} logged bytes in all; "
                     f"w = {WIRE_FACTORS[collective_of(op)]} x {row['bytes']:,.0f} = {factor:g} x "
                     f"{row['bytes']:,.0f} = {w:,.0f} bytes; {row['count']:g} x {ab.alpha * 1e6:,.1f} us + "
                     f"{w:,.0f} B / {ab.bandwidth / 1e9:.3g} GB/s = {seconds * 1e3:.3f} ms")
    if not math.isclose(total, model.predict_total(record.comm_ops()), rel_tol=1e-9):
        raise ValueError("the worked terms do not add up to the model's prediction")
    return (f"{record.summary['name']} ({where}, {n} ranks), one optimizer step:\n" + "\n".join(terms) +
            f"\n  predicted collectives: {total * 1e3:.3f} ms")


def reference_worked_row(run: str = "zero0-acc4", name: str = "bandwidth-nvlink") -> str:
    """:func:`worked_row` for one run of the committed GPU reference, with the model fitted there."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    device, date, _, runs = found[0]
    record = runs[run]
    return worked_row(record, CommModel.from_benchmark(runs["collectives"]),
                      f"{device}, {date}, {record.model_name} {record.precision}; not this run")


def reference_what_if_table(name: str = "bandwidth-nvlink") -> str:
    """The committed GPU reference's what-if table (:func:`what_if_table`, alpha as fitted there for
    all_reduce), labelled with its device and date."""
    found = _reference_what_if_rows(name)
    if isinstance(found, str):
        return found
    device, date, rows = found
    return (f"GPU reference ({device}, {date}; not this run), its measured computation and fitted model:\n"
            + what_if_table(rows))


def _reference_what_if_rows(name: str) -> tuple[str, str, list[dict]] | str:
    """(device, date, :func:`what_if` rows) of the newest committed GPU reference ``name``, alpha as fitted there
    for all_reduce, accumulation 1 and 4 for each stage that ran with accumulation; or why there is none."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    device, date, _, runs = found[0]
    model = CommModel.from_benchmark(runs["collectives"])
    accum = [r for r in logged_runs(runs).values() if r["grad_accum"] >= 2]
    profiles = [extrapolate(r, a) for r in sorted(accum, key=lambda r: r.stage) for a in (1, 4)]
    return device, date, what_if(profiles, model.fits["all_reduce"].alpha)


def reference_fit(name: str = "bandwidth-nvlink") -> str:
    """The committed GPU reference's alpha-beta fit table (:func:`fit_table`), labelled with its device and
    date, to set beside this machine's fit."""
    found = _reference_benchmark(name)
    if isinstance(found, str):
        return found
    device, date, result, model = found
    return f"GPU reference, measured on {device}, {date} (NCCL; not this run):\n" + fit_table(model, result)


def byte_sum(record: records.Record) -> str:
    """A run's logged bytes per optimizer step as a sum over its DeepSpeed functions (calls x bytes per call),
    checked against the record's own total."""
    terms, total = [], 0.0
    for op, callers in sorted(record.section("comm").get("by_caller", {}).items()):
        for caller, row in sorted(callers.items()):
            if row["count"]:
                terms.append(f"{row['count']:g} x {row['bytes'] / row['count']:,.0f} ({op}, {caller or '-'})")
                total += row["bytes"]
    if not math.isclose(total, record.comm.bytes_per_step, rel_tol=1e-9):
        raise ValueError(f"the callers' bytes ({total:,.0f}) differ from the record's total "
                         f"({record.comm.bytes_per_step:,.0f})")
    return " + ".join(terms) + f" = {total:,.0f} bytes per step"


def shard_note(logged: Mapping[str, Mapping[str, Mapping[str, float]]], world_size: int) -> str:
    """Why a ZeRO-3 run's logged all_gather bytes are 1/n of its reduce_scatter's, from what
    ``deepspeed.comm.log_summary()`` returned (``{name: {size: {"count": ...}}}``): for all_gather the logger
    records one rank's shard (the tensor it sends), for the other collectives the whole tensor. Empty where the
    summary lacks either collective."""
    sizes: dict[str, list[tuple[int, float]]] = {}
    for name, by_size in logged.items():
        for op in ("all_gather", "reduce_scatter"):
            if name.startswith(op):
                sizes.setdefault(op, []).extend((int(size), row["count"]) for size, row in by_size.items())
    if len(sizes) < 2:
        return ""
    gathered, scattered = sizes["all_gather"], sizes["reduce_scatter"]
    if len(gathered) == len(scattered) == 1:
        a, b, what = gathered[0][0], scattered[0][0], "bytes per call"
    else:
        a, b = (int(sum(size * count for size, count in calls)) for calls in (gathered, scattered))
        what = "logged bytes in all"
    share = f"1/{world_size} of" if a * world_size == b else f"{a / b:.2f}x"
    return (f"all_gather's {a:,} {what} are {share} reduce_scatter's {b:,}: for all_gather the logger records one "
            f"rank's shard (the tensor it sends, {world_size} ranks), for the other collectives the whole tensor.")


def comms_logger_fields() -> str:
    """The fields of DeepSpeed's ``comms_logger`` config block and their defaults, read from DeepSpeed's own
    config model (what ``enabled`` does is exercise 3's question: :func:`comms_logger_switch`)."""
    CommsLoggerConfig = ds.load("deepspeed.comm.config").CommsLoggerConfig

    table = [[field, repr(info.default)] for field, info in CommsLoggerConfig.model_fields.items()]
    return records.format_table(table, ["comms_logger field", "default"])


def comms_logger_switch() -> str:
    """The line of DeepSpeed's ``DeepSpeedCommsConfig`` that decides whether the comms logger is on, read from
    DeepSpeed's installed source."""
    DeepSpeedCommsConfig = ds.load("deepspeed.comm.config").DeepSpeedCommsConfig
    for line in inspect.getsource(DeepSpeedCommsConfig.__init__).splitlines():
        if "comms_logger_enabled =" in line:
            return line.strip()
    raise LookupError("DeepSpeedCommsConfig.__init__ no longer sets comms_logger_enabled: read deepspeed/comm/config.py")


def _calls_by_caller(record: records.Record) -> dict[str, float]:
    """DeepSpeed function -> calls per optimizer step of a run (the comms logger's ``debug`` mode)."""
    found: dict[str, float] = {}
    for callers in record.section("comm").get("by_caller", {}).values():
        for caller, row in callers.items():
            found[caller or "-"] = found.get(caller or "-", 0) + row["count"]
    return found


def call_differences(runs: Mapping[str, records.Record], reference: str = "bandwidth-nvlink") -> str:
    """Per training run: collective calls per optimizer step in this launch and in the committed GPU
    ``reference``'s run of the same name, and the DeepSpeed functions (the comms logger's ``debug`` mode) whose
    calls per step differ, written ``function here -> there``."""
    found = references.reference_runs(reference)
    if not found:
        return references.no_references(reference, "run this notebook on a GPU machine to measure them.")
    device, date, _, ref_runs = found[0]
    table, precisions = [], set()
    for name, r in runs.items():
        other = ref_runs.get(name)
        if not isinstance(other, records.Record):
            continue
        here, there = _calls_by_caller(r), _calls_by_caller(other)
        differ = [f"{f} {here.get(f, 0):g} -> {there.get(f, 0):g}" for f in sorted(set(here) | set(there))
                  if here.get(f, 0) != there.get(f, 0)]
        table.append([name, f"{sum(here.values()):g}", f"{sum(there.values()):g}", ", ".join(differ) or "none"])
        precisions.add((r.precision, other.precision))
    said = "; ".join(f"{mine} here, {theirs} there" for mine, theirs in sorted(precisions))
    return (f"This run against the GPU reference ({device}, {date}; {said}):\n"
            + records.format_table(table, ["run", "calls/step here", "on the reference",
                                           "DeepSpeed functions that differ (here -> reference)"]))


def run_configs(runs: Mapping[str, records.Record]) -> str:
    """The DeepSpeed config settings of each training run that decide its collectives: ZeRO stage,
    overlap_comm (where unset, DeepSpeed's default: on at stage 3 only), accumulation and micro batch."""
    table = []
    for name, r in runs.items():
        zero = r.config.get("zero_optimization", {})
        stage = zero.get("stage", 0)
        overlap = zero["overlap_comm"] if "overlap_comm" in zero else f"{stage == 3} (default)"
        table.append([name, f"{stage}", f"{overlap}", f"{r.config.get('gradient_accumulation_steps', 1)}",
                      f"{r.config.get('train_micro_batch_size_per_gpu', '')}"])
    return records.format_table(table, ["run", "zero_optimization.stage", "overlap_comm",
                                        "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"])


# --- a training step, split into computation and communication ---------------------------------

@dataclasses.dataclass
class StepProfile:
    """One optimizer step: collectives (op -> count, logged bytes) and the seconds spent outside them."""

    name: str
    stage: int
    accum: int
    micro_batch: int
    world_size: int
    compute_s: float  # measured step time minus measured collective time
    by_op: dict[str, dict[str, float]]
    measured_step_s: float | None = None
    measured_comm_s: float | None = None

    @property
    def samples(self) -> int:
        return self.micro_batch * self.accum * self.world_size


def _phase_ops(record: records.Record, phase: str) -> dict[str, dict[str, float]]:
    return {op: {"count": row["count"], "bytes": row["bytes"]}
            for op, row in record["micro_steps"]["by_phase"].get(phase, {}).items()}


def _phase_comm(record: records.Record, phase: str) -> float:
    return sum(row["seconds"] for row in record["micro_steps"]["by_phase"].get(phase, {}).values())


def _add(total: dict, ops: Mapping[str, Mapping[str, float]], times: float = 1.0) -> dict:
    for op, row in ops.items():
        target = total.setdefault(op, {"count": 0.0, "bytes": 0.0})
        target["count"] += row["count"] * times
        target["bytes"] += row["bytes"] * times
    return total


def profile(record: records.Record) -> StepProfile:
    """A measured run (probes ``timing`` and ``micro_steps``) as computation + collectives of one step.

    Computation is the sum over phases of wall time minus collective time (rank 0), so the two add up
    to the step as the probe timed it."""
    s = record.summary
    ms = record["micro_steps"]
    by_op: dict = {}
    for phase in ms["phases"]:
        _add(by_op, _phase_ops(record, phase))
    comm = sum(_phase_comm(record, p) for p in ms["phases"])
    compute = sum(ms["wall_s_by_phase"].values()) - comm
    return StepProfile(s["name"], s["zero_stage"], s["grad_accum"], s["micro_batch"], s["world_size"],
                       max(compute, 0.0), by_op, sum(ms["wall_s_by_phase"].values()), comm)


def extrapolate(record: records.Record, accum: int) -> StepProfile:
    """The step of ``record``'s configuration at another accumulation ``accum``, same micro batch (so the
    global batch grows with it), built from its measured phases: the first micro-step stands for every
    micro-step off the accumulation boundary, the last for the one on it, the optimizer step as it was.
    Needs a run with accumulation 2 or more (one micro-step off the boundary)."""
    ms = record["micro_steps"]
    if record["grad_accum"] < 2:
        raise ValueError(f"{record.summary['name']}: accumulation {record['grad_accum']} has no micro-step off "
                         "the boundary to extrapolate from; measure with accumulation 2 or more")
    if not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum={accum!r}: a whole number of micro-steps, 1 or more")
    off, last, step = "micro-step 1", ms["phases"][-2], ms["phases"][-1]
    wall = ms["wall_s_by_phase"]
    by_op = _add(_add(_add({}, _phase_ops(record, off), accum - 1), _phase_ops(record, last)), _phase_ops(record, step))
    compute = ((accum - 1) * (wall[off] - _phase_comm(record, off)) + wall[last] - _phase_comm(record, last)
               + wall[step] - _phase_comm(record, step))
    s = record.summary
    return StepProfile(f"{s['name']} at accumulation {accum}", s["zero_stage"], accum, s["micro_batch"],
                       s["world_size"], max(compute, 0.0), by_op)


def predict_step(profile_: StepProfile, model: CommModel, overlap: bool = False) -> dict[str, float]:
    """Predicted ``comm_s``, ``step_s`` (computation + communication, or the larger of the two when the
    communication ``overlap``\\ s computation perfectly), ``comm_share`` and ``samples_per_s``."""
    comm = model.predict_total(profile_.by_op)
    step = max(profile_.compute_s, comm) if overlap else profile_.compute_s + comm
    return {"comm_s": comm, "step_s": step, "comm_share": comm / (profile_.compute_s + comm),
            "samples_per_s": profile_.samples / step}


def what_if(profiles: Sequence[StepProfile], alpha: float, links: Mapping[str, float] = LINKS,
            alphas: Mapping[str, float] | None = None) -> list[dict]:
    """For every profile and link (bytes/s per direction): the predicted step on that link, serial; each call
    costs ``alphas[link]`` where given, else ``alpha``."""
    found = []
    for p in profiles:
        for link, bandwidth in links.items():
            link_alpha = (alphas or {}).get(link, alpha)
            model = CommModel.for_link(bandwidth, link_alpha, p.world_size, link)
            found.append({"profile": p, "link": link, "bandwidth": bandwidth, "alpha": link_alpha,
                          **predict_step(p, model)})
    return found


def what_if_alphas(rows: Sequence[dict]) -> str:
    """Which alpha each link of a what-if (:func:`what_if`) was given: a generated line."""
    by_alpha: dict[float, list[str]] = {}
    for r in rows:
        if r["link"] not in by_alpha.setdefault(r["alpha"], []):
            by_alpha[r["alpha"]].append(r["link"])
    return "alpha per call: " + "; ".join(f"{a * 1e6:,.1f} us for {', '.join(links)}" for a, links in by_alpha.items())


def what_if_table(rows: Sequence[dict]) -> str:
    """Step time (ms), communication share and samples/s per stage, accumulation and link."""
    links = list(dict.fromkeys(r["link"] for r in rows))
    profiles = list(dict.fromkeys(id(r["profile"]) for r in rows))
    by = {(id(r["profile"]), r["link"]): r for r in rows}
    table = []
    for pid in profiles:
        p = next(r["profile"] for r in rows if id(r["profile"]) == pid)
        cells = [f"ZeRO-{p.stage}", f"{p.accum}", f"{p.samples}"]
        for link in links:
            r = by[(pid, link)]
            cells.append(f"{r['step_s'] * 1e3:,.1f} ms ({r['comm_share']:.0%})")
        table.append(cells)
    return records.format_table(table, ["stage", "accum", "batch"] + [f"{link}: step (comm)" for link in links])


def what_if_sources(rows: Sequence[dict], runs: Mapping[str, records.Record]) -> str:
    """How the computation a what-if (:func:`what_if`) keeps relates to the step times the runs measured: per
    profile, that computation, and for the run measured at the same stage and accumulation (where one ran) its
    step as the ``timing`` probe gives it (median of every step, the warm-up included) and as the ``micro_steps``
    probe splits it (computation + collectives, mean of the steps after the first); then one generated line."""
    profiles = list({id(r["profile"]): r["profile"] for r in rows}.values())
    measured = {(r.stage, r["grad_accum"]): r for r in runs.values() if "micro_steps" in r.probes}
    table, gaps, kept = [], [], []
    for p in profiles:
        cells = [f"ZeRO-{p.stage}", f"{p.accum}", f"{p.compute_s * 1e3:,.1f}"]
        run = measured.get((p.stage, p.accum))
        if run is None:
            cells += ["-", "-", "-"]
        else:
            split = profile(run)
            cells += [run.summary["name"], f"{run.timing.median_s * 1e3:,.1f}",
                      f"{split.compute_s * 1e3:,.1f} + {split.measured_comm_s * 1e3:,.1f} = "
                      f"{split.measured_step_s * 1e3:,.1f}"]
            gaps.append(run.timing.median_s / split.measured_step_s - 1)
            kept.append(p.compute_s / split.compute_s - 1)
        table.append(cells)
    text = records.format_table(table, ["stage", "accum", "what-if computation ms", "measured run",
                                        "step ms (timing)", "computation + collectives ms (micro_steps)"])
    steps = sorted({len(r.timing.all_s) for r in runs.values()})
    line = ("The what-if keeps the computation and replaces the collectives with a link's; at accumulation 1 it "
            "takes the accumulation-4 run's last micro-step and optimizer step.")
    if gaps:
        line += (f" Its computation is {_change(min(kept))} to {_change(max(kept))} off the measured runs' (micro_steps). The "
                 f"two probes time different steps (timing: the median of all {'/'.join(map(str, steps))}, the warm-up "
                 f"included; micro_steps: the mean after the first): the timing step is {_change(min(gaps))} to "
                 f"{_change(max(gaps))} off the micro_steps sum.")
    return text + "\n" + line


def comparison_rows(runs: Mapping[str, records.Record], model: CommModel) -> list[dict]:
    """Per run: collectives per step, measured collective seconds (``micro_steps``) and the model's prediction
    from the bytes the comms logger recorded (``comm.by_op``)."""
    found = []
    for name, r in runs.items():
        section = r.section("micro_steps")
        measured = section["comm_s_per_step"]
        predicted = model.predict_total(r.comm_ops())
        found.append({"name": name, "stage": r.stage, "accum": r["grad_accum"],
                      "calls": sum(row["count"] for row in r.comm_ops().values()),
                      "bytes": r.comm.bytes_per_step, "measured_s": measured, "predicted_s": predicted,
                      "measured_each_s": list(section.get("comm_s_each_step") or [measured]),
                      "error": (predicted - measured) / measured if measured else math.nan})
    return found


def comparison_table(rows: Sequence[dict]) -> str:
    """Measured against predicted communication seconds per step, with the relative error (figures only: the
    verdict on them is :func:`model_verdict_summary`'s)."""
    table = [[r["name"], f"{r['calls']:g}", f"{r['bytes']:,.0f}", f"{r['measured_s'] * 1e3:.2f}",
              f"{r['predicted_s'] * 1e3:.2f}", f"{r['error']:+.0%}"] for r in rows]
    return records.format_table(table, ["run", "calls/step", "logged bytes/step", "measured comm ms",
                                        "predicted comm ms", "error"])


def model_verdicts(rows: Sequence[dict], load: load_guard.Load | None) -> list[load_guard.Verdict]:
    """The load guard's verdict on the model's error for each row of :func:`comparison_rows`: the measured
    collective seconds of each step against the prediction, under the launch's recorded ``load``."""
    return [load_guard.compare({"measured": r["measured_each_s"], "predicted": [r["predicted_s"]]}, load)
            for r in rows]


def model_verdict_summary(rows: Sequence[dict], load: load_guard.Load | None) -> str:
    """Sentences on the model's error in this run, through the load guard: withheld with the reason where the
    run did not have its devices to itself, else per run the error where it exceeds the spread of the
    measured steps, or why it is withheld."""
    verdicts = model_verdicts(rows, load)
    shared = load is None or load.samples == 0 or not load.alone
    if shared:
        return f"Verdict on the model's error withheld: {verdicts[0].withheld}.\n{plain_reading(rows)}"
    lines = []
    for r, v in zip(rows, verdicts):
        lines.append(f"{r['name']}: " + (f"the model predicted {v.change[1]:+.0%} against the measured time, beyond "
                                         f"the spread of its {len(r['measured_each_s'])} measured steps "
                                         f"({v.spread:.0%})." if v.given else f"withheld: {v.withheld}."))
    given = [v for v in verdicts if v.given]
    lines.append(f"The model's error exceeded the steps' spread in {len(given)} of {len(rows)} runs"
                 + (f"; it predicted less than measured in {sum(v.change[1] < 0 for v in given)} of them."
                    if given else "."))
    return "\n".join(lines)


def model_reading(rows: Sequence[dict], load: load_guard.Load | None, reference: str = "bandwidth-nvlink") -> str:
    """:func:`model_verdict_summary`, then what to take from it in one generated line: where the load guard gave
    no verdict, this run cannot tell the model's error from the load's, and the committed GPU ``reference``'s
    errors (its range) are the model's test."""
    verdicts = model_verdicts(rows, load)
    given = sum(v.given for v in verdicts)
    found = references.reference_runs(reference)
    errors = []
    if found:
        _, _, _, ref_runs = found[0]
        errors = [r["error"] for r in comparison_rows(logged_runs(ref_runs), CommModel.from_benchmark(ref_runs["collectives"]))]
    there = (f"on the GPU reference its error ran from {min(errors):+.0%} to {max(errors):+.0%} (table above)"
             if errors else "the GPU reference is the model's test")
    take = (f"So: with no verdict given, this run cannot tell the model's error from the load's; {there}." if not given
            else f"So: the model's error exceeded the steps' spread in {given} of {len(rows)} runs here; {there}.")
    return f"{model_verdict_summary(rows, load)}\n{take}"


def plain_reading(rows: Sequence[dict]) -> str:
    """The figures of :func:`comparison_rows` read without a verdict: the range of measured over predicted."""
    ratios = [r["measured_s"] / r["predicted_s"] for r in rows if r["predicted_s"]]
    if not ratios:
        return "No prediction to read."
    return (f"The figures, without a verdict: the measured collective time is {min(ratios):.1f}x to "
            f"{max(ratios):.1f}x the prediction over the {len(ratios)} runs; above the prediction in "
            f"{sum(x > 1 for x in ratios)} of them.")


def what_if_summary(rows: Sequence[dict]) -> str:
    """The largest share of communication in a what-if (:func:`what_if`), and where: a generated sentence."""
    top = max(rows, key=lambda r: r["comm_share"])
    p = top["profile"]
    return (f"Largest predicted share of communication: {top['comm_share']:.0%} (ZeRO-{p.stage}, accumulation "
            f"{p.accum}, {top['link']}).")


def accumulation_share_reading(rows: Sequence[dict]) -> str:
    """A what-if (:func:`what_if`) read at its slowest link: how accumulation 4 against 1 changes the share of the
    step that ZeRO-1 and ZeRO-2 spend communicating, with each one's collective calls per optimizer step (ZeRO-2
    all-reduces the gradients in every micro-step, ZeRO-1 once per step); a generated sentence."""
    if not rows:
        return ""
    slowest = min(rows, key=lambda r: r["bandwidth"])["link"]
    at = {(r["profile"].stage, r["profile"].accum): r for r in rows if r["link"] == slowest}
    if not all((stage, accum) in at for stage in (1, 2) for accum in (1, 4)):
        return ""
    share = {key: r["comm_share"] for key, r in at.items()}
    calls = {key: sum(row["count"] for row in r["profile"].by_op.values()) for key, r in at.items()}
    drop1, drop2 = share[(1, 1)] - share[(1, 4)], share[(2, 1)] - share[(2, 4)]
    ones = f"{calls[(1, 4)]:g} either way" if calls[(1, 1)] == calls[(1, 4)] else f"{calls[(1, 4)]:g} against {calls[(1, 1)]:g}"
    return (f"At {slowest}, accumulation 4 against 1 takes ZeRO-1's share of the step spent communicating from "
            f"{share[(1, 1)]:.0%} to {share[(1, 4)]:.0%}, and ZeRO-2's "
            f"{'up ' if drop2 < 0 else 'only ' if drop2 < drop1 else ''}from "
            f"{share[(2, 1)]:.0%} to {share[(2, 4)]:.0%}: collective calls per optimizer step, ZeRO-1 {ones}, "
            f"ZeRO-2 {calls[(2, 4)]:g} against {calls[(2, 1)]:g}, since it all-reduces the gradients in every "
            f"micro-step.")


def reference_what_if(name: str = "bandwidth-nvlink") -> str:
    """The committed GPU reference's what-if (:func:`what_if`, alpha as fitted there for all_reduce) read in
    sentences, labelled with its device and date: the run and link where communication takes the largest share
    of the step, and that run's share on the fastest link; then :func:`accumulation_share_reading`."""
    found = _reference_what_if_rows(name)
    if isinstance(found, str):
        return found
    device, date, rows = found
    top = max(rows, key=lambda r: r["comm_share"])
    same = [r for r in rows if r["profile"] is top["profile"]]
    fastest = max(same, key=lambda r: r["bandwidth"])
    p = top["profile"]
    return (f"GPU reference ({device}, {date}; not this run): ZeRO-{p.stage} at accumulation "
            f"{p.accum} spends {top['comm_share']:.0%} of its step communicating at {top['link']} and "
            f"{fastest['comm_share']:.0%} on {fastest['link']}.\n{accumulation_share_reading(rows)}").rstrip()


# --- chapter 09's runs: the model against measurements, on a fast and a slow link ----------------

#: The slow link of chapter 09 on CPU ranks, per rank and direction: slow enough that a 2 MB gradient
#: all-reduce (42 ms) outweighs the small model's computation, fast enough to keep the notebook short.
SLOW_RATE_MBIT = 400


def stage_specs(prefix: str = "", model: str = "mlp", precision: str = "fp32", micro_batch: int = 4, steps: int = 3,
                stages: Sequence[int] = (0, 1, 2, 3), extra: Sequence[tuple[int, int]] = ((1, 1), (2, 1)),
                overlap_stage: int | None = 2, accum: int = 4, task: str = "train") -> dict:
    """RunSpecs of one link's training runs (micro batch fixed): every stage at accumulation ``accum``, the
    ``extra`` (stage, accumulation) pairs, all with the ``comm`` and ``micro_steps`` probes; and
    ``overlap_stage`` at ``accum`` with ``overlap_comm`` off and on, timed without the comms logger (always by
    the course's own loop). ``task``: who trains the logged runs, ``"train"`` (the course's loop) or a
    rank-side ``"module:function"`` that attaches those probes itself (chapter 09's page module)."""

    logged = ("timing", "comm", "micro_steps")
    specs = {}
    for stage, a in [(s, accum) for s in stages] + list(extra):
        specs[f"{prefix}zero{stage}-acc{a}"] = launch.RunSpec(
            f"zero{stage}", model=model, steps=steps, probes=logged if task == "train" else (), task=task,
            overrides=accumulation.overrides(micro_batch, a, precision))
    if overlap_stage is not None:
        for flag in (False, True):
            o = accumulation.overrides(micro_batch, accum, precision)
            o["zero_optimization"] = {"overlap_comm": flag}
            specs[f"{prefix}zero{overlap_stage}-acc{accum}-overlap-{'on' if flag else 'off'}"] = launch.RunSpec(
                f"zero{overlap_stage}", model=model, steps=steps, probes=("timing",), overrides=o)
    return specs


SLOW = "slow-"  # name prefix of the runs on the slow link


def logged_runs(runs: Mapping[str, object], slow: bool = False) -> dict[str, records.Record]:
    """The training runs of a sweep that carry the ``micro_steps`` probe, on the fast link (or the slow one),
    by name (without the slow prefix)."""
    return {name.removeprefix(SLOW): r for name, r in runs.items() if name.startswith(SLOW) == slow
            and isinstance(r, records.Record) and "micro_steps" in r.probes}


def slow_link_plan(world_size: int, env=None, rate_mbit: float = SLOW_RATE_MBIT) -> tuple[bool, str]:
    """Whether chapter 09's launch can put its ranks behind a slow link here (:func:`link_support`, which builds
    and deletes a test namespace), and a sentence saying what the launch will build, or why it cannot."""
    env = env or environment.detect()
    if env.is_gpu:
        return False, "No slow link for GPU ranks: NCCL uses NVLink or PCIe here (the GPU section runs NCCL over sockets)."
    if world_size < 2:
        return False, "No slow link: one rank has no one to send to."
    ok, why = link_support()
    if not ok:
        return False, f"No slow link on this machine ({why}): the slow-link section will say so and skip."
    return True, (f"Slow link: possible here ({why}). The launch puts each of the {world_size} ranks in a network "
                  "namespace of its own, joined by virtual cables to a bridge, at the cables' own speed; halfway, "
                  f"each rank cuts its cable to {rate_mbit:g} Mbit/s per direction for the runs named '{SLOW}...'. "
                  "Everything is deleted when the launch ends.")


def with_config_changes(specs: Mapping[str, object], changes: Mapping[str, dict] | None) -> dict:
    """``specs`` with each ``changes[name]`` (DeepSpeed config settings) merged into the overrides of the training
    run ``name`` and of its slow-link twin; an unknown name raises, listing the runs."""
    found = dict(specs)
    for name, settings in (changes or {}).items():
        targets = [n for n in (name, f"{SLOW}{name}") if isinstance(found.get(n), launch.RunSpec)]
        if not targets:
            runs = ", ".join(n for n, s in found.items() if isinstance(s, launch.RunSpec) and not n.startswith(SLOW))
            raise KeyError(f"no training run {name!r} to change; the runs: {runs}")
        for n in targets:
            found[n] = dataclasses.replace(found[n], overrides=configs.merged(found[n].overrides or {}, settings))
    return found


def run_chapter(task: str | None = None, model: str = "mlp", precision: str = "fp32", micro_batch: int = 4,
                steps: int = 3, rate_mbit: float = SLOW_RATE_MBIT, slow_link: bool = True, env=None,
                timeout: float = 600, config_changes: Mapping[str, dict] | None = None,
                sizes: Sequence[int] | None = None, train_task: str = "train", progress: bool = True
                ) -> tuple[dict, str]:
    """Chapter 09's measurements in ONE launch: the collective benchmark (rank-side ``task``, default
    :data:`TASK`, on message ``sizes``, default :func:`default_sizes`) and the training runs of :func:`stage_specs`,
    trained by ``train_task`` (``overlap_comm`` off and on only on GPUs, where
    there are streams to overlap on); with ``slow_link`` where the machine allows it (:func:`slow_link_plan`),
    every rank in its own network namespace, then, after the link is cut to ``rate_mbit``, a smaller benchmark
    (``slow-collectives``) and the same runs of stages 1 and 2 named ``slow-...``. Returns {name: record or
    benchmark summary} and a sentence saying which links were used. ``config_changes`` maps a training run's name
    to DeepSpeed config settings merged into its config (:func:`with_config_changes`). The launch's own files go to
    ``runs/bandwidth-<model>/``; it is stopped after ``timeout`` seconds. ``progress``: show the runs' progress
    bars (:func:`helpers.core.launch.sweep`)."""

    env = env or environment.detect()
    world = env.default_world_size
    overlap = 2 if env.is_gpu else None
    # training never calls DeepSpeed's shared-memory kernel, which spin-waits on its peers; on a busy machine a
    # launch of this chapter hung in the benchmark's warm-up, so the chapter leaves the kernel out
    specs = {"collectives": spec(is_gpu=env.is_gpu, out=launch.RUNS_DIR / f"collectives-{model}", task=task,
                                 sizes=sizes, implementations=("deepspeed.comm", "torch.distributed"))}
    specs.update(stage_specs(model=model, precision=precision, micro_batch=micro_batch, steps=steps,
                             overlap_stage=overlap, task=train_task))
    ok, why = slow_link_plan(world, env, rate_mbit) if slow_link else (False, "No slow link: not asked for.")
    if not ok:
        specs = with_config_changes(specs, config_changes)
        runs = launch.sweep(specs, name=f"bandwidth-{model}", timeout=timeout, progress=progress)
        return runs, f"one link only (the ranks' loopback). {why}"
    specs[f"{SLOW}rate"] = set_rate_spec(f"{SLOW}rate", rate_mbit)
    specs[f"{SLOW}collectives"] = spec(f"{SLOW}collectives", sizes=(2**14, 2**18, 2**21),
                                       ops=("all_reduce", "all_gather"), implementations=("deepspeed.comm",),
                                       iters=3, warmup=1, is_gpu=False, task=task,
                                       out=launch.RUNS_DIR / f"{SLOW}collectives-{model}")
    specs.update(stage_specs(SLOW, model=model, precision=precision, micro_batch=micro_batch, steps=steps,
                             stages=(1, 2), overlap_stage=overlap, task=train_task))
    specs = with_config_changes(specs, config_changes)
    with rate_limited_link(world, None) as link:
        runs = launch.sweep(specs, name=f"bandwidth-{model}", timeout=timeout, rank_prefix=link.rank_prefix,
                            master_addr=link.master_addr, progress=progress)
    return runs, (f"{link.describe()}; then cut to {rate_mbit:g} Mbit/s per rank and direction for the "
                  f"'{SLOW}' runs")


def _after_warm_up(times: Sequence[float]) -> list[float]:
    """Step times without the first step (it warms up), where there are more."""
    return list(times[1:] if len(times) > 1 else times)


def slow_link_rows(fast: Mapping[str, object], slow: Mapping[str, object], link_model: CommModel,
                   nominal: CommModel | None = None, prefix: str = SLOW) -> list[dict]:
    """Per configuration run on both links: measured step time on each, and the slow link's step predicted from
    the fast run (its computation, measured) plus the slow link's communication (``link_model``, fitted on
    the slow link; ``nominal``: from the link's set rate alone). Timed-only runs (``overlap_comm`` off/on)
    borrow computation and collectives from the logged run of the same stage and accumulation; for them
    the prediction is a range, from no overlap to perfect overlap."""
    found = []
    for name, s_run in slow.items():
        if not name.startswith(prefix) or not isinstance(s_run, records.Record):
            continue
        key = name[len(prefix):]
        f_run = fast.get(key)
        if not isinstance(f_run, records.Record):
            continue
        timed_only = "micro_steps" not in s_run.probes
        base = f_run if not timed_only else fast.get(key.split("-overlap")[0])
        if not isinstance(base, records.Record) or "micro_steps" not in base.probes:
            continue
        p = profile(base)
        serial = predict_step(p, link_model)
        row = {"name": key, "stage": s_run.stage, "accum": s_run["grad_accum"], "batch": s_run["train_batch"],
               "fast_s": f_run.timing.median_s, "slow_s": s_run.timing.median_s,
               "fast_each_s": _after_warm_up(f_run.timing.all_s), "slow_each_s": _after_warm_up(s_run.timing.all_s),
               "predicted_s": serial["step_s"], "comm_s": serial["comm_s"], "compute_s": p.compute_s,
               "overlap_bound_s": predict_step(p, link_model, overlap=True)["step_s"] if timed_only else None,
               "nominal_s": predict_step(p, nominal)["step_s"] if nominal else None}
        found.append(row)
    return found


def slow_link_table(rows: Sequence[dict], fast: str = "fast link", slow: str = "slow link") -> str:
    """Measured step times on both links (named ``fast`` and ``slow``) beside the model's prediction for the slow
    one (ms), and samples/s. The set-rate column appears only where a row has a set rate (:func:`slow_link_rows`'
    ``nominal``); a line under the table explains any predicted range (the ``overlap_comm`` runs)."""
    with_rate = any(r["nominal_s"] is not None for r in rows)
    table = []
    for r in rows:
        predicted = f"{r['predicted_s'] * 1e3:,.0f}"
        if r["overlap_bound_s"] is not None:
            predicted = f"{r['overlap_bound_s'] * 1e3:,.0f} .. {predicted}"
        rate = ["-" if r["nominal_s"] is None else f"{r['nominal_s'] * 1e3:,.0f}"] if with_rate else []
        table.append([r["name"], f"{r['batch']}", f"{r['fast_s'] * 1e3:,.1f}", f"{r['slow_s'] * 1e3:,.0f}", predicted,
                      *rate, f"{r['batch'] / r['fast_s']:,.0f}", f"{r['batch'] / r['slow_s']:,.0f}"])
    text = records.format_table(table, ["run", "batch", f"{fast} step ms", f"{slow} step ms", "predicted step ms",
                                        *(["set-rate step ms"] if with_rate else []), f"samples/s {fast}",
                                        f"samples/s {slow}"])
    if any(r["overlap_bound_s"] is not None for r in rows):
        text += ("\nA range 'a .. b' is the prediction for the overlap_comm off/on runs: a if the collectives hid "
                 "entirely behind the computation, b if not at all.")
    return text


def _change(x: float) -> str:
    """A relative change as a signed whole per cent, without a "-0%"."""
    return "0%" if round(x * 100) == 0 else f"{x:+.0%}"


def accumulation_verdicts(rows: Sequence[dict], load: load_guard.Load | None,
                          links: Mapping[str, str] = {"fast": "the fast link", "slow": "the slow link"}) -> str:
    """For the run just made: accumulation 4 against 1 at stages 1 and 2, on each link, as time per sample of
    the measured steps (first step left out) through the load guard: the ratio where the run had its devices
    to itself and it exceeds the steps' spread, else the reason it is withheld."""
    by = {r["name"]: r for r in rows}
    if load is None or load.samples == 0 or not load.alone:
        why = load.reason() if load is not None and load.samples else "nothing recorded what else used the devices"
        plain = []
        for stage in (1, 2):
            one, four = by.get(f"zero{stage}-acc1"), by.get(f"zero{stage}-acc4")
            if one and four:
                plain.append(f"ZeRO-{stage} " + ", ".join(
                    f"{(four['batch'] / four[f'{key}_s']) / (one['batch'] / one[f'{key}_s']):.2f}x over {link}"
                    for key, link in links.items()))
        return (f"Accumulation 4 against 1 (stages 1 and 2, both links): verdict withheld: {why}."
                + (f"\nThe figures, without a verdict: samples/s at accumulation 4 over 1: {'; '.join(plain)}."
                   if plain else ""))
    lines = []
    for stage in (1, 2):
        one, four = by.get(f"zero{stage}-acc1"), by.get(f"zero{stage}-acc4")
        if not (one and four):
            continue
        for key, link in links.items():
            per_sample = {f"accumulation {r['accum']}": [t / r["batch"] for t in r[f"{key}_each_s"]] for r in (one, four)}
            v = load_guard.compare(per_sample, load)
            head = f"ZeRO-{stage}, accumulation 4 against 1, over {link}: "
            lines.append(head + (f"{v.medians[0] / v.medians[1]:.2f}x the samples/s, beyond the steps' spread "
                                 f"({v.spread:.0%})." if v.given else f"withheld: {v.withheld}."))
    return "\n".join(lines)


def accumulation_reading(rows: Sequence[dict], load: load_guard.Load | None) -> str:
    """Accumulation 4 against 1 at stages 1 and 2 on the slow link, the model's ratio (samples/s from the steps it
    predicts, :func:`slow_link_rows`) beside the measured one, then :func:`accumulation_verdicts`, then what to
    take from them in one generated line."""
    by = {r["name"]: r for r in rows}
    ratios = {}
    for stage in (1, 2):
        one, four = by.get(f"zero{stage}-acc1"), by.get(f"zero{stage}-acc4")
        if one and four:
            ratios[stage] = {key: (four["batch"] / four[key]) / (one["batch"] / one[key])
                             for key in ("predicted_s", "slow_s")}
    verdicts = accumulation_verdicts(rows, load)
    if len(ratios) < 2:
        return verdicts
    model, measured = ({s: r[key] for s, r in ratios.items()} for key in ("predicted_s", "slow_s"))
    head = ("Samples/s at accumulation 4 over 1 on the slow link, the model's (from its predicted steps) beside the "
            "measured: " + "; ".join(f"ZeRO-{s} {model[s]:.2f}x predicted, {measured[s]:.2f}x measured" for s in (1, 2)))
    pays = ("accumulation pays more for ZeRO-1, whose collectives come once per optimizer step, than for ZeRO-2, "
            "which all-reduces in every micro-step" if model[1] > model[2] else
            "accumulation pays as much for ZeRO-2 as for ZeRO-1 here")
    order = "the same way" if (model[1] > model[2]) == (measured[1] > measured[2]) else "the other way"
    alone = load is not None and load.samples > 0 and load.alone
    take = (f"So: in the model, {pays}; the measured ratios rank the two stages {order}"
            + (", and how far each strays from the model cannot be told from the load's noise (no verdict)."
               if not alone else "."))
    return "\n".join([head, verdicts, take])


def _busy(load: load_guard.Load | None) -> bool:
    """Whether the load guard withholds a timing verdict for the launch's load: others used the devices, or
    nothing recorded what did."""
    return load is None or load.samples == 0 or not load.alone


def slow_link_load_note(rows: Sequence[dict], load: load_guard.Load | None) -> str:
    """Under the table of :func:`slow_link_rows`, where the load guard withheld its verdict: each run whose step
    was faster over the slow link than over the fast one, read as the cores' load (a slower link cannot speed up
    the same work). Empty where the run was alone or no run did so."""
    faster = [r for r in rows if r["slow_s"] < r["fast_s"]]
    if not faster or not _busy(load):
        return ""
    runs = "; ".join(f"{r['name']} {r['slow_s'] * 1e3:,.0f} ms against {r['fast_s'] * 1e3:,.1f} ms" for r in faster)
    return (f"Faster over the slow link than over the fast one ({runs}): the same work cannot gain from a slower "
            "link, so that comes from the cores' load, not the link.")


def _accumulation_ratio(one: dict, four: dict, key: str) -> float:
    """Samples/s at accumulation 4 over accumulation 1, from the step times under ``key``."""
    return (four["batch"] / four[f"{key}_s"]) / (one["batch"] / one[f"{key}_s"])


def accumulation_load_note(rows: Sequence[dict], load: load_guard.Load | None,
                           links: Mapping[str, str] = {"fast": "the fast link", "slow": "the slow link"}) -> str:
    """Under :func:`accumulation_reading`, where the load guard withheld its verdict: each ratio of accumulation 4
    over 1 below the model's floor of 1x (an accumulation-4 step does no more work and no more collectives than
    four accumulation-1 steps), read as the cores' load, with the computation the ``micro_steps`` probe measured
    where it grew too. Empty where the run was alone or every ratio reaches the floor."""
    by = {r["name"]: r for r in rows}
    below, grew = [], []
    for stage in (1, 2):
        one, four = by.get(f"zero{stage}-acc1"), by.get(f"zero{stage}-acc4")
        if not (one and four):
            continue
        below += [f"ZeRO-{stage} {_accumulation_ratio(one, four, key):.2f}x over {link}" for key, link in links.items()
                  if _accumulation_ratio(one, four, key) < 1]
        if four["compute_s"] > 4 * one["compute_s"]:
            grew.append(f"ZeRO-{stage} {four['compute_s'] * 1e3:,.1f} ms against 4 x {one['compute_s'] * 1e3:,.1f} ms")
    if not below or not _busy(load):
        return ""
    evidence = f"; the same computation ran slower there too (micro_steps probe: {'; '.join(grew)})" if grew else ""
    return (f"Accumulation 4 losing to 1 ({', '.join(below)}) is below the model's floor of 1x, since an "
            f"accumulation-4 step does no more work and no more collectives than four accumulation-1 steps: it comes "
            f"from the cores' load, not the link{evidence}.")


def accumulation_floor(rows: Sequence[dict],
                       links: Mapping[str, str] = {"fast": "the fast link", "slow": "the slow link"}) -> str:
    """What the model allows for accumulation 4 against 1 at a fixed micro batch (stages 1 and 2), beside the
    figures of :func:`slow_link_rows`: an accumulation-4 step does four micro-steps, one optimizer step and no
    more collectives than four accumulation-1 steps, so its samples/s is at least 1x the accumulation-1 run's.
    For each ratio below that floor, the two measured steps and the computation the ``micro_steps`` probe
    measured in each (on the fast link); :func:`accumulation_load_note` reads them."""
    by = {r["name"]: r for r in rows}
    lines = ["The model's floor is 1x: an accumulation-4 step does no more work and no more collectives than four "
             "accumulation-1 steps."]
    below = 0
    for stage in (1, 2):
        one, four = by.get(f"zero{stage}-acc1"), by.get(f"zero{stage}-acc4")
        if not (one and four):
            continue
        for key, link in links.items():
            ratio = _accumulation_ratio(one, four, key)
            if ratio >= 1:
                continue
            below += 1
            lines.append(f"ZeRO-{stage} over {link}, {ratio:.2f}x: {four[f'{key}_s'] * 1e3:,.1f} ms against four "
                         f"accumulation-1 steps' {4 * one[f'{key}_s'] * 1e3:,.1f} ms; computation (micro_steps, fast "
                         f"link) {four['compute_s'] * 1e3:,.1f} ms against 4 x {one['compute_s'] * 1e3:,.1f} ms.")
    if not below:
        lines.append("Every ratio here is at or above it.")
    return "\n".join(lines)


#: The links of :func:`link_findings`' rows, by the key of their step times (``fast_s``, ``slow_s``).
LINK_KEYS = ("fast", "slow")


def link_verdicts(rows: Sequence[dict], loads: Mapping[str, load_guard.Load | None]) -> dict[tuple[str, str], load_guard.Verdict]:
    """The course's load guard on the two levers of committed runs (:func:`slow_link_rows`), each link under its
    own load (``loads["fast"]``, ``loads["slow"]``: for a reference, its written conditions): accumulation 4
    against 1 at stages 1 and 2 (time per sample), and ``overlap_comm`` off against on (step time), each on the
    steps after the first. Keys: (``"zero<stage>-acc"`` or ``"overlap"``, ``"fast"`` or ``"slow"``)."""
    by = {r["name"]: r for r in rows}
    found = {}
    for key in LINK_KEYS:
        for stage in (1, 2):
            one, four = by.get(f"zero{stage}-acc1"), by.get(f"zero{stage}-acc4")
            if one and four:
                found[(f"zero{stage}-acc", key)] = load_guard.compare(
                    {f"accumulation {r['accum']}": [t / r["batch"] for t in r[f"{key}_each_s"]] for r in (one, four)},
                    loads.get(key))
        off, on = by.get("zero2-acc4-overlap-off"), by.get("zero2-acc4-overlap-on")
        if off and on:
            found[("overlap", key)] = load_guard.compare({"overlap_comm off": off[f"{key}_each_s"],
                                                          "overlap_comm on": on[f"{key}_each_s"]}, loads.get(key))
    return found


def _short(verdict: load_guard.Verdict) -> str:
    """A withheld verdict's reason without its parenthesis (a reference's conditions, the counts of steps)."""
    return verdict.withheld.split(" (")[0]


def link_findings(rows: Sequence[dict], fast: str = "the fast link", slow: str = "the slow link",
                  streams: bool = True, loads: Mapping[str, load_guard.Load | None] | None = None) -> str:
    """What committed runs on both links (:func:`slow_link_rows`) say about the two levers, in sentences generated
    from them: accumulation 4 against 1 at stages 1 and 2 (samples/s), and ``overlap_comm`` on against off (step
    time, beside the model's range for the slow link); ``fast`` and ``slow`` name the links. Without
    ``streams`` (CPU ranks) there is nothing to overlap with, and the sentences say so instead of a verdict.
    With ``loads`` (each link's, :func:`link_verdicts`) the figures go through the load guard: one line says which
    verdicts it withheld and why, and the sentences that judge a link (what overlap did, the model's bound) are
    given only for a link whose verdicts it gave.
    For the run just made, use :func:`accumulation_verdicts`."""
    by = {r["name"]: r for r in rows}
    rate = (lambda r, key: r["batch"] / r[key])
    judged = link_verdicts(rows, loads) if loads is not None else {}
    alone = {key: loads is None or (loads.get(key) is not None and loads[key].alone) for key in LINK_KEYS}
    lines = []
    for stage in (1, 2):
        one, four = by.get(f"zero{stage}-acc1"), by.get(f"zero{stage}-acc4")
        if one and four:
            lines.append(f"ZeRO-{stage}, accumulation 4 against 1: {rate(four, 'slow_s') / rate(one, 'slow_s'):.2f}x the "
                         f"samples/s over {slow}, {rate(four, 'fast_s') / rate(one, 'fast_s'):.2f}x over {fast}.")
    off, on = by.get("zero2-acc4-overlap-off"), by.get("zero2-acc4-overlap-on")
    change = {key: on[key] / off[key] - 1 for key in ("fast_s", "slow_s")} if off and on else {}
    if change:
        lines.append(f"overlap_comm at ZeRO-2, accumulation 4, on against off: {on['fast_s'] * 1e3:,.1f} against "
                     f"{off['fast_s'] * 1e3:,.1f} ms a step over {fast} ({_change(change['fast_s'])}), "
                     f"{on['slow_s'] * 1e3:,.0f} against {off['slow_s'] * 1e3:,.0f} ms over {slow} "
                     f"({_change(change['slow_s'])}; the model's range there: {on['overlap_bound_s'] * 1e3:,.0f} ms with "
                     f"perfect overlap to {on['predicted_s'] * 1e3:,.0f} ms with none).")
    if judged:
        said = []
        for key, name in zip(LINK_KEYS, (fast, slow)):
            mine = [v for (_, k), v in judged.items() if k == key]
            why = ", ".join(sorted({_short(v) for v in mine if not v.given}))
            said.append(f"every verdict over {name} given (beyond the steps' spread)" if not why else
                        f"{'its' if not any(v.given for v in mine) else 'some'} verdicts over {name} withheld ({why})")
        lines.append(f"Load guard: {'; '.join(said)}.")
    if change:
        if not streams:
            lines.append("These ranks have no streams to overlap on, so the two rows differ by this machine's noise only.")
            return "\n".join(lines)
        if off["slow_s"] < on["overlap_bound_s"] and alone["slow"]:
            lines.append(f"Without overlap_comm the step over {slow} already came in below the model's perfect-overlap "
                         "bound: the model overestimates that link's collectives, so its range cannot tell what "
                         "overlap hid there.")
        links = [(link, key) for link, key in ((fast, "fast"), (slow, "slow"))
                 if not judged or judged[("overlap", key)].given]
        shorter = [link for link, key in links if change[f"{key}_s"] < 0]
        longer = [link for link, key in links if change[f"{key}_s"] >= 0]
        said = ([f"shortened the step over {' and over '.join(shorter)}"] if shorter else []) + (
            [f"lengthened {'it' if shorter else 'the step'} over {' and over '.join(longer)}"] if longer else [])
        if said:
            lines.append(f"So overlap_comm {' and '.join(said)}.")
    return "\n".join(lines)


def overlap_in_capstone(sizes: Sequence[str] = ("1.2b", "2.7b")) -> list[tuple[str, float | None]]:
    """The ``overlap_comm`` candidates of chapter 16's committed ladders (``capstone-ladder-<size>``): one line
    each with its verdict, and the change in speed its verdict states (None where it states none)."""
    found = []
    for size in sizes:
        for device, date, _, runs in references.reference_runs(f"capstone-ladder-{size}"):
            for c in runs.get("ladder", {}).get("candidates", []):
                if c.get("rung") == "overlap" and c.get("label", "").startswith("overlap_comm") and c.get("verdict"):
                    gain = re.search(r"([+-]\d+(?:\.\d+)?)%", c["verdict"])
                    margin = re.search(r"the (\d+(?:\.\d+)?)% margin", c["verdict"])
                    head = f"capstone-ladder-{size} on {device} ({date}), ZeRO-{c['setting']['stage']}, {c['label']}: "
                    if gain and margin and c["verdict"].startswith("dropped"):
                        text = (f"{gain.group(1)}% samples/s against the ladder's best so far; a setting is kept "
                                f"only above +{margin.group(1)}% (the ladder's noise margin), so it was dropped")
                    else:
                        text = c["verdict"]
                    found.append((head + text, float(gain.group(1)) / 100 if gain else None))
    return found


def _reference_link_rows(name: str, sockets: str) -> list[tuple[str, str, list[dict], dict[str, load_guard.Load]]]:
    """(device, date, :func:`slow_link_rows`, each link's load) for each committed GPU result measured over both
    transports; a link's load is the one its reference's written conditions state
    (:meth:`~helpers.core.load_guard.Load.from_conditions`: alone only where they say so)."""
    over_sockets = {device: (runs, conditions) for (device, _, _, runs), conditions
                    in zip(references.reference_runs(sockets), references.reference_conditions(sockets))}
    found = []
    for (device, date, _, runs), conditions in zip(references.reference_runs(name), references.reference_conditions(name)):
        socket_runs, socket_conditions = over_sockets.get(device, (None, None))
        if socket_runs and f"{SLOW}collectives" in socket_runs:
            slow_model = CommModel.from_benchmark(socket_runs[f"{SLOW}collectives"])
            loads = {"fast": load_guard.Load.from_conditions(conditions),
                     "slow": load_guard.Load.from_conditions(socket_conditions)}
            found.append((device, date, slow_link_rows(runs, socket_runs, slow_model), loads))
    return found


def reference_findings(name: str = "bandwidth-nvlink", sockets: str = "bandwidth-sockets",
                       capstone: bool = True, overlap: bool = True) -> str:
    """:func:`link_findings` for each committed GPU result measured over both transports (NVLink and NCCL over
    sockets) through the load guard under each reference's written conditions, its ``overlap_comm`` lines only
    with ``overlap``; then, with ``capstone``, :func:`overlap_in_capstone`, and how often ``overlap_comm`` made
    training faster among the references' given verdicts and the ladders' kept or dropped rungs."""
    parts, changes = [], []
    for device, date, rows, loads in _reference_link_rows(name, sockets):
        found = link_findings(rows, fast="NVLink", slow="sockets", loads=loads).splitlines()
        parts += [f"On {device}, {date}, NVLink against NCCL over sockets:"]
        parts += found if overlap else [line for line in found if not line.startswith(("overlap_comm", "So ", "Without"))]
        by = {r["name"]: r for r in rows}
        off, on = by.get("zero2-acc4-overlap-off"), by.get("zero2-acc4-overlap-on")
        if off and on and overlap:  # a shorter step is a gain in speed, counted where the guard gave its verdict
            judged = link_verdicts(rows, loads)
            changes += [off[f"{key}_s"] / on[f"{key}_s"] - 1 for key in LINK_KEYS if judged[("overlap", key)].given]
    if capstone:
        ladder = overlap_in_capstone()
        parts += ["The same knob in chapter 16's ladders (speed against the best setting so far, NVLink):"]
        parts += [line for line, _ in ladder] or ["No committed capstone ladder has an overlap rung."]
        changes += [gain for _, gain in ladder if gain is not None]
    if changes:
        parts.append(f"overlap_comm made training faster in {sum(g > 0 for g in changes)} of these {len(changes)} "
                     "measurements with a verdict.")
    return "\n".join(parts)


def overlap_brief(name: str = "bandwidth-nvlink", sockets: str = "bandwidth-sockets") -> str:
    """``overlap_comm`` in one line per committed GPU result (step time on against off at ZeRO-2, accumulation 4,
    on each transport, with the load guard's verdict under the reference's written conditions), then chapter
    16's ladders counted: how often the knob was kept."""
    lines = []
    for device, date, rows, loads in _reference_link_rows(name, sockets):
        by = {r["name"]: r for r in rows}
        off, on = by.get("zero2-acc4-overlap-off"), by.get("zero2-acc4-overlap-on")
        if off and on:
            judged = link_verdicts(rows, loads)
            said = [f"{_change(on[f'{key}_s'] / off[f'{key}_s'] - 1)} over {link} ("
                    + ("beyond the steps' spread" if judged[("overlap", key)].given
                       else f"verdict withheld: {_short(judged[('overlap', key)])}") + ")"
                    for key, link in (("fast", "NVLink"), ("slow", "sockets"))]
            lines.append(f"overlap_comm on against off (ZeRO-2, accumulation 4; {device}, {date}): step time "
                         f"{', '.join(said)}.")
    ladder = overlap_in_capstone()
    if ladder:
        dropped = sum(line.endswith("so it was dropped") for line, _ in ladder)
        lines.append(f"Chapter 16's ladders tried it {len(ladder)} times and dropped it {dropped} of them (no gain "
                     "beyond their noise margin).")
    return "\n".join(lines) or "No committed GPU result with overlap_comm runs."


#: The GPU-scale runs of chapter 09 (``python -m helpers reference bandwidth-nvlink|bandwidth-sockets``).
GPU_MODEL = {"model": "llama-265m", "precision": "bf16", "micro_batch": 4, "steps": 3}


def measure_gpu(transport: str = "nvlink") -> tuple[dict, object]:
    """GPU machines only: chapter 09 at GPU scale, saved with :func:`helpers.core.references.save_reference`.

    ``"nvlink"``: :func:`run_chapter` with :data:`GPU_MODEL` over NCCL's default transports (the
    benchmark from 1 KiB to 1 GiB, ``deepspeed.comm`` beside ``torch.distributed``), saved as
    ``bandwidth-nvlink``. ``"sockets"``: with NCCL kept off NVLink, peer-to-peer and shared memory
    (:func:`helpers.topics.bandwidth.nccl_over_sockets`, restored after), a benchmark up to 256 MiB and the runs of
    stages 1 and 2 named ``slow-...``, saved as ``bandwidth-sockets`` with the transports NCCL's log names.
    Returns the runs and the file written."""

    if transport not in ("nvlink", "sockets"):
        raise ValueError(f"transport={transport!r}: choose 'nvlink' or 'sockets'")
    if not environment.detect().is_gpu:
        raise RuntimeError("chapter 09's GPU-scale runs need GPUs")
    m = GPU_MODEL
    if transport == "nvlink":
        runs, _ = run_chapter(model=m["model"], precision=m["precision"], micro_batch=m["micro_batch"], steps=m["steps"],
                              timeout=3600)
        note = (f"benchmark 1 KiB-1 GiB and {m['model']} {m['precision']} runs (micro batch {m['micro_batch']}), "
                "NCCL's default transports")
        return runs, references.save_reference("bandwidth-nvlink", runs, note=note)

    name = "bandwidth-sockets"
    with nccl_over_sockets() as settings:
        specs = {f"{SLOW}collectives": spec(f"{SLOW}collectives", sizes=GPU_SIZES[:-1], iters=5,
                                                       out=launch.RUNS_DIR / f"{SLOW}collectives-{m['model']}")}
        specs.update(stage_specs(SLOW, model=m["model"], precision=m["precision"], micro_batch=m["micro_batch"],
                                 steps=m["steps"], stages=(1, 2)))
        runs = launch.sweep(specs, name=name, timeout=3600)
    transports = nccl_transports(launch.RUNS_DIR / name / "launch.log")
    note = (f"NCCL over sockets ({', '.join(f'{k}={v}' for k, v in settings.items())}); channels by transport in "
            f"NCCL's log: {transports or 'none logged'}")
    return runs, references.save_reference(name, runs, note=note)


def extrapolation_check(runs: Mapping[str, records.Record], source_accum: int = 4, target_accum: int = 1) -> str:
    """For each stage measured at both accumulations: do the collectives :func:`extrapolate` predicts from the
    ``source_accum`` run equal, call for call and byte for byte, those measured at ``target_accum``?"""
    table = []
    by_key = {(r.stage, r["grad_accum"]): r for r in runs.values()}
    for (stage, accum), source in sorted(by_key.items()):
        target = by_key.get((stage, target_accum))
        if accum != source_accum or target is None:
            continue
        predicted = extrapolate(source, target_accum).by_op
        measured = {op: {"count": row["count"], "bytes": row["bytes"]} for op, row in target.comm_ops().items()}
        same = {op: (round(v["count"], 6), round(v["bytes"])) for op, v in predicted.items()} == \
               {op: (round(v["count"], 6), round(v["bytes"])) for op, v in measured.items()}
        table.append([f"ZeRO-{stage}", f"{source_accum} -> {target_accum}",
                      " ".join(f"{op.split('_into')[0]}:{v['count']:g}" for op, v in sorted(predicted.items())),
                      "yes" if same else "no"])
    return records.format_table(table, ["stage", "extrapolated", "collectives per step", "equal to the measured run"])


def reference_comparison(name: str = "bandwidth-nvlink") -> str:
    """The committed GPU reference's collective time per step, measured against the model fitted there, each
    table labelled with its device and date (a reference, not this run)."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    parts = []
    for device, date, _, runs in found:
        model = CommModel.from_benchmark(runs["collectives"])
        logged = logged_runs(runs)
        first = next(iter(logged.values()))
        parts += [f"Reference, measured on {device}, {date} ({first.model_name}, {first.precision}; not this run):",
                  comparison_table(comparison_rows(logged, model))]
    return "\n".join(parts)


def reference_report(name: str = "bandwidth-nvlink", sockets: str = "bandwidth-sockets") -> str:
    """Committed GPU results of chapter 09, each labelled with its device: the all_reduce target against raw
    torch.distributed, the fitted model, measured against predicted collective time per stage, the what-if
    from the GPU runs, and the runs over NCCL sockets; or a plain statement that none are committed yet."""

    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "run this notebook on a GPU machine to measure them.")
    over_sockets = {device: runs for device, _, _, runs in references.reference_runs(sockets)}
    parts = []
    for device, date, note, runs in found:
        bench = runs["collectives"]
        model = CommModel.from_benchmark(bench)
        fast = logged_runs(runs)
        parts += [f"Measured on {device}, {date} ({note}):",
                  "all_reduce bus bandwidth, deepspeed.comm against torch.distributed:", target_table(bench),
                  "alpha-beta fits (deepspeed.comm):", fit_table(model, bench),
                  "collective time per optimizer step, measured and predicted:",
                  comparison_table(comparison_rows(fast, model))]
        accum4 = [r for r in fast.values() if r["grad_accum"] >= 2 and r.stage in (0, 1, 2, 3)]
        profiles = [extrapolate(r, a) for r in sorted(accum4, key=lambda r: r.stage) for a in (1, 4)]
        if profiles:
            parts += ["what-if from these runs (serial, alpha as fitted for all_reduce):",
                      what_if_table(what_if(profiles, model.fits["all_reduce"].alpha))]
        socket_runs = over_sockets.get(device)
        if socket_runs and f"{SLOW}collectives" in socket_runs:
            slow_model = CommModel.from_benchmark(socket_runs[f"{SLOW}collectives"])
            parts += ["NCCL over sockets instead of NVLink:", fit_table(slow_model, socket_runs[f"{SLOW}collectives"]),
                      slow_link_table(slow_link_rows(runs, socket_runs, slow_model), "NVLink", "sockets")]
        parts.append("")
    return "\n".join(parts)


# --- figures ----------------------------------------------------------------------------------------

def bus_bandwidth(result: dict, title: str | None = None):
    """Bus bandwidth against message size, one panel per collective, one line per implementation
    (a :mod:`helpers.topics.bandwidth` summary)."""
    plt = plots.pyplot()

    ops = list(dict.fromkeys(r["op"] for r in result["results"]))
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3.2), sharey=True, squeeze=False)
    for ax, op in zip(axes[0], ops):
        for impl in IMPLEMENTATIONS:
            points = sorted((p["bytes"], p["busbw"]) for p in rows(result, impl, op))
            if points:
                ax.plot([b for b, _ in points], [w / 1e9 for _, w in points], marker="o", markersize=3, label=impl)
        ax.set(xscale="log", yscale="log", xlabel="message bytes", title=op)
    axes[0][0].set_ylabel("bus bandwidth GB/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title or f"Collectives on {result['world_size']} ranks ({result['device_name']}, {result['backend']})")
    fig.tight_layout()
    plt.close(fig)
    return fig


def reference_alpha_beta(name: str = "bandwidth-nvlink"):
    """:func:`alpha_beta` of the committed GPU reference, titled with its device and date; None without one."""
    found = references.reference_runs(name)
    if not found:
        return None
    device, date, _, runs = found[0]
    return alpha_beta(runs["collectives"], CommModel.from_benchmark(runs["collectives"]),
                      title=f"GPU reference: {device}, {date} (NCCL; not this run)")


def alpha_beta(result: dict, model, implementation: str = "deepspeed.comm", title: str | None = None):
    """Measured seconds per call against wire bytes per rank (points) and the fitted t = alpha + beta w (lines)."""
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (op, fit) in enumerate(model.fits.items()):
        points = sorted((p["wire_bytes"], p["seconds"]) for p in rows(result, implementation, op))
        xs = [x for x, _ in points]
        ax.plot(xs, [t * 1e6 for _, t in points], "o", color=colours[i % len(colours)], markersize=4, label=f"{op} measured")
        ax.plot(xs, [fit.seconds(x) * 1e6 for x in xs], "-", color=colours[i % len(colours)], linewidth=1,
                label=f"{op} fit: {fit.describe()}")
    ax.set(xscale="log", yscale="log", xlabel="wire bytes per rank", ylabel="microseconds per call",
           title=title or f"alpha-beta fits ({model.source})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


def measured_vs_predicted(rows: Sequence[dict], title: str = "Collective time per optimizer step"):
    """Bars: measured and predicted collective seconds per step, run by run (:func:`helpers.topics.bandwidth.comparison_rows`)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(rows), 3.6))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_s"] * 1e3 for r in rows], 0.38, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted_s"] * 1e3 for r in rows], 0.38, label="alpha-beta model", hatch="//")
    ax.set_xticks(list(xs), [r["name"] for r in rows], fontsize=8, rotation=20)
    ax.set(ylabel="ms per optimizer step", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def what_if_figure(rows: Sequence[dict], title: str = "Predicted step time by link"):
    """Two panels against link bandwidth (log): predicted time per sample, and communication's share of the step;
    one line per (stage, accumulation) profile (:func:`helpers.topics.bandwidth.what_if`)."""
    plt = plots.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    profiles = list(dict.fromkeys(id(r["profile"]) for r in rows))
    for pid in profiles:
        mine = [r for r in rows if id(r["profile"]) == pid]
        p = mine[0]["profile"]
        style = "-" if p.accum == 1 else "--"
        label = f"ZeRO-{p.stage}, accum {p.accum}"
        gbits = [r["bandwidth"] * 8 / 1e9 for r in mine]
        left.plot(gbits, [r["step_s"] / p.samples * 1e3 for r in mine], style, marker="o", markersize=3, label=label)
        right.plot(gbits, [r["comm_share"] * 100 for r in mine], style, marker="o", markersize=3, label=label)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("link Gbit/s per direction")
    left.set(ylabel="ms per sample", yscale="log", title="time per sample")
    right.set(ylabel="% of the step", ylim=(0, 100), title="communication share")
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


def slow_link(rows: Sequence[dict], title: str = "Step time on a fast and a slow link"):
    """Bars per run: measured step time on the fast link and on the slow one, and the model's prediction for
    the slow one (:func:`helpers.topics.bandwidth.slow_link_rows`); a range for the timed-only overlap runs."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(rows), 3.8))
    xs = list(range(len(rows)))
    ax.bar([x - 0.27 for x in xs], [r["fast_s"] * 1e3 for r in rows], 0.26, label="fast link, measured")
    ax.bar(xs, [r["slow_s"] * 1e3 for r in rows], 0.26, label="slow link, measured")
    ax.bar([x + 0.27 for x in xs], [r["predicted_s"] * 1e3 for r in rows], 0.26, hatch="//",
           label="slow link, predicted (no overlap)")
    lows = [(x, r["overlap_bound_s"]) for x, r in zip(xs, rows) if r["overlap_bound_s"] is not None]
    if lows:
        ax.plot([x + 0.27 for x, _ in lows], [v * 1e3 for _, v in lows], "kv", label="predicted, perfect overlap")
    ax.set_xticks(xs, [r["name"] for r in rows], fontsize=7, rotation=20)
    ax.set(ylabel="ms per optimizer step", title=title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    plt.close(fig)
    return fig



# --- exercises: predict with the model, then configure what DeepSpeed records ----------------------

#: The message of exercise 1: one all_reduce of 64 MiB, as a ZeRO bucket of gradients might be.
EXERCISE_MESSAGE = 64 * 2**20


def reference_model(name: str = "bandwidth-nvlink") -> tuple[str, CommModel]:
    """The alpha-beta model fitted on the first committed GPU reference of ``name`` (its device and date, and
    the model): the same on every machine, so exercises can check predictions against it."""
    found = references.reference_runs(name)
    if not found:
        raise ValueError(f"no committed reference {name!r}: " + references.no_references(name))
    device, date, _, runs = found[0]
    return f"{device}, {date}", CommModel.from_benchmark(runs["collectives"])


def _fit_words(op: str, where: str, model: CommModel) -> str:
    ab = model.fits[op]
    return (f"{op} on {where}: alpha = {ab.alpha * 1e6:,.1f} us, 1/beta = {ab.bandwidth / 1e9:.3g} GB/s "
            f"({model.world_size} ranks)")


def exercise_collective_time(answer: object, message_bytes: int = EXERCISE_MESSAGE, op: str = "all_reduce",
                             reference: str = "bandwidth-nvlink") -> exercises.Verdict:
    """Exercise: predict the milliseconds one ``op`` of ``message_bytes`` takes on the GPU reference's link, from
    its fitted alpha and beta (t = alpha + beta x w, w the ring's wire bytes per rank); within 5%."""
    where, model = reference_model(reference)
    ab, n = model.fits[op], model.world_size
    w = wire_bytes(op, message_bytes, n)
    expected = ab.seconds(w) * 1e3
    share = ab.beta * w / ab.seconds(w)
    return exercises.number(
        f"{op} time", answer, expected, relative=0.05, unit=" ms",
        task=f"Predict, in milliseconds, one {op} of {records.format_bytes(message_bytes)} with the model fitted on "
             f"{_fit_words(op, where, model)}.",
        hint=f"the alpha-beta model of 'A model of a collective', where w is the bytes one rank sends, not the "
             f"message S: {op}'s bus-bandwidth factor ('The collectives, measured') relates the two; mind the "
             "units (us, GB/s = 1e9 bytes/s).",
        why=f"w = 2(n-1)/n x S = {w:,.0f} bytes on {n} ranks; beta x w is {share:.0%} of the time and alpha the "
            f"rest: at this size the call is bandwidth-bound, so doubling the message nearly doubles its time.")


def exercise_latency_bound_size(answer: object, op: str = "all_gather",
                                reference: str = "bandwidth-nvlink") -> exercises.Verdict:
    """Exercise: predict the message size S (bytes; for all_gather the gathered result) at which alpha and
    beta x w cost the same on the GPU reference's link, i.e. below which ``op`` is latency-bound; within 5%."""
    where, model = reference_model(reference)
    ab, n = model.fits[op], model.world_size
    per_byte = wire_bytes(op, 1.0, n)  # wire bytes per byte of message
    expected = ab.half_bandwidth_bytes / per_byte
    return exercises.number(
        f"{op} latency-bound below", answer, expected, relative=0.05, unit=" bytes",
        task=f"Predict the message size S, in bytes, at which {op}'s alpha equals its bytes term, with the model "
             f"fitted on {_fit_words(op, where, model)}.",
        hint="use the alpha and 1/beta of this to-do line (not this machine's fit table) in the model of "
             "'A model of a collective', and mind which bytes each of its quantities counts.",
        why=f"alpha / beta = {records.format_bytes(ab.half_bandwidth_bytes)} of wire bytes, and each rank sends "
            f"{per_byte:g} x S, so S = {records.format_bytes(expected)}: below it a call costs about alpha whatever "
            "its size, which is why many small collectives (stage 3's per-layer gathers, small buckets) cost more "
            "than their bytes suggest.")


#: The collectives the chapter's ZeRO runs call, as DeepSpeed's comms logger names them.
LOGGED_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def comms_logger_records(block: dict, ops: Sequence[str] = LOGGED_OPS) -> dict[str, bool]:
    """Which of ``ops`` DeepSpeed 0.19.8 records with the config block ``comms_logger = block``: DeepSpeed's own
    config model (``DeepSpeedCommsConfig``, which refuses unknown keys) configures a fresh ``CommsLogger``, and
    ``timed_op`` profiles a call when the logger is on and ``prof_all`` is set or the op is in ``prof_ops``."""
    DeepSpeedCommsConfig = ds.load("deepspeed.comm.config").DeepSpeedCommsConfig
    CommsLogger = ds.load("deepspeed.utils.comms_logging").CommsLogger

    if not isinstance(block, dict):
        raise TypeError(f"the block is a dict of settings, not {type(block).__name__}")
    logger = CommsLogger()
    logger.configure(DeepSpeedCommsConfig({"comms_logger": block}))
    return {op: bool(logger.enabled and (logger.prof_all or op in logger.prof_ops)) for op in ops}


#: Exercise 3's comms_logger block and accumulation.
EXERCISE_LOGGER = {"enabled": False, "prof_all": False, "prof_ops": ["all_reduce"]}
EXERCISE_ACCUM = 8


def exercise_logged_calls(answer: object, record: records.Record, block: dict | None = None,
                          accum: int = EXERCISE_ACCUM) -> exercises.Verdict:
    """Exercise: predict which collectives, and how many calls of each per optimizer step, DeepSpeed's logger
    records with the config block ``block`` for ``record``'s configuration at accumulation ``accum``: the ops
    :func:`comms_logger_records` says the block records, counted by :func:`extrapolate` from the record."""
    block = EXERCISE_LOGGER if block is None else block
    recorded = comms_logger_records(block)
    counts = extrapolate(record, accum).by_op
    expected = {op: int(round(row["count"])) for op, row in sorted(counts.items()) if recorded.get(op, True)}
    stage = record.stage
    all_counts = ", ".join(f"{op} {int(round(row['count']))}" for op, row in sorted(counts.items()))
    return exercises.choice(
        "logged calls", answer, expected,
        task=f"With comms_logger = {block!r}, which collectives would DeepSpeed record for ZeRO-{stage} at "
             f"accumulation {accum} (micro batch as in the runs), and how many calls of each per optimizer step? "
             "Answer a dict {logged name: calls per step}.",
        hint="two things to settle: which ops this block records (read how DeepSpeedCommsConfig.__init__ in "
             "deepspeed/comm/config.py decides whether the logger is on; the field table under the training script "
             f"says what the other fields do), and how ZeRO-{stage}'s calls per step change with the accumulation (the "
             "table of calls per step at accumulation 1 and 4, and the reading under it).",
        why=f"the block's presence turns the logger on whatever 'enabled' says (`{comms_logger_switch()}`), and prof_all false leaves only "
            f"prof_ops; ZeRO-{stage}'s per-step counts at accumulation {accum}, built from the run's measured "
            f"micro-steps: {all_counts}.")


def _calls_per_step(record: records.Record) -> int:
    """Collective calls per optimizer step in a run's comms-logger records."""
    return int(round(sum(row["count"] for row in record.comm_ops().values())))


def exercise_accumulation_gain(answer: object, runs: Mapping[str, records.Record]) -> exercises.Verdict:
    """Exercise: predict which of ZeRO-1 and ZeRO-2 gains more samples/s from accumulation 4 against 1 on a slow
    link. By the alpha-beta model the stage whose collective calls (and bytes) per optimizer step do not grow with
    the accumulation spreads them over four times the samples; the counts come from the runs' records, so the
    answer is the same on every machine that ran them."""
    calls = {stage: (_calls_per_step(runs[f"zero{stage}-acc1"]), _calls_per_step(runs[f"zero{stage}-acc4"]))
             for stage in (1, 2)}
    growth = {stage: four / one for stage, (one, four) in calls.items()}
    expected = "ZeRO-1" if growth[1] < growth[2] else "ZeRO-2"
    counts = "; ".join(f"ZeRO-{stage} {one} at accumulation 1, {four} at 4" for stage, (one, four) in calls.items())
    return exercises.choice(
        "accumulation on a slow link", answer, expected, choices=("ZeRO-1", "ZeRO-2"),
        task="On the slow link, which stage gains more samples/s from accumulation 4 against 1: \"ZeRO-1\" or "
             "\"ZeRO-2\"?",
        hint="on a slow link the collectives dominate a step, so compare the communication per sample under "
             "accumulation: compare chapter 04's and chapter 08's schedules of each stage's collectives, and the "
             "alpha-beta model's cost of each call.",
        why=f"collective calls per optimizer step: {counts}. A stage whose calls do not grow shares them among four "
            "times the samples; one that all-reduces in every micro-step does not.")
