"""Sequence parallelism (chapter 12b): the formulas, the checks before launch, the search's bookkeeping, the
exercises' checks and the core pieces Ulysses needs (a builder's initialize arguments, the data-parallel
coordinates of a sequence-parallel engine, the batch arithmetic of the config checker)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from helpers.core import configs, load_guard, models, records, references, theory, train
from helpers.topics import activations, sequence_parallel as sp

OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_all_to_all_calls_count_eight_per_layer_of_one_ranks_tensor_and_repeat_few_kv_heads():
    calls = sp.all_to_all_calls(layers=2, batch=4, seq=64, hidden=64, heads=4, kv_heads=4, size=2)
    assert calls == {"queries and outputs": (8, 4 * 32 * 64 * 4), "keys and values": (8, 4 * 32 * 64 * 4)}
    # 2 key/value heads of 16 values on 4 ranks: each repeated to 4
    gqa = sp.all_to_all_calls(layers=1, batch=1, seq=8, hidden=128, heads=8, kv_heads=2, size=4, precision="bf16")
    assert gqa["keys and values"] == (4, 1 * 2 * 4 * 16 * 2)
    assert sp.all_to_all_wire_bytes(2, 4, 64, 64, 4, 4, 2) == sp.all_to_all_bytes(2, 4, 64, 64, 4, 4, 2) / 2


def test_the_wire_bytes_of_an_all_to_all_leave_out_the_part_a_rank_keeps():
    assert theory.wire_bytes("all_to_all_single", 1000, 4) == 750
    assert theory.wire_bytes("all_to_all_single", 1000, 1) == 0


def test_the_layer_formula_is_chapter_10s_without_the_softmax_plus_a_log_sum_exp_and_splits_the_tokens():
    eager = activations.activation_bytes_per_layer(2, 128, 64, 4, 172)
    assert sp.activation_bytes_per_layer(2, 128, 64, 4, 172) == eager["total"] - eager["a·s²·b"] + 4 * 2 * 4 * 128
    assert sp.activation_bytes_per_layer(2, 128, 64, 4, 172, size=4) == sp.activation_bytes_per_layer(2, 32, 64, 4, 172)
    assert sp.ulysses_extra_bytes(2, 128, 64, 4) == 2 * 32 * 64 * 4 and sp.ulysses_extra_bytes(2, 128, 64, 1) == 0
    with pytest.raises(ValueError, match="equal slices"):
        sp.activation_bytes_per_layer(1, 100, 64, 4, 172, size=8)


def test_token_slices_cover_the_sequence_once_and_refuse_an_uneven_split():
    parts = [sp.token_slice(12, 3, r) for r in range(3)]
    assert [i for part in parts for i in range(12)[part]] == list(range(12))
    with pytest.raises(ValueError, match="multiple of 5"):
        sp.token_slice(12, 5, 0)


def _errors(config, model="llama", world=8, seq=None, attention="sdpa"):
    return [(f.key, f.rule) for f in sp.findings({**config, **OPTIMIZER}, model, world, seq, attention)
            if f.severity == "error"]


def test_findings_name_the_key_and_the_rule_deepspeed_would_raise_before_any_process_starts():
    base = {"train_micro_batch_size_per_gpu": 1}
    assert _errors({**base, "sequence_parallel_size": 4}) == []
    heads = _errors({**base, "sequence_parallel_size": 8}, "llama-medium")
    assert heads and heads[0][0] == "sequence_parallel_size" and "12 attention heads" in heads[0][1]
    assert _errors({**base, "sequence_parallel_size": 4}, seq=102)[0][0] == "model_options.seq"
    assert _errors({**base, "sequence_parallel_size": 2}, world=2, attention="eager")[0][0] == "attn_implementation"
    world = _errors({**base, "sequence_parallel_size": 3})
    assert world and world[0][0] == "sequence_parallel_size" and "whole sequence-parallel groups" in world[0][1]


def test_the_config_checker_counts_sequence_parallel_groups_in_the_batch_as_deepspeed_does():
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "sequence_parallel_size": 4, **OPTIMIZER}
    found = [f for f in configs.check(config, 8) if f.key == "train_batch_size"]
    assert found and "counts the 2 sequence-parallel groups" in found[0].rule
    assert not [f for f in configs.check({**config, "train_batch_size": 2}, 8) if f.severity == "error"]
    assert configs.deepspeed_parse({**config, "train_batch_size": 2}, 8) is None


def test_the_builder_returns_the_model_alone_and_checks_its_options():
    model = sp.build_model("llama", config={"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2})
    assert model.config._attn_implementation == "sdpa"  # Ulysses is registered by initialize, not here
    assert sp.build_model("llama", seq=256).config.max_position_embeddings == 256
    with pytest.raises(ValueError, match="'seq'"):
        sp.check_options("llama", {"sequence": 8})
    with pytest.raises(ValueError, match="plain LLaMA-style size"):
        sp.check_options("mlp", {})


def test_reset_attention_puts_back_what_ulysses_replaced_and_keeps_transformers_own():
    table = sp._attention_table()
    original = table["sdpa"]
    try:
        sp.reset_attention("sdpa")
        table["sdpa"] = lambda *a, **k: None  # as register_with_transformers replaces it
        sp.reset_attention("sdpa")  # the next build
        assert table["sdpa"] is original
        assert sp._ORIGINAL_ATTENTION["sdpa"] is original
    finally:
        table["sdpa"] = original


def test_rank_code_names_the_chapters_module_and_imports_it_fresh(tmp_path, monkeypatch):
    from helpers.core import environment, plan

    monkeypatch.setattr(environment, "REPO_ROOT", tmp_path)
    module = tmp_path / "runs" / "chapter" / "rank_code_probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("def build_model(*a):\n    return 1\n\ndef initialize(*a):\n    return 3\n\n"
                      "def train_step(*a):\n    return [1.0]\n")
    code = sp.rank_code(module)
    assert code == ("runs.chapter.rank_code_probe:build_model", "runs.chapter.rank_code_probe:initialize",
                    "runs.chapter.rank_code_probe:train_step")
    assert plan.resolve(code.builder)() == 1 and plan.resolve(code.initialize)() == 3
    module.write_text("def build_model(*a):\n    return 2\n\ndef train_step(*a):\n    return [2.0]\n")
    assert plan.resolve(sp.rank_code(module).builder)() == 2  # an edited module is read again
    with pytest.raises(ValueError, match="inside"):
        sp.rank_code(tmp_path.parent / "elsewhere.py")


def test_a_sequence_parallel_engine_gives_one_data_parallel_coordinate_per_group(monkeypatch):
    import deepspeed.comm as dist

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    engine = types.SimpleNamespace(dp_world_size=None, sequence_parallel_size=2, seq_dp_world_size=8,
                                   seq_data_parallel_group=object())
    assert train.data_parallel_coords(engine) == (2, 4)


def test_the_search_reads_the_longest_sequence_that_fitted_and_the_first_that_did_not():
    outcomes = sp.fit_outcomes({"ulysses-1024": object(), "ulysses-2048": RuntimeError("rank 0 failed: "
                                "OutOfMemoryError: CUDA out of memory"), "one-sequence-1024": RuntimeError("boom\nmore")})
    assert outcomes == {"ulysses-1024": "fits", "ulysses-2048": "out of memory", "one-sequence-1024": "boom"}
    assert sp.longest_fitting(outcomes, "ulysses") == (1024, 2048)
    assert sp.longest_fitting(outcomes, "one-sequence") == (None, 1024)


def test_the_predicted_bytes_follow_each_ways_formula():
    shape = models.shape_of("llama")
    psi = models.parameters_of("llama")
    assert sp.predicted_sent_bytes("zero3", shape, psi, 64, 2, "fp32") == theory.zero3_wire_bytes(psi, 2, "fp32")
    two, four = (sp.predicted_sent_bytes("pipeline", shape, psi, 64, n, "fp32") for n in (2, 4))
    assert four == 4 * two  # twice the micro-batches, and a middle stage sends both ways
    with pytest.raises(ValueError, match="one of"):
        sp.predicted_sent_bytes("fsdp", shape, psi, 64, 2)


def test_a_model_larger_than_zero3_keeps_gathered_is_gathered_again_three_messages_as_chapter_13_counts():
    shape, psi = sp.ARTICLE_SHAPE, models.llama_7b_parameters()
    assert sp.regathers(psi) and not sp.regathers(models.parameters_of("llama"))
    once, again = (sp.predicted_sent_bytes("zero3", shape, psi, 4096, 8, "bf16", regather=r) for r in (False, True))
    assert again == 3 * psi * 2 * theory.ring_factor(8) and once == 2 * psi * 2 * theory.ring_factor(8)
    u_once, u_again = (sp.predicted_sent_bytes("ulysses-compare", shape, psi, 4096, 8, "bf16", regather=r)
                       for r in (False, True))
    assert u_again - u_once == 8 * psi * 2 * theory.ring_factor(8)  # one more bf16 gather in each of 8 micro-steps


def test_tensor_parallel_activations_split_the_matrices_outputs_and_keep_the_norms_whole():
    b, s, h, a, i = 1, 64, 64, 4, 172
    whole = sp.activation_bytes_per_layer(b, s, h, a, i)
    assert sp.tensor_parallel_activation_bytes(b, s, h, a, i, size=1) == whole
    norms = 4 * (6 * b * s * h + 2 * b * s)  # two RMSNorms: input, normalized, weighted (fp32), 1/rms per token
    split = 4 * (4 * b * s * h + 4 * b * s * i + a * b * s)  # q, k, v, attention output, the MLP's four, log-sum-exp
    assert sp.tensor_parallel_activation_bytes(b, s, h, a, i, size=2) == norms + split / 2
    with pytest.raises(ValueError, match="evenly"):
        sp.tensor_parallel_activation_bytes(b, s, h, a, i, size=3)


def test_the_activation_check_says_exact_on_cpu_and_names_cudas_rng_state():
    def rows(device, extra):
        return [{"layer": 100 + extra, "formula": 100, "layer_split": 60 + extra, "formula_split": 60, "device": device}]
    assert "0 bytes: the formula is exact" in sp.activation_check(rows("cpu", 0))
    assert "seed and offset" in sp.activation_check(rows("cuda", sp.SDPA_CUDA_RNG_BYTES))
    assert "not explained" in sp.activation_check(rows("cuda", 8))
    assert "not explained" in sp.activation_check(rows("cpu", 16))
    assert "int64" not in sp.activation_check(rows("cpu", 0))  # the CUDA detail is the closing section's


def test_what_if_rows_pick_the_cheapest_way_per_length():
    rows = sp.what_if_rows(sp.ARTICLE_SHAPE, models.llama_7b_parameters(), 8, (4096, 262144))
    assert len(rows) == 2 * len(sp.COMPARED)
    holds = sp.cheapest(rows, "activations")
    assert holds == {4096: "ulysses-compare", 262144: "ulysses-compare"}
    autotp, zero3 = (next(r["activations"] for r in rows if r["seq"] == 4096 and r["way"] == w) for w in ("autotp", "zero3"))
    assert autotp < zero3 / 2  # its split matrices keep 1/8 of their outputs
    sends = sp.cheapest(rows, "NVLink 4")
    assert all(min(r["NVLink 4"] for r in rows if r["seq"] == s) ==
               next(r["NVLink 4"] for r in rows if r["seq"] == s and r["way"] == way) for s, way in sends.items())


def test_the_config_exercise_wants_the_largest_group_the_stage_and_the_asked_samples():
    test = sp.ulysses_config_test(16, "llama-medium", 6144, 32, stage=3)
    right = {"train_micro_batch_size_per_gpu": 8, "sequence_parallel_size": 4, "zero_optimization": {"stage": 3},
             **OPTIMIZER}
    assert test(right)[0]
    assert not test({**right, "sequence_parallel_size": 2})[0]  # allowed, not the largest
    assert not test({**right, "sequence_parallel_size": 8})[0]  # 12 heads
    assert not test({**right, "train_micro_batch_size_per_gpu": 4})[0]  # 4 groups x 4: 16 samples
    assert "ZeRO-3" in test({**right, "zero_optimization": {"stage": 1}})[1]
    assert "not a config" in test([1])[1]
    assert not sp.exercise_ulysses_config(...).answered


def test_the_pages_config_exercise_is_bound_by_the_length_not_the_heads():
    # 24 GPUs and 12 heads would allow 12; 5,000 tokens split only into 1, 2 or 4 equal slices
    right = {"train_micro_batch_size_per_gpu": 8, "sequence_parallel_size": 4, "zero_optimization": {"stage": 3},
             **OPTIMIZER}
    assert sp.exercise_ulysses_config(right).right
    refused = sp.exercise_ulysses_config({**right, "sequence_parallel_size": 12, "train_micro_batch_size_per_gpu": 24})
    assert not refused.right and "5000 tokens do not split into 12" in refused.message
    assert "seq_length" in sp.exercise_ulysses_config(...).message


def test_the_layer_exercise_prints_the_probes_count_with_commas_and_hides_the_formula_in_its_hint(monkeypatch):
    monkeypatch.setattr(sp, "group_size", lambda record: 2)
    record = types.SimpleNamespace(section=lambda name: {"per_rank": [{"per_layer": [7, 11_452_416]}]},
                                   model_name="llama", precision="fp32")
    runs = {"ulysses-4096": record}
    assert str(sp.exercise_layer_bytes(11_452_416, runs)).endswith("right: 11,452,416 bytes: the activations probe "
                                                                  "counted exactly that on rank 0.")
    wrong = sp.exercise_layer_bytes(5_000_000, runs)
    assert not wrong.right and "5,000,000 bytes is not within 0.1%" in wrong.message
    assert not sp.exercise_layer_bytes("many", runs).right
    blank = sp.exercise_layer_bytes(..., runs)
    assert not blank.answered and "activation_bytes_per_layer" not in blank.message and "4,096 tokens" in blank.message


def test_the_equality_sentence_flags_a_gradient_of_another_scale_behind_the_same_losses():
    def run(norm, losses, stage):
        return types.SimpleNamespace(section=lambda name: {"per_step": [norm]}, losses=losses, precision="fp32",
                                     stage=stage)
    runs = {"data-parallel": run(2.0, [5.0, 4.0], 1), "ulysses": run(4.0, [5.0, 4.0], 1),
            "ulysses-zero3": run(2.0, [5.0, 4.0], 3)}
    assert sp.equality_sentence(runs).splitlines() == [
        "ulysses (ZeRO-1): the same losses, but a gradient 2.000x data-parallel's: another scale, which the losses "
        "hide (why: the rule above).",
        "ulysses-zero3 (ZeRO-3): the same losses and data-parallel's gradient norm (1.000x)."]


def test_the_calls_sentence_sorts_a_ulysses_runs_calls_into_all_to_alls_positions_and_zero():
    by_caller = {"all_to_all_single": {"ulysses": {"count": 32, "bytes": 1}},
                 "all_gather": {"positions": {"count": 4, "bytes": 1}},
                 "all_gather_into_tensor": {"allgather_fn": {"count": 2, "bytes": 1}},
                 "reduce_scatter_tensor": {"reduce_scatter_fn": {"count": 2, "bytes": 1}},
                 "all_reduce": {"norm": {"count": 1, "bytes": 1}}, "recv": {"x": {"count": 9, "bytes": 1}}}
    class Record(dict):  # a record's keys, read as attributes too
        __getattr__ = dict.__getitem__
    record = Record(name="ulysses-compare", model_name="llama", grad_accum=2, stage=3, data_parallel_size=1,
                    comm=types.SimpleNamespace(by_caller=by_caller), config={"sequence_parallel_size": 2})
    text = sp.calls_sentence(record)
    assert text.startswith("Ulysses (sequence) + ZeRO-3: 41 calls per step = 32 all-to-alls")
    assert "+ 4 all_gathers of the token positions" in text and "+ 5 of ZeRO-3" in text and "2 micro-steps" in text


def test_the_zero3_sentence_multiplies_the_models_traffic_by_the_micro_steps():
    shape, psi = sp.ARTICLE_SHAPE, models.llama_7b_parameters()
    rows = sp.what_if_rows(shape, psi, 8, (4096, 65536))
    text = sp.ulysses_zero3_sentence(rows, psi, 8)
    parts = sp.ulysses_sent_parts(shape, psi, 4096, 8, "bf16", regather=True)
    assert text.startswith("At 4,096 tokens Ulysses sends 358 GiB per rank and step against ZeRO-3's 32.9 GiB.")
    assert f"8 x {records.format_bytes(parts['ZeRO-3'] / 8)} = {records.format_bytes(parts['ZeRO-3'])}" in text
    assert "gathered twice" in text and "reducing fp32 gradients" in text


def test_the_ulysses_bytes_split_into_all_to_alls_positions_and_zero3_and_the_all_to_alls_grow_with_tokens():
    shape, psi = sp.ARTICLE_SHAPE, models.llama_7b_parameters()
    for seq in (4096, 65536):
        parts = sp.ulysses_sent_parts(shape, psi, seq, 8, "bf16", regather=True)
        assert sum(parts.values()) == sp.predicted_sent_bytes("ulysses-compare", shape, psi, seq, 8, "bf16", regather=True)
        assert parts["all-to-alls"] == 8 * sp.all_to_all_wire_bytes(shape.layers, 1, seq, shape.hidden, shape.heads,
                                                                    shape.heads, 8, "bf16")
    small, large = (sp.ulysses_sent_parts(shape, psi, seq, 8, "bf16", regather=True) for seq in (4096, 262144))
    assert large["all-to-alls"] == 64 * small["all-to-alls"] and large["ZeRO-3"] == small["ZeRO-3"]


def test_the_what_if_table_shows_the_model_states_only_when_asked():
    rows = sp.what_if_rows(sp.ARTICLE_SHAPE, models.llama_7b_parameters(), 8, sp.WHAT_IF_SEQUENCES)
    header = sp.what_if_table(rows).splitlines()[0]
    assert "ms on NVLink 4" in header and "25 Gb/s" not in header and "model states" not in header
    assert "model states per rank" in sp.what_if_table(rows, states=True).splitlines()[0]
    assert len(sp.what_if_table(rows).splitlines()) == 2 + 4 * len(sp.WHAT_IF_SEQUENCES)


def test_the_formula_names_each_kind_of_all_to_all_only_when_their_sizes_differ():
    same = sp.all_to_all_calls(2, 1, 64, 64, 4, 4, 2)
    assert sp._bytes_each(same) == f"{4 * 32 * 64:,}"
    fewer_kv = sp.all_to_all_calls(2, 1, 64, 64, 4, 1, 2)
    assert sp._bytes_each(fewer_kv) == f"queries and outputs {4 * 32 * 64:,}; keys and values {4 * 32 * 2 * 16:,}"


def _timed(times):
    return types.SimpleNamespace(timing=types.SimpleNamespace(all_s=times, median_s=sorted(times)[len(times) // 2]))


ALONE = load_guard.Load("gpu", 0, None, 2, 10.0, 20, "test")


def test_the_timing_verdict_drops_the_warm_up_and_needs_the_devices_alone_a_repeat_and_a_gap_beyond_the_spread():
    runs = {"zero3": _timed([9.0, 0.3, 0.35, 0.4]), "ulysses-compare": _timed([9.0, 2.0, 2.1, 2.2]),
            sp.REPEAT: _timed([9.0, 0.3, 0.36, 0.4])}
    given = sp.timing_verdict(runs, ALONE)
    assert "2,100 ms against 350 ms (medians of 3 and 3 steps)" in given and "slower here, 6.00x" in given
    busy = load_guard.Load("gpu", 1, 0.5, 2, 10.0, 20, "test")
    assert "withheld: 1 other process used these GPUs" in sp.timing_verdict(runs, busy)
    no_repeat = {k: v for k, v in runs.items() if k != sp.REPEAT}
    assert "withheld: the sweep did not measure its first setting" in sp.timing_verdict(no_repeat, ALONE)
    drifted = {**runs, sp.REPEAT: _timed([9.0, 0.6, 0.62, 0.64])}
    assert "withheld: the machine changed during the sweep" in sp.timing_verdict(drifted, ALONE)
    short = {k: _timed(v.timing.all_s[:3]) for k, v in runs.items()}  # two measured steps after the warm-up
    assert "withheld: too few measured steps" in sp.timing_verdict(short, ALONE)
    close = {**runs, "ulysses-compare": _timed([9.0, 0.3, 0.5, 0.9])}
    assert "is within the steps' spread" in sp.timing_verdict(close, ALONE)


def test_the_comparison_runs_keep_enough_steps_after_the_warm_up_and_zero3_is_measured_again_last(monkeypatch):
    seen = {}
    monkeypatch.setattr(sp.launch, "sweep", lambda specs, **kw: seen.update(specs) or {})
    sp.sequence_parallel_runs(world_size=2, steps=3)
    assert list(seen)[-1] == sp.REPEAT
    assert (seen[sp.REPEAT].config, seen[sp.REPEAT].overrides) == (seen["zero3"].config, seen["zero3"].overrides)
    assert {seen[n].steps for n in (*sp.COMPARED, sp.REPEAT)} == {1 + load_guard.MIN_STEPS}
    assert seen["data-parallel"].steps == 3
    assert sp.timed_steps(6) == 6


def _reference_runs() -> dict:
    """The committed GPU reference's runs (2 x H200): what a GPU launch of the chapter returns."""
    (_, _, _, runs), = references.reference_runs(sp.REFERENCE)
    return runs


