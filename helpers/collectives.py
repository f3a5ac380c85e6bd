"""A microbenchmark of the collectives ZeRO uses, run by the ranks of a launch (chapter 09).

:func:`spec` makes the :class:`helpers.launch.RunSpec` of a benchmark (``task="helpers.collectives:benchmark"``),
so it runs under DeepSpeed's launcher beside training runs of the same sweep and writes a
``summary.json`` into its own run folder. On every rank, for each message size and collective, each
implementation is called ``warmup`` times, then ``iters`` times in turn with the others (so drift of
the machine hits all alike), each call timed alone: a barrier, the call, the device synchronized.

Implementations:

- ``deepspeed.comm``: what DeepSpeed's engine calls (``all_reduce``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``broadcast``), with its comms logger off.
- ``torch.distributed``: the same collectives called on torch directly (gloo or NCCL).
- ``deepspeed shm`` (CPU only, all_reduce only): ``deepspeed.comm.inference_all_reduce``, DeepSpeed's
  shared-memory kernel (see :mod:`helpers.network` for when it exists).

Conventions are nccl-tests' (``doc/PERFORMANCE.md``): the message size S is the whole tensor (for
all_gather, the gathered result); algbw = S / t; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n
for all_gather and reduce_scatter, x 1 for broadcast (:func:`helpers.theory.bus_bandwidth`). The bytes
one rank sends, ``wire_bytes`` (:func:`helpers.theory.wire_bytes`), are busbw x t: the size the
latency-bandwidth model of :mod:`helpers.bandwidth` is fitted on. Inside a course network namespace
(:mod:`helpers.network`) each rank also counts the bytes its network interfaces really sent.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Sequence

from helpers import records, theory

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
IMPLEMENTATIONS = ("deepspeed.comm", "torch.distributed", "deepspeed shm")
#: Message sizes (bytes): 1 KiB to 1 GiB on GPUs, 1 KiB to 4 MiB on CPU, by factors of 4.
GPU_SIZES = tuple(2**k for k in range(10, 31, 2))
CPU_SIZES = tuple(2**k for k in range(10, 23, 2))
TASK = "helpers.collectives:benchmark"
DTYPES = ("float32", "bfloat16")
MAX_BYTES = 2**32  # 4 GiB: larger messages are refused before launch
LINK_CALLS = 2  # calls whose bytes on the network are counted, per point (course namespaces only)


def default_sizes(is_gpu: bool) -> tuple[int, ...]:
    return GPU_SIZES if is_gpu else CPU_SIZES


def spec(name: str = "collectives", sizes: Sequence[int] | None = None, ops: Sequence[str] = OPS,
         implementations: Sequence[str] | None = None, iters: int | None = None, warmup: int | None = None,
         dtype: str = "float32", is_gpu: bool | None = None, baseline_ops: Sequence[str] | None = None,
         out: str | Path | None = None):
    """The RunSpec of one benchmark (checked here, before any process starts).

    Defaults depend on the device (``is_gpu``, else :func:`helpers.environment.detect`): sizes
    :data:`GPU_SIZES` or :data:`CPU_SIZES`, 20 timed calls per point on GPUs and 5 on CPU, a quarter
    of that (at least 1) as warm-up, every implementation that applies. ``baseline_ops``: the collectives
    also measured with ``torch.distributed`` (default: all on GPUs; all_reduce on CPU, where both are gloo
    and the shared-memory kernel is the comparison that matters). ``out``: the run folder (default
    ``runs/<name>``).
    """
    from helpers import environment, launch

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
                          task=TASK, out=out or launch.RUNS_DIR / name)


# --- rank side ----------------------------------------------------------------------------------

def _interface_bytes() -> int | None:
    """Bytes this process's network namespace has sent on all its interfaces, inside a course namespace only
    (elsewhere other programs share the counters)."""
    if not os.environ.get("COURSE_NETNS"):
        return None
    return sum(int(p.read_text()) for p in Path("/sys/class/net").glob("*/statistics/tx_bytes"))


def shm_status(world_size: int) -> dict:
    """Whether DeepSpeed's shared-memory all-reduce can run in this rank, and what decided it."""
    import torch

    from deepspeed.comm import comm as ds_comm  # the module: its ``cdb`` is the backend in use now

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


