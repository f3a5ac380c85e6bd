"""helpers.core.theory: the ZeRO paper's memory and communication formulas, checked by hand."""

from __future__ import annotations

import pytest

from helpers.core import theory
from helpers.topics import activations, pipeline, tensor_parallel

PSI = 1_000_000  # divisible by every world size used below, so the halvings are exact
STATE_KEYS = ("params", "grads", "optimizer", "master")


# --- the paper's 7.5B-parameter, 64-GPU table -------------------------------------------------

def test_paper_table_reproduces_the_papers_figures():
    table = theory.paper_table()
    assert set(table) == {0, 1, 2, 3}
    assert {stage: round(gb, 1) for stage, gb in table.items()} == theory.PAPER_FIGURE_1_GB


def test_paper_table_exact_values():
    # (2+2+12)*7.5 = 120; 4*7.5 + 12*7.5/64; 2*7.5 + 14*7.5/64; 16*7.5/64
    table = theory.paper_table()
    assert table[0] == pytest.approx(120.0)
    assert table[1] == pytest.approx(30 + 90 / 64)
    assert table[2] == pytest.approx(15 + 105 / 64)
    assert table[3] == pytest.approx(1.875)


def test_paper_table_other_arguments():
    # one rank: partitioning saves nothing, every stage is (2 + 2 + K) Ψ
    assert theory.paper_table(psi=1e9, world_size=1) == pytest.approx({0: 16.0, 1: 16.0, 2: 16.0, 3: 16.0})
    # K is a parameter: with K = 0 stage 1 is just 4Ψ
    assert theory.paper_table(psi=1e9, world_size=8, k=0)[1] == pytest.approx(4.0)


# --- model_state_bytes ------------------------------------------------------------------------

def _expected_states(psi: int, stage: int, n: int, precision: str) -> dict[str, float]:
    width = {"fp32": 4, "bf16": 2, "fp16": 2}[precision]
    states = {
        "params": width * psi / (n if stage >= 3 else 1),
        "grads": width * psi / (n if stage >= 2 else 1),
        "optimizer": 8 * psi / (n if stage >= 1 else 1),
        "master": (0 if precision == "fp32" else 4 * psi) / (n if stage >= 1 else 1),
    }
    states["total"] = sum(states.values())
    return states


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_matches_hand_formula(stage, world_size, precision):
    got = theory.model_state_bytes(PSI, stage, world_size, precision)
    assert set(got) == {*STATE_KEYS, "total"}
    assert got == pytest.approx(_expected_states(PSI, stage, world_size, precision))
    assert got["total"] == pytest.approx(sum(got[k] for k in STATE_KEYS))


def test_model_state_bytes_fp32_literal_values():
    assert theory.model_state_bytes(1000, 0, 2, "fp32") == {
        "params": 4000, "grads": 4000, "optimizer": 8000, "master": 0, "total": 16000}
    assert theory.model_state_bytes(1000, 3, 4, "fp32") == pytest.approx(
        {"params": 1000, "grads": 1000, "optimizer": 2000, "master": 0, "total": 4000})


def test_model_state_bytes_bf16_literal_values():
    assert theory.model_state_bytes(1000, 0, 2, "bf16") == {
        "params": 2000, "grads": 2000, "optimizer": 8000, "master": 4000, "total": 16000}
    assert theory.model_state_bytes(1000, 2, 2, "bf16") == pytest.approx(
        {"params": 2000, "grads": 1000, "optimizer": 4000, "master": 2000, "total": 9000})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage, halved", [
    (0, set()),
    (1, {"optimizer", "master"}),
    (2, {"optimizer", "master", "grads"}),
    (3, {"optimizer", "master", "grads", "params"}),
])
def test_partitioning_halves_exactly_the_right_keys_at_two_ranks(stage, halved, precision):
    unpartitioned = theory.model_state_bytes(PSI, 0, 2, precision)
    got = theory.model_state_bytes(PSI, stage, 2, precision)
    for key in STATE_KEYS:
        if key in halved:
            assert got[key] == pytest.approx(unpartitioned[key] / 2), key
        else:
            assert got[key] == pytest.approx(unpartitioned[key]), key
    if precision == "fp32":
        assert got["master"] == 0  # the paper counts no master copy in fp32


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_partitions_nothing(stage):
    assert theory.model_state_bytes(PSI, stage, 1, "bf16") == theory.model_state_bytes(PSI, 0, 1, "bf16")


