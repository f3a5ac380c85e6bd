"""PyTorch's own data parallelism on the course's ranks: DDP and FSDP2, recorded like DeepSpeed's runs.

A run of this module is a task of the plan (``RunSpec(task="helpers.pytorch_train:train_run")``), started
by ``torchrun`` as PyTorch users start their scripts (``launcher="torchrun"`` in :mod:`helpers.launch`).
It reads the same DeepSpeed config file as the DeepSpeed runs beside it, for the same hyperparameters:
micro-batch, gradient accumulation, AdamW's ``lr`` and ``weight_decay``, ``gradient_clipping``, bf16.
``options={"strategy": ...}`` picks one of :data:`STRATEGIES`:

- ``ddp``: ``DistributedDataParallel``: every rank holds everything; gradients are all-reduced in
  buckets once per optimizer step (``no_sync()`` on the other micro-steps, the DDP idiom).
- ``fsdp2``: ``fully_shard`` on every layer and the root, ``reshard_after_forward=True``: parameters,
  gradients and Adam's states sharded (ZeRO-3's partitioning); each layer is gathered for forward, freed,
  gathered again for backward; gradients reduce-scattered after every backward.
- ``fsdp2-grad-op``: the same with ``reshard_after_forward=False``: a layer gathered in forward stays
  whole until its backward, so backward gathers nothing (FSDP1's SHARD_GRAD_OP, ZeRO-2's traffic), at the
  price of holding unsharded parameters between forward and backward.

The training loop and the record are :func:`helpers.train.train_and_record`, the DeepSpeed runs' own;
the probes ``timing``, ``model_states``, ``peak_memory`` and ``timeline`` work unchanged (an adapter gives
them what they read from a DeepSpeed engine). DeepSpeed's comms logger cannot see PyTorch's collectives,
so the ``torch_comm`` probe measures them with the PyTorch profiler instead (see :class:`TorchComm`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import time
from contextlib import nullcontext
from typing import Any

from helpers import probes as probe_registry


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One of PyTorch's ways to train data-parallel."""

    label: str  # the record's "strategy" (tables show it instead of "ZeRO-N")
    zero_stage: int  # the ZeRO stage whose model states per rank it holds between steps
    comm_stage: int  # the ZeRO stage whose communication volume it has (the paper's 2Ψ or 3Ψ)
    reshard_after_forward: bool | None  # FSDP2's setting; None for DDP


STRATEGIES = {
    "ddp": Strategy("DDP", 0, 0, None),
    "fsdp2": Strategy("FSDP2 full", 3, 3, True),
    "fsdp2-grad-op": Strategy("FSDP2 grad-op", 3, 2, False),
}


@dataclasses.dataclass
class TorchEngine:
    """What the course's probes read from a DeepSpeed engine, for a PyTorch model: ``module`` (whose
    parameters hold the model's weights), ``optimizer``, ``device``; and DDP's bucket bytes, which DDP
    keeps in C++ where no Python tensor shows them (``helpers.memory.model_states`` reads them here)."""

    module: Any
    optimizer: Any
    device: Any
    wrapped: Any  # the DDP or FSDP2 module that runs forward
    strategy: str

    def buffer_bytes(self) -> int:
        """Bytes of DDP's gradient buckets (DDP's own logging data, ``bucket_sizes``); 0 for FSDP2, whose
        gather and reduce buffers live only during each collective."""
        if self.strategy != "ddp":
            return 0
        sizes = str(self.wrapped._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(s) for s in sizes.split(",") if s.strip())


def shard_units(model) -> list:
    """The modules FSDP2 shards as units (each gathered and freed as one): every transformer block of the
    LLaMA-style model, every ``nn.Linear`` of a ``Sequential``; the root is sharded on top of them."""
    from torch import nn

    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return list(inner.layers)
    if isinstance(model, nn.Sequential):
        return [m for m in model if isinstance(m, nn.Linear)]
    return []


def _wrap(model, strategy: str, device, precision: str):
    """The model wrapped by ``strategy`` (see :data:`STRATEGIES`)."""
    import torch

    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids), model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
              if precision == "bf16" else MixedPrecisionPolicy())
    reshard = STRATEGIES[strategy].reshard_after_forward
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model, model


def torch_step(ctx, run: dict, step: int, probes: list) -> list[float]:
    """One optimizer step the way PyTorch scripts write it: ``grad_accum`` micro-steps of forward and
    ``(loss / grad_accum).backward()`` (DDP skips its all-reduce on all but the last, ``no_sync()``),
    then ``clip_grad_norm_``, ``optimizer.step()``, ``zero_grad()``. Returns this rank's micro-batch losses."""
    import torch

    from helpers import models

    engine, name, seed = ctx.engine, run["model"], run["seed"]
    autocast = (torch.autocast(engine.device.type, dtype=torch.bfloat16)
                if ctx.precision == "bf16" and engine.strategy == "ddp" else nullcontext())
    losses = []
    for micro_step in range(ctx.grad_accum):
        last = micro_step == ctx.grad_accum - 1
        indices = models.sample_indices(step, micro_step, ctx.rank, ctx.world_size, ctx.micro_batch, ctx.grad_accum)
        batch = models.make_batch(name, indices, seed, models.run_seq_len(name, run.get("model_options"))).to(engine.device)
        sync = engine.wrapped.no_sync() if engine.strategy == "ddp" and not last else nullcontext()
        with sync:
            with autocast:
                loss = models.loss_of(engine.wrapped, name, batch)
            (loss / ctx.grad_accum).backward()
        for probe in probes:
            probe.after_backward(ctx, step, micro_step)
        losses.append(loss.item())
    clip = ctx.config.get("gradient_clipping", 0)
    if clip:
        torch.nn.utils.clip_grad_norm_(engine.wrapped.parameters(), clip)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    return losses


