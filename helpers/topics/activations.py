"""Activation memory: the bytes a forward pass keeps for its backward, counted tensor by tensor.

The ``activations`` probe watches the forward of the first micro-step of a run (on a pipeline stage:
every forward before its first backward) through ``torch.autograd.graph.saved_tensors_hooks``: each
tensor autograd saves for backward passes through its pack hook. Each block of memory (storage) is
counted once, however many views of it are saved; parameters are not activations and are left out.
Activation checkpointing changes what is saved:

- torch's ``torch.utils.checkpoint`` (what transformers' ``activation_checkpointing_enable`` uses,
  non-reentrant by default) saves a checkpointed layer's inputs through the same hooks;
- DeepSpeed's ``deepspeed.checkpointing.checkpoint`` keeps them as plain attributes of its autograd
  function (``ctx.deepspeed_saved_tensors``), which no hook sees: the probe reads those from the
  layer output's ``grad_fn`` when the layer returns (with ``cpu_checkpointing``, also the host copies,
  beside the tensor or in DeepSpeed's offload engine, where they are when the backward starts).

Each saved block is attributed to the decoder layer whose forward was running when it was first
saved (a layer's input is first saved by that layer), or to ``outside`` (embedding, final norm, LM
head, loss). A checkpointed layer is watched where transformers calls its checkpoint function
(``layer._gradient_checkpointing_func``), outside the checkpoint whatever the transformers version:
transformers 5.17 checkpoints the layer's ``__call__``, so the layer's own forward hooks run inside the
checkpoint (inside DeepSpeed's, under ``no_grad``); 5.24 checkpoints ``forward`` and calls the hooks outside.
Tensors a checkpointed layer's closure holds for its replay (the rotary cos/sin and the causal mask, shared by
all layers) are not saved tensors and are not counted.

The ``phases`` probe (:class:`Phases`) times each step's forward, its decoder layers, its backward and the
rest, to compare what recomputation costs with the 4/3 rule of thumb.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from helpers.core import ds, exercises, load_guard, models, plots, records, references, theory
from helpers.core.probes import Probe, RunContext


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a model, in order (modules whose class name ends in ``DecoderLayer``)."""
    return [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]


def _held_by_function(grad_fn: Any) -> tuple[list[torch.Tensor], list[int]]:
    """Floating-point tensors a custom autograd function keeps as plain attributes of its ctx (DeepSpeed's
    checkpoint keeps the layer inputs there), not through ``save_for_backward``; and the ids under which
    DeepSpeed's asynchronous offload engine holds the ones it took away (``cpu_checkpointing`` on a GPU)."""
    found: list[torch.Tensor] = []
    offloaded: list[int] = []
    for value in getattr(grad_fn, "__dict__", {}).values():
        items = value if isinstance(value, (tuple, list)) else [value]
        for t in items:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                found.append(t)
                # cpu_checkpointing (blocking copy) empties the tensor and keeps a host copy beside it
                if isinstance(getattr(t, "saved_data", None), torch.Tensor):
                    found.append(t.saved_data)
                if isinstance(getattr(t, "ds_offload_id", None), int):
                    offloaded.append(t.ds_offload_id)
    return found, offloaded


def _offload_engine_holds(token: int) -> list[torch.Tensor]:
    """What DeepSpeed's activation offload engine holds for ``token`` now: the tensor kept on the device
    (the newest), the device source of a copy in flight, the host copy."""
    checkpointing = ds.load("deepspeed.runtime.activation_checkpointing.checkpointing")

    engine = getattr(checkpointing, "_cpu_offload_engine", None)
    held = []
    for store in ("_keep_last", "_fwd_stash", "_tracker"):
        value = getattr(engine, store, {}).get(token)
        first = value[0] if isinstance(value, tuple) else value
        if isinstance(first, torch.Tensor):
            held.append(first)
    return held


class SavedTensorCounter:
    """Counts the storages saved for backward while active (``start`` ... ``stop``), per decoder layer.

    Saves after the first unpack (the backward has begun: recomputation of checkpointed layers) are
    not counted: they are transient, freed layer by layer.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = {_storage(p)[0] for p in model.parameters()}
        self.layers = decoder_layers(model)
        self.saved: dict[int, dict] = {}  # storage pointer -> {bytes, where, dtype, shape}
        self.where: str = "outside"
        self.backward_started = False
        self.offloaded: list[tuple[int, str]] = []  # (offload engine id, layer)
        self.handles: list = []
        self.wrapped: list[tuple[torch.nn.Module, Any]] = []  # (layer, its own checkpoint function)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _note(self, t: torch.Tensor, where: str) -> None:
        if isinstance(t, torch.nn.Parameter):
            return
        ptr, nbytes = _storage(t)
        if ptr in self.params or ptr in self.saved or nbytes == 0:
            return
        self.saved[ptr] = {"bytes": nbytes, "where": where, "dtype": str(t.dtype).removeprefix("torch."),
                           "elements": nbytes // t.element_size(), "device": t.device.type}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.backward_started:
            self._note(t, self.where)
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.backward_started:  # the forward is over: see where offloaded inputs ended up
            for token, where in self.offloaded:
                for held in _offload_engine_holds(token):
                    self._note(held, where)
        self.backward_started = True
        return t

    def start(self) -> None:
        for index, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(
                lambda module, args, index=index: setattr(self, "where", f"layer {index}")))
            self.handles.append(layer.register_forward_hook(lambda module, args, output, index=index:
                                                            self._after_layer(output, index)))
            checkpoint = layer.__dict__.get("_gradient_checkpointing_func")  # set by transformers' switch
            if checkpoint is not None:
                self.wrapped.append((layer, checkpoint))
                layer._gradient_checkpointing_func = self._watched(checkpoint, index)
        self.hooks.__enter__()

    def _watched(self, checkpoint: Any, index: int) -> Any:
        """``checkpoint`` (torch's or DeepSpeed's, as transformers calls it for layer ``index``), attributing
        what it saves to the layer and reading what DeepSpeed's keeps from the output it returns."""
        def watched(*args: Any, **kwargs: Any) -> Any:
            if not self.backward_started:
                self.where = f"layer {index}"
            output = checkpoint(*args, **kwargs)
            self._after_layer(output, index)
            return output
        return watched

    def _after_layer(self, output: Any, index: int) -> None:
        first = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(first, torch.Tensor) and first.grad_fn is not None and not self.backward_started:
            tensors, offloaded = _held_by_function(first.grad_fn)
            for t in tensors:
                self._note(t, f"layer {index}")
            self.offloaded += [(token, f"layer {index}") for token in offloaded]
        self.where = "outside"

    def stop(self) -> None:
        self.hooks.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for layer, checkpoint in self.wrapped:
            layer._gradient_checkpointing_func = checkpoint
        self.wrapped.clear()

    def summary(self) -> dict:
        """Bytes per decoder layer, outside the layers, in total and per device type (``cpu`` holds the
        host copies of ``cpu_checkpointing``); and [dtype, elements] of each saved block of layer 0 and
        outside the layers."""
        per_layer = [0] * len(self.layers)
        outside = 0
        for entry in self.saved.values():
            if entry["where"] == "outside":
                outside += entry["bytes"]
            else:
                per_layer[int(entry["where"].split()[1])] += entry["bytes"]
        by_device: dict[str, int] = {}
        for entry in self.saved.values():
            by_device[entry["device"]] = by_device.get(entry["device"], 0) + entry["bytes"]
        return {"per_layer": per_layer, "outside": outside, "total": sum(per_layer) + outside, "by_device": by_device,
                "layer0_blocks": sorted([[e["dtype"], e["elements"]] for e in self.saved.values()
                                         if e["where"] == "layer 0"], key=lambda b: (-b[1], b[0])),
                "outside_blocks": sorted([[e["dtype"], e["elements"]] for e in self.saved.values()
                                          if e["where"] == "outside"], key=lambda b: (-b[1], b[0]))}


