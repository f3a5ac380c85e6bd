"""A killed, interrupted or hung launch ends every process it started and leaves nothing in /dev/shm.

Each test starts a real 2-rank CPU launch whose rank 0 hangs on purpose (``hang_on_rank``), so the
launch is alive and holds DeepSpeed's shared-memory segments when the fault is applied.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from helpers.core import launch
from helpers.core.environment import REPO_ROOT

HANGING_RUN = textwrap.dedent("""
    from helpers.core import launch
    launch.run("zero0", model="linear", steps=2, world_size=2, out={out!r}, progress=False, timeout=300,
               faults={{"hang_on_rank": 0}})
""")


def course_processes(out: Path) -> list[psutil.Process]:
    """Live processes (not zombies) whose command line names the launch's folder."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(str(out) in a for a in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def segments_of(out: Path) -> list[Path]:
    port = (out / "command.txt").read_text().split("--master_port=")[1].split()[0]
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def wait_until(condition, seconds: float) -> float:
    """Poll ``condition`` until it holds; return how long that took (fail after ``seconds``)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > seconds:
            pytest.fail(f"not within {seconds} s")
        time.sleep(0.2)
    return time.monotonic() - started


def wait_for_ranks(out: Path) -> None:
    """Until both ranks are up and hold their shared-memory segments (the hang comes after)."""
    wait_until(lambda: (out / "command.txt").exists() and len(segments_of(out)) == 2, 120)


#: One rank that hangs: killed from outside, it is the launch's only failure. (With two ranks the other one then
#: fails on its closed connection, and DeepSpeed's launcher reports whichever exit code it polls first.)
KILLED_RUN = textwrap.dedent("""
    from helpers.core import launch
    try:
        launch.run("zero0", model="linear", steps=2, world_size=1, out={out!r}, progress=False, timeout=300,
                   faults={{"hang_on_rank": 0}})
    except launch.RunFailed as failure:
        print("RunFailed:", failure)
""")


def test_a_rank_killed_by_sigkill_is_named_with_the_hosts_memory_and_leaves_nothing(tmp_path):
    out = tmp_path / "rank-killed"
    parent = subprocess.Popen([sys.executable, "-c", KILLED_RUN.format(out=str(out))], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rank = lambda: [p for p in course_processes(out) if "--local_rank=0" in p.cmdline()]
        wait_until(lambda: rank() != [], 120)
        rank()[0].kill()  # as the kernel's out-of-memory killer would: SIGKILL, no Python error
        said = parent.communicate(timeout=60)[0]
    finally:
        parent.kill()
    assert "RunFailed: [1 CPU rank] a rank was killed by SIGKILL, which comes from outside the process" in said, said
    assert "the host's available memory at the lowest sample:" in said
    assert wait_until(lambda: course_processes(out) == [], 10) < 10
    assert segments_of(out) == []


def test_a_sigkill_with_the_host_out_of_memory_says_so():
    memory = launch._HostMemory()
    lines = ["[2026-11-29 01:46:40,399] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', '-m', "
             "'helpers.core.train', '--local_rank=0'] exits with return code = -9\n"]
    memory.lowest = 0.5 * 2 ** 30
    assert launch.how_it_ended(247, lines, memory).startswith(
        "a rank was killed by SIGKILL: the host ran out of memory (available at the lowest sample: 0.5 GiB of")
    memory.lowest = memory.total / 2
    assert "comes from outside the process" in launch.how_it_ended(247, lines, memory)
    assert launch.how_it_ended(1, ["exits with return code = 1"], memory) == "exited with code 1"


def test_killing_the_starting_process_ends_the_launch_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "killed"
    parent = subprocess.Popen([sys.executable, "-c", HANGING_RUN.format(out=str(out))], cwd=REPO_ROOT)
    try:
        wait_for_ranks(out)
        stale = segments_of(out)
        assert not set(stale) & set(launch.remove_stale_shared_memory()), "a live launch's segments must stay"
        assert all(s.exists() for s in stale)
        parent.kill()  # kill -9: no cleanup code runs in it
        parent.wait(10)
        seconds = wait_until(lambda: course_processes(out) == [], 10)  # launcher and ranks die with it
        assert seconds < 10
    finally:
        parent.kill()
    assert all(s.exists() for s in stale)  # nothing removed them yet: the next launch does
    removed = launch.remove_stale_shared_memory()
    assert set(stale) <= set(removed)
    assert segments_of(out) == []


def test_interrupting_a_cell_ends_the_run_within_10_s_and_the_next_cell_works(tmp_path):
    from jupyter_client.manager import start_new_kernel

    out = tmp_path / "interrupted"
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(REPO_ROOT))
    try:
        hanging = client.execute(HANGING_RUN.format(out=str(out)))
        wait_for_ranks(out)
        started = time.monotonic()
        manager.interrupt_kernel()  # Jupyter's stop button
        wait_until(lambda: course_processes(out) == [] and segments_of(out) == [], 10)
        assert time.monotonic() - started < 10
        reply = client.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == hanging
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        reply = client.execute_interactive(
            'print(launch.run("zero0", model="linear", steps=1, world_size=2, progress=False).summary["steps"])',
            timeout=120)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_a_hung_launch_is_ended_at_its_timeout_with_nothing_left(tmp_path):
    out = tmp_path / "hung"
    started = time.perf_counter()
    with pytest.raises(launch.RunFailed, match="timed out") as caught:
        launch.run("zero0", model="linear", steps=2, world_size=2, out=out, progress=False, timeout=15,
                   faults={"hang_on_rank": 1})
    assert 14 < time.perf_counter() - started < 40
    assert caught.value.out == out
    assert course_processes(out) == []
    assert segments_of(out) == []
    # the error says where the hung rank waited: its stack, printed by faulthandler on the launcher's signal
    assert "Where the ranks waited" in str(caught.value)
    assert "faults.py" in caught.value.traceback and "before_step" in caught.value.traceback


def test_a_recording_sweep_keeps_the_runs_that_finished_before_one_hung(tmp_path):
    # what _follow returns at a timeout when every run records its failure; a real hung launch (its stacks,
    # nothing left running) is the test above
    import json

    from test_records import minimal_summary

    prepared = [launch._Prepared(name, launch.RunSpec("zero0", steps=2, on_error="record"), tmp_path / name, {})
                for name in ("first", "hangs", "after")]
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "summary.json").write_text(json.dumps(minimal_summary()))
    stacks = 'Stack (most recent call first):\n  File "/x/helpers/core/train.py", line 119 in data_parallel_step'
    found = launch._after_timeout(prepared, {0: [1.0, 3.5], 1: [3.5]}, {0: 2, 1: 1}, 20, "tail", stacks)
    assert found["first"].losses == [1.0, 0.75] and found["first"].wall_s == 2.5
    assert isinstance(found["hangs"], launch.RunFailed) and found["hangs"].error_type == "Timeout"
    assert found["hangs"].message == "not done within the launch's 20 s (1 of 2 steps)"
    assert "a rank was in data_parallel_step (helpers/core/train.py:119)" in str(found["hangs"])
    assert found["hangs"].traceback == stacks
    assert isinstance(found["after"], launch.RunFailed) and found["after"].error_type == "NotRun"
