"""helpers.topics.accumulation and helpers.topics.bandwidth tables and checks, on hand-built records (no launches)."""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from typing import Sequence

import pytest

from helpers.core import load_guard, models, records
from helpers.topics import accumulation, bandwidth
from test_records import minimal_summary

AR, AG = "all_reduce", "all_gather_into_tensor"


def _run(stage: int, accum: int, micro: int, ops: dict, losses=(1.0, 0.75), phases: dict | None = None) -> records.Record:
    s = minimal_summary()
    s.update(zero_stage=stage, grad_accum=accum, micro_batch=micro, train_batch=micro * accum * s["world_size"],
             losses=list(losses), name=f"zero{stage}-acc{accum}")
    s["comm"]["by_op"] = {op: {"count": float(c), "bytes": float(b)} for op, (c, b) in ops.items()}
    s["comm"]["bytes_per_step"] = float(sum(b for _, b in ops.values()))
    if phases is not None:
        s["probes"] = list(records.LEGACY_PROBES) + ["micro_steps"]
        s["micro_steps"] = {"phases": list(phases), "by_phase": phases, "wall_s_by_phase": {p: 0.01 for p in phases},
                            "comm_s_per_step": 0.0}
    return records.Record(s)


def _write(folder, name: str, r: records.Record) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "summary.json").write_text(json.dumps(r.summary))


