"""Chapter 15: DeepSpeed beside PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2, in two parts.

1. The ranks' side: what the course does around a run whose framework code the chapter writes on its page
   (``runs/15/frameworks_rank.py``): :func:`run_pytorch` and :func:`run_deepspeed` build the model, hand it to
   the page's set-up, call the page's step every optimizer step with this rank's micro-batches, and record the
   run with the course's probes, like every other run. :func:`train_run` (``TASK``) does the same with this
   module's copy of PyTorch's side, :func:`setup_pytorch` and :func:`step_pytorch`, for the chapters and
   benchmarks that cannot import a notebook's file (chapter 16's FSDP2 runs, ``benchmarks/bytes_reference.py``).
2. The notebook's side: the runs and the tables that compare them with ZeRO.

--- 1. the ranks ---

A PyTorch run is a task of the plan (``RunSpec(task=..., options={"strategy": ...})``), started by ``torchrun``
as PyTorch users start their scripts (``launcher="torchrun"`` in :mod:`helpers.core.launch`). It reads the same
DeepSpeed config file as the DeepSpeed runs beside it, for the same hyperparameters: micro-batch, gradient
accumulation, AdamW's ``lr`` and ``weight_decay``, ``gradient_clipping``, bf16. ``strategy`` is one of
:data:`STRATEGIES`:

- ``ddp``: ``DistributedDataParallel``: every rank holds everything; gradients all-reduced in buckets once per
  optimizer step (``no_sync()`` on the other micro-steps, the DDP idiom).
- ``ddp-zero1``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` around AdamW: PyTorch's ZeRO-1.
- ``fsdp2``: ``fully_shard`` on every layer and the root, ``reshard_after_forward=True``: ZeRO-3's partitioning.
- ``fsdp2-grad-op``: the same with ``reshard_after_forward=False`` (FSDP1's SHARD_GRAD_OP, ZeRO-2's traffic).
- ``fsdp2-no-sync``: ``fsdp2`` with ``set_requires_gradient_sync(False)`` on every micro-step but the last.

The probes ``timing``, ``model_states``, ``peak_memory`` and ``timeline`` work unchanged on PyTorch's runs (an
adapter, :class:`TorchEngine`, gives them what they read from a DeepSpeed engine). DeepSpeed's comms logger
cannot see PyTorch's collectives, so the ``torch_comm`` probe measures them with the PyTorch profiler instead
(see :class:`TorchComm`).

--- 2. the comparison ---

- :func:`compare`: two launches: PyTorch's strategies under ``torchrun`` and DeepSpeed's ZeRO stages under
  DeepSpeed's launcher, each run by the tasks it is given (the page's, in the chapter).
- tables of model states, collectives, losses and step time; the "which to pick" table.
- :func:`gpu_compare`: on GPUs, the same comparison at a size where time means something.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import statistics
import sys
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from helpers.core import (configs, environment, exercises, launch, load_guard, memory, models, plots, probes, records,
                          references, theory, train)
from helpers.core.plan import PlannedRun, reference_of, resolve
from helpers.core.probes import RunContext
from helpers.core.profiler_comm import TorchComm, profiler_check_table

# === 1. the ranks =================================================================================

@dataclasses.dataclass(frozen=True)
class Strategy:
    """One of PyTorch's ways to train data-parallel."""

    label: str  # the record's "strategy" (tables show it instead of "ZeRO-N")
    zero_stage: int  # the ZeRO stage whose model states per rank it holds between steps
    comm_stage: int  # the ZeRO stage whose communication volume it has (the paper's 2Ψ or 3Ψ)
    reshard_after_forward: bool | None  # FSDP2's setting; None for DDP
    sharded_optimizer: bool = False  # DDP with ZeroRedundancyOptimizer (Adam's states sharded: ZeRO-1)
    sync_last_micro_step_only: bool = False  # FSDP2: set_requires_gradient_sync(False) before the last micro-step

    @property
    def ddp(self) -> bool:
        """Whether the model is wrapped in DDP (else FSDP2)."""
        return self.reshard_after_forward is None


STRATEGIES = {
    "ddp": Strategy("DDP", 0, 0, None),
    "ddp-zero1": Strategy("DDP + ZeroRedundancyOptimizer", 1, 1, None, sharded_optimizer=True),
    "fsdp2": Strategy("FSDP2 full", 3, 3, True),
    "fsdp2-grad-op": Strategy("FSDP2 grad-op", 3, 2, False),
    "fsdp2-no-sync": Strategy("FSDP2 full, no-sync", 3, 3, True, sync_last_micro_step_only=True),
}

#: The page's functions, as :func:`run_pytorch` and :func:`run_deepspeed` call them.
PytorchSetup = Callable[[torch.nn.Module, str, dict, torch.device], tuple[Any, Any]]
# called as step(model, optimizer, batches, loss_of=, strategy=, config=, after_backward=): keep those names
PytorchStep = Callable[..., list[float]]
DeepSpeedSetup = Callable[[torch.nn.Module, dict], Any]
DeepSpeedStep = Callable[..., list[float]]  # step(engine, batches, loss_of=, after_backward=)


@dataclasses.dataclass
class TorchEngine:
    """What the course's probes read from a DeepSpeed engine, for a PyTorch model: ``module`` (whose
    parameters hold the model's weights), ``optimizer`` (the one holding this rank's Adam states: inside
    ``ZeroRedundancyOptimizer``, its local AdamW), ``device``; and DDP's bucket bytes, which DDP keeps in C++
    where no Python tensor shows them (``helpers.core.memory.model_states`` reads them here)."""

    module: Any
    optimizer: Any
    device: Any
    wrapped: Any  # the DDP or FSDP2 module that runs forward
    strategy: str

    @property
    def fp32_gradients(self) -> bool:
        """Whether the gradients stay fp32 in a bf16 run: DDP under ``torch.autocast`` casts only the compute."""
        return STRATEGIES[self.strategy].ddp

    def buffer_bytes(self) -> int:
        """Bytes of DDP's gradient buckets (DDP's own logging data, ``bucket_sizes``); 0 for FSDP2, whose
        gather and reduce buffers live only during each collective."""
        if not STRATEGIES[self.strategy].ddp:
            return 0
        sizes = str(self.wrapped._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(s) for s in sizes.split(",") if s.strip())

    def unsharded_grad_bytes(self) -> int:
        """Bytes of the whole (unsharded) gradients FSDP2 holds between micro-steps whose reduce-scatter
        ``set_requires_gradient_sync(False)`` skipped: on each parameter's unsharded tensor, or, where the
        reduce dtype differs from the compute dtype, in its ``unsharded_accumulated_grad``. The sharded
        parameters' ``.grad`` (what the memory probe reads) stays empty until the reduce-scatter. 0 for DDP."""
        if STRATEGIES[self.strategy].ddp:
            return 0
        total = 0
        for module in self.module.modules():
            if not hasattr(module, "_get_fsdp_state"):
                continue
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; one group in earlier versions
            groups = groups if groups is not None else [getattr(state, "_fsdp_param_group", None)]
            for group in groups:
                for fsdp_param in getattr(group, "fsdp_params", []):
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
                    for grad in (getattr(unsharded, "grad", None), accumulated):
                        if grad is not None:
                            total += grad.numel() * grad.element_size()
        return total


