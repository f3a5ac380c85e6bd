"""Kill a ZeRO-3 run mid-way (SIGKILL on every rank), resume it in fresh processes from its last
checkpoint, and get the uninterrupted run's losses bit for bit; then read the checkpoint back.

Two launches for the whole module (helpers.topics.checkpoints.crash_and_resume with one stage, and its bf16
ZeRO-3 runs that call save_16bit_model with and without the gather switch).
"""

from __future__ import annotations

import dataclasses

import pytest

from helpers.core import launch, plan, records, train
from helpers.topics import checkpoints
from helpers.core.environment import WORLD_SIZE_VARIABLE

STEPS, CRASH_AFTER = 4, 2


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    return checkpoints.crash_and_resume(stages=(3,), model="mlp", steps=STEPS, crash_after=CRASH_AFTER,
                                        folder=folder, world_size=2, progress=False, bf16_stages=(3,))


def test_the_killed_launch_really_died_and_left_only_its_checkpoints(crashed):
    assert isinstance(crashed.crashed, launch.RunFailed)
    assert "return code = -9" in crashed.crashed.log_tail  # SIGKILL, seen by DeepSpeed's launcher
    killed = crashed.folder / "zero3-crash"
    assert not (crashed.folder / "run-zero3-crash" / "summary.json").exists()  # no record: no teardown ran
    assert sorted(p.name for p in killed.glob("step*")) == [f"step{k}" for k in range(1, CRASH_AFTER + 1)]
    assert (killed / "latest").read_text().strip() == f"step{CRASH_AFTER}"


def test_the_resumed_run_continues_with_the_uninterrupted_losses_bit_for_bit(crashed):
    whole, resumed = crashed.uninterrupted[3], crashed.resumed[3]
    assert resumed["first_step"] == CRASH_AFTER
    assert len(resumed.losses) == STEPS - CRASH_AFTER
    assert resumed.losses == whole.losses[CRASH_AFTER:]  # fp32 on CPU: exactly
    records.validate(resumed.summary)
    assert "identical" in checkpoints.resume_table(crashed)


def test_each_rank_saved_exactly_the_optimizer_states_and_master_copy_it_held(crashed):
    held = crashed.uninterrupted[3]["memory.model_states_bytes_per_rank"]
    saved = checkpoints.saved_by_rank(crashed.checkpoint_dir(3) / f"step{CRASH_AFTER}", len(held))
    for rank, states in enumerate(held):
        assert saved[rank]["files"] == 2  # its model shard and its optimizer shard
        assert saved[rank]["optimizer"] == states["optimizer"] and saved[rank]["master"] == states["master"]
        assert saved[rank]["params"] == 0  # at stage 3 the weights live in the fp32 master shards


def test_zero_to_fp32_gives_a_plain_state_dict_that_reproduces_the_runs_next_loss(crashed):
    run = crashed.uninterrupted[3].summary
    state = checkpoints.consolidate(crashed.checkpoint_dir(3), f"step{CRASH_AFTER}")
    loss = checkpoints.loss_of_state_dict(state, "mlp", CRASH_AFTER, 2, run["micro_batch"], run["grad_accum"])
    assert records.loss_agreement([loss], [run["losses"][CRASH_AFTER]]) == "within 1e-06"


def test_before_training_hook_must_return_a_step_of_the_run(monkeypatch):
    monkeypatch.setattr(train, "resolve", lambda name: (lambda engine, run: 7))
    run = plan.PlannedRun(name="x", out="x", config="x", model="mlp", steps=4, seed=0, probes=[], before_training="x:y")
    with pytest.raises(ValueError, match="steps 0..3"):
        train.before_training(None, run)
    assert train.before_training(None, dataclasses.replace(run, before_training=None)) == 0  # no hook: a fresh run


def test_bad_hooks_and_options_are_refused_before_any_process_starts(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="before_training='helpers.topics.checkpoints:nope'"):
        launch.run("zero3", before_training="helpers.topics.checkpoints:nope", world_size=2)
    with pytest.raises(ValueError, match="package.module:name"):
        launch.run("zero3", before_training="resume", world_size=2)
    with pytest.raises(ValueError, match="options"):
        launch.run("zero3", options={"save_dir": object()}, world_size=2)
    with pytest.raises(ValueError, match=r"options\['save_dir'\]"):
        launch.run("zero3", probes=(checkpoints.Checkpoint,), world_size=2)
    with pytest.raises(ValueError, match=r"options\['load_dir'\]='nowhere'"):
        launch.run("zero3", before_training=checkpoints.RESUME, options={"load_dir": "nowhere"},
                   world_size=2)


