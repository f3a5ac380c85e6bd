"""The capstone's arithmetic and rules, without launching: FLOPs and MFU, the communication share of a
profiled step, the settings' DeepSpeed configs (checked by DeepSpeed's own parser), the keep-or-drop rule
and the tables. Its runs are notebook 16's (nbval)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from test_records import minimal_summary
from helpers.core import configs, launch, load_guard, models, performance, records
from helpers.topics import capstone

#: Loads for the load-guard tests: the machine to itself, and three other busy processes on it.
ALONE = load_guard.Load("cpu", other_processes=0, other_share=0.0, cores=2, seconds=10.0, samples=20, source="t")
BUSY = load_guard.Load("cpu", other_processes=3, other_share=0.5, cores=2, seconds=10.0, samples=20, source="t")


# --- model FLOPs, peaks, MFU ---------------------------------------------------------------------

def test_flops_per_token_is_palms_count():
    f = performance.flops_per_token(1_000, layers=2, hidden=64, seq_len=128)
    assert f == {"matmul_6N": 6_000.0, "attention_12LdT": 12.0 * 2 * 64 * 128, "total": 6_000.0 + 196_608.0,
                 "lookup_params": 0}


def test_an_untied_input_embedding_is_a_lookup_not_flops():
    f = performance.flops_per_token(1_000, layers=2, hidden=64, seq_len=128, lookup_params=200)
    assert f["matmul_6N"] == 6 * 800 and f["total"] == 6 * 800 + 12.0 * 2 * 64 * 128
    with pytest.raises(ValueError, match="lookup_params"):
        performance.flops_per_token(1_000, layers=2, hidden=64, seq_len=128, lookup_params=2_000)


def test_model_shape_counts_the_untied_embedding_from_the_config():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        untied = LlamaForCausalLM(capstone.model_config("1.2b"))
        tied_config = capstone.model_config("tiny")
        tied_config.tie_word_embeddings = True
        tied = LlamaForCausalLM(tied_config)
    assert performance.model_shape(untied)["lookup_params"] == 32_000 * 2048 == untied.get_input_embeddings().weight.numel()
    assert performance.model_shape(tied)["lookup_params"] == 0
    assert performance.model_shape(torch.nn.Linear(2, 2)) is None


def test_the_baseline_model_has_the_issues_shape():
    assert capstone.model_parameters("1.2b") == 1_244_227_584
    assert capstone.model_config("1.2b").num_hidden_layers == 22
    assert capstone.model_config("1.2b", seq_len=4096).max_position_embeddings == 4096


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.5), ("NVIDIA H200 NVL", 835.5),
                                        ("NVIDIA A100-SXM4-80GB", 312.0), ("cpu", None)])
def test_peak_looked_up_by_device_name(name, peak):
    found, source = performance.peak_tflops(name)
    assert found == peak and source


def test_throughput_and_mfu_from_step_times():
    t = performance.throughput([2.0, 1.0, 3.0], tokens_per_step=1000, flops_token=1e12, world_size=2,
                               device_name="NVIDIA H100 80GB HBM3")
    assert t["step_time_s"] == 2.0 and t["tokens_per_s"] == 500.0
    assert t["tflops_per_gpu"] == pytest.approx(250.0) and t["mfu"] == pytest.approx(250.0 / 989.5)


# --- communication share of a profiled step ------------------------------------------------------

def test_union_and_overlap_of_intervals():
    assert performance.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert performance.length([(0, 2), (1, 3)]) == 3
    assert performance.overlap([(0, 10)], [(2, 4), (3, 5), (8, 12)]) == 5


def test_gpu_share_counts_only_communication_no_kernel_hides():
    events = [("ampere_bf16_gemm", 0, 600, True), ("ncclDevKernel_AllReduce", 400, 900, True),
              ("Memcpy HtoD", 800, 1000, True), ("aten::mm", 0, 1000, False)]
    share = performance.comm_share(events, step_s=0.001)
    assert share["comm_busy_s"] == pytest.approx(500e-6) and share["comm_exposed_s"] == pytest.approx(300e-6)
    assert share["exposed_share"] == pytest.approx(0.3)


def test_cpu_share_is_time_inside_collectives():
    events = [("aten::mm", 0, 500, False), ("record_param_comms", 500, 700, False), ("gloo:all_reduce", 520, 690, False)]
    share = performance.comm_share(events, step_s=0.001)
    assert share["exposed_share"] == pytest.approx(0.2) and share["busy_share"] == share["exposed_share"]


# --- settings and the ladder ----------------------------------------------------------------------

@pytest.mark.parametrize("setting", [
    capstone.GPU_BASELINE,
    dataclasses.replace(capstone.GPU_BASELINE, stage=1, overlap_comm=True, reduce_bucket_size=200_000_000,
                        allgather_bucket_size=200_000_000),
    dataclasses.replace(capstone.GPU_BASELINE, stage=3, prefetch_bucket_size=200_000_000, optimizer="torch"),
    capstone.CPU_BASELINE,
])
def test_every_setting_is_a_config_deepspeed_accepts(setting):
    config = setting.config(world_size=4)
    assert config["train_batch_size"] == setting.micro_batch * setting.grad_accum * 4
    errors = [f for f in configs.check(config, 4) if f.severity == "error"]
    assert not errors, errors


def test_setting_names_what_it_changed():
    other = dataclasses.replace(capstone.GPU_BASELINE, micro_batch=16, grad_accum=1, reduce_bucket_size=200_000_000)
    assert other.changes_from(capstone.GPU_BASELINE) == "micro_batch=16, grad_accum=1, reduce_bucket_size=2e8"
    assert capstone.GPU_BASELINE.changes_from(capstone.GPU_BASELINE) == "same"


def test_every_rung_proposes_new_settings_and_the_model_takes_their_options():
    for rung in capstone.GPU_LADDER + capstone.CPU_LADDER:
        for label, setting in rung.propose(capstone.GPU_BASELINE):
            assert setting != capstone.GPU_BASELINE, (rung.name, label)
            capstone.check_options(capstone.MODEL, setting.model_options("1.2b"))


@pytest.mark.parametrize("options, key", [({"size": "13b"}, "size"), ({"seq_len": 0}, "seq_len"),
                                          ({"attention": "flash"}, "attention"), ({"tp": 2}, "tp"),
                                          ({"compile": "yes"}, "compile")])
def test_bad_model_options_name_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        capstone.check_options(capstone.MODEL, options)
    with pytest.raises(ValueError, match="takes no model_options"):
        models.check_model_options("mlp", {"seq_len": 64})
    with pytest.raises(ValueError, match="builds 'llama-capstone'"):
        capstone.check_options("mlp", {})


def _candidates(*stages):
    return [capstone.Candidate("stage", f"c{i}", dataclasses.replace(capstone.GPU_BASELINE, stage=s), f"r{i}")
            for i, s in enumerate(stages)]


def test_decide_keeps_the_fastest_eligible_candidate_above_the_margin():
    rung = capstone.GPU_LADDER[0]
    a, b, c, d = _candidates(3, 2, 1, 2)
    d.failure = "CUDA out of memory"
    winner = capstone.decide([(a, 110.0), (b, 101.0), (c, 150.0), (d, None)], best_value=100.0, margin=0.02, rung=rung)
    assert winner is a
    assert a.verdict == "kept: +10.0%"
    assert b.verdict.startswith("dropped: +1.0%, not above the 2.0% margin")
    assert c.verdict.startswith("not eligible (+50.0%)")
    assert d.verdict == "failed: CUDA out of memory"


def test_decide_keeps_nothing_when_no_candidate_beats_the_best():
    a, b = _candidates(3, 2)
    assert capstone.decide([(a, 90.0), (b, 101.5)], 100.0, 0.02, capstone.GPU_LADDER[0]) is None
    assert a.verdict.startswith("dropped: -10.0%")


def test_tables_from_a_ladder_dict():
    row = {"rung": "stage", "label": "baseline", "run": "r0", "verdict": "baseline", "changes": "same",
           "failure": None, "setting": dataclasses.asdict(capstone.GPU_BASELINE), "tokens_per_s": 100_000.0,
           "tflops_per_gpu": 400.0, "mfu": 400 / 989.5, "step_time_s": 1.0, "peak_bytes": 40 * 2**30,
           "comm_exposed_share": 0.05, "comm_busy_share": 0.2, "losses": [10.0, 9.0], "metric": 400.0}
    kept = {**row, "label": "ZeRO-3", "run": "r1", "verdict": "kept: +25.0%", "changes": "stage=3", "metric": 500.0,
            "tflops_per_gpu": 500.0, "mfu": 500 / 989.5, "setting": dataclasses.asdict(
                dataclasses.replace(capstone.GPU_BASELINE, stage=3))}
    failed = {"rung": "batch", "label": "micro x2", "run": "r2", "verdict": "failed: OOM", "changes": "micro_batch=16",
              "failure": "OOM", "setting": dataclasses.asdict(capstone.GPU_BASELINE)}
    ladder = {"candidates": [row, kept, failed], "rungs": [{"rung": "stage", "what": "ZeRO stage", "ran": True,
                                                            "kept": "ZeRO-3"}],
              "best_run": "r1", "best_label": "stage: ZeRO-3", "device": "2 x NVIDIA H100 80GB HBM3", "world_size": 2,
              "params": 1_244_227_584, "target_mfu": 0.5, "fsdp2": {"measured": False, "reason": "not connected"}}
    table = capstone.ladder_table(ladder)
    assert "40.4%" in table and "50.5%" in table and "40 GiB" in table and "failed: OOM" in table
    text = capstone.summary(ladder)
    assert "1.25x the baseline's 400" in text and "MFU 50.5% (target 50%: reached)" in text
    assert "losses vs the baseline" in capstone.same_math(ladder)
    assert "within 1e-03" in capstone.same_math(ladder)  # bf16 tolerance, same batch as the baseline


def test_fsdp2_lines_report_what_ran_or_why_not():
    base = {"rung": "cpu", "label": "baseline", "run": "r0", "verdict": "baseline", "losses": [5.0, 4.0],
            "setting": dataclasses.asdict(capstone.CPU_BASELINE)}
    runs = {"FSDP2 full": {"mfu": None, "tokens_per_s": 1234.0, "losses": [5.0, 4.0 + 5e-6]},
            "FSDP2 grad-op": {"mfu": None, "tokens_per_s": 1500.0, "losses": [5.0, 4.1]}}
    ladder = {"candidates": [base], "best": dataclasses.asdict(capstone.CPU_BASELINE), "best_run": "r0",
              "fsdp2": {"measured": True, "setting": dataclasses.asdict(capstone.CPU_BASELINE), "runs": runs}}
    same = capstone.fsdp2_same_math(ladder)
    assert "FSDP2 full" in same and "within 1e-05" in same and "differ by more than 1e-05" in same
    assert "FSDP2 full 1,234 tokens/s; FSDP2 grad-op 1,500 tokens/s" in capstone.fsdp2_line(ladder)
    base.update(run="r0", tokens_per_s=1000.0, tflops_per_gpu=None, mfu=None, peak_bytes=2**20)
    for r in runs.values():
        r.update(tflops_per_gpu=None, peak_bytes=2**21)
    table = capstone.fsdp2_table({**ladder, "device": "CPU (2 cores)"})
    assert "DeepSpeed baseline" in table and "FSDP2 grad-op, eager" in table and "DeepSpeed best" not in table
    best = {**base, "run": "r1", "label": "ZeRO-3", "verdict": "kept: +5.0%"}
    table = capstone.fsdp2_table({**ladder, "candidates": [base, best], "best_run": "r1", "device": "CPU (2 cores)"})
    assert "DeepSpeed best: ZeRO-3" in table
    skipped = {**ladder, "fsdp2": {"measured": False, "reason": "time budget: about 50 s needed, 3 s left"}}
    assert capstone.fsdp2_line(skipped) == "FSDP2: time budget: about 50 s needed, 3 s left"
    assert "did not run: time budget" in capstone.fsdp2_same_math(skipped)


def test_summary_says_when_nothing_beat_the_baseline():
    base = {"rung": "cpu", "label": "baseline", "run": "r0", "verdict": "baseline", "changes": "same", "metric": 2.0,
            "mfu": None, "comm_exposed_share": 0.1}
    ladder = {"candidates": [base, {**base, "run": "r1", "metric": 4.0}], "best_run": "r1", "best_label": "baseline",
              "device": "CPU (2 cores)", "world_size": 2, "params": 10, "target_mfu": 0.5, "margin": 0.5, "fsdp2": {}}
    text = capstone.summary(ladder)
    assert "no candidate beat the baseline by more than the 50.0% margin: model TFLOP/s per rank 3 " in text
    assert "MFU: none" in text


def _FakeRecord(value: float) -> records.Record:
    """What the ladder reads of a record: throughput, peak memory, comm share, losses."""
    summary = minimal_summary()
    summary.update(losses=[1.0], steps=1, comm_share={"exposed_share": 0.1, "busy_share": 0.2},
                   throughput={"tflops_per_gpu": value, "tokens_per_s": value * 10, "mfu": None, "step_time_s": 1.0})
    summary["memory"]["peak_bytes_per_rank"] = [1, 1]
    return records.Record(summary)


def test_walk_keeps_what_beats_the_margin_and_resumes_where_it_stopped(monkeypatch):
    def value(s: capstone.Setting) -> float:
        return {3: 90.0}.get(s.stage, 100.0) * (1.1 if s.grad_accum == 4 else 1.0)

    launches = []

    def fake_launch(index, rung, pairs, size, steps, world, name, timeout, prefix="", trainer=capstone.TRAINER,
                    initialize=capstone.INITIALIZE, progress=True):
        launches.append([label for label, _ in pairs])
        return [capstone.Candidate(rung.name, label, s, f"{prefix}{index}-{i}", record=_FakeRecord(value(s)))
                for i, (label, s) in enumerate(pairs)]

    monkeypatch.setattr(capstone, "_launch_rung", fake_launch)
    fsdp2_settings = []

    def fake_fsdp2(setting, size, steps, world_size, name, timeout, progress=True):
        fsdp2_settings.append(setting)
        return {"measured": False, "reason": "faked"}

    monkeypatch.setattr(capstone, "fsdp2_run", fake_fsdp2)
    stage = capstone.Rung("stage", "stage", lambda s: [("ZeRO-3", dataclasses.replace(s, stage=3))])
    batch = capstone.Rung("batch", "batch", lambda s: [("accumulation x2", dataclasses.replace(s, grad_accum=4))])
    first = capstone.walk("tiny", ladder=[stage], budget_s=1000, world_size=2).to_dict()
    assert launches == [["baseline", "baseline, again", "ZeRO-3"]]
    assert first["spread"] == 0 and first["margin"] == capstone.MIN_MARGIN
    assert [c["verdict"].split(":")[0] for c in first["candidates"]] == ["baseline", "baseline", "dropped"]

    second = capstone.walk("tiny", ladder=[stage, batch], budget_s=1000, world_size=2, resume=first).to_dict()
    # the stage rung is not climbed again; the kept setting trains again beside the new candidate
    assert launches[1:] == [[capstone.AGAIN, "accumulation x2"]]
    assert second["candidates"][-2]["verdict"].startswith("best so far, trained again")
    assert second["candidates"][-1]["verdict"] == "kept: +10.0%" and second["best_label"] == "batch: accumulation x2"
    assert [r["rung"] for r in second["rungs"]] == ["stage", "batch"] and second["walks"] == 2
    # rung indices restart in every walk: a resumed walk's run names carry its number
    assert [c["run"] for c in second["candidates"]] == ["0-0", "0-1", "0-2", "w2-1-0", "w2-1-1"]
    # after each walk, FSDP2 on the best setting so far
    assert [s.grad_accum for s in fsdp2_settings] == [capstone.CPU_BASELINE.grad_accum, 4]

    # each walk keeps its launches' (seconds, candidates, compiled); a resumed walk's estimates start from them
    assert [n for _, n, _ in second["launches"]] == [3, 2]
    seen_history, estimate = [], capstone._estimate
    monkeypatch.setattr(capstone, "_estimate", lambda history, *rest: seen_history.append(list(history)) or 0.0)
    capstone.walk("tiny", ladder=[stage, batch], budget_s=1000, world_size=2, resume=second, climb_again=["batch"])
    assert [n for _, n, _ in seen_history[0]] == [3, 2]
    monkeypatch.setattr(capstone, "_estimate", estimate)
    del fsdp2_settings[2:]

    # a rung named in `climb_again` is climbed once more, from the best so far; one not named stays climbed
    again = capstone.walk("tiny", ladder=[stage, batch], budget_s=1000, world_size=2, resume=second,
                          climb_again=["stage"]).to_dict()
    assert launches[2:] == [[capstone.AGAIN, "ZeRO-3"]]
    assert again["candidates"][-1]["setting"]["grad_accum"] == 4 and again["candidates"][-1]["setting"]["stage"] == 3
    assert [r["rung"] for r in again["rungs"]] == ["stage", "batch", "stage"] and again["walks"] == 3
    assert again["candidates"][-1]["run"] == "w3-0-1"
    del fsdp2_settings[2:]

    # on a machine 20% faster the candidate gains 10% over the kept setting trained there, not 32% over the old figure
    scale = 1.2
    faster = lambda index, rung, pairs, *rest, prefix="", **options: [  # noqa: E731
        capstone.Candidate(rung.name, label, s, f"{prefix}{index}-{i}", record=_FakeRecord(scale * value(s)))
        for i, (label, s) in enumerate(pairs)]
    monkeypatch.setattr(capstone, "_launch_rung", faster)
    elsewhere = capstone.walk("tiny", ladder=[stage, batch], budget_s=1000, world_size=2, resume=first).to_dict()
    assert elsewhere["candidates"][-1]["verdict"] == "kept: +10.0%"
    monkeypatch.setattr(capstone, "_launch_rung", fake_launch)

    monkeypatch.setattr(capstone, "_estimate", lambda *args: 1e9)  # no budget: the baseline alone, then nothing
    third = capstone.walk("tiny", ladder=[stage, batch], budget_s=10, world_size=2).to_dict()
    assert launches[-1] == ["baseline", "baseline, again"]
    assert [r["ran"] for r in third["rungs"]] == [False, False] and "baseline alone" in third["rungs"][0]["why"]
    assert third["fsdp2"]["reason"].startswith("time budget") and len(fsdp2_settings) == 3


def test_candidates_failing_after_another_failed_are_trained_again_in_one_more_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(capstone.launch, "RUNS_DIR", tmp_path)
    launches = []

    trained = records.Record.__new__(records.Record)  # a record; its contents are not read here

    def fake_sweep(specs, name, world_size, timeout, progress):
        launches.append([s.name for s in specs])
        if len(specs) < len(pairs):  # without the candidate that ran out of memory, they train
            return {s.name: trained for s in specs}
        return {specs[0].name: trained,
                specs[1].name: launch.RunFailed("rank 0 failed: OutOfMemoryError: CUDA out of memory"),
                specs[2].name: launch.RunFailed("rank 0 failed: DistBackendError: NCCL error"),
                specs[3].name: launch.RunFailed("rank 0 failed: DistBackendError: NCCL error"),
                specs[4].name: trained}

    monkeypatch.setattr(capstone.launch, "sweep", fake_sweep)
    rung = capstone.Rung("batch", "batch", lambda s: [])
    pairs = [(label, capstone.GPU_BASELINE) for label in ("again", "micro x2", "accumulation x2", "micro /2", "x")]
    found = capstone._launch_rung(0, rung, pairs, "tiny", 2, 2, "capstone", timeout=10, prefix="w4-")
    names = [f"w4-0-batch-{i}-{capstone._slug(label)}" for i, (label, _) in enumerate(pairs)]
    assert launches == [names, names[2:4]]  # the two that failed after the first failure, in one more launch
    assert [c.record is not None for c in found] == [True, False, True, True, True]
    assert found[1].failure.startswith("rank 0 failed: OutOfMemoryError") and not found[1].note
    assert found[2].note == found[3].note == ("trained again in one more launch: it failed after 'micro x2' "
                                              "failed in the rung's launch")
    assert not found[0].note and not found[4].note


def test_a_resumed_walk_proposes_again_what_failed_for_another_reason_than_memory(monkeypatch):
    proposed = []

    def fake_launch(index, rung, pairs, size, steps, world, name, timeout, prefix="", trainer=capstone.TRAINER,
                    initialize=capstone.INITIALIZE, progress=True):
        proposed.extend(label for label, _ in pairs)
        return [capstone.Candidate(rung.name, label, s, f"{prefix}{index}-{i}", record=_FakeRecord(100.0))
                for i, (label, s) in enumerate(pairs)]

    monkeypatch.setattr(capstone, "_launch_rung", fake_launch)
    monkeypatch.setattr(capstone, "fsdp2_run", lambda *args, **kwargs: {"measured": False, "reason": "faked"})
    stage = capstone.Rung("stage", "stage", lambda s: [("ZeRO-3", dataclasses.replace(s, stage=3))])
    first = capstone.walk("tiny", ladder=[stage], budget_s=1000, world_size=2).to_dict()
    base = capstone.CPU_BASELINE
    x2, x4 = (dataclasses.replace(base, grad_accum=base.grad_accum * k) for k in (2, 4))
    first["candidates"] += [
        {"rung": "batch", "label": "x2", "run": "r1", "verdict": "failed: ...", "setting": dataclasses.asdict(x2),
         "failure": "rank 0 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 320.00 MiB."},
        {"rung": "batch", "label": "x4", "run": "r2", "verdict": "failed: ...", "setting": dataclasses.asdict(x4),
         "failure": "rank 0 failed: DistBackendError: NCCL error in: ..."}]
    accumulate = next(r for r in capstone.GPU_LADDER if r.name == "accumulate")
    capstone.walk("tiny", ladder=[accumulate], budget_s=1000, world_size=2, resume=first)
    # out of memory stays seen; the NCCL error that followed it is tried again
    assert proposed[-2:] == [capstone.AGAIN, "accumulation x4"]


def test_shortfall_bounds_what_hiding_communication_could_give():
    ladder = {"target_mfu": 0.5, "best_run": "r2", "candidates": [
        {"run": "r0", "verdict": "baseline", "mfu": 0.40, "comm_exposed_share": 0.03},
        {"run": "r1", "verdict": "baseline", "mfu": 0.40, "comm_exposed_share": 0.03},
        {"run": "r2", "verdict": "kept: +20%", "mfu": 0.48, "comm_exposed_share": 0.02}]}
    assert capstone.shortfall(ladder).startswith("best 48.0% MFU with 2.0% of its step exposed communication: "
                                                 "hiding all of it would give at most 49.0%, still 1.0 points short")
    ladder["candidates"][2]["comm_exposed_share"] = 0.1
    assert capstone.shortfall(ladder).endswith("the communication left is what stands in the way.")
    # an overlap rung that was measured and dropped: hiding was tried and did not pay
    setting = dataclasses.asdict(capstone.Setting())
    for candidate in ladder["candidates"]:
        candidate["setting"] = setting
    ladder["candidates"] += [
        {"run": "r3", "rung": "overlap", "label": "overlap_comm", "tokens_per_s": 1.0, "setting": setting,
         "verdict": "dropped: -6.6%, not above the 2.0% margin"},
        {"run": "r4", "rung": "overlap", "label": "overlap_comm, buckets 2e8", "verdict": "failed: out of memory"}]
    assert capstone.shortfall(ladder).endswith(
        "enough for 50% on paper; but the overlap rung did not hide it here (overlap_comm -6.6%).")
    ladder["candidates"][3]["setting"] = {**setting, "micro_batch": 4, "grad_accum": 4}  # tried on other samples
    assert capstone.shortfall(ladder).endswith(
        "(overlap_comm -6.6% (tried on micro batch 4 x accumulation 4, before the kept 8 x 2)).")
    ladder["best_run"] = "r0"  # the baseline: the mean of its two runs
    assert capstone.shortfall(ladder).startswith("best 40.0% MFU with 3.0%")


def test_a_compiled_launch_is_estimated_from_compiled_launches_once_one_was_timed():
    eager = [(100.0, 5, False)]  # 20 s a candidate
    assert capstone._estimate(eager, 2, False, True) == 40.0
    assert capstone._estimate(eager, 2, True, True) == 40.0 * capstone.COMPILE_FACTOR  # no compiled launch yet
    timed = eager + [(70.0, 1, True)]  # a compiled candidate took 70 s: the factor is not applied on top
    assert capstone._estimate(timed, 2, True, True) == 140.0
    assert capstone._estimate(timed, 2, False, True) == 40.0
    assert capstone._estimate([], 2, False, True) == 120.0


def test_fsdp2_of_an_earlier_walk_is_set_beside_the_run_that_trained_its_batch():
    def setting(micro: int, accum: int, compiled: bool) -> dict:
        return dataclasses.asdict(dataclasses.replace(capstone.GPU_BASELINE, micro_batch=micro, grad_accum=accum,
                                                      compile=compiled))

    def row(run: str, label: str, verdict: str, s: dict, losses: list) -> dict:
        return {"run": run, "label": label, "verdict": verdict, "setting": s, "losses": losses, "tokens_per_s": 1.0,
                "tflops_per_gpu": 1.0, "mfu": 0.4, "peak_bytes": 1}

    fsdp2 = {"measured": True, "setting": setting(8, 2, False), "runs": {"FSDP2 full": {
        "losses": [2.0, 1.0], "tokens_per_s": 1.0, "tflops_per_gpu": 1.0, "mfu": 0.4, "peak_bytes": 1}}}
    ladder = {"device": "2 x GPU", "best": setting(16, 1, True), "best_run": "r2", "fsdp2": fsdp2, "candidates": [
        row("r0", "baseline", "baseline", setting(8, 2, False), [9.0, 9.0]),
        row("r1", "engine.compile()", "kept: +14%", setting(8, 2, True), [2.0, 1.0]),
        row("r2", "micro x2, accumulation /2", "kept: +4%", setting(16, 1, True), [1.5])]}
    assert capstone.fsdp2_partner(ladder)["run"] == "r1"  # the last kept run of FSDP2's batch, not the best
    assert "losses vs DeepSpeed's engine.compile()" in capstone.fsdp2_same_math(ladder)
    assert "within" in capstone.fsdp2_same_math(ladder)
    assert "DeepSpeed, FSDP2's batch: engine.compile()" in capstone.fsdp2_table(ladder)
    assert capstone.fsdp2_line(ladder).startswith("FSDP2 on an earlier best setting (micro batch 8 x accumulation 2")
    # a later walk whose FSDP2 failed on its best setting keeps the earlier figures and says why it has no new ones
    before = {"candidates": [], "rungs": [], "budget_s": 1, "seconds": 1, "walks": 1, "best_run": "r2", "fsdp2": fsdp2}
    failed = "the FSDP2 launch failed: rank 0 failed: OutOfMemoryError"
    later = capstone.Ladder(size="tiny", params=1, world_size=2, device="2 x GPU", baseline=capstone.GPU_BASELINE,
                            budget_s=1, previous=before, fsdp2={"measured": False, "reason": failed}).to_dict()
    assert later["fsdp2"]["runs"] == fsdp2["runs"] and later["fsdp2"]["latest"] == {"reason": failed}
    assert capstone.fsdp2_line({**ladder, "fsdp2": later["fsdp2"]}).endswith(f"; on the best setting since: {failed}")
    ladder["fsdp2"] = {**fsdp2, "setting": setting(16, 1, False)}  # FSDP2 on the best's batch: the best itself
    assert capstone.fsdp2_partner(ladder)["run"] == "r2" and capstone.fsdp2_line(ladder).startswith("FSDP2 on the best")
    # a later walk with no time left for FSDP2 keeps the outcome a walk before it measured
    skipped = {"measured": False, "reason": capstone.BUDGET_SKIP + "about 175 s needed, 164 s left"}
    after_skip = capstone.Ladder(size="tiny", params=1, world_size=2, device="2 x GPU", baseline=capstone.GPU_BASELINE,
                                 budget_s=1, previous=later, fsdp2=skipped).to_dict()
    assert after_skip["fsdp2"]["latest"] == {"reason": failed} and after_skip["fsdp2"]["runs"] == fsdp2["runs"]


def _reference(runs: dict, candidates: list[str], note: str, conditions: str, fsdp2: dict | None = None) -> dict:
    """A capstone reference file's shape: records by run name and the ladder whose candidates name them."""
    ladder = {"candidates": [{"run": r} for r in candidates], "fsdp2": fsdp2 or {}}
    return {"experiment": "capstone-ladder-2.7b", "device": "2 x NVIDIA H200", "note": note, "conditions": conditions,
            "software": {"torch": note}, "runs": {**runs, "ladder": ladder}}


