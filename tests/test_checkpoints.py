"""Chapter 14's helpers: what they read from the chapter script's records, printed lines and checkpoint files,
and the checks of its exercises. The files here are written the way DeepSpeed 0.19.8 lays them out (its
key names), small; the chapter's own launches run under nbval."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers.core import launch, plan, records, train
from helpers.core.environment import WORLD_SIZE_VARIABLE
from helpers.topics import checkpoints

REFUSAL = ("The checkpoint being loaded used a DP world size of 2 but the current world size is 1. Automatic "
           "adjustment of ZeRO's optimizer state partitioning with a new world size is not currently supported.")


def summary(name: str, losses: list[float], world_size: int = 2, stage: int = 2, precision: str = "fp32",
            params: int = 100, optimizer: str = "DeepSpeedZeroOptimizer") -> dict:
    """A valid record of the chapter's script: ``losses`` of the steps it trained."""
    return {"name": name, "world_size": world_size, "backend": "gloo", "device": "cpu", "zero_stage": stage,
            "precision": precision, "micro_batch": 4, "grad_accum": 8 // world_size, "train_batch": 32,
            "steps": len(losses), "model": {"name": "mlp", "params": params}, "losses": losses,
            "optimizer": optimizer,
            "theory": {"model_states_bytes_per_rank": {}, "comm_bytes_per_step": 0, "comm_wire_bytes_per_step": 0}}


def write_record(folder: Path, name: str, losses: list[float], **kwargs) -> records.Record:
    (folder / name).mkdir(parents=True, exist_ok=True)
    (folder / name / "summary.json").write_text(json.dumps(summary(name, losses, **kwargs)))
    return records.load(folder / name)