def test_save_16bit_model_at_stage_3_writes_nothing_without_the_gather_switch(crashed):
    quiet = crashed.model16[False]
    assert quiet.section("model_16bit")["returned"] == [False, False]
    assert not crashed.model16_dir(False).exists()
    assert "nothing (no folder)" in checkpoints.model16_table(crashed)


def test_with_the_gather_switch_rank_0_writes_the_bf16_weights_alone(crashed):
    import torch

    from helpers.core import models

    assert crashed.model16[True].section("model_16bit")["returned"] == [True, True]
    files = sorted(p.name for p in crashed.model16_dir(True).iterdir())
    assert files == ["pytorch_model.bin"]
    state = torch.load(crashed.model16_dir(True) / "pytorch_model.bin", weights_only=True)
    net = models.build("mlp")
    assert list(state) == list(net.state_dict())  # every weight of the plain model, nothing else
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert sum(t.numel() for t in state.values()) == models.count_parameters(net)


def test_the_16bit_file_is_the_master_copy_rounded_and_reproduces_the_runs_next_loss(crashed):
    table = checkpoints.model16_check(crashed)
    assert "identical, 16 of 16 tensors" in table
    assert "within 1e-03" in table


def test_a_bf16_checkpoint_keeps_fp32_weights_only_in_the_master_copy(crashed):
    files = checkpoints.files_per_rank(crashed.bf16_checkpoint_dir(3) / f"step{CRASH_AFTER}")
    assert not any(f["weights_dtype"] for f in files)  # stage 3: names and shapes only
    table = checkpoints.precision_table(crashed)
    bf16_row = next(line for line in table.splitlines() if line.startswith("ZeRO-3") and " bf16 " in line)
    assert "none (names and shapes only)" in bf16_row and "on each rank" in bf16_row


def test_bad_16bit_options_are_refused_before_any_process_starts(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=r"options\['model16_dir'\]"):
        launch.run("zero3", probes=(checkpoints.Model16bit,), world_size=2)
    with pytest.raises(ValueError, match=r"options\['model16_after'\]=9"):
        launch.run("zero3", probes=(checkpoints.Model16bit,), steps=4, world_size=2,
                   options={"model16_dir": "x", "model16_after": 9})


# --- the chapter's exercises, against the module's runs ------------------------------------------

def test_exercise_bytes_per_rank_is_right_from_the_model_states_and_wrong_for_a_replica(crashed):
    params = crashed.uninterrupted[3].summary["model"]["params"]
    shard = params // 2
    # stage 3: no rank writes whole weights; each its shard of Adam's two moments and of the master copy
    assert checkpoints.exercise_zero2_bytes_per_rank({0: 12 * shard, 1: 12 * shard}, crashed, stage=3)
    assert not checkpoints.exercise_zero2_bytes_per_rank({0: 4 * params + 12 * shard, 1: 12 * shard}, crashed, stage=3)
    assert "one entry per rank" in str(checkpoints.exercise_zero2_bytes_per_rank([1, 2], crashed, stage=3))
    assert "to do:" in str(checkpoints.exercise_zero2_bytes_per_rank(..., crashed, stage=3))


def test_exercise_save_16bit_needs_the_method_and_the_gather_switch(crashed):
    switch = {"stage": 3, checkpoints.GATHER_KEY: True}
    right = checkpoints.exercise_save_16bit(switch, "engine.save_16bit_model(save_dir)", crashed)
    assert right and "pytorch_model.bin" in str(right)
    without = checkpoints.exercise_save_16bit({"stage": 3}, "engine.save_16bit_model(save_dir)", crashed)
    assert not without and "wrote nothing" in str(without)
    assert not checkpoints.exercise_save_16bit(switch, "engine.save_checkpoint(save_dir)", crashed)
    assert "no method" in str(checkpoints.exercise_save_16bit(switch, "engine.save_16bit(save_dir)", crashed))
    assert "to do:" in str(checkpoints.exercise_save_16bit(..., ..., crashed))


def test_exercise_universal_config_keeps_the_global_batch_and_loads_universal(crashed):
    base = crashed.uninterrupted[3].summary["config"]
    accum = base["gradient_accumulation_steps"] * 2  # two ranks become one
    assert checkpoints.exercise_universal_config(
        {"gradient_accumulation_steps": accum, "checkpoint": {"load_universal": True}}, crashed)
    assert not checkpoints.exercise_universal_config(
        {"gradient_accumulation_steps": accum // 2, "checkpoint": {"load_universal": True}}, crashed)
    assert "load_universal" in str(checkpoints.exercise_universal_config({"gradient_accumulation_steps": accum}, crashed))
    assert "to do:" in str(checkpoints.exercise_universal_config(..., crashed))