def test_a_ladder_climbed_in_several_walks_becomes_one_reference(tmp_path):
    oom = {"reason": "the FSDP2 launch failed: OutOfMemoryError"}
    earlier = _reference({"a": {"x": 1}, "b": {"x": 2}}, ["a", "b"], "walk 1", "alone",
                         fsdp2={"measured": True, "latest": oom})
    later = _reference({"b": {"x": 3}, "c": {"x": 4}}, ["a", "b", "c"], "walk 2", "beside chapter 13",
                       fsdp2={"measured": True, "latest": {"reason": capstone.BUDGET_SKIP + "about 9 s needed"}})
    both = capstone.combine_references(earlier, later)
    assert both["runs"] == {"a": {"x": 1}, "b": {"x": 3}, "c": {"x": 4}, "ladder": both["runs"]["ladder"]}
    assert both["runs"]["ladder"]["candidates"] == later["runs"]["ladder"]["candidates"]
    assert both["note"] == "walk 1; walk 2" and both["conditions"] == "alone; beside chapter 13"
    assert both["software"] == later["software"]
    assert both["runs"]["ladder"]["fsdp2"]["latest"] == oom  # walk 2 did not try FSDP2: walk 1's outcome stays
    with pytest.raises(ValueError, match="did not resume the earlier one: 1 earlier"):
        capstone.combine_references(later, earlier)
    with pytest.raises(ValueError, match="does not continue"):
        capstone.combine_references(earlier, {**later, "device": "4 x NVIDIA H200"})

    # --resume takes a ladder file or a committed reference (whose records the new reference carries on)
    (tmp_path / "ladder.json").write_text(json.dumps(earlier["runs"]["ladder"]))
    (tmp_path / "reference.json").write_text(json.dumps(earlier))
    assert capstone.load_resume(tmp_path / "ladder.json") == (earlier["runs"]["ladder"], None)
    assert capstone.load_resume(tmp_path / "reference.json") == (earlier["runs"]["ladder"], earlier)
    (tmp_path / "other.json").write_text(json.dumps({**earlier, "experiment": "zeropp"}))
    with pytest.raises(ValueError, match="not of a capstone ladder"):
        capstone.load_resume(tmp_path / "other.json")


