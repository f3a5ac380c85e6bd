"""Measure the model states a DeepSpeed engine really holds on one rank.

Runs inside each rank (called by ``helpers.train``). Nothing here uses a formula: each figure is
the sum of the bytes of the tensors the engine holds at the moment of the call, found where
DeepSpeed keeps them for each stage, each tensor counted once.

Keys of the result:

- ``params``: the model's parameters as this rank holds them (at stage 3, its ``ds_tensor`` shard,
  plus any parameter held whole: gathered, or persistent because it is small).
- ``grads``: gradients held for the optimizer (full ``.grad`` at stages 0-1, this rank's
  partition at stages 2-3).
- ``optimizer``: the inner optimizer's state (Adam's ``exp_avg`` and ``exp_avg_sq``, ``step``).
- ``master``: the fp32 copy of this rank's weight partition that ZeRO (and DeepSpeed's bf16
  optimizer) keeps beside the parameters, even when training in fp32.
- ``buffers``: gradient buckets DeepSpeed allocates for communication (``reduce_bucket_size``), or
  PyTorch DDP's buckets for a PyTorch run.

PyTorch FSDP2's sharded tensors (DTensors) count with their local shard.
"""

from __future__ import annotations

from typing import Iterable

import torch

KEYS = ("params", "grads", "optimizer", "master", "buffers")


def _local(t):
    """This rank's part of a tensor: a DTensor (PyTorch FSDP2's sharded parameters, gradients and Adam
    states) -> its local shard; any other tensor as it is."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes covered by ``tensors``, each byte of memory counted once (views may overlap)."""
    tensors = [_local(t) for t in tensors if isinstance(t, torch.Tensor)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in tensors if t.numel() > 0)
    total, reach = 0, -1
    for begin, end in spans:
        if end <= reach:
            continue
        total += end - max(begin, reach)
        reach = end
    return total


def _flatten(container) -> list:
    """Tensors in a dict or list of tensors / lists of tensors (DeepSpeed's per-group holders)."""
    if container is None:
        return []
    if isinstance(container, torch.Tensor):
        return [container]
    values = container.values() if isinstance(container, dict) else container
    found = []
    for value in values:
        found.extend(_flatten(value) if isinstance(value, (list, tuple, dict)) else [value])
    return [t for t in found if isinstance(t, torch.Tensor)]


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def describe_optimizer(engine) -> str:
    """Which DeepSpeed optimizer class holds the states (names the code path measured)."""
    return type(engine.optimizer).__name__


def model_states(engine) -> dict[str, int]:
    """Bytes of each kind of model state this rank's engine holds right now (see module docstring).

    Call it after ``engine.backward`` and before ``engine.step`` on an accumulation boundary, once
    the optimizer has stepped at least once: that is when parameters, gradients and optimizer
    states all exist.
    """
    opt = engine.optimizer
    params = list(engine.module.parameters())
    found: dict[str, list[torch.Tensor | None]] = {key: [] for key in KEYS}

    # At stage 3 each parameter owns a shard (ds_tensor); its .data is the whole tensor only while
    # gathered, or always for "persistent" small parameters (stage3_param_persistence_threshold).
    found["params"] = [p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params]

    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3 (DeepSpeedZeroOptimizer_Stage3)
        found["master"] = list(opt.fp32_partitioned_groups_flat)
        found["optimizer"] = _state_tensors(opt.optimizer)
        grad_buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        if grad_buffer is not None:
            found["grads"] = [grad_buffer]
        else:
            found["grads"] = [g for group in opt.averaged_gradients.values() for g in group]
        found["buffers"] = [getattr(bucket, "buffer", None) for bucket in getattr(opt, "ipg_buckets", {}).values()]
    elif hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1 and ZeRO-2 (DeepSpeedZeroOptimizer)
        found["master"] = list(opt.single_partition_of_fp32_groups)
        found["optimizer"] = _state_tensors(opt.optimizer)
        # Wherever this version keeps gradients between backward and step: the full .grad while
        # ZeRO-1 accumulates, the accumulators of this rank's partition (all_grad_tensors), the
        # reduced partition (averaged_gradients), the contiguous partition buffer.
        found["grads"] = ([p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
                          + _flatten(getattr(opt, "all_grad_tensors", None))
                          + _flatten(getattr(opt, "averaged_gradients", None))
                          + _flatten(getattr(opt, "grads_in_partition", None)))
        found["buffers"] = [b for bucket in getattr(opt, "ipg_buckets", {}).values() for b in bucket.buffer]
    elif hasattr(opt, "fp32_groups_flat_partition"):  # stage 0 in bf16 (BF16_Optimizer)
        found["master"] = list(opt.fp32_groups_flat_partition)
        found["optimizer"] = _state_tensors(opt.optimizer)
        found["grads"] = [p.grad for p in params] + list(opt.fp32_groups_gradients_flat)
    elif hasattr(opt, "fp32_groups_flat") or hasattr(opt, "fp32_groups"):  # stage 0, fp16/bf16 (FP16_*Optimizer)
        found["master"] = _flatten(getattr(opt, "fp32_groups_flat", None)) or _flatten(opt.fp32_groups)
        found["optimizer"] = _state_tensors(opt.optimizer)
        found["grads"] = [p.grad for p in params] + [t.grad for t in found["master"]]
    else:  # stage 0 in fp32: the client or config optimizer itself
        inner = getattr(opt, "optimizer", opt)
        found["optimizer"] = _state_tensors(inner)
        found["grads"] = [p.grad for p in params]

    result = {key: _unique_bytes(found[key]) for key in KEYS}
    # Engines that are not DeepSpeed's (helpers.pytorch_train.TorchEngine) report buckets no Python
    # tensor shows (DDP keeps them in C++).
    buffer_bytes = getattr(engine, "buffer_bytes", None)
    if callable(buffer_bytes):
        result["buffers"] += buffer_bytes()
    return result


def peak_bytes(device: str) -> tuple[int, str]:
    """Peak memory of this rank and where the figure comes from.

    On a GPU: ``torch.cuda.max_memory_allocated`` (tensors only). On CPU: the process's peak
    resident set (``ru_maxrss``), which also counts Python, torch and DeepSpeed themselves.
    """
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS (ru_maxrss)"