@pytest.mark.parametrize("world_size", [1, 2, 8, 64])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_total_is_the_papers_formula(stage, world_size):
    # optimizer (8 bytes) + master (4 bytes) is the paper's K = 12
    total = theory.model_state_bytes(PSI, stage, world_size, "bf16")["total"]
    assert total == pytest.approx(theory.paper_bytes_per_device(PSI, stage, world_size))


# --- communication volume ---------------------------------------------------------------------

@pytest.mark.parametrize("precision, width", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_comm_bytes_stages_0_to_2_are_two_psi(stage, precision, width):
    assert theory.comm_elements_per_step(PSI, stage) == 2 * PSI
    assert theory.comm_bytes_per_step(PSI, stage, precision) == 2 * PSI * width


@pytest.mark.parametrize("precision, width", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_comm_bytes_stage_3_is_three_psi(precision, width):
    assert theory.comm_elements_per_step(PSI, 3) == 3 * PSI
    assert theory.comm_bytes_per_step(PSI, 3, precision) == 3 * PSI * width
    assert theory.comm_bytes_per_step(PSI, 3, precision) / theory.comm_bytes_per_step(PSI, 2, precision) == 1.5


def test_comm_bytes_default_precision_is_fp32():
    assert theory.comm_bytes_per_step(1000, 1) == 8000


def test_ring_factor():
    assert theory.ring_factor(1) == 0
    assert theory.ring_factor(2) == 0.5
    assert theory.ring_factor(8) == 7 / 8


# --- ring wire bytes --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_wire_bytes_ring_formulas(n):
    full = 1200 * n  # S for all_reduce / reduce_scatter
    shard = full // n  # what the logger records for all_gather
    assert theory.wire_bytes("all_reduce", full, n) == pytest.approx(2 * (n - 1) / n * full)
    assert theory.wire_bytes("all_gather", shard, n) == pytest.approx((n - 1) * shard)
    assert theory.wire_bytes("reduce_scatter", full, n) == pytest.approx((n - 1) / n * full)
    # reduce-scatter of S plus all-gather of S/n is exactly one ring all-reduce of S
    assert (theory.wire_bytes("reduce_scatter", full, n) + theory.wire_bytes("all_gather", shard, n)
            == pytest.approx(theory.wire_bytes("all_reduce", full, n)))


def test_wire_bytes_literal_values_and_op_variants():
    assert theory.wire_bytes("all_reduce", 1000, 4) == pytest.approx(1500)
    assert theory.wire_bytes("all_reduce_coalesced", 1000, 4) == pytest.approx(1500)
    assert theory.wire_bytes("all_gather_into_tensor", 250, 4) == pytest.approx(750)
    assert theory.wire_bytes("reduce_scatter_tensor", 1000, 4) == pytest.approx(750)
    assert theory.wire_bytes("broadcast", 1000, 4) == 1000  # other ops: the message once


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_wire_bytes_nothing_moves_on_one_rank_or_for_empty_messages(op):
    assert theory.wire_bytes(op, 1000, 1) == 0
    assert theory.wire_bytes(op, 0, 8) == 0


# --- bus bandwidth ----------------------------------------------------------------------------

def test_bus_bandwidth_nccl_tests_conventions():
    size, seconds, n = 1e9, 0.5, 8  # algbw = 2e9 B/s
    assert theory.bus_bandwidth("all_reduce", size, seconds, n) == pytest.approx(2e9 * 2 * 7 / 8)
    assert theory.bus_bandwidth("all_gather", size, seconds, n) == pytest.approx(2e9 * 7 / 8)
    assert theory.bus_bandwidth("all_gather_into_tensor", size, seconds, n) == pytest.approx(2e9 * 7 / 8)
    assert theory.bus_bandwidth("reduce_scatter", size, seconds, n) == pytest.approx(2e9 * 7 / 8)
    assert theory.bus_bandwidth("reduce_scatter_tensor", size, seconds, n) == pytest.approx(2e9 * 7 / 8)
    assert theory.bus_bandwidth("broadcast", size, seconds, n) == pytest.approx(2e9)


def test_bus_bandwidth_two_ranks():
    # at n = 2 an all-reduce's busbw equals its algbw, an all-gather's is half of it
    assert theory.bus_bandwidth("all_reduce", 100, 1, 2) == pytest.approx(100)
    assert theory.bus_bandwidth("all_gather", 100, 1, 2) == pytest.approx(50)


# --- DeepSpeed's own estimators ---------------------------------------------------------------

def test_deepspeed_estimate_bytes():
    assert theory.deepspeed_estimate_bytes(PSI, 0, 2) is None
    assert theory.deepspeed_estimate_bytes(PSI, 1, 2) is None
    # DeepSpeed 0.19: 2Ψ + 18Ψ/N at stage 2; 4 * largest layer + 18Ψ/N at stage 3 (no offload)
    assert theory.deepspeed_estimate_bytes(PSI, 2, 2) == 2 * PSI + 9 * PSI
    assert theory.deepspeed_estimate_bytes(PSI, 3, 2, largest_layer_params=1000) == 4000 + 9 * PSI


# --- bad arguments ----------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda: theory.model_state_bytes(PSI, 4, 2),
    lambda: theory.model_state_bytes(PSI, -1, 2),
    lambda: theory.model_state_bytes(PSI, 2, 2, "fp8"),
    lambda: theory.model_state_bytes(PSI, 2, 0),
    lambda: theory.paper_bytes_per_device(PSI, 4, 64),
    lambda: theory.paper_table(world_size=0),
    lambda: theory.comm_elements_per_step(PSI, 4),
    lambda: theory.comm_bytes_per_step(PSI, 5),
    lambda: theory.comm_bytes_per_step(PSI, 2, "int8"),
], ids=["stage4", "stage-1", "fp8", "world0", "paper-stage4", "paper-world0", "comm-elements-stage4",
        "comm-stage5", "comm-int8"])