def write_zero2_checkpoint(folder: Path, params: int = 100) -> None:
    """A ZeRO-2 fp32 checkpoint of 2 ranks: rank 0 the weights, each rank half of Adam's moments and of the
    master copy, under DeepSpeed's file and key names."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.zeros(params)}, "dp_world_size": 2}, folder / "mp_rank_00_model_states.pt")
    for rank in range(2):
        half = params // 2
        state = {"optimizer_state_dict": {
            "base_optimizer_state": {"state": {0: {"exp_avg": torch.zeros(half), "exp_avg_sq": torch.zeros(half)}}},
            "single_partition_of_fp32_groups": [torch.zeros(half)]}}
        torch.save(state, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def test_printed_reads_the_named_runs_lines_only():
    output = ("[zero3-bf16-gather-false] rank 1: save_16bit_model returned False[zero3-bf16-gather-false] rank 0: "
              "save_16bit_model returned False\n\n"  # two ranks printing at once: one line inside the other
              "noise [zero3-bf16-gather-true] rank 1: save_16bit_model returned True\n"
              "[zero3-bf16-gather-true] rank 0: save_16bit_model returned True\n")
    assert checkpoints.printed(output, "zero3-bf16-gather-true") == ["rank 1: save_16bit_model returned True",
                                                                     "rank 0: save_16bit_model returned True"]
    assert checkpoints._returned(output, "zero3-bf16-gather-true") == [True, True]  # by rank, whatever the order
    assert checkpoints._returned(output, "zero3-bf16-gather-false") == [False, False]
    assert checkpoints._returned(output, "zero2-bf16") == []


def test_load_one_rank_takes_refusals_from_the_output_and_records_from_disk(tmp_path):
    write_record(tmp_path, "zero0-on-1-rank", [1.0, 0.9, 0.8], world_size=1, stage=0)
    write_record(tmp_path, "zero3-universal", [1.0, 0.9, 0.8], world_size=1, stage=3)
    output = "\n".join(f"[zero{s}-on-1-rank] load_checkpoint refused: {REFUSAL}" for s in (1, 2, 3))
    as_saved, universal = checkpoints.load_one_rank(tmp_path, output)
    assert isinstance(as_saved[0], records.Record) and as_saved[0].losses == [1.0, 0.9, 0.8]
    assert [as_saved[s] for s in (1, 2, 3)] == [REFUSAL] * 3
    assert list(universal) == [3]  # no ZeRO-2 universal record: left out, not invented
    with pytest.raises(FileNotFoundError, match="zero1-on-1-rank"):  # neither a refusal nor a record
        checkpoints.load_one_rank(tmp_path, output.split("\n", 1)[1])


def test_each_rank_is_credited_with_the_weights_moments_and_master_copy_it_wrote(tmp_path):
    write_zero2_checkpoint(tmp_path / "step3")
    saved = checkpoints.saved_by_rank(tmp_path / "step3", 2)
    assert {k: saved[0][k] for k in ("files", "params", "optimizer", "master")} == \
        {"files": 2, "params": 400, "optimizer": 400, "master": 200}
    assert {k: saved[1][k] for k in ("files", "params", "optimizer", "master")} == \
        {"files": 1, "params": 0, "optimizer": 400, "master": 200}
    assert saved[0]["bytes"] > saved[1]["bytes"] > 600  # files on disk: the tensors and pickle's own bytes


def chapter_runs(folder: Path, resumed_losses: list[float]) -> checkpoints.ChapterRuns:
    whole = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    uninterrupted = {s: write_record(folder, f"zero{s}", whole, stage=s) for s in checkpoints.STAGES}
    resumed = {s: write_record(folder, f"zero{s}-resumed", resumed_losses, stage=s) for s in checkpoints.STAGES}
    return checkpoints.ChapterRuns(folder, uninterrupted, resumed, bf16={}, model16={},
                                   model16_returned={False: [False, False], True: [True, True]})


def test_the_resume_table_says_identical_only_for_the_same_losses(tmp_path):
    runs = chapter_runs(tmp_path / "same", [0.7, 0.6, 0.5])
    assert runs.steps == 6 and runs.crash_after == 3
    assert runs.checkpoint_dir(3).name == "zero3-killed" and runs.checkpoint_dir(2).name == "zero2"
    assert checkpoints.resume_table(runs).count("identical") == 4
    close = chapter_runs(tmp_path / "close", [0.7, 0.6, 0.5 + 1e-7])
    assert "identical" not in checkpoints.resume_table(close) and "within 1e-06" in checkpoints.resume_table(close)


def test_on_disk_table_tells_the_killed_run_by_its_missing_record(tmp_path):
    for name, last in (("zero0", 6), ("zero1", 6), ("zero2", 6), ("zero3", 6), ("zero3-killed", 3)):
        for step in range(1, last + 1):
            (tmp_path / "checkpoints" / name / f"step{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "latest").write_text(f"step{last}")
        if name != "zero3-killed":
            write_record(tmp_path, name, [1.0] * 6)
    (tmp_path / "checkpoints" / "zero3-killed" / "step3_universal").mkdir()  # a conversion, not a step
    row = next(line for line in checkpoints.on_disk_table(tmp_path).splitlines() if line.startswith("zero3-killed"))
    assert row.split() == ["zero3-killed", "step1", "step2", "step3", "step3", "no", "(killed)"]


def test_crash_report_keeps_the_launchers_lines_without_process_ids_or_timestamps():
    tail = ("[2026-11-28 16:30:01,123] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 4242\n"
            "[measure] step 3/6: loss 1.0672 (rank 0)\n"
            "[2026-11-28 16:30:01,125] [ERROR] [launch.py:259:sigkill_handler] ['/venv/bin/python', '-u', "
            "'runs/14/train_checkpoint.py', '--local_rank=1', '--phase', 'crash'] exits with return code = -9\n")
    report = checkpoints.crash_report(launch.RunFailed("failed", log_tail=tail))
    assert report.splitlines() == ["[INFO] [launch.py:253:sigkill_handler] Killing subprocess PID",
                                   "[ERROR] [launch.py:259:sigkill_handler] [... train_checkpoint.py ...] "
                                   "exits with return code = -9"]


def test_exercise_bytes_per_rank_is_right_from_what_each_rank_wrote_and_wrong_for_a_replica(tmp_path):
    runs = chapter_runs(tmp_path, [0.7, 0.6, 0.5])
    write_zero2_checkpoint(runs.checkpoint_dir(2) / "step3")
    disk = checkpoints.saved_by_rank(runs.checkpoint_dir(2) / "step3", 2)
    assert checkpoints.exercise_zero2_bytes_per_rank({r: disk[r]["bytes"] for r in (0, 1)}, runs)
    assert not checkpoints.exercise_zero2_bytes_per_rank({0: disk[0]["bytes"], 1: disk[0]["bytes"]}, runs)
    assert "one entry per rank" in str(checkpoints.exercise_zero2_bytes_per_rank([1, 2], runs))
    assert "to do:" in str(checkpoints.exercise_zero2_bytes_per_rank(..., runs))


def test_exercise_save_16bit_wants_no_file_without_the_switch_and_the_file_with_it(tmp_path):
    runs = chapter_runs(tmp_path, [0.7, 0.6, 0.5])
    runs.model16 = {g: write_record(tmp_path, f"zero3-bf16-gather-{str(g).lower()}", [1.0] * 6, stage=3,
                                    precision="bf16", params=1000) for g in (False, True)}
    runs.model16_dir(True).mkdir(parents=True)
    torch.save({"w": torch.zeros(1000, dtype=torch.bfloat16)}, runs.model16_dir(True) / "pytorch_model.bin")
    size = (runs.model16_dir(True) / "pytorch_model.bin").stat().st_size
    right = checkpoints.exercise_save_16bit({False: 0, True: size}, runs)
    assert right and "returned False / False" in str(right)
    assert not checkpoints.exercise_save_16bit({False: size // 2, True: size}, runs)  # rank 0's shard: not written
    assert not checkpoints.exercise_save_16bit({False: 0, True: 2 * size}, runs)  # fp32: twice the bytes
    assert "both runs" in str(checkpoints.exercise_save_16bit({True: size}, runs))
    assert "to do:" in str(checkpoints.exercise_save_16bit(..., runs))


def test_exercise_other_ranks_follows_what_deepspeed_did(tmp_path):
    runs = chapter_runs(tmp_path, [0.7, 0.6, 0.5])
    loaded = write_record(tmp_path, "zero0-on-1-rank", [0.7, 0.6, 0.5], world_size=1, stage=0)
    as_saved = {0: loaded, 1: REFUSAL, 2: REFUSAL, 3: REFUSAL}
    assert checkpoints.exercise_other_ranks({0: "loads", 1: "refused", 2: "refused", 3: "refused"}, runs, as_saved)
    wrong = checkpoints.exercise_other_ranks({0: "loads", 1: "loads", 2: "refused", 3: "refused"}, runs, as_saved)
    assert not wrong and "ZeRO-1" in str(wrong)
    assert "one of" in str(checkpoints.exercise_other_ranks({0: "yes", 1: "no", 2: "no", 3: "no"}, runs, as_saved))
    assert "to do:" in str(checkpoints.exercise_other_ranks(..., runs, as_saved))
    assert "its 2-rank run saved" in str(checkpoints.exercise_other_ranks(..., runs, as_saved))


def test_one_rank_table_gives_deepspeeds_reason_and_the_loss_agreement(tmp_path):
    runs = chapter_runs(tmp_path, [0.7, 0.6, 0.5])
    one = write_record(tmp_path, "zero0-on-1-rank", [0.7, 0.6, 0.5 + 1e-7], world_size=1, stage=0)
    universal = {3: write_record(tmp_path, "zero3-universal", [0.7, 0.6, 0.5], world_size=1, stage=3)}
    table = checkpoints.one_rank_table(runs, {0: one, 1: REFUSAL, 2: REFUSAL, 3: REFUSAL}, universal)
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert "loads; losses within 1e-06" in rows["ZeRO-0"] and "4 x 8 x 1" in rows["ZeRO-0"]
    assert "refused: The checkpoint being loaded used a DP world size of 2" in rows["ZeRO-1"]
    assert "Automatic" not in table  # the first sentence only
    assert rows["ZeRO-3"].rstrip().endswith("4 x 8 x 1") and rows["ZeRO-3"].count("loads") == 1


def test_before_training_hook_must_return_a_step_of_the_run(monkeypatch):
    monkeypatch.setattr(train, "resolve", lambda name: (lambda engine, run: 7))
    run = plan.PlannedRun(name="x", out="x", config="x", model="mlp", steps=4, seed=0, probes=[], before_training="x:y")
    with pytest.raises(ValueError, match="steps 0..3"):
        train.before_training(None, run)
    assert train.before_training(None, dataclasses.replace(run, before_training=None)) == 0  # no hook: a fresh run


def test_bad_hooks_are_refused_before_any_process_starts(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="before_training='helpers.topics.checkpoints:nope'"):
        launch.run("zero3", before_training="helpers.topics.checkpoints:nope", world_size=2)
    with pytest.raises(ValueError, match="package.module:name"):
        launch.run("zero3", before_training="resume", world_size=2)
    with pytest.raises(ValueError, match="options"):
        launch.run("zero3", options={"save_dir": object()}, world_size=2)


def test_load_runs_reads_the_scripts_records_by_name_and_needs_every_ranks_16bit_answer(tmp_path):
    names = [f"zero{s}" for s in checkpoints.STAGES] + [f"zero{s}-bf16" for s in checkpoints.BF16_STAGES]
    names += ["zero3-bf16-gather-false", "zero3-bf16-gather-true"]
    for name in names:
        write_record(tmp_path, name, [1.0] * 6)
    with pytest.raises(FileNotFoundError, match="zero0-resumed"):
        checkpoints.load_runs(tmp_path, "")
    for stage in checkpoints.STAGES:
        write_record(tmp_path, f"zero{stage}-resumed", [1.0] * 2)
    one_rank = "[zero3-bf16-gather-true] rank 0: save_16bit_model returned True\n"
    with pytest.raises(ValueError, match="on 1 of 2 ranks for run zero3-bf16-gather-true"):
        checkpoints.load_runs(tmp_path, one_rank + "[zero3-bf16-gather-false] rank 0: save_16bit_model returned False\n"
                              "[zero3-bf16-gather-false] rank 1: save_16bit_model returned False\n")
    output = "".join(f"[zero3-bf16-gather-{g}] rank {r}: save_16bit_model returned {g.title()}\n"
                     for g in ("false", "true") for r in (1, 0))
    runs = checkpoints.load_runs(tmp_path, output)
    assert runs.model16_returned == {False: [False, False], True: [True, True]}
    assert sorted(runs.bf16) == [0, 2, 3] and runs.bf16[3].name == "zero3-bf16-gather-true"
    assert runs.crash_after == 4  # 6 steps, of which the resumed runs trained 2


def test_loss_of_model_is_the_loss_of_every_sample_the_step_trained_on():
    from helpers.core import models

    record = records.Record(summary("zero2", [1.0] * 6))  # 2 ranks, micro-batch 4, accumulation 4
    net = models.build("mlp")
    step = 3
    indices = [i for micro in range(record.grad_accum) for rank in range(2)
               for i in models.sample_indices(step, micro, rank, 2, record.micro_batch, record.grad_accum)]
    assert len(set(indices)) == record.train_batch  # 32 different samples
    with torch.no_grad():  # equal micro-batches: the mean of their mean losses is the loss of all of them at once
        whole = models.loss_of(net, "mlp", models.make_batch("mlp", indices)).item()
    assert checkpoints.loss_of_model(net, record, step) == pytest.approx(whole, rel=1e-6)
    assert checkpoints.loss_of_model(net, record, step + 1) != pytest.approx(whole, rel=1e-6)  # other samples


def test_precision_ratios_compare_each_stages_bf16_checkpoint_with_its_fp32_one(tmp_path):
    runs = chapter_runs(tmp_path, [0.7, 0.6, 0.5])
    runs.bf16 = {2: runs.uninterrupted[2]}
    write_zero2_checkpoint(runs.checkpoint_dir(2) / "step3", params=400)
    write_zero2_checkpoint(runs.bf16_checkpoint_dir(2) / "step3", params=200)
    line = checkpoints.precision_ratios(runs)
    assert line.startswith("bf16 checkpoint vs fp32 checkpoint") and "ZeRO-2" in line and "(smaller)" in line
    assert "ZeRO-0" not in line  # only the stages trained in bf16
