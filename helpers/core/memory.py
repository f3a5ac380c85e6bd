"""Measure the model states a DeepSpeed engine really holds on one rank.

Runs inside each rank (called by ``helpers.core.train``). Nothing here uses a formula: each figure is
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
- ``buffers``: gradient buckets DeepSpeed allocates for communication (``reduce_bucket_size``), and
  with ZeRO-Offload the staging buffers between host and accelerator, or PyTorch DDP's buckets for a
  PyTorch run.

PyTorch FSDP2's sharded tensors (DTensors) count with their local shard. :func:`placement` splits the
same tensors into accelerator side and host side (offload).
"""

from __future__ import annotations

import resource
from typing import Iterable

import torch

from helpers.core import ds

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


def _holders(engine) -> dict[str, list[tuple[torch.Tensor | None, bool]]]:
    """Every tensor of the model states this rank's engine holds, by kind, each with whether DeepSpeed
    keeps that holder on the host by design (its offload partitions): ``{kind: [(tensor, offloaded)]}``.

    "Offloaded" comes from DeepSpeed's own switches (``cpu_offload`` at stages 1-2,
    ``offload_optimizer`` / ``offload_param`` at stage 3), so it is known even where the host and the
    accelerator are the same memory (CPU ranks); :func:`placement` checks it against the tensors' devices.
    """
    opt = engine.optimizer
    params = list(engine.module.parameters())
    found: dict[str, list[tuple[torch.Tensor | None, bool]]] = {key: [] for key in KEYS}

    def add(key: str, tensors, offloaded: bool = False) -> None:
        found[key].extend((t, offloaded) for t in tensors)

    # At stage 3 each parameter owns a shard (ds_tensor); its .data is the whole tensor only while
    # gathered, or always for "persistent" small parameters (stage3_param_persistence_threshold).
    add("params", [p.data for p in params])
    param_offload = bool(getattr(opt, "offload_param", False))
    add("params", [getattr(p, "ds_tensor", None) for p in params], param_offload)

    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3 (DeepSpeedZeroOptimizer_Stage3)
        off = bool(getattr(opt, "offload_optimizer", False))
        add("master", opt.fp32_partitioned_groups_flat, off)
        add("optimizer", _state_tensors(opt.optimizer), off)
        grad_buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        if grad_buffer is not None:
            add("grads", [grad_buffer], off)
        else:
            add("grads", [g for group in opt.averaged_gradients.values() for g in group])
        if off:  # the optimizer's own fp32 gradient partition, beside the flat buffer
            add("grads", [t.grad for t in opt.fp32_partitioned_groups_flat], True)
        if param_offload:  # the host home of the parameter shards (ds_tensor points into it)
            add("params", getattr(opt, "param_groups_fp16_flat_cpu_memory", []), True)
        add("buffers", [getattr(bucket, "buffer", None) for bucket in getattr(opt, "ipg_buckets", {}).values()])
    elif hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1 and ZeRO-2 (DeepSpeedZeroOptimizer)
        off = bool(getattr(opt, "cpu_offload", False))
        add("master", opt.single_partition_of_fp32_groups, off)
        add("optimizer", _state_tensors(opt.optimizer), off)
        # Wherever this version keeps gradients between backward and step: the full .grad while
        # ZeRO-1 accumulates, the accumulators of this rank's partition (all_grad_tensors), the
        # reduced partition (averaged_gradients), the contiguous partition buffer.
        add("grads", [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
            + _flatten(getattr(opt, "all_grad_tensors", None))
            + _flatten(getattr(opt, "averaged_gradients", None))
            + _flatten(getattr(opt, "grads_in_partition", None)))
        add("buffers", [b for bucket in getattr(opt, "ipg_buckets", {}).values() for b in bucket.buffer])
        if off:  # ZeRO-Offload: the fp32 gradient partition and its accumulators live with the master copy
            add("grads", [t.grad for t in opt.single_partition_of_fp32_groups]
                + _flatten(getattr(opt, "accumulated_grads_in_cpu", None)), True)
            add("buffers", _flatten(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None))
                + [getattr(opt, "temp_grad_buffer_for_cpu_offload", None)], True)
            add("buffers", [getattr(opt, "temp_grad_buffer_for_gpu_offload", None)])
    elif hasattr(opt, "fp32_groups_flat_partition"):  # stage 0 in bf16 (BF16_Optimizer)
        add("master", opt.fp32_groups_flat_partition)
        add("optimizer", _state_tensors(opt.optimizer))
        add("grads", [p.grad for p in params] + list(opt.fp32_groups_gradients_flat))
    elif hasattr(opt, "fp32_groups_flat") or hasattr(opt, "fp32_groups"):  # stage 0, fp16/bf16 (FP16_*Optimizer)
        master = _flatten(getattr(opt, "fp32_groups_flat", None)) or _flatten(opt.fp32_groups)
        add("master", master)
        add("optimizer", _state_tensors(opt.optimizer))
        add("grads", [p.grad for p in params] + [t.grad for t in master])
    else:  # stage 0 in fp32: the client or config optimizer itself
        inner = getattr(opt, "optimizer", opt)
        add("optimizer", _state_tensors(inner))
        add("grads", [p.grad for p in params])
    return found


