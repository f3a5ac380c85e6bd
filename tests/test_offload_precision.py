"""Chapters 06, 07 and 07b: the offload formulas, the placement and loss-scale probes, the loss-spike fault,
DeepSpeed's loss scaler in the fp16 demo (in this process), the records of chapter 07's script, the speed
verdicts and the article's fp16 section. One 2-rank launch serves every test that needs ranks."""

from __future__ import annotations

import copy
import json
import math
import re
import statistics
from types import SimpleNamespace

import pytest

from helpers.core import configs, launch, load_guard, models, records, references, theory
from helpers.topics import offload, precision
from helpers.core.environment import WORLD_SIZE_VARIABLE

PSI = 1_000_000


# --- the offload formulas, by hand -------------------------------------------------------------------

def test_optimizer_offload_leaves_the_working_parameters_on_the_accelerator():
    n = 4
    got = theory.offload_bytes_per_device(PSI, 2, n, "optimizer", "fp16")
    assert got["accelerator"] == pytest.approx({"params": 2 * PSI, "grads": 0, "optimizer": 0, "master": 0,
                                                "total": 2 * PSI})
    assert got["host"] == pytest.approx({"params": 0, "grads": 2 * PSI / n, "optimizer": 8 * PSI / n,
                                         "master": 4 * PSI / n, "total": 14 * PSI / n})  # (2 + K) Ψ / N_d


def test_stage_3_offload_splits_every_state_by_the_ranks():
    n = 8
    optimizer = theory.offload_bytes_per_device(PSI, 3, n, "optimizer", "bf16")
    assert optimizer["accelerator"]["total"] == pytest.approx(2 * PSI / n)
    everything = theory.offload_bytes_per_device(PSI, 3, n, "optimizer+params", "bf16")
    assert everything["accelerator"]["total"] == 0
    assert everything["host"]["total"] == pytest.approx(16 * PSI / n)  # (2 + 2 + K) Ψ / N_d


def test_no_offload_is_the_stage_formula():
    for stage in (0, 1, 2, 3):
        got = theory.offload_bytes_per_device(PSI, stage, 4, "none", "fp16")
        assert got["accelerator"]["total"] == pytest.approx(theory.paper_bytes_per_device(PSI, stage, 4))
        assert got["host"]["total"] == 0


@pytest.mark.parametrize("stage, mode", [(0, "optimizer"), (2, "optimizer+params"), (2, "everything")])
def test_offload_modes_deepspeed_cannot_run_are_refused(stage, mode):
    with pytest.raises(ValueError, match="offload"):
        theory.offload_bytes_per_device(PSI, stage, 2, mode)


def test_largest_model_divides_the_memory_by_the_bytes_per_parameter():
    fit = theory.largest_model(80e9, 2, 8, "none", reserve_bytes=16e9)
    assert fit["params"] == pytest.approx(64e9 / (2 + 14 / 8))
    offloaded = theory.largest_model(80e9, 2, 8, "optimizer", host_bytes=2000e9, reserve_bytes=16e9)
    assert offloaded["accelerator_limit"] == pytest.approx(32e9)
    assert offloaded["host_limit"] == pytest.approx(2000e9 / 14)  # every rank's share of (2 + K)
    full = theory.largest_model(80e9, 3, 8, "optimizer+params", host_bytes=2000e9)
    assert math.isinf(full["accelerator_limit"]) and full["params"] == pytest.approx(2000e9 / 16)
    with pytest.raises(ValueError, match="reserve"):
        theory.largest_model(16e9, 2, 8, reserve_bytes=16e9)


def test_the_zero_offload_headline_from_the_formulas():
    v100 = 32e9  # decimal GB, as the chapter's other tables
    assert theory.largest_model(v100, 0, 1)["params"] / 1e9 == pytest.approx(2.0)
    assert theory.largest_model(v100, 2, 1, "optimizer")["params"] / 1e9 == pytest.approx(16.0)
    text = offload.zero_offload_headline()
    assert "16.0" in text and "2.0" in text and "13.0" in text and "81%" in text  # 13 / 16
    assert "17.2" not in text  # not 32 GiB


def test_traffic_and_step_cost():
    traffic = offload.offload_traffic_bytes(PSI, 4, "optimizer", "fp16")
    assert traffic == {"to_host": 4 * PSI / 4, "to_accelerator": 2 * PSI / 4}
    assert offload.offload_traffic_bytes(PSI, 4, "optimizer+params")["to_accelerator"] == 2 * 2 * PSI / 4
    cost = offload.offload_step_cost_s(PSI, 4, "optimizer", 1e9, 2e9, 2e-9, 1e-10)
    assert cost["copies_s"] == pytest.approx(1e6 / 1e9 + 0.5e6 / 2e9)
    # the host steps all 4 ranks' partitions on the cores they share; each GPU would have stepped its own
    assert cost["adam_s"] == pytest.approx(PSI * 2e-9 - PSI / 4 * 1e-10)
    assert offload.offload_step_cost_s(PSI, 8, "optimizer", 1e9, 2e9, 2e-9)["adam_s"] == pytest.approx(
        cost["adam_s"] + PSI / 4 * 1e-10)  # the host's Adam time does not shrink with more GPUs


def _bench(ranks: int | None, seconds: float = 0.02, params: int = 2**23, transfers: dict | None = None) -> dict:
    """A benchmark result: DeepSpeed's CPU Adam at ``seconds`` per step for ``params`` (``ranks`` None: a result
    from before the ranks shared the host), torch's AdamW twice as slow."""
    adam = {"params": params, "repeats": 3, "threads": 1, "accelerator": "Test GPU" if transfers else None,
            "seconds": {"DeepSpeedCPUAdam": seconds, "torch.optim.AdamW": 2 * seconds},
            "accelerator_adamw_seconds": 1e-4 if transfers else None}
    if ranks:
        adam.update(ranks=ranks, accelerator_params=params // ranks,
                    steps_s={"DeepSpeedCPUAdam": [seconds] * 3, "torch.optim.AdamW": [2 * seconds, 2.01 * seconds, 2 * seconds]},
                    again_s=[seconds] * 3)
    return {"task": "benchmark", "adam": adam, "transfers": transfers}


