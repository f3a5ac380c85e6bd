"""How fast a run trains: model FLOPs, tokens per second, MFU, and the share of a step spent communicating.

The formulas the capstone (notebook 16) and its probes (``throughput``, ``comm_share`` in
:mod:`helpers.core.probes`) use, kept here so a learner finds each in one place:

- **Model FLOPs per token** (PaLM, Chowdhery et al. 2022, appendix B): ``6 N`` for the matrix products of
  forward and backward over ``N`` parameters, plus ``12 L d T`` for attention's score and value products
  (``L`` layers, hidden size ``d``, sequence length ``T``; the causal mask is not subtracted, as PaLM
  does not). An input embedding that is not tied to the output layer is a table lookup, not a matrix
  product, so its ``E = V d`` parameters are left out of ``N``: ``6 (N - E)`` (PaLM ties the two, so its
  ``N`` needs no such step; torchtitan counts untied LLaMA models this way). Recomputed activations (checkpointing) are not counted: this is *model* FLOPs, not
  hardware FLOPs, so checkpointing lowers MFU by the work it repeats.
- **MFU**: model FLOP/s per GPU divided by the GPU's dense bf16 peak from its datasheet
  (:data:`PEAK_BF16_DENSE_TFLOPS`, looked up by the device name torch reports).
- **Communication share**: from a profiler trace of one step, the time during which a communication
  kernel (NCCL) runs while no computation kernel does (``exposed``), over the step's wall time. On CPU
  ranks communication blocks the training thread, so all of it counts as exposed.
"""

from __future__ import annotations

import re
import statistics
from typing import Iterable, Sequence

#: Dense (no sparsity) bf16 tensor-core peak per GPU, by device name, with where the figure comes from.
#: First match wins, so the more specific names come first. NVIDIA's datasheets print the figure
#: "with sparsity"; dense is half of it.
PEAK_BF16_DENSE_TFLOPS: list[tuple[str, float, str]] = [
    (r"H100.*PCIe", 756.0, "NVIDIA H100 datasheet, H100 PCIe: bf16 1,513 TFLOPS with sparsity, half dense"),
    (r"H100.*NVL", 835.5, "NVIDIA H100 datasheet, H100 NVL: bf16 1,671 TFLOPS with sparsity, half dense"),
    (r"H100", 989.5, "NVIDIA H100 datasheet, H100 SXM: bf16 1,979 TFLOPS with sparsity, half dense"),
    (r"H200.*NVL", 835.5, "NVIDIA H200 datasheet, H200 NVL: bf16 1,671 TFLOPS with sparsity, half dense"),
    (r"H200|GH200", 989.5, "NVIDIA H200 datasheet, H200 SXM: bf16 1,979 TFLOPS with sparsity, half dense"),
    (r"A100", 312.0, "NVIDIA A100 datasheet: bf16 312 TFLOPS dense (624 with sparsity)"),
]

#: GPU kernels that are communication (NCCL's), and GPU activity that is neither (copies, memsets).
COMM_KERNEL = re.compile(r"nccl", re.IGNORECASE)
NOT_COMPUTE = re.compile(r"^(Memcpy|Memset)", re.IGNORECASE)
#: CPU profiler events that are collectives: gloo, c10d and DeepSpeed's shared-memory ones.
COMM_OP = re.compile(r"nccl|gloo|c10d::|record_param_comms|all_reduce|allreduce|all_gather|allgather|"
                     r"reduce_scatter|broadcast", re.IGNORECASE)


def peak_tflops(device_name: str) -> tuple[float | None, str]:
    """(dense bf16 TFLOP/s peak, its source) for a device name such as "NVIDIA H100 80GB HBM3";
    (None, why) for a device with no entry (any CPU)."""
    for pattern, tflops, source in PEAK_BF16_DENSE_TFLOPS:
        if re.search(pattern, device_name):
            return tflops, source
    return None, (f"no dense bf16 peak known for {device_name!r}: add it to "
                  "helpers.core.performance.PEAK_BF16_DENSE_TFLOPS to get an MFU")


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int, lookup_params: int = 0) -> dict[str, float]:
    """Model FLOPs of training on one token (forward and backward): ``6 (N - E)`` + ``12 L d T`` (PaLM),
    where ``E`` = ``lookup_params``, the parameters of an untied input embedding (a lookup, no FLOPs)."""
    if not 0 <= lookup_params <= params:
        raise ValueError(f"lookup_params={lookup_params:,}: between 0 and the model's {params:,} parameters")
    matmul = 6.0 * (params - lookup_params)
    attention = 12.0 * layers * hidden * seq_len
    return {"matmul_6N": matmul, "attention_12LdT": attention, "total": matmul + attention,
            "lookup_params": lookup_params}


