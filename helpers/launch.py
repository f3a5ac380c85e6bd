"""Start real multi-rank DeepSpeed runs from a notebook or the command line.

:func:`run` checks the config (no process starts for a bad one), writes the run's config into its
output folder, starts DeepSpeed's launcher with an argument list on a free port, shows one live
progress line, and returns the run's :class:`helpers.records.Record`. A rank that raises ends
the whole run within seconds with that rank's error (:class:`RunFailed`); a run that passes
its timeout is killed, every process of it.

Two ways to start DeepSpeed's launcher, same ranks and same training script:

- ``"launch"`` (default): ``python -m deepspeed.launcher.launch``, the per-node launcher that the
  ``deepspeed`` command itself starts for a single machine. Skipping the extra process
  saves one Python start-up and one import of torch and DeepSpeed per run.
- ``"deepspeed"``: the ``deepspeed`` command (``deepspeed.launcher.runner``), as in the source article.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from helpers import configs, environment, records
from helpers.train import EVENT_PREFIX

RUNS_DIR = environment.REPO_ROOT / "runs"
LAUNCHERS = ("launch", "deepspeed")


class RunFailed(RuntimeError):
    """A run that ended badly: which rank failed, its error, and the tail of the log."""

    def __init__(self, summary: str, rank: int | None = None, error_type: str | None = None,
                 message: str | None = None, traceback: str = "", log_tail: str = "", out: Path | None = None):
        self.rank, self.error_type, self.message = rank, error_type, message
        self.traceback, self.log_tail, self.out = traceback, log_tail, out
        super().__init__(summary)

    def explain(self, traceback_lines: int = 0) -> str:
        """The error as a learner should read it: the failing rank, the exception, its message."""
        text = str(self)
        if traceback_lines and self.traceback:
            text += "\n" + "\n".join(self.traceback.strip().splitlines()[-traceback_lines:])
        return text


#: Master ports are drawn from here: below Linux's ephemeral range (32768-60999), which NCCL, gloo
#: and every outgoing connection draw from, so a port found free stays free until the ranks bind it.
PORT_RANGE = (20000, 32000)
PORT_RETRIES = 3  # launches retried on "address already in use" before giving up


def free_port() -> int:
    """A random TCP port in :data:`PORT_RANGE` that nobody listens on now (two notebooks, two ports)."""
    for _ in range(100):
        port = random.randint(*PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found in {PORT_RANGE}")


def _port_taken(failure: "RunFailed") -> bool:
    text = f"{failure.message or ''} {failure.log_tail}"
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def command(config_path: Path, out: Path, world_size: int, port: int, model: str, steps: int, seed: int,
            launcher: str = "launch", extra_args: list[str] | None = None) -> list[str]:
    """The argument list that starts ``world_size`` ranks of ``helpers.train``."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    script = ["--module", "helpers.train", "--config", str(config_path), "--out", str(out),
              "--model", model, "--steps", str(steps), "--seed", str(seed), *(extra_args or [])]
    python = environment.python_executable()
    if launcher == "deepspeed":
        return [python, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(world_size),
                "--master_port", str(port), *script]
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(world_size))}).encode()).decode()
    return [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", "--node_rank=0",
            "--master_addr=127.0.0.1", f"--master_port={port}", *script]


def remove_shared_memory(port: int) -> list[Path]:
    """Delete the shared-memory segments a CPU run's ranks left behind, and return them.

    DeepSpeed's CPU all-reduce (``deepspeed_shm_comm``) maps one segment of about 70 MB per rank,
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, and never unlinks it: without
    this, every run leaks them until /dev/shm fills the machine's memory and the kernel kills ranks.
    """
    leftovers = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for segment in leftovers:
        segment.unlink(missing_ok=True)
    return leftovers


