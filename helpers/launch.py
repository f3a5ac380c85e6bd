"""Start real multi-rank DeepSpeed runs from a notebook or the command line.

:func:`run` trains one configuration; :func:`sweep` trains several, one after the other, in the same
ranks of a single launch (each with its own ``deepspeed.initialize`` and record), which saves the
seconds every launch spends starting processes and importing torch and DeepSpeed.

Before any process starts, every config is checked (:func:`helpers.configs.check`) and written
into its run's folder with the plan. Then DeepSpeed's launcher starts the ranks on a free port; a
progress bar per run shows each optimizer step's loss (the mean over ranks, the same number the
record keeps); and each run's :class:`helpers.records.Record` is returned. A rank that raises ends
the launch within seconds with that rank's error (:class:`RunFailed`); a launch that passes its
timeout, or is interrupted (Jupyter's stop button, Ctrl-C), is ended, every process of it. If the
Python process that started a launch is killed outright, the launcher and its ranks die with it.

Two ways to start DeepSpeed's launcher, same ranks and same training script:

- ``"launch"`` (default): ``python -m deepspeed.launcher.launch``, the per-node launcher that the
  ``deepspeed`` command itself starts for a single machine. Skipping the extra process
  saves one Python start-up and one import of torch and DeepSpeed per launch.
- ``"deepspeed"``: the ``deepspeed`` command (``deepspeed.launcher.runner``), as in the source article.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import json
import os
import queue
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from helpers import configs, environment, probes as probe_registry, records
from helpers.train import EVENT_PREFIX

RUNS_DIR = environment.REPO_ROOT / "runs"
LAUNCHERS = ("launch", "deepspeed")
ON_ERROR = ("raise", "record")


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


@dataclasses.dataclass
class RunSpec:
    """One training run of a launch: a config (a name in ``ds_configs/``, a path or a dict) with
    ``overrides`` merged in, a course model, a number of optimizer steps and the probes to measure with.

    ``check=False`` skips the config checker (to let DeepSpeed itself show an error);
    ``client_optimizer=True`` passes ``torch.optim.AdamW`` to ``deepspeed.initialize`` as the source
    article does; ``cast_inputs=False`` feeds fp32 inputs to a half-precision model (to show that
    error); ``on_error="record"`` lets a sweep go on past this run's failure and return the
    :class:`RunFailed` in place of its record; ``faults`` ({"fail_on_rank": r} or {"hang_on_rank": r})
    makes a rank fail or hang on purpose, for the course's own tests. ``task`` is what the ranks do:
    ``"train"``, or ``"package.module:function"`` for other work (see ``helpers.train.resolve_task``),
    whose result comes back as the plain dict of its ``summary.json``.
    """

    config: str | Path | dict = "zero0"
    model: str = "linear"
    steps: int = 4
    seed: int = 0
    overrides: dict | None = None
    name: str | None = None
    out: str | Path | None = None
    probes: Sequence[str] = probe_registry.DEFAULT
    check: bool = True
    client_optimizer: bool = False
    cast_inputs: bool = True
    on_error: str = "raise"
    faults: dict | None = None
    task: str = "train"


#: Master ports are drawn from here: below Linux's ephemeral range (32768-60999), which NCCL, gloo
#: and every outgoing connection draw from, so a port found free stays free until the ranks bind it.
PORT_RANGE = (20000, 32000)
PORT_RETRIES = 3  # launches retried on "address already in use" before giving up


def port_is_free(port: int) -> bool:
    """True when nothing on this machine listens on TCP ``port`` (127.0.0.1). Connections of a finished
    launch waiting out TIME_WAIT do not count (``SO_REUSEADDR``, as torch's TCPStore binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A random TCP port in :data:`PORT_RANGE` that nobody listens on now (two notebooks, two ports)."""
    for _ in range(100):
        port = random.randint(*PORT_RANGE)
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free TCP port found in {PORT_RANGE}")


def _port_taken(failure: RunFailed) -> bool:
    text = f"{failure.message or ''} {failure.log_tail}"
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def command(plan_path: Path, world_size: int, port: int, launcher: str = "launch", rank_prefix: Sequence[str] = (),
            master_addr: str = "127.0.0.1") -> list[str]:
    """The argument list that starts ``world_size`` ranks of ``helpers.train`` on the plan.

    ``rank_prefix``: a command the launcher starts each rank through, with the rank's own command
    appended (it can read ``$LOCAL_RANK``; :mod:`helpers.network` uses it to place each rank in a
    network namespace); ``master_addr``: where the ranks find rank 0's TCP store.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    python = environment.python_executable()
    script = ["--module", "helpers.train", "--plan", str(plan_path)]
    if rank_prefix:  # the launcher runs the prefix itself; the rank's Python comes after it
        script = ["--no_python", "--no_local_rank", *rank_prefix, python, "-u", "-m", "helpers.train",
                  "--plan", str(plan_path)]
    if launcher == "deepspeed":
        address = ["--master_addr", master_addr] if master_addr != "127.0.0.1" else []
        return [python, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(world_size), *address,
                "--master_port", str(port), *script]
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(world_size))}).encode()).decode()
    return [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", "--node_rank=0",
            f"--master_addr={master_addr}", f"--master_port={port}", *script]


# --- DeepSpeed's shared-memory segments -------------------------------------------------------

SHM_DIR = Path("/dev/shm")
#: ``deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>`` (DeepSpeed's shm.cpp)
SHM_SEGMENT = re.compile(r"^deepspeed_allreduce_buffer_(\d+)_(.+)_(\d+)_(\d+)$")


def remove_shared_memory(port: int) -> list[Path]:
    """Delete the shared-memory segments a CPU launch on ``port`` left behind, and return them.

    DeepSpeed's CPU all-reduce (``deepspeed_shm_comm``) maps one segment of about 70 MB per rank and
    never unlinks it: without this, every launch leaks them until /dev/shm fills the machine's memory
    and the kernel kills ranks.
    """
    leftovers = sorted(SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for segment in leftovers:
        segment.unlink(missing_ok=True)
    return leftovers


def _mapped_files() -> set[str]:
    """Paths of every file some process of this user has mapped (``/proc/*/maps``)."""
    found: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's
            continue
        found.update(line.split(None, 5)[5] for line in text.splitlines() if "/dev/shm/" in line and line.count(" ") >= 5)
    return found


def remove_stale_shared_memory() -> list[Path]:
    """Delete this user's DeepSpeed segments whose launch is no longer alive, and return them.

    A launch whose Python process was killed (a kernel restart, ``kill -9``) never got to clean up.
    A segment is stale when no process maps it and nothing holds its launch's master port; segments
    of a live launch (another notebook's, say) have both, and are left alone.
    """
    mapped = _mapped_files()
    stale = []
    for segment in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        match = SHM_SEGMENT.match(segment.name)
        if not match or str(segment) in mapped or not port_is_free(int(match.group(3))):
            continue
        segment.unlink(missing_ok=True)
        stale.append(segment)
    return stale


# --- processes --------------------------------------------------------------------------------

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


def _die_with_parent() -> None:
    """In the launcher's process, before it starts: SIGTERM it when the process that started it dies.

    DeepSpeed's launcher answers SIGTERM by ending every rank; the ranks also ask for SIGKILL when
    the launcher dies (``helpers.train.die_with_parent``).
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(process: subprocess.Popen) -> None:
    """End the launcher and every rank it started (they share its process group)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            process.poll()
            try:
                os.killpg(process.pid, 0)  # the launcher may be gone while ranks linger
            except ProcessLookupError:
                return
            time.sleep(0.05)


# --- preparing a launch -----------------------------------------------------------------------

@dataclasses.dataclass
class _Prepared:
    name: str
    spec: RunSpec
    out: Path
    config: dict


def _prepare(spec: RunSpec, world: int, env: environment.Environment) -> _Prepared:
    """Check one run's arguments and config and decide its folder; starts nothing, writes nothing."""
    from helpers import models

    models.check_model_name(spec.model)
    if not isinstance(spec.steps, int) or spec.steps < 1:
        raise ValueError(f"steps={spec.steps}: a run needs at least one optimizer step")
    probe_registry.check_names(list(spec.probes))
    if spec.on_error not in ON_ERROR:
        raise ValueError(f"on_error={spec.on_error!r}: choose one of {', '.join(ON_ERROR)}")
    base = spec.config if isinstance(spec.config, dict) else configs.load(spec.config)
    label = spec.name or (Path(str(spec.config)).stem if not isinstance(spec.config, dict) else "config")
    full = configs.for_run(configs.merged(base, spec.overrides), spec.probes)
    if spec.check:
        configs.check_or_raise(full, world, env, spec.client_optimizer, source=label)
    out = Path(spec.out) if spec.out else RUNS_DIR / f"{label}-{spec.model}-{world}r"
    return _Prepared(label, spec, out, full)


def _plan_entry(p: _Prepared, plan_path: Path) -> dict:
    s = p.spec
    return {"name": p.name, "out": str(p.out), "config": str(p.out / "ds_config.json"), "model": s.model,
            "steps": s.steps, "seed": s.seed, "probes": list(s.probes), "client_optimizer": s.client_optimizer,
            "cast_inputs": s.cast_inputs, "on_error": s.on_error, "faults": dict(s.faults or {}),
            "task": s.task, "plan": str(plan_path)}


def run(config: str | Path | dict, *, world_size: int | None = None, model: str = "linear", steps: int = 4,
        seed: int = 0, overrides: dict | None = None, name: str | None = None, out: str | Path | None = None,
        timeout: float = 600, check: bool = True, client_optimizer: bool = False, launcher: str = "launch",
        probes: Sequence[str] = probe_registry.DEFAULT, cast_inputs: bool = True, faults: dict | None = None,
        progress: bool = True) -> records.Record:
    """Train ``model`` for ``steps`` optimizer steps on ``world_size`` ranks in one launch; return its record.

    Arguments as in :class:`RunSpec`. Raises :class:`helpers.configs.ConfigError` before starting
    anything for a bad config, and :class:`RunFailed` when a rank fails or the run times out.
    """
    spec = RunSpec(config=config, model=model, steps=steps, seed=seed, overrides=overrides, name=name, out=out,
                   probes=tuple(probes), check=check, client_optimizer=client_optimizer, cast_inputs=cast_inputs,
                   faults=faults)
    results = _launch_specs([spec], world_size, None, timeout, launcher, progress)
    return next(iter(results.values()))


def sweep(specs: Sequence[RunSpec] | Mapping[str, RunSpec], *, name: str = "sweep", world_size: int | None = None,
          timeout: float = 900, launcher: str = "launch", progress: bool = True, rank_prefix: Sequence[str] = (),
          master_addr: str = "127.0.0.1") -> dict[str, records.Record | RunFailed]:
    """Train several runs one after the other in the same ranks of ONE launch; return {name: record}.

    Each run gets a fresh model, ``deepspeed.initialize``, comms-logger reset and probes, and its own
    folder and record, the same record it would get from a launch of its own (tested); its engine is
    destroyed before the next run starts. ``specs`` given as a mapping are named by their keys. Every
    config is checked before anything starts. A failing run ends the launch (:class:`RunFailed`)
    unless its spec says ``on_error="record"``. The launch's own files (plan, command, log) go to
    ``runs/<name>/``. ``rank_prefix`` and ``master_addr``: see :func:`command` (a
    :class:`helpers.network.Link` gives both).
    """
    if isinstance(specs, Mapping):
        specs = [dataclasses.replace(spec, name=spec.name or key) for key, spec in specs.items()]
    if not specs:
        raise ValueError("sweep() needs at least one RunSpec")
    return _launch_specs(list(specs), world_size, name, timeout, launcher, progress, rank_prefix, master_addr)


def _launch_specs(specs: list[RunSpec], world_size: int | None, sweep_name: str | None, timeout: float,
                  launcher: str, progress: bool, rank_prefix: Sequence[str] = (),
                  master_addr: str = "127.0.0.1") -> dict[str, records.Record | RunFailed]:
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    env = environment.detect(world_size)
    world = env.default_world_size
    prepared = [_prepare(spec, world, env) for spec in specs]
    names = [p.name for p in prepared]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"runs named {duplicates} more than once: give each RunSpec its own name")

    folder = RUNS_DIR / sweep_name if sweep_name else prepared[0].out
    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / "plan.json"
    for p in prepared:
        p.out.mkdir(parents=True, exist_ok=True)
        for stale in ["summary.json", *p.out.glob("rank*.json")]:
            (p.out / stale).unlink(missing_ok=True)
        (p.out / "ds_config.json").write_text(json.dumps(p.config, indent=1))
    plan_path.write_text(json.dumps({"world_size": world, "runs": [_plan_entry(p, plan_path) for p in prepared]},
                                    indent=1))
    child, _ = environment.child_env(env, world)
    remove_stale_shared_memory()
    where = f"{world} {'GPU' if env.is_gpu else 'CPU'} rank{'s' if world > 1 else ''}"
    for attempt in range(1, PORT_RETRIES + 1):
        port = free_port()
        argv = command(plan_path, world, port, launcher, rank_prefix, master_addr)
        (folder / "command.txt").write_text(shlex.join(argv) + "\n")
        try:
            return _follow(argv, child, folder, prepared, world, where, timeout, progress, port)
        except RunFailed as failure:
            # Another program took the master port between our check and the ranks' bind.
            if attempt == PORT_RETRIES or not _port_taken(failure):
                raise
            print(f"master port taken by another program; retrying on a new port ({attempt}/{PORT_RETRIES - 1})",
                  file=sys.stderr)
    raise AssertionError("unreachable")


class _Progress:
    """One tqdm bar per run, on stderr (terminals and notebooks alike): each optimizer step's loss is
    the mean over ranks, shown once every rank has reported it."""

    def __init__(self, prepared: list[_Prepared], world: int, where: str, enabled: bool):
        self.prepared, self.world, self.where, self.enabled = prepared, world, where, enabled
        self.pending: dict[tuple[int, int], list[float]] = {}
        self.bar = None

    def start(self, run: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.close()
        p = self.prepared[run]
        self.bar = tqdm(total=p.spec.steps, desc=f"{p.name} · {self.where}", unit="step", file=sys.stderr,
                        leave=True, dynamic_ncols=True, bar_format="{desc}: {n}/{total} steps |{bar:12}| "
                        "{elapsed}{postfix}")

    def step(self, event: dict) -> None:
        losses = self.pending.setdefault((event["run"], event["step"]), [])
        losses.append(event["loss"])
        if len(losses) == self.world and self.bar is not None:
            self.bar.update(1)
            if None not in losses:  # tasks other than training report steps without a loss
                self.bar.set_postfix_str(f"loss {sum(losses) / len(losses):.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _follow(argv: list[str], child: dict[str, str], folder: Path, prepared: list[_Prepared], world: int,
            where: str, timeout: float, progress: bool, port: int) -> dict[str, records.Record | dict | RunFailed]:
    """Start one launch, follow its events, and return each run's record (or RunFailed, see on_error)."""
    started = time.perf_counter()
    fatal: dict | None = None
    run_errors: dict[int, dict] = {}
    run_times: dict[int, list[float]] = {}
    log_lines: list[str] = []
    bars = _Progress(prepared, world, where, progress)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child,
                               cwd=environment.REPO_ROOT, start_new_session=True, preexec_fn=_die_with_parent)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    timed_out = interrupted = False
    try:
        with open(folder / "launch.log", "w") as log:
            while True:
                remaining = timeout - (time.perf_counter() - started)
                if remaining <= 0:
                    timed_out = True
                    break
                try:
                    line = lines.get(timeout=min(remaining, 0.2))
                except queue.Empty:
                    continue
                if line is None:
                    break
                if EVENT_PREFIX in line:
                    text, events = parse_events(line)
                    for event in events:
                        kind = event["event"]
                        if kind == "run_start":
                            run_times[event["run"]] = [time.perf_counter()]
                            bars.start(event["run"])
                        elif kind == "step":
                            bars.step(event)
                        elif kind == "done":
                            run_times[event["run"]].append(time.perf_counter())
                            bars.close()
                        elif kind == "run_error":
                            run_errors.setdefault(event["run"], event)
                        elif kind == "error" and fatal is None:
                            fatal = event
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
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        code = process.poll()
        bars.close()
        _kill_group(process)  # nothing of a launch outlives it, whatever happened
        remove_shared_memory(port)
        if interrupted:
            print("interrupted: every process of the run was stopped", file=sys.stderr)
    seconds = time.perf_counter() - started

    tail = "".join(log_lines[-25:])
    first = prepared[0].out
    if timed_out:
        raise RunFailed(f"[{where}] timed out after {timeout:.0f} s: every process of the run was stopped. "
                        f"Last log lines:\n{tail}", log_tail=tail, out=first)
    if fatal is not None:
        run = next((p for i, p in enumerate(prepared) if i in run_times and len(run_times[i]) == 1), prepared[0])
        raise RunFailed(f"rank {fatal['rank']} failed: {fatal['type']}: {fatal['message']}", rank=fatal["rank"],
                        error_type=fatal["type"], message=fatal["message"], traceback=fatal["traceback"],
                        log_tail=tail, out=run.out)
    results: dict[str, records.Record | RunFailed] = {}
    for i, p in enumerate(prepared):
        if i in run_errors:
            e = run_errors[i]
            results[p.name] = RunFailed(f"rank {e['rank']} failed: {e['type']}: {e['message']}", rank=e["rank"],
                                        error_type=e["type"], message=e["message"], traceback=e["traceback"],
                                        log_tail=tail, out=p.out)
            continue
        if code != 0 or not (p.out / "summary.json").exists():
            raise RunFailed(f"[{where}] exited with code {code} and no summary for {p.name}. "
                            f"Last log lines:\n{tail}", log_tail=tail, out=p.out)
        if p.spec.task != "train":
            results[p.name] = json.loads((p.out / "summary.json").read_text())
            continue
        record = records.load(p.out)
        times = run_times.get(i, [])
        # a launch of one run: launch to exit; a run of a sweep: its own start to its record
        record.wall_s = seconds if len(prepared) == 1 else (times[1] - times[0] if len(times) == 2 else None)
        results[p.name] = record
    return results


def run_expecting_failure(config: str | Path | dict, **kwargs) -> RunFailed:
    """Run something that should fail and return the failure, to show a real DeepSpeed error.

    Raises AssertionError if the run succeeds after all.
    """
    try:
        run(config, progress=False, **kwargs)
    except RunFailed as failure:
        return failure
    raise AssertionError("the run was expected to fail but succeeded")