def test_the_step_cost_charges_the_host_every_ranks_partition():
    bench = _bench(2, seconds=0.02, params=2**23)
    assert offload.host_adam_s_per_param(bench) == pytest.approx(0.02 / 2**23)
    lines = offload.cost_lines(bench, "here", psis=(1e9,))
    assert f"{1e9 * 0.02 / 2**23:.2f} s per step" in lines and "copies not measured" in lines
    assert "2 rank(s) stepping 4,194,304 each at the same time" in lines
    gpu = _bench(2, transfers={"bytes": 1, "bytes_per_s": {"device_to_host_pinned": 5e10, "host_to_device_pinned": 5e10}})
    cost = offload.offload_step_cost_s(7e9, 8, "optimizer", 5e10, 5e10, 0.02 / 2**23, 1e-4 / 2**22)
    assert f"{cost['adam_s']:.2f} s Adam" in offload.cost_lines(gpu, "gpu", psis=(7e9,))
    assert "rank 0 alone" in offload.cost_lines(_bench(None), "old")
    from helpers.core import load_guard

    busy = load_guard.Load("cpu", 3, 0.5, 2, 10.0, 20, "test")
    assert "measured while other processes" in offload.cost_lines(bench, "here", load=busy)
    assert "measured while" not in offload.cost_lines(bench, "here", load=load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test"))


def test_an_offloaded_step_bounds_the_benchmarks_adam_rate(swept):
    # the benchmark: 0.04 s for 2**23 parameters (4.77 ns each), its repeat 0.02 s; a training step of 10 ms for
    # the record's parameters holds the whole CPU Adam step, so the host steps no slower than 10 ms / params
    bench = _bench(2, seconds=0.04)
    bench["adam"]["again_s"] = [0.02] * 3
    trained = {"stage 2 + optimizer offload": _timed(swept["stage 2 offload"], [50, 10, 10, 10])}
    psi = trained["stage 2 + optimizer offload"].params
    text = offload.adam_rate_bounds(bench, trained, "here", psi=7e9)
    bound = 0.01 / psi
    assert f"the benchmark {0.04 / 2**23 * 1e9:.2f}, its repeat at the end {0.02 / 2**23 * 1e9:.2f}" in text
    assert f"{bound * 1e9:.2f} ns per parameter or less" in text
    assert f"at most {7e9 * bound:.1f} s, not {7e9 * 0.04 / 2**23:.1f} s" in text
    assert "upper bound" in text and "2 ranks ran 1 threads each" in text
    assert "or less" not in offload.adam_rate_bounds(bench, {}, "no run")  # no offloaded step: rates only
    for _, _, _, runs in references.reference_runs("offload"):
        assert "ns per parameter or faster" in offload.reference_adam_bounds()  # the bound, not the benchmark
        assert "up to" not in offload.reference_adam_bounds() and "the benchmark" in offload.how_measured()


def test_adam_verdicts_go_through_the_load_guard():
    from helpers.core import load_guard

    busy = load_guard.Load("cpu", 3, 0.5, 2, 10.0, 20, "test")
    alone = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
    assert "Verdict withheld" in offload.adam_verdicts(_bench(2), busy)
    given = offload.adam_verdicts(_bench(2), alone)
    assert "DeepSpeedCPUAdam is faster: torch.optim.AdamW takes 2.00x its time" in given
    assert offload.adam_verdicts(_bench(None), alone).startswith("No verdict")  # medians only: no spread


def test_the_benchmark_steps_every_optimizer_against_adamws_formula(tmp_path):
    import json

    import torch

    optimizers = {"DeepSpeedCPUAdam": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),  # a stand-in
                  "wrong lr": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01)}
    got = offload.adam_benchmark(optimizers, out=tmp_path / "bench.json", numel=4096, repeats=2)
    assert json.loads((tmp_path / "bench.json").read_text()) == got
    adam = got["adam"]
    assert adam["ranks"] == 1 and adam["params"] == 4096 and len(adam["steps_s"]["wrong lr"]) == 2
    assert len(adam["again_s"]) == 2
    assert adam["max_difference_from_formula"]["DeepSpeedCPUAdam"] < 1e-6 < adam["max_difference_from_formula"]["wrong lr"]


def test_adamw_first_step_by_hand():
    import torch

    w, g = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, -0.1, 0.0])
    got = offload.adamw_first_step(w, g, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    # decay by lr * wd, then a step of lr against the gradient's sign (0 where the gradient is 0)
    assert got.tolist() == pytest.approx([1.0 * 0.999 - 0.1, -2.0 * 0.999 + 0.1, 0.5 * 0.999], abs=1e-6)


def test_the_host_is_planned_with_the_gradient_bytes_deepspeed_keeps():
    # the formula's host side is (2 + K)/N_d per parameter; 6 gradient bytes an element instead of 2 add 4/N_d
    assert offload.host_bytes_per_parameter(2, 8, "optimizer") == pytest.approx(14 / 8)
    assert offload.host_bytes_per_parameter(2, 8, "optimizer", grad_bytes=6) == pytest.approx(18 / 8)
    assert offload.host_bytes_per_parameter(3, 8, "optimizer+params", grad_bytes=6) == pytest.approx(20 / 8)
    assert offload.host_bytes_per_parameter(2, 8, "none", grad_bytes=6) == 0
    table = offload.largest_model_table(80, 8, 2000, 16, host_grad_bytes={2: 6.0, 3: 6.0})
    row = next(line for line in table.splitlines() if line.startswith("stage 3 + optimizer offload"))
    assert f"{2000 / 14 * 8 / 8:.1f}" in row and f"{2000 / 18:.1f}" in row  # formula's and measured host limits
    assert "18" in offload.zero_offload_headline(host_grad_bytes=6.0)
    headline = offload.headline_sentence(6.0)  # 1.5 TB at 18 bytes: 83B; 32 GB at 2 bytes: 16B
    assert "83B parameters: the GPU, not the host, limited the paper's 13B" in headline and "16B" in headline
    assert "the host limited it first (6B against the GPU's 16B)" in offload.headline_sentence(6.0, host_gb=100)


def test_mlp_wide_has_the_parameters_its_description_says():
    import torch

    with torch.device("meta"):
        assert models.count_parameters(models.build("mlp_wide")) == 134_250_496
    assert "134,250,496" in models.MODELS["mlp_wide"]


# --- the article's config, line by line ----------------------------------------------------------------

def test_the_article_restates_deepspeeds_defaults():
    article = configs.load(precision.ARTICLE)
    restated = configs.restates_default(article)
    assert {f"fp16.{k}" for k in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis",
                                  "min_loss_scale")} <= set(restated)
    assert "gradient_clipping" in restated and "zero_optimization.reduce_scatter" in restated
    # what it changes is not "restated"
    assert not {"zero_optimization.stage", "zero_optimization.overlap_comm", "fp16.enabled"} & set(restated)
    # DeepSpeed's own stage-dependent default: overlap_comm is on by default at stage 3 only
    assert configs.deepspeed_defaults({"zero_optimization": {"stage": 3, "overlap_comm": True}})[
        "zero_optimization.overlap_comm"] is True


def test_the_corrected_article_passes_the_checker_on_any_world_that_divides_its_batch():
    corrected = precision.corrected_article()
    for world in (1, 2, 4, 8):
        assert configs.check(corrected, world) == [], world
    assert "offload_param" not in corrected["zero_optimization"] and "fp16" not in corrected


def test_a_bad_fp16_setting_fails_before_launch_naming_it():
    with pytest.raises(ValueError, match="loss_scale_window"):
        precision.demo_config({"loss_scale_window": 0})


@pytest.mark.parametrize("options, faults, match", [({"loss_spike_at_step": 0}, None, "from 1 to 3"),
                                                    ({"loss_spike_at_step": [2, 9]}, None, "from 1 to 3"),
                                                    (None, None, "loss_spike_at_step"),
                                                    ({"loss_spike_at_step": 2}, {"loss_spike": 2}, "not course faults")])
def test_bad_spikes_and_faults_fail_before_any_process_starts(monkeypatch, options, faults, match):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=match):
        launch.run("zero2", steps=3, world_size=2, probes=("timing", precision.LossSpike), options=options,
                   faults=faults)


def test_step_ranges_read_as_a_learner_writes_them():
    assert precision._ranges([1, 2, 3, 6, 10, 11]) == "1-3, 6, 10-11"
    assert precision._ranges([]) == ""


ACCUM_PROBES = ("timing", "model_states", "placement", "peak_memory", precision.AccumulatedGradient)


# --- DeepSpeed's loss scaler on real fp16 gradients, in this process -----------------------------------

@pytest.fixture(scope="module")
def demos():
    steps = dict(steps=4, world=2)
    return {
        "demo": precision.scaler_demo(precision.demo_config({"initial_scale_power": 16}), [2], **steps),
        "demo, two spikes": precision.scaler_demo(precision.demo_config({}), [2, 3], **steps),
        "demo, consecutive": precision.scaler_demo(precision.demo_config({"consecutive_hysteresis": True}), [2, 4],
                                                   **steps),
        "demo at the floor": precision.scaler_demo(precision.demo_config({"hysteresis": 1, "min_loss_scale": 65536}),
                                                   [2], **steps),
    }


def test_deepspeeds_scaler_skips_the_spiked_step_in_fp16(demos):
    demo = demos["demo"]
    assert demo["overflow_per_step"] == [False, True, False, False]
    assert demo["scale_per_step"] == [65536.0] * 4  # hysteresis 2 absorbs one overflow
    assert demo["skipped_steps"] == 1 and demo["stopped"] is None
    assert all(h > 1 for h in demo["headroom_log2"] if h is not None)
    assert math.isinf(demo["losses"][1])
    assert demo["hysteresis_per_step"] == [2, 1, 1, 1]  # the spike used up one unit; nothing refilled it


