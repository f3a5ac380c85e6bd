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

For the calculator (:mod:`helpers.topics.widgets`), the end of this module adds where offload puts each
state (:func:`placement`), the collectives of one step (:func:`step_collectives`) and their predicted
time on a :class:`Cluster` (:func:`collective_seconds`); :class:`AlphaBeta` is the one place bytes become seconds.
"""

from __future__ import annotations

import dataclasses
import math

from helpers.core import ds

PAPER_K = 12  # bytes of optimizer state per parameter for mixed-precision Adam
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
STAGES = (0, 1, 2, 3)


def bytes_per_element(precision: str) -> int:
    """Bytes of one element in ``precision`` ("fp32", "bf16" or "fp16"); a ValueError naming the choices otherwise."""
    if precision not in BYTES_PER_ELEMENT:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(BYTES_PER_ELEMENT)}")
    return BYTES_PER_ELEMENT[precision]


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


#: The ZeRO paper's own printed figures for its example (7.5B parameters, 64 GPUs, K = 12): GB of model
#: states per device by stage, as figure 1 of arXiv 1910.02054 prints them (copied, not computed: what the
#: formulas here are checked against).
PAPER_FIGURE_1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


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
    if op.startswith(("reduce_scatter", "all_to_all")):  # all_to_all: each rank keeps 1/n of its own tensor
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


def deepspeed_estimate_bytes(psi: int, stage: int, world_size: int, largest_layer_params: int = 0,
                             offload_optimizer: bool = False, offload_param: bool = False) -> float | None:
    """What DeepSpeed's own estimator says a GPU holds for stage 2 or 3, else None.

    DeepSpeed counts 18 bytes a parameter (2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 Adam)
    plus 2 for the fp16 parameters, not the paper's K = 12, and adds buffers at stage 3. With
    ``offload_optimizer`` its stage-2 GPU keeps only the 2-byte parameters, its stage-3 GPU the
    parameter shards (none with ``offload_param`` too) plus the largest layer. Its estimator has no case
    for parameter offload without optimizer offload: None then.
    """
    if stage == 2:
        zero2 = ds.load("deepspeed.runtime.zero.stage_1_and_2")
        return float(zero2.estimate_zero2_model_states_mem_needs(psi, world_size, 1, cpu_offload=offload_optimizer)[1])
    if stage == 3:
        if offload_param and not offload_optimizer:
            return None
        zero3 = ds.load("deepspeed.runtime.zero.stage3")
        return float(zero3.estimate_zero3_model_states_mem_needs(psi, largest_layer_params, world_size, 1,
                                                                 cpu_offload=offload_optimizer,
                                                                 cpu_offload_params=offload_param)[1])
    return None


# --- offload, clusters and predicted communication time (the calculator; helpers.topics.widgets) -----
#
@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """The course's one latency-bandwidth model of communication: a call (or ``calls`` calls) that makes
    each rank send ``wire_bytes`` bytes takes ``calls * alpha + beta * wire_bytes`` seconds. ``alpha`` is
    seconds per call, ``1 / beta`` the bus bandwidth in bytes/s (nccl-tests' convention). The calculator's
    bandwidth-only :class:`Cluster`, ZeRO++'s two-link model and the fits of measured collectives
    (:func:`helpers.topics.bandwidth.fit`) are all this class."""

    alpha: float  # seconds per call
    beta: float  # seconds per byte sent by a rank

    @classmethod
    def link(cls, bandwidth: float, latency: float = 0.0) -> "AlphaBeta":
        """A link of ``bandwidth`` bytes/s per GPU and ``latency`` seconds per call."""
        if not bandwidth > 0 or latency < 0:
            raise ValueError(f"bandwidth={bandwidth!r}, latency={latency!r}: needs a positive bandwidth and a "
                             "latency of 0 or more")
        return cls(latency, 1.0 / bandwidth)

    def seconds(self, wire_bytes: float, calls: float = 1.0) -> float:
        """Time of ``calls`` calls that send ``wire_bytes`` bytes in all."""
        return calls * self.alpha + self.beta * wire_bytes

    @property
    def bandwidth(self) -> float:
        """1 / beta in bytes/s (infinite when there is no bandwidth term)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    @property
    def half_bandwidth_bytes(self) -> float:
        """The message (wire bytes) at which alpha and the bytes cost the same: below it latency rules."""
        return math.inf if self.beta == 0 else self.alpha / self.beta

    def describe(self) -> str:
        return f"alpha {self.alpha * 1e6:,.1f} us, 1/beta {self.bandwidth / 1e9:.3g} GB/s"


# Everything the calculator shows is computed here, from the formulas above, so a chapter and the
# calculator can never disagree.

#: Link bandwidth the calculator assumes when the learner gives none: bytes per second each GPU
#: sends on a ring (nccl-tests' "bus bandwidth"). A stated round number, NOT a measurement: enter
#: your cluster's figure. A measured, fitted model replaces it through :func:`collective_seconds`.
DEFAULT_LINK_BYTES_PER_S = 100e9


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPUs the calculator plans for: ``nodes`` machines of ``gpus_per_node`` GPUs with
    ``gpu_memory_bytes`` each, one data-parallel rank per GPU, joined at ``link_bytes_per_s`` (bus
    bandwidth per GPU: for several nodes, the slowest link a ring crosses, usually the network)."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory_bytes: float = 80 * 2**30
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}={value!r}: needs a whole number of at least 1")
        for key in ("gpu_memory_bytes", "link_bytes_per_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r}: needs a positive number")

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: one per GPU."""
        return self.gpus_per_node * self.nodes

    @property
    def link(self) -> AlphaBeta:
        """The cluster's link as the course's latency-bandwidth model (bandwidth only: no latency term)."""
        return AlphaBeta.link(self.link_bytes_per_s)


def placement(psi: float, stage: int, world_size: int, precision: str = "bf16", offload_optimizer: bool = False,
              offload_param: bool = False) -> dict[str, dict[str, float]]:
    """The calculator's view of :func:`offload_bytes_per_device`: model-state bytes per rank split by where
    they live, ``{"gpu": {...}, "offloaded": {...}}`` (``offloaded`` is CPU memory, or the NVMe drive),
    taking DeepSpeed's switches as they are: ``offload_optimizer`` does nothing at stage 0 and
    ``offload_param`` nothing below stage 3 (DeepSpeed ignores them there; the checker warns).
    Gathered layers still pass through the GPU while they compute: working memory, not a model state,
    like activations and communication buffers, which no figure here counts."""
    mode = "optimizer" if offload_optimizer and stage >= 1 else "none"
    if mode == "optimizer" and offload_param and stage == 3:
        mode = "optimizer+params"
    found = offload_bytes_per_device(psi, stage, world_size, mode, precision)
    gpu, offloaded = dict(found["accelerator"]), dict(found["host"])
    if offload_param and stage == 3 and mode == "none":  # parameter shards alone
        offloaded["params"], gpu["params"] = gpu["params"], 0.0
        for side in (gpu, offloaded):
            side["total"] = sum(v for k, v in side.items() if k != "total")
    return {"gpu": gpu, "offloaded": offloaded}


def largest_model_that_fits(memory_bytes: float, stage: int, world_size: int, precision: str = "bf16",
                            offload_optimizer: bool = False, offload_param: bool = False) -> float | None:
    """The most parameters whose model states fit ``memory_bytes`` of one GPU (states grow linearly
    with Ψ, so this is the memory over the GPU bytes per parameter); None when nothing stays on the GPU."""
    per_parameter = placement(1, stage, world_size, precision, offload_optimizer, offload_param)["gpu"]["total"]
    return memory_bytes / per_parameter if per_parameter else None


def step_collectives(psi: float, stage: int, precision: str = "fp32") -> list[tuple[str, float]]:
    """The paper's collectives of one optimizer step, as ``(op, message bytes)`` with the whole message
    (for all_gather, the gathered result): stage 0 all-reduces the gradients; stages 1-2 reduce-scatter
    them and all-gather the updated parameters; stage 3 all-gathers the parameters in forward and again
    in backward, and reduce-scatters the gradients. Their ring bytes add up to
    :func:`comm_bytes_per_step` x :func:`ring_factor`."""
    size = psi * BYTES_PER_ELEMENT[precision]
    _check(stage, 1, precision)
    if stage == 0:
        return [("all_reduce", size)]
    if stage < 3:
        return [("reduce_scatter", size), ("all_gather", size)]
    return [("all_gather", size), ("all_gather", size), ("reduce_scatter", size)]


def ring_bytes(op: str, message_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for one ring collective on a message of ``message_bytes`` (the whole tensor;
    for all_gather the gathered result): 2(n-1)/n of it for all_reduce, (n-1)/n for all_gather and
    reduce_scatter (:func:`wire_bytes` takes the comms logger's sizes instead)."""
    n = world_size
    factor = 2 * (n - 1) / n if op.startswith("all_reduce") else (n - 1) / n
    return factor * message_bytes