def shard_units(model) -> list:
    """The modules FSDP2 shards as units (each gathered and freed as one): every transformer block of the
    LLaMA-style model, every ``nn.Linear`` of a ``Sequential``; the root is sharded on top of them."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return list(inner.layers)
    if isinstance(model, torch.nn.Sequential):
        return [m for m in model if isinstance(m, torch.nn.Linear)]
    return []


def setup_pytorch(model: torch.nn.Module, strategy: str, config: dict, device: torch.device) -> tuple[Any, Any]:
    """PyTorch's side of a run (chapter 15 writes the same on its page): the model wrapped by ``strategy``
    and its optimizer, AdamW with the config's ``lr`` and ``weight_decay``."""
    params = config.get("optimizer", {}).get("params", {})
    adamw = {"lr": params.get("lr", 1e-3), "weight_decay": params.get("weight_decay", 0.01)}
    chosen = STRATEGIES[strategy]
    if chosen.ddp:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        if chosen.sharded_optimizer:
            return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), **adamw)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
              if train.precision_of(config) == "bf16" else MixedPrecisionPolicy())
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=chosen.reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=chosen.reshard_after_forward, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), **adamw)


def step_pytorch(model, optimizer, batches: Sequence[models.Batch], loss_of: Callable, strategy: str, config: dict,
                 after_backward: Callable[[int], None]) -> list[float]:
    """One optimizer step the way PyTorch scripts write it (chapter 15 writes the same on its page): per
    micro-batch, forward and ``(loss / accumulation).backward()``, the gradients reduced on the last only
    (DDP's ``no_sync()``; FSDP2's ``set_requires_gradient_sync`` with no-sync); then ``clip_grad_norm_``,
    ``optimizer.step()``, ``zero_grad()``. Returns this rank's micro-batch losses."""
    chosen = STRATEGIES[strategy]
    autocast = (torch.autocast(batches[0].inputs.device.type, dtype=torch.bfloat16)
                if train.precision_of(config) == "bf16" and chosen.ddp else nullcontext())
    losses = []
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if chosen.sync_last_micro_step_only:
            model.set_requires_gradient_sync(last)
        with model.no_sync() if chosen.ddp and not last else nullcontext(), autocast:
            loss = loss_of(model, batch)
            (loss / len(batches)).backward()
        after_backward(i)
        losses.append(loss.item())
    if config.get("gradient_clipping", 0):
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses


def _data(run: PlannedRun) -> str:
    """The course data set the run's model trains on: its builder's ``data`` (the capstone's model trains on
    the LLaMA models' text), else the model's own."""
    return getattr(resolve(run.builder), "data", run.model)


def _batches(ctx: RunContext, run: PlannedRun, step: int, dtype: torch.dtype | None = None) -> list[models.Batch]:
    """This rank's micro-batches of optimizer step ``step``, on its device (floating inputs cast to ``dtype``)."""
    name = _data(run)
    return [models.make_batch(name, models.sample_indices(step, m, ctx.dp_rank, ctx.dp_size, ctx.micro_batch,
                                                          ctx.grad_accum),
                              run.seed, run.model_options.get("seq_len")).to(ctx.engine.device, dtype)
            for m in range(ctx.grad_accum)]


def _loss_of(run: PlannedRun) -> Callable:
    """``loss_of(model, batch)``: the course's loss for the run's data (MSE, or the language model's)."""
    name = _data(run)
    return lambda model, batch: models.loss_of(model, name, batch)


def _trainer(step_once: Callable, dtype: torch.dtype | None = None):
    """The course loop's trainer (``trainer(ctx, run, step, probes)``) around a page's step function, given as
    ``step_once(batches, after_backward=...)``: the probes measure after each micro-step's backward."""
    def trainer(ctx: RunContext, run: PlannedRun, step: int, found: list) -> list[float]:
        def after_backward(micro_step: int) -> None:
            for probe in found:
                probe.after_backward(ctx, step, micro_step)
        return step_once(_batches(ctx, run, step, dtype), after_backward=after_backward)
    return trainer


def run_pytorch(run: PlannedRun, position: int, count: int, born: float, setup: PytorchSetup,
                step: PytorchStep) -> None:
    """Train one PyTorch run on this rank with the page's ``setup`` and ``step`` (see :func:`setup_pytorch` and
    :func:`step_pytorch` for their arguments) and write its record (rank 0)."""
    dist = torch.distributed
    run_started = time.time()
    _check_strategy(run.options)
    strategy = run.options["strategy"]
    config = run.read_config()
    if config.get("fp16", {}).get("enabled"):
        raise ValueError("fp16: this comparison trains in fp32 or bf16 (set bf16.enabled or neither)")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    precision = train.precision_of(config)
    model = resolve(run.builder)(run.model, run.seed, config, **run.model_options).to(device)
    psi = models.count_parameters(model)
    wrapped, optimizer = setup(model, strategy, config, device)
    chosen = STRATEGIES[strategy]
    engine = TorchEngine(module=model, optimizer=getattr(optimizer, "optim", optimizer), device=device,
                         wrapped=wrapped, strategy=strategy)
    ctx = trainer = None  # they hold the engine: dropped with it at teardown
    try:
        ctx = RunContext(
            engine=engine, rank=rank, world_size=world, device_type=device.type, precision=precision,
            stage=chosen.zero_stage, micro_batch=config["train_micro_batch_size_per_gpu"],
            grad_accum=config.get("gradient_accumulation_steps", 1), steps=run.steps, params=psi, born=born,
            run_started=run_started, config=config, faults=run.faults, first_step=0, options=run.options,
            dp_rank=rank, dp_size=world)
        volume = theory.comm_bytes_per_step(psi, chosen.comm_stage, "fp32" if chosen.ddp else precision)
        trainer = _trainer(functools.partial(step, wrapped, optimizer, loss_of=_loss_of(run), strategy=strategy,
                                             config=config))
        train.train_and_record(ctx, run, position, count, trainer, {
            "framework": f"torch {torch.__version__}",
            "strategy": chosen.label,
            "launcher": _launcher_of(run),
            "optimizer": (f"torch.distributed.optim.ZeroRedundancyOptimizer({type(engine.optimizer).__name__})"
                          if isinstance(optimizer, ZeroRedundancyOptimizer) else f"torch.optim.{type(optimizer).__name__}"),
            "basic_optimizer": type(engine.optimizer).__name__,
            "theory": {
                # PyTorch keeps fp32 parameters and gradients between steps, in bf16 runs too (autocast or
                # FSDP2's mixed-precision policy cast them for compute and communication only)
                "model_states_bytes_per_rank": theory.model_state_bytes(psi, chosen.zero_stage, world, "fp32"),
                "comm_bytes_per_step": volume,
                "comm_wire_bytes_per_step": volume * theory.ring_factor(world),
            },
        })
    finally:
        del engine, optimizer, wrapped, model, ctx, trainer  # all of them before the collection (train.train_run)
        _collect()


