"""The ZeRO paper's formulas (Rajbhandari et al., SC20, arXiv 1910.02054), in one place.

Notation as in the paper: Ψ parameters, N_d data-parallel ranks, K bytes of optimizer state per
parameter (K = 12 for mixed-precision Adam: fp32 master weights, momentum and variance).

Model-state bytes per rank (paper, section 5):

============  ==============================
stage 0 (DP)  (2 + 2 + K) Ψ
stage 1       4Ψ + KΨ / N_d
stage 2       2Ψ + (2 + K) Ψ / N_d
stage 3       (2 + 2 + K) Ψ / N_d
============  ==============================

For fp32 training the same bookkeeping is 4Ψ parameters, 4Ψ gradients and 8Ψ Adam moments,
with no master copy. Communication per step and rank (paper, section 7): 2Ψ elements for
stages 0-2 (reduce-scatter + all-gather), 3Ψ for stage 3 (one more all-gather of parameters).
"""

from __future__ import annotations

import dataclasses

PAPER_K = 12  # bytes of optimizer state per parameter for mixed-precision Adam
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
STAGES = (0, 1, 2, 3)


def _check(stage: int, world_size: int, precision: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"zero stage {stage!r}: ZeRO has stages 0, 1, 2 and 3")
    if world_size < 1:
        raise ValueError(f"world_size {world_size!r}: needs at least one rank")
    if precision not in BYTES_PER_ELEMENT:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(BYTES_PER_ELEMENT)}")


def model_state_bytes(psi: int, stage: int, world_size: int, precision: str = "fp32") -> dict[str, float]:
    """Bytes of model states per rank, split the way a run measures them.

    Keys: ``params``, ``grads``, ``optimizer`` (Adam's two moments, 8 bytes a parameter) and
    ``master`` (the fp32 copy of the weights that mixed precision keeps; 0 in fp32, where the
    paper counts none), and ``total``. ``optimizer + master`` is the paper's KΨ.
    """
    _check(stage, world_size, precision)
    width = BYTES_PER_ELEMENT[precision]
    n = world_size
    params, grads = width * psi, width * psi
    optimizer = 8 * psi
    master = 0 if precision == "fp32" else 4 * psi
    if stage >= 1:
        optimizer, master = optimizer / n, master / n
    if stage >= 2:
        grads = grads / n
    if stage >= 3:
        params = params / n
    states = {"params": params, "grads": grads, "optimizer": optimizer, "master": master}
    states["total"] = sum(states.values())
    return states


def paper_bytes_per_device(psi: float, stage: int, world_size: int, k: int = PAPER_K) -> float:
    """The paper's mixed-precision formula for one stage, in bytes (its Figure 1 and Table 1)."""
    _check(stage, world_size, "fp16")
    n = world_size
    return {
        0: (2 + 2 + k) * psi,
        1: 4 * psi + k * psi / n,
        2: 2 * psi + (2 + k) * psi / n,
        3: (2 + 2 + k) * psi / n,
    }[stage]


def paper_table(psi: float = 7.5e9, world_size: int = 64, k: int = PAPER_K) -> dict[int, float]:
    """Stage -> GB (1e9 bytes) per device; the defaults reproduce the paper's 120 / 31.4 / 16.6 / 1.9 GB."""
    return {stage: paper_bytes_per_device(psi, stage, world_size, k) / 1e9 for stage in STAGES}


def comm_elements_per_step(psi: int, stage: int) -> float:
    """The paper's communication volume per optimizer step and rank, in elements: 2Ψ, or 3Ψ at stage 3."""
    _check(stage, 1, "fp32")
    return (3 if stage == 3 else 2) * psi


def comm_bytes_per_step(psi: int, stage: int, precision: str = "fp32") -> float:
    """The paper's volume (2Ψ or 3Ψ elements) in bytes of the precision gradients travel in."""
    _check(stage, 1, precision)
    return comm_elements_per_step(psi, stage) * BYTES_PER_ELEMENT[precision]


def ring_factor(world_size: int) -> float:
    """(n-1)/n: the share of a message each rank sends in a ring reduce-scatter or all-gather.

    The paper's 2Ψ is the large-n limit of the ring all-reduce's exact 2Ψ(n-1)/n.
    """
    return (world_size - 1) / world_size


