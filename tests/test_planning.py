"""What the calculator computes, in helpers.core.theory and helpers.core.models: offload placement, the paper's
collectives of a step, predicted communication time, LLaMA-style parameter counts."""

from __future__ import annotations

import pytest

from helpers.core import models, theory

PSI = 1_000_000
KEYS = ("params", "grads", "optimizer", "master")


# --- where model states live ------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_without_offload_everything_stays_on_the_gpu(stage, precision):
    where = theory.placement(PSI, stage, 4, precision)
    assert where["gpu"] == theory.model_state_bytes(PSI, stage, 4, precision)
    assert where["offloaded"] == {k: 0 for k in (*KEYS, "total")}


@pytest.mark.parametrize("stage, optimizer, param, moved", [
    (0, True, True, set()),  # DeepSpeed offloads nothing at stage 0
    (2, True, False, {"optimizer", "master", "grads"}),
    (2, False, True, set()),
    (3, True, False, {"optimizer", "master", "grads"}),
    (3, False, True, {"params"}),
    (3, True, True, {"optimizer", "master", "grads", "params"}),
])
def test_offload_moves_exactly_these_states_and_loses_none(stage, optimizer, param, moved):
    states = theory.model_state_bytes(PSI, stage, 4, "bf16")
    where = theory.placement(PSI, stage, 4, "bf16", optimizer, param)
    for key in KEYS:
        assert where["offloaded"][key] == (states[key] if key in moved else 0), key
        assert where["gpu"][key] + where["offloaded"][key] == states[key], key
    assert where["gpu"]["total"] + where["offloaded"]["total"] == pytest.approx(states["total"])


@pytest.mark.parametrize("param", [False, True])  # parameters move at stage 3 only
def test_stage_1_offload_keeps_the_whole_gradient_on_the_gpu_and_its_partition_on_the_host(param):
    states = theory.model_state_bytes(PSI, 1, 4, "bf16")
    where = theory.placement(PSI, 1, 4, "bf16", True, param)
    assert where["gpu"]["grads"] == states["grads"]  # accumulating micro-steps need the whole gradient
    assert where["offloaded"]["grads"] == states["grads"] / 4  # the partition the CPU optimizer reads
    for key in ("optimizer", "master"):
        assert where["offloaded"][key] == states[key] and where["gpu"][key] == 0
    assert where["gpu"]["params"] == states["params"] and where["offloaded"]["params"] == 0


def test_offload_agrees_with_deepspeeds_own_estimator_where_both_count_the_same():
    # DeepSpeed's stage-2 estimator with optimizer offload keeps 2 bytes a parameter on the GPU: the
    # fp16/bf16 parameters, which is what the placement keeps too
    n = 8
    assert theory.placement(PSI, 2, n, "bf16", True)["gpu"]["total"] == theory.deepspeed_estimate_bytes(PSI, 2, n, 0, True)
    # stage 3 with everything offloaded: DeepSpeed keeps only the largest layer (4 bytes a parameter)
    assert theory.placement(PSI, 3, n, "bf16", True, True)["gpu"]["total"] == 0
    assert theory.deepspeed_estimate_bytes(PSI, 3, n, 1000, True, True) == 4000
    # its estimator has no case for parameter offload alone
    assert theory.deepspeed_estimate_bytes(PSI, 3, n, 1000, False, True) is None
    # without offload the estimator is the one the chapters already show
    assert theory.deepspeed_estimate_bytes(PSI, 2, 2) == 2 * PSI + 9 * PSI


def test_largest_model_that_fits():
    gib80 = 80 * 2**30
    # stage 0, bf16: 16 bytes a parameter
    assert theory.largest_model_that_fits(gib80, 0, 8, "bf16") == pytest.approx(gib80 / 16)
    # stage 3 on 8 GPUs: 2 bytes a parameter
    assert theory.largest_model_that_fits(gib80, 3, 8, "bf16") == pytest.approx(gib80 / 2)
    # stage 2 with optimizer offload: only the 2-byte parameters stay
    assert theory.largest_model_that_fits(gib80, 2, 8, "bf16", True) == pytest.approx(gib80 / 2)
    assert theory.largest_model_that_fits(gib80, 3, 8, "bf16", True, True) is None


# --- communication of one step ----------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 3, 8, 64])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_collectives_add_up_to_the_papers_volume(stage, n, precision):
    collectives = theory.step_collectives(PSI, stage, precision)
    sent = sum(theory.ring_bytes(op, size, n) for op, size in collectives)
    assert sent == pytest.approx(theory.comm_bytes_per_step(PSI, stage, precision) * theory.ring_factor(n))