def run_deepspeed(run: PlannedRun, position: int, count: int, born: float, setup: DeepSpeedSetup,
                  step: DeepSpeedStep) -> None:
    """Train one DeepSpeed run on this rank with the page's ``setup(model, config) -> engine`` (which calls
    ``deepspeed.initialize``) and ``step(engine, batches, loss_of, after_backward) -> losses``, write its record
    (rank 0), and tear the engine down."""
    run_started = time.time()
    config = run.read_config()
    model = resolve(run.builder)(run.model, run.seed, config, **run.model_options)
    psi = models.count_parameters(model)
    engine = setup(model, config)
    ctx = trainer = None  # they hold the engine: dropped with it at teardown
    try:
        ctx = RunContext(
            engine=engine, rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
            device_type="cuda" if engine.device.type == "cuda" else "cpu", precision=train.precision_of(config),
            stage=engine.zero_optimization_stage(), micro_batch=engine.train_micro_batch_size_per_gpu(),
            grad_accum=engine.gradient_accumulation_steps(), steps=run.steps, params=psi, born=born,
            run_started=run_started, config=config, faults=run.faults, first_step=0, options=run.options)
        ctx.dp_rank, ctx.dp_size = train.data_parallel_coords(engine)
        dtype = next(engine.module.parameters()).dtype  # bf16 inputs for a bf16 engine
        trainer = _trainer(functools.partial(step, engine, loss_of=_loss_of(run)), dtype)
        train.train_and_record(ctx, run, position, count, trainer, {
            "deepspeed_train_batch": engine.train_batch_size(),
            "optimizer": memory.describe_optimizer(engine),
            "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
        })
    finally:
        engine.destroy()
        train.release_zero3_references(engine.module)
        del engine, model, ctx, trainer
        _collect()


def _collect() -> None:
    """Teardown between the runs of a launch: the collector frees the engine's reference cycles (twice:
    objects the first collection finalizes can hold the last references), and a GPU's cached blocks go back."""
    gc.collect()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_run(run: PlannedRun, position: int, count: int, born: float) -> None:
    """Task: train one run with PyTorch's ``options["strategy"]`` by this module's :func:`setup_pytorch` and
    :func:`step_pytorch`, and write its record (rank 0)."""
    run_pytorch(run, position, count, born, setup_pytorch, step_pytorch)


def _launcher_of(run: PlannedRun) -> str:
    """The launcher that started this run's ranks, as its plan says (``torchrun`` for PyTorch's strategies)."""
    with open(run.plan) as f:
        return json.load(f).get("launcher", "launch")


def _check_strategy(options: dict) -> None:
    strategy = options.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(f"options['strategy']={strategy!r}: choose one of {', '.join(STRATEGIES)}, "
                         "e.g. options={'strategy': 'ddp'}")


train_run.check_options = _check_strategy  # the launcher checks the options before any process starts
#: How a run names this task (``RunSpec(task=TASK, options={"strategy": ...})``).
TASK = reference_of(train_run)


def page_tasks(path: str | Path) -> tuple[str, str]:
    """The import paths of ``train_pytorch`` and ``train_deepspeed`` in the module chapter 15 wrote at ``path``
    (inside the repository, which the ranks import from), as the tasks of :func:`compare`; the module is made
    importable here too (the launcher imports both to check them), an edited one read again."""
    path = Path(path).resolve()
    module = ".".join(path.relative_to(environment.REPO_ROOT).with_suffix("").parts)
    environment.importable_repository()
    sys.modules.pop(module, None)
    return f"{module}:train_pytorch", f"{module}:train_deepspeed"


# === 2. the comparison with ZeRO ===================================================================

#: PyTorch strategies (:data:`STRATEGIES`), in the order tables show them.
PYTORCH = ("ddp", "ddp-zero1", "fsdp2-grad-op", "fsdp2", "fsdp2-no-sync")
STAGES = (0, 1, 2, 3)
#: The probes of a PyTorch run: the DeepSpeed runs' own, with the profiler in place of the comms logger.
TORCH_PROBES = ("timing", "model_states", "peak_memory", TorchComm, "timeline")
#: DeepSpeed runs keep the comms logger and add the profiler (its section: ``comm_profiler``).
DEEPSPEED_PROBES = probes.DEFAULT + (TorchComm,)


def _label(record: records.Record) -> str:
    return record.summary.get("strategy") or f"ZeRO-{record.stage}"


def compare(model: str = "mlp", steps: int = 4, overrides: dict | None = None, world_size: int | None = None,
            timing_only: bool = False, progress: bool = True, tag: str = "",
            tasks: tuple[str, str] = (TASK, "train")) -> dict[str, records.Record]:
    """Train ``model`` with each of :data:`PYTORCH` (DDP, DDP + ZeroRedundancyOptimizer, FSDP2 in both reshard
    settings and full sharding reducing once a step) and ZeRO 0-3 from ``ds_configs/zero<N>.json`` (the PyTorch
    runs read ``zero0.json`` for the same hyperparameters), ``overrides`` applied to all; two
    launches. ``tasks``: what the PyTorch and the DeepSpeed ranks run (import paths: the chapter's page module,
    :func:`page_tasks`; by default this module's :func:`train_run` and the course's DeepSpeed loop).
    ``timing_only`` leaves out the probes that measure communication (they slow a step).
    Returns {label: record}, labels such as ``"DDP"``, ``"FSDP2 full"``, ``"ZeRO-2"``."""
    torch_probes = ("timing", "peak_memory") if timing_only else TORCH_PROBES
    ds_probes = ("timing", "peak_memory") if timing_only else DEEPSPEED_PROBES
    suffix = f"-{tag}" if tag else ""
    torch_specs = {f"torch-{s}{suffix}": launch.RunSpec("zero0", model=model, steps=steps, overrides=overrides,
                                                        probes=torch_probes, task=tasks[0],
                                                        options={"strategy": s}) for s in PYTORCH}
    ds_specs = {f"deepspeed-zero{s}{suffix}": launch.RunSpec(f"zero{s}", model=model, steps=steps, task=tasks[1],
                                                             overrides=overrides, probes=ds_probes) for s in STAGES}
    runs = dict(launch.sweep(torch_specs, name=f"frameworks-torchrun{suffix}", world_size=world_size,
                             launcher="torchrun", progress=progress))
    runs.update(launch.sweep(ds_specs, name=f"frameworks-deepspeed{suffix}", world_size=world_size, progress=progress))
    return {_label(r): r for r in runs.values()}


