"""The script every rank runs, started by DeepSpeed's launcher or torchrun (see :mod:`helpers.core.launch`).

    python -m deepspeed.launcher.launch ... --module helpers.core.train --plan DIR/plan.json

The plan (:class:`helpers.core.plan.Plan`) lists one run or several (a sweep): each is trained in turn by
the same ranks, with its own ``deepspeed.initialize``, and torn down before the next. Every run is the
source article's loop, :func:`train_run` and :func:`data_parallel_step`::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(steps):
        for micro_step in range(grad_accum):
            loss = loss_of(engine, batch)
            engine.backward(loss)
            engine.step()        # DeepSpeed applies the optimizer on the last micro-step
    engine.destroy()

with the run's probes (:mod:`helpers.core.probes`) called around it; rank 0 writes the run's
``summary.json`` into its folder (schema: :mod:`helpers.core.records`).

A run names what differs by import path (:func:`helpers.core.plan.resolve`): its trainer (one optimizer
step; :func:`data_parallel_step` unless the run names another, such as a pipeline's ``train_batch``), its
model builder, its ``initialize`` (the call to ``deepspeed.initialize``; :func:`initialize` unless the run
names a chapter's own, which passes Ulysses' ``mpu``, say), a ``before_training`` hook (to load a checkpoint,
say), or a whole task that is not DeepSpeed training (PyTorch's DDP and FSDP2, a collectives benchmark).
Those share this loop and record through :func:`train_and_record`.

One loss definition everywhere: the loss of an optimizer step is the mean of its micro-batch
losses on a rank, averaged over the ranks. The ranks report their own; the launcher averages.

Lines starting with ``@@course`` on stdout are events for the launcher (progress, errors);
everything else is DeepSpeed's own log.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import json
import os
import signal
import statistics
import sys
import time
import traceback
from typing import Sequence

import psutil
import torch

from helpers.core import cpu_info, ds, memory, models, theory
from helpers.core.faults import Faults
from helpers.core.plan import STACK_SIGNAL, Plan, PlannedRun, emit, publish, resolve, write_json
from helpers.core.probes import Probe, RunContext, Timeline, deep_update, missing_keys, resolve_probe

# Every rank imports this module (its loop below, or a script's `from helpers import measure`): DeepSpeed's CPU
# ops then read py-cpuinfo's answer kept for this processor instead of asking it, a second and more each time.
cpu_info.remember()


def exempt_imports_from_gc() -> None:
    """Put every object alive now out of the garbage collector's reach (``gc.freeze``): the modules of torch,
    DeepSpeed and the course, some 400,000 objects. A sweep's ``gc.collect()`` between runs then scans only what
    was made since, about a millisecond instead of 0.1-0.2 s a call on a CPU. Call it before any model or engine
    exists (what it freezes is never collected). ``torch._dynamo``, which DeepSpeed's first ``initialize``
    imports (its Muon optimizer is compiled), is imported first so that it is frozen too."""
    import torch._dynamo  # noqa: F401  (deferred: only a rank pays for its import)

    gc.freeze()


if "LOCAL_RANK" in os.environ:  # a rank started by a launcher (a notebook's kernel has none): no model yet
    exempt_imports_from_gc()


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (``PR_SET_PDEATHSIG``).

    The ranks' parent is DeepSpeed's launcher; if it is killed outright, no rank must live on.
    Elsewhere than Linux this does nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="plan.json written by helpers.core.launch")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    return parser.parse_args(argv)


def _wait_for_json(path: str, timeout: float = 120.0) -> dict:
    """Read a JSON file another rank is about to write."""
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s: did that rank die?")
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def precision_of(config: dict) -> str:
    """"bf16", "fp16" or "fp32", as the config enables."""
    if config.get("bf16", {}).get("enabled"):
        return "bf16"
    if config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def data_parallel_step(ctx: RunContext, run: PlannedRun, step: int, probes: list[Probe]) -> list[float]:
    """One optimizer step of data-parallel training, the loop of the source article: ``grad_accum``
    micro-steps of forward, ``engine.backward`` and ``engine.step`` (DeepSpeed applies the optimizer on
    the last one). Returns this rank's micro-batch losses."""
    engine = ctx.engine
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for micro_step in range(ctx.grad_accum):
        indices = models.sample_indices(step, micro_step, ctx.dp_rank, ctx.dp_size, ctx.micro_batch, ctx.grad_accum)
        batch = models.make_batch(run.model, indices, run.seed)
        batch = batch.to(engine.device, dtype if run.cast_inputs else None)
        loss = models.loss_of(engine, run.model, batch)
        engine.backward(loss)
        for probe in probes:
            probe.after_backward(ctx, step, micro_step)
        engine.step()
        losses.append(loss.item())
    return losses