def test_scale_by_step_says_what_the_scaler_decided_for_the_learners_block():
    text = precision.scale_by_step({"enabled": True, "hysteresis": 1, "min_loss_scale": 32768}, [2, 3], steps=4)
    lines = text.splitlines()
    assert len(lines) == 2 + 3 + 1  # header, rule, three steps (the run ended at the third), the summary
    assert lines[3].split()[:5] == ["2", "spike", "2^16", "overflow:", "skipped"] and lines[3].endswith("2^15 (halved)")
    assert lines[4].endswith("run ended") and "DeepSpeed ended the run: Exception: Current loss scale" in lines[-1]
    static = precision.scale_by_step({"loss_scale": 1024}, [2], steps=3)
    assert static.splitlines()[-1] == "LossScaler; 1 of 3 steps skipped" and " - " in static.splitlines()[3]


def test_the_scaler_ends_the_run_at_min_loss_scale(demos):
    floor = demos["demo at the floor"]
    assert floor["stopped"].startswith("Exception: Current loss scale already at minimum")
    assert len(floor["scale_per_step"]) == 2  # stopped at the spike, step 2


def test_hysteresis_is_refilled_only_when_the_scale_doubles_unless_consecutive(demos):
    # default: the spike of step 2 uses up hysteresis; step 3's, before any doubling, halves the scale
    assert demos["demo, two spikes"]["scale_per_step"] == [65536.0, 65536.0, 65536.0, 32768.0]
    # consecutive_hysteresis: step 3 (no overflow) refills it, so step 4's spike halves nothing
    assert demos["demo, consecutive"]["overflow_per_step"] == [False, True, False, True]
    assert demos["demo, consecutive"]["final_scale"] == 65536.0


def test_the_demo_plays_every_rank_on_its_own_samples():
    config = precision.demo_config({})
    one, two = (precision.scaler_demo(config, steps=2, world=w) for w in (1, 2))
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["losses"][0] != two["losses"][0]  # the second rank's samples enter the mean
    assert one["overflow_per_step"] == two["overflow_per_step"] == [False, False]


def test_the_scenarios_table_names_each_scenarios_knobs_and_spikes():
    table = precision.scenarios_table()
    assert "consecutive_hysteresis=true" in table and "(the defaults)" in table and "6, 12" in table
    assert len(table.splitlines()) == 2 + len(precision.SCENARIOS)
    # every name numbers its scenario and lists each knob it sets besides DeepSpeed's defaults
    defaults = precision.fp16_settings({})
    for number, (name, (knobs, spikes)) in enumerate(precision.SCENARIOS.items(), 1):
        assert name.startswith(f"{number} · ")
        changed = [k for k, v in knobs.items() if v != getattr(defaults, k)]
        assert all(f"{k}={json.dumps(knobs[k])}" in name for k in changed), name
        assert ("two spikes" in name) == (len(spikes) == 2), name


def test_the_engine_runs_are_read_back_by_scenario(tmp_path):
    """Chapter 07b's GPU branch: a run DeepSpeed ended leaves ended.json in engine-<scenario index>."""
    (tmp_path / "engine-5").mkdir()
    (tmp_path / "engine-5" / precision.ENDED).write_text(json.dumps({"failed": "Exception: minimum"}))
    found = precision.load_engine_runs(tmp_path)
    assert found == {"6 · hysteresis=1, min_loss_scale=32768, two spikes": {"failed": "Exception: minimum",
                                                                           "device": "cuda"}}


def test_the_article_beside_the_corrected_config():
    table = precision.article_changes_table(2)
    assert "gradient_accumulation_steps                           8  (removed)" in table
    assert "bf16.enabled" in table and "fp16.hysteresis" in table and "train_batch_size " not in table.split("\n\n")[0]
    article, corrected = table.split("the corrected one:")
    assert "32 != 4 * 8 * 2 = 64" in article and corrected.strip() == "no findings"
    assert "32 != 4 * 8" not in precision.article_changes_table(1)  # one rank: the article's arithmetic holds


# --- one launch for the rest -------------------------------------------------------------------------

PINNED = {"device": "cpu", "pin_memory": True}


def offloaded(**zero: dict) -> dict:
    """Overrides for a run that offloads: ``zero`` and DeepSpeed's Adam (the course configs ask for torch's)."""
    return configs.merged(offload.DEEPSPEED_ADAM, {"zero_optimization": zero})

@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    import os

    os.environ.pop(WORLD_SIZE_VARIABLE, None)
    folder = tmp_path_factory.mktemp("offload-precision")
    bf16 = {"bf16": {"enabled": True}}
    probes = ("timing", "model_states", "placement", "peak_memory", precision.LossScale)
    specs = {
        "stage 2": launch.RunSpec("zero2", model="mlp", steps=3, overrides=bf16, probes=probes, out=folder / "s2"),
        "stage 2 offload": launch.RunSpec("zero2", model="mlp", steps=3, probes=probes, out=folder / "s2o",
                                          overrides=configs.merged(bf16, offloaded(offload_optimizer=PINNED))),
        "stage 3 offload": launch.RunSpec("zero3", model="mlp", steps=3, probes=probes, out=folder / "s3o",
                                          overrides=configs.merged(bf16, offloaded(
                                              offload_optimizer=PINNED, offload_param=PINNED))),
        "spiked": launch.RunSpec("zero2", model="mlp", steps=3, overrides=bf16, probes=probes + (precision.LossSpike,),
                                 out=folder / "spiked", **precision.spike(2)),
        **{f"accum {dtype}": launch.RunSpec("zero2", model="mlp", steps=2, probes=ACCUM_PROBES,
                                            options={"reference_model": "mlp", "reference_seed": 0}, out=folder / dtype,
                                            overrides={"gradient_accumulation_steps": 4, **changes})
           for dtype, changes in (("bf16", {"bf16": {"enabled": True}}),
                                  ("fp32", {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}),
                                  ("fp32 training", {}))},
    }
    return launch.sweep(specs, name=f"offload-precision-{folder.name}", world_size=2, progress=False)


def test_placement_splits_the_model_states_between_the_sides(swept):
    for name, record in swept.items():
        if not isinstance(record, records.Record):
            continue
        for rank, (placement, states) in enumerate(zip(record["memory.placement_bytes_per_rank"],
                                                       record["memory.model_states_at_boundary_bytes_per_rank"])):
            for key in records.STATE_KEYS:  # each byte on exactly one side
                assert placement["accelerator"][key] + placement["host"][key] == states[key], (name, rank, key)


def test_no_offload_keeps_everything_on_the_accelerator(swept):
    placement = swept["stage 2"]["memory.placement_bytes_per_rank"][0]
    assert sum(placement["host"].values()) == 0
    assert placement["dtypes"] == {"params": ["bfloat16"], "grads": ["bfloat16"], "optimizer": ["float32"],
                                   "master": ["float32"]}


def test_optimizer_offload_moves_the_optimizer_master_and_gradients(swept):
    psi, n = swept["stage 2"].params, 2
    off = swept["stage 2 offload"]["memory.placement_bytes_per_rank"][0]
    assert off["accelerator"]["params"] == 2 * psi  # every bf16 parameter stays
    assert off["accelerator"]["optimizer"] == off["accelerator"]["master"] == off["accelerator"]["grads"] == 0
    assert off["host"]["master"] == 4 * psi // n and off["host"]["optimizer"] >= 8 * psi // n
    assert off["host"]["grads"] == 6 * psi // n  # fp32 partition + bf16 accumulator
    assert swept["stage 2 offload"]["basic_optimizer"] == "DeepSpeedCPUAdam"
    assert swept["stage 2 offload"].losses == pytest.approx(swept["stage 2"].losses, abs=1e-3)


def test_parameter_offload_empties_the_accelerator_of_model_states(swept):
    placement = swept["stage 3 offload"]["memory.placement_bytes_per_rank"][1]
    assert all(placement["accelerator"][k] == 0 for k in records.MODEL_STATE_KEYS)
    assert placement["host"]["params"] == 2 * swept["stage 3 offload"].params // 2


def test_a_spike_in_bf16_is_a_huge_loss_not_an_overflow(swept):
    spiked, clean = swept["spiked"], swept["stage 2"]
    assert spiked["faults.loss_spike.steps"] == [2]
    assert spiked.losses[0] == clean.losses[0]
    assert spiked.losses[1] > 1e6 * clean.losses[1]  # the output times 1e6: the squared error times ~1e12
    section = spiked["loss_scale"]
    assert section["applied_per_step"] == [True, True, True] and section["skipped_steps"] == 0
    assert set(section["scale_per_step"]) == {1.0}  # bf16: no loss scaling


