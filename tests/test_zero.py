"""helpers.topics.zero: gradient reductions and what a rank sends for them, the model built with and without
``deepspeed.zero.Init`` (counted by hand, then on 2 CPU ranks in one launch), the sentences read from GPU references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.core import load_guard, models, probes, records
from helpers.core.environment import WORLD_SIZE_VARIABLE
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


def test_step_spread_says_whether_the_steps_after_the_first_can_tell_two_settings_apart(monkeypatch):
    runs = {"a": _timed([900, 20, 21, 22], 2, 10), "fast": _timed([900, 10, 11, 12], 2, 10),
            "mixed": _timed([900, 15, 21, 30], 2, 10)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", runs))
    assert zero.step_spread("x", "a", "fast").endswith("fast was faster in every step.")
    assert zero.step_spread("x", "fast", "a").endswith("a was slower in every step.")
    assert "cannot tell the two apart" in zero.step_spread("x", "a", "mixed")
    assert "10.0-12.0 ms with fast" in zero.step_spread("x", "a", "fast")  # the warm-up step left out


def test_peak_contrast_leaves_the_step_times_out_when_asked(monkeypatch):
    runs = {"defaults": _timed([900, 12, 12], 3, 2 * 2**30), "small": _timed([900, 19, 19], 10, 70 * 2**20)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", runs))
    timed = zero.peak_contrast("x", "defaults", "small")
    assert "median step 19.0 ms against 12.0 ms" in timed and timed.endswith("(10 collective calls per step against 3).")
    untimed = zero.peak_contrast("x", "defaults", "small", times=False)
    assert " ms " not in untimed and untimed.startswith("On 2 x GPU, small: peak 70 MiB per rank against 2 GiB")
    assert untimed.endswith("apart; 10 collective calls per step against 3).")


def test_calls_and_step_times_says_when_time_does_not_follow_the_calls(monkeypatch):
    rising = {"few": _timed([1, 10, 10], 2, 1), "many": _timed([1, 20, 20], 9, 1)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", rising))
    assert zero.calls_and_step_times("x").endswith("rises with every added call in this order.")
    falling = {"few": _timed([1, 20, 20], 2, 1), "many": _timed([1, 10, 10], 9, 1)}
    monkeypatch.setattr(zero, "latest_reference", lambda name: ("2 x GPU", falling))
    assert zero.calls_and_step_times("x").endswith("does not rise with the calls in every row.")


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
    assert "the machine warmed during the sweep" in drifted and "is faster" not in drifted


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


def test_build_options_are_checked_before_any_process_starts():
    zero.check_build_options("mlp", {"init": "zero.Init"})
    with pytest.raises(ValueError, match="init='Init': choose one of plain, zero.Init"):
        zero.check_build_options("mlp", {"init": "Init"})
    with pytest.raises(ValueError, match=r"model_options \['size'\]: this builder takes only 'init'"):
        zero.check_build_options("mlp", {"size": 3})
    with pytest.raises(ValueError, match="not one of the course's models"):
        zero.check_build_options("mlpp", {})
    assert zero.build_model.check_options is zero.check_build_options
    assert zero.BUILDER == "helpers.topics.zero:build_model"


def test_zero_init_needs_a_stage_3_config():
    with pytest.raises(ValueError, match="zero_optimization.stage 2; use stage 3"):
        zero.build_model("mlp", 0, {"zero_optimization": {"stage": 2}}, init="zero.Init")


def test_built_whole_a_rank_holds_every_parameter():
    model = zero.build_model("mlp", 0, {"zero_optimization": {"stage": 3}}, init="plain")
    found = getattr(model, zero.CONSTRUCTION_ATTR)
    whole = 4 * models.parameters_of("mlp")
    assert found["full_bytes"] == found["held_bytes"] == found["peak_bytes"] == whole
    assert found["largest_module_bytes"] == 4 * (models.MLP_WIDTH ** 2 + models.MLP_WIDTH)
    assert found["gathered"]["shape_outside"] == [models.MLP_WIDTH, models.MLP_WIDTH]
    assert found["gathered"]["digest"] == zero.digest(models.build("mlp", 0)[0].weight)


def test_construction_estimate_by_hand():
    # 1,000 parameters on 4 ranks in fp32, largest module 100: whole 4,000 bytes; shards 1,000 + 100 x 4 x 3/4
    assert zero.construction_estimate(1000, 4, 100, 4) == (4000, 1300)
    table = zero.construction_estimate_table(8_000_000_000, 8, 1_000_000_000).splitlines()
    assert table[2].split() == ["fp32", "32.0", "256.0", "7.50", "60.0"]


# --- the chapter's launch ------------------------------------------------------------------------------

def test_zero3_chapter_runs_builds_the_model_both_ways_in_the_same_launch(monkeypatch):
    launches = []

    def sweep(specs, *, name, **_):
        launches.append((name, specs))
        return {spec.name: f"record of {spec.name}" for spec in specs}

    monkeypatch.setattr(zero.launch, "sweep", sweep)

    class Env:
        device_name = "a CPU without bf16"

        @staticmethod
        def supports(precision):
            return precision == "fp32"

    runs, knobs, built = zero.zero3_chapter_runs({"defaults": {}}, also=(2,), env=Env())
    assert len(launches) == 1 and launches[0][0] == "zero3-chapter"
    specs = {spec.name: spec for spec in launches[0][1]}
    assert list(specs) == ["zero0-fp32", "zero3-fp32", "zero2-fp32", "zero3-defaults", "zero3-built-plain",
                           "zero3-built-zero.Init"]
    assert built == {"plain": "record of zero3-built-plain", "zero.Init": "record of zero3-built-zero.Init"}
    for init in zero.INIT_CHOICES:
        spec = specs[f"zero3-built-{init}"]
        assert spec.builder == zero.BUILDER and spec.model_options == {"init": init} and spec.config == "zero3"
        assert zero.Construction in spec.probes and set(probes.DEFAULT) <= set(spec.probes)
    assert all(spec.builder is None for name, spec in specs.items() if "built" not in name)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The model built both ways and trained 2 steps at stage 3 on 2 CPU ranks, in one launch."""
    import os

    saved = os.environ.pop(WORLD_SIZE_VARIABLE, None)
    folder = tmp_path_factory.mktemp("zero-init")
    try:
        specs = [zero.launch.RunSpec("zero3", model="mlp", steps=2, name=f"built-{init}", builder=zero.BUILDER,
                                     model_options={"init": init}, out=folder / init,
                                     probes=(*probes.DEFAULT, zero.Construction))
                 for init in zero.INIT_CHOICES]
        results = zero.launch.sweep(specs, name="test-zero-init", progress=False)
    finally:
        if saved is not None:
            os.environ[WORLD_SIZE_VARIABLE] = saved
    return {init: results[f"built-{init}"] for init in zero.INIT_CHOICES}