def _op(record: records.Record, op: str) -> dict[str, float]:
    return record.comm_ops().get(op, {"count": 0, "bytes": 0})


def zero1_reading(runs: Mapping[str, records.Record], rank: int = 0) -> str:
    """PyTorch's ZeRO-1 (DDP + ZeroRedundancyOptimizer) beside DeepSpeed's ZeRO-1 and DDP, in sentences
    generated from the runs: Adam's states and master copy on ``rank``, and what each sends per step."""
    ours, theirs, ddp = runs["DDP + ZeroRedundancyOptimizer"], runs["ZeRO-1"], runs["DDP"]
    mine, ds, plain = ours.states(rank), theirs.states(rank), ddp.states(rank)
    step_broadcasts = {caller: row for caller, row in ours.summary["comm"]["by_caller"].get("broadcast", {}).items()
                       if "step" in caller}
    calls = sum(row["count"] for row in step_broadcasts.values())
    sent = sum(row["bytes"] for row in step_broadcasts.values())
    gather = _op(theirs, "all_gather_into_tensor")
    n = ours.world_size
    return "\n".join([
        f"Adam's states on rank {rank}: {mine['optimizer']:,} bytes with ZeroRedundancyOptimizer, {ds['optimizer']:,} "
        f"with DeepSpeed's ZeRO-1, {plain['optimizer']:,} with DDP alone; fp32 master copy: {mine['master']:,} and "
        f"{ds['master']:,} bytes.",
        f"Per step, ZeroRedundancyOptimizer adds to DDP's all-reduce {calls:g} broadcasts from its step "
        f"({sent:,.0f} bytes as logged: every rank records every broadcast, as the root of the ones of the "
        f"parameters it owns and a receiver of the rest); DeepSpeed's ZeRO-1 adds one all-gather "
        f"({gather['bytes']:,.0f} bytes: this rank's shard).",
        f"On the wire a broadcast leaves its owner and reaches each of the {n - 1} other rank(s) once: averaged over "
        f"the {n} ranks, a rank sends (n-1)/n of the broadcast bytes, {(n - 1) / n * sent:,.0f} a step (the 'sent "
        f"per rank' column); ZeRO-1's all-gather sends "
        f"{theory.wire_bytes('all_gather', gather['bytes'], n):,.0f}: "
        + ("the same: each rank's updated shard reaches every other rank once either way."
           if math.isclose((n - 1) / n * sent, theory.wire_bytes("all_gather", gather["bytes"], n), rel_tol=0.01)
           else "not the same here.")])


def no_sync_reading(runs: Mapping[str, records.Record], rank: int = 0) -> str:
    """FSDP2 full sharding with and without ``set_requires_gradient_sync(False)`` on the early micro-steps, beside
    ZeRO-2, in sentences generated from the runs: reduce-scatters (or ZeRO-2's all-reduces) per step, their
    bytes, and the gradients held after the first micro-step's backward."""
    synced, held, zero2 = runs["FSDP2 full"], runs["FSDP2 full, no-sync"], runs["ZeRO-2"]
    a, b = _op(synced, "reduce_scatter_tensor"), _op(held, "reduce_scatter_tensor")
    reduce2 = zero2.summary["comm"]["by_caller"]["all_reduce"].get("allreduce_bucket", {"count": 0, "bytes": 0})
    gathers = _op(synced, "all_gather_into_tensor"), _op(held, "all_gather_into_tensor")
    where = held.summary["memory"].get("measured_at", "mid-accumulation")
    return "\n".join([
        f"Gradient reductions per step ({held.grad_accum} micro-steps): FSDP2 full {a['count']:g} reduce-scatters, "
        f"{a['bytes']:,.0f} bytes; with no-sync {b['count']:g}, {b['bytes']:,.0f} bytes; ZeRO-2 {reduce2['count']:g} "
        f"bucket all-reduces, {reduce2['bytes']:,.0f} bytes.",
        f"All-gathers per step: {gathers[0]['count']:g} and {gathers[1]['count']:g} "
        f"({'the same' if gathers[0] == gathers[1] else 'not the same'}): no-sync changes only the reduction.",
        f"Gradients held on rank {rank} at {where}: {synced.states(rank)['grads']:,} bytes with sync (this rank's "
        f"shard), {held.states(rank)['grads']:,} with no-sync (whole, as DDP's {runs['DDP'].states(rank)['grads']:,}); "
        f"at the boundary, after the reduce-scatter, "
        f"{held['memory.model_states_at_boundary_bytes_per_rank'][rank]['grads']:,}."])


def ddp_first_bucket_bytes() -> int:
    """The cap of DDP's first gradient bucket in this torch (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``):
    kept small so that the first all-reduce starts early in backward."""
    return torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def launchers_table(runs: Mapping[str, records.Record]) -> str:
    """How each run was started: the launcher command of its launch (``command.txt``) and the backend."""
    rows = []
    for name, record in runs.items():
        command = (Path(record["launch"]["plan"]).parent / "command.txt").read_text().split()
        module = command[command.index("-m") + 1] if "-m" in command else command[0]
        rows.append([name, f"python -m {module}", record.summary["backend"], record.summary["world_size"]])
    return records.format_table(rows, ["run", "launched with", "backend", "ranks"])


def losses_table(runs: Mapping[str, records.Record], baseline: str = "DDP") -> str:
    """Every run's losses against ``baseline``'s, within the precision's tolerance (no digits: checked)."""
    base = runs[baseline]
    rows = [[name, r.summary["precision"], f"{len(r.losses)} steps",
             "-" if name == baseline else records.loss_agreement(base.losses, r.losses, r.summary["precision"])]
            for name, r in runs.items()]
    return records.format_table(rows, ["run", "precision", "compared", f"losses vs {baseline}"])


