"""Chapter 02b: a learner's own script, started with a stock command (helpers.core.launch.run_script) and
measured by helpers.measure; its record set beside the course's run of the same config (helpers.topics.own_script).
The measured runs themselves (the deepspeed command, Hugging Face's Trainer, accelerate launch, each equal to
the course's run) are the chapter's notebook, which the README's test command executes."""

from __future__ import annotations

import copy
import os
import time

import psutil
import pytest

from helpers import measure
from helpers.core import launch, records
from helpers.topics import own_script
from test_records import minimal_summary

AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999]}}, "zero_optimization": {"stage": 2}}
RESOLVED = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999]}}, "zero_optimization": {"stage": 2},
            "comms_logger": {"enabled": True}, "steps_per_print": float("inf"), "fp16": {"enabled": False}}


def _record(**changes) -> records.Record:
    summary = minimal_summary()
    summary.update(copy.deepcopy(changes))
    return records.Record(summary)


# --- run_script: bad input stops before any process, a failing script shows its error ---------------

@pytest.mark.parametrize("kwargs, match", [({}, "does not exist: write it first"),
                                           ({"launcher": "torchrun"}, "choose one of deepspeed, accelerate"),
                                           ({"launcher": "accelerate"}, "needs deepspeed_config")])
def test_bad_input_is_named_before_any_process_starts(tmp_path, monkeypatch, kwargs, match):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    script = tmp_path / "train.py"
    if "launcher" in kwargs:
        script.write_text("print('hi')\n")
    with pytest.raises(ValueError, match=match):
        launch.run_script(tmp_path / "train.py", world_size=2, **kwargs)


def test_a_missing_deepspeed_config_file_is_named(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ValueError, match="ds.json' does not exist"):
        launch.run_script(script, launcher="accelerate", deepspeed_config=tmp_path / "ds.json", world_size=2)


def test_the_stock_commands_are_what_a_learner_would_type(tmp_path):
    plain = launch.script_command("train.py", ["--out", "x"], world_size=2, port=29500)
    assert [os.path.basename(plain[0]), *plain[1:]] == ["deepspeed", "--num_gpus", "2", "--master_port", "29500",
                                                         "train.py", "--out", "x"]
    accelerate = launch.script_command("train.py", world_size=2, port=29500, launcher="accelerate",
                                       deepspeed_config="ds.json")
    assert [os.path.basename(accelerate[0]), *accelerate[1:]] == [
        "accelerate", "launch", "--num_processes", "2", "--num_machines", "1", "--use_deepspeed",
        "--deepspeed_config_file", "ds.json", "--main_process_port", "29500", "train.py"]


def _survivors(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in (process.info["cmdline"] or [])):
            found.append(process)
    return found


def test_a_failing_script_raises_with_its_error_and_leaves_no_process(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nif os.environ.get('RANK') == '1':\n    raise SystemExit('rank 1 gives up: bad batch')\n"
                      "import time\ntime.sleep(60)\n")
    started = time.monotonic()
    with pytest.raises(launch.RunFailed, match="rank 1 gives up: bad batch") as caught:
        launch.run_script(script, world_size=2, show=False, timeout=120)
    assert "exit code" in str(caught.value) and time.monotonic() - started < 60
    assert _survivors(str(script)) == []


def test_a_launch_ends_once_deepspeeds_launcher_logged_every_ranks_clean_exit():
    exits = launch._CleanExits(2)
    log = ["[2026-11-29 00:00:00,001] [INFO] [launch.py:245:main] process 11 spawned with command: [...]\n",
           "[2026-11-29 00:00:01,002] [INFO] [launch.py:285:main] Process 11 exits successfully.\n",
           "a rank's own line that says Process 12 exits successfully.\n",  # not the launcher's log line
           "[2026-11-29 00:00:01,003] [ERROR] [launch.py:291:sigkill_handler] [...] exits with return code = 1\n"]
    assert [exits.see(line) for line in log] == [False, False, False, False] and exits.seen == 1
    assert exits.see("[2026-11-29 00:00:02,004] [INFO] [launch.py:285:main] Process 12 exits successfully.\n")


