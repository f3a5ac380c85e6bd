"""helpers.topics.zero: gradient reductions and what a rank sends for them, what a chapter script saves of the model
built with and without ``deepspeed.zero.Init`` and the tables that read it, the sentences about GPU runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.core import load_guard, records, theory
from helpers.topics import zero
from test_records import minimal_summary


def _record(by_caller: dict, world_size: int = 2, **changes) -> records.Record:
    summary = {**minimal_summary(), **changes, "world_size": world_size}
    summary["comm"] = {**summary["comm"], "by_caller": by_caller}
    return records.Record(summary)


# --- gradient reductions ---------------------------------------------------------------------------

def test_a_rank_sends_a_ring_all_reduce_twice_over_and_a_reduce_per_owner_once():
    # ring all_reduce: 2(n-1)/n of the tensor; one reduce per owner: the (n-1)/n a rank does not own
    assert zero.gradient_sent_bytes("all_reduce", 1000, 2) == 1000
    assert zero.gradient_sent_bytes("all_reduce", 1000, 4) == 1500
    assert zero.gradient_sent_bytes("reduce", 1000, 2) == 500
    assert zero.gradient_sent_bytes("reduce", 1000, 4) == 750


def test_reduction_table_leaves_out_the_norm_and_the_parameter_gather():
    default = _record({"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": 4000.0},
                                      "get_grad_norm_direct": {"count": 1.0, "bytes": 4.0}},
                       "all_gather_into_tensor": {"all_gather_into_tensor_dp_groups": {"count": 1.0, "bytes": 2000.0}}})
    owners = _record({"reduce": {"allreduce_bucket": {"count": 2.0, "bytes": 4000.0}},
                      "all_reduce": {"get_grad_norm_direct": {"count": 1.0, "bytes": 4.0}}})
    rows = zero.reduction_table({"defaults": default, "owners": owners}).splitlines()[2:]
    assert len(rows) == 2, rows
    assert rows[0].split() == ["defaults", "all_reduce", "(allreduce_bucket)", "1", "4,000", "4,000"]
    assert rows[1].split() == ["owners", "reduce", "(allreduce_bucket)", "2", "4,000", "2,000"]
    assert zero.gradient_calls(owners) == 2 and zero.gradient_bytes(owners) == 4000


def test_knob_agreement_names_the_setting_that_differs():
    base = records.Record(minimal_summary())
    other = records.Record({**minimal_summary(), "losses": [1.0, 0.7]})
    assert zero.knob_agreement({"defaults": base, "same": records.Record(minimal_summary())}) == \
        "losses of every setting against defaults: within 1e-06"
    differing = zero.knob_agreement({"defaults": base, "other": other})
    assert differing == "other against defaults: differ by more than 1e-06"


def test_deepspeed_defaults_are_read_from_its_config_model():
    assert zero.zero_default("reduce_bucket_size") == 500_000_000
    assert zero.zero_default("use_multi_rank_bucket_allreduce") is True
    assert zero.zero_default("stage3_param_persistence_threshold") == 100_000  # by its alias
    with pytest.raises(KeyError, match="no key 'bucket'"):
        zero.zero_default("bucket")


# --- GPU references read into sentences ----------------------------------------------------------

def _timed(times_ms: list[float], calls: float, peak: int) -> records.Record:
    summary = minimal_summary()
    summary["step_time_s"] = {"median": sorted(times_ms)[len(times_ms) // 2] / 1000,
                              "all": [t / 1000 for t in times_ms]}
    summary["comm"]["by_op"] = {"all_reduce": {"count": calls, "bytes": 4000.0}}
    summary["memory"]["peak_bytes_per_rank"] = [peak, peak]
    return records.Record(summary)


def test_peak_contrast_leaves_the_step_times_out_when_asked(monkeypatch):
    runs = {"defaults": _timed([900, 12, 12], 3, 2 * 2**30), "small": _timed([900, 19, 19], 10, 70 * 2**20)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", runs))
    timed = zero.peak_contrast("x", "defaults", "small")
    assert "median step 19.0 ms against 12.0 ms" in timed and timed.endswith("(10 collective calls per step against 3).")
    untimed = zero.peak_contrast("x", "defaults", "small", times=False)
    assert " ms " not in untimed
    assert untimed.startswith("On 2 x GPU (the committed reference), small: peak 70 MiB per rank against 2 GiB")
    assert untimed.endswith("apart; 10 collective calls per step against 3).")


def _on(device: str, record: records.Record) -> records.Record:
    record.summary.update(device=device, device_name=f"2 x {device.upper()} box")
    return record


def test_gpu_sentences_comment_the_chapters_own_gpu_run_before_the_reference(monkeypatch):
    reference = {"defaults": _timed([900, 12, 12], 3, 2 * 2**30), "small": _timed([900, 19, 19], 10, 70 * 2**20)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", reference))
    on_gpu = {"defaults": _on("cuda", _timed([900, 12, 12], 3, 4 * 2**30)),
              "small": _on("cuda", _timed([900, 19, 19], 10, 2**30))}
    on_cpu = {name: _on("cpu", _timed([900, 12, 12], 3, 2**20)) for name in ("defaults", "small")}
    assert zero.gpu_runs("x", on_gpu) == ("this launch on 2 x CUDA box", on_gpu)
    assert zero.gpu_runs("x", on_cpu) == ("2 x GPU (the committed reference)", reference)
    assert zero.gpu_runs("x") == ("2 x GPU (the committed reference)", reference)
    own = zero.peak_contrast("x", "defaults", "small", times=False, measured=on_gpu)
    assert own.startswith("On this launch on 2 x CUDA box, small: peak 1 GiB per rank against 4 GiB")


def test_chapter_05s_reference_reads_its_old_base_name_as_course_base():
    device, runs = zero.latest_reference("zero3-knobs")
    assert "course-base" in runs and "defaults" not in runs
    assert runs["course-base"].summary["config"]["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert zero.current_names("zero1-knobs", {"defaults": 1}) == {"defaults": 1}  # other chapters keep theirs
    assert "course-base " in zero.reference_report("zero3-knobs", wire=True)


def test_calls_and_times_note_reads_the_reference_without_the_first_step(monkeypatch):
    runs = {"base": _timed([900, 12, 14], 3, 1), "small": _timed([900, 19, 21], 10, 1)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", runs))
    note = zero.calls_and_times_note("x", "base")
    assert note.startswith("On 2 x GPU (the committed reference), collective calls per step and median step time")
    assert "base 3 calls, 13.0 ms; small 10 calls, 20.0 ms." in note and "not a verdict" in note


def test_knob_table_warm_step_times_leave_the_first_step_out():
    runs = {"base": _timed([900, 12, 14], 3, 1)}
    assert zero.knob_table(runs, timings=True).splitlines()[-1].endswith("14.0")  # the record's median, of all three steps
    warm = zero.knob_table(runs, timings=True, warm=True)
    assert "step ms (median after step 1)" in warm and warm.splitlines()[-1].endswith("13.0")


def test_not_in_reference_names_the_settings_without_a_gpu_row():
    assert "no GPU row for it" in zero.not_in_reference("zero1-knobs", ["defaults", "no-such-setting"])
    assert "no-such-setting" in zero.not_in_reference("zero1-knobs", ["defaults", "no-such-setting"])
    assert zero.not_in_reference("zero1-knobs", ["defaults"]).endswith("a run for every setting above.")


# --- chapter 03's script: its records, the bytes, the step-time verdict ------------------------------

def _named(name: str, **changes) -> dict:
    return {**minimal_summary(), "name": name, **changes}


def test_chapter_records_sorts_baselines_from_settings_and_leaves_out_older_runs(tmp_path):
    import json
    import os
    import time

    def write(name: str, mtime: float) -> None:
        (tmp_path / name).mkdir()
        path = tmp_path / name / "summary.json"
        path.write_text(json.dumps(_named(name)))
        os.utime(path, (mtime, mtime))

    now = time.time()
    write("zero1-renamed-knob", now - 100)  # from an earlier launch
    for i, name in enumerate(["zero0-fp32", "zero1-fp32", "zero1-defaults", "zero1-small", "zero1-defaults-again"]):
        write(name, now + i)
    runs, settings = zero.chapter_records(tmp_path, since=now - 1, precisions=("fp32",))
    assert list(runs) == [(0, "fp32"), (1, "fp32")]
    assert list(settings) == ["defaults", "small", "defaults-again"]  # in the order they trained
    with pytest.raises(FileNotFoundError, match="did the script run"):
        zero.chapter_records(tmp_path, since=now + 100)


def test_logged_table_shows_what_the_logger_recorded_and_wire_note_what_a_rank_sends():
    by_caller = {"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": 4000.0}},
                 "all_gather_into_tensor": {"all_gather_into_tensor_dp_groups": {"count": 1.0, "bytes": 1000.0}}}
    four = _record(by_caller)
    four.summary["world_size"] = 4  # after validation, which would want 4 ranks' states
    four.summary["comm"].update(bytes_per_step=5000.0, wire_bytes_per_step=9000.0)
    rows = zero.logged_table([four]).splitlines()[2:]
    assert rows[0].split()[-1] == "4,000" and rows[1].split()[-1] == "1,000"  # logged, not sent
    assert rows[-1].split()[-1] == "5,000"
    note = zero.wire_note([four])
    # 4 ranks: an all_reduce sends 2(n-1)/n = 1.5 of its tensor, an all-gather its shard to 3 others
    assert "1.50x an all_reduce's" in note and "3.00x an all-gather's" in note and "9,000" in note


def _steps(times_ms: list[float]) -> records.Record:
    return _timed([1000.0, *times_ms], 2, 1)  # the first step warms up and is left out


def test_timing_verdict_needs_the_devices_alone_a_steady_repeat_and_a_clear_difference():
    settings = {"defaults": _steps([20, 21, 22]), "fast": _steps([10, 11, 12]), "close": _steps([19, 21, 23])}
    alone = load_guard.Load("cpu", 0, 0.01, 2, 30.0, 60, "test")
    busy = load_guard.Load("cpu", 3, 0.40, 2, 30.0, 60, "test")
    verdict = zero.timing_verdict(settings, _steps([21, 21, 21]), alone)
    assert "fast: fast is faster" in verdict
    assert "close: Verdict withheld: the difference" in verdict
    withheld = zero.timing_verdict(settings, _steps([21, 21, 21]), busy)
    assert "used 40% of the 2 cores' time" in withheld and "is faster" not in withheld
    drifted = zero.timing_verdict(settings, _steps([15, 15, 15]), alone)
    assert "the machine changed during the sweep" in drifted and "is faster" not in drifted


def test_merged_timing_verdicts_say_one_shared_reason_once_and_keep_every_median():
    settings = {"defaults": _steps([20, 21, 22]), "fast": _steps([10, 11, 12]), "close": _steps([19, 21, 23])}
    alone = load_guard.Load("cpu", 0, 0.01, 2, 30.0, 60, "test")
    busy = load_guard.Load("cpu", 3, 0.40, 2, 30.0, 60, "test")
    merged = zero.timing_verdict(settings, _steps([21, 21, 21]), busy, merge=True)
    assert merged.count("used 40% of the 2 cores' time") == 1 and "\n" not in merged
    assert merged.startswith("Step-time verdicts withheld for all 2 settings against defaults:")
    assert merged.endswith("(medians without each run's first step: defaults 21 ms, fast 11 ms, close 21 ms).")
    # a verdict given, or reasons that differ, keep one line per setting
    assert zero.timing_verdict(settings, _steps([21, 21, 21]), alone, merge=True) == \
        zero.timing_verdict(settings, _steps([21, 21, 21]), alone)


# --- building the model: the meter, the builder's checks, the estimate -----------------------------

def test_the_meter_counts_what_parameters_hold_at_their_highest():
    def partition(module: nn.Module, world: int = 2) -> None:  # what zero.Init does as a module's __init__ ends
        for p in module.parameters():
            p.ds_tensor = p.data.view(-1)[: p.numel() // world].clone()
            p.data = torch.empty(0)

    with zero.parameter_bytes_meter() as meter:
        first = nn.Linear(4, 4)  # 16 + 4 floats: 80 bytes
        partition(first)  # 40 bytes left
        second = nn.Linear(4, 4)  # 40 + 80 at its bias's registration
        partition(second)
    assert meter["peak"] == 120
    assert sum(zero._held_bytes(p) for m in (first, second) for p in m.parameters()) == 80
    with zero.parameter_bytes_meter() as whole:
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert whole["peak"] == 160
    with zero.parameter_bytes_meter() as none:
        pass
    assert none["peak"] == 0


def test_construction_estimate_by_hand():
    # 1,000 parameters on 4 ranks in fp32, largest module 100: whole 4,000 bytes; shards 1,000 + 100 x 4 x 3/4
    assert zero.construction_estimate(1000, 4, 100, 4) == (4000, 1300)
    table = zero.construction_estimate_table(8_000_000_000, 8, 1_000_000_000).splitlines()
    assert table[2].split() == ["fp32", "32.0", "256.0", "7.50", "60.0"]


# --- the model built inside zero.Init: what the script saves and the tables read -----------------------

def _partition(module: nn.Module, world: int = 2) -> None:
    """What zero.Init leaves of a module's parameters on one rank: an empty tensor and a shard of 1/world."""
    for p in module.parameters():
        p.ds_numel = p.numel()
        p.ds_tensor = p.data.view(-1)[: p.numel() // world].clone()
        p.data = torch.empty(0)


def _gathered(digest: str) -> dict:
    return {"shape_outside": [0], "shape_inside": [4, 4], "shard_elements": 8, "digest": digest,
            "change_kept_without_modifier_rank": False, "change_kept_with_modifier_rank": True, "restored": True}


def test_save_construction_keeps_each_ranks_findings_beside_the_record(tmp_path):
    whole = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # 20 + 10 floats; the largest module 80 bytes
    for rank in range(2):
        zero.save_construction(tmp_path / "plain", rank, "plain", whole, 120, {"digest": "a"})
    partitioned = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    _partition(partitioned)
    for rank in range(2):
        zero.save_construction(tmp_path / "init", rank, "zero.Init", partitioned, 100, _gathered("a"))
    plain_run = records.Record(minimal_summary(), tmp_path / "plain")
    init_run = records.Record(minimal_summary(), tmp_path / "init")
    assert zero.construction(plain_run) == {"init": "plain", "peak_bytes": 120, "held_bytes": 120, "full_bytes": 120,
                                            "largest_module_bytes": 80, "gathered": {"digest": "a"}}
    found = zero.construction(init_run, rank=1)
    assert (found["held_bytes"], found["full_bytes"], found["largest_module_bytes"]) == (60, 120, 80)
    (tmp_path / "init" / "construction-rank1.json").unlink()
    with pytest.raises(FileNotFoundError, match="construction-rank1.json"):
        zero.construction(records.Record(minimal_summary(), tmp_path / "init"))


def _built(peak: int, digest: str = "a", device: str = "cpu", losses: list | None = None) -> dict:
    per_rank = [{"init": "zero.Init", "full_bytes": 2000, "peak_bytes": peak, "held_bytes": 1000,
                 "largest_module_bytes": 200, "gathered": _gathered(digest)} for _ in range(2)]
    init = records.Record({**minimal_summary(), "construction": {"init": "zero.Init", "per_rank": per_rank}})
    plain = records.Record({**minimal_summary(), "construction": {"init": "plain", "per_rank": [
        {"init": "plain", "full_bytes": 2000, "peak_bytes": 2000, "held_bytes": 2000, "largest_module_bytes": 200,
         "gathered": {"shape_outside": [4, 4], "digest": "a"}}] * 2}})
    init.summary["device"] = device
    if losses is not None:
        init.summary["losses"] = losses
    return {"plain": plain, "zero.Init": init}


def test_construction_tables_read_the_shards_plus_the_module_being_built():
    built = _built(1100)  # shards 1000 + the largest module 200 whole - its own shard 100
    rows = zero.construction_table(built).splitlines()[2:]
    assert rows[0].split()[-1] == "yes" and "1,100 (0.55)" in rows[1] and "1,000 (0.50)" in rows[1]
    assert zero.construction_check(built["zero.Init"]).endswith("= 1,100: as measured")
    assert zero.construction_check(_built(1200)["zero.Init"]).endswith("= 1,100: measured 1,200")
    report = zero.gathered_report(built)
    assert report.count("identical to the tensor built whole") == 2
    assert "GatheredParameters(p): lost" in report and "modifier_rank=0): kept" in report
    assert "DIFFERENT from" in zero.gathered_report(_built(1100, digest="b"))


def test_init_weights_note_says_why_the_weights_differ_only_where_they_do_on_gpus():
    same = zero.init_weights_note(_built(1100))
    assert same.startswith("On these cpu ranks: the first weight built inside zero.Init is identical")
    assert "CUDA generator" not in same
    gpu = zero.init_weights_note(_built(1100, digest="b", device="cuda", losses=[1.0, 0.7]))
    assert "is different from the one built whole; losses differ" in gpu
    assert "torch.manual_seed seeds it as well, but its random stream is not the CPU's" in gpu
    assert "CUDA generator" not in zero.init_weights_note(_built(1100, digest="b", device="cpu"))


# --- exercises ----------------------------------------------------------------------------------------------

MLP = zero.model_parameter_sizes("mlp")  # 8 x (65,536 + 256)


def _knob(calls: float, zero_block: dict, params: int | None = None) -> records.Record:
    run = _record({"all_reduce": {"allreduce_bucket": {"count": calls, "bytes": 4000.0}}})
    run.summary["config"] = {"zero_optimization": zero_block}
    if params is not None:
        run.summary["memory"]["model_states_bytes_per_rank"][0] = {**run.states(0), "params": params}
    return run


def test_bucket_calls_follow_deepspeeds_fill_then_send_rule():
    assert zero.bucket_calls(MLP, 500_000_000) == 1
    assert zero.bucket_calls(MLP, 100_000) == 8  # one layer per bucket, as the chapter's 1e5 run measured
    assert zero.bucket_calls(MLP, 150_000) == 4


def test_bucket_exercise_right_wrong_blank_and_a_rule_the_runs_contradict():
    knobs = {"defaults": _knob(1, {"stage": 1}), "reduce_bucket_size=1e5": _knob(8, {"reduce_bucket_size": 100_000})}
    assert zero.exercise_bucket_for_calls({"stage": 1, "reduce_bucket_size": 150_000}, knobs)
    assert "3 gradient reduction" in str(zero.exercise_bucket_for_calls({"reduce_bucket_size": 200_000}, knobs))
    assert "at least the largest" in str(zero.exercise_bucket_for_calls({"reduce_bucket_size": 10}, knobs))
    assert not zero.exercise_bucket_for_calls(..., knobs).answered
    wrong = {**knobs, "reduce_bucket_size=1e5": _knob(5, {"reduce_bucket_size": 100_000})}
    assert "does not reproduce" in str(zero.exercise_bucket_for_calls({"reduce_bucket_size": 150_000}, wrong))


def test_state_and_wire_bytes_are_the_records():
    run = _record({"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": 4000.0}}})
    assert zero.exercise_state_bytes(12_000, run) and not zero.exercise_state_bytes(12_512, run)  # buffers left out
    assert zero.exercise_wire_bytes(6000, run) and not zero.exercise_wire_bytes(8000, run)
    assert not zero.exercise_state_bytes(..., run).answered and not zero.exercise_wire_bytes(..., run).answered