def model_shape(module) -> dict[str, int] | None:
    """:func:`config_shape` of a ``transformers`` model's config; None for other models. Read from the
    config, not the weights, which ZeRO-3 has partitioned."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return None
    return config_shape(config)


def config_shape(config) -> dict[str, int]:
    """Layers, hidden size, sequence length and untied input-embedding parameters (``lookup_params``,
    0 when tied) of a ``transformers`` config (the course's language models set
    ``max_position_embeddings`` to the sequence length they train on)."""
    tied = getattr(config, "tie_word_embeddings", False)
    return {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "seq_len": config.max_position_embeddings,
            "lookup_params": 0 if tied else config.vocab_size * config.hidden_size}


def throughput(step_times: Sequence[float], tokens_per_step: int, flops_token: float | None, world_size: int,
               device_name: str) -> dict:
    """Tokens/s, TFLOP/s per GPU and MFU from the median of ``step_times`` (seconds per optimizer step)."""

    median = statistics.median(step_times)
    tokens_per_s = tokens_per_step / median
    result = {"step_time_s": median, "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_s,
              "tokens_per_s_per_rank": tokens_per_s / world_size, "tflops_per_gpu": None, "mfu": None}
    peak, source = peak_tflops(device_name)
    result.update({"peak_tflops": peak, "peak_source": source})
    if flops_token is not None:
        result["tflops_per_gpu"] = flops_token * tokens_per_s / world_size / 1e12
        if peak:
            result["mfu"] = result["tflops_per_gpu"] / peak
            if result["mfu"] > 1:  # faster than the chip can go: the token or FLOP count is wrong, not the GPU
                raise ValueError(f"MFU {result['mfu']:.0%} is above 100% of {device_name}'s peak: the tokens per step "
                                 f"({tokens_per_step:,}) or FLOPs per token counted do not match what was trained")
    return result


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping ``(start, end)`` intervals into disjoint ones, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total time covered by ``intervals`` (overlaps counted once)."""
    return sum(b - a for a, b in union(intervals))


def overlap(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Time covered by both ``a`` and ``b``."""
    ua, ub = union(a), union(b)
    total, j = 0.0, 0
    for start, end in ua:
        while j < len(ub) and ub[j][1] <= start:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < end:
            total += max(0.0, min(end, ub[k][1]) - max(start, ub[k][0]))
            k += 1
    return total


def comm_share(events: Sequence[tuple[str, float, float, bool]], step_s: float) -> dict:
    """Communication time of one profiled step from its events ``(name, start_us, end_us, on_device)``.

    On a GPU (device events present): ``busy`` is the time some NCCL kernel ran, ``exposed`` the part
    of it when no other kernel ran. On a CPU: communication blocks the rank, so ``exposed`` = ``busy``.
    Shares are over the step's wall time ``step_s``.
    """
    device = [e for e in events if e[3]]
    if device:
        comm = [(s, t) for name, s, t, _ in device if COMM_KERNEL.search(name)]
        compute = [(s, t) for name, s, t, _ in device if not COMM_KERNEL.search(name) and not NOT_COMPUTE.match(name)]
        busy = length(comm)
        exposed = busy - overlap(comm, compute)
        where = "GPU kernels: NCCL kernel time not overlapped by any other kernel"
    else:
        comm = [(s, t) for name, s, t, _ in events if COMM_OP.search(name)]
        busy = exposed = length(comm)
        where = "CPU: time inside collectives (they block the rank)"
    step_us = step_s * 1e6
    return {"step_s": step_s, "comm_busy_s": busy / 1e6, "comm_exposed_s": exposed / 1e6,
            "busy_share": busy / step_us if step_us else None, "exposed_share": exposed / step_us if step_us else None,
            "measured": where}