def test_the_gpu_report_labels_this_run_and_judges_it_under_its_own_load():
    runs = _reference_runs()
    report = sp.run_report({**runs, sp.REPEAT: runs["zero3"]}, ALONE, Path("runs/reference/x.json"))
    first = report.splitlines()[0]
    assert first.startswith("THIS RUN, 2 x NVIDIA H200, ") and first.endswith("kept as runs/reference/x.json")
    assert "COMMITTED" not in report and "Ulysses (sequence) + ZeRO-3 was slower here" in report
    assert "verdict withheld: the sweep did not measure its first setting" in sp.run_report(runs, ALONE)


def test_the_committed_reference_is_labelled_and_judged_by_the_same_rules_under_the_load_it_kept(monkeypatch, tmp_path):
    report = sp.reference_report()
    assert report.startswith("COMMITTED REFERENCE (2 x NVIDIA H200, 2026-11-28; ")
    assert "verdict withheld: the sweep did not measure its first setting" in report  # measured without a repeat
    runs = {**_reference_runs(), sp.REPEAT: _reference_runs()["zero3"]}
    monkeypatch.setattr(references, "NEW_REFERENCE_DIR", tmp_path)
    monkeypatch.setattr(references, "REFERENCE_DIR", tmp_path)
    monkeypatch.delenv(references.CONDITIONS_VARIABLE, raising=False)
    kept = sp.keep_reference(runs, ALONE)
    assert kept.parent == tmp_path and references.reference_conditions(sp.REFERENCE)[0].startswith("not stated")
    assert "Ulysses (sequence) + ZeRO-3 was slower here" in sp.reference_report()  # the kept load, not the conditions
    sp.keep_reference(runs, load_guard.Load("gpu", 2, 0.9, 2, 10.0, 20, "test"))
    assert "verdict withheld: 2 other processes used these GPUs" in sp.reference_report()