def collective_seconds(op: str, message_bytes: float, cluster: Cluster) -> float:
    """Predicted seconds of one collective on ``cluster``: the bytes each GPU sends on a ring through
    :meth:`AlphaBeta.seconds` of the cluster's link (bandwidth only: no per-message latency).

    Bytes become seconds only through :class:`AlphaBeta`: here, in ZeRO++'s model below and in the
    fitted models of :mod:`helpers.topics.bandwidth`.
    """
    return cluster.link.seconds(ring_bytes(op, message_bytes, cluster.world_size))


def comm_seconds_per_step(psi: float, stage: int, cluster: Cluster, precision: str = "fp32") -> float:
    """Predicted communication seconds of one optimizer step: :func:`collective_seconds` summed over
    :func:`step_collectives` (no overlap with computation assumed)."""
    return sum(collective_seconds(op, size, cluster) for op, size in step_collectives(psi, stage, precision))


# --- offload (ZeRO-Offload, Ren et al., USENIX ATC 2021, arXiv 2101.06840; ZeRO-Infinity, SC21, 2104.07857) ---

#: What a run offloads: nothing, the optimizer (states, fp32 master, gradients), or the parameters as well.
OFFLOAD_MODES = ("none", "optimizer", "optimizer+params")


def offload_bytes_per_device(psi: float, stage: int, world_size: int, offload: str = "none",
                             precision: str = "fp16", k: int = PAPER_K) -> dict[str, dict[str, float]]:
    """Model-state bytes per rank on the accelerator and on the host, split like :func:`model_state_bytes`.

    The ZeRO-Offload paper's placement: the optimizer step (its K bytes a parameter: fp32 master,
    momentum, variance) and the gradients it reads go to the host, each rank's partition of them; the
    working-precision parameters stay on the accelerator. Offloading the parameters too (ZeRO-Infinity,
    stage 3 only) moves each rank's parameter shard to the host as well. ``offload`` is one of
    :data:`OFFLOAD_MODES`; optimizer offload needs stage 1-3, parameter offload stage 3. Returns
    ``{"accelerator": {params, grads, optimizer, master, total}, "host": {...}}``; with ``"none"`` the
    host holds nothing and the accelerator the stage's :func:`model_state_bytes`.
    """
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload {offload!r}: choose one of {', '.join(OFFLOAD_MODES)}")
    if offload != "none" and stage == 0:
        raise ValueError("offload needs ZeRO stage 1, 2 or 3: at stage 0 DeepSpeed partitions and offloads nothing")
    if offload == "optimizer+params" and stage != 3:
        raise ValueError(f"parameter offload needs ZeRO stage 3 (stage {stage} keeps every parameter on the device)")
    states = model_state_bytes(psi, stage, world_size, precision)
    if k != PAPER_K:  # the optimizer's share besides the master copy
        states["optimizer"] = states["optimizer"] * (k - 4) / (PAPER_K - 4)
    zero = {key: 0.0 for key in ("params", "grads", "optimizer", "master")}
    accelerator, host = dict(states), dict(zero)
    accelerator.pop("total")
    if offload != "none":
        n = world_size
        width = BYTES_PER_ELEMENT[precision]
        host.update(optimizer=accelerator["optimizer"], master=accelerator["master"], grads=width * psi / n)
        accelerator.update(optimizer=0.0, master=0.0)
        if stage >= 2:  # stage 1 still holds its whole gradient on the device while it accumulates
            accelerator["grads"] = 0.0
    if offload == "optimizer+params":
        host["params"], accelerator["params"] = accelerator["params"], 0.0
    accelerator["total"], host["total"] = sum(accelerator.values()), sum(host.values())
    return {"accelerator": accelerator, "host": host}