def benchmark(run: dict, position: int, count: int, born: float) -> None:
    """Rank-side task: time every (size, collective, implementation) of the plan; rank 0 publishes the table."""
    import torch
    import torch.distributed as tdist

    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from helpers.train import emit, publish

    with open(run["config"]) as f:
        settings = json.load(f)["collectives"]
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():  # deepspeed.initialize picks each rank's GPU; a task before it must do so itself
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(get_accelerator().current_device_name())
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, settings["dtype"])
    width = torch.empty((), dtype=dtype).element_size()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    shm = shm_status(world) if not on_gpu else {"available": False, "why_not": "GPU ranks use NCCL"}
    logger_was = dist.comms_logger.enabled
    dist.comms_logger.enabled = False  # a training run before this one in the sweep may have turned it on

    def aligned(fn) -> float:
        """One call, every rank starting together: a barrier (raw torch, not a call being measured), then the
        call, timed to the end of its work on the device. DeepSpeed's shared-memory kernel spin-waits on its
        peers' flags, and a rank racing into the next call has deadlocked it before (DeepSpeed PR #4048 fixed
        one such case; a launch of this benchmark with back-to-back calls once hung here), so no call,
        warm-up included, goes without the barrier."""
        tdist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def calls(op: str, elements: int) -> dict:
        """implementation -> a function making one call of ``op`` on ``elements`` elements (whole message)."""
        shard = elements // world
        if op == "all_reduce":
            x = torch.ones(elements, dtype=dtype, device=device)
            found = {"deepspeed.comm": lambda: dist.all_reduce(x), "torch.distributed": lambda: tdist.all_reduce(x)}
            if shm["available"]:
                found["deepspeed shm"] = lambda: dist.inference_all_reduce(x)
            return found
        if op == "all_gather":
            out = torch.empty(shard * world, dtype=dtype, device=device)
            inp = torch.ones(shard, dtype=dtype, device=device)
            return {"deepspeed.comm": lambda: dist.all_gather_into_tensor(out, inp),
                    "torch.distributed": lambda: tdist.all_gather_into_tensor(out, inp)}
        if op == "reduce_scatter":
            inp = torch.ones(shard * world, dtype=dtype, device=device)
            out = torch.empty(shard, dtype=dtype, device=device)
            return {"deepspeed.comm": lambda: dist.reduce_scatter_tensor(out, inp),
                    "torch.distributed": lambda: tdist.reduce_scatter_tensor(out, inp)}
        x = torch.ones(elements, dtype=dtype, device=device)
        return {"deepspeed.comm": lambda: dist.broadcast(x, 0), "torch.distributed": lambda: tdist.broadcast(x, 0)}

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
                        aligned(fn)
                times: dict[str, list[float]] = {name: [] for name in chosen}
                for _ in range(settings["iters"]):
                    for name, fn in chosen.items():
                        times[name].append(aligned(fn))
                sent: dict[str, float | None] = {name: None for name in chosen}
                if _interface_bytes() is not None:  # bytes on the wire, where the counters are ours alone
                    barriers = _interface_bytes()
                    for _ in range(LINK_CALLS):
                        aligned(lambda: None)
                    barriers = _interface_bytes() - barriers
                    for name, fn in chosen.items():
                        before = _interface_bytes()
                        for _ in range(LINK_CALLS):
                            aligned(fn)
                        sent[name] = (_interface_bytes() - before - barriers) / LINK_CALLS
                for name, measured in times.items():
                    seconds = statistics.median(measured)
                    results.append({"implementation": name, "op": op, "bytes": message, "elements": elements,
                                    "seconds": seconds, "times": measured,
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
            "name": run["name"], "task": "collectives", "world_size": world, "backend": tdist.get_backend(),
            "device": device.type, "device_name": torch.cuda.get_device_name(0) if on_gpu else "cpu",
            "dtype": settings["dtype"], "iters": settings["iters"], "warmup": settings["warmup"],
            "implementations": sorted({r["implementation"] for r in results}),
            "shm": shm, "namespace": os.environ.get("COURSE_NETNS"), "results": results})


# --- reading results ----------------------------------------------------------------------------

def wire_bytes(op: str, message_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for a collective on a message of ``message_bytes`` (nccl-tests' S) on a ring:
    busbw x time. Same as :func:`helpers.theory.wire_bytes` of the size DeepSpeed's comms logger records
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
    headers = ["size"] + [f"{i} {h}" for i in impls for h in ("us", "algbw", "busbw")]
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