def test_load_grid_reads_the_scripts_records_by_name_and_names_what_is_missing(tmp_path):
    for stage in (0, 2):
        for accum in (1, 2):
            _write(tmp_path, accumulation.run_name(stage, accum), _run(stage, accum, 16 // accum, {AR: (1, 8)}))
    grid_args = dict(stages=(0, 2), accumulations=(1, 2), fixed_micro=(2,))
    with pytest.raises(ValueError, match="no record of zero0-acc2-micro16, zero2-acc2-micro16"):
        accumulation.load_grid(tmp_path, **grid_args)
    for stage in (0, 2):
        _write(tmp_path, accumulation.run_name(stage, 2, 16), _run(stage, 2, 16, {AR: (2, 16)}))
    grid = accumulation.load_grid(tmp_path, **grid_args)
    assert grid.global_batch == 32 and grid.micro_batch == 16
    assert list(grid.fixed_micro) == [(0, 1), (0, 2), (2, 1), (2, 2)]
    assert grid.fixed_micro[(2, 2)]["train_batch"] == 64 and grid.fixed_micro[(2, 1)] is grid.fixed_global[(2, 1)]
    _write(tmp_path / "edited", "zero0-acc1", _run(0, 1, 16, {AR: (1, 8)}))
    _write(tmp_path / "edited", "zero0-acc2", _run(0, 2, 4, {AR: (1, 8)}))  # an edited script: 16 samples, not 32
    _write(tmp_path / "edited", "zero0-acc2-micro16", _run(0, 2, 16, {AR: (1, 8)}))
    with pytest.raises(ValueError, match=r"global batches \[16, 32\]"):
        accumulation.load_grid(tmp_path / "edited", stages=(0,), accumulations=(1, 2), fixed_micro=(2,))


def test_overrides_turn_on_half_precision_only_when_asked():
    assert accumulation.overrides(8, 4) == {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}
    assert accumulation.overrides(8, 4, "bf16")["bf16"] == {"enabled": True}


def test_comm_table_gives_bytes_per_sample_relative_to_accumulation_one():
    runs = {(2, 1): _run(2, 1, 16, {AR: (2, 2000), AG: (1, 1000)}),
            (2, 4): _run(2, 4, 4, {AR: (5, 8000), AG: (1, 1000)}),
            (1, 4): _run(1, 4, 4, {AR: (2, 2000), AG: (1, 1000)})}
    lines = accumulation.comm_table(runs).splitlines()
    assert lines[2].split()[-1] == "1.00x"
    assert lines[3].split()[-1] == "3.00x"  # (8000 + 1000) / (2000 + 1000), same batch of 32
    assert lines[4].split()[-1] == "-"  # no accumulation-1 run of stage 1 to compare with
    assert "4 x 4 x 2 = 32" in lines[3] and "all_gather:1 all_reduce:5" in lines[3]


def test_comm_table_short_names_drop_every_tensor_suffix():
    rs = "reduce_scatter_tensor"
    runs = {(3, 4): _run(3, 4, 4, {AG: (4, 4000), rs: (4, 8000)})}
    assert "all_gather:4 reduce_scatter_tensor:4" in accumulation.comm_table(runs)
    assert "all_gather:4 reduce_scatter:4" in accumulation.comm_table(runs, short_names=True)


def test_where_table_reads_the_phases_off_the_boundary_on_it_and_in_the_optimizer_step():
    ar = {AR: {"count": 1, "bytes": 2000, "seconds": 0.001}}
    phases = {"micro-step 1": ar, "micro-step 2": ar, "micro-step 3": ar, "micro-step 4": ar,
              "optimizer step": {AG: {"count": 1, "bytes": 1000, "seconds": 0.001}}}
    quiet = {"micro-step 1": {}, "micro-step 2": {}, "micro-step 3": {}, "micro-step 4": ar, "optimizer step": {}}
    runs = {(2, 4): _run(2, 4, 4, {AR: (4, 8000)}, phases=phases), (0, 4): _run(0, 4, 4, {AR: (1, 2000)}, phases=quiet)}
    lines = accumulation.where_table(runs, 4).splitlines()
    assert lines[2].split() == ["ZeRO-2", "all_reduce:1", "all_reduce:1", "all_gather:1"]
    assert lines[3].split() == ["ZeRO-0", "-", "all_reduce:1", "-"]
    assert "micro-step 4" in accumulation.phase_table(runs[(2, 4)])


def test_loss_table_states_agreement_within_the_tolerance_and_says_when_not():
    base = _run(0, 1, 16, {AR: (1, 10)}, losses=(1.0, 0.75))
    close = _run(0, 2, 8, {AR: (1, 10)}, losses=(1.0 + 4e-7, 0.75))
    far = _run(0, 4, 4, {AR: (1, 10)}, losses=(1.0, 0.7501))
    lines = accumulation.loss_table({(0, 1): base, (0, 2): close, (0, 4): far}).splitlines()
    assert lines[2].endswith("within 1e-06") and lines[3].endswith("differ by more than 1e-06")


def test_same_collectives_table_compares_the_two_ways_of_accumulating():
    a = _run(1, 4, 4, {AR: (2, 2000)})
    b = _run(1, 4, 16, {AR: (2, 2000)})
    c = _run(2, 4, 16, {AR: (5, 9000)})
    grid = accumulation.Grid({(1, 4): a, (2, 4): _run(2, 4, 4, {AR: (5, 8000)})}, {(1, 4): b, (2, 4): c}, 32, 16)
    lines = accumulation.same_collectives_table(grid).splitlines()
    assert lines[2].split()[-1] == "yes" and lines[3].split()[-1] == "no"


def test_claim_table_gives_tokens_per_second_and_the_speedup_over_accumulation_one():
    one, four = _run(2, 1, 8, {AR: (1, 1)}), _run(2, 4, 8, {AR: (4, 4)})
    one.summary["samples_per_s"], four.summary["samples_per_s"] = 100.0, 135.0  # over every step: not the basis
    # 8 x 1 x 2 = 16 and 8 x 4 x 2 = 64 samples a step; the 9 s warm-up step left out, as the verdicts do
    one.summary["step_time_s"] = {"median": 0.2, "all": [9.0, 0.16, 0.16, 0.16]}
    four.summary["step_time_s"] = {"median": 0.5, "all": [9.0, 0.50, 0.48, 0.52]}
    lines = accumulation.claim_table({"zero2-acc1": one, "zero2-acc4": four}, tokens_per_sample=1024).splitlines()
    assert "after step 1" in lines[0]
    assert "102,400" in lines[2] and "1.00x" in lines[2]
    assert "131,072" in lines[3] and "1.28x" in lines[3]


ALONE = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
BUSY = load_guard.Load("cpu", 3, 0.4, 2, 10.0, 20, "test")


def _timed(stage: int, accum: int, times: list[float], micro: int = 8) -> records.Record:
    r = _run(stage, accum, micro, {AR: (1, 1)})
    r.summary["step_time_s"] = {"median": sorted(times)[len(times) // 2], "all": times}
    return r


def test_seconds_per_sample_leave_out_the_warm_up_step_and_divide_by_the_global_batch():
    r = _timed(2, 4, [9.0, 0.64, 0.32])  # 8 x 4 x 2 = 64 samples per step
    assert accumulation.seconds_per_sample(r) == [0.01, 0.005]


@pytest.mark.parametrize("speedup, verdict", [(1.15, "15% faster, 0.5 of the article's 30%, so the data supports a gain "
                                                      "but not the article's figure"),
                                               (1.32, "about the article's 30%, so the data supports its figure"),
                                               (0.8, "slower, so the data contradicts the article's claim")])
def test_the_claims_verdict_is_given_alone_and_beyond_the_spread_against_the_articles_30_percent(speedup, verdict):
    one = _timed(2, 1, [5.0, 0.100, 0.101, 0.099])  # 16 samples a step
    four = _timed(2, 4, [5.0, *(4 * 0.1 / speedup * k for k in (1.0, 1.01, 0.99))])  # 64 samples a step
    lines = accumulation.claim_verdict({"a": one, "b": four}, ALONE, "Test GPU (today)").splitlines()
    assert lines[0] == "Test GPU (today): samples/s at accumulation 4 against 1, the micro batch fixed (steps after the first):"
    assert lines[1] == f"- ZeRO-2: {speedup:.2f}x, beyond the steps' spread (2%): {verdict}."


def test_the_claims_verdict_is_withheld_under_load_within_the_spread_or_with_too_few_steps():
    one, four = _timed(0, 1, [5.0, 0.10, 0.11, 0.09]), _timed(0, 4, [5.0, 0.30, 0.31, 0.29])
    busy = accumulation.claim_verdict({"a": one, "b": four}, BUSY, "X").splitlines()[1:]
    assert busy == ["- ZeRO-0: 1.33x",
                    "Verdict withheld for ZeRO-0: other processes (3) used 40% of the 2 cores' time during the run."]
    unknown = accumulation.claim_verdict({"a": one, "b": four}, None, "X").splitlines()[-1]
    assert unknown == "Verdict withheld for ZeRO-0: nothing recorded what else used the devices during the run."
    assert accumulation.claim_verdict({"a": one, "b": four}, None, "X", unrecorded="no log").endswith(": no log.")
    noisy = _timed(0, 4, [5.0, 0.30, 0.40, 0.25])
    assert "within the steps' spread" in accumulation.claim_verdict({"a": one, "b": noisy}, ALONE, "X")
    few = accumulation.speed_verdict(_timed(0, 1, [5.0, 0.1]), _timed(0, 4, [5.0, 0.2]), ALONE)
    assert not few.given and few.withheld == "1 timed step per run after the first, fewer than the 3 a spread needs"


def test_the_load_travels_with_the_claims_records_and_a_reference_without_one_is_withheld(monkeypatch):
    one, four = _timed(2, 1, [5.0, 0.10, 0.101, 0.099]), _timed(2, 4, [5.0, 0.30, 0.301, 0.299])
    assert accumulation.load_of({"a": one, "b": four}) is None
    one.summary["load"] = dataclasses.asdict(BUSY)
    assert accumulation.load_of({"a": one, "b": four}) == BUSY
    del one.summary["load"]
    monkeypatch.setattr(accumulation.references, "reference_runs", lambda name: [("2 x GPU", "2026-01-01", "", {"a": one, "b": four})])
    monkeypatch.setattr(accumulation.references, "reference_conditions", lambda name: ["another job ran"])
    lines = accumulation.reference_verdicts("claim").splitlines()
    assert lines[0].startswith("Committed reference, 2 x GPU (2026-01-01): ")
    assert lines[2] == ("Verdict withheld for ZeRO-2: the load guard took no samples during that run; its stated "
                        "conditions name another job on the machine.")
    assert lines[3].endswith("another job ran")


def test_withheld_verdicts_give_one_sentence_per_reason_naming_their_stages():
    runs = {}
    for stage in (0, 1, 3):
        runs[f"{stage}-1"] = _timed(stage, 1, [5.0, 0.10, 0.11, 0.09])
        runs[f"{stage}-4"] = _timed(stage, 4, [5.0, 0.30, 0.31, 0.29])
    lines = accumulation.claim_verdict(runs, BUSY, "X").splitlines()
    withheld = [line for line in lines if line.startswith("Verdict withheld")]
    assert withheld == ["Verdict withheld for ZeRO-0, ZeRO-1 and ZeRO-3: other processes (3) used 40% of the 2 cores' "
                        "time during the run."]
    noisy = dict(runs, **{f"{s}-4": _timed(s, 4, [5.0, 0.40, 0.10, 0.25]) for s in (0, 3)})  # 60% within 120%
    reasons = [line for line in accumulation.claim_verdict(noisy, ALONE, "X").splitlines() if "withheld" in line]
    assert reasons == ["Verdict withheld for ZeRO-0 and ZeRO-3: the difference (60%) is within the steps' spread (120%)."]
    assert "- ZeRO-1: 1.33x, beyond the steps' spread (20%)." in accumulation.claim_verdict(noisy, ALONE, "X")


@pytest.mark.parametrize("conditions, reason", [
    ("not stated", "the load guard took no samples during that run, and no conditions were stated with it"),
    ("GPUs 2,3; the ladder trained on GPUs 0,1 at the same time",
     "the load guard took no samples during that run; its stated conditions name another job on the machine"),
    ("GPUs 0,1 of a 2-GPU machine", "the load guard took no samples during that run; only its stated conditions say "
                                    "what else ran"),
])
def test_an_unrecorded_load_is_explained_from_the_written_conditions(conditions, reason):
    assert accumulation.unrecorded_reason(conditions) == reason


def test_the_curves_verdict_compares_per_step_over_the_common_steps_and_per_sample_at_the_end():
    curves = {"small": (8, [1.0, 0.9, 0.5, 0.4]), "large": (16, [1.0, 0.8])}
    assert accumulation.curve_verdict(curves, window=16).splitlines() == [
        "per optimizer step, mean loss over the first 2 steps: 0.95 (small), 0.90 (large)",
        "per sample seen, mean loss over the last 16 samples: 0.45 (small), 0.80 (large): small ends lower"]


def test_the_claim_model_is_the_265m_llama_of_the_gpu_experiment():
    config = models.llama_config("llama-265m")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (1024, 16, 32000)
    assert models.sequence_length("llama-265m") == 1024
    assert models.parameters_of("llama-265m") == pytest.approx(265e6, rel=0.005)
    assert models.sequence_length("mlp") == 1
    batch = models.make_batch("llama-265m", [0, 1])
    assert tuple(batch.inputs.shape) == (2, 1024) and int(batch.inputs.max()) < 256


def test_batch_size_curves_see_the_same_samples_in_fewer_steps_and_restore_threads():
    import torch

    threads = torch.get_num_threads()
    curves = accumulation.batch_size_curves({"small": 8, "large": 32}, samples=64, model="linear")
    assert [len(losses) for _, losses in curves.values()] == [8, 2]
    assert torch.get_num_threads() == threads
    assert "mean loss, last 16 samples" in accumulation.curve_summary(curves, window=16)


# --- helpers.topics.bandwidth ----------------------------------------------------------------------------

def _link_row(name: str, stage: int, accum: int, fast_ms: float, slow_ms: float, bound_ms: float | None = None,
              predicted_ms: float = 0.0) -> dict:
    return {"name": name, "stage": stage, "accum": accum, "batch": 8 * accum, "fast_s": fast_ms / 1e3,
            "slow_s": slow_ms / 1e3, "predicted_s": predicted_ms / 1e3,
            "overlap_bound_s": None if bound_ms is None else bound_ms / 1e3}


def test_link_findings_give_accumulation_and_overlap_from_the_rows():
    rows = [_link_row("zero1-acc1", 1, 1, 10, 100), _link_row("zero1-acc4", 1, 4, 40, 130),
            _link_row("zero2-acc4-overlap-off", 2, 4, 50, 200, 180, 300),
            _link_row("zero2-acc4-overlap-on", 2, 4, 45, 220, 180, 300)]
    lines = bandwidth.link_findings(rows, fast="NVLink", slow="sockets").splitlines()
    assert lines[0] == "ZeRO-1, accumulation 4 against 1: 3.08x the samples/s over sockets, 1.00x over NVLink."
    assert lines[1].startswith("overlap_comm at ZeRO-2, accumulation 4, on against off: 45.0 against 50.0 ms a step "
                               "over NVLink (-10%), 220 against 200 ms over sockets (+10%; the model's range there: "
                               "180 ms with perfect overlap to 300 ms with none)")
    assert lines[2] == "So overlap_comm shortened the step over NVLink and lengthened it over sockets."
    rows[2]["slow_s"] = 0.170  # faster than the model's perfect overlap
    assert "below the model's perfect-overlap bound" in bandwidth.link_findings(rows)
    assert bandwidth.link_findings(rows, streams=False).splitlines()[-1] == (
        "These ranks have no streams to overlap on, so the two rows differ by this machine's noise only.")


def _timed_row(name: str, stage: int, accum: int, fast_ms: Sequence[float], slow_ms: Sequence[float]) -> dict:
    """A row of :func:`bandwidth.slow_link_rows` whose steps after the first took ``fast_ms`` and ``slow_ms``."""
    row = _link_row(name, stage, accum, statistics.median(fast_ms), statistics.median(slow_ms), 180, 300)
    return {**row, "fast_each_s": [t / 1e3 for t in fast_ms], "slow_each_s": [t / 1e3 for t in slow_ms]}


def test_link_findings_judge_each_link_under_its_own_load():
    rows = [_timed_row("zero1-acc1", 1, 1, [10, 10.2, 9.9], [100, 101, 99]),
            _timed_row("zero1-acc4", 1, 4, [30, 30.5, 29.8], [130, 131, 129]),
            _timed_row("zero2-acc4-overlap-off", 2, 4, [50, 50.5, 49.8], [200, 202, 199]),
            _timed_row("zero2-acc4-overlap-on", 2, 4, [45, 45.3, 44.9], [220, 221, 219])]
    alone = load_guard.Load.from_conditions("executed by check-gpu, alone")
    beside = load_guard.Load.from_conditions("check-gpu ran three notebooks at a time here")
    both = bandwidth.link_findings(rows, fast="NVLink", slow="sockets", loads={"fast": alone, "slow": alone})
    assert "Load guard: every verdict over NVLink given (beyond the steps' spread); every verdict over sockets given" in both
    assert both.endswith("So overlap_comm shortened the step over NVLink and lengthened it over sockets.")
    one = bandwidth.link_findings(rows, fast="NVLink", slow="sockets", loads={"fast": alone, "slow": beside})
    assert "its verdicts over sockets withheld (not measured alone)" in one
    assert one.endswith("So overlap_comm shortened the step over NVLink.")  # nothing said of the link not alone
    rows[1]["fast_each_s"] = rows[1]["fast_each_s"][:2]  # two measured steps: no spread
    few = bandwidth.link_findings(rows, fast="NVLink", slow="sockets", loads={"fast": alone, "slow": beside})
    assert "some verdicts over NVLink withheld (too few measured steps to judge)" in few
    rows[2]["slow_s"] = 0.170  # below the model's perfect-overlap bound, on a link not measured alone: not judged
    assert "perfect-overlap bound" not in bandwidth.link_findings(rows, loads={"fast": alone, "slow": beside})


def test_the_references_overlap_sentences_go_through_the_load_guard():
    text = bandwidth.reference_findings(capstone=False)
    # NVLink: alone on its own GPUs by its conditions, but 3 steps a run leave 2 measured; sockets: beside notebooks
    assert ("Load guard: its verdicts over NVLink withheld (too few measured steps to judge); its verdicts over "
            "sockets withheld (not measured alone)") in text
    assert "So overlap_comm" not in text
    brief = bandwidth.overlap_brief().splitlines()[0]
    assert "verdict withheld: too few measured steps" in brief and "verdict withheld: not measured alone" in brief


def test_the_count_of_overlap_gains_takes_both_links_and_the_capstones_verdicts(monkeypatch):
    ladder = {"ladder": {"candidates": [
        {"rung": "overlap", "label": "best so far, again", "verdict": "best so far", "setting": {"stage": 2}},
        {"rung": "overlap", "label": "overlap_comm", "verdict": "dropped: -6.6%, not above the 2.0% margin",
         "setting": {"stage": 2}},
        {"rung": "overlap", "label": "overlap_comm, buckets 2e8", "verdict": "kept: +3.0%", "setting": {"stage": 2}}]}}
    monkeypatch.setattr(bandwidth.references, "reference_runs",
                        lambda name: [("2 x GPU", "today", "", ladder)] if name == "capstone-ladder-1.2b" else [])
    found = bandwidth.overlap_in_capstone()
    assert [gain for _, gain in found] == [pytest.approx(-0.066), pytest.approx(0.03)]
    assert found[0][0] == ("capstone-ladder-1.2b on 2 x GPU (today), ZeRO-2, overlap_comm: -6.6% samples/s against "
                           "the ladder's best so far; a setting is kept only above +2.0% (the ladder's noise margin), "
                           "so it was dropped")
    assert found[1][0].endswith("overlap_comm, buckets 2e8: kept: +3.0%")  # a kept one keeps its verdict
    assert bandwidth.reference_findings().splitlines()[-1] == (
        "overlap_comm made training faster in 1 of these 2 measurements with a verdict.")


@pytest.mark.parametrize("kwargs, match", [({"ops": ("all_to_all",)}, "ops"), ({"implementations": ("nccl",)}, "implementations"),
                                           ({"sizes": (8,)}, "sizes"), ({"sizes": (2**33,)}, "sizes"),
                                           ({"iters": 0}, "iters"), ({"dtype": "int8"}, "dtype"),
                                           ({"baseline_ops": ("gather",)}, "baseline_ops")])
def test_a_bad_benchmark_is_refused_before_launch(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bandwidth.spec(is_gpu=False, **kwargs)


def test_benchmark_defaults_depend_on_the_device():
    cpu = bandwidth.spec(is_gpu=False).config["collectives"]
    gpu = bandwidth.spec(is_gpu=True).config["collectives"]
    assert cpu["sizes"][0] == gpu["sizes"][0] == 1024
    assert cpu["sizes"][-1] == 4 * 2**20 and gpu["sizes"][-1] == 2**30
    assert cpu["baseline_ops"] == ["all_reduce"] and gpu["baseline_ops"] == list(bandwidth.OPS)
    spec = bandwidth.spec("b", is_gpu=False)
    assert spec.task == bandwidth.TASK and spec.probes == () and spec.check is False


def _bench(points: list[tuple[str, str, int, float]], world: int = 2) -> dict:
    from helpers.core import theory

    return {"world_size": world, "device": "cuda", "device_name": "GPU", "backend": "nccl",
            "implementations": sorted({p[0] for p in points}),
            "results": [{"implementation": i, "op": op, "bytes": size, "seconds": t,
                         "busbw": theory.bus_bandwidth(op, size, t, world),
                         "wire_bytes": bandwidth.wire_bytes(op, size, world), "interface_bytes_sent": None}
                        for i, op, size, t in points]}


def test_target_table_says_met_or_missed_at_each_size():
    mib256, gib = 256 * 2**20, 2**30
    bench = _bench([("deepspeed.comm", "all_reduce", mib256, 1.00e-3), ("torch.distributed", "all_reduce", mib256, 0.96e-3),
                    ("deepspeed.comm", "all_reduce", gib, 4.4e-3), ("torch.distributed", "all_reduce", gib, 4.0e-3)])
    lines = bandwidth.target_table(bench).splitlines()
    assert lines[2].split()[-1] == "met" and lines[3].split()[-1] == "missed"
    assert bandwidth.ratio(bench, "all_reduce", "deepspeed.comm", "torch.distributed", gib) == pytest.approx(4.0 / 4.4)
    small = _bench([("deepspeed.comm", "all_reduce", 2**20, 1e-4), ("torch.distributed", "all_reduce", 2**20, 1e-4)])
    assert "not measured" in bandwidth.target_table(small)


def test_coverage_and_point_lookup():
    bench = _bench([("deepspeed.comm", "all_gather", 4096, 1e-5), ("deepspeed.comm", "all_gather", 65536, 2e-5)])
    assert bandwidth.coverage_table(bench).splitlines()[2].split()[:3] == ["all_gather", "deepspeed.comm", "2"]
    assert bandwidth.point(bench, "deepspeed.comm", "all_gather", 60000)["bytes"] == 65536
    with pytest.raises(KeyError, match="torch.distributed"):
        bandwidth.point(bench, "torch.distributed", "all_gather", 4096)
    assert "no interface counters" in bandwidth.wire_check_table(bench)
    both = copy.deepcopy(bench)
    both["results"][0]["interface_bytes_sent"] = 4096.0
    assert bandwidth.wire_check_table(both, "all_gather").splitlines()[2].split()[-1] == "2.00"  # 4 KiB sent for 2 KiB of ring


def test_gpu_reference_commands_refuse_a_machine_without_gpus(capsys):
    from helpers.core import environment
    from helpers import __main__ as cli

    if environment.detect().is_gpu:
        pytest.skip("this machine has GPUs: the command would measure")
    assert cli.main(["reference", "grad-accum-claim"]) == 2
    assert cli.main(["reference", "bandwidth-sockets"]) == 2
    assert "need GPUs" in capsys.readouterr().err


# --- the exercises of chapter 08 ---------------------------------------------------------------------

def _phased(stage: int, accum: int, micro: int, grad: float, once: float, every_micro: bool) -> records.Record:
    """A run whose gradient all_reduce (``grad`` bytes) comes in every micro-step or only the last; ``once``
    bytes in the optimizer step."""
    phases = {f"micro-step {i}": ({AR: {"count": 1.0, "bytes": grad}} if every_micro or i == accum else {})
              for i in range(1, accum + 1)}
    phases["optimizer step"] = {AG: {"count": 1.0, "bytes": once}}
    count = accum if every_micro else 1
    return _run(stage, accum, micro, {AR: (count, count * grad), AG: (1, once)}, phases=phases)


def test_the_step_growth_exercise_reads_both_stages_from_the_records():
    runs = {(s, a): _phased(s, a, 16 // a, 400.0, 200.0, s == 2) for s in (1, 2) for a in (1, 8)}
    grid = accumulation.Grid(runs, {}, 32, 16)
    check = lambda answer: accumulation.exercise_step_growth(answer, grid)
    assert not check(...).answered and "to do" in str(check(...))
    right = check({1: 1.0, 2: (8 * 400 + 200) / 600})
    assert right and "ZeRO-2 5.67x" in str(right) and "micro-step 8 400" in str(right)
    assert not check({1: 8.0, 2: 8.0}) and "Hint" in str(check({1: 8.0, 2: 8.0}))
    assert "one factor per stage" in str(check(5.67))


def test_the_bytes_floor_exercise_takes_the_repeating_phase_over_a_whole_step_at_accumulation_one():
    one, four = _phased(2, 1, 16, 400.0, 200.0, True), _phased(2, 4, 16, 400.0, 200.0, True)
    grid = accumulation.Grid({}, {(2, 1): one, (2, 4): four}, 32, 16)
    check = lambda answer: accumulation.exercise_bytes_floor(answer, grid)
    assert not check(...).answered and "without bound" in str(check(...))
    right = check(400 / 600)
    assert right and "400 / 600 = 0.67x" in str(right) and "Measured at accumulation 4: 0.75x" in str(right)
    assert not check(0.75) and "Hint" in str(check(0.75))  # accumulation 4's factor, not the limit
    assert not check(0.0)  # stage 0's limit, not stage 2's
    assert "one number" in str(check({2: 0.67}))


def test_timing_table_gives_the_steps_after_the_first_as_the_verdicts_do():
    r = _timed(0, 4, [9.0, 0.30, 0.20, 0.25])  # 8 x 4 x 2 = 64 samples a step; the 9 s warm-up left out
    row = accumulation.timing_table({(0, 4): r}).splitlines()[2].split()
    assert row[3:5] == ["250.0", "256"]


def test_the_step_cost_reading_fits_the_share_paid_once_and_labels_withheld_stages():
    one = _timed(1, 1, [5.0, 0.100, 0.101, 0.099], micro=8)
    four = _timed(1, 4, [5.0, 0.130, 0.131, 0.129], micro=8)  # 4x the samples, 1.3x the time
    noisy = _timed(3, 4, [5.0, 0.40, 0.10, 0.25], micro=8)
    runs = {"a": one, "b": four, "c": _timed(3, 1, [5.0, 0.10, 0.11, 0.09], micro=8), "d": noisy}
    lines = accumulation.step_cost_reading(runs, ALONE, label="Here").splitlines()
    assert lines[0].startswith("Here: a step at accumulation 4 (4x the samples) against one at 1, samples/s")
    # t(1) = once + v, t(4) = once + 4v: once = 0.09 of t(1) = 0.1
    assert lines[1].startswith("The timings of ZeRO-3 cannot be read: the difference")  # before the figures
    assert lines[2] == ("- ZeRO-1: 1.30x as long, 3.08x samples/s; 90% paid once: most of a step is paid once, so 4x "
                        "the samples took only 1.30x the time: accumulation spread that cost")
    assert lines[3] == "- ZeRO-3: 2.50x as long, 1.60x samples/s; 50% paid once"
    assert lines[4] == ("The largest gain with a verdict, ZeRO-1's +208% samples/s, measures this small model on these "
                        "ranks, not the article's 30%.")
    busy = accumulation.step_cost_reading(runs, BUSY).splitlines()
    assert busy[1] == ("The timings of ZeRO-1 and ZeRO-3 cannot be read: other processes (3) used 40% of the 2 cores' "
                       "time during the run.")


def test_the_step_cost_reading_says_what_a_negative_fit_printed_as_zero_means():
    one = _timed(0, 1, [5.0, 0.100, 0.101, 0.099])
    slow = _timed(0, 4, [5.0, 0.600, 0.601, 0.599])  # 4x the samples, 6x the time: once = (4 - 6) / 3 < 0
    lines = accumulation.step_cost_reading({"a": one, "b": slow}, ALONE).splitlines()
    assert lines[1].startswith("- ZeRO-0: 6.00x as long, 0.67x samples/s; 0% paid once: the fit finds nothing paid once")
    assert lines[2].startswith("0% stands for a negative fit: a step at 4 took more than 4x as long as at 1")
    fair = _timed(0, 4, [5.0, 0.300, 0.301, 0.299])
    assert not any(line.startswith("0% stands") for line in
                   accumulation.step_cost_reading({"a": one, "b": fair}, ALONE).splitlines())


def test_bytes_per_sample_ratios_divide_by_the_global_batch_against_accumulation_one():
    runs = {(0, 1): _run(0, 1, 16, {AR: (1, 400)}), (0, 4): _run(0, 4, 16, {AR: (1, 400)}),
            (2, 1): _run(2, 1, 16, {AR: (1, 600)}), (2, 4): _run(2, 4, 16, {AR: (4, 1800)})}
    assert accumulation.bytes_per_sample_ratios(runs) == {0: 0.25, 2: 0.75}


def test_the_reference_conclusion_settles_the_claim_only_with_a_verdict(monkeypatch):
    one, four = _timed(2, 1, [5.0, 0.10, 0.101, 0.099]), _timed(2, 4, [5.0, 0.35, 0.351, 0.349])
    monkeypatch.setattr(accumulation.references, "reference_runs", lambda name: [("2 x GPU", "2026-01-01", "", {"a": one, "b": four})])
    monkeypatch.setattr(accumulation.references, "reference_conditions", lambda name: ["not stated"])
    text = accumulation.reference_conclusion("claim")
    assert text == ("So the committed 2 x GPU run (2026-01-01) measured, in samples/s at accumulation 4 against 1: "
                    "ZeRO-2 1.14x. ZeRO-2 gained +14%, where the article reports about 30%: figures, not a verdict, "
                    "because the load guard took no samples during that run, and no conditions were stated with it.")
    one.summary["load"] = dataclasses.asdict(ALONE)
    assert accumulation.reference_conclusion("claim").endswith(
        "about 30%: 14% faster, 0.5 of the article's 30%, so the data supports a gain but not the article's figure.")


@pytest.mark.parametrize("ratios, reading", [
    ({0: 0.25, 2: 0.75, 3: 1.0}, "they fall from ZeRO-0 to ZeRO-3 in the order the CPU grid's bytes per sample predict "
                                 "(ZeRO-0 0.25x, ZeRO-2 0.75x, ZeRO-3 1.00x: fewer bytes, a larger speed-up)"),
    ({0: 1.0, 2: 0.75, 3: 0.25}, "they do not follow the order the CPU grid's bytes per sample predict"),
])
def test_the_reference_conclusion_reads_the_speedups_against_the_bytes_per_sample(monkeypatch, ratios, reading):
    runs = {}
    for stage, speedup in ((0, 1.4), (2, 1.15), (3, 0.97)):
        runs[f"{stage}-1"] = _timed(stage, 1, [5.0, 0.10, 0.101, 0.099])
        runs[f"{stage}-4"] = _timed(stage, 4, [5.0, *(0.4 / speedup * k for k in (1.0, 1.01, 0.99))])
    monkeypatch.setattr(accumulation.references, "reference_runs", lambda name: [("2 x GPU", "2026-01-01", "", runs)])
    monkeypatch.setattr(accumulation.references, "reference_conditions", lambda name: ["not stated"])
    text = accumulation.reference_conclusion("claim", ratios=ratios)
    assert "ZeRO-0 1.40x, ZeRO-2 1.15x, ZeRO-3 0.97x; " + reading in text