def test_the_gpu_measurement_returns_the_runs_and_the_search_without_the_failed_ones(monkeypatch):
    asked = {}
    monkeypatch.setattr(sp, "sequence_parallel_runs",
                        lambda **kw: asked.update(kw) or {"zero3": "record", "ulysses-eager": ValueError("eager")})
    monkeypatch.setattr(sp, "fit_runs", lambda **kw: ({"ulysses-16384": "fit record",
                                                       "one-sequence-65536": RuntimeError("CUDA out of memory")}, []))
    runs = sp.gpu_measurement(world_size=2)
    assert (asked["size"], asked["batch"], asked["precision"], asked["growing"]) == ("llama-gpu", 4, "bf16", ())
    assert set(runs) == {"zero3", "fit: ulysses-16384", "fit outcomes"}
    assert runs["fit outcomes"]["outcomes"] == {"ulysses-16384": "fits", "one-sequence-65536": "out of memory"}
    assert asked["divided"] == sp.DIVIDED
    sp.gpu_measurement(world_size=2, divided=["ulysses"])  # the page's divided reaches the GPU runs
    assert asked["divided"] == ["ulysses"]


def test_the_gpu_report_labels_the_runs_the_page_divided():
    runs = _reference_runs()
    labelled = [line.split()[0] for line in sp.run_report(runs, ALONE, divided=["ulysses"]).splitlines()
                if "divided by P" in line]
    assert labelled == ["ulysses"]
    assert [line.split()[0] for line in sp.reference_report().splitlines() if "divided by P" in line] == list(sp.DIVIDED)