def test_stage2_bytes_scale_the_gradient_part_with_the_micro_steps():
    run = _record({"all_reduce": {"allreduce_bucket": {"count": 2.0, "bytes": 4000.0},
                                  "get_grad_norm_direct": {"count": 1.0, "bytes": 4.0}},
                   "all_gather_into_tensor": {"all_gather_into_tensor_dp_groups": {"count": 1.0, "bytes": 1000.0}}},
                  grad_accum=2, train_batch=16)
    run.summary["comm"]["wire_bytes_per_step"] = 5004.0  # 4000 gradients + 1000 gather + 4 norm, on 2 ranks
    assert zero.stage2_wire_bytes_at(run, 4) == 9004.0
    assert zero.exercise_stage2_bytes(9004, {(2, "fp32"): run}, 4)
    assert not zero.exercise_stage2_bytes(5004, {(2, "fp32"): run}, 4)
    assert not zero.exercise_stage2_bytes(..., {(2, "fp32"): run}).answered


def test_overlap_buckets_counts_two_buckets_and_deepspeeds_defaults():
    assert zero.bucket_bytes({"overlap_comm": True, "reduce_bucket_size": 10}) == 80
    assert zero.bucket_bytes({"contiguous_gradients": False}) == 0
    assert zero.exercise_overlap_buckets({"stage": 2, "overlap_comm": True, "reduce_bucket_size": 12_500_000})
    assert "4,000,000,000" in str(zero.exercise_overlap_buckets({"stage": 2, "overlap_comm": True}))
    assert not zero.exercise_overlap_buckets({"stage": 2, "reduce_bucket_size": 12_500_000})  # overlap off
    assert not zero.exercise_overlap_buckets(...).answered


