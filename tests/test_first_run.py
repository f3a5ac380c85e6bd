"""helpers.topics.first_run: chapter 02's exercise checks (a batch block DeepSpeed's config class resolves, a
WarmupLR block DeepSpeed's scheduler follows, the bytes of stage 0's gradient all_reduce)."""

from __future__ import annotations

from helpers.core import records
from helpers.topics import first_run
from test_records import PSI, minimal_summary

LINEAR = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10,
                                         "warmup_type": "linear"}}


def test_deepspeed_resolves_the_missing_batch_key():
    assert first_run.resolved_batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 8) == (64, 4, 2)


def test_batch_config_right_wrong_and_blank():
    right = first_run.exercise_batch_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4})
    assert right and "micro batch 2 x accumulation 4 x 8 ranks = train batch 64" in str(right)
    too_big = first_run.exercise_batch_config({"train_batch_size": 64})  # DeepSpeed derives a micro batch of 8
    assert not too_big and too_big.answered and "8 samples per micro-step" in str(too_big)
    refused = first_run.exercise_batch_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                               "gradient_accumulation_steps": 8})
    assert not refused and "32 != 4 * 8 * 8 = 256" in str(refused)
    assert not first_run.exercise_batch_config([64])
    blank = first_run.exercise_batch_config(...)
    assert not blank and not blank.answered


def test_warmup_lrs_follow_deepspeeds_linear_warmup():
    lrs = first_run.warmup_lrs(LINEAR)
    assert lrs[:3] == [0.0, 0.0, 1e-5] and abs(lrs[11] - 1e-4) < 1e-12 and abs(lrs[-1] - 1e-4) < 1e-12


def test_warmup_scheduler_right_wrong_and_blank():
    assert first_run.exercise_warmup_scheduler(LINEAR)
    log = {**LINEAR, "params": {**LINEAR["params"], "warmup_type": "log"}}
    assert "not all 1e-05" in str(first_run.exercise_warmup_scheduler(log))
    slow = {**LINEAR, "params": {**LINEAR["params"], "warmup_num_steps": 1000}}
    assert "rise to 0.0001" in str(first_run.exercise_warmup_scheduler(slow))
    assert not first_run.exercise_warmup_scheduler({"type": "NoSuchLR"})
    assert not first_run.exercise_warmup_scheduler(...).answered


def test_stage0_bytes_read_from_the_runs_comms_log():
    summary = minimal_summary()
    summary["comm"]["by_caller"] = {"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": PSI * 4.0},
                                                   "clip_grad_norm_": {"count": 1.0, "bytes": 4.0}}}
    run = records.Record(summary)
    assert first_run.exercise_stage0_bytes(PSI * 4, run)
    assert not first_run.exercise_stage0_bytes(PSI * 8, run)  # accumulation does not multiply it
    assert not first_run.exercise_stage0_bytes(..., run).answered