def data_parallel_coords(engine) -> tuple[int, int]:
    """This rank's place among the ranks that read different samples, and their number.

    Every rank with plain data parallelism (ZeRO included); fewer with tensor parallelism (the ranks of
    one tensor-parallel group read the same samples), pipeline parallelism (the stages of one pipeline
    read the same micro-batches) or sequence parallelism (the ranks of one group split each sample's tokens).
    """
    dist = ds.load("deepspeed.comm")

    if engine.dp_world_size is None:  # a sequence-parallel mpu: the ranks of one group share each sample
        sequence = int(engine.sequence_parallel_size)
        return (dist.get_rank(group=engine.seq_data_parallel_group) // sequence,
                int(engine.seq_dp_world_size) // sequence)
    size = int(engine.dp_world_size)
    group = getattr(engine, "data_parallel_group", None)
    if size == 1:
        return 0, 1
    return (dist.get_rank(group=group) if group is not None else dist.get_rank()), size


def initialize(model: torch.nn.Module, config: dict, run: PlannedRun):
    """The source article's ``deepspeed.initialize``: the run's engine (a run's default ``initialize``).
    With ``run.client_optimizer``, ``torch.optim.AdamW`` is built here and passed in, as the article does."""
    deepspeed = ds.load()
    client_optimizer = None
    if run.client_optimizer:
        lr = config.get("optimizer", {}).get("params", {}).get("lr", 1e-4)
        client_optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer,
                                           model_parameters=None if client_optimizer else model.parameters(),
                                           config=config)
    return engine


def make_engine(model: torch.nn.Module, config: dict, run: PlannedRun):
    """The engine the run's ``initialize`` (an import path: :func:`initialize`, or a chapter's own) makes of
    ``model``; it may return the engine or ``deepspeed.initialize``'s whole tuple."""
    made = resolve(run.initialize)(model, config, run)
    engine = made[0] if isinstance(made, tuple) else made
    if not hasattr(engine, "backward") or not hasattr(engine, "step"):
        raise TypeError(f"initialize {run.initialize!r} returned {type(engine).__name__}: return the engine "
                        "deepspeed.initialize made (its first value)")
    return engine


def before_training(engine, run: PlannedRun) -> int:
    """The run's ``before_training`` hook, if it names one: ``function(engine, run)`` called after
    ``deepspeed.initialize`` and before the probes start (to load a checkpoint, say). It returns the
    0-based optimizer step training starts from (0 for a fresh run); the loop and the probes start there."""
    hook = run.before_training
    first = resolve(hook)(engine, run) if hook else 0
    if not isinstance(first, int) or not 0 <= first < run.steps:
        raise ValueError(f"before_training hook {hook!r} returned step {first!r}: a run of {run.steps} steps "
                         f"can start at steps 0..{run.steps - 1}")
    return first


def train_run(run: PlannedRun, position: int, count: int, born: float) -> None:
    """Train one run of the plan on this rank, write its record (rank 0), and tear its engine down."""
    dist = ds.load("deepspeed.comm")

    run_started = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = run.read_config()
    model = resolve(run.builder)(run.model, run.seed, config, **run.model_options)
    psi = models.count_parameters(model)
    # The three lines of the source article: wrap (the run's initialize), then backward and step through the engine.
    engine = make_engine(model, config, run)
    ctx = None  # holds the engine: dropped with it at teardown
    try:
        first_step = before_training(engine, run)
        ctx = RunContext(
            engine=engine, rank=rank, world_size=world, device_type="cuda" if engine.device.type == "cuda" else "cpu",
            precision=precision_of(config), stage=engine.zero_optimization_stage(),
            micro_batch=engine.train_micro_batch_size_per_gpu(), grad_accum=engine.gradient_accumulation_steps(),
            steps=run.steps, params=psi, born=born, run_started=run_started, config=config,
            faults=run.faults, first_step=first_step, options=run.options)
        ctx.dp_rank, ctx.dp_size = data_parallel_coords(engine)
        train_and_record(ctx, run, position, count, resolve(run.trainer), {
            # DeepSpeed's own figure can count more ranks than read samples: with tensor parallelism it
            # counts every rank, not the data-parallel ones (train_batch is what a step consumes)
            "deepspeed_train_batch": engine.train_batch_size(),
            "optimizer": memory.describe_optimizer(engine),
            "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
        })
    finally:
        # Teardown before the next run: without it ZeRO-3 keeps hooks and gathered parameters alive.
        compiled = bool(getattr(engine, "is_compiled", False))
        engine.destroy()
        release_zero3_references(engine.module)
        # Every reference this frame holds goes before the collection: the engine sits in reference cycles
        # (its hooks), which only the collector frees, and a run's peak memory must not include the last run's.
        del engine, model, ctx
        # A pipeline or tensor-parallel engine leaves its groups in DeepSpeed's module globals (groups.mpu
        # and friends), which the next engine of a sweep would inherit: forget them (the process groups
        # themselves stay; every rank makes the same call, so later group creation stays in step).
        groups = ds.load("deepspeed.utils.groups")

        groups._release_process_group_references(None)
        if compiled:  # torch.compile's caches keep a compiled ZeRO-3 engine's modules (its guards on DeepSpeed's hooks)
            torch._dynamo.reset()
        # twice: objects the first collection finalizes can hold the last references to the engine's cycles
        gc.collect()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def release_zero3_references(module) -> None:
    """Drop what DeepSpeed 0.19.8's ZeRO-3 keeps of an engine after ``engine.destroy()``, which otherwise
    keeps the engine, its model and its optimizer states alive for the life of the process (so in a sweep,
    the GPU memory of every earlier run): the top module it puts on the module-level
    ``parameter_offload.FWD_MODULE_STACK`` and never takes off, and the entries of
    ``PartitionedParameterCoordinator.__params_to_release``, a class-level ``functools.lru_cache`` keyed
    by (coordinator, module, step). ``tests/test_launch.py`` checks that no engine outlives its run."""
    parameter_offload = ds.load("deepspeed.runtime.zero.parameter_offload")
    PartitionedParameterCoordinator = ds.load("deepspeed.runtime.zero.partitioned_param_coordinator").PartitionedParameterCoordinator

    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if m is not module]
    method = PartitionedParameterCoordinator.__dict__.get("_PartitionedParameterCoordinator__params_to_release")
    # DeepSpeed wraps the cached method in its NVTX decorator (no functools.wraps): the cache is the
    # decorator's closure variable ``func``
    code, cells = getattr(method, "__code__", None), getattr(method, "__closure__", None) or ()
    inner = dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("func") if code else None
    for cached in (method, inner):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