def test_overlap_peak_is_the_gpu_runs_peak_within_2_percent():
    gpu = {"defaults": _on("cuda", _timed([900, 12, 12], 3, 2_000_000_000)),
           "overlap_comm=true": _on("cuda", _timed([900, 12, 12], 3, 4_000_000_000))}
    assert zero.exercise_overlap_peak(3_950_000_000, measured=gpu)
    assert not zero.exercise_overlap_peak(2_000_000_000, measured=gpu)
    assert "1.00 times one bucket of 500,000,000 fp32 elements" in str(zero.exercise_overlap_peak(4e9, measured=gpu))
    assert not zero.exercise_overlap_peak(..., measured=gpu).answered
    # the committed reference, where the chapter ran on a CPU: overlap_comm raised the peak by one bucket there too
    reference = zero.latest_reference("zero2-knobs")[1]
    assert zero.exercise_overlap_peak(reference["defaults"].memory.peak(0) + 2e9)


def test_persistence_rule_keeps_small_parameters_whole_besides_every_shard():
    shards = sum(MLP) // 2 * 4
    assert zero.persistent_param_bytes(MLP, 0, 2) == shards
    assert zero.persistent_param_bytes(MLP, 100_000, 2) == shards + sum(MLP) * 4
    knobs = {"course-base": _knob(1, {"stage3_param_persistence_threshold": 0}, params=shards),
             "persistence_threshold=1e5": _knob(1, {"stage3_param_persistence_threshold": 100_000},
                                                params=shards + sum(MLP) * 4)}
    assert zero.exercise_persistence({"stage": 3, "stage3_param_persistence_threshold": 1000}, knobs)
    assert not zero.exercise_persistence({"stage3_param_persistence_threshold": 100_000}, knobs)
    assert not zero.exercise_persistence(..., knobs).answered
    # every knob run is checked against the rule, whatever its name
    wrong = {**knobs, "prefetch": _knob(1, {"stage3_param_persistence_threshold": 0}, params=shards + 4)}
    assert "does not reproduce the measured run 'prefetch'" in str(
        zero.exercise_persistence({"stage": 3, "stage3_param_persistence_threshold": 1000}, wrong))