def losses_digits(runs: Mapping[str, records.Record], digits: int = 6) -> str:
    """The losses themselves (their digits depend on the processor: print in an ignored cell)."""
    rows = [[name, " ".join(f"{x:.{digits}f}" for x in r.losses)] for name, r in runs.items()]
    return records.format_table(rows, ["run", "losses"])


#: Per run, its model states in fp32 as the bytes a parameter takes in weights, gradients, Adam's two moments and
#: DeepSpeed's fp32 master copy, each with whether the run shards that part over the n ranks.
STATE_FORMULAS: dict[str, tuple[tuple[int, bool], ...]] = {
    "DDP": ((4, False), (4, False), (8, False), (0, False)),
    "ZeRO-0": ((4, False), (4, False), (8, False), (0, False)),
    "DDP + ZeroRedundancyOptimizer": ((4, False), (4, False), (8, True), (0, False)),
    "ZeRO-1": ((4, False), (4, False), (8, True), (4, True)),
    "ZeRO-2": ((4, False), (4, True), (8, True), (4, True)),
    "FSDP2 grad-op": ((4, True), (4, True), (8, True), (0, False)),
    "ZeRO-3": ((4, True), (4, True), (8, True), (4, True)),
    "FSDP2 full": ((4, True), (4, True), (8, True), (0, False)),
    "FSDP2 full, no-sync": ((4, True), (4, False), (8, True), (0, False)),
}


def states_formula(name: str, psi: int, world: int) -> tuple[str, float]:
    """Run ``name``'s model states per rank in fp32 (:data:`STATE_FORMULAS`): the formula in Ψ and n, and its bytes."""
    parts = [(c, sharded) for c, sharded in STATE_FORMULAS[name] if c]
    text = " + ".join(f"{c}Ψ{'/n' if sharded else ''}" for c, sharded in parts)
    return text, sum(c * psi / (world if sharded else 1) for c, sharded in parts)


def symbols(runs: Mapping[str, records.Record]) -> str:
    """What the chapter's formulas' symbols stand for in these runs: Ψ, n and A."""
    r = next(iter(runs.values()))
    return (f"Ψ = {r.params:,} parameters, n = {r.world_size} ranks, A = {r.grad_accum} micro-steps a step, "
            f"{r['precision']}")


def states_table(runs: Mapping[str, records.Record], rank: int = 0) -> str:
    """Measured bytes per rank: parameters, gradients, Adam's states, fp32 master copy (the model states),
    communication buffers, the model states against DDP's, and each run's formula for them
    (:func:`states_formula`) with the measured bytes over the formula's."""
    base = None
    rows = []
    for name, r in runs.items():
        states = r.states(rank)
        total = r.model_state_bytes(rank)
        base = base or total
        text, expected = states_formula(name, r.params, r.world_size)
        rows.append([name, *(f"{states[k]:,}" for k in records.STATE_KEYS), f"{total:,}", f"{total / base:.2f}",
                     text, f"{total / expected:.3f}"])
    first = next(iter(runs))
    return records.format_table(rows, ["run", "params", "grads", "Adam", "master", "buffers", "model states",
                                       f"vs {first}", "formula: weights + grads + Adam + master", "measured/formula"])


def comm_table(runs: Mapping[str, records.Record]) -> str:
    """Per run and collective: calls and bytes per optimizer step and the code that issued them (DeepSpeed's
    function, or PyTorch's FSDP/DDP range), then the totals: bytes per step, and what one rank sends on a
    ring (wire bytes)."""
    rows = []
    for name, r in runs.items():
        comm = r.summary["comm"]
        for op, callers in comm["by_caller"].items():
            for caller, row in callers.items():
                rows.append([name, op, caller or "-", f"{row['count']:g}", f"{row['bytes']:,.0f}"])
        rows.append([name, "= total", comm.get("source", "DeepSpeed comms logger"), "",
                     f"{comm['bytes_per_step']:,.0f}"])
    return records.format_table(rows, ["run", "collective", "issued by", "calls/step", "bytes/step"])


def sent_bytes_per_step(record: records.Record) -> float:
    """Bytes a rank sends per optimizer step, averaged over the ranks: each collective by the ring algorithm
    (:func:`helpers.core.theory.wire_bytes`), except a broadcast. Its owner's message reaches the n-1 other
    ranks, so the ranks together send it n-1 times, (n-1)/n of it a rank, whatever the route; ZeroRedundancyOptimizer
    broadcasts each rank's shard from its owner, as an all-gather would."""
    n = record.world_size
    total = 0.0
    for op, callers in record.summary["comm"]["by_caller"].items():
        for row in callers.values():
            if op.startswith("broadcast"):
                total += (n - 1) / n * row["bytes"]
            else:
                total += theory.wire_bytes(op, row["bytes"] / row["count"], n) * row["count"] if row["count"] else 0
    return total


#: Per run, what it sends per optimizer step: (once per micro-step?, collective, elements in units of Ψ), each
#: sent (n-1)/n per rank on a ring.
WIRE_FORMULAS: dict[str, tuple[tuple[bool, str, int], ...]] = {
    "DDP": ((False, "all-reduce", 2),),
    "ZeRO-0": ((False, "all-reduce", 2),),
    "DDP + ZeroRedundancyOptimizer": ((False, "all-reduce", 2), (False, "broadcasts", 1)),
    "ZeRO-1": ((False, "all-reduce", 2), (False, "all-gather", 1)),
    "ZeRO-2": ((True, "all-reduce", 2), (False, "all-gather", 1)),
    "FSDP2 grad-op": ((True, "all-gather", 1), (True, "reduce-scatter", 1)),
    "ZeRO-3": ((True, "all-gather", 1), (True, "reduce-scatter", 1)),
    "FSDP2 full": ((True, "all-gathers", 2), (True, "reduce-scatter", 1)),
    "FSDP2 full, no-sync": ((True, "all-gathers", 2), (False, "reduce-scatter", 1)),
}


def wire_formula(name: str, psi: int, world: int, accumulation: int, precision: str = "fp32") -> tuple[str, float]:
    """Run ``name``'s bytes sent per rank and step (:data:`WIRE_FORMULAS`): the formula in Ψ and A, and its bytes."""
    terms = WIRE_FORMULAS[name]
    text = " + ".join(f"{'A x ' if per_micro else ''}{op} {'' if c == 1 else c}Ψ" for per_micro, op, c in terms)
    elements = sum(c * psi * (accumulation if per_micro else 1) for per_micro, _, c in terms)
    return text, elements * theory.ring_factor(world) * theory.bytes_per_element(precision)