def test_the_pages_settings_reach_the_named_runs_and_an_unknown_run_is_refused(monkeypatch):
    seen = {}
    monkeypatch.setattr(sp.launch, "sweep", lambda specs, **kw: seen.update(specs) or {})
    sp.sequence_parallel_runs(world_size=2, settings={"ulysses": {"gradient_clipping": 0.5}})
    assert seen["ulysses"].overrides["gradient_clipping"] == 0.5
    assert "gradient_clipping" not in seen["data-parallel"].overrides
    with pytest.raises(ValueError, match="no such run"):
        sp.sequence_parallel_runs(world_size=2, settings={"ulyses": {}})


def test_the_pages_divided_runs_get_the_option_and_one_line_per_run_replaces_the_bars(monkeypatch, capsys):
    seen, kw_seen = {}, {}
    monkeypatch.setattr(sp.launch, "sweep", lambda specs, **kw: seen.update(specs) or kw_seen.update(kw) or {})
    sp.sequence_parallel_runs(world_size=2)
    assert {n for n, s in seen.items() if (s.options or {}).get("divide_by_group")} == set(sp.DIVIDED)
    assert kw_seen["progress"] is False
    kw_seen["on_event"]({"event": "run_start", "run": 0, "name": "data-parallel", "steps": 3})
    kw_seen["on_event"]({"event": "step", "run": 0, "name": "data-parallel", "step": 1, "steps": 3, "loss": 5.0})
    assert capsys.readouterr().out == f"run 1/{len(seen)}: data-parallel\n"
    seen.clear()
    sp.sequence_parallel_runs(world_size=2, divided=["ulysses"])
    assert {n for n, s in seen.items() if (s.options or {}).get("divide_by_group")} == {"ulysses"}
    with pytest.raises(ValueError, match="is no run"):
        sp.sequence_parallel_runs(world_size=2, divided=["ulyses"])