def test_the_accumulated_gradient_against_an_fp32_reference(swept):
    fp32 = precision.accumulated_gradient(swept["accum fp32 training"])
    assert fp32["dtypes"] == ["float32"] and fp32["relative_error"] < 1e-5  # two fp32 computations agree
    bf16, fp32_accum = (precision.accumulated_gradient(swept[f"accum {d}"]) for d in ("bf16", "fp32"))
    held = {d: swept[f"accum {d}"].memory.placement(0)["dtypes"]["grads"] for d in ("bf16", "fp32")}
    assert held == {"bf16": ["bfloat16"], "fp32": ["float32"]}  # the partition DeepSpeed accumulates into
    assert 1e-4 < fp32_accum["relative_error"] < bf16["relative_error"] < 1e-1  # bf16 rounds, and more so when it adds
    runs = {("accum", (2, d)): swept[f"accum {d}"] for d in ("bf16", "fp32", "fp32 training")}
    table = precision.grad_accum_table(runs)
    assert "ZeRO-2, bf16, accumulated in fp32" in table and "step 1 equal" in table
    # ZeRO-2 keeps only its partition, in the accumulation dtype, mid-accumulation and at the boundary alike
    assert "1.00             1.00" in table and "2.00             2.00" in table
    assert precision.gradient_held_lines(runs) == ""
    verdicts = precision.grad_accum_verdicts(runs)
    assert "accumulated in fp32: True" in verdicts and "losses of the two runs within 1e-03" in verdicts
    summary = precision.grad_accum_error_summary(runs)
    share = fp32_accum["relative_error"] / bf16["relative_error"]
    assert summary.startswith(f"Accumulating in fp32 instead of bf16 makes the step-1 gradient's error "
                              f"{1 - share:.0%} smaller (ZeRO-2 ")  # one pair: one share, not a range
    errors = precision.grad_accum_error_table(runs).splitlines()
    assert errors[-1].startswith("ZeRO-2, fp32 training") and errors[-1].split()[-2:] == ["-", "-"]


def test_a_stage_that_reduces_at_the_boundary_holds_the_whole_gradient_until_then(swept):
    """ZeRO-1's accumulation: the whole gradient mid-accumulation, its partition once reduced at the boundary."""
    summary = copy.deepcopy(swept["accum bf16"].summary)
    params = swept["accum bf16"].params
    for states in summary["memory"]["model_states_bytes_per_rank"]:
        states["grads"] = 2 * params
    for placement in summary["memory"]["placement_bytes_per_rank"]:
        placement["accelerator"]["grads"], placement["host"]["grads"] = params, 0
    runs = {("accum", (1, "bf16")): records.Record(summary),
            ("accum", (0, "fp32")): RuntimeError("NotImplementedError: unsupported mix")}
    table = precision.grad_accum_table(runs).splitlines()
    assert "2.00" in table[2] and "1.00" in table[2] and "refused" not in table[2]  # the refusal: under the table
    assert table[-1] == "ZeRO-0, bf16, accumulated in fp32: refused by deepspeed.initialize: NotImplementedError: unsupported mix"
    assert precision.gradient_held_lines(runs) == (
        "ZeRO-1, bf16, accumulated in bf16: 2.00 B/param while it accumulates (the whole gradient on every rank), "
        f"1.00 at the boundary (after the reduction, its 1/{summary['world_size']} partition only)")


def test_a_bad_reference_model_fails_before_launch(monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="reference_model"):
        launch.run("zero2", steps=2, world_size=2, probes=("timing", precision.AccumulatedGradient),
                   options={"reference_model": "llama"})


def test_the_engine_and_the_demo_are_compared_scenario_by_scenario(swept, demos):
    engine = {"demo": swept["spiked"], "demo at the floor": {"failed": "Exception: minimum", "device": "cuda"}}
    text = precision.engine_demo_differences(engine, demos, "This run, Test GPU")
    # the bf16 engine never scales, the fp16 demo does: they differ; both ended at the floor: alike
    assert text.startswith("This run, Test GPU: the engine and the demo decide 1 of 2 scenarios alike; they differ in 1 (demo)")
    assert "within 1 halving of an fp16 overflow: none" in text and "exactly those: False" in text
    numbered = {f"{i} · {name}": run for i, (name, run) in enumerate(engine.items(), 3)}
    text = precision.engine_demo_differences(numbered, {f"{i} · {n}": demos[n] for i, n in enumerate(engine, 3)}, "R")
    assert "they differ in 1 (scenarios 3)" in text  # numbered scenarios are named by their numbers
    rows = precision.engine_against_demo(engine, demos).splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["demo", "demo"]  # in the demos' order, only where both ran
    assert rows[0].split()[-2:] == ["no", "no"]  # bf16 engine skipped nothing; the demo kept its headroom
    assert re.split(r"\s{2,}", rows[1]) == ["demo at the floor", "2; then ended at min_loss_scale",
                                            "ended at min_loss_scale", "yes", "no"]  # both ended at the floor


def test_the_trajectory_table_reads_both_kinds_of_result(swept, demos):
    table = precision.trajectory_table({"demo": demos["demo"], "engine (bf16)": swept["spiked"]})
    assert "1: steps 2" in table and "2^16 -> 2^16" in table and "2^0 -> 2^0" in table


def test_committed_gpu_results_are_shown_beside_the_learners(swept, demos, tmp_path, monkeypatch):
    """The notebooks' GPU sections read notebooks/reference/: render a committed file made of this launch's
    records (relabelled as GPU results) through every report the chapters print."""
    import json


    monkeypatch.setattr(references, "REFERENCE_DIR", tmp_path)
    bench = {"name": "adam-benchmark", "task": "benchmark", "device": "cuda", "transfers": None,
             "adam": _bench(None)["adam"]}

    def commit(name: str, runs: dict) -> None:
        payload = {"experiment": name, "device": "2 x Test GPU", "date": "2026-01-01", "note": "test", "software": {},
                   "runs": {k: (r.summary if isinstance(r, records.Record) else r) for k, r in runs.items()}}
        (tmp_path / f"{name}-2xTest-GPU.json").write_text(json.dumps(payload))

    assert "No GPU results for 'offload'" in offload.reference_report()
    commit("offload", {"stage 2": swept["stage 2"], "stage 2 offload": swept["stage 2 offload"], "adam benchmark": bench})
    report = offload.reference_report()
    assert "Measured on 2 x Test GPU" in report and "DeepSpeedCPUAdam" in report and "stage 2 offload" in report
    commit("loss-scale", {"demo": swept["spiked"], "demo at the floor": {"failed": "Exception: minimum", "device": "cuda"}})
    report = precision.loss_scale_reference_report({"demo": demos["demo"], "demo at the floor": demos["demo at the floor"]})
    assert report.startswith("DeepSpeed's fp16 engine on 2 x Test GPU, 2026-01-01 (test), beside the demo here:")
    assert "2 x Test GPU, 2026-01-01: the engine and the demo decide 1 of 2 scenarios alike" in report
    commit("precision-speed", {"ZeRO-2 fp32": swept["accum fp32 training"], "ZeRO-2 bf16": swept["stage 2"]})
    report = precision.speed_reference_report()
    assert "Measured on 2 x Test GPU, 2026-01-01" in report and "ZeRO-2 bf16" in report
    assert "ZeRO-2 bf16" in report and "(verdict withheld: not measured alone (" in report  # not "alone"
    assert "peak" not in report and "Conditions:" not in report  # the short form: steps and one sentence
    assert precision.speed_takeaway_reference().startswith("Takeaway (2 x Test GPU, 2026-01-01): no fp32 peak known")
    detail = precision.speed_reference_report(detail=True)
    assert "Conditions: " in detail and "verdict withheld: " in detail


def _timed(record: records.Record, steps_ms: list[float], device: str = "NVIDIA H200") -> records.Record:
    """``record`` with other step times (ms, the first a warm-up) and another device name."""
    summary = copy.deepcopy(record.summary)
    summary["step_time_s"] = {"all": [t / 1e3 for t in steps_ms], "median": statistics.median(steps_ms[1:]) / 1e3}
    summary["device_name"] = device
    return records.Record(summary)