def test_step_collectives_are_the_papers():
    assert [op for op, _ in theory.step_collectives(PSI, 0)] == ["all_reduce"]
    assert [op for op, _ in theory.step_collectives(PSI, 2)] == ["reduce_scatter", "all_gather"]
    assert [op for op, _ in theory.step_collectives(PSI, 3)] == ["all_gather", "all_gather", "reduce_scatter"]
    assert theory.step_collectives(PSI, 1, "bf16") == [("reduce_scatter", 2 * PSI), ("all_gather", 2 * PSI)]


def test_ring_bytes_match_the_comms_logger_convention():
    n, full = 4, 4000
    assert theory.ring_bytes("all_reduce", full, n) == theory.wire_bytes("all_reduce", full, n)
    assert theory.ring_bytes("reduce_scatter", full, n) == theory.wire_bytes("reduce_scatter", full, n)
    # the logger records an all_gather's own shard; the ring formula takes the gathered result
    assert theory.ring_bytes("all_gather", full, n) == theory.wire_bytes("all_gather", full // n, n)


def test_predicted_time_is_ring_bytes_over_the_link():
    cluster = theory.Cluster(gpus_per_node=4, nodes=2, gpu_memory_bytes=80e9, link_bytes_per_s=50e9)
    assert cluster.world_size == 8
    assert theory.collective_seconds("all_reduce", 1e9, cluster) == pytest.approx(2 * 7 / 8 * 1e9 / 50e9)
    seconds = theory.comm_seconds_per_step(PSI, 2, cluster, "bf16")
    assert seconds == pytest.approx(2 * 2 * PSI * 7 / 8 / 50e9)
    faster = theory.Cluster(4, 2, 80e9, 100e9)
    assert theory.comm_seconds_per_step(PSI, 2, faster, "bf16") == pytest.approx(seconds / 2)
    assert theory.comm_seconds_per_step(PSI, 3, cluster, "bf16") == pytest.approx(seconds * 1.5)


def test_the_calculator_and_the_fitted_models_share_one_time_formula():
    from helpers.topics import bandwidth
    cluster = theory.Cluster(gpus_per_node=4, nodes=2, link_bytes_per_s=50e9)
    assert bandwidth.AlphaBeta is theory.AlphaBeta and cluster.link == theory.AlphaBeta(0.0, 1 / 50e9)
    wire = theory.ring_bytes("all_gather", 3e9, 8)
    assert theory.collective_seconds("all_gather", 3e9, cluster) == cluster.link.seconds(wire)
    with pytest.raises(ValueError, match="bandwidth"):
        theory.AlphaBeta.link(0.0)


def test_default_link_is_stated_and_used():
    assert theory.Cluster().link_bytes_per_s == theory.DEFAULT_LINK_BYTES_PER_S


@pytest.mark.parametrize("kwargs, key", [({"gpus_per_node": 0}, "gpus_per_node"), ({"nodes": 1.5}, "nodes"),
                                         ({"gpu_memory_bytes": 0}, "gpu_memory_bytes"),
                                         ({"link_bytes_per_s": -1}, "link_bytes_per_s")])
def test_a_bad_cluster_names_its_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        theory.Cluster(**kwargs)


# --- LLaMA-style shapes -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(models.LLAMA_PRESETS))
def test_parameter_formula_equals_transformers_on_the_meta_device(name):
    shape = models.LLAMA_PRESETS[name]
    assert shape.parameters() == models.meta_parameters(shape)


def test_formula_with_tied_embeddings_and_grouped_query_attention():
    shape = models.LlamaPreset(hidden=256, layers=3, intermediate=688, heads=8, kv_heads=2, vocab=1000,
                              tied_embeddings=True)
    assert shape.parameters() == models.meta_parameters(shape)


def test_presets_span_125m_to_70b_and_include_the_chapters_7b():
    counts = {name: shape.parameters() for name, shape in models.LLAMA_PRESETS.items()}
    assert counts["7B"] == models.llama_7b_parameters()
    assert 1e8 < counts["125M"] < 1.5e8 and 6.5e10 < counts["70B"] < 7.5e10
    assert list(counts.values()) == sorted(counts.values())
    assert models.LLAMA_PRESETS["7B"].largest_layer() == 32000 * 4096