def test_init_peak_is_the_construction_probes():
    run = _record({})
    run.summary["construction"] = {"init": "zero.Init", "per_rank": [
        {"full_bytes": 2000, "peak_bytes": 1100, "held_bytes": 1000, "largest_module_bytes": 200}]}
    assert zero.exercise_init_peak(1100, {"zero.Init": run}) and not zero.exercise_init_peak(2000, {"zero.Init": run})
    assert f"Ψ = {run.params:,} parameters" in str(zero.exercise_init_peak(..., {"zero.Init": run}))
    assert not zero.exercise_init_peak(..., {"zero.Init": run}).answered


def test_bucket_rule_counts_a_reduce_per_owner_when_multi_rank_allreduce_is_off():
    knobs = {"defaults": _knob(1, {"stage": 1}),
             "use_multi_rank_bucket_allreduce=false": _knob(2, {"use_multi_rank_bucket_allreduce": False})}
    assert zero.exercise_bucket_for_calls({"stage": 1, "reduce_bucket_size": 150_000}, knobs)
    assert not zero.exercise_bucket_for_calls({"reduce_bucket_size": 150_000, "use_multi_rank_bucket_allreduce": False}, knobs)


# --- chapter 03: the paper beside the measurements -----------------------------------------------------

def _states(params: int, grads: int, optimizer: int, master: int, stage: int) -> records.Record:
    """A fp32 run on 2 ranks whose rank 0 measured these bytes; the paper's count is theory's for ``stage``."""
    states = {"params": params, "grads": grads, "optimizer": optimizer, "master": master, "buffers": 999}
    summary = {**minimal_summary(), "zero_stage": stage}
    summary["memory"] = {**summary["memory"], "model_states_bytes_per_rank": [dict(states), dict(states)]}
    summary["theory"] = {**summary["theory"], "model_states_bytes_per_rank": theory.model_state_bytes(1000, stage, 2, "fp32")}
    return records.Record(summary)