class Recorder:
    """One run's probes on one rank, and its record: call :meth:`before_step`, :meth:`after_backward` and
    :meth:`after_step` around the training loop, then :meth:`finish`. Every rank's findings reach rank 0
    through files in ``out`` (no collective the comms logger would count, nothing in flight at teardown);
    rank 0 returns the summary (core keys, the caller's fields, then each probe's sections).

    The course's rank loop (:func:`train_and_record`) and a learner's own script (:mod:`helpers.measure`)
    record through it, so their records have the same schema and read the same way.
    """

    def __init__(self, ctx: RunContext, probes: Sequence[str], out: str, name: str, model: str,
                 seed: int | None = None, plan: str = "", position: int = 0, count: int = 1):
        self.ctx, self.out, self.name, self.model, self.seed = ctx, out, name, model, seed
        self.plan, self.position, self.count = plan, position, count
        self.probes = [resolve_probe(reference)() for reference in probes]
        self.losses: list[float] = []
        for probe in self.probes:
            probe.start(ctx)

    def before_step(self, step: int) -> None:
        for probe in self.probes:
            probe.before_step(self.ctx, step)

    def after_backward(self, step: int, micro_step: int) -> None:
        for probe in self.probes:
            probe.after_backward(self.ctx, step, micro_step)

    def after_step(self, step: int, micro_losses: Sequence[float]) -> float:
        """Close optimizer step ``step`` (0-based); return its loss on this rank (the mean of its micro-batches)."""
        for probe in self.probes:
            probe.after_step(self.ctx, step)
        self.losses.append(statistics.fmean(micro_losses))
        return self.losses[-1]

    def finish(self, fields: dict) -> dict | None:
        """Write this rank's findings; on rank 0, wait for the others' and return the run's summary
        (``fields`` may replace any core key, ``theory`` included); None on the other ranks."""
        ctx, probes, losses = self.ctx, self.probes, self.losses
        mine = {"losses": losses, "probes": {p.name: p.finish(ctx) for p in probes}}
        write_json(os.path.join(self.out, f"rank{ctx.rank}.json"), mine)
        if ctx.rank != 0:
            return None
        ranks = [mine] + [_wait_for_json(os.path.join(self.out, f"rank{r}.json")) for r in range(1, ctx.world_size)]
        psi, stage, world, precision = ctx.params, ctx.stage, ctx.world_size, ctx.precision
        summary = {
            "name": self.name,
            "world_size": world,
            "backend": torch.distributed.get_backend(),
            "device": ctx.device_type,
            "device_name": torch.cuda.get_device_name(0) if ctx.device_type == "cuda" else "cpu",
            "zero_stage": stage,
            "precision": precision,
            "micro_batch": ctx.micro_batch,
            "grad_accum": ctx.grad_accum,
            # samples one optimizer step consumes: every rank reads its own, unless tensor or pipeline
            # parallelism makes several ranks share a micro-batch
            "train_batch": ctx.micro_batch * ctx.grad_accum * ctx.dp_size,
            "data_parallel_size": ctx.dp_size,
            "steps": ctx.steps,
            "seed": self.seed,
            "model": {"name": self.model, "params": psi},
            "first_step": ctx.first_step,
            "losses": [statistics.fmean(r["losses"][i] for r in ranks) for i in range(len(losses))],
            "losses_per_rank": [r["losses"] for r in ranks],
            "probes": [p.name for p in probes if not isinstance(p, Faults)],
            "probe_keys": {p.name: list(p.keys) for p in probes if p.keys},
            "launch": {"position": self.position + 1, "of": self.count, "plan": self.plan},
            "theory": {
                "model_states_bytes_per_rank": theory.model_state_bytes(psi, stage, world, precision),
                "comm_bytes_per_step": theory.comm_bytes_per_step(psi, stage, precision),
                "comm_wire_bytes_per_step": theory.comm_bytes_per_step(psi, stage, precision) * theory.ring_factor(world),
            },
            **fields,
            "config": ctx.config,
        }
        for probe in probes:
            deep_update(summary, probe.combine([r["probes"][probe.name] for r in ranks], ctx))
            missing = missing_keys(summary, probe.keys)
            if missing:
                raise RuntimeError(f"probe {probe.name!r} ({type(probe).__module__}.{type(probe).__qualname__}) declares "
                                   f"keys {missing} but did not write them: fix its combine() or its keys")
        return summary


