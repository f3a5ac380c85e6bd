"""helpers.topics.bandwidth: the alpha-beta model recovers known alpha and beta, and predicts what it should (no launches)."""

from __future__ import annotations

import math
import random

import pytest

from helpers.core import load_guard, records, references, theory
from helpers.topics import bandwidth

SIZES = [2.0**k for k in range(10, 31, 2)]  # 1 KiB .. 1 GiB, as the GPU benchmark


@pytest.mark.parametrize("alpha, gbps", [(20e-6, 300.0), (300e-6, 1.0), (5e-6, 12.5), (1e-3, 0.025)])
def test_fit_recovers_alpha_and_beta_exactly_from_noiseless_points(alpha, gbps):
    beta = 1 / (gbps * 1e9)
    model = bandwidth.fit(SIZES, [alpha + beta * x for x in SIZES])
    assert model.alpha == pytest.approx(alpha, rel=1e-9)
    assert model.beta == pytest.approx(beta, rel=1e-9)
    assert model.bandwidth == pytest.approx(gbps * 1e9, rel=1e-9)
    assert model.half_bandwidth_bytes == pytest.approx(alpha / beta, rel=1e-9)


def test_fit_recovers_alpha_and_beta_within_noise():
    rng = random.Random(7)
    alpha, beta = 50e-6, 1 / 10e9
    times = [(alpha + beta * x) * (1 + rng.uniform(-0.05, 0.05)) for x in SIZES for _ in range(5)]
    model = bandwidth.fit([x for x in SIZES for _ in range(5)], times)
    assert model.alpha == pytest.approx(alpha, rel=0.05)
    assert model.beta == pytest.approx(beta, rel=0.05)


def test_relative_weighting_keeps_small_messages_in_view():
    # an ordinary least-squares fit would let the 1 GiB point swamp alpha; this one keeps both
    alpha, beta = 10e-6, 1 / 100e9
    model = bandwidth.fit(SIZES, [alpha + beta * x for x in SIZES])
    errors = bandwidth.relative_errors(model, SIZES, [alpha + beta * x for x in SIZES])
    assert max(abs(e) for e in errors) < 1e-9


def test_fit_clamps_to_non_negative_terms():
    # pure bandwidth (t proportional to size, times shrunk at small sizes): alpha would come out negative
    sizes = [1e3, 1e4, 1e5, 1e6]
    model = bandwidth.fit(sizes, [x / 1e9 * (0.5 if x < 1e4 else 1.0) for x in sizes])
    assert model.alpha == 0.0 and model.beta > 0
    # pure latency: the same time whatever the size
    flat = bandwidth.fit(sizes, [1e-4] * 4)
    assert flat.beta == 0.0 and flat.alpha == pytest.approx(1e-4) and flat.bandwidth == math.inf


@pytest.mark.parametrize("sizes, times, match", [([1e3, 1e3], [1e-4, 2e-4], "two or more different sizes"),
                                                 ([1e3, 1e4], [1e-4], "2 sizes but 1 times"),
                                                 ([1e3, 1e4], [0.0, 1e-4], "positive")])
