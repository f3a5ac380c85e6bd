"""helpers.core.load_guard: timing verdicts are withheld under load, under a wide spread, and after drift."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers.core import load_guard

ALONE = load_guard.Load("cpu", 0, 0.01, 2, 3.0, 6, "test: an idle machine")


def timed_steps(n: int, work: int) -> list[float]:
    """n step times of a fixed piece of work (seconds)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        sum(i * i for i in range(work))
        times.append(time.perf_counter() - start)
    return times


@pytest.fixture
def busy_process():
    """A process spinning on a core, NOT a descendant of this one (started through a shell that exits),
    so the guard must count it as another process."""
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True).stdout
    pid = int(out.strip())
    yield pid
    os.kill(pid, signal.SIGKILL)


def test_a_comparison_under_another_busy_process_is_withheld_with_its_reason(busy_process):
    spinner = psutil.Process(busy_process)
    with load_guard.watch(device="cpu", interval=0.2) as w:
        used = sum(spinner.cpu_times()[:2])
        small, large = timed_steps(5, 20_000), timed_steps(5, 200_000)
        deadline = time.monotonic() + 30  # on a shared machine the spinner may get little of a core
        while sum(spinner.cpu_times()[:2]) - used < 2 * load_guard.MIN_OTHER_CPU_S and time.monotonic() < deadline:
            time.sleep(0.2)
    load = w.load
    assert load.device == "cpu" and load.samples >= 2
    assert not load.alone and busy_process in load.pids and os.getpid() not in load.pids
    verdict = load_guard.compare({"small": small, "large": large}, load)
    assert not verdict.given
    assert "other processes" in verdict.withheld and "cores' time during the run" in verdict.withheld
    assert load_guard.sentence(verdict).startswith("Verdict withheld: other processes")


def test_the_same_comparison_alone_and_well_separated_gets_its_verdict():
    small, large = timed_steps(5, 20_000), timed_steps(5, 200_000)
    verdict = load_guard.compare({"small": small, "large": large}, ALONE)
    assert verdict.given, verdict.withheld
    assert verdict.faster == "small" and verdict.ratio > 1 + verdict.spread
    assert load_guard.sentence(verdict).startswith("small is faster: large takes")


def test_a_difference_within_the_spread_is_withheld_even_when_alone():
    a = [0.100, 0.130, 0.105, 0.095, 0.120]  # spread (0.130 - 0.095) / 0.105 = 33%
    b = [0.110, 0.112, 0.111]  # 6% slower than a's median
    verdict = load_guard.compare({"a": a, "b": b}, ALONE)
    assert not verdict.given
    assert verdict.withheld == "the difference (6%) is within the steps' spread (33%)"
    assert verdict.change == (0.0, pytest.approx(0.111 / 0.105 - 1))


