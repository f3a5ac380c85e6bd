"""helpers.topics.accumulation and helpers.topics.bandwidth tables and checks, on hand-built records (no launches)."""

from __future__ import annotations

import copy

import pytest

from helpers.core import launch, models, records
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


def test_grid_specs_keep_the_global_batch_and_name_every_point():
    specs = accumulation.grid_specs(world_size=2, stages=(0, 2), accumulations=(1, 2, 4), fixed_micro=(4,))
    assert list(specs) == ["zero0-acc1", "zero0-acc2", "zero0-acc4", "zero0-acc4-micro16",
                           "zero2-acc1", "zero2-acc2", "zero2-acc4", "zero2-acc4-micro16"]
    for name, spec in specs.items():
        o = spec.overrides
        if "micro" in name:
            assert o["train_micro_batch_size_per_gpu"] == 16
        else:
            assert o["train_micro_batch_size_per_gpu"] * o["gradient_accumulation_steps"] == 16
        assert "micro_steps" in spec.probes and "comm" in spec.probes


def test_an_accumulation_that_does_not_divide_the_batch_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=r"accumulations \[3\]"):
        accumulation.grid_specs(world_size=2, accumulations=(1, 3))
    with pytest.raises(ValueError, match="accumulations"):
        accumulation.run_grid(accumulations=(0,), world_size=2)


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
    one.summary["samples_per_s"], four.summary["samples_per_s"] = 100.0, 135.0
    lines = accumulation.claim_table({"zero2-acc1": one, "zero2-acc4": four}, tokens_per_sample=1024).splitlines()
    assert "102,400" in lines[2] and "1.00x" in lines[2]
    assert "138,240" in lines[3] and "1.35x" in lines[3]


@pytest.mark.parametrize("speedup, verdict", [(1.15, "0.5 of the article's 30%, so the data supports a gain at ZeRO-2 "
                                                      "but not the article's figure"),
                                               (1.32, "about the article's 30%: the data supports its figure"),
                                               (0.97, "not faster, so the data contradicts the article's claim")])
def test_the_claims_verdict_is_drawn_from_the_reference_against_the_articles_30_percent(monkeypatch, speedup, verdict):
    runs = {}
    for stage, rate in ((0, 1.4), (2, speedup), (3, 1.04)):
        one, four = _run(stage, 1, 8, {AR: (1, 1)}), _run(stage, 4, 8, {AR: (4, 4)})
        one.summary["samples_per_s"], four.summary["samples_per_s"] = 100.0, 100.0 * rate
        runs.update({f"zero{stage}-acc1": one, f"zero{stage}-acc4": four})
    monkeypatch.setattr(accumulation.references, "reference_runs", lambda name: [("2 x GPU", "today", "", runs)])
    first, second = accumulation.claim_verdict("claim").splitlines()
    assert first.endswith(f"{speedup - 1:.0%} faster: {verdict}.")
    assert f"trained {speedup:.2f}x the tokens/s of accumulation 1 ({100 * speedup * 1024:,.0f} against 102,400)" in first
    assert second == (f"Accumulation 4 against 1 at every stage: ZeRO-0 1.40x, ZeRO-2 {speedup:.2f}x, ZeRO-3 1.04x; "
                      f"the largest gain at ZeRO-0, the smallest at ZeRO-{2 if speedup < 1.04 else 3}; in the order "
                      "of the communication per sample accumulation spreads (stages 0 and 1, then 2, then 3): "
                      f"{'no' if speedup < 1.04 else 'yes'}.")


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
    assert found[0][0] == ("capstone-ladder-1.2b on 2 x GPU (today), ZeRO-2, overlap_comm: dropped: -6.6%, "
                           "not above the 2.0% margin")
    assert bandwidth.reference_findings().splitlines()[-1] == "overlap_comm made training faster in 1 of these 2 measurements."


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

def _stage2_acc4() -> records.Record:
    phases = {**{f"micro-step {i}": {AR: {"count": 1.0, "bytes": 400.0}} for i in range(1, 5)},
              "optimizer step": {AG: {"count": 1.0, "bytes": 100.0}, AR: {"count": 1.0, "bytes": 4.0}}}
    return _run(2, 4, 4, {AR: (5, 1604), AG: (1, 100)}, phases=phases)


def test_the_stage2_bytes_exercise_reads_the_measured_record_phase_by_phase():
    grid = accumulation.Grid({(2, 4): _stage2_acc4()}, {}, 32, 16)
    check = lambda answer: accumulation.exercise_stage2_bytes(answer, grid)
    assert not check(...).answered and "to do" in str(check(...))
    right = check(1704)  # 4 all_reduces of the gradient, the all_gather of a shard, the norm
    assert right and "micro-step 4: all_reduce 400" in str(right) and "all_gather 100 + all_reduce 4" in str(right)
    assert not check(504) and "Hint" in str(check(504))  # one all_reduce per step: stage 0's pattern


def test_the_batch_exercise_is_checked_by_deepspeeds_own_batch_arithmetic():
    one, eight = _run(2, 1, 16, {AR: (2, 8)}), _run(2, 8, 2, {AR: (9, 72), AG: (1, 4)})
    grid = accumulation.Grid({(2, 1): one, (2, 8): eight}, {}, 32, 16)
    check = lambda lines: accumulation.exercise_batch_config(lines, grid)
    assert not check(...).answered
    assert check({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8})
    derived = check({"train_batch_size": 32, "gradient_accumulation_steps": 8})  # DeepSpeed derives the micro batch
    assert derived and "32 = 2 x 8 x 2 ranks" in str(derived) and "all_reduce:9" in str(derived)
    assert "train_batch_size 64" in str(check({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}))
    assert "checker finds" in str(check({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                         "gradient_accumulation_steps": 8}))
    assert "only the batch lines" in str(check({"zero_optimization": {"stage": 2}}))
    assert accumulation.deepspeed_batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2) == (64, 4, 8)