def test_fit_refuses_what_it_cannot_fit(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        bandwidth.fit(sizes, times)


def test_collective_names_of_the_comms_logger_map_to_the_four_collectives():
    assert bandwidth.collective_of("all_gather_into_tensor") == "all_gather"
    assert bandwidth.collective_of("reduce_scatter_tensor") == "reduce_scatter"
    assert bandwidth.collective_of("all_reduce_coalesced") == "all_reduce"
    assert bandwidth.collective_of("inference_all_reduce") == "all_reduce"
    with pytest.raises(KeyError, match="all_to_all"):
        bandwidth.collective_of("all_to_all_single")


def _synthetic_benchmark(world: int, fits: dict[str, tuple[float, float]]) -> dict:
    """A helpers.topics.bandwidth summary whose times follow known alpha and beta per collective."""
    results = []
    for op, (alpha, beta) in fits.items():
        for size in (2**k for k in range(10, 23, 2)):
            wire = bandwidth.wire_bytes(op, size, world)
            seconds = alpha + beta * wire
            results.append({"implementation": "deepspeed.comm", "op": op, "bytes": size, "seconds": seconds,
                            "wire_bytes": wire, "busbw": theory.bus_bandwidth(op, size, seconds, world),
                            "interface_bytes_sent": None})
    return {"world_size": world, "device_name": "cpu", "backend": "gloo", "implementations": ["deepspeed.comm"],
            "results": results}


def test_a_model_fitted_on_a_benchmark_predicts_a_steps_collectives_from_logged_bytes():
    world = 4
    known = {"all_reduce": (100e-6, 1 / 2e9), "all_gather": (50e-6, 1 / 3e9), "reduce_scatter": (70e-6, 1 / 1e9)}
    model = bandwidth.CommModel.from_benchmark(_synthetic_benchmark(world, known))
    for op, (alpha, beta) in known.items():
        assert model.fits[op].alpha == pytest.approx(alpha, rel=1e-6)
        assert model.fits[op].beta == pytest.approx(beta, rel=1e-6)
    # a ZeRO-2-like step as the comms logger records it: 3 all_reduce of 2 MB in all, 1 all_gather of a 1 MB shard
    step = {"all_reduce": {"count": 3, "bytes": 6e6}, "all_gather_into_tensor": {"count": 1, "bytes": 1e6}}
    expected = (3 * 100e-6 + 2 * 3 / 4 * 6e6 / 2e9) + (50e-6 + 3 * 1e6 / 3e9)
    assert model.predict_total(step) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(KeyError, match="broadcast"):
        model.predict({"broadcast": {"count": 1, "bytes": 10}})


def test_busbw_of_the_benchmark_is_wire_bytes_over_time():
    # nccl-tests' busbw and the model's wire bytes are the same convention, for every collective
    for op in bandwidth.OPS:
        for world in (2, 3, 8):
            size, seconds = 2**20 * world, 1e-3
            assert theory.bus_bandwidth(op, size, seconds, world) == pytest.approx(
                bandwidth.wire_bytes(op, size, world) / seconds)


def test_a_link_model_is_bandwidth_per_direction_plus_latency():
    link = bandwidth.CommModel.for_link(100 * bandwidth.GBIT, 20e-6, world_size=2)
    # an all_reduce of 1 GB on 2 ranks sends 1 GB per rank: 80 ms at 100 Gb/s, plus one alpha
    assert link.seconds("all_reduce", 1e9) == pytest.approx(0.08 + 20e-6)
    assert bandwidth.LINKS["10 Gb/s"] == pytest.approx(1.25e9)


def _record_with_phases(accum: int, micro_ops: dict, boundary_ops: dict, step_ops: dict, walls: dict) -> records.Record:
    from test_records import minimal_summary

    summary = minimal_summary()
    phases = [f"micro-step {i + 1}" for i in range(accum)] + ["optimizer step"]
    by_phase = {p: dict(micro_ops) for p in phases[:-2]}
    by_phase[phases[-2]] = dict(boundary_ops)
    by_phase["optimizer step"] = dict(step_ops)
    summary.update(grad_accum=accum, micro_batch=4, train_batch=4 * accum * summary["world_size"], name="synthetic",
                   probes=list(summary.get("probes", records.LEGACY_PROBES)) + ["micro_steps"])
    summary["micro_steps"] = {"phases": phases, "by_phase": by_phase, "wall_s_by_phase": walls,
                              "comm_s_per_step": sum(r["seconds"] for p in by_phase.values() for r in p.values())}
    return records.Record(summary)


def test_extrapolating_accumulation_repeats_the_off_boundary_micro_step():
    ar = {"all_reduce": {"count": 1, "bytes": 1000, "seconds": 0.002}}
    ag = {"all_gather_into_tensor": {"count": 1, "bytes": 500, "seconds": 0.001}}
    r = _record_with_phases(2, ar, ar, ag, {"micro-step 1": 0.010, "micro-step 2": 0.012, "optimizer step": 0.005})
    p8 = bandwidth.extrapolate(r, 8)
    assert p8.by_op == {"all_reduce": {"count": 8, "bytes": 8000}, "all_gather_into_tensor": {"count": 1, "bytes": 500}}
    # computation: 7 x (10 - 2) ms + (12 - 2) ms + (5 - 1) ms
    assert p8.compute_s == pytest.approx(7 * 0.008 + 0.010 + 0.004)
    assert p8.samples == 4 * 8 * r["world_size"]
    # the profile of the run itself adds up to the step its probe timed
    p2 = bandwidth.profile(r)
    assert p2.compute_s + p2.measured_comm_s == pytest.approx(0.027)
    assert bandwidth.extrapolate(r, 2).by_op == p2.by_op
    # stage 0/1-like: nothing off the boundary, so accumulation leaves the collectives alone
    quiet = _record_with_phases(2, {}, ar, {}, {"micro-step 1": 0.010, "micro-step 2": 0.012, "optimizer step": 0.005})
    assert bandwidth.extrapolate(quiet, 8).by_op == {"all_reduce": {"count": 1, "bytes": 1000}}
    with pytest.raises(ValueError, match="accumulation 1 has no micro-step"):
        bandwidth.extrapolate(_record_with_phases(1, {}, ar, {}, {"micro-step 1": 0.01, "optimizer step": 0.0}), 4)


def test_what_if_puts_slower_links_above_faster_ones_and_overlap_below_serial():
    ar = {"all_reduce": {"count": 1, "bytes": 1e8, "seconds": 0.002}}
    r = _record_with_phases(2, ar, ar, {}, {"micro-step 1": 0.010, "micro-step 2": 0.012, "optimizer step": 0.005})
    p = bandwidth.profile(r)
    rows = bandwidth.what_if([p], alpha=10e-6)
    steps = [row["step_s"] for row in rows]
    assert [row["link"] for row in rows] == list(bandwidth.LINKS)
    assert steps == sorted(steps, reverse=True)
    assert all(0 < row["comm_share"] < 1 for row in rows)
    # 10 Gb/s: 2 all_reduce of 100 MB on 2 ranks send 200 MB per rank = 0.16 s
    assert rows[0]["comm_s"] == pytest.approx(0.16 + 2 * 10e-6)
    link = bandwidth.CommModel.for_link(bandwidth.LINKS["10 Gb/s"], 10e-6, 2)
    assert bandwidth.predict_step(p, link, overlap=True)["step_s"] == pytest.approx(max(p.compute_s, rows[0]["comm_s"]))
    assert "10 Gb/s: step (comm)" in bandwidth.what_if_table(rows).splitlines()[0]


# --- the chapter's exercises -------------------------------------------------------------------------

def test_exercise_collective_time_is_alpha_plus_beta_times_the_ring_wire_bytes_of_the_reference_fit():
    _, model = bandwidth.reference_model()
    ab, n = model.fits["all_reduce"], model.world_size
    expected_ms = (ab.alpha + ab.beta * 2 * (n - 1) / n * bandwidth.EXERCISE_MESSAGE) * 1e3
    assert bandwidth.exercise_collective_time(expected_ms)
    assert bandwidth.exercise_collective_time(expected_ms * 1.04)
    assert not bandwidth.exercise_collective_time(ab.alpha * 1e3)  # latency alone
    blank = bandwidth.exercise_collective_time(...)
    assert not blank.answered and "to do" in str(blank)


def test_exercise_latency_bound_size_turns_alpha_over_beta_into_the_gathered_message():
    _, model = bandwidth.reference_model()
    ab, n = model.fits["all_gather"], model.world_size
    assert bandwidth.exercise_latency_bound_size(ab.half_bandwidth_bytes * n / (n - 1))
    assert not bandwidth.exercise_latency_bound_size(ab.half_bandwidth_bytes)  # wire bytes, not the message
    assert not bandwidth.exercise_latency_bound_size(...).answered


def test_deepspeeds_config_model_and_logger_say_which_ops_a_block_records():
    only = {"prof_all": False, "prof_ops": ["all_reduce"]}
    assert bandwidth.comms_logger_records(only) == {"all_reduce": True, "all_gather_into_tensor": False,
                                                    "reduce_scatter_tensor": False}
    assert all(bandwidth.comms_logger_records({"enabled": True}).values())  # prof_all's default records every op
    assert all(bandwidth.comms_logger_records({"enabled": False}).values())  # the block's presence turns it on
    with pytest.raises(ValueError, match="prof_al"):  # DeepSpeed's config model refuses an unknown key
        bandwidth.comms_logger_records({"prof_al": False})


ALONE = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test: an idle machine")
BUSY = load_guard.Load("cpu", 3, 0.4, 2, 10.0, 20, "test: a shared machine")


def _row(name: str, each: list[float], predicted: float) -> dict:
    return {"name": name, "measured_each_s": each, "measured_s": sum(each) / len(each), "predicted_s": predicted}


def test_the_models_error_is_stated_only_beyond_the_steps_spread_and_alone():
    rows = [_row("zero1-acc4", [0.010, 0.011, 0.0105], 0.020), _row("zero2-acc4", [0.010, 0.014, 0.012], 0.0125)]
    lines = bandwidth.model_verdict_summary(rows, ALONE).splitlines()
    assert lines[0] == ("zero1-acc4: the model predicted +90% against the measured time, beyond the spread of its 3 "
                        "measured steps (10%).")
    assert lines[1].startswith("zero2-acc4: withheld: the difference (4%) is within the steps' spread (33%)")
    assert lines[2] == "The model's error exceeded the steps' spread in 1 of 2 runs; it predicted less than measured in 0 of them."


def test_on_a_shared_machine_the_models_error_is_withheld_with_the_reason():
    rows = [_row("zero1-acc4", [0.010, 0.011], 0.020)]
    assert bandwidth.model_verdict_summary(rows, BUSY) == (
        "Verdict on the model's error withheld: other processes (3) used 40% of the 2 cores' time during the run.\n"
        "The figures, without a verdict: the measured collective time is 0.5x to 0.5x the prediction over the 1 "
        "runs; above the prediction in 0 of them.")


def test_the_plain_reading_gives_the_range_of_measured_over_predicted():
    rows = [_row("a", [0.030], 0.010), _row("b", [0.015], 0.010), _row("c", [0.005], 0.010)]
    assert bandwidth.plain_reading(rows) == ("The figures, without a verdict: the measured collective time is 0.5x to "
                                             "3.0x the prediction over the 3 runs; above the prediction in 2 of them.")
    assert bandwidth.plain_reading([_row("none", [0.01], 0.0)]) == "No prediction to read."


def test_the_page_can_replace_the_deepspeed_call_of_the_benchmark():
    spec = bandwidth.spec("b", sizes=(4096,), is_gpu=False, task="runs.bandwidth.collectives_bench:benchmark")
    assert spec.task == "runs.bandwidth.collectives_bench:benchmark"
    assert bandwidth.spec("b", sizes=(4096,), is_gpu=False).task == bandwidth.TASK == "helpers.topics.bandwidth:benchmark"


def test_the_slow_link_plan_says_why_it_skips(monkeypatch):
    cpu = type("Env", (), {"is_gpu": False})()
    monkeypatch.setattr(bandwidth, "link_support", lambda: (False, "`tc` (iproute2) is not installed"))
    ok, why = bandwidth.slow_link_plan(2, cpu)
    assert not ok and "`tc` (iproute2) is not installed" in why
    monkeypatch.setattr(bandwidth, "link_support", lambda: (True, "root, iproute2"))
    ok, what = bandwidth.slow_link_plan(2, cpu, rate_mbit=400)
    assert ok and "each of the 2 ranks in a network namespace" in what and "400 Mbit/s" in what


def test_accumulation_is_judged_per_sample_through_the_load_guard():
    def row(accum, batch, fast, slow):
        return {"name": f"zero1-acc{accum}", "accum": accum, "batch": batch, "fast_each_s": fast, "slow_each_s": slow}
    rows = [row(1, 8, [0.100, 0.101, 0.1005], [0.400, 0.402, 0.401]), row(4, 32, [0.200, 0.202, 0.201], [0.420, 1.600, 0.5])]
    lines = bandwidth.accumulation_verdicts(rows, ALONE).splitlines()
    assert lines[0] == "ZeRO-1, accumulation 4 against 1, over the fast link: 2.00x the samples/s, beyond the steps' spread (1%)."
    assert lines[1].startswith("ZeRO-1, accumulation 4 against 1, over the slow link: withheld: the difference")
    for r, fast, slow in zip(rows, (0.1005, 0.201), (0.401, 0.420)):  # the medians slow_link_rows gives
        r["fast_s"], r["slow_s"] = fast, slow
    assert bandwidth.accumulation_verdicts(rows, BUSY) == (
        "Accumulation 4 against 1 (stages 1 and 2, both links): verdict withheld: other processes (3) used 40% of the "
        "2 cores' time during the run.\nThe figures, without a verdict: samples/s at accumulation 4 over 1: ZeRO-1 "
        "2.00x over the fast link, 3.82x over the slow link.")


def _scattered(known: dict) -> dict:
    """A synthetic benchmark whose every other point is 4 times slower: far off any line."""
    scattered = _synthetic_benchmark(2, known)
    for i, p in enumerate(scattered["results"]):
        p["seconds"] *= 4 if i % 2 else 1
    return scattered


def test_the_fit_reading_calls_a_noiseless_fit_good_and_a_scattered_one_poor():
    known = {"all_reduce": (100e-6, 1 / 2e9), "all_gather": (50e-6, 1 / 3e9)}
    clean = _synthetic_benchmark(2, known)
    model = bandwidth.CommModel.from_benchmark(clean)
    assert max(bandwidth.worst_errors(model, clean).values()) < 1e-6
    assert bandwidth.fit_reading(model, clean).startswith(f"median fit error 0% over {len(clean['results'])} points")
    assert "the lines follow the points" in bandwidth.fit_reading(model, clean)
    scattered = _scattered(known)
    model = bandwidth.CommModel.from_benchmark(scattered)
    worst = max(bandwidth.worst_errors(model, scattered).values())
    assert worst > bandwidth.POOR_FIT
    reading = bandwidth.fit_reading(model, scattered)
    assert f"worst {worst:.0%}" in reading and reading.endswith("the points scatter far from the lines.")


def test_rate_match_says_whether_the_fitted_bandwidth_recovers_the_set_rate():
    rate = 50e6
    near = bandwidth.CommModel.for_link(0.97 * rate, 300e-6, 2)
    far = bandwidth.CommModel.for_link(0.5 * rate, 300e-6, 2)
    assert "Every fit is within 10% of the set rate: the fit recovers it." in bandwidth.rate_match(near, rate)
    assert "all_reduce 48.5 MB/s (-3.0%)" in bandwidth.rate_match(near, rate)
    assert bandwidth.rate_match(far, rate).endswith("More than 10% away: all_reduce (-50.0%), all_gather (-50.0%), "
                                                    "reduce_scatter (-50.0%), broadcast (-50.0%).")
    mixed = bandwidth.CommModel.for_link(rate, 300e-6, 2)
    mixed.fits["all_gather"] = far.fits["all_gather"]
    assert bandwidth.rate_match(mixed, rate).endswith("More than 10% away: all_gather (-50.0%); the others recover "
                                                      "the set rate.")


def _with_times(result: dict) -> dict:
    for p in result["results"]:
        p["times"] = [p["seconds"]] * 3
    return result


def test_worst_points_names_the_point_behind_a_large_fit_error():
    known = {"all_reduce": (100e-6, 1 / 2e9)}
    bench = _with_times(_synthetic_benchmark(2, known))
    slow = min(bench["results"], key=lambda p: p["bytes"])  # the smallest message, 10 times slower
    slow["seconds"] *= 10
    slow["times"] = [slow["seconds"], 1e-4, slow["seconds"]]
    model = bandwidth.CommModel.from_benchmark(bench)
    line = bandwidth.worst_points(model, bench)
    assert line.startswith(f"all_reduce: worst at {records.format_bytes(slow['bytes'])}, median ")
    assert "calls: " in line and ", 100, " in line


def test_wire_check_notes_explain_only_rows_that_stray_from_the_ring():
    def point(impl, size, sent):
        return {"implementation": impl, "op": "all_reduce", "bytes": size, "wire_bytes": float(size),
                "interface_bytes_sent": sent}
    bench = {"results": [point("deepspeed.comm", 2**22, 2**22 * 1.001), point("torch.distributed", 2**22, 2**22 * 0.84),
                         point("deepspeed.comm", 2**10, 2**10 * 2.5)]}
    notes = bandwidth.wire_check_notes(bench)
    assert notes.startswith("torch.distributed at 4 MiB: 0.84x the ring's wire bytes (-671,089 bytes a call); "
                            "deepspeed.comm's same call at that size sent 1.00x.")
    assert len(notes.splitlines()) == 1  # the 1 KiB row strays too, but TCP headers explain it
    bench["results"][1]["interface_bytes_sent"] = 2**22
    assert bandwidth.wire_check_notes(bench) == "From 64 KiB up, every row is within 5% of the ring's wire bytes."
    for p in bench["results"]:
        p["interface_bytes_sent"] = None
    assert bandwidth.wire_check_notes(bench) == "(no interface counters here)"


def test_the_slow_alpha_note_sets_the_smallest_calls_beside_their_bytes_at_the_set_rate():
    known = {"all_reduce": (2e-3, 1 / 50e6)}
    bench = _with_times(_synthetic_benchmark(2, known))
    bench["iters"] = 3
    slow = bandwidth.CommModel.from_benchmark(bench)
    fast = bandwidth.CommModel.for_link(1e9, 300e-6, 2)
    first = min(bench["results"], key=lambda p: p["bytes"])
    lines = bandwidth.slow_alpha_note(slow, fast, bench, 50e6).splitlines()
    assert lines[0].startswith(f"all_reduce: alpha 300 us on the fast link, 2,000 us here; its smallest message "
                               f"({records.format_bytes(first['bytes'])}) took ")
    assert lines[0].endswith(f"its bytes at the set rate account for {first['wire_bytes'] / 50e6 * 1e3:.2f} ms")
    assert lines[-1].startswith(f"alpha is the line's intercept, fitted on {len({p['bytes'] for p in bench['results']})} "
                                "sizes of 3 calls each")


def test_the_call_differences_name_the_deepspeed_functions_whose_calls_differ_from_the_reference():
    from test_records import minimal_summary

    reference = references.reference_runs("bandwidth-nvlink")[0][3]["zero1-acc4"]
    there = {caller: row["count"] for callers in reference.section("comm")["by_caller"].values()
             for caller, row in callers.items()}
    summary = minimal_summary()
    mine = {c: n for c, n in there.items() if c != "has_overflow"}  # fp32: no overflow flag
    mine["allreduce_bucket"] = there["allreduce_bucket"] + 1
    summary["comm"] = {"by_caller": {"all_reduce": {c: {"count": n, "bytes": 4.0 * n} for c, n in mine.items()}}}
    lines = bandwidth.call_differences({"zero1-acc4": records.Record(summary), "zero9-acc1": records.Record(summary)})
    lines = lines.splitlines()
    assert lines[0].startswith("This run against the GPU reference (") and "bf16 there" in lines[0]
    assert len(lines) == 4  # the run the reference lacks is left out
    row = lines[3].split()
    assert row[:3] == ["zero1-acc4", f"{sum(mine.values()):g}", f"{sum(there.values()):g}"]
    assert " ".join(row[3:]) == (f"allreduce_bucket {mine['allreduce_bucket']:g} -> {there['allreduce_bucket']:g}, "
                                 f"has_overflow 0 -> {there['has_overflow']:g}")


def test_run_configs_shows_deepspeeds_default_overlap_comm_per_stage():
    from test_records import minimal_summary

    found = {}
    for stage in (2, 3):
        summary = minimal_summary()
        summary["config"] = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 4,
                             "train_micro_batch_size_per_gpu": 4}
        found[f"zero{stage}"] = records.Record(summary)
    lines = bandwidth.run_configs(found).splitlines()
    assert "False (default)" in lines[2] and "True (default)" in lines[3]