def summary_table(runs: Mapping[str, records.Record]) -> str:
    """One row per run: collective calls per step, bytes per step as logged, bytes one rank sends
    (:func:`sent_bytes_per_step`), and the run's formula for them (:func:`wire_formula`) with sent over formula."""
    rows = []
    for name, r in runs.items():
        comm = r.summary["comm"]
        calls = sum(row["count"] for row in r.comm_ops().values())
        sent = sent_bytes_per_step(r)
        text, expected = wire_formula(name, r.params, r.world_size, r.grad_accum, r["precision"])
        rows.append([name, f"{calls:g}", f"{comm['bytes_per_step']:,.0f}", f"{sent:,.0f}", text,
                     f"{sent / expected:.3f}"])
    width = theory.bytes_per_element(next(iter(runs.values()))["precision"])
    return records.format_table(rows, ["run", "calls/step", "bytes/step (logged)", "sent per rank",
                                       f"formula, x (n-1)/n x {width} B", "sent/formula"])


#: The step-time column's header: the median of the steps the load guard judges (:func:`median_step_ms`).
STEP_COLUMN = "step ms (median, steps 2+)"


def median_step_ms(record: records.Record) -> float:
    """A run's median step time in milliseconds over the steps :func:`timing_verdict` judges (after the first,
    which warms up), so that a table and the verdict beside it give the same medians."""
    return statistics.median(_steps_s(record)) * 1000


def timing_table(runs: Mapping[str, records.Record]) -> str:
    """Median step time (:func:`median_step_ms`) and peak memory per rank (machine-dependent: print in an
    ignored cell)."""
    rows = [[name, f"{median_step_ms(r):.1f}", records.format_peak(r),
             r.memory.peak_source] for name, r in runs.items()]
    return records.format_table(rows, ["run", STEP_COLUMN, "peak per rank", "peak measured as"])


#: What each strategy is, when to pick it: the stable part of the "which to pick" table (the measured
#: columns come from the runs).
ADVICE = {
    "DDP": "model, gradients and Adam's states fit one device: the simplest, one all-reduce a step",
    "ZeRO-0": "DeepSpeed's data parallelism: DDP's states and traffic, with DeepSpeed's other features",
    "DDP + ZeroRedundancyOptimizer": "Adam's states do not fit, PyTorch-native (ZeRO-1): DDP's all-reduce, then "
                                     "each updated parameter broadcast by its owner",
    "ZeRO-1": "Adam's states do not fit: shard them; DDP's all-reduce plus a gather of updated weights",
    "ZeRO-2": "gradients do not fit either: a reduction every micro-step; weights stay whole",
    "FSDP2 grad-op": "weights do not fit at rest but fit for one step: no gathers in backward",
    "ZeRO-3": "weights do not fit: DeepSpeed keeps small models gathered between uses (chapter 05)",
    "FSDP2 full": "weights do not fit: PyTorch-native, every layer gathered twice a micro-step",
    "FSDP2 full, no-sync": "as FSDP2 full, with whole gradients held between micro-steps: one reduce-scatter a step",
}


def pick_table(runs: Mapping[str, records.Record], baseline: str = "DDP") -> str:
    """Which to pick: per run, model states per rank and bytes a rank sends per step (:func:`sent_bytes_per_step`)
    against ``baseline``, whether
    its losses agree, and when it is the right choice."""
    base = runs[baseline]
    rows = []
    for name, r in runs.items():
        rows.append([name, f"{r.model_state_bytes() / base.model_state_bytes():.2f}x",
                     records.format_ratio(sent_bytes_per_step(r), sent_bytes_per_step(base), suffix="x"),
                     records.loss_agreement(base.losses, r.losses, r.summary["precision"]) if name != baseline else "-",
                     ADVICE.get(name, "")])
    return records.format_table(rows, ["run", f"states vs {baseline}", f"sent vs {baseline}", "losses",
                                       "pick it when"])


def ordered(runs: Mapping[str, records.Record]) -> dict[str, records.Record]:
    """Runs in the order of how much they shard: DDP, ZeRO-0, DDP + ZeroRedundancyOptimizer, ZeRO-1, ZeRO-2,
    FSDP2 grad-op, ZeRO-3, FSDP2 full, FSDP2 full with no-sync accumulation."""
    order = ["DDP", "ZeRO-0", "DDP + ZeroRedundancyOptimizer", "ZeRO-1", "ZeRO-2", "FSDP2 grad-op", "ZeRO-3",
             "FSDP2 full", "FSDP2 full, no-sync"]
    return {name: runs[name] for name in order if name in runs} | {k: v for k, v in runs.items() if k not in order}


# --- on GPUs ----------------------------------------------------------------------------------

GPU_MODEL = "llama-medium"
GPU_OVERRIDES = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1}


def gpu_compare(steps: int = 12, world_size: int | None = None, progress: bool = True,
                tasks: tuple[str, str] = (TASK, "train")) -> tuple[dict[str, records.Record], dict[str, records.Record]]:
    """On GPUs: the comparison on the 85M-parameter model in bf16, twice: with the probes that measure
    communication (bytes), and with timing only (step time without the comms logger's synchronization or
    the profiler). Four launches. Returns (by bytes, by time), each {label: record}."""
    by_bytes = compare(GPU_MODEL, steps, GPU_OVERRIDES, world_size, progress=progress, tag="gpu-bytes", tasks=tasks)
    by_time = compare(GPU_MODEL, steps, GPU_OVERRIDES, world_size, timing_only=True, progress=progress,
                      tag="gpu-time", tasks=tasks)
    return ordered(by_bytes), ordered(by_time)


def bytes_per_step(record: records.Record) -> str:
    """A run's bytes per step, or what is missing: the profiler can count a collective yet record no
    message size (seen for DDP's bucket all-reduce on NCCL), and zero bytes would then be a false figure."""
    calls = sum(row["count"] for row in record.comm_ops().values())
    if record.comm.bytes_per_step == 0 and calls:
        return f"? ({calls:.3g} collectives a step, no sizes recorded)"
    return records.format_bytes(record.comm.bytes_per_step)


def gpu_table(by_bytes: Mapping[str, records.Record], by_time: Mapping[str, records.Record]) -> str:
    """Per run: model states and peak memory per rank, bytes per step, median step time (:func:`median_step_ms`),
    losses vs DDP."""
    base = by_bytes.get("DDP")
    rows = []
    for name, r in by_bytes.items():
        t = by_time.get(name)
        rows.append([name, records.format_bytes(r.model_state_bytes()),
                     records.format_peak(t) if t else "-",
                     bytes_per_step(r),
                     f"{median_step_ms(t):.1f}" if t else "-",
                     records.loss_agreement(base.losses, r.losses, r.summary["precision"])
                     if base is not None and name != "DDP" else "-"])
    return records.format_table(rows, ["run", "model states/rank", "peak/rank", "bytes/step", STEP_COLUMN,
                                       "losses vs DDP"])