def test_the_labels_follow_the_divided_runs_not_their_names():
    def run(norm):
        return types.SimpleNamespace(section=lambda name: {"per_step": [norm]}, losses=[5.0], precision="fp32",
                                     config={"sequence_parallel_size": 2}, stage=1, probes={"grad_norm": 1})
    runs = {"data-parallel": run(2.0), "ulysses": run(2.0), "ulysses-zero3": run(2.0)}
    table = sp.equality_table(runs, divided=["ulysses"])
    assert [line.split()[0] for line in table.splitlines() if "divided by P" in line] == ["ulysses"]


def test_every_run_of_the_page_is_built_wrapped_and_trained_by_the_pages_three_functions(monkeypatch):
    seen = {}
    monkeypatch.setattr(sp.launch, "sweep", lambda specs, **kw: seen.update(specs) or {})
    page = sp.RankCode("runs.p:build_model", "runs.p:initialize", "runs.p:train_step")
    sp.sequence_parallel_runs(world_size=2, code=page)
    mine = {name: (s.builder, s.initialize, s.trainer) for name, s in seen.items() if name != "pipeline"}
    assert mine and set(mine.values()) == {tuple(page)}
    assert seen["pipeline"].initialize is None  # chapter 11's pipeline engine, made by the course's loop
    fits = []
    monkeypatch.setattr(sp.launch, "sweep_retrying", lambda specs, **kw: fits.extend(specs) or ({}, []))
    sp.fit_runs(world_size=2, code=page)  # the GPU search: the same page functions
    assert fits and {(s.builder, s.initialize, s.trainer) for s in fits} == {tuple(page)}