def test_comparison_table_sets_the_papers_ratio_beside_each_measured_one():
    stage0 = _states(4000, 4000, 8000, 0, stage=0)
    stage1 = _states(4000, 4000, 4000, 2000, stage=1)  # DeepSpeed's fp32 master copy of the slice
    rows = {line.split("  ")[0]: line.split()[-2:] for line in
            zero.comparison_table(stage1, {"stage 0": stage0}, paper=True).splitlines()[2:]}
    assert rows["model states per rank"] == ["0.88x", "0.75x"]  # 14,000 / 16,000 measured; 12 / 16 by the paper
    assert rows["Adam states per rank"] == ["0.50x", "0.50x"]
    assert "paper" not in zero.comparison_table(stage1, {"stage 0": stage0}).splitlines()[0]


def test_master_note_puts_the_gap_on_the_master_copy_only_where_it_closes_it():
    stage0 = _states(4000, 4000, 8000, 0, stage=0)
    note = zero.master_note(_states(4000, 4000, 4000, 2000, stage=1), stage0)
    assert "measured 0.875x, the paper's formula 0.750x" in note and "without the master copies the ratio is 0.750x" in note
    other = zero.master_note(_states(4000, 4000, 6000, 0, stage=1), stage0)  # a gap the master copy does not explain
    assert "The gap is the master copy" not in other