def parse_events(line: str) -> tuple[str, list[dict]]:
    """Split one line of the launcher's output into ordinary log text and the ranks' events.

    Events are written in one piece, but another process's log output can still land on the same line.
    """
    decoder = json.JSONDecoder()
    text, events = [], []
    head, *chunks = line.split(EVENT_PREFIX)
    text.append(head)
    for chunk in chunks:
        try:
            event, end = decoder.raw_decode(chunk)
        except json.JSONDecodeError:
            text.append(chunk)
            continue
        events.append(event)
        text.append(chunk[end:])
    return "".join(text), events


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _kill_group(process: subprocess.Popen) -> None:
    """End the launcher and every rank it started (they share its process group)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            # the launcher may be gone while ranks linger: make sure the group is empty
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run(config: str | Path | dict, *, world_size: int | None = None, model: str = "linear", steps: int = 4,
        seed: int = 0, overrides: dict | None = None, name: str | None = None, out: str | Path | None = None,
        timeout: float = 600, check: bool = True, client_optimizer: bool = False, launcher: str = "launch",
        extra_args: list[str] | None = None, progress: bool = True) -> records.Record:
    """Train ``model`` for ``steps`` optimizer steps on ``world_size`` ranks and return its record.

    ``config`` is a name in ``ds_configs/``, a path, or a dict; ``overrides`` are merged into it
    (:func:`helpers.configs.merged`). ``check=False`` skips the config checker, to let DeepSpeed
    itself show an error. Raises :class:`helpers.configs.ConfigError` before starting anything
    for a bad config, and :class:`RunFailed` when a rank fails or the run times out.
    """
    from helpers import models

    models.check_model_name(model)
    if steps < 1:
        raise ValueError(f"steps={steps}: a run needs at least one optimizer step")
    env = environment.detect(world_size)
    world = env.default_world_size
    base = configs.load(config) if not isinstance(config, dict) else config
    label = name or (Path(str(config)).stem if not isinstance(config, dict) else "config")
    full = configs.for_run(configs.merged(base, overrides))
    if check:
        configs.check_or_raise(full, world, env, client_optimizer, source=label)

    out = Path(out) if out else RUNS_DIR / f"{label}-{model}-{world}r"
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "ds_config.json"
    config_path.write_text(json.dumps(full, indent=1))
    args = list(extra_args or []) + (["--client-optimizer"] if client_optimizer else [])
    child, _ = environment.child_env(env, world)
    for attempt in range(1, PORT_RETRIES + 1):
        port = free_port()
        argv = command(config_path, out, world, port, model, steps, seed, launcher, args)
        (out / "command.txt").write_text(shlex.join(argv) + "\n")
        try:
            return _launch(argv, child, out, f"[{label} · {world} {'GPU' if env.is_gpu else 'CPU'} "
                           f"rank{'s' if world > 1 else ''}]", steps, timeout, progress, port)
        except RunFailed as failure:
            # Another program took the master port between our check and the ranks' bind.
            if attempt == PORT_RETRIES or not _port_taken(failure):
                raise
            if progress:
                print(f"master port taken by another program; retrying on a new port ({attempt}/{PORT_RETRIES - 1})")
    raise AssertionError("unreachable")


def _launch(argv: list[str], child: dict[str, str], out: Path, prefix: str, steps: int, timeout: float,
            progress: bool, port: int) -> records.Record:
    """Start one launch, follow its events, and return its record or raise RunFailed."""
    for stale in ["summary.json", "launch.log", *out.glob("rank*.json")]:
        (out / stale).unlink(missing_ok=True)
    started = time.perf_counter()
    error_event: dict | None = None
    log_lines: list[str] = []
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child,
                               cwd=environment.REPO_ROOT, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    timed_out = False
    try:
        with open(out / "launch.log", "w") as log:
            while True:
                remaining = timeout - (time.perf_counter() - started)
                if remaining <= 0:
                    timed_out = True
                    break
                try:
                    line = lines.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    continue
                if line is None:
                    break
                if EVENT_PREFIX in line:
                    text, events = parse_events(line)
                    for event in events:
                        if event["event"] == "step" and progress:
                            print(f"\r{prefix} step {event['step']}/{event['steps']}  loss {event['loss']:.4f}",
                                  end="", flush=True)
                        elif event["event"] == "error" and error_event is None:
                            error_event = event
                    if not text.strip():
                        continue
                    line = text
                log.write(line)
                log_lines.append(line)
                del log_lines[:-40]
        if not timed_out:
            try:
                process.wait(max(1.0, timeout - (time.perf_counter() - started)))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        code = process.poll()
        _kill_group(process)  # nothing of a run outlives it, whatever happened
        remove_shared_memory(port)
    seconds = time.perf_counter() - started
    if progress:
        print()

    tail = "".join(log_lines[-25:])
    if timed_out:
        raise RunFailed(f"{prefix} timed out after {timeout:.0f} s: every process of the run was stopped. "
                        f"Last log lines:\n{tail}", log_tail=tail, out=out)
    if error_event is not None:
        raise RunFailed(f"rank {error_event['rank']} failed: {error_event['type']}: {error_event['message']}",
                        rank=error_event["rank"], error_type=error_event["type"], message=error_event["message"],
                        traceback=error_event["traceback"], log_tail=tail, out=out)
    if code != 0 or not (out / "summary.json").exists():
        raise RunFailed(f"{prefix} exited with code {code} and no summary. Last log lines:\n{tail}",
                        log_tail=tail, out=out)
    record = records.load(out)
    record.wall_s = seconds
    if progress:
        print(f"{prefix} {steps} steps, final loss {record.losses[-1]:.4f}, took {seconds:.1f} s")
    return record


def run_expecting_failure(config: str | Path | dict, **kwargs) -> RunFailed:
    """Run something that should fail and return the failure, to show a real DeepSpeed error.

    Raises AssertionError if the run succeeds after all.
    """
    try:
        run(config, progress=False, **kwargs)
    except RunFailed as failure:
        return failure
    raise AssertionError("the run was expected to fail but succeeded")