def test_initialize_registers_ulysses_only_for_a_group_and_passes_its_mpu(monkeypatch):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    calls = []
    monkeypatch.setattr(UlyssesSPAttentionHF, "register_with_transformers",
                        staticmethod(lambda **kw: calls.append(("register", kw)) or "the groups"))
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: calls.append(("initialize", kw)) or ("engine", 0, 0, 0))
    model = sp.build_model("llama", seq=256)
    run = types.SimpleNamespace(model="llama", model_options={"seq": 256, "attention": "eager"})
    assert sp.initialize(model, {"train_micro_batch_size_per_gpu": 1}, run) == "engine"
    assert [c[0] for c in calls] == ["initialize"] and calls[0][1]["mpu"] is None
    calls.clear()
    sp.initialize(model, {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}, run)
    (_, registered), (_, initialized) = calls
    assert (registered["sequence_parallel_size"], registered["seq_length"], registered["core_attn_implementation"]) \
        == (2, 256, "eager")
    assert initialized["mpu"] == "the groups" and initialized["model"] is model


def test_ulysses_gradients_travel_in_deepspeeds_sequence_parallel_communication_type():
    from deepspeed.runtime import constants

    assert sp.GRADIENT_COMMUNICATION == constants.SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT
    shape, psi = models.shape_of("llama-gpu"), models.parameters_of("llama-gpu")
    fp32, bf16 = (sp.predicted_sent_bytes("ulysses-compare", shape, psi, 1024, 2, "bf16", g) for g in ("fp32", "bf16"))
    assert fp32 - bf16 == 2 * psi * 2 * theory.ring_factor(2)  # 2 micro-steps, 2 more bytes a gradient, half sent