def test_what_if_gives_a_link_its_own_alpha_where_one_is_given():
    p = bandwidth.StepProfile("synthetic", stage=1, accum=1, micro_batch=4, world_size=2, compute_s=0.0,
                              by_op={"all_reduce": {"count": 10, "bytes": 1e3}})
    rows = bandwidth.what_if([p], alpha=100e-6, alphas={"NVLink 4": 1e-6})
    by = {r["link"]: r for r in rows}
    assert by["NVLink 4"]["alpha"] == 1e-6 and by["400 Gb/s"]["alpha"] == 100e-6
    # ten calls of tiny messages: the step is about ten alphas on each link
    assert by["NVLink 4"]["comm_s"] == pytest.approx(10e-6, rel=0.01)
    assert by["400 Gb/s"]["comm_s"] == pytest.approx(1e-3, rel=0.01)
    assert bandwidth.what_if_alphas(rows) == ("alpha per call: 100.0 us for 10 Gb/s, 25 Gb/s, 100 Gb/s, 400 Gb/s; "
                                              "1.0 us for NVLink 4")


def test_config_changes_reach_a_run_and_its_slow_twin_and_refuse_unknown_names():
    specs = {**bandwidth.stage_specs(overlap_stage=None), **bandwidth.stage_specs(bandwidth.SLOW, stages=(2,),
                                                                                  extra=(), overlap_stage=None)}
    change = {"zero_optimization": {"reduce_bucket_size": 100_000}}
    found = bandwidth.with_config_changes(specs, {"zero2-acc4": change})
    for name in ("zero2-acc4", "slow-zero2-acc4"):
        assert found[name].overrides["zero_optimization"]["reduce_bucket_size"] == 100_000
        assert found[name].overrides["gradient_accumulation_steps"] == 4  # the run's own settings are kept
    assert "zero_optimization" not in (found["zero1-acc4"].overrides or {})
    assert "zero_optimization" not in (specs["zero2-acc4"].overrides or {})  # the given specs are not changed
    with pytest.raises(KeyError, match="zero0-acc4"):
        bandwidth.with_config_changes(specs, {"zero9-acc4": change})