def test_bad_stage_precision_or_world_size_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_error_messages_name_the_bad_value():
    with pytest.raises(ValueError, match="zero stage 4"):
        theory.model_state_bytes(PSI, 4, 2)
    with pytest.raises(ValueError, match="'fp8'"):
        theory.model_state_bytes(PSI, 2, 2, "fp8")


# --- beyond ZeRO (chapters 10-12) -------------------------------------------------------------

# the course's llama: b=4, s=64, h=64, a=4, i=172 (counted by hand from the formula's terms)
LLAMA = dict(batch=4, seq=64, hidden=64, heads=4, intermediate=172)


def test_activation_bytes_per_layer_fp32_terms():
    bsh, bsi, ass, bs = 4 * 64 * 64, 4 * 64 * 172, 4 * 64 * 64 * 4, 4 * 64
    got = activations.activation_bytes_per_layer(**LLAMA)
    assert got == {"b·s·h": 40 * bsh, "b·s·i": 16 * bsi, "a·s²·b": 4 * ass, "b·s": 8 * bs,
                   "total": 40 * bsh + 16 * bsi + 4 * ass + 8 * bs}
    assert got["total"] == 1_624_064  # what the activations probe measures for layer 1 (notebook 10)


def test_activation_bytes_per_layer_half_precision_keeps_fp32_copies():
    got = activations.activation_bytes_per_layer(**LLAMA, precision="bf16")
    # 8 bf16 + 2 fp32 b·s·h; 4 bf16 b·s·i; softmax in fp32 and cast back; two fp32 1/rms
    assert got["b·s·h"] == (8 * 2 + 2 * 4) * 4 * 64 * 64
    assert got["a·s²·b"] == (2 + 4) * 4 * 64 * 64 * 4
    assert got["total"] == 1_140_736
    assert activations.activation_bytes_per_layer(**LLAMA, precision="fp16") == got