class Activations(Probe):
    """Bytes saved for backward during the forward of the first micro-step (see the module docstring),
    per decoder layer and outside the layers, on each rank. On a GPU also the bytes the allocator holds
    when the last step starts (model states and buffers: the floor the activations come on top of; the
    ``peak_memory`` probe gives the peak). Section: ``activations``.
    """

    name = "activations"
    keys = ("activations.per_rank",)

    def start(self, ctx: RunContext) -> None:
        self.counter: SavedTensorCounter | None = None
        self.result: dict = {}

    def before_step(self, ctx: RunContext, step: int) -> None:
        if ctx.device_type == "cuda":
            torch.cuda.synchronize()
            self.result["allocated_at_step_start"] = int(torch.cuda.memory_allocated())
        if step == 0:
            self.counter = SavedTensorCounter(ctx.engine.module)
            self.counter.start()

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        if self.counter is not None:
            self.counter.stop()
            self.result.update(self.counter.summary())
            self.counter = None

    def finish(self, ctx: RunContext) -> dict:
        return self.result

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"activations": {"per_rank": ranks,
                                "measured_at": "forward of micro-step 1 of step 1 (until its backward starts)"}}


class _Clock:
    """Time stamps that do not stop the device: CUDA events on a GPU (read once the step has ended), the
    wall clock on a CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class Phases(Probe):
    """Where each optimizer step's time goes on rank 0: the model's forward (``forward_s``), the decoder
    layers' part of it (``layers_s``), the loss and the backward (``backward_s``: from the end of the forward
    to the end of ``engine.backward``, where checkpointed layers run their forward again), and the rest of
    the step (``rest_s``: reading the batch and ``engine.step``). Summed over the micro-steps of a step;
    with ``step_s``, the step from end to end. Section: ``phases``.
    """

    name = "phases"
    keys = ("phases.per_step",)

    def start(self, ctx: RunContext) -> None:
        self.clock = _Clock(ctx.device_type == "cuda")
        self.steps: list[dict[str, float]] = []
        self.marks: list[tuple[str, Any]] = []
        self.in_forward = False
        model = ctx.engine.module
        self.handles = [model.register_forward_pre_hook(lambda *_: self._forward(True)),
                        model.register_forward_hook(lambda *_: self._forward(False))]
        for layer in decoder_layers(model):  # in the forward only: some versions replay these hooks in backward
            self.handles += [layer.register_forward_pre_hook(lambda *_: self._mark("layer start", forward_only=True)),
                             layer.register_forward_hook(lambda *_: self._mark("layer end", forward_only=True))]

    def _mark(self, label: str, forward_only: bool = False) -> None:
        if self.in_forward or not forward_only:
            self.marks.append((label, self.clock.now()))

    def _forward(self, starts: bool) -> None:
        self.in_forward = starts
        self._mark("forward start" if starts else "forward end")

    def before_step(self, ctx: RunContext, step: int) -> None:
        self.marks = []
        self._mark("step start")

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        self._mark("backward end")

    def after_step(self, ctx: RunContext, step: int) -> None:
        self._mark("step end")
        if self.clock.cuda:
            torch.cuda.synchronize()
        found = {"forward_s": 0.0, "layers_s": 0.0, "backward_s": 0.0}
        opened: dict[str, Any] = {}
        for label, stamp in self.marks:
            kind, edge = label.rsplit(" ", 1)
            if edge == "start":
                opened[kind] = stamp
            elif kind == "forward":
                found["forward_s"] += self.clock.seconds(opened["forward"], stamp)
                opened["backward"] = stamp  # the loss and the backward start where the forward ends
            elif kind == "layer":
                found["layers_s"] += self.clock.seconds(opened["layer"], stamp)
            elif kind == "backward" and "backward" in opened:
                found["backward_s"] += self.clock.seconds(opened.pop("backward"), stamp)
        found["step_s"] = self.clock.seconds(self.marks[0][1], self.marks[-1][1])
        found["rest_s"] = found["step_s"] - found["forward_s"] - found["backward_s"]
        self.steps.append(found)

    def finish(self, ctx: RunContext) -> dict:
        for handle in self.handles:
            handle.remove()
        return {"steps": self.steps}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"phases": {"per_step": ranks[0]["steps"], "rank": 0}}


# --- the chapter's experiment and tables (notebooks/10_activation_checkpointing.ipynb) --------------

#: The name suffixes of the course's checkpointed models (:data:`helpers.core.models.LLAMA_VARIANTS`): a chapter
#: script records a model it checkpointed under that name (``llama-ckpt``: torch's checkpoint, ``llama-dsckpt``:
#: DeepSpeed's), which the formulas read.
CHECKPOINTED = ("-ckpt", "-dsckpt")
#: Run name -> what it is, as the tables print it (the chapter script's runs; ``transformers`` and
#: ``long-transformers`` name torch's checkpoint, as transformers calls it, in the older GPU references).
LABELS = {"plain": "no checkpointing", "torch": "torch.utils.checkpoint",
          "transformers": "torch.utils.checkpoint",
          "deepspeed": "deepspeed.checkpointing", "section-only": "config section, plain model",
          "deepspeed-cpu": "deepspeed.checkpointing + cpu_checkpointing",
          "long": "512 tokens, no checkpointing", "long-torch": "512 tokens, torch.utils.checkpoint",
          "long-transformers": "512 tokens, transformers", "plain-again": "no checkpointing, again at the end"}


def chapter_records(folder: str | Path, since: float = 0.0) -> dict[str, records.Record]:
    """The records the chapter's script wrote into ``folder`` (one sub-folder per run, named as the script
    names them) since ``since`` (a ``time.time()``: folders of runs a learner has since renamed are left out),
    by run name in the order they trained."""
    loaded, _ = records.load_all(folder)
    found = [(Path(folder, name, "summary.json").stat().st_mtime, name, record) for name, record in loaded.items()]
    found = sorted(item for item in found if item[0] >= since)
    if not found:
        raise FileNotFoundError(f"no record in {folder} newer than the launch: did the script run?")
    return {name: record for _, name, record in found}


def measured(record: records.Record, rank: int = 0) -> dict:
    """What the ``activations`` probe measured on ``rank``: ``total`` bytes saved for backward, ``per_layer``,
    ``outside`` (the layers' neighbours), and on a GPU ``allocated_at_step_start``."""
    return record.section("activations")["per_rank"][rank]


def saved_bytes(record: records.Record, rank: int = 0) -> int:
    """Bytes ``rank`` saved for backward in the forward of one micro-batch (the ``activations`` probe)."""
    return measured(record, rank)["total"]


def _shape(record: records.Record) -> models.LlamaShape:
    return models.shape_of(record.model_name)


def layer_formula(record, layer: int) -> float:
    """The formula's bytes for decoder ``layer`` of ``record``'s model, batch and precision (the rotary
    cos/sin are first saved by layer 0)."""

    shape, precision = _shape(record), record["precision"]
    checkpointed = record.model_name.endswith(CHECKPOINTED)  # a pipeline's stages ("llama-pipe") are not
    per_layer = activation_bytes_per_layer(record["micro_batch"], shape.seq, shape.hidden, shape.heads,
                                                  shape.intermediate, precision, checkpointed)["total"]
    rotary = rotary_bytes(shape.seq, shape.hidden // shape.heads, precision)
    return per_layer + (rotary if layer == 0 and not checkpointed else 0)


def layer_table(runs: dict, names) -> str:
    """Per run and decoder layer: bytes saved for backward (rank 0), the formula, their ratio."""

    rows = []
    for name in names:
        r = runs[name]
        for layer, saved in enumerate(measured(r)["per_layer"]):
            formula = layer_formula(r, layer)
            rows.append([LABELS.get(name, name), layer, f"{saved:,}", f"{formula:,.0f}", f"{saved / formula:.3f}"])
    return records.format_table(rows, ["run", "layer", "saved bytes", "formula bytes", "measured/formula"])


def rotary_note(record) -> str:
    """Why decoder layer 0 of ``record`` (rank 0) saved more than layer 1: the rotary cos and sin, which the first
    layer keeps for the whole model, compared with :func:`rotary_bytes`."""
    shape = _shape(record)
    first, second = measured(record)["per_layer"][:2]
    rotary = rotary_bytes(shape.seq, shape.hidden // shape.heads, record["precision"])
    width = theory.bytes_per_element(record["precision"])
    return (f"Layer 0 saved {first - second:,} bytes more than layer 1: "
            + (f"the rotary cos and sin, 2·s·d = 2 x {shape.seq} x {shape.hidden // shape.heads} x {width} bytes = "
               f"{rotary:,.0f}, which the first layer keeps for every layer." if first - second == rotary else
               f"not the rotary cos and sin's {rotary:,.0f} bytes: something else differs."))


def _term_of(elements: int, record) -> str:
    shape, b = _shape(record), record["micro_batch"]
    s, h, a, i = shape.seq, shape.hidden, shape.heads, shape.intermediate
    names = {b * s * h: "b·s·h", b * s * i: "b·s·i", a * s * s * b: "a·s²·b", b * s: "b·s", s * (h // a): "s·d (rotary)"}
    return names.get(elements, f"{elements} elements")


def terms_table(record) -> str:
    """The blocks decoder layer 0 saved (rank 0), grouped by the formula's terms: how many of which dtype,
    their bytes, and the formula's bytes for that term."""

    shape = _shape(record)
    formula = activation_bytes_per_layer(record["micro_batch"], shape.seq, shape.hidden, shape.heads,
                                                shape.intermediate, record["precision"])
    formula["s·d (rotary)"] = rotary_bytes(shape.seq, shape.hidden // shape.heads, record["precision"])
    width = {"float32": 4, "bfloat16": 2, "float16": 2}
    groups: dict[str, dict[str, list[int]]] = {}  # term -> dtype -> [tensors, bytes]
    for dtype, elements in measured(record)["layer0_blocks"]:
        count = groups.setdefault(_term_of(elements, record), {}).setdefault(dtype, [0, 0])
        count[0] += 1
        count[1] += elements * width[dtype]
    rows = [[term, " + ".join(f"{n} x {dtype}" for dtype, (n, _) in by_dtype.items()),
             f"{sum(b for _, b in by_dtype.values()):,}", f"{formula.get(term, 0):,.0f}"]
            for term, by_dtype in groups.items()]
    return records.format_table(rows, ["term", "tensors saved", "bytes", "formula bytes"])


def outside_table(record) -> str:
    """What rank 0 saved for backward outside the decoder layers, block by block, named by its shape (final norm,
    log-softmax of the logits, token ids...), with the formula's bytes (:func:`activation_bytes_outside_layers`,
    floating point only) under it."""
    shape, b = _shape(record), record["micro_batch"]
    s, h = shape.seq, shape.hidden
    width = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}
    names = {(b * s * models.LM_VOCAB, False): "log-softmax of the logits (b·s·V)",
             (b * s * h, False): "final norm: input, normalized, weighted (b·s·h)",
             (b * s, False): "final norm's 1/rms (b·s)", (b * (s + 1), True): "token windows, b·(s+1): the ids",
             (b * s, True): "targets, flattened for the loss (b·s)",
             (1, False): "the loss"}
    groups: dict[str, list[int]] = {}
    for dtype, elements in measured(record)["outside_blocks"]:
        label = names.get((elements, dtype.startswith("int")), f"{elements} elements")
        count = groups.setdefault(label, [0, 0, dtype])
        count[0] += 1
        count[1] += elements * width.get(dtype, 4)
    rows = [[label, f"{n} x {dtype}", f"{size:,}"] for label, (n, size, dtype) in groups.items()]
    rows.append(["all outside the layers", "", f"{measured(record)['outside']:,}"])
    formula = activation_bytes_outside_layers(b, s, h, models.LM_VOCAB, record["precision"])
    return records.format_table(rows, ["outside the layers (rank 0)", "tensors saved", "bytes"]) + (
        f"\nformula, floating point only: {formula:,.0f} bytes")


def totals_table(runs: dict, names) -> str:
    """Per run: bytes saved by the decoder layers (summed), outside them, in total (the sum of the two), against
    the first run's total."""

    base = measured(runs[names[0]])["total"]
    rows = []
    for name in names:
        m = measured(runs[name])
        rows.append([LABELS.get(name, name), f"{sum(m['per_layer']):,}", f"{m['outside']:,}", f"{m['total']:,}",
                     f"{m['total'] / base:.3f}"])
    return records.format_table(rows, ["run", "layers, summed", "outside layers", "total",
                                       f"vs {LABELS.get(names[0], names[0])}"])


#: The cost of recomputation as the FLOP count gives it: a backward of twice the forward's FLOPs, and one more
#: forward of every layer (4 forwards' worth instead of 3).
RULE_OF_THUMB = 4 / 3


def phases(record: records.Record) -> dict[str, float] | None:
    """The phases the ``phases`` probe timed on rank 0 in the run's fastest step (other work on the machine only
    ever adds time, so the fastest step is the least disturbed; its phases add up to it), in seconds:
    ``forward_s``, ``layers_s``, ``backward_s``, ``rest_s``, ``step_s``; None for a record without the probe."""
    if "phases" not in record.probes:
        return None
    return min(record.section("phases")["per_step"], key=lambda step: step["step_s"])


def recompute_rows(runs: dict, names: Sequence[str]) -> list[dict]:
    """Per run, against the first (no checkpointing): its phases, its step time relative to the first's, and
    what one more forward of the first run's decoder layers would make of that step (``predicted``). Runs
    without the ``phases`` probe have step times only."""
    base = runs[names[0]]
    base_phases = phases(base)
    rows = []
    for name in names:
        r = runs[name]
        row = {"name": name, "label": LABELS.get(name, name), "phases": phases(r)}
        # the phases' own step where both runs have them (so that the parts add up), else the timing probe's
        both = row["phases"] is not None and base_phases is not None
        row["step_s"] = row["phases"]["step_s"] if both else r.timing.median_s
        row["ratio"] = row["step_s"] / (base_phases["step_s"] if both else base.timing.median_s)
        row["basis"] = "fastest" if both else "median"  # which step the ratio divides
        if base_phases and row["phases"] and name != names[0]:
            row["predicted"] = 1 + base_phases["layers_s"] / base_phases["step_s"]
            # the backward's growth, in forwards of the layers it replays
            row["replay_forwards"] = (row["phases"]["backward_s"] - base_phases["backward_s"]) / base_phases["layers_s"]
        rows.append(row)
    return rows


def recompute_table(runs: dict, names: Sequence[str]) -> str:
    """Each run's median step (the steps after the first, the statistic the load guard's verdict quotes), its
    fastest step and that step's forward and backward (the loss and ``engine.backward``, where the replays run),
    rank 0, each over the first run's (print it in a cell nbval does not compare)."""

    first_median = statistics.median(_steps_s(runs[names[0]]))
    table = []
    for row in recompute_rows(runs, names):
        p = row["phases"] or {}
        ms = (lambda key: f"{p[key] * 1e3:.1f}" if key in p else "-")
        median = statistics.median(_steps_s(runs[row["name"]]))
        table.append([row["label"], f"{median * 1e3:.1f}", f"{median / first_median:.2f}x",
                      f"{row['step_s'] * 1e3:.1f}", f"{row['ratio']:.2f}x", ms("forward_s"), ms("backward_s")])
    return records.format_table(table, ["run", "median step ms", "median / first", "fastest step ms",
                                        "fastest / first", "its forward ms", "its backward ms"])


def reference_findings(name: str = "activation-checkpointing") -> str:
    """Each committed GPU result's median step time over its run without checkpointing, labelled with its device,
    date and conditions, beside the 4/3 rule, then the load guard's verdict on those times and the per-method
    findings (:func:`recompute_findings`): the detail behind :func:`reference_price`."""

    def render(runs: dict, load: load_guard.Load) -> str:
        names = timed_names(runs)
        base = statistics.median(_steps_s(runs[names[0]]))
        ratios = ", ".join(f"{LABELS.get(n, n)} {statistics.median(_steps_s(runs[n])) / base:.2f}x" for n in names[1:])
        return (f"Median step over {LABELS.get(names[0], names[0])}'s: {ratios} (the rule: {RULE_OF_THUMB:.2f}x).\n"
                + recompute_findings(runs, names, load, again=runs.get(AGAIN), sweep=True))

    return _report_with_load(name, render)


#: The methods the price table compares, in its columns' order (``transformers``: torch's checkpoint in older runs).
PRICED = (("torch.utils.checkpoint", ("torch", "transformers")), ("deepspeed.checkpointing", ("deepspeed",)),
          ("+ cpu_checkpointing", ("deepspeed-cpu",)))


def reference_price(name: str = "activation-checkpointing") -> str:
    """One table of the committed GPU results: per device and date, the median step without checkpointing and
    each checkpoint method's median over it (steps after the first, the statistic of the load guard's verdict),
    beside the 4/3 rule; under it, one line per result with the load guard's verdict on those times."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name)
    rows, notes = [], []
    for (device, date, _, runs), conditions in zip(found, references.reference_conditions(name)):
        names = timed_names(runs)
        median = {n: statistics.median(_steps_s(runs[n])) for n in names}
        base = median[names[0]]
        cells = []
        for _, candidates in PRICED:
            run = next((n for n in candidates if n in median), None)
            cells.append(f"{median[run] / base:.2f}x" if run else "-")
        rows.append([f"{device}, {date}", runs[names[0]]["grad_accum"], f"{base * 1e3:.1f}", *cells,
                     f"{RULE_OF_THUMB:.2f}x"])
        again = runs.get(AGAIN)
        verdict = load_guard.compare({LABELS.get(n, n): _steps_s(runs[n]) for n in names},
                                     load_guard.Load.from_conditions(conditions),
                                     repeat=_steps_s(again) if again is not None else None, sweep=True)
        notes.append(f"{device}: " + (f"the differences exceed the steps' spread ({verdict.spread:.0%}): the ratios "
                                      "stand as measured." if verdict.given else
                                      f"verdict withheld, {verdict.withheld}: the ratios are for reading only."))
    table = records.format_table(rows, ["measured on", "micro-batches a step", "no checkpointing, median ms",
                                        *(label for label, _ in PRICED), "the 4/3 rule"])
    return (table + "\nEach ratio: the method's median step over no checkpointing's, steps after the first (which "
            "warms up).\n" + "\n".join(notes))


def recompute_verdict(runs: dict, names: Sequence[str], load: load_guard.Load | None,
                      again: records.Record | None = None) -> str:
    """The load guard's verdict on the step times of ``names`` (the first without checkpointing, measured ``again``
    at the end of the launch where given) under ``load``, in one sentence; :func:`recompute_findings` adds the
    per-method findings."""
    verdict = load_guard.compare({LABELS.get(n, n): _steps_s(runs[n]) for n in names}, load,
                                 repeat=_steps_s(again) if again is not None else None)
    return load_guard.sentence(verdict)


#: The run without checkpointing, measured again at the end of the chapter's launch.
AGAIN = "plain-again"


def timed_names(runs: Mapping[str, Any]) -> list[str]:
    """The runs whose step times the chapter compares, the run without checkpointing first: those of ``runs``
    that are plain, a checkpoint function's, or ``cpu_checkpointing``'s (not the config section alone)."""
    return [n for n in ("plain", "transformers", "torch", "deepspeed", "deepspeed-cpu")
            if n in runs and not isinstance(runs[n], Exception)]


def _report_with_load(name: str, render: Callable[[dict, load_guard.Load], str]) -> str:
    """:func:`helpers.core.references.references_report` for renderers that judge timings: each committed
    result's ``render(runs, load)`` with the load its written conditions state
    (:meth:`~helpers.core.load_guard.Load.from_conditions`: alone where they say so)."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name)
    return "\n\n".join(f"Measured on {device}, {date} ({note}):\nConditions: {conditions}\n"
                        f"{render(runs, load_guard.Load.from_conditions(conditions))}"
                        for (device, date, note, runs), conditions in zip(found, references.reference_conditions(name)))


def gpu_findings(runs: Mapping[str, Any], load: load_guard.Load | None) -> str:
    """:func:`recompute_findings` for the chapter's GPU run: its timed runs (:func:`timed_names`) under the
    ``load`` its launch was watched under, the run without checkpointing measured again at its end."""
    return recompute_findings(runs, timed_names(runs), load, again=runs.get(AGAIN), sweep=True)


def _steps_s(record: records.Record) -> list[float]:
    """A run's step times after its first (which warms up), or all of them where it has one or two."""
    times = record.timing.all_s
    return times[1:] if len(times) > 2 else times


def recompute_findings(runs: dict, names: Sequence[str], load: load_guard.Load | None,
                       again: records.Record | None = None, sweep: bool = False) -> str:
    """The measured cost of recomputation against the 4/3 rule, in sentences generated from the runs, through the
    course's load guard: its verdict on the step times of ``names`` (the first, the run without checkpointing,
    measured ``again`` at the end of the launch where given) under ``load`` first; where it withholds it, nothing
    more (``sweep``: the runs come from one sweep, withheld without ``again``). Otherwise each run's step against the rule's 4/3, and which of the rule's assumptions (a backward twice
    the forward; a replay that costs one forward) held."""

    rows = recompute_rows(runs, names)
    verdict = load_guard.compare({LABELS.get(n, n): _steps_s(runs[n]) for n in names}, load,
                                 repeat=_steps_s(again) if again is not None else None, sweep=sweep)
    lines = [load_guard.sentence(verdict)]
    if not verdict.given:
        if load is not None and not load.alone:
            medians = {n: statistics.median(_steps_s(runs[n])) for n in names}
            faster = [row["label"] for row in rows[1:]
                      if row["ratio"] < 1 or medians[row["name"]] < medians[names[0]]]
            lines.append("Under this load the step times cannot even rank the methods: other processes took the "
                         "cores for different steps of each run"
                         + (f" ({', '.join(faster)} came out faster than {LABELS.get(names[0], names[0])} in its "
                            "median or fastest step, which a replay cannot do)." if faster else "."))
        lines.append("So nothing is said here of what recomputation cost: the step times are for reading, not for "
                     "judging.")
        return "\n".join(lines)
    if any(row["ratio"] < 1 or row.get("replay_forwards", 0) < 0 for row in rows[1:]):
        lines.append("A checkpointed run measured a shorter step or backward than the run without checkpointing, "
                     "which recomputation cannot do: these times test nothing here.")
        return "\n".join(lines)
    base = rows[0]["phases"]
    for row in rows[1:]:
        side = "within" if row["ratio"] <= RULE_OF_THUMB else "above"
        lines.append(f"{row['label']}: {row['ratio']:.2f}x the {row['basis']} step without checkpointing, {side} the "
                     f"rule's {RULE_OF_THUMB:.2f}x.")
    if not base:
        lines.append("These runs were not split into phases (no 'phases' probe), so which of the rule's "
                     "assumptions failed is not measured here.")
        return "\n".join(lines)
    ratio = base["backward_s"] / base["forward_s"]
    share = ("shorter, so one forward is more than a third of forward + backward" if ratio < 2 else
             "so one forward is at most a third of forward + backward")
    lines.append(f"Without checkpointing the loss and backward took {ratio:.2f} times the forward (the rule assumes 2: "
                 f"{share}), and the decoder layers were {base['layers_s'] / base['forward_s']:.0%} of the forward; "
                 f"one more forward of them predicts {rows[1]['predicted']:.2f}x.")
    for row in rows[1:]:
        if "replay_forwards" in row:
            more = row["replay_forwards"]
            lines.append(f"{row['label']}: its backward grew by {more:.2f} times the layers' forward "
                         f"({'more than' if more > 1 else 'at most'} the one forward the rule counts).")
    return "\n".join(lines)


def softmax_share(record: records.Record) -> str:
    """What the a·s²·b softmax probabilities of decoder layer 0 take of a layer's saved bytes in ``record``
    (rank 0): the block of that many elements the probe found, against the last layer's total."""
    shape = _shape(record)
    elements = shape.heads * shape.seq ** 2 * record["micro_batch"]
    width = theory.bytes_per_element(record["precision"])
    found = [e for _, e in measured(record)["layer0_blocks"] if e == elements]
    layer = measured(record)["per_layer"][-1]
    if not found:
        return f"{shape.seq} tokens: no block of a·s²·b = {elements:,} elements was saved."
    softmax = width * sum(found)
    return (f"{shape.seq} tokens: the a·s²·b softmax keeps {records.format_bytes(softmax)} of a layer's "
            f"{records.format_bytes(layer)} ({softmax / layer:.0%})")


def model_state_bytes_fp32(psi: int) -> int:
    """Model states of fp32 training with Adam at ZeRO-0: 4 (weights) + 4 (gradients) + 8 (moments) bytes
    a parameter."""
    return 16 * psi


def states_against_activations(runs: dict, names) -> str:
    """Per run: model states (measured, rank 0) and activations saved (measured), their ratio, and the
    formulas' ratio (16Ψ against :func:`activation_bytes`)."""

    rows = []
    for name in names:
        r = runs[name]
        shape = _shape(r)
        states = r.model_state_bytes(0)
        saved = saved_bytes(r)
        formula = activation_bytes(shape.layers, r["micro_batch"], shape.seq, shape.hidden, shape.heads,
                                   shape.intermediate, models.LM_VOCAB, r["precision"])
        rows.append([LABELS.get(name, name), shape.seq, f"{states:,}", f"{saved:,}", f"{saved / states:.2f}",
                     f"{formula / model_state_bytes_fp32(r.params):.2f}"])
    return records.format_table(rows, ["run", "tokens", "model states", "activations", "activations/states",
                                       "formula ratio"])


def crossover_sequence(layers: int, hidden: int, heads: int, intermediate: int, vocab: int, psi: int,
                       batch: int = 1, precision: str = "bf16", bytes_per_param: int = 16) -> int:
    """The shortest sequence (in tokens) at which one micro-batch's activations (formula) exceed the model
    states (``bytes_per_param`` x Ψ: 16 for Adam in fp32 or in mixed precision)."""

    seq = 1
    while activation_bytes(layers, batch, seq, hidden, heads, intermediate, vocab, precision) < bytes_per_param * psi:
        seq += 1
    return seq


def saving_summary(runs: Mapping[str, Any], pairs: Sequence[tuple[str, str]] = (("plain", "torch"),
                                                                                ("long", "long-torch"))) -> str:
    """The key result in one line per sequence length, from the runs (rank 0): the whole step's saved bytes with
    checkpointing against without, per decoder layer too, and whether the losses agree."""
    lines = []
    for plain_name, ckpt_name in pairs:
        plain, ckpt = measured(runs[plain_name]), measured(runs[ckpt_name])
        lines.append(f"{models.seq_len_of(runs[plain_name].model_name)} tokens: checkpointed / not: "
                     f"{ckpt['total'] / plain['total']:.3f} of the step's saved bytes, "
                     f"{ckpt['per_layer'][-1] / plain['per_layer'][-1]:.3f} of a decoder layer's; losses "
                     f"{records.loss_agreement(runs[ckpt_name].losses, runs[plain_name].losses)}")
    return "\n".join(lines)


#: The config's ``activation_checkpointing`` settings (DeepSpeed 0.19.8:
#: ``deepspeed/runtime/activation_checkpointing/config.py``, read by ``checkpointing.configure``): what each changes
#: in ``deepspeed.checkpointing.checkpoint``, and where it applies.
SECTION_SETTINGS = {
    "partition_activations": ("splits each input it keeps across the model-parallel ranks",
                              "model parallelism (an mpu given to configure)"),
    "cpu_checkpointing": ("moves the inputs it keeps to host memory until the replay",
                          "GPUs (not CPU ranks: the script's comment)"),
    "contiguous_memory_optimization": ("copies the split inputs into one preallocated buffer",
                                       "with partition_activations and number_checkpoints"),
    "number_checkpoints": ("how many checkpoints a forward keeps: that buffer's size",
                           "with contiguous_memory_optimization"),
    "synchronize_checkpoint_boundary": ("waits for the device at each checkpoint's start and end",
                                        "debugging, timing"),
    "profile": ("logs each checkpoint's forward and backward time", "profiling"),
}


def section_settings_table() -> str:
    """The six settings of the config's ``activation_checkpointing`` section: what each does, where it applies."""
    rows = [["setting", "what it does to deepspeed.checkpointing.checkpoint", "applies with"]]
    rows += [[name, does, where] for name, (does, where) in SECTION_SETTINGS.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths)] + lines[1:])


def section_report(runs: dict) -> str:
    """What the config's ``activation_checkpointing`` section did to the plain model with every setting on: its
    saved bytes (rank 0) against the run without it."""
    plain, section = measured(runs["plain"]), measured(runs["section-only"])
    same = section["per_layer"] == plain["per_layer"] and section["total"] == plain["total"]
    return (f"plain model, activation_checkpointing section with every setting on: {section['total']:,} bytes saved, "
            f"{'the same as' if same else 'different from'} without the section ({plain['total']:,})")


def cpu_checkpointing_findings(runs: dict) -> str:
    """What ``cpu_checkpointing`` did in this launch, generated from its runs (rank 0): where the layers' inputs
    were when the backward began, as a table (on the GPU, in host memory, counted in the layers) in layer inputs
    and bytes, and a sentence that reconciles them; or, where the launch had no ``deepspeed-cpu`` run (CPU ranks),
    that it was not measured here."""
    if "deepspeed-cpu" not in runs:
        return (f"This launch ran on {runs['plain']['device']} ranks, where the script leaves cpu_checkpointing out "
                "(its comment says why): nothing here measures it; the GPU reference below does.")
    with_cpu, without = measured(runs["deepspeed-cpu"]), measured(runs["deepspeed"])
    device = runs["deepspeed-cpu"]["device"]
    where = "GPU" if device == "cuda" else device
    layers = len(with_cpu["per_layer"])
    one = layer_formula(runs["deepspeed"], 0)  # a checkpointed layer keeps its input: b·s·h elements
    kept, host, before = (with_cpu["by_device"].get(device, 0), with_cpu["by_device"].get("cpu", 0),
                          without["by_device"].get(device, 0))
    counted = sum(with_cpu["per_layer"])
    n = lambda size: size / one  # noqa: E731 -- bytes in layer inputs
    table = records.format_table(
        [[f"on the {where}", records.format_bytes(kept), f"{n(kept - with_cpu['outside']):.0f}",
          records.format_bytes(with_cpu["outside"])],
         ["in host memory", records.format_bytes(host), f"{n(host):.0f}", "0 B"],
         ["counted in the layers", records.format_bytes(counted), f"{n(counted):.0f}", "-"],
         [f"on the {where}, without cpu_checkpointing", records.format_bytes(before),
          f"{n(before - without['outside']):.0f}", records.format_bytes(without["outside"])]],
        ["cpu_checkpointing, rank 0, as the backward began", "bytes",
         f"layer inputs ({records.format_bytes(one)} each)", "outside the layers"])
    both = round(n(kept - with_cpu["outside"]) + n(host) - layers)
    return (f"{table}\n{layers} layers, so {layers} inputs: {round(n(host))} were in host memory and "
            f"{round(n(kept - with_cpu['outside']))} on the {where}"
            + (f", {both} of them on both sides (a copy still running), which the layers' count holds twice"
               if both > 0 else "")
            + f"; {records.format_bytes(max(before - kept, 0))} left the {where}.\nSo the "
            f"{records.format_bytes(host)} in host memory did not free {records.format_bytes(host)} on the {where}: "
            f"{records.format_bytes(without['by_device'].get(device, 0))} without cpu_checkpointing, "
            f"{records.format_bytes(kept)} with it, {records.format_bytes(max(before - kept, 0))} freed.")


def llama_7b_shape() -> dict:
    """LLaMA-7B's sizes (the source article's model), for the formulas."""
    return {"layers": 32, "hidden": 4096, "heads": 32, "intermediate": 11008, "vocab": 32000}


def crossover_table(course_batch: int = 4, at_seq: int = 4096) -> str:
    """The sequence length at which one micro-batch's activations (formula) pass the model states, for the
    course's model (fp32, its micro-batch) and LLaMA-7B (bf16, micro-batch 1), and the activations at
    ``at_seq`` tokens; model states 16 bytes a parameter (Adam at ZeRO-0, fp32 or mixed precision)."""

    rows = []
    course = models.shape_of("llama")
    psi = models.count_parameters(models.build("llama"))
    big = llama_7b_shape()
    psi_7b = models.llama_7b_parameters()
    for label, shape, p, batch, precision in (
            ("course llama", dict(layers=course.layers, hidden=course.hidden, heads=course.heads,
                                  intermediate=course.intermediate, vocab=models.LM_VOCAB), psi, course_batch, "fp32"),
            ("LLaMA-7B", big, psi_7b, 1, "bf16")):
        seq = crossover_sequence(psi=p, batch=batch, precision=precision, **shape)
        at = activation_bytes(shape["layers"], batch, at_seq, shape["hidden"], shape["heads"],
                                     shape["intermediate"], shape["vocab"], precision)
        rows.append([label, f"{p:,}", precision, batch, records.format_bytes(16 * p), seq, records.format_bytes(at)])
    return records.format_table(rows, ["model", "parameters", "precision", "micro-batch", "model states (16 B/param)",
                                       "activations pass them at (tokens)", f"activations at {at_seq:,} tokens"])


def crossover_terms(precision: str = "bf16", seq: int = 4096) -> str:
    """LLaMA-7B's activations at ``seq`` tokens (micro-batch 1) term by term, as :func:`activation_bytes_per_layer`
    counts them in ``precision``: each term's elements and bytes per unit, its bytes over the 32 layers, and what
    the same elements would take at the precision's width alone; then why the two differ."""
    big = llama_7b_shape()
    args = (1, seq, big["hidden"], big["heads"], big["intermediate"])
    counted = activation_bytes_per_layer(*args, precision=precision)
    elements = {term: value / 4 for term, value in activation_bytes_per_layer(*args, precision="fp32").items()}
    units = {"b·s·h": seq * big["hidden"], "b·s·i": seq * big["intermediate"],
             "a·s²·b": big["heads"] * seq * seq, "b·s": seq}
    width = theory.bytes_per_element(precision)
    rows = [[term, f"{elements[term] / unit:.0f}", f"{counted[term] / unit:.0f}",
             records.format_bytes(big["layers"] * counted[term]),
             records.format_bytes(big["layers"] * elements[term] * width)] for term, unit in units.items()]
    rows.append(["all 32 layers", "", "", records.format_bytes(big["layers"] * counted["total"]),
                 records.format_bytes(big["layers"] * elements["total"] * width)])
    table = records.format_table(rows, ["term", "tensors kept", f"bytes per unit ({precision})",
                                        f"LLaMA-7B, {seq:,} tokens", f"at {width} B an element"])
    return (table + f"\nWhy more than {width} bytes an element: in {precision}, transformers' eager attention runs "
            "the softmax in fp32 (softmax(..., dtype=torch.float32)), whose backward keeps that fp32 output, and "
            "casts it back for the product with the values, which keeps the half copy (4 + 2 bytes); each RMSNorm "
            "keeps an fp32 copy of its input and its fp32 1/rms (LlamaRMSNorm.forward, transformers 5.24). Read "
            "from the source: this chapter measures fp32 only.")


def activation_curves(course_batch: int = 4, seqs=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)) -> dict:
    """label -> (sequence lengths, activation bytes by formula, model-state bytes) for
    :func:`helpers.topics.activations.activations_vs_sequence`: the course's model and LLaMA-7B."""

    course = models.shape_of("llama")
    psi = models.count_parameters(models.build("llama"))
    big = llama_7b_shape()
    psi_7b = models.llama_7b_parameters()
    return {
        f"course llama, fp32, b={course_batch}": (list(seqs), [activation_bytes(
            course.layers, course_batch, s, course.hidden, course.heads, course.intermediate, models.LM_VOCAB, "fp32")
            for s in seqs], 16 * psi),
        "LLaMA-7B, bf16, b=1": (list(seqs), [activation_bytes(
            big["layers"], 1, s, big["hidden"], big["heads"], big["intermediate"], big["vocab"], "bf16")
            for s in seqs], 16 * psi_7b),
    }


def gpu_table(runs: dict) -> str:
    """GPU results: per run, bytes saved for backward (on the GPU and in host memory), the allocator's view
    (allocated when the last step starts, the run's peak), the median step after the first (which warms up) and
    its ratio to the first run's."""

    names = [n for n, r in runs.items() if not isinstance(r, Exception)]
    base = statistics.median(_steps_s(runs[names[0]]))
    rows = []
    for name in names:
        r = runs[name]
        m = measured(r)
        median = statistics.median(_steps_s(r))
        rows.append([LABELS.get(name, name), records.format_bytes(m["by_device"].get("cuda", 0)),
                     records.format_bytes(m["by_device"].get("cpu", 0)),
                     records.format_bytes(m.get("allocated_at_step_start", 0)),
                     records.format_peak(r, 0),
                     f"{median * 1000:.1f}", f"{median / base:.2f}x"])
    return records.format_table(rows, ["run", "saved on GPU", "saved in host memory", "allocated at step start",
                                       f"peak ({runs[names[0]]['memory']['peak_source']})", "median step ms",
                                       "time vs first"])


def reference_report(name: str = "activation-checkpointing") -> str:
    """Every committed GPU result of this chapter, labelled with its device and date, with what its
    ``cpu_checkpointing`` run moved (:func:`cpu_checkpointing_findings`); or a plain statement that none is."""

    return references.references_report(
        name, lambda runs: gpu_table(runs) + ("\n\n" + cpu_checkpointing_findings(runs) if "deepspeed-cpu" in runs else ""))


# --- exercises: predict what a checkpointed layer keeps, configure DeepSpeed's checkpoint -----------

def exercise_checkpointed_layer_bytes(answer: object, runs: Mapping[str, Any], name: str = "long-torch") -> exercises.Verdict:
    """Exercise: predict the bytes one checkpointed decoder layer of run ``name`` keeps for backward, checked
    against what the ``activations`` probe measured on rank 0 (its last layer)."""
    record = runs[name]
    shape, batch = _shape(record), record["micro_batch"]
    width = theory.bytes_per_element(record["precision"])
    expected = measured(record)["per_layer"][-1]
    formula = batch * shape.seq * shape.hidden * width
    return exercises.number(
        "checkpointed layer bytes", answer, expected, relative=0.01, unit=" bytes",
        task=f"Predict the bytes one checkpointed decoder layer keeps for backward in the run '{name}' "
             f"(micro-batch {batch}, {shape.seq} tokens, hidden {shape.hidden}, {record['precision']}).",
        hint="the tensor that enters the layer, at the run's shape and precision.",
        why=f"the probe measured {expected:,} bytes; b x s x h x {width} = {batch} x {shape.seq} x {shape.hidden} x "
            f"{width} = {formula:,.0f}. Nothing from inside the layer stays, not even the s² softmax: the replay "
            "recomputes it during backward.")


def exercise_host_bytes(answer: object, name: str = "activation-checkpointing") -> exercises.Verdict:
    """Exercise: predict the MiB DeepSpeed's ``cpu_checkpointing`` had in host memory on rank 0 when the backward
    began, in the first committed GPU reference with a ``deepspeed-cpu`` run, checked against its probe."""
    found = [(device, date, runs) for device, date, _, runs in references.reference_runs(name) if "deepspeed-cpu" in runs]
    if not found:
        return exercises.satisfies("cpu_checkpointing in host memory", answer, lambda _: (False, ""),
                                   task=references.no_references(name), hint="")
    device, date, runs = found[0]
    record = runs["deepspeed-cpu"]
    shape = _shape(record)
    expected = measured(record)["by_device"].get("cpu", 0)
    one = layer_formula(record, 0)
    return exercises.number(
        "cpu_checkpointing in host memory", answer, expected / 2**20, relative=0.01, unit=" MiB",
        task=f"In the committed reference of {device} ({date}), the 'deepspeed-cpu' run trained {shape.layers} "
             f"checkpointed decoder layers (micro-batch {record['micro_batch']}, {shape.seq} tokens, hidden "
             f"{shape.hidden}, {record['precision']}) with cpu_checkpointing, which moves checkpointed layers' inputs "
             "to host memory until the backward replays them. Predict the MiB rank 0 had in host memory when the "
             "backward began.",
        hint="what one checkpointed layer keeps (exercise 1), at this run's shape; then think about which layer "
             "the backward replays first, and whether its input has any reason to leave the GPU.",
        why=f"the probe counted {records.format_bytes(expected)} in host memory: {shape.layers - 1} inputs of "
            f"{records.format_bytes(one)} (b x s x h x 4 bytes), every layer's but the newest.")


def exercise_section_bytes(answer: object, runs: Mapping[str, Any]) -> exercises.Verdict:
    """Exercise: predict the bytes rank 0 saves for backward in the 'section-only' run (the plain model, the config's
    ``activation_checkpointing`` section with every setting on) as a fraction of the plain run's, checked against
    the ``activations`` probe."""
    section, plain = measured(runs["section-only"]), measured(runs["plain"])
    same = section["total"] == plain["total"]
    return exercises.number(
        "the section alone", answer, section["total"] / plain["total"], relative=0.01, unit=" of the plain run's bytes",
        task="Predict the bytes rank 0 saves for backward in the 'section-only' run (the plain model, trained with "
             "the config's activation_checkpointing section, every setting on) as a fraction of the plain run's.",
        hint="find, in the script, which call reads the activation_checkpointing section and which function its "
             "settings change; does 'section-only' make that call, and does its model call that function?",
        why=f"the probe measured {section['total']:,} bytes, {'the same as' if same else 'unlike'} the plain run's "
            f"{plain['total']:,}: deepspeed.initialize parses the section but nothing in it acts on it; only "
            "deepspeed.checkpointing.configure reads it, for deepspeed.checkpointing.checkpoint.")


# --- figures ----------------------------------------------------------------------------------------

def activations_vs_sequence(curves: Mapping[str, tuple[Sequence[int], Sequence[float], float]],
                            measured: Mapping[str, tuple[int, float]] | None = None,
                            title: str = "Activations of one micro-batch against model states"):
    """Per model: activation bytes (formula) against sequence length, and its model states as a flat line.

    ``curves``: label -> (sequence lengths, activation bytes, model-state bytes); ``measured``: label ->
    (sequence length, measured activation bytes), drawn as points.
    """
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, (seqs, values, states)) in enumerate(curves.items()):
        colour = colours[i % len(colours)]
        ax.plot(seqs, [v / 2**30 for v in values], color=colour, label=f"{label}: activations (formula)")
        ax.axhline(states / 2**30, color=colour, linestyle="--", linewidth=1, label=f"{label}: model states")
    for label, (seq, value) in (measured or {}).items():
        ax.plot([seq], [value / 2**30], "ko", markersize=5)
        ax.annotate(label, (seq, value / 2**30), textcoords="offset points", xytext=(5, -10), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="GiB", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- formulas ---------------------------------------------------------------------------------------

def activation_bytes_per_layer(batch: int, seq: int, hidden: int, heads: int, intermediate: int,
                               precision: str = "fp32", checkpointed: bool = False) -> dict[str, float]:
    """Bytes one LLaMA decoder layer (transformers' eager attention) keeps for backward, term by term.

    Without checkpointing, per layer, in elements (fp32 training):
    - ``10·b·s·h``: each of the two RMSNorms keeps its input, the normalized input and the weighted
      output (6); attention keeps the rotated queries, the transposed keys, the values and its output
      before ``o_proj`` (4);
    - ``4·b·s·i``: the MLP keeps ``gate_proj``'s output, its SiLU, ``up_proj``'s output and their product;
    - ``a·s²·b``: the softmax probabilities (no dropout, so no mask);
    - ``2·b·s``: each RMSNorm's 1/rms per token.

    In bf16 the norms compute in fp32 (they keep an fp32 copy of their input and fp32 1/rms) and the
    softmax runs in fp32 and is cast back to bf16 (both copies are kept): 24·b·s·h + 8·b·s·i + 6·a·s²·b
    + 8·b·s bytes. With checkpointing a layer keeps only its input, b·s·h elements. The rotary cos and
    sin (:func:`rotary_bytes`) are shared by all layers. Keys: the four terms and ``total``.
    """
    theory.bytes_per_element(precision)  # a clear error for an unknown precision
    bsh, bsi, ass, bs = batch * seq * hidden, batch * seq * intermediate, heads * seq * seq * batch, batch * seq
    width = theory.BYTES_PER_ELEMENT[precision]
    if checkpointed:
        terms = {"b·s·h": width * bsh, "b·s·i": 0, "a·s²·b": 0, "b·s": 0}
    elif precision == "fp32":
        terms = {"b·s·h": 4 * 10 * bsh, "b·s·i": 4 * 4 * bsi, "a·s²·b": 4 * ass, "b·s": 4 * 2 * bs}
    else:  # half precision: what the half tensors keep, plus the fp32 copies of norms and softmax
        terms = {"b·s·h": 2 * 8 * bsh + 4 * 2 * bsh, "b·s·i": 2 * 4 * bsi, "a·s²·b": (2 + 4) * ass, "b·s": 4 * 2 * bs}
    terms["total"] = sum(terms.values())
    return terms


def rotary_bytes(seq: int, head_dim: int, precision: str = "fp32") -> float:
    """The rotary embedding's cos and sin (s x head_dim each), computed once and used by every layer."""
    theory.bytes_per_element(precision)  # a clear error for an unknown precision
    return 2 * seq * head_dim * theory.BYTES_PER_ELEMENT[precision]


def activation_bytes_outside_layers(batch: int, seq: int, hidden: int, vocab: int, precision: str = "fp32") -> float:
    """Floating-point bytes kept for backward outside the decoder layers: the final RMSNorm (as in a layer:
    3·b·s·h, with an fp32 copy in bf16, and b·s fp32), the log-softmax of the fp32 logits (b·s·V, fp32)
    and the loss. The token ids and targets (int64) come on top."""
    theory.bytes_per_element(precision)  # a clear error for an unknown precision
    bsh, bs = batch * seq * hidden, batch * seq
    norm = 4 * 3 * bsh if precision == "fp32" else 2 * 2 * bsh + 4 * bsh
    return norm + 4 * bs + 4 * bs * vocab + 4


def activation_bytes(layers: int, batch: int, seq: int, hidden: int, heads: int, intermediate: int, vocab: int,
                     precision: str = "fp32", checkpointed: bool = False) -> float:
    """Floating-point bytes a whole LLaMA-style model saves for backward in one micro-batch's forward: L
    layers, the rotary cos/sin and the part outside the layers. Checkpointed layers save neither their
    insides nor the cos/sin (their replay closures hold those, 2·s·head_dim elements, uncounted here)."""
    per_layer = activation_bytes_per_layer(batch, seq, hidden, heads, intermediate, precision, checkpointed)["total"]
    rotary = 0 if checkpointed else rotary_bytes(seq, hidden // heads, precision)
    return layers * per_layer + rotary + activation_bytes_outside_layers(batch, seq, hidden, vocab, precision)


def checkpointing_figure(runs: Mapping[str, Any], pairs: Sequence[tuple[str, str]] = (("plain", "torch"),
                                                                                       ("long", "long-torch"))):
    """The chapter's key result: bytes saved for backward in one micro-batch (rank 0), without and with
    checkpointing, split into the decoder layers and what lies outside them; one panel per sequence length."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.4), squeeze=False)
    for ax, names in zip(axes[0], pairs):
        found = [measured(runs[n]) for n in names]
        layers = [sum(m["per_layer"]) / 2**20 for m in found]
        outside = [m["outside"] / 2**20 for m in found]
        labels = ["no checkpointing", "checkpointed"][:len(names)]
        ax.bar(labels, layers, label="in the decoder layers")
        ax.bar(labels, outside, bottom=layers, label="outside the layers", hatch="//")
        ax.set(ylabel="MiB saved for backward", title=f"{models.seq_len_of(runs[names[0]].model_name)} tokens")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Activations kept for backward, rank 0, one micro-batch")
    fig.tight_layout()
    plt.close(fig)
    return fig