def test_a_script_that_ends_well_returns_every_ranks_output_and_leaves_no_process(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text("import os\nprint(f\"rank {os.environ['RANK']} done\", flush=True)\n")
    output = launch.run_script(script, world_size=2, show=False, timeout=120)
    assert "rank 0 done" in output and "rank 1 done" in output and output.count("exits successfully") == 2
    assert _survivors(str(script)) == []


def test_the_processor_time_of_a_script_that_ended_well_stays_counted(tmp_path):
    # the launch is ended after every rank's clean exit: its launcher first, so that the deepspeed command waits
    # for it and the ranks' processor time reaches this process as it does when the launch ends by itself
    import resource

    script = tmp_path / "busy.py"
    script.write_text("import time\nstart = time.process_time()\nwhile time.process_time() - start < 1.0:\n    pass\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launch.run_script(script, world_size=2, show=False, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) >= 2.0  # both ranks' second


def test_a_rank_failing_after_the_other_ended_well_still_fails_the_script(tmp_path):
    script = tmp_path / "late.py"
    script.write_text("import os, time\nif os.environ.get('RANK') == '1':\n    time.sleep(3)\n"
                      "    raise SystemExit('rank 1 fails late')\n")
    with pytest.raises(launch.RunFailed, match="rank 1 fails late"):
        launch.run_script(script, world_size=2, show=False, timeout=120)
    assert _survivors(str(script)) == []


def test_a_hanging_script_is_stopped_at_its_timeout_and_leaves_no_process(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(launch.RunFailed, match="ran past its timeout of 15 s"):
        launch.run_script(script, world_size=2, show=False, timeout=15)
    assert _survivors(str(script)) == []


# --- measure ----------------------------------------------------------------------------------------

def test_configure_adds_the_comms_logger_and_keeps_the_scripts_own_settings():
    config = {"train_micro_batch_size_per_gpu": 4, "comms_logger": {"verbose": True}}
    merged = measure.configure(config)
    assert merged["comms_logger"]["enabled"] is True and merged["comms_logger"]["verbose"] is True
    assert merged["train_micro_batch_size_per_gpu"] == 4 and "comms_logger" not in measure.configure({}, probes=("timing",))
    assert config == {"train_micro_batch_size_per_gpu": 4, "comms_logger": {"verbose": True}}  # not changed


# --- own_script -------------------------------------------------------------------------------------

def test_auto_paths_and_the_values_deepspeed_received():
    assert own_script.auto_paths(AUTO) == ["train_micro_batch_size_per_gpu", "gradient_clipping", "optimizer.params.lr"]
    table = own_script.auto_table(AUTO, RESOLVED).splitlines()
    assert table[2].split() == ["train_micro_batch_size_per_gpu", "auto", "4"]
    assert table[4].split() == ["optimizer.params.lr", "auto", "0.001"]
    with pytest.raises(KeyError, match="optimizer.params.eps"):
        own_script.value_at(RESOLVED, "optimizer.params.eps")


def test_a_records_config_runs_again_without_what_the_course_adds_or_switched_off_blocks():
    assert own_script.runnable_config(_record(config=RESOLVED)) == {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999]}}}


def test_agreement_needs_equal_losses_states_and_collectives():
    mine, same = _record(), _record()
    slower = _record(losses=[1.0, 0.7])
    other_comm = _record(comm={"by_op": {"all_reduce": {"count": 2.0, "bytes": 4000.0}}, "bytes_per_step": 4000.0,
                               "wire_bytes_per_step": 4000.0})
    rows = own_script.agreement_rows({"a": mine, "b": mine, "c": mine}, {"a": same, "b": slower, "c": other_comm})
    assert [r["same"] for r in rows] == [True, False, False]
    assert rows[1]["losses"].startswith("differ")
    assert "DIFFER" in own_script.agreement_table({"c": mine}, {"c": other_comm})


def _four_ranks() -> records.Record:
    summary = minimal_summary()
    states = summary["memory"]["model_states_bytes_per_rank"]
    summary.update(world_size=4, train_batch=16, memory={**summary["memory"], "model_states_bytes_per_rank": states * 2,
                                                          "peak_bytes_per_rank": [10, 11, 12, 13]})
    return records.Record(summary)


def test_course_runs_refuse_records_of_different_world_sizes(monkeypatch):
    monkeypatch.setattr(launch, "sweep", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="different numbers of ranks"):
        own_script.course_runs({"a": _record(), "b": _four_ranks()})


def test_the_bytes_exercise_is_checked_against_the_record():
    record = _record()
    assert not own_script.exercise_bytes_per_step(..., record).answered
    assert own_script.exercise_bytes_per_step(6000, record)
    assert own_script.exercise_bytes_per_step(6050, record)  # within 1%
    wrong = own_script.exercise_bytes_per_step(8000, record)
    assert not wrong and "Hint" in str(wrong)


def test_the_auto_exercise_wants_every_auto_value_as_deepspeed_received_it():
    record = _record(config=RESOLVED)
    right = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "optimizer.params.lr": 0.001}
    assert own_script.exercise_resolved_config(right, record, AUTO)
    missing = own_script.exercise_resolved_config({"train_micro_batch_size_per_gpu": 4}, record, AUTO)
    assert not missing and "2 of 3 wrong or missing: gradient_clipping, optimizer.params.lr" in str(missing)
    extra = own_script.exercise_resolved_config({**right, "zero_optimization.stage": 2}, record, AUTO)
    assert not extra and "are not 'auto'" in str(extra)
    assert "TypeError" in str(own_script.exercise_resolved_config([4, 1.0], record, AUTO))


def test_a_meter_in_a_course_launch_advances_its_progress_bar(monkeypatch, capsys):
    events = []
    monkeypatch.setattr(measure, "emit", lambda event, **fields: events.append((event, fields)))

    class Engine:
        def is_gradient_accumulation_boundary(self):
            return True

    class Recorder:
        def after_step(self, step, losses):
            return sum(losses) / len(losses)

        def before_step(self, step):
            pass

    for progress in (3, None):
        meter = object.__new__(measure.Meter)
        meter.engine, meter.steps, meter.progress, meter.recorder = Engine(), 2, progress, Recorder()
        meter.ctx = type("Ctx", (), {"rank": 0})()
        meter.step, meter.micro_step, meter.micro_losses = 0, 0, [0.5]
        meter._step = lambda: None
        meter._measured_step()
    assert events == [("step", {"run": 3, "rank": 0, "step": 1, "steps": 2, "loss": 0.5})]
    assert capsys.readouterr().out == "[measure] step 1/2: loss 0.5000 (rank 0)\n"  # outside a launch: a line