def test_the_page_module_trains_the_logged_runs_and_the_course_loop_the_timed_ones():
    specs = bandwidth.stage_specs(task="runs.bandwidth.train_comms:train", overlap_stage=2)
    logged = [s for n, s in specs.items() if "overlap" not in n]
    timed = [s for n, s in specs.items() if "overlap" in n]
    assert logged and all(s.task == "runs.bandwidth.train_comms:train" and not s.probes for s in logged)
    assert len(timed) == 2 and all(s.task == "train" and s.probes == ("timing",) for s in timed)
    assert all(s.task == "train" and "micro_steps" in s.probes
               for n, s in bandwidth.stage_specs(overlap_stage=None).items())


def test_the_byte_sum_adds_each_functions_calls_and_checks_the_records_total():
    from test_records import minimal_summary

    summary = minimal_summary()
    summary["comm"]["by_caller"] = {"all_reduce": {"allreduce_bucket": {"count": 4.0, "bytes": 8000.0},
                                                   "get_grad_norm_direct": {"count": 1.0, "bytes": 4.0}},
                                    "all_gather_into_tensor": {"allgather": {"count": 1.0, "bytes": 1996.0}}}
    summary["comm"]["bytes_per_step"] = 10_000.0
    assert bandwidth.byte_sum(records.Record(summary)) == (
        "1 x 1,996 (all_gather_into_tensor, allgather) + 4 x 2,000 (all_reduce, allreduce_bucket) + 1 x 4 "
        "(all_reduce, get_grad_norm_direct) = 10,000 bytes per step")
    summary["comm"]["bytes_per_step"] = 6000.0  # the callers no longer add up to the record's total
    with pytest.raises(ValueError, match="differ from the record's total"):
        bandwidth.byte_sum(records.Record(summary))


def test_the_comms_logger_fields_are_deepspeeds_own_and_the_switch_is_read_from_its_source():
    text = bandwidth.comms_logger_fields()
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines()[2:]}
    assert rows == {"enabled": "False", "prof_all": "True", "prof_ops": "[]", "verbose": "False", "debug": "False"}
    assert "still records" not in text  # exercise 3 asks what 'enabled' does: the table does not say
    switch = bandwidth.comms_logger_switch()
    assert switch == "self.comms_logger_enabled = 'comms_logger' in ds_config"
    assert bandwidth.comms_logger_records({"enabled": False})["all_reduce"]  # what that line means for a block