def test_summary_gives_the_spread_of_the_best_setting_over_every_launch_that_trained_it():
    best = dataclasses.asdict(dataclasses.replace(capstone.GPU_BASELINE, micro_batch=16))
    base = {"rung": "batch", "label": "baseline", "run": "r0", "verdict": "baseline", "metric": 400.0, "mfu": 0.40,
            "setting": dataclasses.asdict(capstone.GPU_BASELINE), "comm_exposed_share": 0.05}
    kept = {**base, "label": "micro x2", "run": "r1", "verdict": "kept: +24%", "metric": 494.0, "mfu": 0.499,
            "setting": best, "changes": "micro_batch=16"}
    again = [{**kept, "label": capstone.AGAIN, "run": f"w{i}", "verdict": "best so far, trained again", "mfu": m}
             for i, m in enumerate((0.492, 0.5004))]
    ladder = {"candidates": [base, kept, *again], "best": best, "best_run": "r1", "best_label": "batch: micro x2",
              "device": "2 x NVIDIA H200", "world_size": 2, "params": 10, "target_mfu": 0.5, "fsdp2": {}}
    assert capstone.best_repeats(ladder) == [0.499, 0.492, 0.5004]
    text = capstone.summary(ladder)
    assert "MFU 49.9% (target 50%: not reached)" in text
    assert "in all 3 launches that trained it: MFU 49.20% to 50.04%, median 49.90%; 1 of 3 at or above the target" in text
    assert "launches that trained it" not in capstone.summary({**ladder, "candidates": [base, kept]})