def train_and_record(ctx: RunContext, run: PlannedRun, position: int, count: int, trainer, fields: dict) -> None:
    """The training loop with the run's probes around it (:class:`Recorder`), then the run's record:
    rank 0 writes ``summary.json`` into the run's folder.

    Shared by every way of training (DeepSpeed's engine here, PyTorch's DDP and FSDP2 in
    :mod:`helpers.topics.frameworks`): ``trainer(ctx, run, step, probes)`` takes one optimizer step and
    returns this rank's micro-batch losses. ``fields`` may replace any core key (``theory`` included).
    """
    recorder = Recorder(ctx, run.probes, run.out, run.name, run.model, run.seed, run.plan, position, count)
    for step in range(ctx.first_step, ctx.steps):
        recorder.before_step(step)
        loss = recorder.after_step(step, trainer(ctx, run, step, recorder.probes))
        emit("step", run=position, rank=ctx.rank, step=step + 1, steps=ctx.steps, loss=loss)
    summary = recorder.finish(fields)
    if summary is not None:
        publish(run, position, summary)


def init_process_group(launcher: str):
    """Join the launch's process group as its launcher expects; return the module whose ``get_rank``
    and ``destroy_process_group`` the ranks use.

    DeepSpeed's launchers: ``deepspeed.init_distributed()`` (DeepSpeed's communication layer, which its
    comms logger watches). ``torchrun``: ``torch.distributed.init_process_group`` alone, as a PyTorch
    script does (gloo on CPU, NCCL on GPUs); DeepSpeed is not imported unless a run uses it.
    """
    if launcher == "torchrun":
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return torch.distributed
    deepspeed = ds.load()
    dist = ds.load("deepspeed.comm")

    deepspeed.init_distributed()
    return dist


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    die_with_parent()
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=False)
    try:
        born = psutil.Process().create_time()  # where a launch's seconds go, from this process's start
        plan = Plan.read(args.plan)
        if plan.launcher != "torchrun":
            ds.load()  # imported before the clock reads "imports", as it always was

        Timeline.process_marks["imports"] = round(time.time() - born, 3)
        dist = init_process_group(plan.launcher)
        exempt_imports_from_gc()  # DeepSpeed's modules and the process group's, imported since this module was
        Timeline.process_marks["init_distributed"] = round(time.time() - born, 3)
        for position, run in enumerate(plan.runs):
            if dist.get_rank() == 0:
                emit("run_start", run=position)
            try:
                task = train_run if run.task == "train" else resolve(run.task)
                task(run, position, len(plan.runs), born)
            except Exception as error:
                if run.on_error != "record":
                    raise
                # a run expected to fail (the checker's tests): report it and go on with the next
                emit("run_error", run=position, rank=dist.get_rank(), type=type(error).__name__,
                     message=str(error), traceback=traceback.format_exc())
            Timeline.process_marks.clear()  # later runs of a sweep did not pay for them
            torch.distributed.barrier()  # raw torch: the comms logger does not see it
        # Without this ZeRO-3 aborts at interpreter exit ("terminate called without an active
        # exception") although training finished.
        dist.destroy_process_group()
        # Everything is written: leave without the interpreter's teardown of torch and DeepSpeed
        # (about half a second per rank, paid by every launch).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException as error:  # report the real error, then leave at once
        rank = int(os.environ.get("RANK", "0"))
        emit("error", rank=rank, type=type(error).__name__, message=str(error), traceback=traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a half-initialized process group can hang there


if __name__ == "__main__":
    main()