def test_the_fit_summary_comments_this_runs_fit_only_where_the_run_was_alone():
    known = {"all_reduce": (100e-6, 1 / 2e9)}
    scattered = _scattered(known)
    model = bandwidth.CommModel.from_benchmark(scattered)
    busy = bandwidth.fit_summary(model, scattered, load=BUSY)
    assert "Comment withheld: other processes (3) used 40% of the 2 cores' time" in busy
    assert "scatter" not in busy and "follow" not in busy  # figures only
    assert "Comment withheld: nothing recorded" in bandwidth.fit_summary(model, scattered)
    alone = bandwidth.fit_summary(model, scattered, load=ALONE)
    assert "alone on its devices" in alone and alone.endswith("the points scatter far from the lines.")
    clean = _synthetic_benchmark(2, known)
    assert "the lines follow the points" in bandwidth.fit_summary(bandwidth.CommModel.from_benchmark(clean), clean,
                                                                  load=ALONE)


def test_a_term_fitted_as_zero_is_explained_from_the_points():
    rate = 50e6
    bench = _synthetic_benchmark(2, {"all_reduce": (0.0, 1 / rate)})
    smallest = min(bench["results"], key=lambda p: p["bytes"])
    smallest["seconds"] *= 0.9  # faster than its bytes at the rate: no intercept left, alpha clamps to 0
    model = bandwidth.CommModel.from_benchmark(bench)
    assert model.fits["all_reduce"].alpha == 0
    line = bandwidth.degenerate_fits(model, bench, rate)
    assert line.startswith("all_reduce: alpha = 0 is the fit's floor, not a measured latency: its smallest message "
                           f"({records.format_bytes(smallest['bytes'])}) took {smallest['seconds'] * 1e3:.2f} ms")
    assert f"the set rate alone account for {1 / 0.9:.0%} of that" in line
    flat = _synthetic_benchmark(2, {"all_gather": (1e-3, 0.0)})
    for i, p in enumerate(sorted(flat["results"], key=lambda p: p["bytes"])):
        p["seconds"] *= 1 - 0.01 * i  # larger messages a little faster: beta clamps to 0
    flat_model = bandwidth.CommModel.from_benchmark(flat)
    assert flat_model.fits["all_gather"].beta == 0
    assert bandwidth.degenerate_fits(flat_model, flat).startswith("all_gather: beta = 0 is the fit's floor")
    clean = _synthetic_benchmark(2, {"all_reduce": (100e-6, 1 / 2e9)})
    assert bandwidth.degenerate_fits(bandwidth.CommModel.from_benchmark(clean), clean).startswith("Every fit has")


def test_the_accumulation_floor_explains_each_ratio_below_one_from_the_computation():
    def row(accum, batch, fast, slow, compute):
        return {"name": f"zero1-acc{accum}", "accum": accum, "batch": batch, "fast_s": fast, "slow_s": slow,
                "compute_s": compute}
    above = [row(1, 8, 0.020, 0.150, 0.015), row(4, 32, 0.070, 0.250, 0.060)]
    assert bandwidth.accumulation_floor(above).splitlines() == [
        "The model's floor is 1x: an accumulation-4 step does no more work and no more collectives than four "
        "accumulation-1 steps.", "Every ratio here is at or above it."]
    slower = [row(1, 8, 0.020, 0.150, 0.015), row(4, 32, 0.120, 0.250, 0.100)]  # 0.67x over the fast link
    lines = bandwidth.accumulation_floor(slower).splitlines()
    assert lines[1:] == ["ZeRO-1 over the fast link, 0.67x: 120.0 ms against four accumulation-1 steps' 80.0 ms; "
                         "computation (micro_steps, fast link) 100.0 ms against 4 x 15.0 ms."]


def test_the_accumulation_load_note_reads_a_ratio_below_one_as_load_only_where_the_verdict_was_withheld():
    def row(accum, batch, fast, slow, compute):
        return {"name": f"zero1-acc{accum}", "accum": accum, "batch": batch, "fast_s": fast, "slow_s": slow,
                "compute_s": compute}
    slower = [row(1, 8, 0.020, 0.150, 0.015), row(4, 32, 0.120, 0.250, 0.100)]  # 0.67x over the fast link
    note = bandwidth.accumulation_load_note(slower, BUSY)
    assert note.startswith("Accumulation 4 losing to 1 (ZeRO-1 0.67x over the fast link) is below the model's floor")
    assert "the cores' load, not the link" in note
    assert note.endswith("(micro_steps probe: ZeRO-1 100.0 ms against 4 x 15.0 ms).")
    assert bandwidth.accumulation_load_note(slower, ALONE) == ""  # a verdict given: no sentence
    slower[1]["compute_s"] = 0.050  # the computation did not grow: no evidence quoted
    assert bandwidth.accumulation_load_note(slower, None).endswith("not the link.")
    above = [row(1, 8, 0.020, 0.150, 0.015), row(4, 32, 0.070, 0.250, 0.060)]
    assert bandwidth.accumulation_load_note(above, BUSY) == ""


def test_the_slow_link_load_note_names_runs_faster_over_the_slow_link_only_where_the_verdict_was_withheld():
    rows = [{"name": "zero1-acc4", "fast_s": 0.1735, "slow_s": 0.122}, {"name": "zero2-acc4", "fast_s": 0.2, "slow_s": 0.3}]
    note = bandwidth.slow_link_load_note(rows, BUSY)
    assert note.startswith("Faster over the slow link than over the fast one (zero1-acc4 122 ms against 173.5 ms)")
    assert "zero2-acc4" not in note and note.endswith("the cores' load, not the link.")
    assert bandwidth.slow_link_load_note(rows, ALONE) == ""
    assert bandwidth.slow_link_load_note(rows[1:], BUSY) == ""


def test_the_shard_note_explains_all_gathers_logged_bytes_as_one_ranks_shard():
    logged = {"all_gather_into_tensor | [Caller Func: allgather_fn]": {"1052672": {"count": 8}},
              "reduce_scatter_tensor | [Caller Func: reduce_scatter_fn]": {"2105344": {"count": 8}},
              "all_reduce | [Caller Func: get_grad_norm_direct]": {"8": {"count": 2}}}
    assert bandwidth.shard_note(logged, 2).startswith(
        "all_gather's 1,052,672 bytes per call are 1/2 of reduce_scatter's 2,105,344: for all_gather the logger "
        "records one rank's shard")
    assert "0.50x" in bandwidth.shard_note(logged, 4)  # not 1/4 on 4 ranks: said as the ratio found
    logged["all_gather_into_tensor | [Caller Func: allgather_fn]"]["526336"] = {"count": 2}
    assert bandwidth.shard_note(logged, 2).startswith("all_gather's 9,474,048 logged bytes in all are 0.56x")
    assert bandwidth.shard_note({"all_reduce | x": {"8": {"count": 1}}}, 2) == ""