def test_memory_failures_after_other_candidates_of_a_launch_from_before_engines_were_released_count_for_little():
    oom = "rank 0 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 432.00 MiB."
    first = {"rung": "batch", "label": "x2", "run": "0-batch-0-micro-x2", "verdict": "failed: ...", "failure": oom}
    later = {**first, "run": "w4-0-rebatch-2-micro-x2"}
    assert capstone._launch_index(first["run"]) == 0 and capstone._launch_index(later["run"]) == 2
    assert not capstone._may_train_again(first)  # its setting's own memory: seen
    assert capstone._may_train_again(later)  # earlier engines of its launch may have held the memory
    assert not capstone._may_train_again({**later, "engines_released": True})
    ladder = {"device": "2 x NVIDIA H200", "candidates": [first, later, {**later, "engines_released": True}]}
    rows = capstone.ladder_table(ladder).splitlines()[2:5]
    assert [records.UPPER_BOUND + "memory: earlier" in row for row in rows] == [False, True, False]


def _capstone_script():
    """benchmarks/capstone.py as a module (its name would clash with helpers.topics.capstone on sys.path)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "capstone.py"
    spec = importlib.util.spec_from_file_location("capstone_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_combines_references_and_refuses_a_wrong_resume_before_looking_at_gpus(tmp_path, monkeypatch, capsys):
    script = _capstone_script()
    monkeypatch.setattr(script.references, "NEW_REFERENCE_DIR", tmp_path / "reference")
    monkeypatch.setattr(script.environment, "detect", lambda *a: pytest.fail("looked for GPUs before checking --resume"))
    (tmp_path / "other.json").write_text(json.dumps({"experiment": "zeropp", "runs": {}}))
    with pytest.raises(SystemExit) as stop:
        script.main(["--resume", str(tmp_path / "other.json")])
    assert stop.value.code == 2 and "not of a capstone ladder" in capsys.readouterr().err

    base = {"run": "r0", "verdict": "baseline", "metric": 1.0, "mfu": None, "comm_exposed_share": None}
    earlier = _reference({"r0": {"x": 1}}, ["r0"], "walk 1", "alone")
    later = _reference({"r1": {"x": 2}}, ["r0", "r1"], "walk 2", "alone")
    for data in (earlier, later):  # what summary() reads of the ladder: the baseline is the best
        data["runs"]["ladder"].update(candidates=[{**base, **c} for c in data["runs"]["ladder"]["candidates"]],
                                      best_run="r0", device="2 x NVIDIA H200", world_size=2, params=1,
                                      target_mfu=0.5, margin=0.02)
    (tmp_path / "a.json").write_text(json.dumps(earlier))
    (tmp_path / "b.json").write_text(json.dumps(later))
    assert script.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    written = json.loads((tmp_path / "reference" / "b.json").read_text())
    assert set(written["runs"]) == {"r0", "r1", "ladder"} and written["note"] == "walk 1; walk 2"
    assert script.main(["--combine", str(tmp_path / "b.json"), str(tmp_path / "a.json")]) == 2
    assert "did not resume the earlier one" in capsys.readouterr().err
    assert script.main(["--combine", str(tmp_path / "other.json"), str(tmp_path / "a.json")]) == 2
    assert "is not a capstone ladder's reference (it has no 'device')" in capsys.readouterr().err


def test_a_walk_can_start_from_knobs_given_as_text_and_bad_knobs_are_named():
    start = capstone.GPU_BASELINE.with_knobs("micro_batch=16, compile=true, reduce_bucket_size=2e8, optimizer=torch")
    assert (start.micro_batch, start.compile, start.reduce_bucket_size, start.optimizer) == (16, True, 200_000_000, "torch")
    assert start.with_knobs("reduce_bucket_size=none").reduce_bucket_size is None
    assert start.changes_from(capstone.GPU_BASELINE) == \
        "micro_batch=16, reduce_bucket_size=2e8, optimizer=torch, compile=True"
    for text, named in (("micro=16", "knob=value"), ("compile=yes", "compile takes true or false"),
                        ("micro_batch=1.5", "micro_batch takes a whole number"), ("stage=none", "stage takes")):
        with pytest.raises(ValueError, match=named):
            capstone.GPU_BASELINE.with_knobs(text)


def test_the_capstone_script_refuses_a_bad_start_before_anything_runs(capsys):
    import benchmarks.capstone as script

    with pytest.raises(SystemExit):
        script.main(["--start", "micro_batch=many"])
    assert "--start micro_batch='many': micro_batch takes a whole number" in capsys.readouterr().err


def test_a_ladder_that_started_elsewhere_says_from_where_in_its_summary():
    metric = {"metric": 500.0, "mfu": 0.505, "comm_exposed_share": 0.03}
    ladder = {"device": "4 x NVIDIA H200", "world_size": 4, "params": 2_701_560_320, "margin": 0.02,
              "target_mfu": 0.5, "best_run": "b0", "best_label": None, "fsdp2": {},
              "baseline": dataclasses.asdict(capstone.GPU_BASELINE.with_knobs("micro_batch=16,compile=true")),
              "candidates": [{"run": "b0", "verdict": "baseline", **metric},
                             {"run": "b1", "verdict": "baseline", **metric}]}
    text = capstone.summary(ladder)
    assert "the walk started from micro_batch=16, compile=True (--start)" in text
    assert "MFU 50.5% (target 50%: reached)" in text
    ladder["baseline"] = dataclasses.asdict(capstone.GPU_BASELINE)
    assert "started from" not in capstone.summary(ladder)


# --- the chapter's exercises, against the committed GPU ladders ------------------------------------

def test_exercise_mfu_is_the_probes_mfu_from_the_courses_formula():
    ladder = capstone.key_ladder("2.7b", world_size=4)
    c = ladder["candidates"][0]
    shape = performance.config_shape(capstone.model_config("2.7b", seq_len=c["setting"]["seq_len"]))
    flops = performance.flops_per_token(ladder["params"], shape["layers"], shape["hidden"], shape["seq_len"],
                                        shape["lookup_params"])["total"]
    peak, _ = performance.peak_tflops(ladder["device"])
    assert capstone.exercise_mfu(flops * c["tokens_per_s"] / ladder["world_size"] / (peak * 1e12), ladder)
    assert "per cent" in str(capstone.exercise_mfu(50, ladder))
    assert not capstone.exercise_mfu(0.3, ladder)
    assert "to do:" in str(capstone.exercise_mfu(..., ladder))
    # the run it names is the start's first, not "the baseline"; the table's figure is the mean of the two runs
    task = str(capstone.exercise_mfu(..., ladder))
    assert "The first of the start's two runs of the 2.70B ladder on 4 x NVIDIA H200 (micro 16 x accum 2, compiled)" in task
    why = str(capstone.exercise_mfu(c["mfu"], ladder))
    assert "= 496.5 TFLOP/s per GPU" in why and "the mean of the start's two runs, 496.9 TFLOP/s" in why


def test_compile_lines_give_each_kept_compile_gain_and_whether_it_was_the_largest():
    ladders = [e[4] for e in capstone.reference_ladders("1.2b") + capstone.reference_ladders("2.7b")]
    lines = capstone.compile_lines(ladders).splitlines()
    assert len(lines) == 4  # three ladders kept it (1 GPU: skipped; 4 GPUs: started compiled), then the range
    assert lines[2] == ("2.70B on 2 x NVIDIA H200: engine.compile() kept at +14.1%, the largest of the 3 gains that "
                        "ladder kept")
    assert lines[-1] == "engine.compile() gained +14% to +17% where it was tried"
    smaller = copy.deepcopy(ladders[3])
    for c in smaller["candidates"]:
        if c["verdict"].startswith("kept") and c["rung"] != "compile":
            c["verdict"] = "kept: +30.0%"
    assert "not the largest" in capstone.compile_lines([smaller])
    assert capstone.compile_lines([ladders[0]]) == ""  # nothing compiled was kept there


def test_trained_lines_give_one_line_per_run_and_why_one_failed():
    ladder = {"candidates": [
        {"rung": "cpu", "label": "baseline", "verdict": "baseline", "losses": [5.5] * 8},
        {"rung": "cpu", "label": "ZeRO-3", "verdict": "failed: rank 0 failed: OutOfMemoryError", "failure": "x"}],
        "fsdp2": {"measured": True, "runs": {"FSDP2 full": {"losses": [5.5] * 8}}}}
    assert capstone.trained_lines(ladder).splitlines() == [
        "cpu: baseline: 8 steps", "cpu: ZeRO-3: failed: rank 0 failed: OutOfMemoryError", "torchrun: FSDP2 full: 8 steps"]
    ladder["fsdp2"] = {"measured": False, "reason": "time budget: about 9 s needed, 1 s left"}
    assert capstone.trained_lines(ladder).splitlines()[-1] == (
        "torchrun: FSDP2 has no figure (time budget: about 9 s needed, 1 s left)")


def test_exercise_hidden_bound_is_the_shortfalls_bound():
    ladder = capstone.key_ladder("2.7b", world_size=2)
    mfu, exposed = capstone.best_mfu_and_exposed(ladder)
    assert 0 < exposed < 0.5
    assert capstone.exercise_hidden_bound(mfu / (1 - exposed), ladder)
    assert f"{mfu / (1 - exposed):.1%}" in capstone.shortfall(ladder)  # the bound section 5 prints
    assert not capstone.exercise_hidden_bound(mfu + exposed, ladder)  # the share added, not the time divided
    assert not capstone.exercise_hidden_bound(mfu, ladder)
    assert "to do:" in str(capstone.exercise_hidden_bound(..., ladder))


def test_exercise_margin_is_the_walks_recorded_margin_from_its_two_baseline_runs():
    ladder = capstone.key_ladder("1.2b", world_size=1)
    a, b = [c["metric"] for c in ladder["candidates"] if c["verdict"] == "baseline"][:2]
    spread = abs(a - b) / ((a + b) / 2)
    assert spread > capstone.MIN_MARGIN / 2  # the rule's second term decides here, not its floor
    assert capstone.exercise_margin(max(capstone.MIN_MARGIN, 2 * spread), ladder)
    assert not capstone.exercise_margin(spread, ladder)
    assert not capstone.exercise_margin(capstone.MIN_MARGIN, ladder)
    assert "to do:" in str(capstone.exercise_margin(..., ladder))


def _timed(times: list[float]) -> records.Record:
    record = _FakeRecord(1.0)
    record.summary["throughput"].update(all_step_times_s=times, measured_steps=list(range(2, len(times) + 1)))
    return record


def test_timing_check_gives_a_verdict_only_for_a_run_alone_beyond_the_spread():
    setting = capstone.CPU_BASELINE
    ladder = capstone.Ladder("tiny", 1, 2, "cpu", setting, 60.0, candidates=[
        capstone.Candidate("cpu", "baseline", setting, "a", record=_timed([9.0, 1.0, 1.02, 1.01])),
        capstone.Candidate("cpu", "baseline, again", setting, "b", record=_timed([9.0, 1.01, 1.0, 1.02])),
        capstone.Candidate("cpu", "ZeRO-3", setting, "c", record=_timed([9.0, 2.0, 2.02, 2.01]))])
    assert "baseline is faster" in capstone.timing_check(ladder, ALONE)
    assert "the machine was not alone" in capstone.timing_check(ladder, BUSY)
    assert "ZeRO-3, step time (its step trains 1x the baseline's tokens): " in capstone.timing_check(ladder, BUSY)
    assert "baseline, again," not in capstone.timing_check(ladder, BUSY)
    doubled = capstone.Candidate("cpu", "accumulation x2", setting.with_knobs("grad_accum=4"), "d",
                                 record=_timed([9.0, 1.0, 1.03, 1.01]))
    ladder.candidates[2] = doubled
    text = capstone.timing_check(ladder, ALONE)
    assert "accumulation x2, step time (its step trains 2x the baseline's tokens): Withheld: within the steps' spread" \
        in text


def test_timing_check_comments_the_baselines_two_runs_through_the_load_guard():
    setting = capstone.CPU_BASELINE
    ladder = capstone.Ladder("tiny", 1, 2, "cpu", setting, 60.0, spread=0.4, margin=0.8, candidates=[
        capstone.Candidate("cpu", "baseline", setting, "a", record=_timed([9.0, 1.0, 1.01, 1.02])),
        capstone.Candidate("cpu", "baseline, again", setting, "b", record=_timed([9.0, 1.6, 1.61, 1.62]))])
    assert "differ by 40.0% of their mean model FLOP/s, hence the 80.0% margin" in capstone.timing_check(ladder, ALONE)
    assert "1.59x apart with the machine to itself" in capstone.timing_check(ladder, ALONE)
    busy_text = capstone.timing_check(ladder, BUSY)
    assert "withheld" in busy_text and "not DeepSpeed" in busy_text and "apart" not in busy_text


def test_fsdp2_check_compares_fsdp2s_steps_with_deepspeeds_through_the_load_guard(tmp_path, monkeypatch):
    monkeypatch.setattr(capstone.launch, "RUNS_DIR", tmp_path)
    loaded = {"fsdp2-fsdp2": _timed([9.0, 2.0, 2.01, 2.02]), "fsdp2-fsdp2-grad-op": _timed([9.0, 2.1, 2.1, 2.11])}
    monkeypatch.setattr(capstone.records, "load", lambda out: loaded[Path(out).name])
    for name in loaded:
        (tmp_path / "capstone" / name).mkdir(parents=True)
    setting = capstone.CPU_BASELINE
    ladder = capstone.Ladder("tiny", 1, 2, "cpu", setting, 60.0, fsdp2={"measured": True}, candidates=[
        capstone.Candidate("cpu", "baseline", setting, "a", record=_timed([9.0, 1.0, 1.01, 1.02]), verdict="baseline")])
    text = capstone.fsdp2_check(ladder, ALONE)
    assert "DeepSpeed baseline is faster" in text and "same fp32 arithmetic" in text
    assert "Verdict withheld" in capstone.fsdp2_check(ladder, BUSY)
    not_run = dataclasses.replace(ladder, fsdp2={"measured": False, "reason": "time budget: 3 s left"})
    assert capstone.fsdp2_check(not_run, ALONE) == "FSDP2 against DeepSpeed: time budget: 3 s left"


def test_kept_path_names_each_setting_by_what_it_trains_with():
    two = capstone.kept_path(capstone.key_ladder("2.7b", world_size=2))
    assert two.count("kept: +") == 3 and two.count("trained again: ") == 6
    # the same rung label ("accumulation x2" from micro 16 x 1) shows as the setting it trained
    assert "micro 16 x accum 2, compiled        494.2  49.9%           kept: +2.3% over 483.3" in two
    assert "relative" not in two and "x2" not in two and "/2" not in two
    assert "moved by up to 1.9% between launches, against the 2.0% margin" in two  # 471.2 -> 462.1
    assert ("\nends at micro 16 x accum 2, compiled: MFU 49.9%, target 50% not reached, but within the "
            "2.0% margin of it: the noise cannot tell 49.9% from 50%\n") in two
    # which figure "ends at" reads: the kept candidate's own, not its later re-runs (49.2% to 50.0%)
    assert two.endswith("that MFU is its figure when it was kept (494.2 TFLOP/s/GPU); its re-runs measured MFU "
                        "49.2% to 50.0%")
    # a re-run is labelled by the rung whose candidates it judged, not as a rung's own setting
    assert two.count("\nre-run before ") == 6 and "\ncheckpointing " not in two
    assert "\nre-run before checkpointing  micro 16 x accum 2, compiled        495.1  50.0%" in two
    four = capstone.kept_path(capstone.key_ladder("2.7b", world_size=4))
    assert "nothing kept" in four and "target 50% reached, but within the 2.0% margin" in four
    assert four.endswith("that MFU is the mean of its two runs")
    first = capstone.kept_path(capstone.key_ladder("1.2b", world_size=1))
    assert "no candidate trained: only the start, measured twice; the time budget skipped rung compile" in first
    assert "beat the start" not in first  # nothing trained that could have
    ends = next(line for line in first.splitlines() if line.startswith("ends at"))
    assert "target 50% not reached" in ends and "within" not in ends  # 37.8% is far from it


def test_kept_path_prints_the_figures_each_gain_is_computed_from():
    ladder = capstone.key_ladder("2.7b", world_size=2)
    rows = [line for line in capstone.kept_path(ladder).splitlines() if "kept: " in line or "trained again: " in line]
    assert len(rows) == 9
    for line in rows:
        after = float(re.search(r"compiled\s+([\d.]+)", line).group(1))
        gain, before = re.search(r"([+-][\d.]+)% (?:over|from) ([\d.]+)", line).groups()
        assert after / float(before) - 1 == pytest.approx(float(gain) / 100, abs=6e-4)  # printed figures, printed gain


def test_setting_label_is_absolute_and_names_only_what_is_set():
    assert capstone.setting_label(capstone.GPU_BASELINE) == "micro 8 x accum 2"
    two = capstone.GPU_LADDER[2].propose(capstone.GPU_BASELINE.with_knobs("micro_batch=16,grad_accum=1"))
    assert [capstone.setting_label(s) for _, s in two] == ["micro 16 x accum 1, overlap_comm",
                                                            "micro 16 x accum 1, overlap_comm, buckets 2e8"]
    three = capstone.GPU_BASELINE.with_knobs("stage=3,prefetch_bucket_size=2e8,seq_len=4096,compile=true")
    assert capstone.setting_label(three) == "ZeRO-3, micro 8 x accum 2, sequence 4096, prefetch bucket 2e8, compiled"
    assert capstone.setting_label(capstone.CPU_BASELINE, capstone.CPU_BASELINE) == "micro 4 x accum 2"
    assert capstone.setting_label(capstone.CPU_BASELINE) == "micro 4 x accum 2, sequence 64, torch AdamW"


def test_dropped_lines_give_each_rung_once_and_a_failure_only_where_nothing_measured_it():
    lines = capstone.dropped_lines(capstone.key_ladder("2.7b", world_size=2)).splitlines()
    rungs = [line.split(":")[0] for line in lines]
    assert len(rungs) == len(set(rungs)) == 7  # rebatch climbed in three walks: one line
    rebatch = next(line for line in lines if line.startswith("not kept at 'rebatch'"))
    assert rebatch.count("micro 32 x accum 1, compiled out of memory") == 1  # tried twice, shown once
    # the NCCL failure of micro 16 x accum 4: a later walk measured that setting, so only its measurement shows
    assert "DistBackendError" not in "\n".join(lines)
    assert "micro 16 x accum 4, compiled -2.1%" in next(line for line in lines if "'accumulate'" in line)


def test_guarded_withholds_every_rule_verdict_only_where_the_machine_was_shared():
    ladder = {"candidates": [{"verdict": "baseline"}, {"verdict": "kept: +181.2%"},
                             {"verdict": "dropped: -5.0%, not above the 2.0% margin"}, {"verdict": "failed: OOM"}],
              "best_label": "cpu: checkpointing", "rungs": [{"rung": "cpu", "ran": True, "kept": "checkpointing"}]}
    assert capstone.guarded(ladder, ALONE) == ladder
    shown = capstone.guarded(ladder, BUSY)
    assert [c["verdict"] for c in shown["candidates"]] == [
        "baseline", "withheld: the machine was not alone; the rule: +181.2%",
        "withheld: the machine was not alone; the rule: -5.0%", "failed: OOM"]
    assert shown["withheld"] == BUSY.reason() and shown["rungs"][0]["kept"] == capstone.WITHHELD
    assert ladder["candidates"][1]["verdict"] == "kept: +181.2%"  # the walk's own data is left as it was


def test_a_summary_of_a_withheld_ladder_names_no_best_and_no_drop():
    ladder = {"device": "CPU (2 cores)", "world_size": 2, "params": 10, "margin": 1.3, "target_mfu": 0.5,
              "best_run": "b", "best_label": "cpu: x", "fsdp2": {"measured": False, "reason": "not run"},
              "candidates": [{"run": "a", "verdict": "baseline", "metric": 1.0, "mfu": None, "comm_exposed_share": 0.5},
                             {"run": "a2", "verdict": "baseline", "metric": 2.0, "mfu": None, "comm_exposed_share": 0.5},
                             {"run": "b", "verdict": "kept: +50%", "metric": 3.0, "mfu": None, "changes": "x=1",
                              "comm_exposed_share": 0.5}]}
    assert "best: cpu: x" in capstone.summary(ladder)
    text = capstone.summary(capstone.guarded(ladder, BUSY))
    assert "verdicts withheld" in text and "best:" not in text and "no candidate beat" not in text
    assert "1.5 (mean of its two runs)" in text


def test_timing_check_says_when_the_baselines_two_runs_are_far_apart():
    setting = capstone.CPU_BASELINE
    far = capstone.Ladder("tiny", 1, 2, "cpu", setting, 60.0, spread=2 / 3, margin=4 / 3, candidates=[
        capstone.Candidate("cpu", "baseline", setting, "a", record=_timed([9.0, 1.0, 1.01, 1.02])),
        capstone.Candidate("cpu", "baseline, again", setting, "b", record=_timed([9.0, 2.0, 2.01, 2.02]))])
    assert "ran 2.00x faster in one run than in the other" in capstone.timing_check(far, BUSY)
    near = dataclasses.replace(far, spread=0.1, margin=0.2)
    assert "faster in one run" not in capstone.timing_check(near, BUSY)


def test_condensed_blocks_give_the_kept_path_the_rest_by_rung_and_the_takeaway():
    for entry in capstone.reference_ladders("1.2b") + capstone.reference_ladders("2.7b"):
        block = capstone.condensed_block(entry)
        ladder = entry[4]
        assert block.splitlines()[0] == f"{ladder['params'] / 1e9:.2f}B on {entry[0]}, {entry[1]}:"
        assert capstone.kept_path(ladder) in block and block.splitlines()[-1] == capstone.takeaway(ladder)
        assert all(len(line) < 150 for line in block.splitlines()[:-1])  # no failure message, no walk history
    two = capstone.condensed_block(next(e for e in capstone.reference_ladders("2.7b") if e[4]["world_size"] == 2))
    assert len(two.splitlines()) < len(capstone.key_ladder("2.7b", world_size=2)["candidates"])


def test_fsdp2_takeaways_compare_eager_with_eager_and_name_the_out_of_memory_runs():
    ladders = [e[4] for e in capstone.reference_ladders("1.2b") + capstone.reference_ladders("2.7b")]
    text = capstone.fsdp2_takeaways(ladders)
    lines = text.splitlines()
    assert len(lines) == len(ladders) + 1
    two = capstone.fsdp2_takeaway(capstone.key_ladder("2.7b", world_size=2))
    assert "FSDP2 full -2.3%, FSDP2 grad-op -0.3% against DeepSpeed's 413.1" in two  # the baseline's two runs' mean
    assert "not all within the 2.0% margin" in two and "engine.compile() on that batch: 471.2" in two
    assert two.endswith("on the best setting since, FSDP2 ran out of memory (DeepSpeed too ran out of memory at "
                        "micro batch 16 when eager, rung 'batch': FSDP2 runs eagerly)")
    assert capstone.fsdp2_takeaway(capstone.key_ladder("2.7b", world_size=4)).endswith("FSDP2 ran out of memory")
    assert "in 3 of 3 ladders" in lines[-1] and "14% to 16% ahead" in lines[-1]
    assert "(2.70B on 2 GPU(s), 2.70B on 4 GPU(s))" in lines[-1]
    # only the 2-GPU ladder tried that micro batch eagerly (and ran out of memory there)
    assert lines[-1].endswith("a micro batch DeepSpeed fitted only compiled where it tried it eagerly (2.70B on 2 GPU(s)).")


def test_overlap_line_sets_overlap_comm_beside_the_setting_it_started_from():
    two = capstone.overlap_line(capstone.key_ladder("2.7b", world_size=2))
    assert ("micro 16 x accum 1, compiled: without overlap 483.3 model TFLOP/s per GPU, 2.3% of its step exposed "
            "communication; overlap_comm 451.3 (-6.6%)") in two
    assert "slower by more than the 2.0% margin" in two and "not where a step's time went" in two
    assert "peak" not in two
    assert capstone.overlap_line(capstone.key_ladder("2.7b", world_size=4)) is None  # no overlap rung there
    first = next(e[4] for e in capstone.reference_ladders("1.2b") if any(c["rung"] == "overlap" for c in e[4]["candidates"]))
    assert "within the 2.0% margin" in capstone.overlap_line(first)


def test_knobs_names_both_baselines_values():
    line = next(x for x in capstone.knobs().splitlines() if x.startswith("micro_batch:"))
    assert line == (f"micro_batch: int (GPU baseline {capstone.GPU_BASELINE.micro_batch}, "
                    f"CPU baseline {capstone.CPU_BASELINE.micro_batch})")
    assert capstone.GPU_BASELINE.micro_batch != capstone.CPU_BASELINE.micro_batch


def test_warm_up_compares_each_baseline_runs_first_step_with_its_measured_ones():
    setting = capstone.CPU_BASELINE
    slow_first = capstone.Ladder("tiny", 1, 2, "cpu", setting, 60.0, candidates=[
        capstone.Candidate("cpu", "baseline", setting, "a", record=_timed([9.0, 2.0, 2.02, 2.01])),
        capstone.Candidate("cpu", "baseline, again", setting, "b", record=_timed([0.5, 1.01, 1.0, 1.02]))])
    text = capstone.warm_up(slow_first, ALONE)
    assert "first step took 4.5x its measured median, its repeat's 0.5x" in text  # 9 / 2.01 and 0.5 / 1.01
    assert text.endswith("a warm-up beyond them.")
    assert capstone.warm_up(slow_first, BUSY).endswith("warm-up or load.")
    fast_first = dataclasses.replace(slow_first, candidates=slow_first.candidates[::-1])
    assert capstone.warm_up(fast_first, BUSY).endswith("show no warm-up beyond them.")
    assert "not measured twice" in capstone.warm_up(dataclasses.replace(slow_first, candidates=slow_first.candidates[:1]), ALONE)


def test_each_committed_ladder_ends_with_its_takeaway_from_its_data():
    four = capstone.key_ladder("2.7b", world_size=4)
    line = capstone.takeaway(four)
    assert line.startswith("Takeaway: nothing kept: no candidate beat the start") and "target 50% reached, but within" in line
    one = capstone.takeaway(capstone.key_ladder("1.2b", world_size=1))
    assert one.startswith("Takeaway: no candidate trained: only the start, measured twice; the time budget skipped "
                          "rung compile;") and "rungs the time budget skipped" not in one
    two = capstone.takeaway(capstone.key_ladder("2.7b", world_size=2))
    assert "kept at rungs compile, rebatch, rebatch, ending at micro 16 x accum 2, compiled" in two
    assert "target 50% not reached, but within the 2.0% margin" in two
    for entry in capstone.reference_ladders("1.2b") + capstone.reference_ladders("2.7b"):
        block = capstone.reference_block(entry)
        assert block.startswith(f"{entry[4]['params'] / 1e9:.2f}B parameters, measured on {entry[0]}")
        assert (capstone.PEAK_NOTE in block) == capstone.marks_peaks(entry[4])  # the note once, where peaks are marked
        assert block.splitlines()[-1] == capstone.takeaway(entry[4]) and entry[3] not in block


def test_knobs_lists_every_field_with_knobs_accepts():
    listed = [line.split(":")[0] for line in capstone.knobs().splitlines()]
    assert listed == [f.name for f in dataclasses.fields(capstone.Setting)]
    for name in listed:
        with pytest.raises(ValueError, match=name):
            capstone.GPU_BASELINE.with_knobs(f"{name}=")  # each is a knob: the error names what it takes


def test_failures_are_shown_without_a_cut_word_and_the_peak_note_once():
    cut = ("rank 0 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 320.00 MiB. GPU 0 has a total "
           "capacity of 139.80 GiB of which 303.06 MiB is free. Includi")
    assert capstone.whole_sentences(cut).endswith("303.06 MiB is free.")
    nccl = "rank 0 failed: DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3780, unhandled cuda error (run with " \
           "NCCL_DEBUG=INFO for details), NCCL version 2.27.5 ncclUnhandledCudaError: Call to CUDA function f"
    assert capstone.whole_sentences(nccl).endswith("to CUDA function ...")
    assert capstone.whole_sentences("failed: OOM") == "failed: OOM"
    ladder = capstone.key_ladder("2.7b", world_size=2)
    assert capstone.marks_peaks(ladder) and records.PEAK_NOTE not in capstone.ladder_table(ladder)
    assert records.UPPER_BOUND in capstone.ladder_table(ladder) and "Includi" not in capstone.ladder_table(ladder)
    assert not capstone.marks_peaks(capstone.key_ladder("2.7b", world_size=4))


def test_page_code_names_the_chapter_modules_initialize_and_train_step(tmp_path, monkeypatch):
    from helpers.core import environment

    monkeypatch.setattr(environment, "REPO_ROOT", tmp_path)
    path = tmp_path / "runs" / "16" / "capstone_rank.py"
    assert capstone.page_code(path) == ("runs.16.capstone_rank:initialize", "runs.16.capstone_rank:train_step")


def test_every_candidates_spec_names_the_pages_initialize_and_step(monkeypatch):
    seen = []
    monkeypatch.setattr(capstone.launch, "sweep_retrying", lambda specs, **kw: seen.extend(specs) or ({}, []))
    pairs = [("baseline", capstone.CPU_BASELINE), *capstone.CPU_LADDER[0].propose(capstone.CPU_BASELINE)]
    found = capstone._launch_rung(0, capstone.CPU_LADDER[0], pairs, "tiny", 2, 2, "t", 60.0,
                                  trainer="runs.16.capstone_rank:train_step",
                                  initialize="runs.16.capstone_rank:initialize")
    assert len(seen) == len(found) == 4
    assert {(s.builder, s.initialize, s.trainer) for s in seen} == {
        (capstone.BUILDER, "runs.16.capstone_rank:initialize", "runs.16.capstone_rank:train_step")}


def test_initialize_compiles_the_engine_only_for_a_compiled_candidate(monkeypatch):
    import types

    import deepspeed
    import torch

    compiled = []
    engine = types.SimpleNamespace(compile=lambda: compiled.append(True))
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: (engine, None, None, None))
    for setting in (capstone.CPU_BASELINE, capstone.CPU_BASELINE.with_knobs("compile=true")):
        run = types.SimpleNamespace(model_options=setting.model_options("tiny"))
        assert capstone.initialize(torch.nn.Linear(1, 1), {}, run) is engine
    assert compiled == [True]


def test_takeaway_table_has_one_row_per_ladder_from_its_data():
    ladders = [e[4] for e in capstone.reference_ladders("1.2b") + capstone.reference_ladders("2.7b")]
    table = capstone.takeaway_table(ladders).splitlines()
    assert len(table) == 2 + len(ladders) and "FSDP2 OOM?" in table[0]
    four = capstone.key_ladder("2.7b", world_size=4)
    row = next(r for r in table if r.startswith("2.70B on 4 GPU(s)"))
    mfu, exposed = capstone.best_mfu_and_exposed(four)
    assert f"{mfu:.1%}" in row and f"{exposed:.1%}" in row and row.endswith("yes")
    assert capstone.fsdp2_eager_gap(four) is None
    two = capstone.key_ladder("2.7b", world_size=2)
    assert capstone.fsdp2_eager_gap(two) == pytest.approx(-0.003, abs=0.0005)


def test_rung_order_lists_the_rungs_a_walk_ran_and_those_it_never_ran():
    ladder = {"rungs": [{"rung": "batch", "ran": True}, {"rung": "compile", "ran": True},
                        {"rung": "overlap", "ran": False}]}
    line = capstone.rung_order(ladder)
    assert line.startswith("rungs in the order this walk ran them: batch, compile; never run: stage, overlap")