def wire_bytes(op: str, logged_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for one collective, by the ring algorithm (nccl-tests conventions).

    ``logged_bytes`` is the size DeepSpeed's comms logger records: the whole tensor for
    all_reduce and reduce_scatter, each rank's own shard for all_gather.
    """
    n = world_size
    if n == 1 or logged_bytes == 0:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n * logged_bytes
    if op.startswith("all_gather"):
        return (n - 1) * logged_bytes
    if op.startswith("reduce_scatter"):
        return (n - 1) / n * logged_bytes
    return float(logged_bytes)  # broadcast, send/recv, ...: the message once


def bus_bandwidth(op: str, message_bytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s (nccl-tests): algbw = S/t, scaled by 2(n-1)/n or (n-1)/n.

    ``message_bytes`` is the full size S (for all_gather, the gathered result).
    """
    algbw = message_bytes / seconds
    n = world_size
    if op.startswith("all_reduce"):
        return algbw * 2 * (n - 1) / n
    if op.startswith(("all_gather", "reduce_scatter")):
        return algbw * (n - 1) / n
    return algbw


def deepspeed_estimate_bytes(psi: int, stage: int, world_size: int, largest_layer_params: int = 0) -> float | None:
    """What DeepSpeed's own estimator says a GPU holds for stage 2 or 3 (no offload), else None.

    DeepSpeed counts 18 bytes a parameter (2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 Adam)
    plus 2 for the fp16 parameters, not the paper's K = 12, and adds buffers at stage 3.
    """
    from helpers.environment import quiet_deepspeed_import

    quiet_deepspeed_import()
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return float(estimate_zero2_model_states_mem_needs(psi, world_size, 1, cpu_offload=False)[1])
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return float(estimate_zero3_model_states_mem_needs(psi, largest_layer_params, world_size, 1,
                                                           cpu_offload=False, cpu_offload_params=False)[1])
    return None


# --- ZeRO++ (Wang et al., 2023, arXiv 2306.10209) ----------------------------------------------
#
# ZeRO-3 moves three model-sized messages per step and GPU (M = the model in 16-bit, 2Ψ bytes):
# parameters all-gathered for forward, all-gathered again for backward, gradients reduce-scattered:
# 3M. ZeRO++ shrinks what crosses the network between nodes:
#
# - qwZ (``zero_quantized_weights``): weights travel as int8 with per-block scales: each gather 0.5M.
# - hpZ (``zero_hpz_partition_size`` = GPUs per node): every node keeps a second, node-local partition
#   of the weights, so backward gathers inside the node: 0 across nodes.
# - qgZ (``zero_quantized_gradients``): gradients reduced by a two-hop all-to-all in int4: 0.25M
#   across nodes (the first hop, inside the node, moves 0.25M too).
#
# All three: 0.5M + 0 + 0.25M = 0.75M across nodes, 4x less than ZeRO-3's 3M (the paper's figure).
# On ONE node nothing crosses a network; what DeepSpeed 0.19.8 does there (read in its code):
# qwZ still quantizes every gather (the bytes halve); hpZ's secondary group is the node itself
# (no change); qgZ falls back to the plain reduce-scatter (``__avg_scatter_grads``: the quantized
# all-to-all only when world size / GPUs per node > 1).

ZEROPP_PHASES = ("forward all-gather", "backward all-gather", "gradient reduce-scatter")


def zeropp_volume(psi: float, qwz: bool = False, hpz: bool = False, qgz: bool = False,
                  nodes: int = 2) -> dict[str, dict[str, float]]:
    """Bytes per GPU and optimizer step (one micro-step) of each ZeRO-3 phase, split into what crosses
    nodes (``"inter"``) and what stays inside a node (``"intra"``), for a model of ``psi`` parameters in
    16-bit. The paper's accounting: each phase moves the whole model M = 2Ψ bytes per GPU (its ring
    factor (n-1)/n taken as 1). ``nodes=1``: everything is intra-node, and only qwZ changes anything.
    """
    if nodes < 1:
        raise ValueError(f"nodes={nodes}: at least one node")
    m = 2.0 * psi  # the model in 16-bit
    gather = 0.5 * m if qwz else m
    where = "inter" if nodes > 1 else "intra"
    volume = {phase: {"inter": 0.0, "intra": 0.0} for phase in ZEROPP_PHASES}
    volume["forward all-gather"][where] += gather
    # hpZ: backward gathers from the node-local secondary partition (quantized too when qwZ is on)
    volume["backward all-gather"]["intra" if hpz else where] += gather
    if qgz and nodes > 1:
        volume["gradient reduce-scatter"]["intra"] += 0.25 * m  # int4, first hop inside the node
        volume["gradient reduce-scatter"]["inter"] += 0.25 * m  # int4, second hop across nodes
    else:
        volume["gradient reduce-scatter"][where] += m  # DeepSpeed's fallback on one node: plain reduce-scatter
    return volume


def zeropp_cross_node_bytes(psi: float, qwz: bool = False, hpz: bool = False, qgz: bool = False) -> float:
    """Bytes per GPU and step that cross nodes (two or more nodes): 3M for ZeRO-3, 0.75M with all three."""
    return sum(v["inter"] for v in zeropp_volume(psi, qwz, hpz, qgz, nodes=2).values())


@dataclasses.dataclass(frozen=True)
class Link:
    """A latency-bandwidth model of one kind of connection: a collective moving ``b`` bytes per GPU takes
    ``latency + b / bandwidth`` seconds. ``bandwidth`` is bytes/s per GPU (bus bandwidth, nccl-tests)."""

    bandwidth: float
    latency: float

    def seconds(self, nbytes: float, calls: int = 1) -> float:
        return calls * self.latency + nbytes / self.bandwidth


#: The model's assumptions, stated as parameters, not measurements. The bandwidth chapter's measured
#: figures (helpers/bandwidth.py) plug in here: pass a Link built from them instead of these defaults.
#: Inside a node: NVLink-class, 300 GB/s bus bandwidth for large messages, 10 µs a call. Across nodes:
#: one 100 Gb/s NIC per GPU (12.5 GB/s), 20 µs a call: a commodity cluster, where ZeRO++ is meant to help.
DEFAULT_INTRA_NODE = Link(bandwidth=300e9, latency=10e-6)
DEFAULT_INTER_NODE = Link(bandwidth=12.5e9, latency=20e-6)


def zeropp_comm_seconds(psi: float, layers: int, nodes: int, qwz: bool = False, hpz: bool = False,
                        qgz: bool = False, intra: Link = DEFAULT_INTRA_NODE,
                        inter: Link = DEFAULT_INTER_NODE) -> float:
    """Predicted communication seconds per GPU and micro-step of ZeRO-3 (with the ZeRO++ parts chosen) for
    ``psi`` 16-bit parameters in ``layers`` gathered units, on ``nodes`` nodes: bytes from
    :func:`zeropp_volume` at each link's bandwidth, plus one latency per collective call and link
    (3 phases x ``layers`` calls; qgZ's two hops). Assumes no overlap with compute (an upper bound)."""
    total = 0.0
    for phase, v in zeropp_volume(psi, qwz, hpz, qgz, nodes).items():
        for link, nbytes in ((intra, v["intra"]), (inter, v["inter"])):
            if nbytes:
                total += link.seconds(nbytes, calls=layers)
    return total


def zeropp_step_prediction(psi: float, layers: int, tokens_per_gpu: int, nodes: int, flops_per_s: float,
                           intra: Link = DEFAULT_INTRA_NODE, inter: Link = DEFAULT_INTER_NODE) -> dict[str, float]:
    """Predicted seconds per micro-step of plain ZeRO-3 and full ZeRO++ (qwZ + hpZ + qgZ): compute
    (6Ψ FLOPs a token at ``flops_per_s`` achieved per GPU) plus communication (:func:`zeropp_comm_seconds`),
    without overlap; and the speed-up. Quantization kernels' own time is left out (small on GPUs)."""
    compute = 6 * psi * tokens_per_gpu / flops_per_s
    zero3 = compute + zeropp_comm_seconds(psi, layers, nodes, intra=intra, inter=inter)
    zeropp = compute + zeropp_comm_seconds(psi, layers, nodes, True, True, True, intra=intra, inter=inter)
    return {"compute_s": compute, "zero3_s": zero3, "zeropp_s": zeropp, "speedup": zero3 / zeropp}