def _slow_bench(points: dict[str, list[tuple[int, float]]]) -> dict:
    """A 2-rank slow-link benchmark: per op, (message bytes, median seconds) points."""
    results = [{"implementation": "deepspeed.comm", "op": op, "bytes": size, "seconds": t, "times": [t] * 3,
                "wire_bytes": bandwidth.wire_bytes(op, size, 2)} for op, found in points.items() for size, t in found]
    return {"world_size": 2, "device_name": "cpu", "iters": 3, "results": results}


def test_the_slow_fit_reading_reads_the_bandwidth_from_the_largest_message_where_the_fit_strays():
    rate = 50e6
    fast = bandwidth.CommModel.for_link(1e9, 300e-6, 2)
    # all_reduce on the line t = 2 ms + w / rate; all_gather's small calls slowed far beyond their bytes
    bench = _slow_bench({"all_reduce": [(s, 2e-3 + s / rate) for s in (2**14, 2**18, 2**21)],
                         "all_gather": [(2**14, 4e-3), (2**18, 2e-3), (2**21, 2**20 / rate)]})
    slow = bandwidth.CommModel.from_benchmark(bench, ops=("all_reduce", "all_gather"))
    assert slow.fits["all_gather"].bandwidth > 1.1 * rate  # the line is flattened above the set rate
    lines = bandwidth.slow_fit_reading(slow, fast, bench, rate).splitlines()
    assert lines[0] == ("all_reduce: alpha 2,000 us (fast link: 300 us); its largest message alone: 2,097,152 wire "
                        f"bytes in {(2e-3 + 2**21 / rate) * 1e3:.1f} ms = {2**21 / (2e-3 + 2**21 / rate) / 1e6:.1f} MB/s "
                        f"({2**21 / (2e-3 + 2**21 / rate) / rate - 1:+.0%} off the set rate)")
    assert lines[1].endswith("1,048,576 wire bytes in 21.0 ms = 50.0 MB/s (+0% off the set rate)")
    assert lines[2] == ("So: all_reduce's fitted 1/beta matches the set rate: gloo's bytes cross the cable at tc's "
                        "rate. all_gather's fitted line strays from the set rate, but its largest message comes within "
                        "10% of it: read a link's bandwidth from its largest messages.")
    slowed = _slow_bench({"all_reduce": [(s, 2 * s / rate) for s in (2**14, 2**18, 2**21)],  # half the rate
                          "all_gather": [(s, s / 4 / rate) for s in (2**14, 2**18, 2**21)]})  # twice the rate
    off = bandwidth.CommModel.from_benchmark(slowed, ops=("all_reduce", "all_gather"))
    reading = bandwidth.slow_fit_reading(off, fast, slowed, rate)
    assert reading.splitlines()[0].startswith("all_reduce: alpha 0 us (fast link: 300 us)")
    assert reading.splitlines()[-1] == (
        "So: all_reduce stayed below the set rate even at its largest message: the rate is a ceiling, not a promise. "
        "all_gather beat the set rate at its largest message, which the cable should not allow: the last section "
        "lists each call.")


def test_the_model_reading_points_to_the_reference_where_no_verdict_is_given():
    rows = [_row("zero1-acc4", [0.010, 0.011, 0.0105], 0.020), _row("zero2-acc4", [0.010, 0.014, 0.012], 0.0125)]
    busy = bandwidth.model_reading(rows, BUSY).splitlines()
    assert busy[:2] == bandwidth.model_verdict_summary(rows, BUSY).splitlines()
    ref = references.reference_runs("bandwidth-nvlink")[0][3]
    errors = [r["error"] for r in bandwidth.comparison_rows(bandwidth.logged_runs(ref),
                                                           bandwidth.CommModel.from_benchmark(ref["collectives"]))]
    assert busy[2] == ("So: with no verdict given, this run cannot tell the model's error from the load's; on the GPU "
                       f"reference its error ran from {min(errors):+.0%} to {max(errors):+.0%} (table above).")
    assert bandwidth.model_reading(rows, ALONE).splitlines()[-1].startswith(
        "So: the model's error exceeded the steps' spread in 1 of 2 runs here; on the GPU reference")


def test_the_accumulation_reading_sets_the_models_ratio_beside_the_measured_one():
    def row(stage, accum, batch, slow, predicted):
        return {"name": f"zero{stage}-acc{accum}", "accum": accum, "batch": batch, "fast_s": slow / 4,
                "slow_s": slow, "predicted_s": predicted, "fast_each_s": [slow / 4] * 3, "slow_each_s": [slow] * 3}
    rows = [row(1, 1, 8, 0.080, 0.070), row(1, 4, 32, 0.090, 0.075), row(2, 1, 8, 0.080, 0.070),
            row(2, 4, 32, 0.200, 0.250)]
    lines = bandwidth.accumulation_reading(rows, BUSY).splitlines()
    assert lines[0].endswith(f"ZeRO-1 {4 * 0.070 / 0.075:.2f}x predicted, {4 * 0.080 / 0.090:.2f}x measured; "
                             f"ZeRO-2 {4 * 0.070 / 0.250:.2f}x predicted, {4 * 0.080 / 0.200:.2f}x measured")
    assert lines[1:3] == bandwidth.accumulation_verdicts(rows, BUSY).splitlines()
    assert lines[3] == ("So: in the model, accumulation pays more for ZeRO-1, whose collectives come once per optimizer "
                        "step, than for ZeRO-2, which all-reduces in every micro-step; the measured ratios rank the two "
                        "stages the same way, and how far each strays from the model cannot be told from the load's "
                        "noise (no verdict).")
    rows[3]["slow_s"] = 0.020  # ZeRO-2 measured ahead of ZeRO-1
    assert "rank the two stages the other way" in bandwidth.accumulation_reading(rows, BUSY)
    assert bandwidth.accumulation_reading(rows[:2], BUSY) == bandwidth.accumulation_verdicts(rows[:2], BUSY)


def test_the_reference_readings_are_labelled_with_their_device_and_date():
    device_date = bandwidth.reference_model()[0]
    assert bandwidth.reference_fit().startswith(f"GPU reference, measured on {device_date} (NCCL; not this run):")
    sentence = bandwidth.reference_what_if()
    assert sentence.startswith(f"GPU reference ({device_date}; not this run): ZeRO-")
    assert "10 Gb/s" in sentence and "NVLink 4" in sentence


def test_the_worked_row_writes_each_ops_calls_times_alpha_plus_its_wire_bytes_over_the_bandwidth():
    world = 4
    known = {"all_reduce": (100e-6, 1 / 2e9), "all_gather": (50e-6, 1 / 3e9)}
    model = bandwidth.CommModel.from_benchmark(_synthetic_benchmark(world, known))
    record = references.reference_runs("bandwidth-nvlink")[0][3]["zero2-acc4"]
    ops = record.comm_ops()
    lines = bandwidth.worked_row(record, model).splitlines()
    assert len(lines) == 1 + len(ops) + 1
    # all_reduce logs the whole tensor (2(n-1)/n of it on the wire), all_gather one shard ((n-1) shards on the wire)
    expected = (ops["all_reduce"]["count"] * 100e-6 + 1.5 * ops["all_reduce"]["bytes"] / 2e9
                + ops["all_gather_into_tensor"]["count"] * 50e-6 + 3 * ops["all_gather_into_tensor"]["bytes"] / 3e9)
    assert lines[-1] == f"  predicted collectives: {expected * 1e3:.3f} ms"
    assert any("w = (n-1) x " in line and "= 3 x " in line for line in lines if "all_gather" in line)