def test_zero_init_holds_a_shard_from_construction_on_and_trains_the_same(built):
    plain, partitioned = built["plain"], built["zero.Init"]
    whole = 4 * models.parameters_of("mlp")
    layer = 4 * (models.MLP_WIDTH ** 2 + models.MLP_WIDTH)
    assert partitioned.params == plain.params == models.parameters_of("mlp")  # ds_numel counted
    for rank in range(2):
        found = zero.construction(partitioned, rank)
        assert found["init"] == "zero.Init" and found["full_bytes"] == whole
        assert found["held_bytes"] == whole // 2
        # the shards of every layer but the last, then the last layer whole before DeepSpeed partitions it
        assert found["peak_bytes"] == (models.MLP_BLOCKS - 1) * layer // 2 + layer
        gathered = found["gathered"]
        assert gathered["shape_outside"] == [0] and gathered["shape_inside"] == [models.MLP_WIDTH] * 2
        assert gathered["shard_elements"] == models.MLP_WIDTH ** 2 // 2
        assert gathered["digest"] == zero.construction(plain, rank)["gathered"]["digest"]
        assert not gathered["change_kept_without_modifier_rank"]
        assert gathered["change_kept_with_modifier_rank"] and gathered["restored"]
        assert zero.construction(plain, rank)["peak_bytes"] == whole
    assert zero.construction_check(partitioned).endswith(": as measured")
    assert partitioned.losses == plain.losses
    assert partitioned.states(0) == plain.states(0)
    table = zero.construction_table(built).splitlines()
    assert table[3].split()[-1] == "yes" and "(0.50)" in table[3]
    report = zero.gathered_report(built)
    assert report.count("identical to the tensor built whole") == 2 and "DIFFERENT" not in report


def test_the_construction_probe_refuses_a_run_built_otherwise():
    class Ctx:
        class engine:
            module = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="give the run builder=zero.BUILDER"):
        zero.Construction().start(Ctx())


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


def test_peak_knob_is_the_references_highest_peak():
    assert zero.exercise_peak_knob("overlap_comm=true")
    assert not zero.exercise_peak_knob("defaults") and not zero.exercise_peak_knob(...).answered


def test_persistence_rule_keeps_small_parameters_whole_besides_every_shard():
    shards = sum(MLP) // 2 * 4
    assert zero.persistent_param_bytes(MLP, 0, 2) == shards
    assert zero.persistent_param_bytes(MLP, 100_000, 2) == shards + sum(MLP) * 4
    knobs = {"defaults": _knob(1, {"stage3_param_persistence_threshold": 0}, params=shards),
             "persistence_threshold=1e5": _knob(1, {"stage3_param_persistence_threshold": 100_000},
                                                params=shards + sum(MLP) * 4)}
    assert zero.exercise_persistence({"stage": 3, "stage3_param_persistence_threshold": 1000}, knobs)
    assert not zero.exercise_persistence({"stage3_param_persistence_threshold": 100_000}, knobs)
    assert not zero.exercise_persistence(..., knobs).answered


def test_init_peak_is_the_construction_probes():
    run = _record({})
    run.summary["construction"] = {"init": "zero.Init", "per_rank": [
        {"full_bytes": 2000, "peak_bytes": 1100, "held_bytes": 1000, "largest_module_bytes": 200}]}
    assert zero.exercise_init_peak(1100, {"zero.Init": run}) and not zero.exercise_init_peak(2000, {"zero.Init": run})
    assert not zero.exercise_init_peak(..., {"zero.Init": run}).answered


def test_bucket_rule_counts_a_reduce_per_owner_when_multi_rank_allreduce_is_off():
    knobs = {"defaults": _knob(1, {"stage": 1}),
             "use_multi_rank_bucket_allreduce=false": _knob(2, {"use_multi_rank_bucket_allreduce": False})}
    assert zero.exercise_bucket_for_calls({"stage": 1, "reduce_bucket_size": 150_000}, knobs)
    assert not zero.exercise_bucket_for_calls({"reduce_bucket_size": 150_000, "use_multi_rank_bucket_allreduce": False}, knobs)
