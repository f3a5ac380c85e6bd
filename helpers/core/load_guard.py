"""The course's load guard: a timing verdict only where the run had its devices to itself.

A verdict such as "A is 1.3x faster than B" or "the model erred by +20%" means something only when
nothing else used the devices while the steps were timed, and when the difference is larger than the
steps' own scatter. This module records the first and checks both:

- :func:`watch` (a context manager around a timed launch) samples, once a ``interval``, what processes
  outside the run did on its devices: on GPUs the other compute processes and the utilization (NVML
  through ``pynvml`` where it imports, else ``nvidia-smi``), on CPU the processor time used by processes
  that are not this one or its descendants, against the core count. It yields a :class:`Watch`; its
  ``load`` is a :class:`Load` once the block ends.
- :func:`compare` takes two or more lists of measured step times (seconds) and the :class:`Load`, and
  returns a :class:`Verdict`: medians, the ratio of the slowest to the fastest and which is faster, or
  the reason the verdict is withheld. :func:`sentence` writes it as one sentence.

Sweep order: the first run of a sweep warms the machine (caches, clocks, allocators), so an early
configuration can look slower than it is. Measure the first configuration again at the end and pass
those times as ``repeat=``: where the two measurements of one configuration differ by more than their
spread, the verdict is withheld ("the machine changed during the sweep").

Checks that execute many notebooks (``check-gpu``) set two variables: :data:`LOCK_VARIABLE`, a file that
:func:`watch` locks for its block, so that the timed launches of notebooks executed together take turns;
and :data:`LOG_VARIABLE`, a file to which :func:`compare` adds each verdict (given or withheld, and why),
which the check's report counts.

Example::

    with load_guard.watch(ranks=2) as w:
        runs = launch.sweep(specs)
    verdict = load_guard.compare({"ZeRO-1": steps_1, "ZeRO-2": steps_2}, w.load)
    print(load_guard.sentence(verdict))
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from typing import Iterator, Mapping, Sequence

import psutil

from helpers.core import ds

#: CPU: the share of the machine's processor time other processes may use while the run still counts as alone.
MAX_OTHER_CPU_SHARE = 0.05
#: CPU: a process outside the run counts as "another process" once it used this much processor time (seconds).
MIN_OTHER_CPU_S = 0.2
#: A file :func:`watch` holds locked for its block, where set: timed launches sharing the devices take turns.
LOCK_VARIABLE = "COURSE_TIMING_LOCK"
#: A file :func:`compare` adds one JSON line to for each verdict, where set (read back by :func:`read_log`).
LOG_VARIABLE = "COURSE_VERDICT_LOG"
#: The fewest measured steps a list may have for its spread, and so a verdict, to mean something.
MIN_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Load:
    """What else used the run's devices while it ran (see :func:`watch`).

    ``device``: "gpu" or "cpu". ``other_processes``: processes outside the run seen on the devices (GPU
    compute processes; on CPU, processes that used at least :data:`MIN_OTHER_CPU_S`). ``other_share``: on
    CPU, the share of all cores' time those processes used (0..1); on GPU, the mean utilization of the
    devices over the samples where another process was present (0..1; ``None`` when no sample had one).
    ``cores``: CPU cores (CPU) or devices watched (GPU). ``seconds``: how long the watch lasted.
    ``source``: how it was measured. ``pids``: the other processes' ids.
    """

    device: str
    other_processes: int
    other_share: float | None
    cores: int
    seconds: float
    samples: int
    source: str
    pids: tuple[int, ...] = ()
    note: str = ""  # where not alone: why, in words (a committed reference's written conditions)

    @property
    def alone(self) -> bool:
        """True where nothing outside the run used its devices enough to change its timings."""
        if self.device == "gpu":
            return self.other_processes == 0
        return (self.other_share or 0.0) <= MAX_OTHER_CPU_SHARE

    def reason(self) -> str:
        """Why the run was not alone (empty where it was): the clause a withheld verdict gives."""
        if self.alone:
            return ""
        if self.note:
            return self.note
        if self.device == "gpu":
            return (f"{self.other_processes} other process{'es' if self.other_processes != 1 else ''} used "
                    f"{'these GPUs' if self.cores > 1 else 'this GPU'} during the run")
        return (f"other processes ({self.other_processes}) used {self.other_share:.0%} of the {self.cores} "
                f"cores' time during the run")

    def describe(self) -> str:
        """One line for a notebook: what the watch saw."""
        if self.samples == 0:
            return "Load beside the run: not recorded."
        what = (f"{self.other_processes} other GPU process{'es' if self.other_processes != 1 else ''}" if self.device == "gpu"
                else f"other processes used {self.other_share:.0%} of the {self.cores} cores' time "
                     f"({self.other_processes} of them above {MIN_OTHER_CPU_S:g} s)")
        verdict = "alone: timing verdicts may be given" if self.alone else "not alone: timing verdicts are withheld"
        return f"Load beside the run ({self.samples} samples over {self.seconds:.0f} s, {self.source}): {what}; {verdict}."

    @classmethod
    def from_dict(cls, saved: Mapping) -> "Load":
        """A load saved with ``dataclasses.asdict`` (in a record or a JSON file) read back."""
        return cls(**{**saved, "pids": tuple(saved.get("pids", ()))})

    @classmethod
    def from_conditions(cls, conditions: str | None, device: str = "gpu") -> "Load":
        """A committed reference's written conditions as a load: alone where they begin "alone" (the words
        ``benchmarks/reference.py`` writes for a machine it had to itself), end ", alone" (``check-gpu``'s for a
        notebook executed by itself), say "nothing else running on it", or say it had its own GPUs to itself
        (:func:`own_gpus_alone`), else not
        alone, that text the reason."""
        text = conditions or "not stated"
        if (text.startswith("alone") or "alone" in text.split(", ") or "nothing else running on it" in text
                or own_gpus_alone(text)):
            return cls(device, 0, None, 0, 0.0, 1, f"the reference's conditions: {text}")
        return cls(device, 1, None, 0, 0.0, 1, f"the reference's conditions: {text}",
                   note=f"not measured alone ({text})")

    @classmethod
    def unknown(cls, device: str = "cpu") -> "Load":
        """A load nobody recorded: every verdict on it is withheld."""
        return cls(device, 0, None, 0, 0.0, 0, "not recorded")


def own_gpus_alone(conditions: str) -> bool:
    """Whether written conditions say the run had its own GPUs to itself, as :func:`watch` counts it (only
    processes on the run's GPUs): they open with its GPUs ("GPUs 2,3 of a 4 x ... machine"), say that one
    notebook (or launch) at a time ran there, or that the work beside it ran on other GPUs only ("on GPUs 0,1",
    "on the other two GPUs"), and never that it shared its GPUs or ran several notebooks at a time there."""
    own = re.match(r"GPUs ([\d,]+) of a ", conditions)
    if not own or re.search(r"shared|(?<!one) notebooks at a time here", conditions):
        return False
    mine = set(own.group(1).split(","))
    others = [set(m.split(",")) for m in re.findall(r"on GPUs ([\d,]+)", conditions)]
    beside = bool(others) or "on the other" in conditions
    return (beside or "one notebook at a time here" in conditions) and all(not (o & mine) for o in others)


# --- recording ---------------------------------------------------------------------------------

def _ours(me: psutil.Process) -> set[int]:
    """This process and all its descendants (the launcher and the ranks it started)."""
    try:
        return {me.pid} | {p.pid for p in me.children(recursive=True)}
    except psutil.Error:
        return {me.pid}


def watched_gpus() -> list[int] | None:
    """The GPU numbers (as ``nvidia-smi`` lists them) whose other processes count against a run here: those
    ``$COURSE_GPUS`` names (the course's ranks use only those), else those ``$CUDA_VISIBLE_DEVICES`` names,
    else None (every GPU). Two checks sharing one box, each on its own GPUs, then do not count each other."""
    for variable in ("COURSE_GPUS", "CUDA_VISIBLE_DEVICES"):  # environment.GPUS_VARIABLE first
        value = os.environ.get(variable, "").strip()
        if value:
            numbers = [int(i) for i in value.split(",") if i.strip().isdigit()]
            if numbers:
                return numbers
    return None


def _gpu_sampler() -> tuple[str, object] | None:
    """How to read the watched GPUs' processes and utilization here: ("pynvml", handles), ("nvidia-smi",
    GPU numbers or None for all), or None."""
    chosen = watched_gpus()
    try:
        import pynvml  # optional: NVIDIA's bindings, where installed

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        indices = chosen if chosen is not None else list(range(count))
        return "pynvml", [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices if i < count]
    except Exception:  # no module, no driver, no device: try the command line tool
        pass
    if shutil.which("nvidia-smi"):
        return "nvidia-smi", chosen
    return None


def _smi(*query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=20).stdout
    return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_sample(sampler: tuple[str, object]) -> tuple[set[int], float, int]:
    """One look at the GPUs: (pids of their compute processes, mean utilization 0..1, devices)."""
    kind, handles = sampler
    if kind == "pynvml":
        import pynvml  # optional, present: _gpu_sampler chose it

        pids = {p.pid for h in handles for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        use = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100 for h in handles]
        return pids, (sum(use) / len(use) if use else 0.0), len(handles)
    return _smi_sample(handles, _smi("--query-gpu=index,uuid,utilization.gpu"),
                       _smi("--query-compute-apps=pid,gpu_uuid"))


def _smi_sample(chosen: Sequence[int] | None, gpus: list[list[str]],
                apps: list[list[str]]) -> tuple[set[int], float, int]:
    """:func:`gpu_sample` from ``nvidia-smi``'s rows (index, uuid, utilization; pid, gpu uuid), keeping the
    GPUs numbered in ``chosen`` (all where None)."""
    kept = {row[1]: float(row[2]) / 100 for row in gpus if len(row) >= 3 and row[0].isdigit()
            and (chosen is None or int(row[0]) in chosen) and row[2].replace(".", "").isdigit()}
    pids = {int(row[0]) for row in apps if len(row) >= 2 and row[0].isdigit() and row[1] in kept}
    use = list(kept.values())
    return pids, (sum(use) / len(use) if use else 0.0), len(use)


@dataclasses.dataclass
class Watch:
    """What :func:`watch` yields: ``load`` is set when its block ends (None before)."""

    load: Load | None = None


def _cpu_time(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


@contextlib.contextmanager
def watch(ranks: int | None = None, interval: float = 0.5, device: str | None = None) -> Iterator[Watch]:
    """Record, for the duration of the block, what processes outside this one (and its descendants) did on
    the devices. ``device``: "gpu" or "cpu" (default: "gpu" where NVML or ``nvidia-smi`` answers, unless the
    ranks run on the CPU, ``$COURSE_DEVICE=cpu``). ``ranks``:
    the run's processes on the GPUs, used where the GPU tool reports process ids from another pid namespace
    (a container), so that ours cannot be told apart: then every process beyond ``ranks`` counts as
    another. Processes that started and ended between two samples are missed on CPU.
    """
    me = psutil.Process()
    if device is None and ds.cpu_ranks_chosen():
        device = "cpu"  # CPU ranks on a machine with GPUs (environment.detect's choice)
    sampler = _gpu_sampler() if device in (None, "gpu") else None
    device = device or ("gpu" if sampler else "cpu")
    if device == "gpu" and sampler is None:
        raise RuntimeError("device='gpu' but neither pynvml nor nvidia-smi answers here")
    result = Watch()
    stop = threading.Event()
    seen: dict[int, float] = {}  # pid -> processor seconds at the last sample
    other_cpu: dict[int, float] = {}  # pid outside the run -> processor seconds used during the watch
    gpu_others: set[int] = set()
    gpu_busy: list[float] = []
    devices = [0]
    samples = [0]

    def cpu_look() -> None:
        ours = _ours(me)
        for p in psutil.process_iter():
            try:
                used = _cpu_time(p)
                fresh = p.pid not in seen and p.create_time() >= boot
            except psutil.Error:
                continue
            before = seen.get(p.pid, 0.0 if fresh else used)
            seen[p.pid] = used
            if p.pid not in ours and used > before:
                other_cpu[p.pid] = other_cpu.get(p.pid, 0.0) + used - before

    def gpu_look() -> None:
        pids, busy, count = gpu_sample(sampler)
        devices[0] = count
        ours = _ours(me)
        if pids and not pids & ours and ranks is not None and not any(psutil.pid_exists(p) for p in pids):
            others = set(sorted(pids)[ranks:])  # ids from another pid namespace: count beyond the run's ranks
        else:
            others = pids - ours
        gpu_others.update(others)
        if others:
            gpu_busy.append(busy)

    def loop() -> None:
        while True:
            try:
                gpu_look() if device == "gpu" else cpu_look()
                samples[0] += 1
            except (psutil.Error, OSError, subprocess.SubprocessError):
                pass
            if stop.wait(interval):
                return

    lock = _take_turn()  # before the first sample: time spent waiting for the turn is not the run's
    start, boot = time.monotonic(), time.time()
    if device == "cpu":
        cpu_look()  # the starting point of every process's processor time
    thread = threading.Thread(target=loop, name="load-guard", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        if lock is not None:
            _held.turn = False
            lock.close()  # closing the file releases its lock
        seconds = time.monotonic() - start
        if device == "gpu":
            result.load = Load("gpu", len(gpu_others), statistics.fmean(gpu_busy) if gpu_busy else None,
                               devices[0], seconds, samples[0], sampler[0], tuple(sorted(gpu_others)))
        else:
            cores = psutil.cpu_count() or 1
            busy = [pid for pid, s in other_cpu.items() if s >= MIN_OTHER_CPU_S]
            result.load = Load("cpu", len(busy), sum(other_cpu.values()) / (seconds * cores), cores, seconds,
                               samples[0], "psutil: processor time of processes outside the run", tuple(sorted(busy)))


_held = threading.local()  # whether this thread already holds the turn (a watch inside a watch)


def _take_turn():
    """Wait for, and hold, the lock named by :data:`LOCK_VARIABLE` (None where it is not set, or where this
    thread already holds it: a second lock of the same file would wait for itself)."""
    path = os.environ.get(LOCK_VARIABLE)
    if not path or getattr(_held, "turn", False):
        return None
    handle = open(path, "a")
    fcntl.flock(handle, fcntl.LOCK_EX)
    _held.turn = True
    return handle


# --- the verdict -------------------------------------------------------------------------------

def spread(times: Sequence[float]) -> float:
    """The relative spread of measured step times: (largest - smallest) / median (0 for a single value)."""
    if not times:
        raise ValueError("no step times")
    return (max(times) - min(times)) / statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`compare`: the figures always, and either a verdict or the reason it is withheld.

    ``names`` and ``medians`` (seconds) in the order given; ``spread``: the widest relative spread among the
    lists; ``ratio``: the slowest median over the fastest; ``faster``: the name with the smallest median;
    ``change``: each median against the first, minus 1 (the first is 0.0; for a model's prediction given
    second, its error); ``withheld``: why no verdict may be printed ("" where it may).
    """

    names: tuple[str, ...]
    medians: tuple[float, ...]
    spread: float
    ratio: float
    faster: str
    change: tuple[float, ...]
    withheld: str

    @property
    def given(self) -> bool:
        """True where the verdict may be printed."""
        return not self.withheld


def compare(samples: Mapping[str, Sequence[float]], load: Load | None,
            repeat: Sequence[float] | None = None, sweep: bool = False) -> Verdict:
    """Compare two or more named lists of measured step times (seconds) under a recorded ``load``.

    The verdict is withheld, with the reason, where the load is unknown or the run was not alone
    (:attr:`Load.alone`), where a list of measured steps has fewer than :data:`MIN_STEPS` (too few for a
    spread), where ``repeat`` (the first configuration measured again at the end of the sweep) differs from
    the first list by more than their spread, where ``sweep`` says the lists come from one sweep but no
    ``repeat`` was measured, or where the difference between the slowest and the fastest median does not
    exceed the widest spread of the lists. A single value (a prediction) has no spread of its own.
    """
    if len(samples) < 2:
        raise ValueError("compare needs two or more lists of step times")
    names = tuple(samples)
    medians = tuple(statistics.median(samples[n]) for n in names)
    if any(m <= 0 for m in medians):
        raise ValueError("step times must be positive")
    widest = max(spread(samples[n]) for n in names)
    fastest = min(range(len(names)), key=lambda i: medians[i])
    ratio = max(medians) / medians[fastest]
    change = tuple(m / medians[0] - 1 for m in medians)
    few = [n for n in names if 1 < len(samples[n]) < MIN_STEPS]
    reason = ""
    if load is None or load.samples == 0:
        reason = "nothing recorded what else used the devices during the run"
    elif not load.alone:
        reason = load.reason()
    elif few:
        reason = (f"too few measured steps to judge ({', '.join(f'{n}: {len(samples[n])}' for n in few)}; "
                  f"a spread needs at least {MIN_STEPS})")
    elif repeat is not None:
        first = samples[names[0]]
        moved = statistics.median(repeat) / medians[0] - 1
        bound = max(spread(first), spread(repeat))
        if abs(moved) > bound:
            reason = (f"the machine changed during the sweep: {names[0]}, repeated at the end, took "
                      f"{abs(moved):.0%} {'longer' if moved > 0 else 'less'} than at the start, more than its "
                      f"spread ({bound:.0%})")
    elif sweep:
        reason = f"the sweep did not measure its first setting ({names[0]}) again at its end"
    if not reason and ratio - 1 <= widest:
        reason = f"the difference ({ratio - 1:.0%}) is within the steps' spread ({widest:.0%})"
    verdict = Verdict(names, medians, widest, ratio, names[fastest], change, reason)
    _log(verdict)
    return verdict


def _log(verdict: Verdict) -> None:
    """Add ``verdict`` to the file named by :data:`LOG_VARIABLE`, where set."""
    path = os.environ.get(LOG_VARIABLE)
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"names": verdict.names, "ratio": round(verdict.ratio, 4),
                                  "spread": round(verdict.spread, 4), "withheld": verdict.withheld}) + "\n")