def test_bucket_note_counts_gradient_bytes_and_names_the_other_calls():
    base = _record({"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": 4000.0},
                                   "get_grad_norm_direct": {"count": 1.0, "bytes": 4.0}},
                    "all_gather_into_tensor": {"all_gather_into_tensor_dp_groups": {"count": 1.0, "bytes": 2000.0}}})
    small = _record({"all_reduce": {"allreduce_bucket": {"count": 8.0, "bytes": 4000.0},
                                    "get_grad_norm_direct": {"count": 1.0, "bytes": 4.0}},
                     "all_gather_into_tensor": {"all_gather_into_tensor_dp_groups": {"count": 1.0, "bytes": 2000.0}}})
    for run in (base, small):  # the logger's totals per collective, as a record holds them beside by_caller
        run.summary["comm"]["by_op"] = {op: {"count": sum(row["count"] for row in callers.values()),
                                             "bytes": sum(row["bytes"] for row in callers.values())}
                                        for op, callers in run.summary["comm"]["by_caller"].items()}
    note = zero.bucket_note(base, small, "small")
    assert "1 call(s) against 8" in note and "(4,000 against 4,000)" in note and "add 2 more per step" in note


def test_scaled_out_table_keeps_the_stages_asked_for():
    table = zero.scaled_out_table(7.5e9, 64, stages=(0, 1), estimator=False).splitlines()
    assert [line.split()[:3] for line in table[2:]] == [["stage", "0", "120.0"], ["stage", "1", "31.4"]]
    assert "estimator" not in table[0] and "estimator" in zero.scaled_out_table(7.5e9, 64).splitlines()[0]
    gib = zero.scaled_out_table(7.5e9, 64, unit="GiB").splitlines()
    assert gib[0].split()[:3] == ["ZeRO", "paper", "GiB/device"] and "estimator GiB/device" in gib[0]
    assert gib[2].split()[2] == f"{16 * 7.5e9 / 2**30:.1f}" == "111.8"  # the paper's 120 GB, in GiB
    with pytest.raises(KeyError):
        zero.scaled_out_table(7.5e9, 64, unit="TB")


