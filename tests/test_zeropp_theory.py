"""helpers.core.theory's ZeRO++ accounting (arXiv 2306.10209) and latency-bandwidth model, checked by hand."""

from __future__ import annotations

import json
import statistics

import pytest

from helpers.core import load_guard, records, theory
from helpers.topics import compression

PSI = 1_000_000
M = 2 * PSI  # the model in 16-bit bytes


def _across(**flags) -> float:
    return compression.zeropp_cross_node_bytes(PSI, **flags)


def test_zero3_moves_three_models_across_nodes_and_zeropp_three_quarters_of_one():
    assert _across() == 3 * M
    assert _across(qwz=True, hpz=True, qgz=True) == 0.75 * M
    assert _across() / _across(qwz=True, hpz=True, qgz=True) == 4


@pytest.mark.parametrize("flags, expected", [
    ({"qwz": True}, 0.5 + 0.5 + 1),  # int8 weights: both gathers halve
    ({"hpz": True}, 1 + 0 + 1),  # backward gathers inside the node
    ({"qgz": True}, 1 + 1 + 0.25),  # int4 gradients
    ({"qwz": True, "hpz": True}, 0.5 + 0 + 1),
])
def test_each_switch_alone(flags, expected):
    assert _across(**flags) == pytest.approx(expected * M)


def test_on_one_node_nothing_crosses_and_only_qwz_changes_the_bytes():
    plain = compression.zeropp_volume(PSI, nodes=1)
    assert all(v["inter"] == 0 for v in plain.values())
    assert sum(v["intra"] for v in plain.values()) == 3 * M
    # hpZ's node-local group is the node; qgZ falls back to the reduce-scatter (DeepSpeed's stage3.py)
    assert compression.zeropp_volume(PSI, hpz=True, qgz=True, nodes=1) == plain
    halved = compression.zeropp_volume(PSI, qwz=True, nodes=1)
    assert sum(v["intra"] for v in halved.values()) == 2 * M


def test_hpz_and_qgz_keep_part_of_their_traffic_inside_the_node():
    v = compression.zeropp_volume(PSI, qwz=True, hpz=True, qgz=True, nodes=4)
    assert v["backward all-gather"] == {"inter": 0.0, "intra": 0.5 * M}
    assert v["gradient reduce-scatter"] == {"inter": 0.25 * M, "intra": 0.25 * M}
    with pytest.raises(ValueError, match="nodes"):
        compression.zeropp_volume(PSI, nodes=0)


def test_link_costs_latency_per_call_plus_bytes_over_bandwidth():
    link = theory.AlphaBeta.link(bandwidth=1e9, latency=1e-5)
    assert link.seconds(2e9) == pytest.approx(2 + 1e-5)
    assert link.seconds(0, calls=10) == pytest.approx(1e-4)


def test_comm_seconds_by_hand():
    intra, inter = theory.AlphaBeta.link(100e9, 0.0), theory.AlphaBeta.link(10e9, 0.0)
    # two nodes, plain ZeRO-3: 3M across at 10 GB/s
    assert compression.zeropp_comm_seconds(PSI, 1, 2, intra=intra, inter=inter) == pytest.approx(3 * M / 10e9)
    # ZeRO++: 0.75M across, 0.5M (quantized secondary gather) + 0.25M (first qgZ hop) inside
    assert compression.zeropp_comm_seconds(PSI, 1, 2, True, True, True, intra=intra, inter=inter) == pytest.approx(
        0.75 * M / 10e9 + 0.75 * M / 100e9)
    # latency: one per phase, link and layer
    lat = theory.AlphaBeta.link(1e30, 1e-3)
    assert compression.zeropp_comm_seconds(PSI, 10, 2, intra=lat, inter=lat) == pytest.approx(3 * 10 * 1e-3)