def train_run(run: dict, position: int, count: int, born: float) -> None:
    """Task: train one run with PyTorch's ``options["strategy"]`` on this rank and write its record (rank 0)."""
    import torch
    import torch.distributed as dist

    from helpers import models, theory, train

    run_started = time.time()
    _check_strategy(run.get("options") or {})
    strategy = run["options"]["strategy"]
    with open(run["config"]) as f:
        config = json.load(f)
    if config.get("fp16", {}).get("enabled"):
        raise ValueError("fp16: this comparison trains in fp32 or bf16 (set bf16.enabled or neither)")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    precision = train.precision_of(config)
    model = models.build(run["model"], run["seed"], config, **(run.get("model_options") or {})).to(device)
    psi = models.count_parameters(model)
    wrapped, module = _wrap(model, strategy, device, precision)
    params = config.get("optimizer", {}).get("params", {})
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=params.get("lr", 1e-3),
                                  weight_decay=params.get("weight_decay", 0.01))
    engine = TorchEngine(module=module, optimizer=optimizer, device=device, wrapped=wrapped, strategy=strategy)
    micro = config["train_micro_batch_size_per_gpu"]
    accum = config.get("gradient_accumulation_steps", 1)
    chosen = STRATEGIES[strategy]
    ctx = None  # holds the engine: dropped with it at teardown
    try:
        ctx = probe_registry.RunContext(
            engine=engine, rank=rank, world_size=world, device_type=device.type, precision=precision,
            stage=chosen.zero_stage, micro_batch=micro, grad_accum=accum, steps=run["steps"], params=psi, born=born,
            run_started=run_started, config=config, first_step=0, options=run.get("options") or {},
            dp_rank=rank, dp_size=world)
        volume = theory.comm_bytes_per_step(psi, chosen.comm_stage, "fp32" if strategy == "ddp" else precision)
        train.train_and_record(ctx, run, position, count, torch_step, {
            "framework": f"torch {torch.__version__}",
            "strategy": chosen.label,
            "launcher": _launcher_of(run),
            "optimizer": "torch.optim.AdamW",
            "basic_optimizer": "AdamW",
            "theory": {
                # PyTorch keeps fp32 parameters and gradients between steps, in bf16 runs too (autocast or
                # FSDP2's mixed-precision policy cast them for compute and communication only)
                "model_states_bytes_per_rank": theory.model_state_bytes(psi, chosen.zero_stage, world, "fp32"),
                "comm_bytes_per_step": volume,
                "comm_wire_bytes_per_step": volume * theory.ring_factor(world),
            },
        })
    finally:
        del engine, optimizer, wrapped, module, model, ctx  # all of them before the collection (train.train_run)
        gc.collect()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _launcher_of(run: dict) -> str:
    """The launcher that started this run's ranks, as its plan says (``torchrun`` for PyTorch's strategies)."""
    with open(run["plan"]) as f:
        return json.load(f).get("launcher", "launch")


def _check_strategy(options: dict) -> None:
    strategy = options.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(f"options['strategy']={strategy!r}: choose one of {', '.join(STRATEGIES)}, "
                         "e.g. options={'strategy': 'ddp'}")


train_run.check_options = _check_strategy  # helpers.launch checks the options before any process starts


# --- measuring PyTorch's collectives -----------------------------------------------------------

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
    {message bytes: {"count": n}}}, so :func:`helpers.communication.record_section` folds both alike.

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


@probe_registry.register
class TorchComm(probe_registry.Probe):
    """Every collective of steps 2..S of a run that DeepSpeed's comms logger cannot see (PyTorch DDP,
    FSDP2), from the PyTorch profiler (``record_shapes=True``): each ``c10d`` op with its tensors' shapes
    and dtypes, whoever issued it (DDP's C++ reducer, FSDP2, DTensor). Bytes follow the comms logger's
    convention; the section is the ``comm`` section the ``comm`` probe writes (:mod:`helpers.communication`).

    In a run that also has the ``comm`` probe (a DeepSpeed run), the section is ``comm_profiler`` instead,
    so the two measurements of the same collectives can be compared.
    """

    name = "torch_comm"

    def start(self, ctx: probe_registry.RunContext) -> None:
        self.profiler = None
        self.steps = max(1, ctx.steps - ctx.first_step - 1)

    def before_step(self, ctx: probe_registry.RunContext, step: int) -> None:
        if step == ctx.first_step + 1 or (ctx.steps - ctx.first_step == 1 and step == ctx.first_step):
            from torch.profiler import ProfilerActivity, profile

            ctx.synchronize()
            self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self.profiler.__enter__()  # the first step warms up: measure the steady state

    def finish(self, ctx: probe_registry.RunContext) -> dict:
        if self.profiler is None:
            return {"summary": {}}
        ctx.synchronize()
        self.profiler.__exit__(None, None, None)
        width = 2 if ctx.precision == "bf16" and getattr(ctx.engine, "strategy", "") != "ddp" else 4
        events = self.profiler.profiler.kineto_results.events()
        return {"summary": collectives_from_profile(events, width)}

    def combine(self, ranks: list[dict], ctx: probe_registry.RunContext) -> dict:
        from helpers import communication

        summary = {key: {str(size): row for size, row in sizes.items()} for key, sizes in ranks[0]["summary"].items()}
        section = communication.record_section(summary, ctx.world_size, self.steps)
        section["source"] = "PyTorch profiler (c10d ops, record_shapes)"
        logger_on = ctx.config.get("comms_logger", {}).get("enabled", False)
        return {"comm_profiler" if logger_on else "comm": section}