ALONE = load_guard.Load("gpu", 0, None, 2, 5.0, 10, "test: a box to itself")
SHARED = load_guard.Load("gpu", 3, 0.8, 2, 5.0, 10, "test: a shared box")


def test_a_speed_verdict_only_alone_and_beyond_the_spread_of_the_steps(swept):
    fp32 = _timed(swept["accum fp32 training"], [90, 50, 52, 54])
    apart = {"ZeRO-2 fp32": fp32, "ZeRO-2 bf16": _timed(swept["stage 2"], [90, 40, 41, 42])}
    overlapping = {"ZeRO-2 fp32": fp32, "ZeRO-2 bf16": _timed(swept["stage 2"], [90, 45, 51, 53])}
    assert "1.27x ZeRO-2 fp32's speed (median step), beyond the steps' spread of 8%" in precision.speed_explanation(apart, ALONE)
    shared = precision.speed_explanation(apart, SHARED)
    assert "verdict withheld: 3 other processes used these GPUs during the run." in shared and "beyond" not in shared
    assert "need at least" not in precision.speed_explanation(apart, ALONE, flops=False)
    assert precision.speed_summary(apart, ALONE) == (
        "Median step speed against ZeRO-2 fp32: ZeRO-2 bf16 1.27x (faster, beyond the steps' spread).")
    assert precision.speed_summary(overlapping, ALONE).endswith("(verdict withheld: the difference (2%) is within the "
                                                              "steps' spread (16%)).")
    text = precision.speed_explanation(apart, ALONE)
    assert "40.0-42.0 ms" in text and "need at least" in text and "lower bounds on the products' time" in text
    assert "fp32 peak (67 TFLOP/s)" in text  # the H200's datasheet figure
    assert "no fp32 peak known" in precision.speed_explanation(
        {k: _timed(r, [90, 50, 52, 54], device="CPU") for k, r in apart.items()}, ALONE)
    assert precision.peak_fp32_tflops("NVIDIA H200")[0] == 67.0 and precision.peak_fp32_tflops("CPU")[0] is None


def test_the_speed_bounds_set_each_measured_gain_beside_the_products_least_time(swept):
    fp32 = _timed(swept["accum fp32 training"], [90, 50, 52, 54])
    runs = {"ZeRO-2 fp32": fp32, "ZeRO-2 bf16": _timed(swept["stage 2"], [90, 40, 41, 42]),
            "ZeRO-2 fp16": _timed(swept["stage 2"], [90, 40, 42, 41])}
    text = precision.speed_bounds(runs, ALONE)
    assert "of the 52.0 ms fp32 step" in text and "could speed the step up 1.00x at most" in text  # a tiny MLP
    assert "ZeRO-2 bf16 and ZeRO-2 fp16 beat that bound" in text
    assert "ZeRO-2 fp16 against ZeRO-2 bf16: verdict withheld: the difference (0%)" in text
    assert "nothing these runs measured explains a difference" in text
    shared = precision.speed_bounds(runs, SHARED)
    assert "beat" not in shared and "Within that bound" in shared  # no gain judged under load
    cpu = {k: _timed(r, [90, 50, 52, 54], device="CPU") for k, r in runs.items()}
    assert "no fp32 peak known" in precision.speed_bounds(cpu, ALONE)


def test_the_speed_takeaway_names_the_products_share_and_the_gains_beyond_the_spread(swept):
    fp32 = _timed(swept["accum fp32 training"], [90, 50, 52, 54])
    runs = {"ZeRO-2 fp32": fp32, "ZeRO-2 bf16": _timed(swept["stage 2"], [90, 40, 41, 42]),
            "ZeRO-2 fp16": _timed(swept["stage 2"], [90, 50, 53, 51])}
    text = precision.speed_takeaway(runs, ALONE)
    assert text.startswith("On this model the matrix products need at least 0% of an fp32 step (at the datasheet's "
                           "peak; their real share is unknown without a kernel profile).")  # a tiny MLP
    assert text.endswith("Measured: bf16 1.27x (beyond the steps' spread), fp16 1.02x (within the spread).")
    assert "at most" not in text and "ms" not in text  # the bounds' arithmetic is speed_bounds', not the takeaway's
    shared = precision.speed_takeaway(runs, SHARED)
    assert shared.endswith("Measured: bf16 1.27x (within the spread), fp16 1.02x (within the spread).")
    cpu = {k: _timed(r, [90, 50, 52, 54], device="CPU") for k, r in runs.items()}
    assert "no fp32 peak known" in precision.speed_takeaway(cpu, ALONE)


def test_the_speed_table_names_its_peak_in_plain_words(swept):
    table = precision.speed_table({"ZeRO-2 bf16": swept["stage 2"]})
    assert table.splitlines()[0].split("  ")[-1].strip() == "peak memory of a rank's process"  # these runs: CPU
    assert "ru_maxrss" not in table and "peak" not in precision.speed_table({"ZeRO-2 bf16": swept["stage 2"]}, peak=False)


def test_the_bf16_optimizer_line_splits_its_gradient_by_dtype_and_finds_its_partition(swept):
    """BF16_Optimizer (ZeRO-1, fp32 accumulation): a whole bf16 and a whole fp32 gradient, a partitioned master."""
    summary = copy.deepcopy(swept["accum fp32"].summary)
    params = swept["accum fp32"].params
    summary["optimizer"] = "BF16_Optimizer"
    for states in (*summary["memory"]["model_states_bytes_per_rank"],
                   *(p["accelerator"] for p in summary["memory"]["placement_bytes_per_rank"])):
        states.update(grads=6 * params, master=2 * params, optimizer=4 * params)
    for placement in summary["memory"]["placement_bytes_per_rank"]:
        placement["dtypes"]["grads"] = ["bfloat16", "float32"]
    runs = {("accum", (1, "fp32")): records.Record(summary), ("accum", (2, "fp32")): swept["accum fp32"]}
    assert precision.bf16_optimizer_lines(runs) == (
        "ZeRO-1, bf16, accumulated in fp32 (BF16_Optimizer): gradients 6.00 B/param = a whole bfloat16 gradient (2) + "
        "a whole float32 gradient (4), the same at the boundary; master 2.00 + Adam's moments 4.00 B/param = 1/2 of "
        "fp32's 4 + 8: partitioned over the 2 ranks, as ZeRO-1 does")
    for states in summary["memory"]["model_states_bytes_per_rank"]:
        states.update(master=4 * params, optimizer=8 * params)  # whole on every rank: not partitioned
    assert precision.bf16_optimizer_lines(runs).endswith("= 1.00 of fp32's 4 + 8")
    assert precision.bf16_optimizer_lines({("accum", (2, "fp32")): swept["accum fp32"]}) == ""  # a ZeRO optimizer


def test_a_references_written_conditions_are_its_load():
    assert load_guard.Load.from_conditions("alone on the machine: one at a time").alone
    beside = load_guard.Load.from_conditions("executed by check-gpu beside 5 other notebook(s)")
    assert not beside.alone and beside.reason() == "not measured alone (executed by check-gpu beside 5 other notebook(s))"
    assert not load_guard.Load.from_conditions(None).alone


# --- chapter 07's script: its records, their collectives ------------------------------------------------

def test_the_scripts_run_names_become_the_chapters_keys():
    assert precision.run_key("zero2-bf16") == (2, "bf16")
    assert precision.run_key("accum-zero3-fp32") == ("accum", (3, "fp32"))
    assert precision.run_key("fp32-zero2") == ("accum", (2, "fp32 training"))
    assert precision.run_key("accum-zero2-fp32-training") is None  # accumulation runs name a dtype only
    assert precision.run_key("speed-zero2-fp16") == ("speed", "fp16")
    assert precision.run_key("zero2-int8") is None and precision.run_key("my-run") is None


