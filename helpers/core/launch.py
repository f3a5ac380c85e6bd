"""Start real multi-rank DeepSpeed runs from a notebook or the command line.

:func:`run` trains one configuration; :func:`sweep` trains several, one after the other, in the same
ranks of a single launch (each with its own ``deepspeed.initialize`` and record), which saves the
seconds every launch spends starting processes and importing torch and DeepSpeed.

Before any process starts, every run is checked: its config (:func:`helpers.core.configs.check`), its
model, and every probe, trainer, builder, task and hook it names by import path (each imported here as
the ranks will import it, with the options it takes checked). The config goes into its run's folder and
the runs into the launch's ``plan.json`` (:class:`helpers.core.plan.Plan`). Then DeepSpeed's launcher starts
the ranks on a free port; a progress bar per run shows each optimizer step's loss (the mean over ranks, the
same number the record keeps); and each run's :class:`helpers.core.records.Record` is returned. A rank that
raises ends the launch within seconds with that rank's error (:class:`RunFailed`); a launch that passes its
timeout, or is interrupted (Jupyter's stop button, Ctrl-C), is ended, every process of it. If the
Python process that started a launch is killed outright, the launcher and its ranks die with it. A launch
whose ranks all exited with status 0, as DeepSpeed's launcher logs, is over: the launcher's last idle
second (and the ``deepspeed`` command's exit after it) is not waited out (:data:`RANK_EXITED`).

Three ways to start the ranks, same rank script (``helpers.core.train``) and the same records:

- ``"launch"`` (default): ``python -m deepspeed.launcher.launch``, the per-node launcher that the
  ``deepspeed`` command itself starts for a single machine. Skipping the extra process
  saves one Python start-up and one import of torch and DeepSpeed per launch.
- ``"deepspeed"``: the ``deepspeed`` command (``deepspeed.launcher.runner``), as in the source article.
  It is also the way to several machines: given :class:`Hosts` (a DeepSpeed hostfile, ``--include`` /
  ``--exclude``), DeepSpeed's multi-node runner starts the ranks on every host over pdsh and ssh.
- ``"torchrun"``: PyTorch's own launcher (``python -m torch.distributed.run``), the way PyTorch DDP and
  FSDP2 scripts are started; the ranks join the process group with ``torch.distributed`` alone
  (:func:`helpers.core.train.init_process_group`). A topic's task for PyTorch's own strategies uses it
  (chapter 15).

GPUs: the ranks use ``environment.detect().gpu_ids`` (every GPU, or those ``$COURSE_GPUS`` or
``$CUDA_VISIBLE_DEVICES`` name), handed to DeepSpeed's launcher as it expects them. Output: each run
writes to ``runs/<name>/``, or under ``$COURSE_RUNS_DIR`` when set (one folder per learner on a shared box).
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import json
import math
import os
import queue
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import psutil

from helpers.core import configs, ds, environment, models, records
from helpers.core import faults as course_faults
from helpers.core import probes as probe_registry
from helpers.core.plan import (COURSE_MODELS, DATA_PARALLEL_STEP, DEEPSPEED_INITIALIZE, EVENT_PREFIX, STACK_SIGNAL,
                               Plan, PlannedRun, resolve)

#: Where runs write their folders: ``$COURSE_RUNS_DIR`` when set, else ``runs/`` in the repository.
RUNS_DIR = Path(os.environ.get("COURSE_RUNS_DIR") or environment.REPO_ROOT / "runs").resolve()
LAUNCHERS = ("launch", "deepspeed", "torchrun")
ON_ERROR = ("raise", "record")

#: A listener for a launch's progress (``on_event=`` of :func:`run` and :func:`sweep`), called in the
#: launching process with one dict per event, the same figures the progress bar shows:
#: ``{"event": "run_start", "run": i, "name": ..., "steps": N}``, then per optimizer step, once every
#: rank has reported it, ``{"event": "step", "run": i, "name": ..., "step": k, "steps": N, "loss": mean
#: over ranks (None for tasks other than training)}``, and ``{"event": "done", "run": i, "name": ...}``
#: when the run's record is written. An exception it raises ends the launch, like any other.
EventListener = Callable[[dict], None]


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


#: A probe as a run names it: a core probe's short name ("timing"), a Probe class, or its import path.
ProbeRef = str | type[probe_registry.Probe]


@dataclasses.dataclass
class RunSpec:
    """One training run of a launch: a config (a name in ``ds_configs/``, a path or a dict) with
    ``overrides`` merged in, a model, a number of optimizer steps and the probes to measure with.

    ``probes``: core probes by name (:data:`helpers.core.probes.CORE`), others as their class or import
    path; None (the default) takes :func:`helpers.core.probes.defaults_for` the config. ``trainer`` and
    ``builder`` name, by import path, the function that takes one optimizer step and the one that builds
    the model (defaults: the data-parallel loop of :mod:`helpers.core.train` and the course's models of
    :mod:`helpers.core.models`); a topic with its own way of training (a pipeline, the capstone) names its
    own. ``initialize`` names the function that wraps the model in DeepSpeed's engine,
    ``function(model, config, run) -> engine`` (default :func:`helpers.core.train.initialize`, the source
    article's call); a chapter whose ranks need more arguments (Ulysses' ``mpu``) writes its own. ``task`` is
    ``"train"``, or ``"package.module:function"`` for other work on the ranks, whose result comes back as a
    :class:`helpers.core.records.Record` when its ``summary.json`` is a run record, else as the plain dict.
    ``model_options`` are keyword arguments of the builder.

    ``check=False`` skips the config checker (to let DeepSpeed itself show an error);
    ``client_optimizer=True`` passes ``torch.optim.AdamW`` to ``deepspeed.initialize`` as the source
    article does; ``cast_inputs=False`` feeds fp32 inputs to a half-precision model (to show that
    error); ``on_error="record"`` lets a sweep go on past this run's failure and return the
    :class:`RunFailed` in place of its record; ``faults`` makes a rank fail or hang on purpose
    (:mod:`helpers.core.faults`).

    ``options`` (JSON) are settings for the run's probes and hooks, which read them as
    ``ctx.options``. ``before_training`` names a ``"package.module:function"`` the ranks call after
    ``deepspeed.initialize`` and before the first step (to load a checkpoint, say); it returns the step
    training starts from
    (:func:`helpers.core.train.before_training`).
    """

    config: str | Path | dict = "zero0"
    model: str = "linear"
    steps: int = 4
    seed: int = 0
    overrides: dict | None = None
    name: str | None = None
    out: str | Path | None = None
    probes: Sequence[ProbeRef] | None = None
    check: bool = True
    client_optimizer: bool = False
    cast_inputs: bool = True
    on_error: str = "raise"
    faults: dict | None = None
    task: str = "train"
    model_options: dict | None = None  # keyword arguments of the model builder
    options: dict | None = None
    before_training: str | None = None
    trainer: str | None = None
    builder: str | None = None
    initialize: str | None = None


@dataclasses.dataclass(frozen=True)
class Hosts:
    """Machines for DeepSpeed's multi-node runner (``deepspeed --hostfile ... --include/--exclude``).

    ``hostfile`` is DeepSpeed's MPI-style file, one ``<host> slots=<ranks>`` line per machine;
    ``include``/``exclude`` are DeepSpeed's filters (``"node-a:0,1@node-b"``: slots 0 and 1 of node-a
    and all of node-b). Every host must be reachable by ``ssh <host>`` without a password and hold this
    repository and its Python at the same paths (a shared filesystem), as DeepSpeed's pdsh runner
    assumes: it runs ``cd <this folder>; <this python> -m deepspeed.launcher.launch ...`` on each host.
    ``master_addr`` defaults to what the first host answers to ``hostname -I`` (DeepSpeed's own choice).
    """

    hostfile: str | Path
    include: str = ""
    exclude: str = ""
    master_addr: str | None = None
    ssh_port: int | None = None
    runner: str = "pdsh"  # DeepSpeed's --launcher; pdsh starts the per-node launchers over ssh

    def resources(self) -> dict[str, list[int]]:
        """{host: [slots]} after the filters, read by DeepSpeed's own parsers (errors name the bad entry)."""
        runner = ds.load("deepspeed.launcher.runner")

        path = Path(self.hostfile)
        if not path.is_file():
            raise ValueError(f"hostfile {path}: no such file; write one '<host> slots=<ranks>' line per machine")
        if self.include and self.exclude:
            raise ValueError("Hosts: give include or exclude, not both (DeepSpeed refuses the pair)")
        pool = runner._parse_hostfile(path.read_text().splitlines())
        return dict(runner.parse_inclusion_exclusion(pool, self.include, self.exclude))

    def world_size(self) -> int:
        return sum(len(slots) for slots in self.resources().values())


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


def command(plan_path: Path, world_size: int, port: int, launcher: str = "launch", gpu_ids: Sequence[int] = (),
            hosts: Hosts | None = None, python: str | None = None, rank_prefix: Sequence[str] = (),
            master_addr: str = "127.0.0.1") -> list[str]:
    """The argument list that starts ``world_size`` ranks of ``helpers.core.train`` on the plan.

    ``gpu_ids`` are the GPU numbers to use (none on CPU); ``hosts`` sends the launch through
    DeepSpeed's multi-node runner (``launcher`` must then be ``"deepspeed"``). ``rank_prefix``: a
    command the launcher starts each rank through, with the rank's own command appended (it can read
    ``$LOCAL_RANK``; :mod:`helpers.topics.bandwidth` uses it to place each rank in a network namespace);
    ``master_addr``: where the ranks find rank 0's TCP store.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    script = ["--module", "helpers.core.train", "--plan", str(plan_path)]
    python = python or environment.python_executable()
    if rank_prefix:  # the launcher runs the prefix itself; the rank's Python comes after it
        script = ["--no_python", "--no_local_rank", *rank_prefix, python, "-u", "-m", "helpers.core.train",
                  "--plan", str(plan_path)]
    if hosts is not None:
        if launcher != "deepspeed":
            raise ValueError("several hosts need DeepSpeed's multi-node runner: launcher='deepspeed'")
        argv = [python, "-u", "-m", "deepspeed.launcher.runner", "--hostfile", str(Path(hosts.hostfile).resolve()),
                "--launcher", hosts.runner, "--master_port", str(port)]
        if hosts.include:
            argv += ["--include", hosts.include]
        if hosts.exclude:
            argv += ["--exclude", hosts.exclude]
        if hosts.master_addr:
            argv += ["--master_addr", hosts.master_addr]
        if hosts.ssh_port:
            argv += ["--ssh_port", str(hosts.ssh_port)]
        return argv + script
    if launcher == "torchrun":  # PyTorch's own launcher: the chosen GPUs reach it as CUDA_VISIBLE_DEVICES
        return [python, "-u", "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world_size}",
                f"--master_addr={master_addr}", f"--master_port={port}", *script]
    gpus = list(gpu_ids)[:world_size]
    if gpu_ids and len(gpus) < world_size:
        raise ValueError(f"{world_size} ranks but only GPUs {gpus} chosen")
    if launcher == "deepspeed":
        where = ["--include", "localhost:" + ",".join(map(str, gpus))] if gpus else ["--num_gpus", str(world_size)]
        address = ["--master_addr", master_addr] if master_addr != "127.0.0.1" else []
        return [python, "-u", "-m", "deepspeed.launcher.runner", *where, *address, "--master_port", str(port), *script]
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": gpus or list(range(world_size))}).encode()).decode()
    return [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", "--node_rank=0",
            f"--master_addr={master_addr}", f"--master_port={port}", *script]


#: Variables the ranks need that DeepSpeed's multi-node runner does not pass to other hosts by itself
#: (it passes PYTHON*, NCCL*, UCX*, MV2*, MLFLOW* and a ``DS_ENV_FILE`` it is pointed to).
FORWARDED_TO_HOSTS = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_CUDA_ARCH_LIST", "COURSE_RUNS_DIR",
                      "DEEPSPEED_TIMEOUT", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                      "NVSHMEM_DISABLE_NVLS")


def write_host_env(child: dict[str, str], path: Path) -> Path:
    """Write DeepSpeed's env file (``KEY=VALUE`` lines, read by its runner through ``DS_ENV_FILE``) with
    the variables of :data:`FORWARDED_TO_HOSTS` the ranks get here, so ranks on other hosts get them too."""
    lines = [f"{key}={child[key]}" for key in FORWARDED_TO_HOSTS if child.get(key)]
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    return path


def _stop_remote_ranks(hosts: Hosts, plan_path: Path, child: dict[str, str]) -> None:
    """After a multi-node launch was killed: end its ranks on every host, matched by this launch's own
    plan path (DeepSpeed's runner would ``pkill -f`` every ``deepspeed.launcher.launch`` of this Python
    on those hosts, other people's launches included)."""
    try:
        workers = ",".join(hosts.resources())
        pattern = "helpers[.]core[.]train --plan " + re.escape(str(plan_path))
        subprocess.run(["pdsh", "-S", "-w", workers, f"pkill -KILL -f -- '{pattern}'"], env={**child,
                       "PDSH_RCMD_TYPE": "ssh"}, capture_output=True, timeout=30)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass


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
    the launcher dies (``helpers.core.train.die_with_parent``).
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_stacks(process: subprocess.Popen, lines: queue.Queue, log_path: Path, wait: float = 4.0) -> str:
    """Ask every rank of a launch that timed out for its Python stack (:data:`helpers.core.plan.STACK_SIGNAL`;
    not the launcher, which that signal would end) and collect what they print for ``wait`` seconds into
    the launch's log. Returns every rank's stack (innermost frame first), or "" if none came."""
    try:
        # the ranks run "python -u -m helpers.core.train"; a launcher that names the module differently
        # (DeepSpeed's launch: "--module helpers.core.train") is left alone
        ranks = [c for c in psutil.Process(process.pid).children(recursive=True)
                 if " -m helpers.core.train " in f" {' '.join(c.cmdline())} "]
    except Exception:  # the launch is already gone
        return ""
    printed: list[str] = []
    for rank in ranks:  # one at a time: stacks printed at once would interleave line by line
        try:
            os.kill(rank.pid, STACK_SIGNAL)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + wait / max(1, len(ranks))
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            printed.append(line)
    with open(log_path, "a") as log:
        log.write("".join(printed))
    # faulthandler prints "Stack (most recent call first):", then one "  File ..." line per frame
    kept = [line.rstrip() for line in printed if "most recent call first" in line or line.lstrip().startswith("File ")]
    return "\n".join(kept[next((i for i, line in enumerate(kept) if "most recent call first" in line), len(kept)):])


def _innermost(stacks: str) -> str:
    """``function (file:line)`` of the first stack's innermost frame, from :func:`_rank_stacks`' text."""
    match = re.search(r'File "([^"]+)", line (\d+) in (\S+)', stacks)
    if not match:
        return ""
    path = Path(match.group(1))
    return f"{match.group(3)} ({'/'.join(path.parts[-3:])}:{match.group(2)})"


def _after_timeout(prepared: list["_Prepared"], run_times: dict[int, list[float]], steps_done: dict[int, int],
                   timeout: float, tail: str, stacks: str) -> dict[str, records.Record | RunFailed]:
    """A sweep whose every run records its failure (``on_error="record"``) keeps what finished before a
    run hung: finished runs give their records, the hung run and those after it a :class:`RunFailed`."""
    results: dict[str, records.Record | RunFailed] = {}
    hung = None
    for i, p in enumerate(prepared):
        times = run_times.get(i, [])
        if (p.out / "summary.json").exists() and len(times) == 2:
            results[p.name] = _finished(p, times[1] - times[0])
        elif hung is None:
            hung = p.name
            done = f"{steps_done.get(i, 0)} of {p.spec.steps} steps"
            results[p.name] = RunFailed(f"timed out after {timeout:.0f} s ({done}): every process of the launch was "
                                        "stopped" + (f"; a rank was in {_innermost(stacks)}" if stacks else ""),
                                        error_type="Timeout", message=f"not done within the launch's {timeout:.0f} s "
                                        f"({done})",
                                        traceback=stacks, log_tail=tail, out=p.out)
        else:
            results[p.name] = RunFailed(f"not run: {hung} hung before it", error_type="NotRun",
                                        message=f"not run: {hung} hung before it", log_tail=tail, out=p.out)
    return results


def _kill_group(process: subprocess.Popen, signals: Sequence[int] = (signal.SIGTERM, signal.SIGKILL)) -> None:
    """End the launcher and every rank it started (they share its process group): each of ``signals``
    in turn, 5 s apart, until none is left."""
    for sig, wait in ((s, 5) for s in signals):
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
            if not _runs_in_group(process.pid):  # zombies only: a parent's wait removes them, not a signal
                return
            time.sleep(0.05)


def _end_idle_launcher(process: subprocess.Popen) -> None:
    """End a launch whose ranks all exited with status 0 (:class:`_CleanExits`): DeepSpeed's launcher first,
    so that its parent (the ``deepspeed`` command, where there is one) waits for it and counts the processor
    time of the launcher and its ranks as the ``time`` command does, then the rest of the group."""
    try:
        launchers = psutil.Process(process.pid).children()
    except psutil.NoSuchProcess:
        launchers = []
    for launcher in launchers:
        try:
            launcher.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(launchers, timeout=5)
    _kill_group(process, signals=(signal.SIGKILL,))


def _runs_in_group(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` is still running, zombies left out. Where the launcher dies
    with the ``deepspeed`` command above it, the launcher's zombie waits for the machine's init process to
    reap it (a second or more in some containers). True where ``/proc`` cannot tell."""
    if not Path("/proc/self/stat").exists():
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


# --- preparing a launch -----------------------------------------------------------------------

@dataclasses.dataclass
class _Prepared:
    name: str
    spec: RunSpec
    out: Path
    config: dict
    probes: tuple[str, ...] = ()  # references, as the plan keeps them
    trainer: str = DATA_PARALLEL_STEP
    builder: str = COURSE_MODELS
    initialize: str = DEEPSPEED_INITIALIZE


def _check_model(spec: RunSpec) -> str:
    """The run's model builder (an import path), after checking the model name and options it is given."""
    if spec.builder is None:
        models.check_model_name(spec.model)
        models.check_model_options(spec.model, spec.model_options or {})
        return COURSE_MODELS
    check = getattr(_function("builder", spec.builder), "check_options", None)
    if callable(check):
        check(spec.model, spec.model_options or {})
    return spec.builder


def _prepare(spec: RunSpec, world: int, env: environment.Environment) -> _Prepared:
    """Check one run's arguments and config and decide its folder; starts nothing, writes nothing."""
    if not isinstance(spec.steps, int) or spec.steps < 1:
        raise ValueError(f"steps={spec.steps}: a run needs at least one optimizer step")
    builder = _check_model(spec)
    trainer = spec.trainer or DATA_PARALLEL_STEP
    _function("trainer", trainer)
    initialize = spec.initialize or DEEPSPEED_INITIALIZE
    _function("initialize", initialize)
    if spec.client_optimizer and initialize != DEEPSPEED_INITIALIZE:
        raise ValueError(f"client_optimizer=True: the default initialize builds the client optimizer; "
                         f"{initialize} makes its own engine, so pass the optimizer there")
    if spec.on_error not in ON_ERROR:
        raise ValueError(f"on_error={spec.on_error!r}: choose one of {', '.join(ON_ERROR)}")
    try:
        json.dumps(spec.options or {})
    except TypeError as error:
        raise ValueError(f"options: must be plain JSON (numbers, strings, lists, dicts) for the ranks: {error}") from None
    for key in ("task", "before_training"):
        name = getattr(spec, key)
        if name is not None and not (key == "task" and name == "train"):
            check = getattr(_function(key, name), "check_options", None)
            if callable(check):
                check(spec.options or {})
    base = spec.config if isinstance(spec.config, dict) else configs.load(spec.config)
    config = configs.merged(base, spec.overrides)
    named = list(probe_registry.defaults_for(config) if spec.probes is None else spec.probes)
    if spec.faults:
        course_faults.check(spec.faults, world, spec.steps)
        named.append(course_faults.Faults)
    classes = [probe_registry.resolve_probe(p) for p in named]
    for cls in classes:
        if cls.trainer not in (None, trainer):
            raise ValueError(f"probe {cls.name!r} measures training by {cls.trainer}, but this run trains by "
                             f"{trainer}: give the run trainer={cls.trainer!r}, or leave the probe out")
        cls.check_options(spec.options or {}, spec.steps)
    label = _label(spec)
    full = configs.for_run(config, probe_registry.config_for(classes))
    if spec.check:
        configs.check_or_raise(full, world, env, spec.client_optimizer, source=label)
    return _Prepared(label, spec, run_folder(spec, world), full,
                     tuple(probe_registry.reference(c) for c in classes), trainer, builder, initialize)


def _label(spec: RunSpec) -> str:
    return spec.name or (Path(str(spec.config)).stem if not isinstance(spec.config, dict) else "config")


def run_folder(spec: RunSpec, world: int) -> Path:
    """Where the run of ``spec`` on ``world`` ranks writes its record: ``spec.out``, else
    ``runs/<name>-<model>-<world>r``."""
    return Path(spec.out) if spec.out else RUNS_DIR / f"{_label(spec)}-{spec.model}-{world}r"


def _function(key: str, name: str):
    """The function a RunSpec's ``key`` names (``"package.module:function"``), imported here as the ranks
    will import it; a ValueError naming the key otherwise. A chapter's own module (``runs.<chapter>.<module>``,
    written by the notebook) is found from the repository's root, which the ranks have on their PYTHONPATH."""
    environment.importable_repository()
    try:
        return resolve(name)
    except ValueError as error:
        raise ValueError(f"{key}={error}") from None


def _planned(p: _Prepared, plan_path: Path) -> PlannedRun:
    s = p.spec
    return PlannedRun(name=p.name, out=str(p.out), config=str(p.out / "ds_config.json"), model=s.model,
                      steps=s.steps, seed=s.seed, probes=list(p.probes), trainer=p.trainer, builder=p.builder,
                      initialize=p.initialize,
                      task=s.task, client_optimizer=s.client_optimizer, cast_inputs=s.cast_inputs,
                      on_error=s.on_error, faults=dict(s.faults or {}), model_options=dict(s.model_options or {}),
                      options=dict(s.options or {}), before_training=s.before_training, plan=str(plan_path))


def run(config: str | Path | dict, *, world_size: int | None = None, model: str = "linear", steps: int = 4,
        seed: int = 0, overrides: dict | None = None, name: str | None = None, out: str | Path | None = None,
        timeout: float = 600, check: bool = True, client_optimizer: bool = False, launcher: str | None = None,
        probes: Sequence[ProbeRef] | None = None, cast_inputs: bool = True, faults: dict | None = None,
        options: dict | None = None, before_training: str | None = None, progress: bool = True,
        hosts: Hosts | None = None, model_options: dict | None = None, trainer: str | None = None,
        builder: str | None = None, on_event: EventListener | None = None) -> records.Record:
    """Train ``model`` for ``steps`` optimizer steps on ``world_size`` ranks in one launch; return its record.

    Arguments as in :class:`RunSpec`. ``launcher`` is ``"launch"`` (default) or ``"deepspeed"`` (default
    with ``hosts``, which runs on several machines: the world size is then the hostfile's slots).
    ``on_event`` hears each progress event (:data:`EventListener`), for a live view such as
    :func:`helpers.topics.widgets.watch_run`. Raises :class:`helpers.core.configs.ConfigError` before starting
    anything for a bad config, and :class:`RunFailed` when a rank fails or the run times out.
    """
    spec = RunSpec(config=config, model=model, steps=steps, seed=seed, overrides=overrides, name=name, out=out,
                   probes=None if probes is None else tuple(probes), check=check, client_optimizer=client_optimizer,
                   cast_inputs=cast_inputs, faults=faults, model_options=model_options, options=options,
                   before_training=before_training, trainer=trainer, builder=builder)
    results = _launch_specs([spec], world_size, None, timeout, launcher, progress, hosts=hosts, on_event=on_event)
    return next(iter(results.values()))


def sweep(specs: Sequence[RunSpec] | Mapping[str, RunSpec], *, name: str = "sweep", world_size: int | None = None,
          timeout: float = 900, launcher: str | None = None, progress: bool = True,
          hosts: Hosts | None = None, on_event: EventListener | None = None, rank_prefix: Sequence[str] = (),
          master_addr: str = "127.0.0.1") -> dict[str, records.Record | RunFailed]:
    """Train several runs one after the other in the same ranks of ONE launch; return {name: record}.

    Each run gets a fresh model, ``deepspeed.initialize``, comms-logger reset and probes, and its own
    folder and record, the same record it would get from a launch of its own (tested); its engine is
    destroyed before the next run starts. ``specs`` given as a mapping are named by their keys. Every
    config is checked before anything starts. A failing run ends the launch (:class:`RunFailed`)
    unless its spec says ``on_error="record"``. The launch's own files (plan, command, log) go to
    ``runs/<name>/``. ``on_event`` hears every run's progress (:data:`EventListener`). ``rank_prefix``
    and ``master_addr``: see :func:`command` (a :class:`helpers.topics.bandwidth.Link` gives both).
    """
    if isinstance(specs, Mapping):
        specs = [dataclasses.replace(spec, name=spec.name or key) for key, spec in specs.items()]
    if not specs:
        raise ValueError("sweep() needs at least one RunSpec")
    return _launch_specs(list(specs), world_size, name, timeout, launcher, progress, hosts=hosts, on_event=on_event,
                         rank_prefix=rank_prefix, master_addr=master_addr)


def sweep_retrying(specs: Sequence[RunSpec], *, name: str, world_size: int | None = None, timeout_each: float = 60,
                   progress: bool = True, together: bool = False
                   ) -> tuple[dict[str, records.Record | RunFailed], list[str]]:
    """Train ``specs`` (each ``on_error="record"``) in ONE launch, ``timeout_each`` seconds a run: when they all
    train, they cost one launch's start-up (tens of seconds on GPUs), not one each.

    A failure can leave the ranks unfit for what follows in the same processes (a hang ends the launch; a
    rank that dies ends it; on 2 x H200 a run that ran out of memory was followed by an NCCL error in the
    next), so every run that failed after the launch's first failure is trained again: each in a launch of
    its own (``runs/<name>-again-<i>/``), or all of them in one more given the first launch's time
    (``together``, for runs that share a slow start such as a compile). A failing or hanging run thus costs
    only itself. Returns ({run name: its record or failure}, the names trained again)."""
    world = environment.detect(world_size).default_world_size

    def one_launch(batch: list[RunSpec], launch_name: str, seconds: float) -> dict[str, records.Record | RunFailed]:
        try:
            return sweep(batch, name=launch_name, world_size=world_size, timeout=seconds, progress=progress)
        except RunFailed as failure:  # a rank died: the runs that finished before it have their records
            found: dict[str, records.Record | RunFailed] = {}
            for spec in batch:
                try:
                    found[_label(spec)] = records.load(run_folder(spec, world))
                except (OSError, ValueError):
                    found[_label(spec)] = failure
            return found

    specs = list(specs)
    results = one_launch(specs, name, timeout_each * len(specs))
    failed = [spec for spec in specs if not isinstance(results.get(_label(spec)), records.Record)]
    again = failed[1:]
    if together and again:
        results.update(one_launch(again, f"{name}-again", timeout_each * len(specs)))
    else:
        for i, spec in enumerate(again):
            results.update(one_launch([spec], f"{name}-again-{i}", timeout_each))
    return results, [_label(spec) for spec in again]


def _launch_specs(specs: list[RunSpec], world_size: int | None, sweep_name: str | None, timeout: float,
                  launcher: str | None, progress: bool, hosts: Hosts | None = None,
                  on_event: EventListener | None = None, rank_prefix: Sequence[str] = (),
                  master_addr: str = "127.0.0.1") -> dict[str, records.Record | RunFailed]:
    launcher = launcher or ("deepspeed" if hosts is not None else "launch")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if hosts is not None:
        if launcher != "deepspeed":
            raise ValueError("several hosts need DeepSpeed's multi-node runner: launcher='deepspeed'")
        if not shutil.which("pdsh") and hosts.runner == "pdsh":
            raise ValueError("DeepSpeed's multi-node runner needs pdsh on this machine (Debian: apt-get install pdsh)")
        total = hosts.world_size()
        if world_size is not None and world_size != total:
            raise ValueError(f"world_size={world_size}, but the hostfile's hosts give {total} ranks: "
                             "leave world_size out, or change the hostfile/include/exclude")
        env = dataclasses.replace(environment.detect(), default_world_size=total,
                                  world_size_source=f"{total} slots of {Path(hosts.hostfile).name}")
    else:
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
    Plan(world, launcher, [_planned(p, plan_path) for p in prepared]).write(plan_path)
    child, _ = environment.child_env(env, world)
    if launcher == "torchrun" and env.is_gpu:  # torchrun does not pick GPUs: each rank takes cuda:LOCAL_RANK
        child["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, env.gpu_ids[:world]))
    if hosts is not None:
        child["DS_ENV_FILE"] = str(write_host_env(child, folder / "deepspeed_env"))
    remove_stale_shared_memory()
    where = f"{world} {'GPU' if env.is_gpu else 'CPU'} rank{'s' if world > 1 else ''}"
    if hosts is not None:
        where += f" on {len(hosts.resources())} hosts"
    for attempt in range(1, PORT_RETRIES + 1):
        port = free_port()
        argv = command(plan_path, world, port, launcher, env.gpu_ids, hosts, rank_prefix=rank_prefix,
                       master_addr=master_addr)
        (folder / "command.txt").write_text(shlex.join(argv) + "\n")
        try:
            return _follow(argv, child, folder, prepared, world, where, timeout, progress, port, hosts=hosts,
                           on_event=on_event)
        except RunFailed as failure:
            # Another program took the master port between our check and the ranks' bind.
            if attempt == PORT_RETRIES or not _port_taken(failure):
                raise
            print(f"master port taken by another program; retrying on a new port ({attempt}/{PORT_RETRIES - 1})",
                  file=sys.stderr)
    raise AssertionError("unreachable")


class _Progress:
    """One tqdm bar per run, on stderr (terminals and notebooks alike): each optimizer step's loss is
    the mean over ranks, shown once every rank has reported it. The same events go to ``on_event``."""

    def __init__(self, prepared: list[_Prepared], world: int, where: str, enabled: bool,
                 on_event: EventListener | None = None):
        self.prepared, self.world, self.where, self.enabled = prepared, world, where, enabled
        self.on_event = on_event
        self.pending: dict[tuple[int, int], list[float]] = {}
        self.bar = None

    def _tell(self, kind: str, run: int, **fields) -> None:
        if self.on_event is not None:
            self.on_event({"event": kind, "run": run, "name": self.prepared[run].name, **fields})

    def start(self, run: int) -> None:
        self._tell("run_start", run, steps=self.prepared[run].spec.steps)
        if not self.enabled:
            return
        from tqdm import tqdm  # deferred: only when a progress bar is shown

        self.close()
        p = self.prepared[run]
        self.bar = tqdm(total=p.spec.steps, desc=f"{p.name} · {self.where}", unit="step", file=sys.stderr,
                        leave=True, dynamic_ncols=True, bar_format="{desc}: {n}/{total} steps |{bar:12}| "
                        "{elapsed}{postfix}")

    def step(self, event: dict) -> None:
        losses = self.pending.setdefault((event["run"], event["step"]), [])
        losses.append(event["loss"])
        if len(losses) != self.world:
            return
        # tasks other than training report steps without a loss
        mean = None if None in losses else sum(losses) / len(losses)
        self._tell("step", event["run"], step=event["step"], steps=event["steps"], loss=mean)
        if self.bar is not None:
            self.bar.update(1)
            if mean is not None:
                self.bar.set_postfix_str(f"loss {mean:.4f}")

    def last_step(self, run: int) -> int:
        """The last step of ``run`` that any rank reported (0: none)."""
        return max((step for r, step in self.pending if r == run), default=0)

    def done(self, run: int) -> None:
        self.close()
        self._tell("done", run)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


#: pdsh puts "<host>: " before each line a host prints
_HOST_PREFIX = re.compile(r"^[\w.-]+: ?")

#: The line DeepSpeed's per-machine launcher (``deepspeed/launcher/launch.py``) logs for each rank it saw exit
#: with status 0. Once it has logged one per rank, what it has left is the last second of its poll loop
#: (``time.sleep(1)``) and its own exit, then the ``deepspeed`` command's (the runner waits for it): about 1.5 s
#: per launch, which the course does not wait out (:class:`_CleanExits`).
RANK_EXITED = re.compile(r"\[launch\.py:\d+:main\] Process \d+ exits successfully\.")


#: DeepSpeed's launcher's line for a rank that ended with an error or a signal (``return code = -9``: SIGKILL).
RANK_FAILED = re.compile(r"\[launch\.py:\d+:sigkill_handler\] .* exits with return code = (-?\d+)")


class _HostMemory:
    """The lowest memory the host had available while a launch ran, sampled every half second: the evidence
    for the kernel's out-of-memory killer, which ends a rank with SIGKILL and leaves no Python error."""

    def __init__(self):
        self.total, self.lowest, self._next = psutil.virtual_memory().total, math.inf, 0.0

    def sample(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self.lowest, self._next = min(self.lowest, psutil.virtual_memory().available), now + 0.5

    @property
    def ran_out(self) -> bool:
        """Whether less than 2% (or 1 GiB, whichever is larger) was left at the lowest sample."""
        return self.lowest < max(2 ** 30, 0.02 * self.total)


def how_it_ended(code: int | None, log_lines: Sequence[str], memory: _HostMemory) -> str:
    """What ended a launch whose ranks did not all exit cleanly, in words: the signal that killed a rank (from
    DeepSpeed's launcher's log) and, for SIGKILL, the host's lowest available memory, or the exit code."""
    codes = [int(m.group(1)) for line in log_lines if (m := RANK_FAILED.search(line))]
    signals = [-c for c in codes if c < 0]
    if not signals:
        return f"exited with code {code}"
    try:
        said = f"a rank was killed by {signal.Signals(signals[0]).name}"
    except ValueError:
        said = f"a rank was killed by signal {signals[0]}"
    if signals[0] != signal.SIGKILL:
        return said
    gib = 2 ** 30
    low = f"{memory.lowest / gib:.1f} GiB of {memory.total / gib:.0f} GiB" if memory.lowest < math.inf else "unknown"
    if memory.ran_out:
        return (f"{said}: the host ran out of memory (available at the lowest sample: {low}); the kernel's "
                "out-of-memory killer ends a process this way, with no Python error")
    return (f"{said}, which comes from outside the process: the kernel's out-of-memory killer or a `kill -9` "
            f"(the host's available memory at the lowest sample: {low})")


class _CleanExits:
    """Counts DeepSpeed's launcher's :data:`RANK_EXITED` lines in a local launch's output: ``done`` once every
    one of the ``world`` ranks has exited with status 0. Nothing is left to wait for then but the launcher's
    idle second, so the caller ends the launcher (and the ``deepspeed`` command above it) at once."""

    def __init__(self, world: int):
        self.world, self.seen = world, 0

    def see(self, line: str) -> bool:
        """Count ``line``; True once every rank's clean exit has been logged."""
        self.seen += bool(RANK_EXITED.search(line))
        return self.done

    @property
    def done(self) -> bool:
        return self.seen >= self.world


def _follow(argv: list[str], child: dict[str, str], folder: Path, prepared: list[_Prepared], world: int,
            where: str, timeout: float, progress: bool, port: int,
            hosts: Hosts | None = None,
            on_event: EventListener | None = None) -> dict[str, records.Record | dict | RunFailed]:
    """Start one launch, follow its events, and return each run's record (or RunFailed, see on_error)."""
    started = time.perf_counter()
    fatal: dict | None = None
    run_errors: dict[int, dict] = {}
    run_times: dict[int, list[float]] = {}
    log_lines: list[str] = []
    bars = _Progress(prepared, world, where, progress, on_event)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child,
                               cwd=environment.REPO_ROOT, start_new_session=True, preexec_fn=_die_with_parent)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    timed_out = interrupted = False
    stacks = ""
    exits = _CleanExits(world if hosts is None else math.inf)  # several hosts: pdsh's runner ends by itself
    memory = _HostMemory()
    try:
        with open(folder / "launch.log", "w") as log:
            while not exits.done:
                remaining = timeout - (time.perf_counter() - started)
                if remaining <= 0:
                    timed_out = True
                    break
                memory.sample()
                try:
                    line = lines.get(timeout=min(remaining, 0.2))
                except queue.Empty:
                    continue
                if line is None:
                    break
                if hosts is not None:
                    line = _HOST_PREFIX.sub("", line, count=1)
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
                            bars.done(event["run"])
                        elif kind == "run_error":  # every rank reports; keep the lowest rank's, as in order
                            if event["rank"] < run_errors.get(event["run"], {"rank": math.inf})["rank"]:
                                run_errors[event["run"]] = event
                        elif kind == "error" and fatal is None:
                            fatal = event
                    if not text.strip():
                        continue
                    line = text
                log.write(line)
                log_lines.append(line)
                del log_lines[:-40]
                exits.see(line)
        if not timed_out and not exits.done:
            try:
                process.wait(max(1.0, timeout - (time.perf_counter() - started)))
            except subprocess.TimeoutExpired:
                timed_out = True
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        code = 0 if exits.done else process.poll()  # every rank exited 0, as DeepSpeed's launcher logged
        bars.close()
        if timed_out and hosts is None:
            stacks = _rank_stacks(process, lines, folder / "launch.log")
        if hosts is not None and code is None:
            # not SIGTERM: DeepSpeed's runner answers it with `pkill -f` of every DeepSpeed launcher
            # of this Python on every host. Kill this launch's processes here, then its ranks there.
            _kill_group(process, signals=(signal.SIGKILL,))
            _stop_remote_ranks(hosts, folder / "plan.json", child)
        if exits.done:  # only the launcher's idle second was left
            _end_idle_launcher(process)
        _kill_group(process)  # nothing of a launch outlives it, whatever happened
        remove_shared_memory(port)
        if interrupted:
            print("interrupted: every process of the run was stopped", file=sys.stderr)
    seconds = time.perf_counter() - started

    tail = "".join(log_lines[-25:])
    first = prepared[0].out
    if timed_out:
        where_stuck = f"\nWhere the ranks waited (their Python stacks):\n{stacks}" if stacks else ""
        if all(p.spec.on_error == "record" for p in prepared):
            steps_done = {i: bars.last_step(i) for i in range(len(prepared))}
            return _after_timeout(prepared, run_times, steps_done, timeout, tail, stacks)
        raise RunFailed(f"[{where}] timed out after {timeout:.0f} s: every process of the run was stopped. "
                        f"Last log lines:\n{tail}{where_stuck}", log_tail=tail, out=first,
                        traceback=stacks)
    if fatal is not None:
        run = next((p for i, p in enumerate(prepared) if i in run_times and len(run_times[i]) == 1), prepared[0])
        ended = how_it_ended(code, log_lines, memory)
        # a rank killed by a signal is the cause; another rank's error (its peer's connection closed) follows
        cause = f"{ended}; then " if ended.startswith("a rank was killed") else ""
        raise RunFailed(f"{cause}rank {fatal['rank']} failed: {fatal['type']}: {fatal['message']}", rank=fatal["rank"],
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
            # the run that was training when the launch ended: the first without its record
            p = next((q for q in prepared[i:] if not (q.out / "summary.json").exists()), p)
            raise RunFailed(f"[{where}] {how_it_ended(code, log_lines, memory)} and no summary for {p.name}. "
                            f"Last log lines:\n{tail}", log_tail=tail, out=p.out)
        times = run_times.get(i, [])
        # a launch of one run: launch to exit; a run of a sweep: its own start to its record
        results[p.name] = _finished(p, seconds if len(prepared) == 1 else
                                    (times[1] - times[0] if len(times) == 2 else None))
    return results


def _finished(p: _Prepared, wall_s: float | None) -> records.Record | dict:
    """A finished run's record (its ``wall_s`` set), or the summary a task other than training wrote
    (a benchmark's table, say)."""
    if p.spec.task != "train":
        summary = json.loads((p.out / "summary.json").read_text())
        if not _is_record(summary):
            return summary
    record = records.load(p.out)
    record.wall_s = wall_s
    return record


def _is_record(summary: dict) -> bool:
    """Whether a task's summary.json is a run record (a PyTorch DDP run's, say) rather than other results."""
    try:
        records.validate(summary)
    except ValueError:
        return False
    return True


#: The stock commands a learner's own script can be started with (:func:`run_script`).
SCRIPT_LAUNCHERS = ("deepspeed", "accelerate")


def script_command(script: str | Path, args: Sequence[str] = (), world_size: int | None = None,
                   port: int | None = None, launcher: str = "deepspeed",
                   deepspeed_config: str | Path | None = None) -> list[str]:
    """The stock command that starts ``script`` on ``world_size`` ranks of this machine (its GPUs, or CPU
    ranks), as a learner would type it: ``deepspeed --num_gpus N --master_port P script ARGS``, or with
    ``launcher="accelerate"``, ``accelerate launch --num_processes N --use_deepspeed --deepspeed_config_file
    CONFIG ... script ARGS`` (Hugging Face Accelerate's launcher with DeepSpeed, which needs ``deepspeed_config``)."""
    if launcher not in SCRIPT_LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: choose one of {', '.join(SCRIPT_LAUNCHERS)}")
    if launcher == "accelerate" and deepspeed_config is None:
        raise ValueError("launcher='accelerate' needs deepspeed_config: the path of the DeepSpeed config (JSON) "
                         "that `accelerate launch --deepspeed_config_file` hands to the script")
    env = environment.detect(world_size)
    world = env.default_world_size if world_size is None else world_size
    port = port or free_port()
    # the command beside this Python; where it was installed without its scripts, the module it runs
    script_path = Path(sys.executable).with_name(launcher)
    modules = {"deepspeed": "deepspeed.launcher.runner", "accelerate": "accelerate.commands.launch"}
    program = [str(script_path)] if script_path.exists() else [sys.executable, "-m", modules[launcher]]
    if launcher == "accelerate":
        program += ["launch"] if script_path.exists() else []
        return [*program, "--num_processes", str(world), "--num_machines", "1", "--use_deepspeed",
                "--deepspeed_config_file", str(deepspeed_config), "--main_process_port", str(port),
                *(["--gpu_ids", ",".join(map(str, env.gpu_ids[:world]))] if env.gpu_ids else []),
                str(script), *map(str, args)]
    where = (["--include", "localhost:" + ",".join(map(str, env.gpu_ids[:world]))] if env.gpu_ids
             else ["--num_gpus", str(world)])
    return [*program, *where, "--master_port", str(port), str(script), *map(str, args)]


def run_script(script: str | Path, args: Sequence[str] = (), *, world_size: int | None = None,
               launcher: str = "deepspeed", deepspeed_config: str | Path | None = None, timeout: float = 600,
               show: bool = True) -> str:
    """Run a learner's own training ``script`` with a stock command (:func:`script_command`), its output shown
    as it comes (``show``); return the output. A script that fails, hangs past ``timeout`` seconds or is
    interrupted ends with every process it started and the shared memory of its CPU ranks removed, and raises
    :class:`RunFailed` with the end of its output."""
    script = Path(script)
    if not script.is_file():
        raise ValueError(f"script {str(script)!r} does not exist: write it first (%%writefile {script.name})")
    if deepspeed_config is not None and not Path(deepspeed_config).is_file():
        raise ValueError(f"deepspeed_config {str(deepspeed_config)!r} does not exist: write the config file first")
    env = environment.detect(world_size)
    world = env.default_world_size if world_size is None else world_size
    argv = script_command(script, args, world, port := free_port(), launcher, deepspeed_config)
    child, _ = environment.child_env(env, world)
    # the script imports the course's package (helpers.measure) from this checkout
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(environment.REPO_ROOT), child.get("PYTHONPATH", "")]))
    if show:  # as a learner types it
        rest = argv[3:] if argv[1] == "-m" else argv[1:]
        if launcher == "accelerate" and rest[0] != "launch":
            rest = ["launch", *rest]
        print("$ " + shlex.join([launcher, *rest]).replace(f"{environment.REPO_ROOT}/", ""), flush=True)
    process = subprocess.Popen(argv, env=child, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    output: list[str] = []
    deadline = time.monotonic() + timeout
    exits = _CleanExits(world)  # the deepspeed command's launcher logs each rank's clean exit (not accelerate's)
    try:
        while not exits.done:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:  # the reader saw the end of the output
                break
            if line:
                output.append(line)
                if show:  # paths inside the course's folder shown relative to it, as on any learner's machine
                    print(line.replace(f"{environment.REPO_ROOT}/", ""), end="", flush=True)
                exits.see(line)
            if time.monotonic() > deadline:
                raise RunFailed(f"{script.name} ran past its timeout of {timeout:.0f} s: stopped",
                                log_tail="".join(output[-40:]))
        code = 0 if exits.done else process.wait()  # every rank exited 0: the finally below ends the rest
        if code != 0:
            raise RunFailed(f"{script.name} failed (exit code {code}); the end of its output:\n"
                            + "".join(output[-25:]), log_tail="".join(output[-40:]))
    finally:
        if process.poll() is None:
            _end_idle_launcher(process) if exits.done else _kill_group(process)
        try:  # ranks that outlive their launcher share its process group
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        remove_shared_memory(port)
    return "".join(output)


def run_expecting_failure(config: str | Path | dict, **kwargs) -> RunFailed:
    """Run something that should fail and return the failure, to show a real DeepSpeed error.

    Raises AssertionError if the run succeeds after all.
    """
    try:
        run(config, progress=False, **kwargs)
    except RunFailed as failure:
        return failure
    raise AssertionError("the run was expected to fail but succeeded")
