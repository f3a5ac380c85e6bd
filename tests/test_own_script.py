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
    assert table[2].split() == ["train_micro_batch_size_per_gpu", "per_device_train_batch_size", "4"]
    assert table[4].split() == ["optimizer.params.lr", "learning_rate", "0.001"]
    with pytest.raises(KeyError, match="optimizer.params.eps"):
        own_script.value_at(RESOLVED, "optimizer.params.eps")


def test_transformers_names_the_field_that_fills_each_auto():
    written = {**AUTO, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-8}},
               "train_batch_size": "auto", "steps_per_print": "auto"}
    assert own_script.trainer_fields(written) == {
        "train_micro_batch_size_per_gpu": "per_device_train_batch_size", "gradient_clipping": "max_grad_norm",
        "optimizer.params.lr": "learning_rate", "optimizer.params.betas": "adam_beta1+adam_beta2",
        "train_batch_size": "train_batch_size (calculated)", "steps_per_print": "-"}  # not the Trainer's to fill
    assert written["optimizer"]["params"]["lr"] == "auto"  # not changed


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


def _zero2(grad_accum: int) -> records.Record:
    """A ZeRO-2 record of ``grad_accum`` micro-steps: a 4,000-byte gradient all-reduce per micro-step, the
    4-byte norm and a 2,000-byte all-gather per optimizer step."""
    callers = {"all_reduce": {"allreduce_bucket": {"count": float(grad_accum), "bytes": 4000.0 * grad_accum},
                              "get_grad_norm_direct": {"count": 1.0, "bytes": 4.0}},
               "all_gather_into_tensor": {"all_gather_into_tensor_dp_groups": {"count": 1.0, "bytes": 2000.0}}}
    total = 4000.0 * grad_accum + 2004.0
    return _record(grad_accum=grad_accum, train_batch=8 * grad_accum,
                   comm={"by_op": {}, "by_caller": callers, "bytes_per_step": total,
                         "wire_bytes_per_step": total, "measured_steps": 1})


def test_collectives_by_function_and_the_model_states_they_add_up_to():
    table = own_script.collectives_table(_zero2(2)).splitlines()
    assert table[2].split() == ["all_gather_into_tensor", "all_gather_into_tensor_dp_groups", "1", "2,000"]
    assert table[3].split() == ["all_reduce", "allreduce_bucket", "2", "8,000"] and table[-1].split() == ["total", "10,004"]
    line = own_script.model_states_line(_record())
    assert line.startswith("model states per rank (rank 0): ") and " = fp32 parameters " in line
    assert " = bf16 parameters " in own_script.model_states_line(_record(precision="bf16"))
    assert own_script.gradient_callers(_zero2(2)) == ["allreduce_bucket"]


def test_only_the_gradient_reduction_scales_with_the_micro_steps():
    assert own_script.bytes_at_accumulation(_zero2(2), 4) == _zero2(4).comm.bytes_per_step == 18004
    assert own_script.bytes_at_accumulation(_zero2(4), 1) == _zero2(1).comm.bytes_per_step
    with pytest.raises(records.NotMeasured, match="by DeepSpeed function"):
        own_script.bytes_at_accumulation(_record(), 4)
    with pytest.raises(ValueError, match="ZeRO-3: this rule is ZeRO-2's"):
        own_script.bytes_at_accumulation(_record(zero_stage=3), 4)


def test_the_accumulation_exercise_is_checked_against_the_scaled_record_or_a_run_at_that_accumulation():
    record = _zero2(2)
    assert not own_script.exercise_bytes_at_accumulation(..., record).answered
    assert own_script.exercise_bytes_at_accumulation(18004, record)
    assert own_script.exercise_bytes_at_accumulation(18100, record)  # within 1%
    naive = own_script.exercise_bytes_at_accumulation(2 * 10004, record)  # every call doubled
    assert not naive and "Hint" in str(naive)
    assert "Measured: your run" in str(own_script.exercise_bytes_at_accumulation(18004, _zero2(4)))


def test_the_auto_exercise_wants_the_field_that_fills_each_auto():
    right = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size", "gradient_clipping": "max_grad_norm",
             "optimizer.params.lr": "learning_rate"}
    assert own_script.exercise_trainer_fields(right, AUTO)
    same_names = own_script.exercise_trainer_fields({**right, "gradient_clipping": "gradient_clipping"}, AUTO)
    assert not same_names and "1 of 3 wrong or missing: gradient_clipping" in str(same_names)
    extra = own_script.exercise_trainer_fields({**right, "zero_optimization.stage": "stage"}, AUTO)
    assert not extra and "are not 'auto'" in str(extra)
    assert "TypeError" in str(own_script.exercise_trainer_fields(["learning_rate"], AUTO))


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