def bytes_per_parameter(stage: int, world_size: int, offload: str = "none", precision: str = "fp16",
                        k: int = PAPER_K) -> dict[str, float]:
    """Accelerator and host model-state bytes per rank for each parameter of the model: the slopes
    :func:`largest_model` divides by."""
    found = offload_bytes_per_device(1.0, stage, world_size, offload, precision, k)
    return {side: found[side]["total"] for side in ("accelerator", "host")}


def largest_model(accelerator_bytes: float, stage: int, world_size: int, offload: str = "none",
                  host_bytes: float | None = None, reserve_bytes: float = 0.0, precision: str = "fp16",
                  k: int = PAPER_K) -> dict[str, float]:
    """The most parameters whose model states fit, per the formulas, on ``world_size`` devices of
    ``accelerator_bytes`` each, keeping ``reserve_bytes`` per device for everything else (activations,
    buffers, the framework), with ``host_bytes`` of host memory for all ranks together (None: unlimited).

    Returns ``{"accelerator_limit", "host_limit", "params"}`` (parameter counts; ``inf`` where that side
    holds nothing per parameter). Model states only: activations and the working set of gathered layers
    are what ``reserve_bytes`` is for.
    """
    if reserve_bytes >= accelerator_bytes:
        raise ValueError(f"reserve_bytes {reserve_bytes:.3g} leaves nothing of accelerator_bytes {accelerator_bytes:.3g}")
    slopes = bytes_per_parameter(stage, world_size, offload, precision, k)
    device_limit = (accelerator_bytes - reserve_bytes) / slopes["accelerator"] if slopes["accelerator"] else float("inf")
    host_slope = slopes["host"] * world_size  # every rank's host share
    host_limit = host_bytes / host_slope if host_bytes is not None and host_slope else float("inf")
    return {"accelerator_limit": device_limit, "host_limit": host_limit, "params": min(device_limit, host_limit)}


# --- beyond ZeRO (chapters 10-12): activations, pipeline bubbles, tensor-parallel collectives -----------
#
# Notation: b micro-batch, s sequence length, h hidden size, a attention heads, i MLP width, V vocabulary,
# L decoder layers, S pipeline stages, M micro-batches per optimizer step, t tensor-parallel ranks.


def zero3_wire_bytes(psi: int, world_size: int, precision: str = "fp32") -> float:
    """Bytes one rank sends per micro-step at ZeRO-3 as DeepSpeed runs a model that fits its live-parameter
    budget (chapter 05): one all-gather of the parameters and one reduce-scatter of the gradients,
    2Ψ(n-1)/n elements: they grow with the parameters, whatever the number of tokens."""
    _check(3, world_size, precision)
    return 2 * psi * BYTES_PER_ELEMENT[precision] * ring_factor(world_size)


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