def _fake_smi(tmp_path, monkeypatch, apps: str, gpus: str) -> None:
    """A stand-in for nvidia-smi on PATH (and no pynvml): ``apps`` and ``gpus`` are its CSV answers."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\ncase "$1" in\n  --query-compute-apps*) printf "{apps}";;\n'
                    f'  --query-gpu*) printf "{gpus}";;\nesac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # force the command-line tool


def test_gpu_processes_outside_the_run_withhold_the_verdict(tmp_path, monkeypatch):
    # two compute processes on GPU 0 (one of them this process), 90% utilization
    _fake_smi(tmp_path, monkeypatch, f"{os.getpid()}, GPU-a\\n1, GPU-a\\n", "0, GPU-a, 90\\n")
    monkeypatch.delenv("COURSE_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with load_guard.watch(device="gpu", interval=0.05) as w:
        time.sleep(0.2)
    assert w.load.source == "nvidia-smi" and w.load.pids == (1,) and w.load.other_share == pytest.approx(0.9)
    verdict = load_guard.compare({"a": [1.0, 1.01], "b": [2.0, 2.02]}, w.load)
    assert verdict.withheld == "1 other process used this GPU during the run"


def test_processes_on_gpus_the_run_does_not_use_do_not_count(tmp_path, monkeypatch):
    # four GPUs; another check runs on GPUs 2,3 (process 7) while this run has GPUs 0,1 (COURSE_GPUS)
    _fake_smi(tmp_path, monkeypatch, "7, GPU-c\\n7, GPU-d\\n",
              "0, GPU-a, 0\\n1, GPU-b, 0\\n2, GPU-c, 95\\n3, GPU-d, 97\\n")
    monkeypatch.setenv("COURSE_GPUS", "0,1")
    with load_guard.watch(device="gpu", interval=0.05) as w:
        time.sleep(0.2)
    assert w.load.pids == () and w.load.cores == 2 and w.load.alone
    monkeypatch.setenv("COURSE_GPUS", "1,2")  # one of the other check's GPUs: its process counts
    with load_guard.watch(device="gpu", interval=0.05) as w:
        time.sleep(0.2)
    assert w.load.pids == (7,) and not w.load.alone


def test_cpu_ranks_beside_a_gpu_are_watched_on_the_cpu(tmp_path, monkeypatch):
    # a GPU answers, but the chapter's ranks run on the CPU ($COURSE_DEVICE=cpu): the CPU's load counts
    _fake_smi(tmp_path, monkeypatch, "1, GPU-a\n", "0, GPU-a, 90\n")
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    with load_guard.watch(interval=0.05) as w:
        time.sleep(0.2)
    assert w.load.device == "cpu" and w.load.source != "nvidia-smi"
    monkeypatch.delenv("COURSE_DEVICE")
    with load_guard.watch(interval=0.05) as w:
        time.sleep(0.2)
    assert w.load.device == "gpu" and w.load.source == "nvidia-smi"


def test_a_sweep_that_drifted_is_withheld_as_warming():
    first, second = [0.200, 0.202, 0.201], [0.100, 0.101, 0.100]
    repeat = [0.150, 0.151, 0.150]  # the first configuration again at the end: 25% faster
    verdict = load_guard.compare({"first": first, "second": second}, ALONE, repeat=repeat)
    assert verdict.withheld.startswith("the machine changed during the sweep: first, repeated at the end, took 25% less than at the start")
    steady = load_guard.compare({"first": first, "second": second}, ALONE, repeat=[0.201, 0.200, 0.202])
    assert steady.given and steady.faster == "second" and steady.ratio == pytest.approx(2.0, rel=0.01)


def test_a_prediction_is_judged_against_the_measured_steps_spread():
    measured = [0.010, 0.011, 0.012]  # spread 18%
    close = load_guard.compare({"measured": measured, "predicted": [0.0115]}, ALONE)
    assert not close.given and "within the steps' spread (18%)" in close.withheld
    far = load_guard.compare({"measured": measured, "predicted": [0.020]}, ALONE)
    assert far.given and far.change[1] == pytest.approx(0.020 / 0.011 - 1)


def test_an_unrecorded_load_withholds_every_verdict():
    verdict = load_guard.compare({"a": [1.0], "b": [3.0]}, load_guard.Load.unknown())
    assert verdict.withheld == "nothing recorded what else used the devices during the run"
    with pytest.raises(ValueError):
        load_guard.compare({"a": [1.0]}, ALONE)


def test_the_load_describes_itself_in_one_line():
    assert ALONE.describe() == ("Load beside the run (6 samples over 3 s, test: an idle machine): other processes used 1% "
                                "of the 2 cores' time (0 of them above 0.2 s); alone: timing verdicts may be given.")
    assert load_guard.Load.unknown().describe() == "Load beside the run: not recorded."


def test_every_verdict_goes_to_the_log_a_check_counts(tmp_path, monkeypatch):
    log = tmp_path / "verdicts.jsonl"
    monkeypatch.setenv(load_guard.LOG_VARIABLE, str(log))
    load_guard.compare({"a": [1.0, 1.01, 1.0], "b": [2.0, 2.02, 2.01]}, ALONE)  # given
    load_guard.compare({"a": [1.0, 1.5, 1.2], "b": [1.1, 1.2, 1.15]}, ALONE)  # within the spread
    load_guard.compare({"a": [1.0], "b": [3.0]}, load_guard.Load.unknown())  # nothing recorded
    busy = load_guard.Load("gpu", 3, 0.9, 2, 5.0, 10, "test: a shared box")
    load_guard.compare({"a": [1.0], "b": [3.0]}, busy)  # not alone
    assert load_guard.read_log(log) == {"given": 1, "withheld": 3, "reasons": {
        "within the spread": 1, "not recorded": 1, "not alone": 1}}
    assert load_guard.read_log(tmp_path / "none.jsonl") == {"given": 0, "withheld": 0, "reasons": {}}


def test_watches_holding_the_lock_take_turns(tmp_path, monkeypatch):
    """A second process's watch waits while this one holds the timing lock, and starts once it is released;
    a watch inside a watch (same thread) does not wait for itself."""
    lock = tmp_path / "timing.lock"
    monkeypatch.setenv(load_guard.LOCK_VARIABLE, str(lock))
    other = ("import time; from helpers.core import load_guard\nprint('ready', flush=True)\n"
             "with load_guard.watch(device='cpu', interval=0.05): print(round(time.time(), 2), flush=True)")
    with load_guard.watch(device="cpu", interval=0.05):
        with load_guard.watch(device="cpu", interval=0.05):  # nested: must not deadlock
            pass
        waiting = subprocess.Popen([sys.executable, "-c", other], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, load_guard.LOCK_VARIABLE: str(lock)})
        assert waiting.stdout.readline().strip() == "ready"  # imported, about to ask for its turn
        time.sleep(1.0)
        assert waiting.poll() is None  # still waiting for its turn
        released = time.time()
    out, _ = waiting.communicate(timeout=30)
    assert float(out.strip()) >= released - 0.05


def test_two_measured_steps_are_too_few_for_a_verdict():
    two = load_guard.compare({"a": [0.100, 0.101], "b": [0.200, 0.202]}, ALONE)
    assert two.withheld == "too few measured steps to judge (a: 2, b: 2; a spread needs at least 3)"
    three = load_guard.compare({"a": [0.100, 0.101, 0.100], "b": [0.200, 0.202, 0.201]}, ALONE)
    assert three.given and three.faster == "a"
    predicted = load_guard.compare({"measured": [0.100, 0.101, 0.100], "predicted": [0.2]}, ALONE)
    assert predicted.given  # a single value is a prediction, not a list of steps


def test_a_sweep_without_its_repeat_is_withheld():
    lists = {"first": [0.200, 0.202, 0.201], "second": [0.100, 0.101, 0.100]}
    assert load_guard.compare(lists, ALONE, sweep=True).withheld == (
        "the sweep did not measure its first setting (first) again at its end")
    assert load_guard.compare(lists, ALONE, sweep=True, repeat=[0.201, 0.200, 0.202]).given
    slower = load_guard.compare(lists, ALONE, repeat=[0.300, 0.301, 0.300])
    assert "took 49% longer than at the start" in slower.withheld


@pytest.mark.parametrize("conditions, alone", [
    ("executed by check-gpu, alone", True),
    ("the only GPU of a 1-GPU machine, nothing else running on it", True),
    ("GPUs 0,1 of a 4 x NVIDIA H200 machine; check-gpu ran one notebook at a time here while notebooks 10-12 "
     "executed on GPUs 2,3", True),
    ("GPUs 2,3 of a 4-GPU machine; chapter 13's runs trained on the other two GPUs at the same time", True),
    ("GPUs 2,3 of a 4 x NVIDIA H200 machine; the capstone ladder trained on GPUs 0,1 at the same time", True),
    ("GPUs 2,3 of a 4 x NVIDIA H200 machine; check-gpu ran three notebooks at a time here while runs used GPUs 0,1",
     False),
    ("GPUs 2,3 of a 4 x NVIDIA H200 machine; another job trained on GPUs 1,2", False),  # shares GPU 2
    ("GPUs 0,1, shared with the compression chapter's bytes runs at the same time", False),
    ("executed by check-gpu beside 2 other notebook(s)", False),
    (None, False),
])
def test_written_conditions_count_only_the_references_own_gpus(conditions, alone):
    assert load_guard.Load.from_conditions(conditions).alone is alone