def test_knob_table_heads_the_logged_bytes_as_told():
    runs = {"defaults": _timed([900, 12, 12], 3, 2**30)}
    assert zero.knob_table(runs).splitlines()[0].split()[4] == "bytes/step"
    header = zero.knob_table(runs, bytes_label="logged bytes/step").splitlines()[0]
    assert "logged bytes/step" in header and header.index("logged") < header.index("buffers")


def test_reduction_table_heads_the_computed_column_as_told():
    run = _record({"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": 4000.0}}})
    assert "computed" in zero.reduction_table({"defaults": run}, sent_label="sent (computed)").splitlines()[0]


def test_bucket_sizes_for_calls_is_the_whole_range_the_rule_gives():
    low, high = zero.bucket_sizes_for_calls(MLP, 4)
    assert (low, high) == (2 * 65_792, 3 * 65_792 - 1)  # two layers fit; a third would complete a bucket of three
    assert zero.bucket_calls(MLP, low) == zero.bucket_calls(MLP, high) == 4
    assert zero.bucket_calls(MLP, low - 1) > 4 and zero.bucket_calls(MLP, high + 1) < 4
    assert zero.bucket_sizes_for_calls(MLP, 1) == (sum(MLP), None)
    with pytest.raises(ValueError):
        zero.bucket_sizes_for_calls([10, 10], 3)
    knobs = {"defaults": _knob(1, {"stage": 1})}
    assert "from 131,584 to 197,375" in str(zero.exercise_bucket_for_calls({"reduce_bucket_size": 150_000}, knobs))


# --- chapter 05: bytes per optimizer step, model states without the master copy, the gradient bucket --------

def _stage(stage: int, grad_accum: int = 2, states: dict | None = None, **changes) -> records.Record:
    summary = {**minimal_summary(), "zero_stage": stage, "grad_accum": grad_accum, "train_batch": 8 * grad_accum,
               **changes}
    if states is not None:
        summary["memory"] = {**summary["memory"], "model_states_bytes_per_rank": [dict(states), dict(states)]}
    return records.Record(summary)


def test_the_papers_stage_3_volume_counts_once_per_micro_step_and_stage_0s_once_per_step():
    # the summary's theory volume is 4,000 bytes: per forward and backward at stage 3, per step below it
    assert _stage(3, grad_accum=2).theory.comm_wire_bytes_per_optimizer_step == 8000
    assert _stage(3, grad_accum=1).theory.comm_wire_bytes_per_optimizer_step == 4000
    assert _stage(0, grad_accum=2).theory.comm_wire_bytes_per_optimizer_step == 4000


def test_comm_table_per_optimizer_step_labels_each_paper_row_and_compares_with_it():
    lines = zero.comm_table_per_optimizer_step([_stage(0), _stage(3)]).splitlines()
    assert "bytes/optimizer step" in lines[0]
    stage0 = [line for line in lines if line.startswith("ZeRO-0")]
    stage3 = [line for line in lines if line.startswith("ZeRO-3")]
    assert "= paper: 2Ψ(n-1)/n, once" in stage0[-2] and stage0[-2].split()[-1] == "4,000"
    assert "= paper: 3Ψ(n-1)/n x 2 micro-steps" in stage3[-2] and stage3[-2].split()[-1] == "8,000"
    # measured: 6,000 wire bytes per step
    assert stage0[-1].split()[-1] == "1.50x" and stage3[-1].split()[-1] == "0.75x"


def test_model_states_note_takes_the_master_copy_out():
    base = {"params": 4000, "grads": 4000, "optimizer": 8000, "master": 0, "buffers": 0}
    halved = {"params": 2000, "grads": 2000, "optimizer": 4000, "master": 2000, "buffers": 0}
    note = zero.model_states_note(_stage(3, states=halved), _stage(0, states=base))
    assert "ZeRO-3 fp32 10,000 bytes against ZeRO-0 fp32 16,000 (0.62x)" in note
    assert "(2,000 and 0 bytes): 0.50x, 1/N_d on 2 ranks" in note
    uneven = dict(halved, params=3000)
    assert "not 1/N_d" in zero.model_states_note(_stage(3, states=uneven), _stage(0, states=base))


def test_bucket_buffer_note_compares_the_buffers_with_the_default_bucket():
    bucket = {"params": 2000, "grads": 2000, "optimizer": 4000, "master": 2000, "buffers": 2_000_000_000}
    note = zero.bucket_buffer_note(_stage(3, states=bucket))
    assert "500,000,000 elements, x 4 bytes (fp32) = 2,000,000,000 bytes;" in note
    assert "measured 2,000,000,000 bytes (the same)" in note
    assert "for a model of 4,000 bytes" in note  # PSI = 1,000 fp32 parameters
    assert "(not the same)" in zero.bucket_buffer_note(_stage(3, states=dict(bucket, buffers=512)))
    assert "x 2 bytes (bf16) = 1,000,000,000" in zero.bucket_buffer_note(_stage(3, states=bucket, precision="bf16"))