def test_the_scale_findings_sort_runs_by_their_step_one_gradient_and_losses():
    def run(norm, losses):
        return types.SimpleNamespace(section=lambda name: {"per_step": [norm]}, losses=losses, precision="fp32")
    runs = {"scale-data-parallel": run(2.0, [5.0, 4.0]), "a": run(2.0, [5.0, 4.0]), "b": run(4.0, [5.0, 3.9])}
    assert sp.scale_findings(runs, ("a", "b")) == ("data parallelism's gradient: a (1.000x)\n"
                                                   "another scale (and other losses): b (2.000x)")


def test_a_source_line_is_named_by_the_innermost_function_holding_it():
    source = ("X = 1\n"
              "class Engine:\n"
              "    def step(self):\n"
              "        def inner():\n"
              "            return 2\n"
              "        return inner()\n"
              "def free():\n"
              "    pass\n")
    functions = sp.enclosing_functions(source)
    assert [name for _, _, name in functions] == ["Engine.step", "Engine.step.inner", "free"]
    assert sp.function_of(functions, 1) == "(module level)"
    assert sp.function_of(functions, 5) == "Engine.step.inner"
    assert sp.function_of(functions, 6) == "Engine.step"
    assert sp.function_of(functions, 8) == "free"


def test_deepspeeds_gradient_division_is_printed_with_its_function():
    text = sp.deepspeed_source_by_function("runtime/zero/stage3.py", [r"buffer_to_reduce.div_\(averaging_world_sz"])
    lines = text.splitlines()
    assert lines[0].startswith("deepspeed/runtime/zero/stage3.py (deepspeed ")
    assert len(lines) == 2 and "in DeepSpeedZeroOptimizer_Stage3." in lines[1] and "sequence_parallel_size" in lines[1]