def save_gpu_reference(by_bytes: Mapping[str, records.Record], by_time: Mapping[str, records.Record],
                       note: str) -> Path | None:
    """Keep both GPU comparisons as one reference file (``runs/reference/frameworks-<N>x<GPU>.json``)."""
    runs = {f"bytes: {k}": r for k, r in by_bytes.items()} | {f"time: {k}": r for k, r in by_time.items()}
    return references.save_reference("frameworks", runs, note)


def reference_report(name: str = "frameworks") -> str:
    """The committed GPU comparisons, each labelled with its device, date and note."""
    def tables(by_bytes: dict, by_time: dict) -> str:
        both = {k: r for k, r in by_bytes.items() if "comm_profiler" in r.summary}
        return gpu_table(by_bytes, by_time) + (f"\n\nDeepSpeed's runs, by its comms logger and by the profiler:\n"
                                               f"{profiler_check_table(both)}" if both else "")

    return references.bytes_and_time_report(
        name, tables, how="run this notebook on a machine with 2 or more NVIDIA GPUs to measure them.")


def _steps_s(record: records.Record) -> list[float]:
    """A run's step times in seconds after the first step (which warms up)."""
    return record.timing.all_s[1:] or record.timing.all_s


#: Pairs of runs whose step times the chapter compares: the same states per rank, a framework each.
TIMED_PAIRS = (("DDP", "ZeRO-0"), ("FSDP2 full", "ZeRO-3"))


def timing_verdict(runs: Mapping[str, records.Record], load: load_guard.Load | None,
                   pairs: Sequence[tuple[str, str]] = TIMED_PAIRS) -> str:
    """Each pair's step times through the course's load guard (:func:`load_guard.compare`): a verdict only where
    the launches had their devices to themselves (``load``) and the difference exceeds the steps' spread;
    otherwise the line says why it withholds one."""
    lines = [f"Load beside the launches: {load.reason() or 'none, they had their devices to themselves'}."
             if load is not None else "Load beside the launches: not recorded."]
    for a, b in pairs:
        if a in runs and b in runs:
            verdict = load_guard.compare({a: _steps_s(runs[a]), b: _steps_s(runs[b])}, load)
            lines.append(f"{a} against {b}: {load_guard.sentence(verdict)}")
    return "\n".join(lines)


def gpu_time_reading(name: str = "frameworks", pairs: Sequence[tuple[str, str]] = TIMED_PAIRS) -> str:
    """For each committed GPU comparison with timing runs: each pair's step times through the load guard, under
    the load the reference's written conditions state (:meth:`~helpers.core.load_guard.Load.from_conditions`:
    alone only where they say so)."""
    lines = []
    for (device, date, _, found), conditions in zip(references.reference_runs(name),
                                                    references.reference_conditions(name)):
        timed = {key.removeprefix("time: "): r for key, r in found.items()
                 if key.startswith("time: ") and isinstance(r, records.Record)}
        if timed:
            load = load_guard.Load.from_conditions(conditions)
            lines.append(f"{device}, {date}:\n{timing_verdict(timed, load, pairs)}")
    return "\n".join(lines) or references.no_references(name)


# --- figures ----------------------------------------------------------------------------------------

def _tick(label: str) -> str:
    """A run's label on lines of at most 15 characters (``ZeroRedundancyOptimizer`` split after "ZeroRedundancy")."""
    return textwrap.fill(label.replace("ZeroRedundancyOptimizer", "ZeroRedundancy- Optimizer"), 15,
                         break_long_words=False, break_on_hyphens=False).replace("- \n", "-\n")


def states_per_rank(runs: Sequence[records.Record], rank: int = 0, title: str = "Model states on one rank"):
    """Stacked bars of measured params / grads / optimizer / master on ``rank``, one bar per run; a run's
    communication buffers (not model states; DeepSpeed's default bucket is far larger than a small model) are
    written above its bar instead of drawn, so they do not flatten the states."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(runs), 3.8))
    for i, run in enumerate(runs):
        bottom = 0.0
        for key in records.STATE_KEYS:
            value = run.states(rank).get(key, 0) / 2**20
            if value and key != "buffers":
                ax.bar(i, value, 0.6, bottom=bottom, color=plots.STATE_COLOURS[key], edgecolor="white",
                       label=key if key not in ax.get_legend_handles_labels()[1] else None)
                bottom += value
        buffers = run.states(rank).get("buffers", 0)
        if buffers:
            ax.text(i, bottom, f"+ buffers\n{records.format_bytes(buffers)}", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    ax.set_xticks(range(len(runs)), [_tick(r.label) for r in runs], fontsize=8)
    ax.set_ylabel(f"MiB on rank {rank}")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def bytes_per_step_figure(runs: Sequence[records.Record], title: str = "Bytes per optimizer step, by collective"):
    """Stacked bars of each run's logged bytes per step, by collective (message sizes, as the comms logger
    and the torch_comm probe record them)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(runs), 3.8))
    ops = sorted({op for r in runs for op in r.comm_ops()})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        bottom = 0.0
        for j, op in enumerate(ops):
            row = run.comm_ops().get(op)
            if row and row["bytes"]:
                ax.bar(i, row["bytes"] / 2**20, 0.6, bottom=bottom, color=colours[j % len(colours)],
                       label=op if op not in ax.get_legend_handles_labels()[1] else None)
                bottom += row["bytes"] / 2**20
    ax.set_xticks(range(len(runs)), [_tick(r.label) for r in runs], fontsize=8)
    ax.set_ylabel("MiB per step (logged message sizes)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig



# --- the key figure and the exercises ---------------------------------------------------------------

def tradeoff_figure(runs: Mapping[str, records.Record], baseline: str = "DDP",
                    title: str = "Memory against traffic: each run against DDP"):
    """One point per run: model states per rank (x) and bytes a rank sends per step (y, :func:`sent_bytes_per_step`),
    both against ``baseline``'s;
    PyTorch's runs as circles, DeepSpeed's as squares. Left and low is cheap in both."""
    plt = plots.pyplot()
    base = runs[baseline]
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name, r in runs.items():
        x = r.model_state_bytes() / base.model_state_bytes()
        y = sent_bytes_per_step(r) / sent_bytes_per_step(base)
        deepspeed = name.startswith("ZeRO-")
        ax.scatter(x, y, marker="s" if deepspeed else "o", s=50, color="#C44E52" if deepspeed else "#4C72B0")
        # PyTorch's labels above their points, DeepSpeed's below: neighbours such as DDP and ZeRO-0 coincide
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, -11) if deepspeed else (6, 4), fontsize=7)
    ax.scatter([], [], marker="o", color="#4C72B0", label="PyTorch")
    ax.scatter([], [], marker="s", color="#C44E52", label="DeepSpeed")
    ax.set(xlabel=f"model states per rank, x {baseline}'s", ylabel=f"bytes a rank sends per step, x {baseline}'s",
           title=title)
    ax.set_xlim(0.4, 1.15)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plt.close(fig)
    return fig