def test_load_runs_reads_records_and_refusals_in_the_tables_order(swept, tmp_path):
    import json

    for name, record in (("zero2-bf16", swept["stage 2"]), ("zero2-fp32", swept["accum fp32 training"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(record.summary))
    (tmp_path / "accum-zero0-fp32").mkdir()
    (tmp_path / "accum-zero0-fp32" / precision.REFUSED).write_text(json.dumps({"error": "NotImplementedError: no"}))
    (tmp_path / "notes").mkdir()
    runs = precision.load_runs(tmp_path)
    assert list(runs) == [(2, "fp32"), (2, "bf16"), ("accum", (0, "fp32"))]  # fp32 first; other folders left out
    assert isinstance(runs[(2, "bf16")], records.Record) and str(runs[("accum", (0, "fp32"))]) == "NotImplementedError: no"
    assert "refused by deepspeed.initialize" in precision.grad_accum_table({("accum", (0, "fp32")): runs[("accum", (0, "fp32"))]})


def _comm(record: records.Record, by_caller: dict) -> records.Record:
    """``record`` with another ``comm`` section (what the collective tables read), made from ``by_caller``."""
    by_op = {op: {"count": sum(r["count"] for r in rows.values()), "bytes": sum(r["bytes"] for r in rows.values())}
             for op, rows in by_caller.items()}
    summary = copy.deepcopy(record.summary)
    summary["comm"] = {"by_op": by_op, "by_caller": by_caller, "bytes_per_step": sum(r["bytes"] for r in by_op.values())}
    return records.Record(summary)


def test_the_collective_tables_compare_each_precision_with_fp32(swept):
    runs = {(2, "fp32"): _comm(swept["accum fp32 training"], {"all_reduce": {"allreduce_bucket": {"count": 2, "bytes": 4000},
                                                          "get_grad_norm_direct": {"count": 1, "bytes": 4}}}),
            (2, "bf16"): _comm(swept["stage 2"], {"all_reduce": {"allreduce_bucket": {"count": 2, "bytes": 2000},
                                                          "get_grad_norm_direct": {"count": 1, "bytes": 4}}})}
    table = precision.collective_bytes_table(runs)
    assert "all_reduce 2,004" in table and "0.500" in table and "1.000" in table
    verdict = precision.gradient_bytes_verdict(runs)
    assert verdict == ("ZeRO-2, gradient reduction (all_reduce issued by DeepSpeed's allreduce_bucket), per step: "
                       "fp32 2 x 2,000 = 4,000 bytes; bf16 2 x 1,000 = 2,000 bytes (0.50 of fp32's)\n"
                       "  the few other bytes: fp32 get_grad_norm_direct 4; bf16 get_grad_norm_direct 4")


def test_the_fp32_reference_probe_for_a_script_names_its_model():
    probe = precision.against_fp32("mlp", seed=3)
    assert issubclass(probe, precision.AccumulatedGradient) and (probe.model, probe.seed) == ("mlp", 3)
    assert probe.name == "accumulated_gradient"  # the same record section
    with pytest.raises(ValueError, match="fp32 reference needs one of"):
        precision.against_fp32("llama")

def test_formats_come_from_torch():
    table = precision.formats_table()
    assert "1 / 8 / 23" in table and "1 / 8 / 7" in table and "1 / 5 / 10" in table and "6.55e+04" in table
    assert "a ZeRO optimizer keeps" in table and "under ZeRO" in precision.formats_table(adds={"fp32": "under ZeRO"})
    assert "a loss scale" in precision.formats_table(adds={"fp32": "under ZeRO"})  # the other rows keep theirs


class _States(records.Record):
    """A record whose measured model states are given (bytes on every rank), for the arithmetic's tests."""

    def __init__(self, states: dict[str, int], params: int = 100):  # no run behind it: nothing to validate
        self.summary, self._given = {"model": {"params": params}}, states

    def states(self, rank: int = 0) -> dict[str, int]:
        return dict(self._given)


def test_the_saving_lines_add_each_runs_states_and_name_the_master():
    runs = {(0, "fp32"): _States({"params": 400, "grads": 400, "optimizer": 800, "master": 0}),
            (0, "bf16"): _States({"params": 200, "grads": 200, "optimizer": 800, "master": 400}),
            (2, "fp32"): _States({"params": 400, "grads": 200, "optimizer": 400, "master": 200}),
            (2, "bf16"): _States({"params": 200, "grads": 100, "optimizer": 400, "master": 200})}
    zero0, zero2 = precision.saving_lines(runs).splitlines()
    assert zero0 == ("ZeRO-0: fp32 4.00 + 4.00 + 8.00 = 16.00; bf16 2.00 + 2.00 + 8.00 + 4.00 master = 16.00 B/param. "
                     "bf16 saves 4.00 on parameters and gradients and adds 4.00 of fp32 master: in all, bf16 saves "
                     "nothing (as many bytes as fp32).")
    assert zero2.endswith("bf16 saves 3.00 on parameters and gradients, both keep the same fp32 master: in all, bf16 "
                          "needs 75% of fp32's bytes (saves 3.00 B/param).")
    assert precision.saving_lines({(2, "bf16"): runs[(2, "bf16")]}) == ""  # no fp32 run to set it beside


def test_the_half_bytes_table_names_the_states_that_match_and_those_that_differ():
    def run(bytes_by_kind: dict, dtype: str) -> SimpleNamespace:
        placement = {"accelerator": bytes_by_kind, "host": dict.fromkeys(bytes_by_kind, 0),
                     "dtypes": {"params": [dtype], "grads": [dtype]}}
        return SimpleNamespace(memory=SimpleNamespace(placement=lambda rank: placement))

    states = {"params": 200, "grads": 100, "optimizer": 400, "master": 200}
    runs = {"ZeRO-2 bf16": run(states, "bfloat16"), "ZeRO-2 fp16": run(states, "float16")}
    row = precision.half_bytes_table(runs).splitlines()[-1]
    assert "the same for params, grads, optimizer, master" in row and "differ" not in row
    assert row.endswith("params float16 | grads float16")
    runs["ZeRO-2 fp16"] = run({**states, "master": 400}, "float16")
    assert "the same for params, grads, optimizer; differ: master" in precision.half_bytes_table(runs)


def test_the_chapters_records_come_back_in_training_order_with_the_repeat_apart(swept, tmp_path):
    import json
    import os
    import time

    from helpers.core import load_guard

    started = time.time() - 60
    trained = {"stage 2": _timed(swept["stage 2"], [50, 10, 10.2, 10.1]),
               "stage 2 + optimizer offload": _timed(swept["stage 2 offload"], [50, 20, 20.1, 20.2]),
               "stage 2 (again)": _timed(swept["stage 2"], [50, 10.1, 10, 10.2])}
    for i, (name, record) in enumerate(trained.items()):
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({**record.summary, "name": name}))
        os.utime(folder / "summary.json", (started + i, started + i))  # trained in this order
    (tmp_path / "old-run").mkdir()  # a record from an earlier launch is left out
    (tmp_path / "old-run" / "summary.json").write_text(json.dumps({**swept["stage 2"].summary, "name": "old"}))
    os.utime(tmp_path / "old-run" / "summary.json", (started - 10, started - 10))
    (tmp_path / offload.BENCHMARK_FILE).write_text(json.dumps(_bench(2)))
    runs, again, bench = offload.chapter_records(tmp_path, since=started)
    assert list(runs) == ["stage 2", "stage 2 + optimizer offload"] and again.name == "stage 2 (again)"
    assert bench == _bench(2)
    alone = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
    assert "stage 2 is faster: stage 2 + optimizer offload takes 1.99x its time" in offload.step_verdicts(runs, again, alone)
    busy = load_guard.Load("cpu", 3, 0.5, 2, 10.0, 20, "test")
    withheld = offload.step_verdicts(runs, again, busy)  # one line for every run, none per run
    assert withheld.startswith("Every verdict below is withheld: other processes (3)") and "\n" not in withheld
    warmed = _timed(swept["stage 2"], [50, 5, 5.1, 5])  # the repeat at half the first run's time
    assert "the machine changed during the sweep" in offload.step_verdicts(runs, warmed, alone)
    assert "stage 2 (again): the load guard's repeat" in offload.step_verdicts(runs, again, alone)
    assert "(10.1 ms against 10.1 ms at the start)" in offload.step_verdicts(runs, again, alone)
    table = offload.timing_table({**runs, again.name: again})  # the verdicts' medians, after the first step
    assert "median after the 1st" in table and "50.0" not in table
    assert " 20.1 " in next(line for line in table.splitlines() if line.startswith("stage 2 + optimizer"))
    with pytest.raises(FileNotFoundError, match="did the script run"):
        offload.chapter_records(tmp_path, since=time.time() + 60)


def _peaks(record: records.Record, accelerator: int, host: int) -> records.Record:
    """``record`` with rank 0's accelerator and host peaks replaced."""
    summary = copy.deepcopy(record.summary)
    summary["memory"]["peak_bytes_per_rank"] = [accelerator] * len(summary["memory"]["peak_bytes_per_rank"])
    summary["memory"]["host_peak_bytes_per_rank"] = [host] * len(summary["memory"]["host_peak_bytes_per_rank"])
    return records.Record(summary)


def test_the_timing_table_shows_one_peak_where_the_accelerator_is_the_host(swept):
    same = offload.timing_table({"stage 2": _peaks(swept["stage 2"], 2**30, 2**30)})
    assert "peak RSS (accelerator = host)" in same and "host peak RSS" not in same
    apart = offload.timing_table({"stage 2": _peaks(swept["stage 2"], 2**30, 2**31)})
    assert "accelerator peak" in apart and "host peak RSS" in apart and "2 GiB" in apart


def test_the_stage_2_offload_buffers_are_explained_from_their_bytes(swept):
    record = swept["stage 2 offload"]
    placement = record.memory.placement(0)
    partition = 2 * record.params // 2  # bf16 partition of 2 ranks
    note = offload.buffers_note({"stage 2": swept["stage 2"], "stage 2 offload": record})
    assert note.startswith("stage 2 offload's buffers: A 128 KiB is the gradient staging buffer")  # 65,536 x 2 bytes
    assert f"plus a bf16 copy of the rank's parameter partition ({records.format_bytes(partition)})" in note
    assert placement["host"]["buffers"] - placement["accelerator"]["buffers"] == partition
    assert "no staging buffers" in offload.buffers_note({"stage 2": swept["stage 2"]})


def test_pinning_advice_reads_the_pinned_bytes_per_partition_element(swept):
    assert "nothing is pinned here" in offload.pinning_advice({"stage 2 offload": swept["stage 2 offload"]})
    for _, _, _, runs in references.reference_runs("offload"):
        trained = {k: r for k, r in runs.items() if not isinstance(r, dict)}
        advice = offload.pinning_advice(trained)
        unpinned = trained["stage 3 + optimizer and param offload, unpinned"]
        shards = unpinned.memory.placement(0)["host"]["params"] / (unpinned.params / unpinned["world_size"])
        assert shards == 2  # bf16 parameter shards: what stage 3 pins without being asked
        assert f"stage 3 + optimizer and param offload, unpinned {shards:.1f}" in advice
        assert "pin_memory false did not stop stage 3 + optimizer and param offload, unpinned" in advice
        assert "Adam's states are never pinned" in advice
        assert "stage 2 + optimizer offload, unpinned" not in advice.split("Ψ/N_d:")[1].split(".")[0].replace(
            "stage 3 + optimizer and param offload, unpinned", "")  # pinning nothing, it has no figure


def test_the_offloaded_step_bounds_the_cost_estimate(swept):
    transfers = {"bytes": 1, "bytes_per_s": {"device_to_host_pinned": 5e10, "host_to_device_pinned": 5e10}}
    bench = _bench(2, seconds=1.0, transfers=transfers)  # 119 ns per parameter: slower than the step allows
    trained = {"stage 2 + optimizer offload": _timed(swept["stage 2 offload"], [50, 10, 10, 10])}
    bound = 0.01 / trained["stage 2 + optimizer offload"].params
    text = offload.bounded_cost_lines(bench, trained, "here", psis=(7e9,))
    cost = offload.offload_step_cost_s(7e9, 8, "optimizer", 5e10, 5e10, bound, 1e-4 / 2**22)
    assert f"{bound * 1e9:.2f} ns per parameter or faster" in text
    assert f"optimizer offload: at most {cost['total_s']:.2f} s more per step" in text
    assert "up to" not in text
    assert "2 ranks ran 1 threads each" in text
    fast = _bench(2, seconds=1e-6, transfers=transfers)  # a benchmark faster than the bound: no excuse needed
    assert "reads slower" not in offload.bounded_cost_lines(fast, trained, "here", psis=(7e9,))


def test_the_plot_caps_each_line_at_the_host_as_the_table_does():
    fig = offload.largest_model([40, 80], 8, 16, host_gb=2000, host_grad_bytes={2: 6.0, 3: 6.0})
    ax = fig.axes[0]
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines["stage 3 + optimizer offload"][1] == pytest.approx(2000 / 18)  # the table's measured host limit
    assert lines["stage 3 + optimizer+params offload"][1] == pytest.approx(2000 / 20)
    assert lines["stage 2"][1] == pytest.approx(64 / (2 + (2 + 12) / 8))  # accelerator-limited: unchanged
    assert "bf16" in ax.get_title() and "2000 GB host" in ax.get_title()
    free = offload.largest_model([80], 8, 16)  # no host given: the accelerator alone
    free_lines = {line.get_label(): list(line.get_ydata()) for line in free.axes[0].get_lines()}
    assert free_lines["stage 3 + optimizer offload"][0] == pytest.approx(64 / 2 * 8)


# --- the exercises of chapter 06 ---------------------------------------------------------------------

def test_the_host_bytes_exercise_counts_what_the_probe_found_on_the_host(swept):
    runs = {"stage 2 + optimizer offload": swept["stage 2 offload"]}
    check = lambda answer: offload.exercise_host_bytes(answer, runs, name="stage 2 + optimizer offload")
    assert not check(...).answered and "to do" in str(check(...))
    assert check(18) and "8 + the fp32 master 4 + gradients 6" in str(check(18))  # 8 + 4 + (4 + 2)
    assert not check(14) and "Hint" in str(check(14))  # the paper's 2 + K


def test_the_fit_exercise_wants_stage_3_with_pinned_optimizer_offload(swept):
    runs = {"stage 2 offload": swept["stage 2 offload"], "stage 3 offload": swept["stage 3 offload"]}
    check = lambda zero: offload.exercise_fit_config(zero, runs)
    cpu = {"device": "cpu", "pin_memory": True}
    assert not check(...).answered
    assert check({"stage": 3, "offload_optimizer": cpu})
    assert check({"stage": 3, "offload_optimizer": {"device": "cpu"}})  # DeepSpeed pins by default
    both = str(check({"stage": 3, "offload_optimizer": cpu, "offload_param": cpu}))  # fits, with more host memory
    assert "not yet" in both and "also fits and keeps 2.25 bytes per parameter per rank" in both
    assert "2.25 on the host per rank (18.00 for all 8 ranks together" in str(check({"stage": 3, "offload_optimizer": cpu}))
    assert "at most 12.0B" in str(check({"stage": 2, "offload_optimizer": cpu}))  # 24 GB / 2 bytes per parameter
    assert not check({"stage": 3})
    assert "pin_memory is false" in str(check({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}))
    assert "checker finds" in str(check({"stage": 3, "offload_optimizer": {"device": "disk"}}))
    assert "TypeError" in str(check([3]))
    small_host = dict(offload.FIT_TASK, host_gb=100)  # 13B x 18 host bytes is more than 100 GB
    assert "host memory limits" in str(offload.exercise_fit_config({"stage": 3, "offload_optimizer": cpu}, runs, small_host))


# --- the exercises of chapter 07 ---------------------------------------------------------------------

def test_the_loss_scale_exercise_follows_deepspeeds_scaler_step_by_step():
    check = precision.exercise_loss_scale
    assert not check(...).answered
    assert check(2**15) and "5 overflow -> 2^14 (h 1)" in str(check(2**15))  # the second halving
    assert not check(2**14) and not check(2**16)
    path = precision.drive_loss_scaler({"hysteresis": 1, "min_loss_scale": 32768}, [True, True, True])
    assert path == [(32768, 1), (32768, -1)]  # the floor, then DeepSpeed ends the run


def test_the_fp16_block_exercise_reads_back_what_deepspeed_built():
    check = precision.exercise_fp16_block
    right = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 100, "hysteresis": 1,
             "min_loss_scale": 1024}
    assert not check(...).answered
    assert check(right) and "2048, 1024, and overflow 3 ends the run" in str(check(right))
    assert "hysteresis is 2, not 1" in str(check({**right, "hysteresis": 2}))
    task = str(check(...))
    assert "halves the scale at the first overflow" in task and "hysteresis" not in task.split("Hint")[0]
    assert "static scale" in str(check({**right, "loss_scale": 1024}))
    assert "not enabled" in str(check({k: v for k, v in right.items() if k != "enabled"}))
    assert "checker finds" in str(check({**right, "loss_scale_window": 0}))


