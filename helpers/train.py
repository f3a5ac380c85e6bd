"""The training script every rank runs, started by DeepSpeed's launcher (see ``helpers.launch``).

    python -m deepspeed.launcher.launch ... --module helpers.train --config ds_config.json --out DIR

It is the source article's loop (``deepspeed.initialize``, ``engine.backward``, ``engine.step``)
with measurements around it. Rank 0 writes ``DIR/summary.json`` (schema: ``helpers.records``).
Lines starting with ``@@course`` on stdout are events for the launcher (progress, errors);
everything else is DeepSpeed's own log.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

EVENT_PREFIX = "@@course "


#: Ranks share the launcher's stdout; one write() of at most this many bytes is never interleaved
#: with another process's write (POSIX PIPE_BUF).
ATOMIC_WRITE_BYTES = 4096


def emit(event: str, **fields) -> None:
    """Send one event to the process that launched the run, as one line written in one piece."""
    line = (EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n").encode()
    if len(line) > ATOMIC_WRITE_BYTES and "traceback" in fields:  # keep the end of a long traceback
        fields["traceback"] = "...\n" + fields["traceback"][-(ATOMIC_WRITE_BYTES // 2):]
        line = (EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n").encode()
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="DeepSpeed config (JSON) to train with")
    parser.add_argument("--out", required=True, help="folder for summary.json")
    parser.add_argument("--model", default="linear", help="linear, mlp or llama")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-optimizer", action="store_true",
                        help="pass torch.optim.AdamW to deepspeed.initialize, as the source article does")
    parser.add_argument("--no-cast-inputs", action="store_true",
                        help="feed fp32 inputs even to an fp16/bf16 model (to show the error)")
    parser.add_argument("--fail-on-rank", type=int, default=None, help="raise on this rank (tests teardown)")
    parser.add_argument("--hang-on-rank", type=int, default=None, help="hang on this rank (tests the timeout)")
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


def train(args: argparse.Namespace) -> None:
    import psutil

    # Where a launch's seconds go, measured on every rank from its own process start.
    born = psutil.Process().create_time()
    timeline: dict[str, float] = {}

    def mark(phase: str) -> None:
        timeline[phase] = round(time.time() - born, 3)

    import deepspeed
    import deepspeed.comm as dist
    import torch

    from helpers import communication, memory, models, theory

    mark("imports")
    with open(args.config) as f:
        config = json.load(f)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    mark("init_distributed")

    model = models.build(args.model, args.seed)
    psi = models.count_parameters(model)
    client_optimizer = None
    if args.client_optimizer:
        lr = config.get("optimizer", {}).get("params", {}).get("lr", 1e-4)
        client_optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The three lines of the source article: wrap, then backward and step through the engine.
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer,
                                           model_parameters=None if client_optimizer else model.parameters(),
                                           config=config)
    dist.reset_log()  # leave out set-up collectives (the initial broadcast of the weights)
    mark("initialize")

    device_type = "cuda" if engine.device.type == "cuda" else "cpu"
    dtype = next(engine.module.parameters()).dtype
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    stage = engine.zero_optimization_stage()
    precision = precision_of(config)
    # Model states are measured on the second step (optimizer states exist once it has stepped):
    # after the last backward before the step (the boundary) and, with accumulation, after the
    # first micro-step's backward too, where each stage's way of holding gradients shows.
    measure_step = 1 if args.steps > 1 else 0

    def synchronize() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize()

    losses, step_times, states, boundary_states = [], [], None, None
    for step in range(args.steps):
        if step == 1:
            dist.reset_log()  # communication is measured over steps 2..S, the steady state
        synchronize()
        start = time.perf_counter()
        micro_losses = []
        for micro_step in range(accum):
            if args.fail_on_rank == rank and step == 0:
                raise RuntimeError(f"deliberate failure on rank {rank} (--fail-on-rank)")
            if args.hang_on_rank == rank and step == 0:
                time.sleep(3600)
            indices = models.sample_indices(step, micro_step, rank, world, micro, accum)
            batch = models.make_batch(args.model, indices, args.seed)
            batch = batch.to(engine.device, None if args.no_cast_inputs else dtype)
            loss = models.loss_of(engine, args.model, batch)
            engine.backward(loss)
            if step == measure_step and micro_step == 0 and accum > 1:
                states = memory.model_states(engine)
            if step == measure_step and micro_step == accum - 1:
                boundary_states = memory.model_states(engine)
                states = states or boundary_states
            engine.step()
            micro_losses.append(loss.item())
        synchronize()
        step_times.append(time.perf_counter() - start)
        losses.append(sum(micro_losses) / len(micro_losses))
        if rank == 0:
            emit("step", step=step + 1, steps=args.steps, loss=losses[-1], seconds=step_times[-1])

    mark("train")
    comm_summary = dist.log_summary(return_dict=True) or {"summary": {}}
    comm_steps = args.steps - 1 if args.steps > 1 else 1
    peak, peak_source = memory.peak_bytes(device_type)

    # Per-rank figures reach rank 0 through files in the run's folder: no collective that the
    # comms logger would count, and nothing left in flight at teardown.
    mark("measure")
    mine = {"losses": losses, "states": states, "boundary_states": boundary_states, "peak": peak,
            "timeline": timeline}
    part = os.path.join(args.out, f"rank{rank}.json")
    with open(part + ".tmp", "w") as f:
        json.dump(mine, f)
    os.replace(part + ".tmp", part)
    gathered = [mine] + [_wait_for_json(os.path.join(args.out, f"rank{r}.json")) for r in range(1, world)] \
        if rank == 0 else []
    if rank == 0:
        mean_losses = [statistics.fmean(r["losses"][i] for r in gathered) for i in range(args.steps)]
        table = communication.by_op(comm_summary.get("summary", {}), world)
        per_step = communication.per_step(table, comm_steps)
        callers = communication.by_caller(comm_summary.get("summary", {}), world)
        median = statistics.median(step_times)
        theory_states = theory.model_state_bytes(psi, stage, world, precision)
        summary = {
            "world_size": world,
            "backend": torch.distributed.get_backend(),
            "device": device_type,
            "device_name": torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu",
            "zero_stage": stage,
            "precision": precision,
            "micro_batch": micro,
            "grad_accum": accum,
            "train_batch": engine.train_batch_size(),
            "steps": args.steps,
            "seed": args.seed,
            "model": {"name": args.model, "params": psi},
            "optimizer": memory.describe_optimizer(engine),
            "losses": mean_losses,
            "losses_per_rank": [r["losses"] for r in gathered],
            "step_time_s": {"median": median, "all": step_times},
            "samples_per_s": engine.train_batch_size() / median,
            "memory": {
                "model_states_bytes_per_rank": [r["states"] for r in gathered],
                "measured_at": (f"step {measure_step + 1}, after the backward of micro-step 1 of {accum} "
                                "(mid-accumulation)" if accum > 1 else
                                f"step {measure_step + 1}, after the backward, before the optimizer step"),
                "model_states_at_boundary_bytes_per_rank": [r["boundary_states"] for r in gathered],
                "peak_bytes_per_rank": [r["peak"] for r in gathered],
                "peak_source": peak_source,
            },
            "comm": {
                "by_op": communication.counts_and_bytes(per_step),
                "bytes_per_step": sum(row["bytes"] for row in per_step.values()),
                "wire_bytes_per_step": sum(row["wire_bytes"] for row in per_step.values()),
                "by_caller": {op: communication.counts_and_bytes(communication.per_step(rows, comm_steps))
                              for op, rows in callers.items()},
                "measured_steps": comm_steps,
                "totals": communication.counts_and_bytes(table),
            },
            "theory": {
                "model_states_bytes_per_rank": theory_states,
                "comm_bytes_per_step": theory.comm_bytes_per_step(psi, stage, precision),
                "comm_wire_bytes_per_step": theory.comm_bytes_per_step(psi, stage, precision)
                * theory.ring_factor(world),
            },
            "timeline_s": {"phases": list(timeline), "per_rank": [r["timeline"] for r in gathered],
                           "note": "seconds from each rank's process start to the end of each phase"},
            "config": config,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        emit("done", out=args.out)

    # Teardown: without it ZeRO-3 aborts at interpreter exit ("terminate called without an
    # active exception") although training finished.
    engine.destroy()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        train(args)
    except BaseException as error:  # report the real error, then leave at once
        rank = int(os.environ.get("RANK", "0"))
        emit("error", rank=rank, type=type(error).__name__, message=str(error),
             traceback=traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a half-initialized process group can hang there


if __name__ == "__main__":
    main()