def exercise_no_sync_states(answer: Any, runs: Mapping[str, records.Record], name: str = "FSDP2 full, no-sync",
                            rank: int = 0) -> exercises.Verdict:
    """Exercise: predict the model-state bytes rank ``rank`` holds in the FSDP2 no-sync run, measured after the
    first micro-step's backward (mid-accumulation); the answer is the ``model_states`` probe's, within 1%."""
    run = runs[name]
    params, world = run.summary["model"]["params"], run.world_size
    states = run.states(rank)
    return exercises.number(
        "FSDP2 no-sync's model states", answer, run.model_state_bytes(rank), relative=0.01, unit=" bytes",
        task=(f"Predict the bytes of model states (weights, gradients, Adam's states) rank {rank} holds in the "
              f"'{name}' run after the first micro-step's backward, for this {params:,}-parameter fp32 model on "
              f"{world} ranks."),
        hint=("FSDP2 keeps every fp32 tensor sharded over the ranks (4 bytes a number, Adam two of them) and no "
              "master copy; the table of section 1 says which one no-sync holds whole between micro-steps."),
        why=(f"Measured on rank {rank}: weights {states['params']:,} (a shard), gradients {states['grads']:,} (whole: "
             f"the reduce-scatter waits for the last micro-step), Adam {states['optimizer']:,} (a shard). Plain FSDP2 "
             f"full, its gradients sharded too, holds {runs['FSDP2 full'].model_state_bytes(rank) / run.model_state_bytes(rank):.2f}x "
             "as much: no-sync pays the whole gradients' memory for one reduce-scatter a step."))


def exercise_zero_redundancy_bytes(answer: Any, runs: Mapping[str, records.Record],
                                   name: str = "DDP + ZeroRedundancyOptimizer") -> exercises.Verdict:
    """Exercise: predict the bytes per step (as logged) of DDP with ZeroRedundancyOptimizer; the answer is the
    profiler's count on the chapter's run, within 2%."""
    run = runs[name]
    params = run.summary["model"]["params"]
    grads = run.states()["grads"]
    return exercises.number(
        "ZeroRedundancyOptimizer's bytes", answer, run.comm.bytes_per_step, relative=0.02, unit=" bytes",
        task=(f"Predict the bytes per optimizer step that {name} logs for this {params:,}-parameter fp32 model "
              "(all_reduce: the whole tensor; broadcast: the whole message)."),
        hint=("DDP's part reduces the gradients once a step (no_sync skips the first micro-step); after "
              "step() each parameter's owner broadcasts it to the others. 4 bytes a number."),
        why=(f"Measured by the profiler: DDP all-reduces the whole gradients once ({grads:,} bytes), then every "
             f"parameter is broadcast by the rank that updated it (the same {grads:,} again), plus the few bytes "
             "of DDP's bucket rebuild: twice DDP's bytes as logged, because every rank logs every broadcast, "
             "the ones it sends and the ones it receives; on the wire each leaves its owner only (the 'sent per "
             "rank' column below)."))


def exercise_zero1_config(answer: Any, runs: Mapping[str, records.Record], world_size: int = 2) -> exercises.Verdict:
    """Exercise: write the ds_config of DeepSpeed's side of PyTorch's ZeRO-1 comparison: the PyTorch runs'
    hyperparameters (the DDP record's config) at the ZeRO stage the ZeRO-1 run used. The course's checker and
    DeepSpeed's parser read it for ``world_size`` ranks."""
    torch_config = runs["DDP"].summary["config"]
    stage = runs["ZeRO-1"].summary["config"]["zero_optimization"]["stage"]

    def test(config: Any) -> tuple[bool, str]:
        if not isinstance(config, dict):
            return False, f"{type(config).__name__} is not a ds_config: write a dict."
        if refused := configs.refusal(config, world_size, parse=True):
            return False, refused
        got_stage = config.get("zero_optimization", {}).get("stage", 0)
        if got_stage != stage:
            return False, (f"stage {got_stage}: ZeroRedundancyOptimizer shards Adam's states only, and so does "
                           f"stage {stage}.")
        wanted = {"train_micro_batch_size_per_gpu": torch_config["train_micro_batch_size_per_gpu"],
                  "gradient_accumulation_steps": torch_config.get("gradient_accumulation_steps", 1),
                  "gradient_clipping": torch_config.get("gradient_clipping", 0.0),
                  "optimizer.type": torch_config["optimizer"]["type"].lower(),
                  "optimizer.lr": torch_config["optimizer"]["params"]["lr"],
                  "optimizer.weight_decay": torch_config["optimizer"]["params"].get("weight_decay", 0.0)}
        optimizer = config.get("optimizer", {})
        got = {"train_micro_batch_size_per_gpu": config.get("train_micro_batch_size_per_gpu"),
               "gradient_accumulation_steps": config.get("gradient_accumulation_steps", 1),
               "gradient_clipping": config.get("gradient_clipping", 0.0),
               "optimizer.type": str(optimizer.get("type", "")).lower(),
               "optimizer.lr": optimizer.get("params", {}).get("lr"),
               "optimizer.weight_decay": optimizer.get("params", {}).get("weight_decay", 0.0)}
        differ = [f"{k} {got[k]!r} (the PyTorch runs: {v!r})" for k, v in wanted.items() if got[k] != v]
        if differ:
            return False, "not the PyTorch runs' hyperparameters: " + "; ".join(differ) + "."
        return True, (f"stage {stage} with the PyTorch runs' batch, AdamW and clipping: the config of this "
                      f"chapter's ZeRO-1 run, whose losses matched ZeroRedundancyOptimizer's "
                      f"({records.loss_agreement(runs['DDP + ZeroRedundancyOptimizer'].losses, runs['ZeRO-1'].losses, 'fp32')}).")
    return exercises.satisfies(
        "ZeRO-1 config", answer, test,
        task=("Write the whole ds_config for DeepSpeed's counterpart of DDP + ZeroRedundancyOptimizer, with the "
              "PyTorch runs' hyperparameters (the list at the top of the chapter)."),
        hint="four top-level keys and a zero_optimization block; the optimizer is a dict with type and params.")