def test_step_prediction_gain_grows_as_the_network_slows():
    slow, fast = theory.AlphaBeta.link(1e9, 2e-5), theory.AlphaBeta.link(100e9, 2e-5)
    p_slow = compression.zeropp_step_prediction(7e9, 32, 8192, 2, 400e12, inter=slow)
    p_fast = compression.zeropp_step_prediction(7e9, 32, 8192, 2, 400e12, inter=fast)
    assert p_slow["compute_s"] == pytest.approx(6 * 7e9 * 8192 / 400e12)
    assert 1 < p_fast["speedup"] < p_slow["speedup"] < 4
    assert p_slow["speedup"] == pytest.approx(p_slow["zero3_s"] / p_slow["zeropp_s"])


def test_gpu_table_shows_timing_only_references_and_failures():
    from helpers.core import records
    from test_records import minimal_summary

    def timed(median: float) -> records.Record:
        return records.Record({**minimal_summary(), "step_time_s": {"median": median, "all": [median]}})

    hung = {"error_type": "RunFailed", "message": "train_zeropp.py ran past its timeout of 600 s: stopped"}
    table = compression.gpu_table({}, {"ZeRO-3": timed(0.2), "qwZ (quantized weights)": timed(0.3), "hpZ": hung})
    rows = {line.split("  ")[0]: line for line in table.splitlines()[2:]}
    assert "not measured" in rows["ZeRO-3"] and "200.0" in rows["ZeRO-3"]
    assert "300.0" in rows["qwZ (quantized weights)"] and "1.50" in rows["qwZ (quantized weights)"]
    assert "failed: RunFailed: train_zeropp.py ran past its timeout of 600 s: stopped" in rows["hpZ"]


def test_a_hung_logger_run_shows_every_ranks_innermost_frame_and_a_finished_one_its_cross_check():
    from helpers.core import records
    from test_records import minimal_summary

    stacks = [
        "Stack (most recent call first):",
        '  File "/x/torch/cuda/__init__.py", line 175 in is_available',  # shown: the frame in DeepSpeed below it
        '  File "/x/deepspeed/comm/comm.py", line 120 in log_wrapper',
        '  File "/x/deepspeed/runtime/zero/partition_parameters.py", line 1426 in _all_gather_dtype',
        "Stack (most recent call first):",
        '  File "/x/deepspeed/runtime/zero/stage3.py", line 1300 in __avg_scatter_grads',
    ]
    hung = {"error_type": "Timeout", "message": "not done within 60 s", "where": stacks}  # as a reference keeps it
    op = {"count": 2.0, "bytes": 100.0}
    section = {"by_op": {"all_gather_into_tensor": op}, "bytes_per_step": 100.0, "wire_bytes_per_step": 50.0}
    logged = records.Record({**minimal_summary(), "comm": section, "comm_profiler": section})
    table = compression.logger_check_table({"ZeRO-3, comms logger": logged, "qwZ (quantized weights), comms logger": hung})
    assert "same" in table
    assert "log_wrapper (comm.py:120)" in table and "__avg_scatter_grads (stage3.py:1300)" in table
    assert "is_available" not in table


def test_zeropp_own_cost_is_added_to_its_step_and_never_negative():
    plain = compression.zeropp_step_prediction(7e9, 32, 8192, 2, 400e12)
    costly = compression.zeropp_step_prediction(7e9, 32, 8192, 2, 400e12, overhead_s=0.25)
    assert costly["zero3_s"] == plain["zero3_s"]  # ZeRO-3 does no quantization
    assert costly["zeropp_s"] == pytest.approx(plain["zeropp_s"] + 0.25)
    with pytest.raises(ValueError, match="overhead_s"):
        compression.zeropp_step_prediction(7e9, 32, 8192, 2, 400e12, overhead_s=-1)


# --- the chapter's exercises ----------------------------------------------------------------------