def test_the_half_ratio_exercise_rescales_what_zero2_splits(swept):
    runs = {(2, "fp32"): swept["accum fp32 training"], (2, "bf16"): swept["stage 2"]}
    check = lambda answer, world=8: precision.exercise_half_ratio(answer, runs, world_size=world)
    assert not check(...).answered
    assert check(3.75 / 6) and "= 6.000 bytes per parameter" in str(check(3.75 / 6))  # (2 + 14/8) / (4 + 16/8)
    assert check(9 / 12, world=2)  # the ranks the runs had: their measured totals
    assert not check(0.5) and "Hint" in str(check(0.5))


def test_the_bf16_bytes_exercise_divides_the_measured_states_by_the_parameters(swept):
    check = lambda answer: precision.exercise_bf16_bytes(answer, swept, key="accum bf16")  # ZeRO-2, 2 ranks
    assert not check(...).answered
    assert check(9) and "bf16 parameters 2.00 + bf16 gradients 1.00" in str(check(9))  # 2 + (2 + 12) / 2
    assert not check(16)


def test_the_stage_3_bucket_is_deepspeeds_default_reduce_bucket_size():
    """The bucket the committed GPU reference measured on the accelerator at stage 3 is DeepSpeed's default
    ``reduce_bucket_size`` in bf16, whatever the model."""
    assert offload.stage3_bucket_bytes(4) == 2 * offload.stage3_bucket_bytes(2)
    for _, _, _, runs in references.reference_runs("offload"):
        stage3 = runs["stage 3"]
        assert stage3.memory.placement(0)["accelerator"]["buffers"] == offload.stage3_bucket_bytes(2)
        assert stage3.params * 2 != offload.stage3_bucket_bytes(2)  # not the model's size
        assert "The GPU's allocator holds all of it" in offload.bucket_sentence(
            {k: r for k, r in runs.items() if isinstance(r, records.Record)})