def test_knob_table_with_wire_bytes_names_both_byte_columns():
    run = _stage(3, comm={**minimal_summary()["comm"], "bytes_per_step": 6000.0, "wire_bytes_per_step": 2500.0})
    plain, wire = zero.knob_table({"defaults": run}), zero.knob_table({"defaults": run}, wire=True)
    assert "bytes/step" in plain.splitlines()[0] and "logged" not in plain
    header, row = wire.splitlines()[0], wire.splitlines()[2]
    assert "logged bytes/step" in header and "wire bytes/step" in header
    assert "6,000" in row.split() and "2,500" in row.split()


def test_the_communication_plot_sets_each_run_beside_the_papers_volume_per_optimizer_step():
    from helpers.core import plots

    runs = [_stage(0, grad_accum=2), _stage(3, grad_accum=2)]
    fig = plots.comm_per_step(runs)
    paper_bars = [patch for patch in fig.axes[0].patches if patch.get_hatch() == "//"]
    assert [bar.get_height() * 2**20 for bar in paper_bars] == pytest.approx([4000, 8000])


def test_optimizer_rows_note_counts_one_step_counter_per_tensor_the_optimizer_updates():
    stage0 = _states(8000, 4000, 8000 + 16 * 4, 0, stage=0)
    stage2 = _states(8000, 2000, 4000 + 4, 2000, stage=2)
    note = zero.optimizer_rows_note(stage0, stage2, tensors=16)
    assert "ZeRO-0 fp32 64 bytes = 16 counter(s) for 16 parameter tensors;" in note
    assert "ZeRO-2 fp32 4 bytes = 1 counter(s) for 1 flat fp32 partition(s)." in note
    assert "2,000 bytes = params / N_d (4,000)" in note and "does not explain" not in note
    assert "does not explain" in zero.optimizer_rows_note(stage0, stage2, tensors=8)


def test_bucket_count_note_derives_the_calls_from_whole_tensors_per_bucket():
    run = _knob(16, {"stage": 2, "reduce_bucket_size": 100_000})
    run.summary["grad_accum"] = 2  # stage 2 reduces after each backward
    note = zero.bucket_count_note(run, MLP)
    assert "8 x 65,536, 8 x 256 elements" in note and "(65,536 + 65,536) overflow" in note
    assert "8 bucket(s) per backward x 2 micro-steps = 16 all_reduce calls per step; the record: 16 (the same)" in note
    assert "the record: 6 (not the same)" in zero.bucket_count_note(_knob(6, {"stage": 2, "reduce_bucket_size": 100_000}), MLP)
    assert "1 bucket(s) per backward" in zero.bucket_count_note(_knob(2, {"stage": 2}), MLP)


def test_reference_step_note_reads_each_settings_median_and_peak_against_the_base(monkeypatch):
    runs = {"defaults": _timed([900, 10, 12], 3, 2 * 2**30), "small": _timed([900, 30, 31], 10, 70 * 2**20)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", runs))
    lines = zero.reference_step_note("x", "defaults", ["small"]).splitlines()
    assert lines[0].startswith("Step times on 2 x GPU (the committed reference), median after step 1; figures, not")
    assert "defaults 11.0 ms (steps 10.0-12.0), peak 2 GiB" in lines[0]  # the first step (900) left out
    assert lines[1].startswith("  small: 30.5 ms (steps 30.0-31.0), 2.77x the defaults median, every step longer "
                               "than every defaults step; peak 70 MiB (-1.93 GiB)")
    assert lines[2] == "Of these 2: lowest peak small, shortest median step defaults."


def test_reference_step_note_says_where_a_settings_steps_lie_against_the_base(monkeypatch):
    runs = {"defaults": _timed([900, 10, 14], 3, 5), "fast": _timed([900, 6, 8], 3, 9),
            "near": _timed([900, 12, 20], 3, 7)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", runs))
    lines = zero.reference_step_note("x", "defaults", ["fast", "near"]).splitlines()
    assert "every step shorter than every defaults step" in lines[1]
    assert "its steps overlap the defaults steps' range" in lines[2]
    assert lines[3] == "Of these 3: lowest peak defaults, shortest median step fast."


def test_knob_table_and_peak_contrast_leave_out_or_name_columns_as_told(monkeypatch):
    runs = {"defaults": _timed([900, 12, 12], 3, 2 * 2**30), "small": _timed([900, 19, 19], 10, 70 * 2**20)}
    assert "buffers" in zero.knob_table(runs) and "buffers" not in zero.knob_table(runs, buffers=False)
    assert len(zero.knob_table(runs, buffers=False).splitlines()[2].split()) == len(zero.knob_table(runs).splitlines()[2].split()) - 2
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", runs))
    said = zero.peak_contrast("x", "defaults", "small", times=False, calls_label="calls of every kind per step")
    assert said.endswith("; 10 calls of every kind per step against 3).")