def model_states(engine) -> dict[str, int]:
    """Bytes of each kind of model state this rank's engine holds right now (see module docstring),
    wherever it lives (accelerator or host: :func:`placement` splits them).

    Call it after ``engine.backward`` and before ``engine.step`` on an accumulation boundary, once
    the optimizer has stepped at least once: that is when parameters, gradients and optimizer
    states all exist.
    """
    result = {key: _unique_bytes(t for t, _ in tensors) for key, tensors in _holders(engine).items()}
    # Engines that are not DeepSpeed's (helpers.topics.frameworks.TorchEngine) report what the tensors read
    # above do not show: DDP's buckets (kept in C++), FSDP2's whole gradients held between micro-steps.
    for key, hook in (("buffers", "buffer_bytes"), ("grads", "unsharded_grad_bytes")):
        extra = getattr(engine, hook, None)
        if callable(extra):
            result[key] += extra()
    return result


SIDES = ("accelerator", "host")


def placement(engine) -> dict:
    """Where this rank's model states live: bytes of each kind on the accelerator side and on the host
    side, how many host bytes are pinned (page-locked), the bytes per physical device, and the dtypes
    of each kind.

    On a GPU the side is the tensor's device. On CPU ranks the accelerator *is* host memory, so the
    side is the one DeepSpeed assigns the holder (its offload partitions are the host side); the result
    says so in ``accelerator_is_host``. Each tensor's bytes are counted once per side.
    """
    get_accelerator = ds.load("deepspeed.accelerator").get_accelerator

    accelerator = get_accelerator()
    accelerator_is_host = accelerator.device_name() == "cpu"
    by_side = {side: {key: [] for key in KEYS} for side in SIDES}
    devices: dict[str, list[torch.Tensor]] = {}
    pinned: list[torch.Tensor] = []
    dtypes: dict[str, set[str]] = {key: set() for key in KEYS}
    for key, tensors in _holders(engine).items():
        for tensor, offloaded in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or tensor.device.type == "meta":
                continue
            on_host = tensor.device.type == "cpu"
            side = "host" if (offloaded if accelerator_is_host else on_host) else "accelerator"
            by_side[side][key].append(tensor)
            devices.setdefault(str(tensor.device), []).append(tensor)
            dtypes[key].add(str(tensor.dtype).removeprefix("torch."))
            if on_host and accelerator.is_pinned(tensor):  # never, on CPU ranks: nothing to pin for
                pinned.append(tensor)
    return {
        **{side: {key: _unique_bytes(by_side[side][key]) for key in KEYS} for side in SIDES},
        "pinned_bytes": _unique_bytes(pinned),
        "devices": {device: _unique_bytes(ts) for device, ts in sorted(devices.items())},
        "dtypes": {key: sorted(names) for key, names in dtypes.items() if names},
        "accelerator_is_host": accelerator_is_host,
    }


def peak_bytes(device: str) -> tuple[int, str]:
    """Peak memory of this rank and where the figure comes from.

    On a GPU: ``torch.cuda.max_memory_allocated`` (tensors only). On CPU: the process's peak
    resident set (``ru_maxrss``), which also counts Python, torch and DeepSpeed themselves.
    """
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS (ru_maxrss)"