def test_exercise_zeropp_block_needs_one_node_for_hpz_and_the_bytes_of_a_cluster_wide_partition():
    right = {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 8,
             "zero_quantized_gradients": True}

    def answer(block: dict, across: float) -> dict:
        return {"zero_optimization": block, "across_if_whole_cluster": across}

    verdict = compression.exercise_zeropp_block(answer(right, 1.25), gpus_per_node=8, nodes=2)
    assert verdict and "0.75M" in str(verdict) and "1.25M" in str(verdict)
    assert not compression.exercise_zeropp_block(answer(right, 0.75))  # the one-node partition's bytes, not 16's
    too_wide = compression.exercise_zeropp_block(answer({**right, "zero_hpz_partition_size": 16}, 1.25))
    assert not too_wide and "1.25M" not in str(too_wide)  # a wrong block does not give the prediction away
    half_node = compression.exercise_zeropp_block(answer({**right, "zero_hpz_partition_size": 4}, 1.25))
    assert not half_node and "more memory" in str(half_node)
    misspelt = compression.exercise_zeropp_block(answer({"stage": 3, "zero_quantized_weight": True}, 1.25))
    assert not misspelt and "DeepSpeed refuses" in str(misspelt)
    assert not compression.exercise_zeropp_block(answer({**right, "stage": 2}, 1.25))
    assert not compression.exercise_zeropp_block(right)  # the block alone is not the answer
    blank = compression.exercise_zeropp_block(...)
    assert not blank and "to do:" in str(blank)


def test_exercise_cross_node_bytes_is_one_and_a_half_models_for_qwz_and_hpz():
    assert compression.exercise_cross_node_bytes(1.5 * M, PSI)
    assert not compression.exercise_cross_node_bytes(0.75 * M, PSI)
    assert "to do:" in str(compression.exercise_cross_node_bytes(..., PSI))