@pytest.mark.parametrize("precision, width", [("fp32", 4), ("bf16", 2)])
def test_a_checkpointed_layer_keeps_only_its_input(precision, width):
    got = activations.activation_bytes_per_layer(**LLAMA, precision=precision, checkpointed=True)
    assert got["total"] == got["b·s·h"] == 4 * 64 * 64 * width


def test_activation_bytes_scale_linearly_in_batch_and_quadratically_in_attention():
    one = activations.activation_bytes_per_layer(1, 128, 64, 4, 172)
    four = activations.activation_bytes_per_layer(4, 128, 64, 4, 172)
    assert four["total"] == 4 * one["total"]
    longer = activations.activation_bytes_per_layer(1, 256, 64, 4, 172)
    assert longer["a·s²·b"] == 4 * one["a·s²·b"] and longer["b·s·h"] == 2 * one["b·s·h"]


def test_whole_model_activations_add_layers_rotary_and_the_head():
    per_layer = activations.activation_bytes_per_layer(**LLAMA)["total"]
    outside = 4 * (3 * 4 * 64 * 64 + 4 * 64 + 4 * 64 * 256 + 1)  # final norm, 1/rms, log-softmax, loss
    assert activations.activation_bytes_outside_layers(4, 64, 64, 256) == outside
    assert activations.rotary_bytes(64, 16) == 2 * 64 * 16 * 4
    assert activations.activation_bytes(2, **LLAMA, vocab=256) == 2 * per_layer + 2 * 64 * 16 * 4 + outside
    assert activations.activation_bytes(2, **LLAMA, vocab=256, checkpointed=True) == 2 * 4 * 64 * 64 * 4 + outside


@pytest.mark.parametrize("stages, micro_batches, expected", [(1, 4, 0.0), (2, 1, 0.5), (2, 4, 0.2), (4, 4, 3 / 7),
                                                             (8, 16, 7 / 23)])
def test_bubble_fraction(stages, micro_batches, expected):
    assert pipeline.bubble_fraction(stages, micro_batches) == pytest.approx(expected)


def test_bubble_fraction_refuses_nonsense():
    with pytest.raises(ValueError, match="micro_batches=0"):
        pipeline.bubble_fraction(2, 0)


def test_pipeline_sends_one_activation_per_micro_batch():
    assert pipeline.pipeline_p2p_bytes(4, 64, 64) == 65_536
    assert pipeline.pipeline_p2p_bytes(4, 64, 64, "bf16") == 32_768


def test_tensor_parallel_collectives_per_micro_step():
    got = tensor_parallel.tensor_parallel_collectives(layers=2, batch=8, seq=64, hidden=64, vocab=256, tp=2)
    assert got == {("all_reduce", "forward"): (4, 131_072), ("all_gather_into_tensor", "forward"): (1, 262_144),
                   ("all_reduce", "backward"): (11, 131_072)}
    # on 2 ranks an all-reduce sends its size once, an all-gather its shard once
    assert tensor_parallel.tensor_parallel_wire_bytes(2, 8, 64, 64, 256, 2) == 15 * 131_072 + 262_144


def test_zero3_wire_bytes_grow_with_parameters_not_tokens():
    assert theory.zero3_wire_bytes(131_904, 2) == 131_904 * 4
    assert theory.zero3_wire_bytes(131_904, 4) == pytest.approx(2 * 131_904 * 4 * 3 / 4)