def test_the_logged_calls_exercise_counts_only_what_the_block_records_at_the_new_accumulation():
    ar = {"all_reduce": {"count": 1, "bytes": 1000, "seconds": 0.002}}
    ag = {"all_gather_into_tensor": {"count": 1, "bytes": 500, "seconds": 0.001}}
    r = _record_with_phases(2, ar, ar, ag, {"micro-step 1": 0.010, "micro-step 2": 0.012, "optimizer step": 0.005})
    assert not bandwidth.exercise_logged_calls(..., r).answered
    assert bandwidth.exercise_logged_calls({"all_reduce": 8}, r)  # the default block records all_reduce only
    assert not bandwidth.exercise_logged_calls({"all_reduce": 2}, r)  # the run's own accumulation, not 8
    assert not bandwidth.exercise_logged_calls({"all_reduce": 8, "all_gather_into_tensor": 1}, r)
    assert bandwidth.exercise_logged_calls({"all_reduce": 8, "all_gather_into_tensor": 1}, r, block={})


def test_the_reference_what_if_table_is_labelled_and_has_every_link():
    device_date = bandwidth.reference_model()[0]
    table = bandwidth.reference_what_if_table()
    assert table.startswith(f"GPU reference ({device_date}; not this run)")
    assert all(f"{link}: step (comm)" in table for link in bandwidth.LINKS)


def test_the_what_if_sources_set_its_computation_beside_each_measured_runs_split():
    runs = bandwidth.logged_runs(references.reference_runs("bandwidth-nvlink")[0][3])
    device, date, rows = bandwidth._reference_what_if_rows("bandwidth-nvlink")
    text = bandwidth.what_if_sources(rows, runs)
    lines = text.splitlines()
    split = bandwidth.profile(runs["zero1-acc4"])
    own = bandwidth.extrapolate(runs["zero1-acc4"], 4)
    zero1 = next(line for line in lines if line.startswith("ZeRO-1      4"))
    assert f"{own.compute_s * 1e3:,.1f}" in zero1 and f"{runs['zero1-acc4'].timing.median_s * 1e3:,.1f}" in zero1
    assert zero1.endswith(f"{split.compute_s * 1e3:,.1f} + {split.measured_comm_s * 1e3:,.1f} = "
                          f"{split.measured_step_s * 1e3:,.1f}")
    assert next(line for line in lines if line.startswith("ZeRO-0      1")).split()[-3:] == ["-", "-", "-"]
    assert lines[-1].startswith("The what-if keeps the computation")


def test_overlap_comm_is_one_line_per_reference_here_and_the_details_stay_in_the_findings():
    short = bandwidth.reference_findings(capstone=False, overlap=False)
    assert "ZeRO-1, accumulation 4 against 1" in short and "overlap_comm" not in short
    assert "the model's range there" in bandwidth.reference_findings(capstone=False)
    brief = bandwidth.overlap_brief().splitlines()
    device_date = bandwidth.reference_model()[0]
    assert brief[0].startswith(f"overlap_comm on against off (ZeRO-2, accumulation 4; {device_date}): step time ")
    ladder = bandwidth.overlap_in_capstone()
    assert brief[-1].startswith(f"Chapter 16's ladders tried it {len(ladder)} times and dropped it "
                                f"{sum(line.endswith('so it was dropped') for line, _ in ladder)} of them")


def test_the_reference_fit_is_read_and_drawn_with_its_device_and_date():
    device_date = bandwidth.reference_model()[0]
    assert bandwidth.reference_fit_reading().startswith(f"GPU reference ({device_date}, NCCL; not this run): "
                                                        "median fit error ")
    figure = bandwidth.reference_alpha_beta()
    assert figure.axes[0].get_title() == f"GPU reference: {device_date} (NCCL; not this run)"
    assert bandwidth.reference_alpha_beta("no-such-reference") is None


def _share_rows(shares: dict, calls: dict, link: str = "10 Gb/s") -> list[dict]:
    """What-if rows (:func:`bandwidth.what_if`'s shape) at one slow link and one fast one: (stage, accum) -> share."""
    found = []
    for (stage, accum), share in shares.items():
        p = bandwidth.StepProfile("p", stage, accum, 4, 2, 0.01, {"all_reduce": {"count": calls[(stage, accum)], "bytes": 1}})
        found += [{"profile": p, "link": link, "bandwidth": 1.25e9, "comm_share": share},
                  {"profile": p, "link": "NVLink 4", "bandwidth": 450e9, "comm_share": share / 10}]
    return found


def test_the_accumulation_share_reading_compares_zero1_and_zero2_at_the_slowest_link():
    rows = _share_rows({(1, 1): 0.92, (1, 4): 0.80, (2, 1): 0.92, (2, 4): 0.91},
                       {(1, 1): 4, (1, 4): 4, (2, 1): 4, (2, 4): 7})
    assert bandwidth.accumulation_share_reading(rows) == (
        "At 10 Gb/s, accumulation 4 against 1 takes ZeRO-1's share of the step spent communicating from 92% to 80%, "
        "and ZeRO-2's only from 92% to 91%: collective calls per optimizer step, ZeRO-1 4 either way, ZeRO-2 7 against "
        "4, since it all-reduces the gradients in every micro-step.")
    more = _share_rows({(1, 1): 0.50, (1, 4): 0.45, (2, 1): 0.50, (2, 4): 0.30},
                       {(1, 1): 3, (1, 4): 4, (2, 1): 3, (2, 4): 6})
    assert "and ZeRO-2's from 50% to 30%" in bandwidth.accumulation_share_reading(more)
    assert "ZeRO-1 4 against 3" in bandwidth.accumulation_share_reading(more)
    assert bandwidth.accumulation_share_reading(rows[:4]) == ""  # no ZeRO-2 rows: nothing to compare
    rising = _share_rows({(1, 1): 0.31, (1, 4): 0.18, (2, 1): 0.30, (2, 4): 0.31},
                         {(1, 1): 3, (1, 4): 3, (2, 1): 3, (2, 4): 6})
    assert "and ZeRO-2's up from 30% to 31%" in bandwidth.accumulation_share_reading(rising)
    assert "\nAt 10 Gb/s, accumulation 4 against 1" in bandwidth.reference_what_if()


def _link_row(name: str, nominal: float | None, bound: float | None) -> dict:
    return {"name": name, "batch": 32, "fast_s": 0.1, "slow_s": 0.4, "predicted_s": 0.5, "nominal_s": nominal,
            "overlap_bound_s": bound}


