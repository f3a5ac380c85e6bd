"""helpers.topics.first_run: chapter 02's exercise checks (a batch block DeepSpeed's config class resolves, the
step at which DeepSpeed's WarmupLR reaches half its peak, the bytes of stage 0's gradient all_reduce), the
warm-up table and what the 4-byte all_reduce of stage 0 is."""

from __future__ import annotations

from helpers.core import records
from helpers.topics import first_run
from test_records import PSI, minimal_summary

LINEAR = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10,
                                         "warmup_type": "linear"}}
#: The source article's scheduler block (ds_configs/source_article.json): log, the default warmup_type.
ARTICLE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 1000}}


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


def test_the_articles_log_warmup_is_close_to_a_ten_step_linear_one_over_four_steps():
    table = first_run.warmup_table({"log": ARTICLE, "linear 10": first_run.linear_warmup(ARTICLE, 10),
                                    "linear 1000": first_run.linear_warmup(ARTICLE, 1000)}, steps=4)
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert rows[2][1:] == ["1e-05", "1e-05", "1e-07"] and rows[3][1:] == ["1.6e-05", "2e-05", "2e-07"]


def test_first_step_at_a_fraction_of_the_peak():
    assert first_run.first_step_at([0.0, 0.0, 1.0, 2.0, 4.0], 0.5) == 4
    assert first_run.first_step_at(first_run.warmup_lrs(LINEAR, steps=14), 0.5) == 7  # (k - 2) / 10 = 1/2


def test_warmup_exercise_right_within_one_step_wrong_and_blank():
    right = first_run.exercise_warmup_scheduler(33, ARTICLE)  # ln(k - 1) / ln(1000) = 1/2 at k - 1 = 32
    assert right and "step 502" in str(right) and "step 1001" in str(right)
    assert first_run.exercise_warmup_scheduler(32, ARTICLE) and first_run.exercise_warmup_scheduler(34, ARTICLE)
    assert not first_run.exercise_warmup_scheduler(502, ARTICLE)  # a linear warm-up's answer
    assert not first_run.exercise_warmup_scheduler(7, first_run.linear_warmup(ARTICLE, 1000))
    blank = first_run.exercise_warmup_scheduler(..., ARTICLE)
    assert not blank.answered and "33" not in str(blank)


def test_norm_allreduce_names_the_callers_bytes_and_deepspeeds_source():
    summary = minimal_summary()
    summary["comm"]["by_caller"] = {"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": PSI * 4.0},
                                                   "clip_grad_norm_": {"count": 1.0, "bytes": 4.0}}}
    text = first_run.norm_allreduce(records.Record(summary))
    assert "1 all_reduce of 4 bytes per optimizer step" in text
    assert "deepspeed/runtime/utils.py:" in text and "moe" in text and "all_reduce(" in text
    del summary["comm"]["by_caller"]["all_reduce"]["clip_grad_norm_"]
    assert first_run.norm_allreduce(records.Record(summary)).startswith("no all_reduce")


def test_stage0_bytes_read_from_the_runs_comms_log():
    summary = minimal_summary()
    summary["comm"]["by_caller"] = {"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": PSI * 4.0},
                                                   "clip_grad_norm_": {"count": 1.0, "bytes": 4.0}}}
    run = records.Record(summary)
    assert first_run.exercise_stage0_bytes(PSI * 4, run)
    assert not first_run.exercise_stage0_bytes(PSI * 8, run)  # accumulation does not multiply it
    assert not first_run.exercise_stage0_bytes(..., run).answered


def test_first_difference_finds_the_first_step_beyond_the_tolerance():
    assert first_run.first_difference([5.0, 4.0, 3.0], [5.0, 4.000001, 3.01], tolerance=1e-5) == 3
    assert first_run.first_difference([5.0, 4.0], [5.0, 4.0], tolerance=1e-5) is None


def test_exercise_hints_name_the_quantity_not_the_answer():
    warmup = first_run.exercise_warmup_scheduler(..., ARTICLE)
    assert "0.5" not in str(warmup).split("Hint:")[1]  # the fraction is the task's, not the hint's method
    summary = minimal_summary()
    summary["comm"]["by_caller"] = {"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": PSI * 4.0}}}
    blank = str(first_run.exercise_stage0_bytes(..., records.Record(summary)))
    assert f"{PSI:,}" not in blank and "4 bytes" not in blank  # neither the count nor the element size