def test_the_bucket_sentence_reads_the_stage_3_buffer_and_the_peak(swept):
    text = offload.bucket_sentence({"stage 3 offload": swept["stage 3 offload"]})
    assert f"({records.format_bytes(offload.stage3_bucket_bytes(2))} in every stage 3 run" in text
    assert "500,000,000 elements" in text and "reduce_bucket_size sizes it" in text
    assert "larger than the runs' peak RSS" in text  # CPU ranks: the untouched pages are not resident
    assert "No stage 3 run" in offload.bucket_sentence({"stage 2": swept["stage 2"]})


def test_the_reference_step_times_go_through_the_load_guard(monkeypatch):
    found = references.reference_runs("offload")
    text = offload.reference_step_verdicts()
    # its conditions: one notebook at a time on its own two GPUs (others on the other two): alone, as a watch counts
    assert "stage 2 faster" in text and "within the steps' spread" in text and "not measured alone" not in text
    assert "Parameter offload against optimizer offload alone: stage 3 + optimizer and param offload" in text
    monkeypatch.setattr(references, "reference_conditions", lambda name: ["beside 2 other notebooks"] * len(found))
    assert offload.reference_step_verdicts().count("withheld") >= 5
    runs = found[0][3]
    pinned, unpinned = runs["stage 2 + optimizer offload"], runs["stage 2 + optimizer offload, unpinned"]
    expected = (f"{statistics.median(pinned.timing.all_s[1:]) * 1e3:.0f} vs "
                f"{statistics.median(unpinned.timing.all_s[1:]) * 1e3:.0f}")
    assert expected in text and "host to device pageable" in text
    monkeypatch.setattr(references, "reference_conditions", lambda name: ["alone"] * len(found))
    alone = offload.reference_step_verdicts()
    assert "stage 2 faster" in alone  # stage 2 without offload: far beyond the steps' spread
    monkeypatch.setattr(references, "reference_runs", lambda name: [])
    assert "No GPU results" in offload.reference_step_verdicts()


def test_an_old_benchmark_says_it_does_not_compare():
    assert "does not compare" in offload.cost_lines(_bench(None), "old")
    assert "does not compare" not in offload.cost_lines(_bench(2), "new")


def test_the_timing_table_names_its_peak_once():
    for _, _, _, runs in references.reference_runs("offload"):
        table = offload.timing_table({k: r for k, r in runs.items() if isinstance(r, records.Record)})
        assert "accelerator peak" in table and table.count("max_memory_allocated") == 1


def test_the_fused_sentence_says_fused_won_only_where_the_guard_allows_it():
    busy = load_guard.Load("cpu", 3, 0.5, 2, 10.0, 20, "test")
    alone = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
    fast = _bench(2, seconds=0.02)
    fast["adam"]["seconds"]["torch.optim.AdamW(fused=True)"] = 0.01
    fast["adam"]["steps_s"]["torch.optim.AdamW(fused=True)"] = [0.01, 0.0101, 0.01]
    assert offload.fused_sentence(fast, alone).startswith(
        "On this machine torch.optim.AdamW(fused=True) stepped faster (torch.optim.AdamW(fused=True) 10.00 ms "
        "against 20.00 ms per step)")
    assert offload.fused_sentence(fast, busy).startswith("No ranking of torch.optim.AdamW(fused=True)")
    slow = copy.deepcopy(fast)
    slow["adam"]["steps_s"]["torch.optim.AdamW(fused=True)"] = [0.04, 0.0401, 0.04]
    assert "did not beat DeepSpeedCPUAdam" in offload.fused_sentence(slow, alone)
    assert "did not step both" in offload.fused_sentence(_bench(2), alone)


def test_the_reference_headline_reads_the_step_times_and_the_copy_rates():
    (device, date, _, runs), = references.reference_runs("offload")[:1]
    text = offload.reference_headline()
    assert text.startswith(f"GPU reference: {device}, {date}")
    offloaded, plain = runs["stage 3 + optimizer offload"], runs["stage 3"]
    assert (f"stage 3 + optimizer offload: {statistics.median(offloaded.timing.all_s[1:]) * 1e3:.0f} ms per step, "
            f"no offload {statistics.median(plain.timing.all_s[1:]) * 1e3:.0f} ms") in text
    rates = next(r for r in runs.values() if isinstance(r, dict))["transfers"]["bytes_per_s"]
    assert f"{rates['host_to_device_pinned'] / 1e9:.1f} GB/s pinned" in text
    assert "no offload faster" in text  # the reference ran alone on its GPUs: the guard judges its steps


def test_the_pinning_rule_budgets_the_most_pinned_bytes_per_mode_and_never_adams_states():
    rule = offload.pinning_rule()
    _, _, _, runs = references.reference_runs("offload")[0]
    r = runs["stage 2 + optimizer offload"]
    per_element = r.memory.placement(0)["pinned_bytes"] / (r.params / r["world_size"])
    assert f"up to {per_element:.1f} pinned bytes per partition element" in rule
    assert "never Adam's states" in rule and "pin_memory false does not stop" in rule


def test_the_theory_table_keeps_the_distinct_cases(swept):
    runs = {"stage 2": swept["stage 2"], "stage 2 offload": swept["stage 2 offload"],
            "stage 2 offload, unpinned": swept["stage 2 offload"]}
    table = offload.theory_table(runs)
    assert "0 = 0" not in table  # stage 2 holds nothing on the host, in the formula and measured
    assert "stage 2 offload, pinned or not" in table and "stage 2 offload, unpinned" not in table
    assert len(table.splitlines()) == 2 + 1 + 2  # header and rule, stage 2's accelerator, the twins' two sides


def test_a_plotted_line_that_coincides_with_another_says_so():
    fig = offload.largest_model([40, 80], 8, 16, host_gb=2000, host_grad_bytes={2: 6.0, 3: 6.0})
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "stage 3 (same as stage 2 + optimizer offload)" in labels