def _run(ops: dict, steps_s=(0.5, 0.1, 0.1), grad_accum: int = 2, **config) -> records.Record:
    from test_records import minimal_summary

    summary = {**minimal_summary(), "grad_accum": grad_accum, "train_batch": 4 * grad_accum * 2, "config": config,
               "step_time_s": {"median": sorted(steps_s)[len(steps_s) // 2], "all": list(steps_s)}}
    summary["comm"] = {**summary["comm"], "by_op": ops}
    return records.Record(summary)


def test_exercise_half_gradient_bytes_reads_the_bf16_runs_reduce_scatter():
    psi = minimal_summary_params()
    runs = {"16-bit gradients (communication_data_type)": _run(
        {"reduce_scatter_tensor": {"count": 2.0, "bytes": 2 * 2.0 * psi}}, communication_data_type="bf16")}
    assert compression.exercise_half_gradient_bytes(2 * 2 * psi, runs)  # per step: accumulation x 2 bytes x psi
    assert not compression.exercise_half_gradient_bytes(2 * 4 * psi, runs)  # fp32's bytes
    assert not compression.exercise_half_gradient_bytes(..., runs).answered
    refused = {"16-bit gradients (communication_data_type)": compression.Refusal("ValueError", "no")}
    with pytest.raises(ValueError):
        compression.exercise_half_gradient_bytes(1.0, refused)


def minimal_summary_params() -> int:
    from test_records import minimal_summary

    return minimal_summary()["model"]["params"]


def test_chapter_runs_labels_the_scripts_runs_and_keeps_unknown_names(tmp_path):
    for name in ("qwz", "my-setting"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "refused.json").write_text(json.dumps({"type": "ValueError", "message": name}))
    found = compression.chapter_runs(tmp_path)
    assert set(found) == {"qwZ (quantized weights)", "my-setting"}
    assert found["qwZ (quantized weights)"].message == "qwz"


def test_timing_verdict_withholds_without_a_load_and_skips_refused_settings():
    runs = {"ZeRO-3": _run({}, (0.5, 0.10, 0.11, 0.10)), "hpZ (node-local partition)": _run({}, (0.5, 0.30, 0.31, 0.30)),
            "qwZ (quantized weights)": compression.Refusal("ValueError", "no CUDA"),
            "ZeRO-3 again": _run({}, (0.1, 0.10, 0.11, 0.10))}
    unknown = compression.timing_verdict(runs, load_guard.Load.unknown())
    assert "hpZ: Verdict withheld" in unknown and "qwZ" not in unknown
    alone = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
    assert "hpZ: ZeRO-3 is faster" in compression.timing_verdict(runs, alone)
    warmed = {**runs, "ZeRO-3 again": _run({}, (0.3, 0.30, 0.31, 0.30))}
    assert "changed during the sweep" in compression.timing_verdict(warmed, alone)
    assert "ZeRO-3 100 ms first, 300 ms again at the end (3.00x)" in compression.timing_verdict(warmed, alone)


def test_one_node_reading_judges_each_reference_by_its_written_conditions():
    from helpers.core import references

    reading = compression.one_node_reading()
    for (device, date, _, _), written in zip(references.reference_runs("zeropp"),
                                             references.reference_conditions("zeropp")):
        alone = load_guard.Load.from_conditions(written).alone
        start = reading.index(f"{device}, {date} (")
        described = reading[start:reading.index(")", start)]
        assert described.endswith("; alone, by its written conditions") == alone
    assert "nothing recorded what else used" not in reading  # every committed reference states its conditions
    # the 2026-11-26 one ran beside another job on the other two GPUs: alone on its own, but without a repeat
    assert "not measured alone" not in reading
    timing = compression.one_node_reading(timing_only=True)
    assert "the sweep did not measure its first setting (ZeRO-3) again" in timing
    assert len(timing.splitlines()) == 1  # one reason for every setting: one sentence, not one line a setting


def test_one_node_reading_withholds_a_sweep_without_a_repeat_and_judges_one_with_it(monkeypatch):
    from helpers.core import references

    zero_knobs = {"zero_optimization": {"stage3_max_live_parameters": 0}}
    fast, slow = (0.5, 0.10, 0.11, 0.10), (0.5, 0.30, 0.31, 0.30)
    runs = {"time: ZeRO-3": _run({}, fast, **zero_knobs), "time: hpZ (node-local partition)": _run({}, slow),
            "time: qgZ (quantized gradients)": _run({}, slow)}
    sweeps = {"no repeat": runs, "also no repeat": runs, "repeat": {**runs, "time: ZeRO-3 again": _run({}, fast)}}
    monkeypatch.setattr(references, "reference_runs",
                        lambda name: [(f"{n} x GPU", "today", note, found) for n, (note, found) in
                                      enumerate(sweeps.items(), start=2)])
    monkeypatch.setattr(references, "reference_conditions", lambda name: ["alone"] * 3)
    lines = compression.one_node_reading().splitlines()
    judged = [line for line in lines if line.startswith("4 x GPU")]
    assert len(judged) == 2 and all("ZeRO-3 is faster" in line for line in judged)
    merged = [line for line in lines if "did not measure its first setting (ZeRO-3) again at its end" in line]
    assert len(merged) == 1 and "hpZ and qgZ on 2 x GPU" in merged[0] and "and 3 x GPU" in merged[0]
    assert "4 x GPU" not in merged[0]


def test_reference_report_keeps_timing_only_references_apart():
    whole = compression.reference_report()
    timing, rest = compression.reference_report(timing_only=True), compression.reference_report(timing_only=False)
    assert compression.TIMING_ONLY in timing and compression.TIMING_ONLY not in rest
    assert whole.count("Measured on") == timing.count("Measured on") + rest.count("Measured on")
    from helpers.core import records

    if "  <= " in rest:  # a peak that may include earlier runs: the chapter's short footnote, not the generic one
        assert compression.PEAK_FOOTNOTE in rest and records.PEAK_NOTE not in rest


def test_gpu_table_step_column_is_the_median_after_the_first_step():
    from helpers.core import records
    from test_records import minimal_summary

    def timed(steps: list[float]) -> records.Record:
        return records.Record({**minimal_summary(), "step_time_s": {"median": statistics.median(steps), "all": steps}})

    table = compression.gpu_table({}, {"ZeRO-3": timed([5.0, 0.2, 0.2, 0.3]), "qwZ": timed([0.1, 0.4, 0.4, 0.4])})
    assert compression.STEP_HEADER in table
    rows = {line.split("  ")[0]: line for line in table.splitlines()[2:]}
    assert "200.0" in rows["ZeRO-3"] and "400.0" in rows["qwZ"] and "2.00" in rows["qwZ"]


def test_bytes_reading_explains_the_measured_qwz_ratio_from_the_records():
    reading = compression.bytes_reading()
    assert "0.67x" in reading  # the accounting: 3M -> 2M
    from helpers.core import references

    for device, _, _, runs in references.reference_runs("zeropp"):
        plain, qwz = runs.get("bytes: ZeRO-3"), runs.get("bytes: qwZ (quantized weights)")
        if plain is None or isinstance(plain, dict) or qwz is None or isinstance(qwz, dict):
            continue
        gathered = plain.comm_ops()["all_gather_into_tensor"]["bytes"] / (2 * plain.params)  # in M, the model in bf16
        ranks = plain["world_size"]
        assert f"{gathered * ranks:.0f} x M/{ranks} = {gathered:.2f}M" in reading  # forward + backward, a shard each
        assert f"{qwz.comm.bytes_per_step / plain.comm.bytes_per_step:.2f}x" in reading
    assert "2x calls" in reading and "the average call is 0.25x" in reading
    assert "records each call's input tensor" in reading


def test_drift_reading_names_only_settings_beyond_the_no_op_switches_on_every_sweep(monkeypatch):
    from helpers.core import references

    def sweep(hpz: float, qwz: float, zeropp: float) -> dict:
        return {"time: ZeRO-3": _run({}, (0.5, 0.10, 0.10)), "time: hpZ (node-local partition)": _run({}, (0.5, hpz, hpz)),
                "time: qgZ (quantized gradients)": _run({}, (0.5, 0.10, 0.10)),
                "time: qwZ (quantized weights)": _run({}, (0.5, qwz, qwz)),
                "time: ZeRO++ (all three)": _run({}, (0.5, zeropp, zeropp))}

    found = [("2 x GPU", "today", "", sweep(0.13, 0.12, 0.15)), ("4 x GPU", "today", "", sweep(0.10, 0.12, 0.15)),
             ("8 x GPU", "today", compression.TIMING_ONLY, sweep(0.10, 0.50, 0.10))]  # left out: timing-only
    monkeypatch.setattr(references, "reference_runs", lambda name: found)
    lines = compression.drift_reading().splitlines()
    assert len(lines) == 3
    assert "hpZ 1.30x and qgZ 1.00x" in lines[0] and "beyond that range: ZeRO++ 1.50x." in lines[0]
    assert "beyond that range: qwZ 1.20x and ZeRO++ 1.50x." in lines[1]
    assert lines[2].startswith("Beyond the no-op switches on every machine: ZeRO++;")
    found[0] = ("2 x GPU", "today", "", sweep(0.16, 0.12, 0.15))  # now within the 2-GPU sweep's drift
    assert "no setting: these sweeps separate no cost" in compression.drift_reading()

def test_outcome_summary_says_from_the_runs_which_settings_were_refused_idle_or_cut_bytes():
    gather = {"all_gather_into_tensor": {"count": 2.0, "bytes": 4096.0}}
    runs = {"ZeRO-3": _run(gather), "qwZ (quantized weights)": compression.Refusal("ValueError", "no CUDA op"),
            "hpZ (node-local partition)": _run(gather),
            "16-bit gradients (communication_data_type)": _run({**gather, "reduce_scatter_tensor": {"count": 2.0,
                                                                                                     "bytes": 2048.0}}),
            "1-bit Adam": compression.Refusal("AssertionError", "OneBitAdam is not a supported DeepSpeed Optimizer")}
    assert compression.outcome_summary(runs) == (
        "On these 2 gloo ranks (cpu, one node): DeepSpeed refused qwZ; hpZ sent exactly ZeRO-3's collectives and "
        "trained to its losses; 16-bit gradients (reduce_scatter_tensor 0 B -> 2 KiB per step) changed the traffic.")
    quantized = _run({"all_gather_into_tensor": {"count": 2.0, "bytes": 1024.0}})
    quantized.summary["losses"] = [1.0, 0.76]
    trained = {**runs, "qwZ (quantized weights)": quantized}  # where qwZ's CUDA op builds: it trains
    text = compression.outcome_summary(trained)
    assert "refused" not in text and "qwZ (all_gather_into_tensor 4 KiB -> 1 KiB per step)" in text
    assert "1-bit Adam" not in text  # refused everywhere: the markdown says so