def read_log(path: str | os.PathLike) -> dict:
    """Count the verdicts a :data:`LOG_VARIABLE` file holds: ``given``, ``withheld`` and, for those withheld,
    how many for each kind of reason ("not alone", "within the spread", "changed during the sweep", "no repeat",
    "too few steps", "not recorded")."""
    counts: dict = {"given": 0, "withheld": 0, "reasons": {}}
    if not os.path.exists(path):
        return counts
    with open(path) as log:
        for line in log:
            why = json.loads(line)["withheld"]
            if not why:
                counts["given"] += 1
                continue
            counts["withheld"] += 1
            kind = ("within the spread" if "within the steps' spread" in why
                    else "changed during the sweep" if "during the sweep" in why
                    else "no repeat" if "again at its end" in why
                    else "too few steps" if "too few measured steps" in why
                    else "not recorded" if "nothing recorded" in why else "not alone")
            counts["reasons"][kind] = counts["reasons"].get(kind, 0) + 1
    return counts


def sentence(verdict: Verdict) -> str:
    """One sentence from a :class:`Verdict`: the verdict, or "withheld: <reason>" beside the medians."""
    medians = ", ".join(f"{n} {m * 1e3:,.3g} ms" for n, m in zip(verdict.names, verdict.medians))
    if not verdict.given:
        return f"Verdict withheld: {verdict.withheld} (medians: {medians})."
    slowest = verdict.names[max(range(len(verdict.names)), key=lambda i: verdict.medians[i])]
    return (f"{verdict.faster} is faster: {slowest} takes {verdict.ratio:.2f}x its time, "
            f"beyond the steps' spread of {verdict.spread:.0%} (medians: {medians}).")