def test_the_slow_link_table_names_its_links_and_explains_a_predicted_range():
    plain = bandwidth.slow_link_table([_link_row("zero1-acc4", 0.45, None)]).splitlines()
    assert "fast link step ms" in plain[0] and "set-rate step ms" in plain[0] and plain[2].split()[-3] == "450"
    assert len(plain) == 3  # no range, no line under the table
    gpu = bandwidth.slow_link_table([_link_row("zero2-acc4-overlap-on", None, 0.3)], "NVLink", "sockets").splitlines()
    assert gpu[0].split() == ["run", "batch", "NVLink", "step", "ms", "sockets", "step", "ms", "predicted", "step", "ms",
                              "samples/s", "NVLink", "samples/s", "sockets"]  # no set rate: no column for it
    assert gpu[2].split()[4:7] == ["300", "..", "500"]
    assert gpu[3].startswith("A range 'a .. b' is the prediction for the overlap_comm off/on runs")


def test_the_reference_comparison_and_worked_row_name_the_references_model_and_precision():
    device, date, _, found = references.reference_runs("bandwidth-nvlink")[0]
    runs = bandwidth.logged_runs(found)
    first = next(iter(runs.values()))
    assert bandwidth.reference_comparison().splitlines()[0].endswith(
        f"({first.model_name}, {first.precision}; not this run):")
    zero0 = runs["zero0-acc4"]
    assert bandwidth.reference_worked_row().startswith(
        f"zero0-acc4 ({device}, {date}, {zero0.model_name} {zero0.precision}; not this run, 2 ranks), one optimizer step:")


def test_the_kept_cores_view_keeps_only_calls_whose_ranks_hardly_waited_and_fits_the_line_on_them():
    known = {"all_reduce": (100e-6, 1 / 2e9)}
    bench = _with_times(_synthetic_benchmark(2, known))
    for p in bench["results"]:  # the middle call of every point waited 4 ms for a core
        p["times"] = [p["seconds"], p["seconds"] + 4e-3, p["seconds"] * 1.01]
        p["core_wait"] = [0.0, 4e-3, 0.1 * p["seconds"]]  # the last waited, but under bandwidth.WAITED of its time
        p["seconds"] = p["times"][2]  # the median of the three calls
    calm = bandwidth.kept_cores(bench)
    assert all(p["times"] == [q["times"][0], q["times"][2]] for p, q in zip(calm["results"], bench["results"]))
    model = bandwidth.CommModel.from_benchmark(calm)
    assert model.fits["all_reduce"].alpha == pytest.approx(100e-6, rel=0.02)
    assert model.source.endswith("calls whose ranks kept their cores")
    point = calm["results"][0]
    assert point["busbw"] * point["seconds"] == pytest.approx(point["wire_bytes"])
    everyone = dict(bench, results=[dict(p, core_wait=[1.0] * 3) for p in bench["results"]])
    assert [p["seconds"] for p in bandwidth.kept_cores(everyone)["results"]] == \
        [min(p["times"]) for p in bench["results"]]  # every call waited: the fastest stands in
    assert bandwidth.kept_cores(everyone)["selection"] == bandwidth.NONE_KEPT
    assert bandwidth.kept_cores_warning(bandwidth.kept_cores(everyone)).startswith("No call of this benchmark kept")
    assert calm["selection"] == bandwidth.KEPT and bandwidth.kept_cores_warning(calm) == ""
    first_kept = dict(bench, results=[dict(p, core_wait=p["core_wait"] if i == 0 else [1.0] * 3)
                                      for i, p in enumerate(bench["results"])])
    mixed = bandwidth.kept_cores(first_kept)  # one point had calls that kept their cores, the others none
    assert mixed["selection"] == f"1 of {len(bench['results'])} points from calls whose ranks kept their cores, " \
        "the rest their fastest call" and bandwidth.kept_cores_warning(mixed) == ""
    counted_nowhere = _with_times(_synthetic_benchmark(2, known))
    assert bandwidth.kept_cores(counted_nowhere) is counted_nowhere


def test_the_core_wait_table_and_reading_split_the_calls_by_whether_their_ranks_waited_for_a_core():
    bench = _with_times(_synthetic_benchmark(2, {"all_reduce": (100e-6, 1 / 2e9)}))
    for p in bench["results"]:
        p["times"] = [1e-4, 5e-3, 1.1e-4, 1e-4]
        p["core_wait"] = [0.0, 4e-3, 1e-4, 1e-5]  # the second and third waited over 20% of their time
    table = bandwidth.core_wait_table(bench)
    assert "2 of 4" in table and "2,555" in table and "55" in table  # waited: median of 5 ms and 0.11 ms
    points = len(bench["results"])
    assert bandwidth.core_wait_reading(bench) == (
        f"Calls slower than 3x their point's fastest call: {points} of {2 * points} (50%) of the calls whose ranks "
        f"waited for a core, 0 of {2 * points} (0%) of the others.")
    everyone = dict(bench, results=[dict(p, core_wait=[1.0] * 4) for p in bench["results"]])
    assert bandwidth.core_wait_reading(everyone).endswith(
        "every call's ranks waited for a core, so the fits use the fastest call per point (no call kept its cores).")
    assert "did not record" in bandwidth.core_wait_reading(_with_times(_synthetic_benchmark(2, {"all_reduce": (1e-4, 1e-9)})))


def test_a_timed_call_reads_how_long_its_threads_waited_for_a_core(monkeypatch):
    monkeypatch.setattr(bandwidth.tdist, "barrier", lambda: None)  # one process here: no peer to wait for
    seconds, waited = bandwidth._timed_with_core_wait(lambda call: (call(), 0.5)[1], lambda: sum(range(10**5)))
    assert seconds == 0.5 and waited >= 0.0
    assert bandwidth._core_wait_ns(), "Linux keeps /proc/self/task/*/schedstat"


def test_the_accumulation_exercise_picks_the_stage_whose_calls_per_step_do_not_grow():
    class Run:  # what the exercise reads of a record: its collectives per optimizer step
        def __init__(self, counts: dict):
            self.counts = counts

        def comm_ops(self) -> dict:
            return {op: {"count": n, "bytes": 4 * n} for op, n in self.counts.items()}

    run = Run
    runs = {"zero1-acc1": run({"all_reduce": 2, "all_gather": 1}), "zero1-acc4": run({"all_reduce": 2, "all_gather": 1}),
            "zero2-acc1": run({"all_reduce": 2, "all_gather": 1}), "zero2-acc4": run({"all_reduce": 5, "all_gather": 1})}
    assert bandwidth.exercise_accumulation_gain("ZeRO-1", runs)
    assert not bandwidth.exercise_accumulation_gain("ZeRO-2", runs)
    assert not bandwidth.exercise_accumulation_gain(..., runs).answered
    assert "not one of the choices" in str(bandwidth.exercise_accumulation_gain("ZeRO-3", runs))
    swapped = {"zero1-acc1": runs["zero2-acc1"], "zero1-acc4": runs["zero2-acc4"],
               "zero2-acc1": runs["zero1-acc1"], "zero2-acc4": runs["zero1-acc4"]}
    assert bandwidth.exercise_accumulation_gain("ZeRO-2", swapped)
    assert "ZeRO-1 3 at accumulation 1, 3 at 4; ZeRO-2 3 at accumulation 1, 6 at 4" in \
        str(bandwidth.exercise_accumulation_gain("ZeRO-1", runs))
