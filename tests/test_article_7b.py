"""``benchmarks/article_7b.py``, the source article's LLaMA-7B case: its plan (which runs, at which batch), the
calculator's predictions, the reference file it writes and resumes from, and (marked ``system``: two CPU ranks,
about two minutes on a quiet machine) the whole ``--size tiny`` path end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import article_7b as article  # noqa: E402
from helpers.core import configs, environment, load_guard, theory  # noqa: E402
from helpers.topics import capstone  # noqa: E402

PSI_7B = 6_738_415_616  # the task's count for LLaMA-7B with untied embeddings
ALONE = load_guard.Load("gpu", other_processes=0, other_share=None, cores=2, seconds=10.0, samples=20, source="t")
BUSY = load_guard.Load("gpu", other_processes=1, other_share=0.5, cores=2, seconds=10.0, samples=20, source="t")


def test_the_7b_size_has_llamas_parameter_count():
    assert capstone.model_parameters("7b") == PSI_7B
    assert capstone.SIZES["7b"]["num_attention_heads"] == 32 and capstone.SIZES["7b"]["hidden_size"] == 4096


# --- the plan ---------------------------------------------------------------------------------------

def test_stage0_tries_its_micro_batches_largest_first_without_accumulation():
    trials = article.stage0_trials(gpu=True)
    micro = [t.setting.micro_batch for t in trials]
    assert micro == sorted(micro, reverse=True) == list(article.STAGE0_MICRO_BATCHES["gpu"])
    assert all(t.setting.stage == 0 and t.setting.grad_accum == 1 and t.offload == "none" for t in trials)
    assert all(t.setting.precision == "bf16" and t.setting.seq_len == 2048 for t in trials)


@pytest.mark.parametrize("fitted, effective, zero2_micro, stage0_accum", [
    (8, 8, 2, 1), (4, 4, 1, 1), (2, 4, 1, 2), (1, 4, 1, 4), (6, 12, 3, 2), (None, 4, 1, None)])
def test_both_sides_of_the_article_train_the_same_effective_batch(fitted, effective, zero2_micro, stage0_accum):
    batch = article.same_batch(fitted)
    assert batch == {"effective": effective, "zero2_micro": zero2_micro, "stage0_accum": stage0_accum}
    assert batch["zero2_micro"] * article.ACCUMULATION == batch["effective"]
    if fitted is not None:
        assert fitted * batch["stage0_accum"] == batch["effective"]


def test_data_parallelism_trains_again_only_where_its_micro_batch_needed_accumulation():
    names = lambda fitted: [t.name for t in article.later_trials(True, ("article",), fitted)]
    assert names(4) == ["zero2-accum4"]
    assert names(None) == ["zero2-accum4"]
    trials = {t.name: t for t in article.later_trials(True, ("article",), 2)}
    dp, zero2 = trials["stage0-same-batch"].setting, trials["zero2-accum4"].setting
    assert (dp.stage, dp.micro_batch, dp.grad_accum) == (0, 2, 2)
    assert (zero2.stage, zero2.micro_batch, zero2.grad_accum) == (2, 1, 4)
    # the same tokens per optimizer step: the same samples of the same length
    assert dp.micro_batch * dp.grad_accum * dp.seq_len == zero2.micro_batch * zero2.grad_accum * zero2.seq_len


def test_each_experiment_brings_its_own_runs_at_the_article_batch():
    trials = {t.name: t for t in article.later_trials(True, article.EXPERIMENTS, 4)}
    assert set(trials) == {"zero2-accum4", "zero3", "zero2-offload-optimizer", "zero3-offload-params"}
    assert {t.name for t in article.later_trials(True, ("offload",), 4)} == {"zero2-offload-optimizer",
                                                                             "zero3-offload-params"}
    assert all((t.setting.micro_batch, t.setting.grad_accum) == (1, 4) for t in trials.values())
    zero3, params = trials["zero3"], trials["zero3-offload-params"]
    assert (zero3.setting.stage, zero3.offload, params.setting.stage, params.offload) == (3, "none", 3, "optimizer+params")


def test_configs_offload_as_the_trial_says_and_deepspeed_accepts_them():
    trials = article.stage0_trials(True) + article.later_trials(True, article.EXPERIMENTS, 2)
    for trial in trials:
        config = trial.config(2)
        zero = config["zero_optimization"]
        assert ("offload_optimizer" in zero) == (trial.offload != "none")
        assert ("offload_param" in zero) == (trial.offload == "optimizer+params")
        # offload steps with DeepSpeed's CPU Adam: torch's AdamW would run on the host instead
        assert not (trial.offload != "none" and config["optimizer"]["params"].get("torch_adam"))
        errors = [f for f in configs.check(config, 2, configs.target("cuda", 2)) if f.severity == "error"]
        assert not errors, (trial.name, errors)


def test_the_largest_fitting_micro_batch_ignores_what_ran_out_of_memory():
    results = {"stage0-micro4": {"status": "out of memory", "setting": {"micro_batch": 4}},
               "stage0-micro2": {"status": "measured", "setting": {"micro_batch": 2}},
               "stage0-micro1": {"status": "measured", "setting": {"micro_batch": 1}},
               "zero2-accum4": {"status": "measured", "setting": {"micro_batch": 8}}}
    assert article.largest_fitting(results) == 2
    assert article.largest_fitting({"stage0-micro1": {"status": "out of memory", "setting": {"micro_batch": 1}}}) is None


@pytest.mark.parametrize("entry, final", [
    ({"status": "measured"}, True), ({"status": "out of memory", "attempts": 0}, True),
    ({"status": "timed out", "attempts": 0}, False), ({"status": "failed", "attempts": 1}, False),
    ({"status": "failed", "attempts": article.ATTEMPTS}, True), ({}, False)])
def test_a_resumed_call_trains_again_only_what_may_still_train(entry, final):
    assert article.is_final(entry) is final


# --- predictions ------------------------------------------------------------------------------------

def test_predictions_are_the_calculators_figures_for_7b_on_two_gpus():
    trials = {t.name: t for t in article.stage0_trials(True) + article.later_trials(True, article.EXPERIMENTS, 4)}
    gib = 2 ** 30
    stage0 = article.predict(trials["stage0-micro1"], PSI_7B, 2)
    assert stage0["model_states_gpu_bytes"]["total"] == 16 * PSI_7B  # (2 + 2 + 12) bytes a parameter
    assert stage0["host_bytes_all_ranks"] == 0
    assert [c["op"] for c in stage0["collectives_per_step"]] == ["all_reduce"]
    assert stage0["ring_bytes_per_rank_per_step"] == pytest.approx(2 * PSI_7B)  # 2(n-1)/n of 2 bytes, n = 2
    zero2 = article.predict(trials["zero2-accum4"], PSI_7B, 2)
    assert zero2["model_states_gpu_bytes"]["total"] == pytest.approx((2 + 14 / 2) * PSI_7B)
    assert zero2["model_states_gpu_bytes"]["total"] / gib == pytest.approx(56.5, abs=0.1)
    off = article.predict(trials["zero2-offload-optimizer"], PSI_7B, 2)
    assert off["model_states_gpu_bytes"]["total"] == 2 * PSI_7B  # bf16 parameters alone stay
    assert off["host_bytes_all_ranks"] == pytest.approx(
        2 * theory.offload_bytes_per_device(PSI_7B, 2, 2, "optimizer", "bf16")["host"]["total"])
    params = article.predict(trials["zero3-offload-params"], PSI_7B, 2)
    assert params["model_states_gpu_bytes"]["total"] == 0
    assert params["host_bytes_all_ranks"] > off["host_bytes_all_ranks"]
    zero3 = article.predict(trials["zero3"], PSI_7B, 2)
    assert zero3["ring_bytes_per_rank_per_step"] == pytest.approx(1.5 * stage0["ring_bytes_per_rank_per_step"])


def test_plan_prints_every_run_with_the_calculators_figures_and_trains_nothing(capsys):
    assert article.main(["--plan", "--experiments", "article,offload"]) == 0
    out = capsys.readouterr().out
    for name in ("stage0-micro4", "stage0-micro1", "zero2-accum4", "zero2-offload-optimizer", "zero3-offload-params"):
        assert name in out
    assert "zero3 " not in out  # the stages experiment was not asked for
    assert "100.4" in out and "56.5" in out  # 16 and 9 bytes a parameter of 7B, in GiB
    assert not list(article.launch.RUNS_DIR.glob("article/7b/*"))


# --- the reference file -------------------------------------------------------------------------------

def _env(gpu: bool) -> environment.Environment:
    env = environment.detect(2)
    return dataclasses.replace(env, device_name="2 x NVIDIA H200" if gpu else env.device_name)


def test_the_reference_is_named_by_size_and_device_and_says_where_it_was_measured():
    env = _env(gpu=False)
    data = article.new_reference("tiny", 1000, env, 2, 5)
    assert article.reference_path("tiny", env, 2).name == "article-tiny-2xCPU.json"
    for key in ("experiment", "device", "date", "software", "hardware", "conditions", "claim", "params", "trials",
                "launches", "peak_tflops"):
        assert key in data
    assert data["peak_tflops"] is None  # no MFU on a CPU
    gpu = article.new_reference("7b", PSI_7B, _env(gpu=True), 2, 6)
    assert gpu["peak_tflops"] == 989.5 and gpu["device"] == "2 x NVIDIA H200"  # the course's H200 SXM dense bf16 peak


def test_the_budget_starts_only_the_runs_that_fit():
    trials = article.later_trials(True, article.EXPERIMENTS, 4)
    data = {"launches": []}
    start, each = article.FIRST_GUESS_S["gpu"]
    assert article.estimate(data, trials[:1], True) == start + each
    assert article.estimate(data, trials[2:3], True) == start + each * article.OFFLOAD_FACTOR
    assert article.fitting(data, trials, start + 2 * each, True) == trials[:2]
    assert article.fitting(data, trials, start, True) == []
    # once launches are timed, their median seconds per run, less the start, replace the guess
    data["launches"].append({"seconds": start + 300.0, "weight": 3.0})
    assert article.estimate(data, trials[:2], True) == start + 200.0
    data["launches"] += [{"seconds": start + 1000.0, "weight": 1.0}, {"seconds": start + 150.0, "weight": 3.0}]
    assert article.estimate(data, trials[:2], True) == start + 200.0  # the slow launch is the median's outlier


def _measured(steps: list[float], tokens: float) -> dict:
    return {"status": "measured", "measured": {"measured_step_times_s": steps, "tokens_per_s": tokens}}


def _comparison_data(load: load_guard.Load) -> dict:
    return {"trials": {"stage0-micro4": {**_measured([1.0, 1.01, 0.99], 4000.0), "label": "stage 0, micro-batch 4",
                                         "setting": {"micro_batch": 4}},
                       "zero2-accum4": {**_measured([0.8, 0.81, 0.79], 5200.0), "label": "ZeRO-2"}},
            "launches": [{"trials": ["stage0-micro4"], "load": dataclasses.asdict(load)},
                         {"trials": ["zero2-accum4"], "load": dataclasses.asdict(load)}]}


def test_the_article_comparison_gives_a_verdict_only_alone():
    alone = article.article_comparison(_comparison_data(ALONE))
    assert alone["tokens_per_s_ratio"] == pytest.approx(1.3) and alone["verdict_given"]
    busy = article.article_comparison(_comparison_data(BUSY))
    assert not busy["verdict_given"] and "withheld" in busy["sentence"]


def test_without_a_data_parallel_run_the_comparison_says_so():
    data = _comparison_data(ALONE)
    data["trials"]["stage0-micro4"] = {"status": "out of memory", "label": "stage 0, micro-batch 4",
                                       "setting": {"micro_batch": 4}}
    found = article.article_comparison(data)
    assert found["data_parallel"] is None and "no micro-batch tried ([4])" in found["sentence"]
    data["trials"]["zero2-accum4"]["status"] = "timed out"
    assert article.article_comparison(data) is None


def test_a_launch_killed_in_one_run_marks_that_run_and_leaves_the_later_ones_to_run(monkeypatch, tmp_path):
    trials = [t for t in article.later_trials(True, ("stages", "offload"), 1)][:3]
    folder = lambda t: article.launch.run_folder(t.spec("7b", 6, 1, tmp_path / "article" / "7b"), 1)
    killed = article.launch.RunFailed("[1 GPU rank] a rank was killed by SIGKILL: the host ran out of memory",
                                      out=folder(trials[1]))

    def sweep(specs, **_):
        raise killed

    monkeypatch.setattr(article.launch, "sweep", sweep)
    monkeypatch.setattr(article.launch, "RUNS_DIR", tmp_path)
    monkeypatch.setattr(article.records, "load", lambda path: (_ for _ in ()).throw(OSError(path)))
    data = {"params": PSI_7B, "trials": {}, "launches": []}
    article.run_launch(data, tmp_path / "ref.json", "rest-1", trials, "7b", 6, 1, timeout=60)
    statuses = [data["trials"][t.name]["status"] for t in trials]
    assert statuses == ["not run", "out of memory", "not run"]  # the first had not failed: it has no record either
    assert [article.is_final(data["trials"][t.name]) for t in trials] == [False, True, False]


# --- end to end on two CPU ranks ---------------------------------------------------------------------

@pytest.mark.system
def test_tiny_runs_every_experiment_on_two_cpu_ranks(tmp_path):
    env = {**os.environ, "COURSE_RUNS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / "article_7b.py"), "--size", "tiny", "--world-size", "2"]
    # a loaded machine may need more than one call: each goes on where the last stopped
    for _ in range(5):
        done = subprocess.run([*command, "--budget", "400"], capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        if "left for the next call" not in done.stdout:
            break
    data = json.loads((tmp_path / "reference" / "article-tiny-2xCPU.json").read_text())
    assert set(data["trials"]) == {"stage0-micro8", "stage0-micro4", "zero2-accum4", "zero3",
                                   "zero2-offload-optimizer", "zero3-offload-params"}
    for name, entry in data["trials"].items():
        assert entry["status"] == "measured", (name, entry.get("failure"))
        m = entry["measured"]
        assert m["tokens_per_s"] > 0 and len(m["measured_step_times_s"]) == 2
        assert m["collectives_logged_step"]["bytes_per_step"] > 0
        assert entry["prediction"]["model_states_gpu_bytes"]["total"] >= 0
    # the same samples: ZeRO-2 with accumulation and data parallelism train the same tokens a step
    zero2, dp = data["trials"]["zero2-accum4"]["setting"], data["trials"]["stage0-micro8"]["setting"]
    assert zero2["micro_batch"] * zero2["grad_accum"] == dp["micro_batch"] * dp["grad_accum"]
    assert data["trials"]["zero2-offload-optimizer"]["measured"]["optimizer"] == "DeepSpeedCPUAdam"
    assert data["article_comparison"]["tokens_per_s_ratio"] > 0 and data["launches"]
    # a second call finds everything done and trains nothing
    again = subprocess.run([*command, "--budget", "60"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "launch " not in again.stdout
    assert len(json.loads((tmp_path / "reference" / "article-tiny-2xCPU.json").read_text())["launches"]) == \
        len(data["launches"])
