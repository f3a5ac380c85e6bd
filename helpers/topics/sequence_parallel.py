"""Sequence parallelism with DeepSpeed-Ulysses: each rank holds a slice of every sequence, and two
all-to-alls per attention switch the split from tokens to heads and back.

DeepSpeed 0.19.8 ships it for Hugging Face models as ``UlyssesSPAttentionHF``
(``deepspeed.runtime.sequence_parallel.ulysses_sp``, part of Arctic Long Sequence Training):

- :func:`build_model`, a run's builder: the course's LLaMA-style model with transformers' ``sdpa``
  attention;
- :func:`initialize`, a run's ``initialize``: with ``sequence_parallel_size`` above 1 in the config it calls
  ``UlyssesSPAttentionHF.register_with_transformers``, which puts Ulysses' wrapper in place of ``sdpa``
  in transformers' attention table and makes the sequence-parallel groups (the ``mpu``), then
  ``deepspeed.initialize(..., mpu=mpu)``;
- :func:`train_step`, a run's trainer: each rank takes its slice of the tokens (with their global
  ``position_ids``), and the sequence's loss is the mean of the slices' losses, gathered with a
  differentiable all-gather, as DeepSpeed's ALST tutorial does ("Loss averaging",
  https://www.deepspeed.ai/tutorials/ulysses-alst-sequence-parallelism/);
- :func:`rank_code`: the chapter writes these three functions on its page (``runs/12b/ulysses_rank.py``) and
  its launch runs that module; this module's copies serve the unit tests and any caller without a page;
- :func:`findings`: what DeepSpeed and transformers refuse, checked before any process starts;
- the formulas: :func:`all_to_all_calls` (every all-to-all of a step, and its bytes),
  :func:`activation_bytes_per_layer` (chapter 10's formula, with ``sdpa`` in place of eager attention).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import functools
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from helpers.core import configs, ds, environment, exercises, launch, load_guard, models, plots, records, references, theory
from helpers.core.plan import PlannedRun, reference_of
from helpers.core.probes import Probe, RunContext
from helpers.topics import activations, bandwidth, pipeline, tensor_parallel

#: The attention Ulysses wraps here: transformers' ``sdpa`` (eager attention is refused: it needs a full
#: s x s mask that the wrapper cannot pass on).
ATTENTION = "sdpa"
#: transformers' own attention functions, kept the first time Ulysses replaces one, so that every build
#: starts from them (a sweep builds several models in the same processes).
_ORIGINAL_ATTENTION: dict[str, Any] = {}


def _attention_table():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # deferred: slow, and only the ranks need it

    return ALL_ATTENTION_FUNCTIONS


def restore_attention() -> None:
    """Put back the attention functions that Ulysses replaced in transformers' table (a no-op before)."""
    table = _attention_table()
    for key, function in _ORIGINAL_ATTENTION.items():
        table[key] = function


def reset_attention(attention: str = ATTENTION) -> None:
    """Before a model is built: put back what an earlier run's Ulysses replaced in transformers' attention table
    (:func:`restore_attention`) and keep transformers' own ``attention`` function, so that registering Ulysses
    again wraps it, not the previous wrapper (a launch builds several models in the same processes)."""
    restore_attention()
    _ORIGINAL_ATTENTION.setdefault(attention, _attention_table().get(attention))


class RankCode(NamedTuple):
    """The import paths of the three functions the ranks call, in order: a RunSpec's ``builder``,
    ``initialize`` and ``trainer``."""

    builder: str
    initialize: str
    trainer: str


def rank_code(path: str | Path) -> RankCode:
    """The import paths of ``build_model``, ``initialize`` and ``train_step`` in the module the chapter wrote at
    ``path`` (inside the repository, which the ranks import from); the module is made importable here too (the
    launcher imports them to check them)."""
    path = Path(path).resolve()
    try:
        relative = path.relative_to(environment.REPO_ROOT).with_suffix("")
    except ValueError:
        raise ValueError(f"{path}: write the ranks' module inside {environment.REPO_ROOT} (the ranks import from "
                         f"there)") from None
    environment.importable_repository()  # also finds a module written after the first import
    module = ".".join(relative.parts)
    sys.modules.pop(module, None)  # an edited module is read again
    return RankCode(f"{module}:build_model", f"{module}:initialize", f"{module}:train_step")


def check_options(name: str, options: dict) -> None:
    """A clear error, before launch, for a model this builder cannot build or an option it does not take."""
    unknown = set(options) - {"seq", "attention"}
    if unknown:
        raise ValueError(f"model_options {sorted(unknown)}: this builder takes 'seq' (tokens per sample) and "
                         f"'attention' (transformers' attn_implementation)")
    if not models.is_llama(name) or models.llama_parts(name)[1]:
        raise ValueError(f"model {name!r}: sequence parallelism here trains a plain LLaMA-style size "
                         f"({', '.join(models.LLAMA_SHAPES)})")
    seq = options.get("seq")
    if seq is not None and (not isinstance(seq, int) or seq < 1):
        raise ValueError(f"model_options['seq'] = {seq!r}: give the tokens per sample as a positive whole number")


def build_model(name: str, seed: int = 0, config: dict | None = None, seq: int | None = None,
                attention: str = ATTENTION):
    """The LLaMA-style model ``name`` with transformers' ``attention`` (default ``sdpa``), for samples of ``seq``
    tokens (``config`` is the run's, unused: a builder's signature). Ulysses is registered later, by
    :func:`initialize`."""
    from transformers import LlamaForCausalLM  # deferred: slow, and most runs need none

    check_options(name, {"seq": seq} if seq else {})
    reset_attention(attention)
    seq = seq or models.seq_len_of(name)
    model_config = models.llama_config(name)
    model_config._attn_implementation = attention
    model_config.max_position_embeddings = max(model_config.max_position_embeddings, seq)
    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config)


build_model.check_options = check_options


def initialize(model: torch.nn.Module, config: dict, run: PlannedRun):
    """A run's ``initialize``: with ``sequence_parallel_size`` P > 1 in ``config``, register Ulysses with
    transformers for the run's attention and sequence length (its wrapper replaces that attention in
    transformers' table; the returned ``mpu`` holds the sequence-parallel groups), then
    ``deepspeed.initialize(..., mpu=mpu)``. Returns the engine."""
    deepspeed = ds.load()
    UlyssesSPAttentionHF = ds.load("deepspeed.runtime.sequence_parallel.ulysses_sp").UlyssesSPAttentionHF

    size = config.get("sequence_parallel_size", 1)
    mpu = None
    if size > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=run.model_options.get("attention", ATTENTION),
            sequence_parallel_size=size, micro_batch_size=config["train_micro_batch_size_per_gpu"],
            seq_length=run.model_options.get("seq") or models.seq_len_of(run.model), seq_length_is_variable=False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    return engine


def token_slice(seq: int, size: int, rank: int) -> slice:
    """The tokens rank ``rank`` of a sequence-parallel group of ``size`` holds: the ``rank``-th of ``size``
    equal parts of ``seq`` tokens."""
    if seq % size:
        raise ValueError(f"a sequence of {seq} tokens does not split into {size} equal parts: use a multiple of {size}")
    part = seq // size
    return slice(rank * part, (rank + 1) * part)


def train_step(ctx: RunContext, run: PlannedRun, step: int, probes: list[Probe]) -> list[float]:
    """One optimizer step with Ulysses: each micro-step this rank takes its slice of every sample's tokens
    (and their global positions), and the loss of the sequences is the mean of the group's slice losses
    (equal slices: equal weights), gathered with ``torch.distributed.nn.functional.all_gather``, whose
    backward sums every rank's dL/dl_r (1/P each): each rank backpropagates its own slice loss at weight 1, so
    the whole sequence's gradient is the mean of the group's. Without sequence parallelism, the whole samples. With
    ``options["divide_by_group"]``, what goes backward is that loss divided by the group's size (the loss
    reported is not). Returns this rank's micro-batch losses."""
    dist = ds.load("deepspeed.comm")

    engine = ctx.engine
    size = int(getattr(engine, "sequence_parallel_size", 1))
    group = engine.seq_parallel_group if size > 1 else None
    seq = run.model_options.get("seq") or models.seq_len_of(run.model)
    part = token_slice(seq, size, dist.get_rank(group=group) if group is not None else 0)
    losses = []
    for micro_step in range(ctx.grad_accum):
        indices = models.sample_indices(step, micro_step, ctx.dp_rank, ctx.dp_size, ctx.micro_batch, ctx.grad_accum)
        batch = models.make_batch(run.model, indices, run.seed, seq_len=seq)
        positions = torch.arange(seq)[part].expand(len(indices), -1)
        logits = engine(input_ids=batch.inputs[:, part].to(engine.device),
                        position_ids=positions.to(engine.device)).logits
        loss = models.lm_loss(logits, batch.targets[:, part].to(engine.device))
        if group is not None:
            loss = torch.stack(torch.distributed.nn.functional.all_gather(loss, group=group)).mean()
        # DeepSpeed sums the group's gradients (ZeRO divides by the data-parallel size alone): the option
        # divides the loss by the group's size, so that the sum is the whole sequence's gradient
        scale = size if run.options.get("divide_by_group") else 1
        engine.backward(loss / scale)
        for probe in probes:
            probe.after_backward(ctx, step, micro_step)
        engine.step()
        losses.append(loss.item())
    return losses


class GradNorm(Probe):
    """The global gradient norm DeepSpeed computed at each optimizer step (before clipping), on rank 0:
    equal norms say the slices' gradients were combined as one whole sequence's. Section: ``grad_norm``."""

    name = "grad_norm"
    keys = ("grad_norm.per_step",)

    def start(self, ctx: RunContext) -> None:
        self.norms: list[float] = []

    def after_step(self, ctx: RunContext, step: int) -> None:
        norm = ctx.engine.get_global_grad_norm()
        self.norms.append(float(norm) if norm is not None else math.nan)

    def finish(self, ctx: RunContext) -> dict:
        return {"norms": self.norms}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"grad_norm": {"per_step": ranks[0]["norms"]}}


def cap_memory(engine, run: PlannedRun) -> int:
    """``before_training`` hook: on a GPU, let this process use at most ``options["memory_cap_gib"]`` GiB of the
    device (``torch.cuda.set_per_process_memory_fraction``; the whole device without the option), so that
    "fits" means the same on an 80 GB and a 141 GB card. Training starts at step 0."""
    if torch.cuda.is_available():
        cap = run.options.get("memory_cap_gib")
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total) if cap else 1.0)
    return 0


#: This module's copies of the page's three functions (the unit tests' and any caller's without a page).
CODE = RankCode(reference_of(build_model), reference_of(initialize), reference_of(train_step))
CAP_MEMORY = reference_of(cap_memory)
PROBES = ("timing", "model_states", "peak_memory", "comm", activations.Activations, GradNorm)


# --- what DeepSpeed and transformers refuse, before launch ------------------------------------------

#: Rule -> what happens without the check, as DeepSpeed 0.19.8 and transformers answer it.
RULES = {
    "heads": "ValueError from UlyssesSPAttentionHF: 'Attention head count H is not divisible by SP size P'",
    "kv-heads": "ValueError from UlyssesSPAttentionHF: 'KV attention head count ... is not divisible by SP size "
                "... or vice versa'",
    "sequence": "each rank must hold an equal slice: the course's trainer (and DeepSpeed's "
                "UlyssesSPDataLoaderAdapter) refuses a sequence length that the group size does not divide",
    "eager": "ValueError from register_with_transformers: 'eager attn_implementation isn't currently supported by "
             "Ulysses sequence parallelism because it requires a 4D attention_mask'",
}


def findings(config: dict, model: str, world_size: int, seq: int | None = None,
             attention: str = ATTENTION) -> list[configs.Finding]:
    """The course's config checker (:func:`helpers.core.configs.check`, which also refuses a group that does not
    divide the ranks) plus what Ulysses needs of the model:
    heads and key/value heads split evenly over the group, tokens split evenly, not eager attention."""
    found = configs.check(config, world_size)
    size = config.get("sequence_parallel_size", 1)
    if not isinstance(size, int) or size <= 1:
        return found
    shape = models.shape_of(model)
    seq = seq or shape.seq
    if shape.heads % size:
        divisors = [d for d in range(2, shape.heads + 1) if shape.heads % d == 0 and world_size % d == 0]
        found.append(configs.Finding("error", "sequence_parallel_size", f"{size} does not divide the model's "
                                     f"{shape.heads} attention heads ({RULES['heads']})",
                                     f"use one of {divisors or 'none on this many ranks'}"))
    if seq % size:
        found.append(configs.Finding("error", "model_options.seq", f"{seq} tokens do not split into {size} equal "
                                     f"slices ({RULES['sequence']})", f"use a multiple of {size}"))
    if attention == "eager":
        found.append(configs.Finding("error", "attn_implementation", RULES["eager"],
                                     f"use '{ATTENTION}' (or a flash-attention implementation on GPUs)"))
    return sorted(found, key=lambda f: f.severity != "error")


def findings_text(found: Sequence[configs.Finding]) -> str:
    """The findings one per line, errors first ("no finding" when there is none)."""
    return "\n".join(str(f) for f in found) or "no finding"


# --- formulas ---------------------------------------------------------------------------------------

def all_to_all_calls(layers: int, batch: int, seq: int, hidden: int, heads: int, kv_heads: int, size: int,
                     precision: str = "fp32") -> dict[str, tuple[int, float]]:
    """Ulysses' all-to-alls in one micro-step, as {what: (calls, logged bytes each)}.

    Forward, in every decoder layer: the queries, keys and values go from a slice of the tokens with every
    head to every token with ``heads/P`` heads (3 calls), the attention output comes back (1 call).
    Backward sends the gradients of the same tensors the other way (4 calls). Each call's message is one
    rank's tensor, b·(s/P)·(heads·d) elements for queries and output and b·(s/P)·(kv_heads·d) for keys and
    values (d = hidden/heads; with fewer key/value heads than P, each is repeated to P)."""
    theory.bytes_per_element(precision)  # a clear error for an unknown precision
    width, head_dim = theory.BYTES_PER_ELEMENT[precision], hidden // heads
    tokens = batch * (seq // size)
    query = tokens * heads * head_dim * width
    key_value = tokens * max(kv_heads, size) * head_dim * width
    return {"queries and outputs": (4 * layers, query), "keys and values": (4 * layers, key_value)}


def all_to_all_bytes(layers: int, batch: int, seq: int, hidden: int, heads: int, kv_heads: int, size: int,
                     precision: str = "fp32") -> float:
    """Logged bytes of every all-to-all of one micro-step (:func:`all_to_all_calls`)."""
    return sum(n * each for n, each in all_to_all_calls(layers, batch, seq, hidden, heads, kv_heads, size,
                                                          precision).values())


def all_to_all_wire_bytes(layers: int, batch: int, seq: int, hidden: int, heads: int, kv_heads: int, size: int,
                          precision: str = "fp32") -> float:
    """Bytes one rank sends per micro-step: of each message, the (P-1)/P that goes to the other ranks."""
    return all_to_all_bytes(layers, batch, seq, hidden, heads, kv_heads, size, precision) * (size - 1) / size


def activation_bytes_per_layer(batch: int, seq: int, hidden: int, heads: int, intermediate: int,
                               precision: str = "fp32", size: int = 1) -> float:
    """Bytes one decoder layer keeps for backward with ``sdpa`` attention, on each of ``size`` Ulysses ranks:
    chapter 10's formula (:func:`helpers.topics.activations.activation_bytes_per_layer`) without the
    a·s²·b softmax, which ``sdpa`` does not keep, plus the fp32 log-sum-exp per head and token it keeps
    instead. Every term counts tokens of one rank: with Ulysses, s/P of them (the heads it attends over
    see all s tokens, but only heads/P of them: the same count)."""
    if seq % size:
        raise ValueError(f"{seq} tokens do not split into {size} equal slices")
    local = seq // size
    eager = activations.activation_bytes_per_layer(batch, local, hidden, heads, intermediate, precision)
    return eager["total"] - eager["a·s²·b"] + 4 * batch * heads * local


def tensor_parallel_activation_bytes(batch: int, seq: int, hidden: int, heads: int, intermediate: int,
                                     precision: str = "fp32", size: int = 1) -> float:
    """Bytes one decoder layer keeps for backward with ``sdpa`` on each of ``size`` tensor-parallel ranks (AutoTP,
    chapter 12): :func:`activation_bytes_per_layer` with the tensors its split matrices produce divided by
    ``size``: the queries, keys, values and attention output (4·b·s·h), the MLP's four (b·s·i) and the
    log-sum-exp (a/P heads); the two norms' tensors (whole hidden vectors) stay whole on every rank."""
    if heads % size or intermediate % size:
        raise ValueError(f"{size} ranks do not split {heads} heads and an MLP of {intermediate} evenly")
    eager = activations.activation_bytes_per_layer(batch, seq, hidden, heads, intermediate, precision)
    split = 4 * batch * seq * hidden * theory.BYTES_PER_ELEMENT[precision] + eager["b·s·i"] + 4 * batch * heads * seq
    return activation_bytes_per_layer(batch, seq, hidden, heads, intermediate, precision) - split * (1 - 1 / size)


# --- the chapter's experiment (notebooks/12b_sequence_parallelism.ipynb) ---------------------------

#: Probes of the runs that only watch memory as the sequence grows.
MEMORY_PROBES = ("timing", "peak_memory", activations.Activations)
#: Tokens per sample of the runs that grow the sequence (one sample per rank, or one split over the ranks).
GROWING = (256, 1024, 4096)


def _run_spec(config: str, overrides: dict, size: str, steps: int, seq: int | None = None, probes=PROBES,
          code: RankCode = CODE, **kw) -> launch.RunSpec:
    options = {"seq": seq} if seq else {}
    return launch.RunSpec(config, model=size, steps=steps, probes=probes, builder=code.builder,
                          initialize=code.initialize, trainer=code.trainer,
                          overrides=configs.merged(tensor_parallel.SMALL_BUCKETS, overrides),
                          model_options={**options, **kw.pop("model_options", {})}, **kw)


#: The run that measures the comparison's first way (``zero3``) again at the end of the launch.
REPEAT = "zero3-again"


def timed_steps(steps: int) -> int:
    """Steps of a timed run: ``steps``, or more where the warm-up (the first step) would leave fewer measured
    steps than the load guard needs for a spread (:data:`helpers.core.load_guard.MIN_STEPS`)."""
    return max(steps, 1 + load_guard.MIN_STEPS)


def measured_s(record: records.Record) -> list[float]:
    """A run's step times (seconds) after its first, which warms up (caches, allocators, kernels)."""
    return record.timing.all_s[1:]


#: A setting whose updates follow the gradient's scale: no clipping, and AdamW's eps as large as its gradients
#: (Adam's step is g/(sqrt(v) + eps): with a tiny eps it does not depend on the scale of g).
SCALE_SENSITIVE = {"gradient_clipping": 0.0, "optimizer": {"params": {"eps": 1.0}}}
#: The runs whose Ulysses loss goes backward divided by the group's size (the page's ``divide_by_group``).
DIVIDED = ("scale-ulysses-divided", "scale-ulysses-zero3-divided")


def sequence_parallel_runs(size: str = "llama", batch: int = 4, steps: int = 3, growing: Sequence[int] = GROWING,
                           world_size: int | None = None, precision: str = "fp32",
                           code: RankCode = CODE, settings: Mapping[str, dict] | None = None,
                           divided: Sequence[str] = DIVIDED, progress: bool = False) -> dict:
    """One launch on N ranks (ZeRO-1 unless named, no accumulation unless said), every model with ``sdpa``,
    built, wrapped and trained by ``code`` (:class:`RankCode`: the chapter's page, through :func:`rank_code`, or
    this module's :data:`CODE`):

    - ``data-parallel`` and ``ulysses``: the same ``batch`` samples per step, split by samples (batch/N per
      rank) or by tokens (every sample, s/N tokens of it per rank): losses, gradient norms, all-to-alls;
      ``ulysses-zero3`` the same under ZeRO-3;
    - ``scale-<run>``: data parallelism and Ulysses under ZeRO-1 and ZeRO-3 with :data:`SCALE_SENSITIVE`, each
      Ulysses loss as DeepSpeed's ALST tutorial writes it or divided by N (``-divided``), and ZeRO-3 with
      ``reduce_scatter`` off (``-contiguous``, its other reduction path): the gradient's scale;
    - ``one-sequence-<s>`` and ``ulysses-<s>``: one sample of s tokens per rank, or one split over the
      N ranks, for each s of ``growing``: activation memory per rank as the sequence grows;
    - the comparison, N samples per step each way, one sample at a time where the way allows: ``zero3``
      (one sample per rank), ``autotp`` (chapter 12: every rank the same sample, N micro-steps),
      ``pipeline`` (chapter 11: one stage per rank, N micro-batches of one), ``ulysses-compare`` (one sample
      split over the ranks, N micro-steps, with ZeRO-3 for the model states, as Arctic Long Sequence Training runs it);
    - ``ulysses-eager``: Ulysses asked to wrap eager attention (refused by DeepSpeed; recorded);
    - :data:`REPEAT`: ``zero3`` again, last, for the load guard's check that the machine did not change during
      the sweep (:func:`timing_verdict`).

    The comparison runs take :func:`timed_steps` steps: a warm-up and enough measured steps for a spread.

    ``settings`` ({run name: DeepSpeed config keys}, the chapter's page) are merged last into the named runs;
    the runs named in ``divided`` backpropagate the Ulysses loss divided by the group's size (the page's
    ``divide_by_group`` option). Each run's Ulysses constraints are checked first (:func:`findings`). Without
    ``progress`` bars, one line per run as it starts (:func:`announce`). Returns {run name: Record or RunFailed}."""
    world = environment.detect(world_size).default_world_size
    if batch % world:
        raise ValueError(f"batch={batch}: data parallelism needs a multiple of the {world} ranks")
    half = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    sp = {"sequence_parallel_size": world}

    def batches(micro: int, accum: int = 1, **more) -> dict:
        return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum, **half, **more}

    _spec = functools.partial(_run_spec, code=code)

    norms = ("timing", GradNorm)
    specs = {"data-parallel": _spec("zero1", batches(batch // world), size, steps),
             "ulysses": _spec("zero1", batches(batch, **sp), size, steps),
             "ulysses-zero3": _spec("zero3", batches(batch, **sp), size, steps, probes=norms)}
    # the same with a setting whose updates follow the gradient's scale, each loss as the tutorial's or divided by N
    specs.update({
        "scale-data-parallel": _spec("zero1", batches(batch // world, **SCALE_SENSITIVE), size, steps, probes=norms),
        "scale-ulysses": _spec("zero1", batches(batch, **sp, **SCALE_SENSITIVE), size, steps, probes=norms),
        "scale-ulysses-divided": _spec("zero1", batches(batch, **sp, **SCALE_SENSITIVE), size, steps, probes=norms),
        "scale-ulysses-zero3": _spec("zero3", batches(batch, **sp, **SCALE_SENSITIVE), size, steps, probes=norms),
        "scale-ulysses-zero3-divided": _spec("zero3", batches(batch, **sp, **SCALE_SENSITIVE), size, steps,
                                             probes=norms),
        "scale-ulysses-zero3-contiguous": _spec("zero3", batches(batch, **sp, **SCALE_SENSITIVE,
                                                                 zero_optimization={"reduce_scatter": False}),
                                                size, steps, probes=norms)})
    for s in growing:
        specs[f"one-sequence-{s}"] = _spec("zero1", batches(1), size, steps, s, MEMORY_PROBES)
        specs[f"ulysses-{s}"] = _spec("zero1", batches(1, **sp), size, steps, s, MEMORY_PROBES)
    compared = ("timing", "model_states", "peak_memory", "comm")
    timed = timed_steps(steps)
    specs["zero3"] = _spec("zero3", batches(1), size, timed, probes=compared)
    specs["autotp"] = _spec("zero1", batches(1, world, tensor_parallel={"autotp_size": world}), size, timed,
                            probes=(*compared, activations.Activations))
    specs["pipeline"] = launch.RunSpec("zero1", model=size + pipeline.SUFFIX, steps=timed, probes=compared,
                                       builder=pipeline.BUILDER, trainer=pipeline.TRAINER, overrides=batches(1, world))
    specs["ulysses-compare"] = _spec("zero3", batches(1, world, **sp), size, timed, probes=compared)
    specs["ulysses-eager"] = _spec("zero1", batches(batch, **sp), size, 1, probes=(),
                                   model_options={"attention": "eager"}, on_error="record")
    specs[REPEAT] = _spec("zero3", batches(1), size, timed, probes=("timing",))  # the machine, unchanged?
    for name, extra in (settings or {}).items():
        if name not in specs:
            raise ValueError(f"settings for {name!r}: no such run (one of {', '.join(specs)})")
        specs[name] = dataclasses.replace(specs[name], overrides=configs.merged(specs[name].overrides, extra))
    for name in divided:
        if name not in specs:
            raise ValueError(f"divided: {name!r} is no run (one of {', '.join(specs)})")
        specs[name] = dataclasses.replace(specs[name], options={**(specs[name].options or {}), "divide_by_group": True})
    for name, spec in specs.items():
        if spec.builder == code.builder and name != "ulysses-eager":
            _raise_on_errors(spec, world, name)
    return launch.sweep(specs, name=f"sequence-parallel-{size}", world_size=world_size, progress=progress,
                        on_event=None if progress else announce(len(specs)))


def announce(runs: int) -> launch.EventListener:
    """A listener for :func:`helpers.core.launch.sweep` that prints one line as each of its ``runs`` starts."""
    def listen(event: dict) -> None:
        if event["event"] == "run_start":
            print(f"run {event['run'] + 1}/{runs}: {event['name']}", flush=True)
    return listen


def settings_table(runs: Mapping[str, Any], names: Sequence[str]) -> str:
    """The DeepSpeed settings each named run was given, read back from its record's config: group size, ZeRO
    stage, gradient clipping and AdamW's eps (DeepSpeed's default where the config sets none)."""
    rows = []
    for name in names:
        c = runs[name].config
        rows.append([name, c.get("sequence_parallel_size", 1), c.get("zero_optimization", {}).get("stage", 0),
                     c.get("gradient_clipping", 0.0), c.get("optimizer", {}).get("params", {}).get("eps", "default")])
    return records.format_table(rows, ["run", "sequence_parallel_size", "ZeRO stage", "gradient_clipping", "AdamW eps"])


def _raise_on_errors(spec: launch.RunSpec, world: int, name: str) -> None:
    config = configs.merged(configs.load(spec.config), spec.overrides)
    found = findings(config, spec.model, world, (spec.model_options or {}).get("seq"),
                     (spec.model_options or {}).get("attention", ATTENTION))
    if any(f.severity == "error" for f in found):
        raise configs.ConfigError(found, f"run {name!r}")


# --- the GPU measurement: the longest sequence that fits -------------------------------------------

#: Tokens per sample the GPU search tries, and the memory each rank may use there.
FIT_SEQUENCES = (16384, 32768, 65536, 131072)
FIT_CAP_GIB = 20.0


def fit_runs(size: str = "llama-gpu", seqs: Sequence[int] = FIT_SEQUENCES, cap_gib: float = FIT_CAP_GIB,
             steps: int = 3, world_size: int | None = None,
             code: RankCode = CODE) -> tuple[dict, list[str]]:
    """On GPUs: bf16 ZeRO-1 runs of model ``size`` with one sample of each length in ``seqs`` per rank
    (``one-sequence-<s>``) and one sample split over all ranks by Ulysses (``ulysses-<s>``), each rank
    allowed ``cap_gib`` GiB (:func:`cap_memory`): peak memory as the sequence grows, and the longest that
    fits. Runs are ordered by tokens per rank, so those that run out of memory come last; a run after the
    first failure is trained again in a launch of its own (:func:`helpers.core.launch.sweep_retrying`).
    Returns ({run name: Record or RunFailed}, the names trained again)."""
    world = environment.detect(world_size).default_world_size
    half = {"bf16": {"enabled": True}}
    probes = ("timing", "peak_memory", "comm")
    specs = []
    for s in seqs:
        for name, overrides, per_rank in ((f"one-sequence-{s}", {}, s),
                                          (f"ulysses-{s}", {"sequence_parallel_size": world}, s // world)):
            spec = _run_spec("zero1", {**overrides, **half, "train_micro_batch_size_per_gpu": 1,
                                       "gradient_accumulation_steps": 1}, size, steps, s, probes, code=code,
                         name=name, on_error="record", before_training=CAP_MEMORY, options={"memory_cap_gib": cap_gib})
            specs.append((per_rank, s, spec))
    ordered = [spec for _, _, spec in sorted(specs, key=lambda t: (t[0], t[1]))]
    for spec in ordered:
        _raise_on_errors(spec, world, spec.name)
    return launch.sweep_retrying(ordered, name=f"sequence-fit-{size}", world_size=world_size, timeout_each=240)


def out_of_memory(failure: Exception) -> bool:
    """Whether a failed run ran out of GPU memory (torch's OutOfMemoryError, as the rank reported it)."""
    return "OutOfMemoryError" in str(failure) or "out of memory" in str(failure).lower()


def fit_outcomes(runs: Mapping[str, Any]) -> dict:
    """{run name: "fits" or "out of memory" or the error's first line}: the search's answer, kept beside
    its records in the reference (failed runs have no record)."""
    found = {}
    for name, r in runs.items():
        if isinstance(r, Exception):
            found[name] = "out of memory" if out_of_memory(r) else str(r).splitlines()[0][:200]
        else:
            found[name] = "fits"
    return found


def longest_fitting(outcomes: Mapping[str, str], prefix: str) -> tuple[int | None, int | None]:
    """(longest sequence that fitted, shortest that did not) among the runs named ``<prefix>-<s>``."""
    tried = {int(k.rsplit("-", 1)[1]): v for k, v in outcomes.items() if k.rsplit("-", 1)[0] == prefix}
    fits = [s for s, v in tried.items() if v == "fits"]
    fails = [s for s, v in tried.items() if v != "fits"]
    return (max(fits) if fits else None), (min(fails) if fails else None)


# --- what the runs show -------------------------------------------------------------------------------

def _shape_of(record: records.Record) -> models.LlamaShape:
    return models.shape_of(pipeline.base_model(record.model_name) if record.model_name.endswith(pipeline.SUFFIX)
                           else models.llama_parts(record.model_name)[0])


def group_size(record: records.Record) -> int:
    """The run's ``sequence_parallel_size`` (1 without it)."""
    return int(record["config"].get("sequence_parallel_size", 1))


def equality_table(runs: Mapping[str, Any], baseline: str = "data-parallel",
                   others: Sequence[str] = ("ulysses", "ulysses-zero3"), divided: Sequence[str] = DIVIDED) -> str:
    """Each run against ``baseline`` at the same global batch: do the losses agree (within the precision's
    tolerance for reordered sums), and DeepSpeed's gradient norm over the baseline's at the first step (where
    both runs measured it), when both have the same weights: a comparison of the gradients alone. The runs in
    ``divided`` are labelled as backpropagating the loss divided by P."""
    base = runs[baseline]
    rows = []
    for name in others:
        r = runs[name]
        tolerance = records.REORDERED_TOLERANCE[r.precision]
        agreement = records.loss_agreement(r.losses, base.losses, r.precision, tolerance)
        norms = f"{norm_ratio(runs, name, baseline):.3f}" if "grad_norm" in r.probes and "grad_norm" in base.probes \
            else "(not measured)"
        loss = "divided by P" if r.config.get("sequence_parallel_size", 1) > 1 and name in divided else (
            "the tutorial's" if r.config.get("sequence_parallel_size", 1) > 1 else "")
        if r.stage == 3 and r.config.get("zero_optimization", {}).get("reduce_scatter") is False:
            loss += " (reduce_scatter off)"
        rows.append([name, f"ZeRO-{r.stage}", loss, agreement, norms])
    return records.format_table(rows, ["run", "stage", "Ulysses loss", f"losses vs {baseline}",
                                       "gradient norm / baseline's (step 1)"])


SCALE_RUNS = ("scale-ulysses", "scale-ulysses-divided", "scale-ulysses-zero3", "scale-ulysses-zero3-divided",
              "scale-ulysses-zero3-contiguous")


def scale_table(runs: Mapping[str, Any], divided: Sequence[str] = DIVIDED) -> str:
    """:func:`equality_table` of the scale-sensitive runs against their data-parallel run."""
    return equality_table(runs, "scale-data-parallel", SCALE_RUNS, divided)


def equality_sentence(runs: Mapping[str, Any], baseline: str = "data-parallel",
                      others: Sequence[str] = ("ulysses", "ulysses-zero3")) -> str:
    """One line per run of :func:`equality_table`: the same losses as ``baseline`` or not, and whether its first
    gradient norm is the baseline's (within 1e-3) or of another scale, which the losses did not show."""
    base = runs[baseline]
    lines = []
    for name in others:
        r = runs[name]
        same = records.max_loss_difference(r.losses, base.losses) <= records.REORDERED_TOLERANCE[r.precision]
        ratio = norm_ratio(runs, name, baseline)
        losses = "the same losses" if same else "other losses"
        if abs(ratio - 1) < 1e-3:
            lines.append(f"{name} (ZeRO-{r.stage}): {losses} and {baseline}'s gradient norm ({ratio:.3f}x).")
        else:
            lines.append(f"{name} (ZeRO-{r.stage}): {losses}, but a gradient {ratio:.3f}x {baseline}'s: another "
                         f"scale{', which the losses hide' if same else ''} (why: the rule above).")
    return "\n".join(lines)


def scale_findings(runs: Mapping[str, Any], names: Sequence[str] = SCALE_RUNS) -> str:
    """Which scale-sensitive Ulysses runs got data parallelism's gradient (norm ratio at step 1 within 1e-3 of 1
    and the same losses) and which did not, with their ratios."""
    base = runs["scale-data-parallel"]
    right, off = [], []
    for name in names:
        ratio = norm_ratio(runs, name, "scale-data-parallel")
        same = records.max_loss_difference(runs[name].losses, base.losses) <= records.REORDERED_TOLERANCE[base.precision]
        (right if same and abs(ratio - 1) < 1e-3 else off).append(f"{name} ({ratio:.3f}x)")
    return (f"data parallelism's gradient: {', '.join(right) or 'none'}\n"
            f"another scale (and other losses): {', '.join(off) or 'none'}")


def norm_ratio(runs: Mapping[str, Any], name: str = "ulysses", baseline: str = "data-parallel") -> float:
    """Run ``name``'s gradient norm over the baseline's at the first step (the same weights in both runs; later
    steps start from weights their different updates made)."""
    return runs[name].section("grad_norm")["per_step"][0] / runs[baseline].section("grad_norm")["per_step"][0]


def enclosing_functions(source: str) -> list[tuple[int, int, str]]:
    """Every function of the Python ``source`` as (first line, last line, qualified name such as
    ``Class.method``), nested functions included, in the order they start."""
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno or child.lineno, prefix + child.name))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sorted(found)


def function_of(functions: Sequence[tuple[int, int, str]], line: int) -> str:
    """The qualified name of the innermost function of :func:`enclosing_functions` holding ``line``
    (1-based), or ``"(module level)"``."""
    holding = [f for f in functions if f[0] <= line <= f[1]]
    return min(holding, key=lambda f: f[1] - f[0])[2] if holding else "(module level)"


def deepspeed_source_by_function(relative: str, patterns: Sequence[str]) -> str:
    """Lines of DeepSpeed's installed source ``relative`` that match any of ``patterns`` (regular expressions),
    each numbered as in the file and named by the function it is in (its qualified name)."""
    deepspeed = ds.load()
    source = (Path(deepspeed.__file__).parent / relative).read_text()
    functions = enclosing_functions(source)
    shown = [(number, function_of(functions, number), line.strip())
             for number, line in enumerate(source.splitlines(), 1) if any(re.search(p, line) for p in patterns)]
    return "\n".join([f"deepspeed/{relative} (deepspeed {deepspeed.__version__}):"]
                     + [f"{number:5d}  in {name}: {line}" for number, name, line in shown])


def all_to_all_table(record: records.Record, seq: int | None = None) -> str:
    """The run's all-to-alls per optimizer step (DeepSpeed's comms logger, rank 0) against
    :func:`all_to_all_calls` times the micro-steps: calls, bytes each, bytes in all, bytes sent."""
    shape, size, accum = _shape_of(record), group_size(record), record.grad_accum
    seq = seq or shape.seq
    formula = all_to_all_calls(shape.layers, record.micro_batch, seq, shape.hidden, shape.heads, shape.heads, size,
                               record.precision)
    calls = sum(n for n, _ in formula.values()) * accum
    total = sum(n * each for n, each in formula.values()) * accum
    measured = record.comm.by_op.get("all_to_all_single", {"count": 0, "bytes": 0})
    sent = theory.wire_bytes("all_to_all_single", measured["bytes"], size)
    rows = [["measured (comms logger)", f"{measured['count']:g}",
             f"{measured['bytes'] / max(measured['count'], 1):,.0f}", f"{measured['bytes']:,.0f}", f"{sent:,.0f}"],
            ["formula", f"{calls:g}", _bytes_each(formula), f"{total:,.0f}", f"{total * (size - 1) / size:,.0f}"]]
    return records.format_table(rows, ["all-to-alls per step", "calls", "bytes each", "bytes", "sent by a rank"])


def _bytes_each(formula: Mapping[str, tuple[int, float]]) -> str:
    """The formula's bytes per call: one number where every call is the same size (as many key/value heads as
    query heads), else each kind of call named."""
    sizes = {each for _, each in formula.values()}
    if len(sizes) == 1:
        return f"{sizes.pop():,.0f}"
    return "; ".join(f"{what} {each:,.0f}" for what, (_, each) in formula.items())


def all_to_all_agrees(record: records.Record, seq: int | None = None) -> bool:
    """Whether the measured calls and bytes per step equal the formula's exactly."""
    shape, size, accum = _shape_of(record), group_size(record), record.grad_accum
    formula = all_to_all_calls(shape.layers, record.micro_batch, seq or shape.seq, shape.hidden, shape.heads,
                               shape.heads, size, record.precision)
    measured = record.comm.by_op.get("all_to_all_single", {"count": 0, "bytes": 0})
    return (measured["count"] == sum(n for n, _ in formula.values()) * accum
            and measured["bytes"] == sum(n * each for n, each in formula.values()) * accum)


def activation_rows(runs: Mapping[str, Any], growing: Sequence[int] = GROWING) -> list[dict]:
    """For each sequence length: the bytes one decoder layer (layer 1: layer 0 also keeps the rotary tables)
    keeps for backward on rank 0, one sequence per rank against one split by Ulysses, each beside
    :func:`activation_bytes_per_layer`; and the whole forward's bytes (every layer and the rest)."""
    rows = []
    for s in growing:
        whole, split = runs[f"one-sequence-{s}"], runs[f"ulysses-{s}"]
        shape, size = _shape_of(whole), group_size(split)
        a_whole, a_split = (r.section("activations")["per_rank"][0] for r in (whole, split))
        rows.append({
            "seq": s, "size": size,
            "layer": a_whole["per_layer"][-1], "layer_split": a_split["per_layer"][-1],
            "formula": activation_bytes_per_layer(1, s, shape.hidden, shape.heads, shape.intermediate, whole.precision),
            "formula_split": activation_bytes_per_layer(1, s, shape.hidden, shape.heads, shape.intermediate,
                                                        split.precision, size)
            + ulysses_extra_bytes(1, s, shape.hidden, size, split.precision),
            "total": a_whole["total"], "total_split": a_split["total"], "device": whole.device})
    return rows


def ulysses_extra_bytes(batch: int, seq: int, hidden: int, size: int, precision: str = "fp32") -> float:
    """What a layer keeps under Ulysses beyond :func:`activation_bytes_per_layer` at s/P tokens: the attention's
    output twice, once as ``sdpa`` returns it (every token, heads/P heads) and once after the all-to-all
    back (s/P tokens, every head) as ``o_proj``'s input: b·(s/P)·h more elements. Without Ulysses the two
    are one tensor."""
    if size <= 1:
        return 0.0
    return batch * (seq // size) * hidden * theory.BYTES_PER_ELEMENT[precision]


def activation_table(rows: Sequence[dict]) -> str:
    """:func:`activation_rows` as a table."""
    table = [[r["seq"], f"{r['layer']:,}", f"{r['formula']:,.0f}", f"{r['layer_split']:,}", f"{r['formula_split']:,.0f}",
              f"{r['layer_split'] / r['layer']:.3f}", f"{r['total_split'] / r['total']:.3f}"] for r in rows]
    return records.format_table(table, ["tokens", "one layer, whole", "formula", "one layer, Ulysses",
                                        "formula (+ b·(s/P)·h)", "layer ratio", "whole forward ratio"])


def activations_agree(rows: Sequence[dict]) -> bool:
    """Whether every measured layer equals its formula exactly, with and without Ulysses."""
    return all(r["layer"] == r["formula"] and r["layer_split"] == r["formula_split"] for r in rows)


#: What ``sdpa``'s memory-efficient CUDA kernel (the one fp32 training takes) keeps for backward beyond the
#: formula, in each layer: its random-number seed and offset for dropout, two int64 scalars on the host, kept
#: even without dropout (seen on an H200 through ``saved_tensors_hooks``). The CPU kernel keeps none.
SDPA_CUDA_RNG_BYTES = 16


def activation_check(rows: Sequence[dict]) -> str:
    """Measured minus formula for every layer of :func:`activation_rows`, with and without Ulysses, and what the
    difference is: nothing on a CPU; :data:`SDPA_CUDA_RNG_BYTES` on a GPU."""
    differences = sorted({r[m] - r[f] for r in rows for m, f in (("layer", "formula"), ("layer_split", "formula_split"))})
    devices = {r["device"] for r in rows}
    text = (f"measured - formula, every layer, with and without Ulysses ({', '.join(sorted(devices))}): "
            f"{', '.join(f'{d:,.0f}' for d in differences)} bytes")
    if differences == [0]:
        text += ": the formula is exact"
    elif devices == {"cuda"} and differences == [SDPA_CUDA_RNG_BYTES]:
        text += ": sdpa's random-number seed and offset (two int64), which the formula leaves out"
    else:
        text += ": not explained by the formula"
    return text


def tensor_parallel_check(record: records.Record) -> str:
    """The AutoTP run's layer 1 on rank 0 (activations probe) against :func:`tensor_parallel_activation_bytes`,
    and against one whole sequence's layer by :func:`activation_bytes_per_layer`."""
    shape, size = _shape_of(record), record.world_size
    measured = record.section("activations")["per_rank"][0]["per_layer"][-1]
    formula = tensor_parallel_activation_bytes(1, shape.seq, shape.hidden, shape.heads, shape.intermediate,
                                               record.precision, size)
    whole = activation_bytes_per_layer(1, shape.seq, shape.hidden, shape.heads, shape.intermediate, record.precision)
    return (f"AutoTP over {size} ranks, one layer on rank 0: measured {measured:,} bytes, formula {formula:,.0f} "
            f"(measured - formula: {measured - formula:,.0f}), {measured / whole:.3f} of a whole layer's {whole:,.0f}")


# --- which parallelism for which case ------------------------------------------------------------------

#: The ways of splitting the work the comparison sets side by side: run name -> label.
COMPARED = {"zero3": "ZeRO-3 (data parallel)", "autotp": "AutoTP (tensor)", "pipeline": "pipeline (1F1B)",
            "ulysses-compare": "Ulysses (sequence) + ZeRO-3"}


#: The functions of DeepSpeed's ZeRO optimizer that issue its collectives over the data-parallel group (as the
#: comms logger names them): where that group is one rank (AutoTP or a pipeline over all ranks) they move nothing.
ZERO_CALLERS = ("allreduce_bucket", "all_gather_into_tensor_dp_groups", "reduce_scatter_fn", "allgather_fn",
                "get_grad_norm_direct", "_model_parallel_all_reduce")


def zero_group_size(record: records.Record) -> int:
    """Ranks ZeRO's collectives run over: the data-parallel ranks, times the sequence-parallel group (ZeRO
    partitions over both)."""
    return record["data_parallel_size"] * group_size(record)


def sent_bytes_per_step(record: records.Record) -> float:
    """Bytes rank 0 sent per optimizer step: each collective the comms logger saw, by the ring algorithm
    (:func:`helpers.core.theory.wire_bytes`; point-to-point sends once, receives nothing), leaving out ZeRO's
    calls on a group of one rank (the logger logs them; nothing moves)."""
    return sum(theory.wire_bytes(op, row["bytes"], record.world_size) for op, row in _moving(record))


def _moving(record: records.Record) -> list[tuple[str, dict]]:
    """(op, {count, bytes}) per step of each collective that sends something: receives and ZeRO's calls on a
    group of one rank left out."""
    alone = zero_group_size(record) == 1
    return [(op, row) for op, callers in record.comm.by_caller.items() for caller, row in callers.items()
            if not op.startswith("recv") and not (alone and caller in ZERO_CALLERS)]


def calls_sentence(record: records.Record) -> str:
    """What a Ulysses run's collective calls per step (rank 0, those that send: :func:`comparison_rows`' count)
    are: its all-to-alls (8 per layer and micro-step), the ``all_gather`` of the token positions Ulysses' attention
    makes in every layer and micro-step, and the rest (ZeRO's gathers and reductions, the gradient norm's)."""
    moving = _moving(record)
    total = sum(row["count"] for _, row in moving)
    a2a = sum(row["count"] for op, row in moving if op == "all_to_all_single")
    positions = sum(row["count"] for op, row in moving if op == "all_gather")
    shape = _shape_of(record)
    return (f"{COMPARED.get(record.name, record.name)}: {total:g} calls per step = {a2a:g} all-to-alls (8 per layer "
            f"and micro-step: {shape.layers} layers, {record.grad_accum} micro-steps) + {positions:g} all_gathers of "
            f"the token positions (one per layer and micro-step) + {total - a2a - positions:g} of ZeRO-{record.stage} "
            f"(parameters gathered, gradients reduced, the gradient norm)")


def comparison_rows(runs: Mapping[str, Any], names: Mapping[str, str] = COMPARED) -> list[dict]:
    """Per way of splitting, measured on rank 0: collective calls and bytes sent per step (:func:`_moving`),
    model states, step time (median after the warm-up, :func:`measured_s`) and, on GPUs, peak memory."""
    rows = []
    for name, label in names.items():
        r = runs[name]
        rows.append({"run": name, "label": label, "sent": sent_bytes_per_step(r),
                     "calls": sum(row["count"] for _, row in _moving(r)),
                     "states": r.model_state_bytes(0), "step_s": statistics.median(measured_s(r) or r.timing.all_s),
                     "peak": records.format_peak(r, 0) if r.device == "cuda" else None})
    return rows


def prediction_table(runs: Mapping[str, Any], names: Mapping[str, str] = COMPARED) -> str:
    """Bytes rank 0 sent per step in each comparison run (:func:`sent_bytes_per_step`) beside
    :func:`predicted_sent_bytes` for the run's model, tokens, ranks and precision."""
    rows = []
    for name, label in names.items():
        r = runs[name]
        shape = _shape_of(r)
        predicted = predicted_sent_bytes(name, shape, r.params, shape.seq, r.world_size, r.precision)
        sent = sent_bytes_per_step(r)
        rows.append([label, f"{sent:,.0f}", f"{predicted:,.0f}", f"{sent / predicted:.3f}"])
    return records.format_table(rows, ["way of splitting", "sent by rank 0 per step", "formula", "measured / formula"])


def comparison_table(rows: Sequence[dict], timings: bool = False) -> str:
    """:func:`comparison_rows` as a table; step time and GPU peaks only with ``timings`` (a cell nbval ignores)."""
    table = []
    for r in rows:
        row = [r["label"], f"{r['calls']:g}", f"{r['sent']:,.0f}", f"{r['states']:,}"]
        if timings:
            row += [f"{r['step_s'] * 1000:.1f}"] + ([r["peak"]] if r["peak"] is not None else [])
        table.append(row)
    headers = ["way of splitting", "calls/step (that send)", "bytes sent/step", "model states (rank 0)"]
    if timings:
        headers += ["step ms (after warm-up)"] + (["peak (max allocated)"] if rows and rows[0]["peak"] is not None else [])
    return records.format_table(table, headers)


#: What DeepSpeed reduces gradients in under Ulysses unless the config's ``seq_parallel_communication_data_type``
#: says otherwise: the engine takes that key's value as its communication type (``runtime/engine.py``), and its
#: default is fp32 (``runtime/constants.py``, whatever the precision of training).
GRADIENT_COMMUNICATION = "fp32"


def predicted_sent_bytes(way: str, shape: models.LlamaShape, params: int, seq: int, ranks: int,
                         precision: str = "bf16", gradient_precision: str = GRADIENT_COMMUNICATION,
                         regather: bool = False) -> float:
    """Bytes one rank sends per optimizer step of ``ranks`` samples of ``seq`` tokens on ``ranks`` ranks, each
    way taking one sample at a time where it can (as :func:`sequence_parallel_runs`' comparison runs do), by
    the course's formulas:

    - ZeRO-3, one sample per rank: the parameters gathered and the gradients reduce-scattered once
      (:func:`helpers.core.theory.zero3_wire_bytes`), whatever the tokens; with ``regather`` (a model larger
      than ZeRO-3 keeps gathered, :func:`regathers`) the parameters are gathered again for backward: three
      model-sized messages, chapter 13's count;
    - AutoTP, the same sample on every rank, ``ranks`` micro-steps: activations all-reduced in every layer
      (:func:`helpers.topics.tensor_parallel.tensor_parallel_wire_bytes`);
    - pipeline, ``ranks`` micro-batches of one: the first stage sends each micro-batch's output forward, the
      last its gradient back, a middle stage both (b·s·h each, :func:`helpers.topics.pipeline.pipeline_p2p_bytes`);
    - Ulysses with ZeRO-3, one sample split over the ranks, ``ranks`` micro-steps: each, :func:`all_to_all_wire_bytes`,
      the token positions each layer gathers, and ZeRO-3's gather (two with ``regather``) and reduce-scatter
      over all ranks (it gathers the parameters and reduces the gradients in every micro-step), the
      gradients in ``gradient_precision`` (:data:`GRADIENT_COMMUNICATION`)."""
    width = theory.BYTES_PER_ELEMENT[precision]
    ring = theory.ring_factor(ranks)
    gathers = 2 if regather else 1
    if way == "zero3":
        return theory.zero3_wire_bytes(params, ranks, precision) + (gathers - 1) * params * width * ring
    if way == "autotp":
        return ranks * tensor_parallel.tensor_parallel_wire_bytes(shape.layers, 1, seq, shape.hidden, shape.vocab,
                                                                  ranks, precision)
    if way == "pipeline":  # the first and the last stage send one way, a middle stage both
        return ranks * (2 if ranks > 2 else 1) * pipeline.pipeline_p2p_bytes(1, seq, shape.hidden, precision)
    if way in ("ulysses", "ulysses-compare"):
        return sum(ulysses_sent_parts(shape, params, seq, ranks, precision, gradient_precision, regather).values())
    raise ValueError(f"way={way!r}: one of {', '.join(COMPARED)}")


def ulysses_sent_parts(shape: models.LlamaShape, params: int, seq: int, ranks: int, precision: str = "bf16",
                       gradient_precision: str = GRADIENT_COMMUNICATION, regather: bool = False) -> dict[str, float]:
    """:func:`predicted_sent_bytes` of Ulysses with ZeRO-3 by part, per optimizer step of ``ranks`` micro-steps:
    ``all-to-alls`` (:func:`all_to_all_wire_bytes`), ``positions`` (the token positions each layer gathers) and
    ``ZeRO-3`` (its parameter gathers, two with ``regather``, and the gradients' reduce-scatter in
    ``gradient_precision``, every micro-step)."""
    ring, gathers = theory.ring_factor(ranks), 2 if regather else 1
    zero3 = params * (gathers * theory.BYTES_PER_ELEMENT[precision] + theory.BYTES_PER_ELEMENT[gradient_precision]) * ring
    return {"all-to-alls": ranks * all_to_all_wire_bytes(shape.layers, 1, seq, shape.hidden, shape.heads, shape.heads,
                                                         ranks, precision),
            "positions": ranks * shape.layers * (seq // ranks) * POSITION_BYTES * (ranks - 1),
            "ZeRO-3": ranks * zero3}


#: Bytes of one token's position id (int64), which Ulysses' attention gathers from the group in every layer.
POSITION_BYTES = 8
#: DeepSpeed's default ``stage3_max_live_parameters``: ZeRO-3 keeps at most this many gathered parameters, so a
#: larger model is released after forward and gathered again for backward.
LIVE_PARAMETERS = 1_000_000_000


def regathers(params: int, live: int = LIVE_PARAMETERS) -> bool:
    """Whether ZeRO-3 gathers a model of ``params`` parameters again for backward (three model-sized messages
    per micro-step, as chapter 13 counts them): when it is larger than the ``live`` parameters it keeps
    gathered. The chapter's CPU model is far smaller: one gather."""
    return params > live


def what_if_rows(shape: models.LlamaShape, params: int, ranks: int, seqs: Sequence[int], precision: str = "bf16",
                 links: Mapping[str, float] | None = None) -> list[dict]:
    """For each sequence length and way of splitting: bytes each rank sends per step (:func:`predicted_sent_bytes`,
    ZeRO-3 gathering again for backward when :func:`regathers` says so)
    and the seconds that takes on each link (bandwidth only, no overlap: the course's
    :class:`helpers.core.theory.AlphaBeta`), with the memory each rank holds (:func:`memory_rows`)."""
    links = links or {k: bandwidth.LINKS[k] for k in ("25 Gb/s", "NVLink 4")}
    rows = []
    for seq in seqs:
        held = {m["way"]: m for m in memory_rows(shape, params, ranks, seq, precision)}
        for way in COMPARED:
            sent = predicted_sent_bytes(way, shape, params, seq, ranks, precision, regather=regathers(params))
            parts = (ulysses_sent_parts(shape, params, seq, ranks, precision, regather=regathers(params))
                     if way == "ulysses-compare" else {})
            rows.append({"seq": seq, "way": way, "sent": sent, "parts": parts, **held[way],
                         **{link: theory.AlphaBeta.link(bw).seconds(sent) for link, bw in links.items()}})
    return rows


def ulysses_zero3_sentence(rows: Sequence[dict], params: int, ranks: int, precision: str = "bf16",
                           gradient_precision: str = GRADIENT_COMMUNICATION) -> str:
    """Why Ulysses with ZeRO-3 sends more than ZeRO-3 alone at the first length of :func:`what_if_rows`: ZeRO-3
    trains the step's ``ranks`` sequences at once, one per rank, and moves the model once; Ulysses' one group
    trains them one at a time, ``ranks`` micro-steps, each moving the model again (its gradients in
    ``gradient_precision``), plus its all-to-alls and the token positions."""
    seq = rows[0]["seq"]
    zero3, ulysses = (next(r for r in rows if r["seq"] == seq and r["way"] == way)
                      for way in ("zero3", "ulysses-compare"))
    parts, fmt = ulysses["parts"], records.format_bytes
    gathers = "twice (forward, then backward)" if regathers(params) else "once"
    return (f"At {seq:,} tokens Ulysses sends {fmt(ulysses['sent'])} per rank and step against ZeRO-3's "
            f"{fmt(zero3['sent'])}. ZeRO-3 trains the {ranks} sequences at once, one per rank: the parameters "
            f"gathered {gathers} and the {precision} gradients reduce-scattered, once per step. Ulysses' one group of "
            f"{ranks} trains them one at a time, {ranks} micro-steps, each gathering the parameters "
            f"{gathers.split(' (')[0]} and reducing {gradient_precision} gradients: {ranks} x {fmt(parts['ZeRO-3'] / ranks)} = "
            f"{fmt(parts['ZeRO-3'])}; its all-to-alls add {fmt(parts['all-to-alls'])}, the token positions "
            f"{fmt(parts['positions'])}.")


def cheapest(rows: Sequence[dict], key: str) -> dict[int, str]:
    """{sequence length: the way of splitting with the least ``key`` (a link's seconds, "sent", "activations")}."""
    best: dict[int, tuple[float, str]] = {}
    for r in rows:
        if r["seq"] not in best or r[key] < best[r["seq"]][0]:
            best[r["seq"]] = (r[key], r["way"])
    return {seq: way for seq, (_, way) in best.items()}


def what_if_table(rows: Sequence[dict], links: Sequence[str] = ("NVLink 4",), states: bool = False) -> str:
    """:func:`what_if_rows` as a table: one row per sequence length and way; the model states per rank only
    when ``states`` (every way of :func:`memory_rows` divides them alike)."""
    table = [[r["seq"], COMPARED[r["way"]], records.format_bytes(r["sent"]),
              *(f"{r[link] * 1000:,.1f}" for link in links),
              *([records.format_bytes(r["states"])] if states else []),
              records.format_bytes(r["activations"])] for r in rows]
    return records.format_table(table, ["tokens", "way of splitting", "sent per rank per step",
                                        *(f"ms on {link}" for link in links),
                                        *(["model states per rank"] if states else []), "activations per rank"])


def memory_rows(shape: models.LlamaShape, params: int, ranks: int, seq: int, precision: str = "bf16") -> list[dict]:
    """Per way of splitting (as :func:`predicted_sent_bytes` runs them), what each rank holds, by the course's
    formulas: model states in mixed precision (16 bytes per parameter; ZeRO-3, with or without Ulysses, divides
    all of them, AutoTP and the pipeline about all: their replicated norms and embeddings left out) and
    activations: one whole sample through every layer on a ZeRO-3 rank (:func:`activation_bytes_per_layer`);
    every layer with its split matrices' outputs divided by P on an AutoTP rank
    (:func:`tensor_parallel_activation_bytes`); L/P layers with up to P micro-batches of one in flight on the
    first pipeline stage (1F1B), a whole sample's total; every layer at s/P tokens under Ulysses."""
    L, h, a, i = shape.layers, shape.hidden, shape.heads, shape.intermediate
    whole = L * activation_bytes_per_layer(1, seq, h, a, i, precision)
    split = L * (activation_bytes_per_layer(1, seq, h, a, i, precision, ranks)
                 + ulysses_extra_bytes(1, seq, h, ranks, precision))
    states = {"zero3": 16 * params / ranks, "autotp": 16 * params / ranks, "pipeline": 16 * params / ranks,
              "ulysses-compare": 16 * params / ranks}
    tensor = L * tensor_parallel_activation_bytes(1, seq, h, a, i, precision, ranks)
    acts = {"zero3": whole, "autotp": tensor, "pipeline": whole, "ulysses-compare": split}
    return [{"way": way, "states": states[way], "activations": acts[way]} for way in COMPARED]


# --- GPU references ----------------------------------------------------------------------------------

REFERENCE = "sequence-parallel"


def gpu_measurement(world_size: int | None = None, code: RankCode = CODE,
                    settings: Mapping[str, dict] | None = None, divided: Sequence[str] = DIVIDED) -> dict:
    """On a GPU machine: this chapter's runs on ``llama-gpu`` in bf16 (:func:`sequence_parallel_runs`, no
    growing runs) and the search for the longest sequence (:func:`fit_runs`). Returns {run: record} with the
    search's runs as ``fit: <run>`` and its ``fit outcomes``, failed runs left out: what :func:`run_report`
    prints and :func:`keep_reference` keeps."""
    world = environment.detect(world_size).default_world_size
    runs = sequence_parallel_runs(size="llama-gpu", batch=2 * world, steps=4, growing=(), world_size=world_size,
                                  precision="bf16", code=code, settings=settings, divided=divided)
    fits, again = fit_runs(world_size=world_size, code=code)
    return {**{k: v for k, v in runs.items() if not isinstance(v, Exception)},
            **{f"fit: {k}": v for k, v in fits.items() if not isinstance(v, Exception)},
            "fit outcomes": {"outcomes": fit_outcomes(fits), "cap_gib": FIT_CAP_GIB, "trained again": again,
                             "sequences": list(FIT_SEQUENCES)}}


#: The entry of a reference that keeps the load recorded beside its launch (:func:`keep_reference`).
LOAD_KEY = "load beside the run"


def keep_reference(runs: Mapping[str, Any], load: load_guard.Load | None) -> Path | None:
    """Keep :func:`gpu_measurement`'s ``runs`` and the ``load`` the page's watch recorded beside them as the
    reference ``sequence-parallel`` (:func:`helpers.core.references.save_reference`); None on CPU."""
    kept = {**runs, **({LOAD_KEY: dataclasses.asdict(load)} if load is not None else {})}
    world = next(r.world_size for r in runs.values() if isinstance(r, records.Record))
    return references.save_reference(REFERENCE, kept, note=f"llama-gpu, bf16, {world} ranks; the search capped each "
                                                           f"rank at {FIT_CAP_GIB:g} GiB")


def fit_table(runs: Mapping[str, Any]) -> str:
    """The GPU search (``fit: <run>`` records and the ``fit outcomes`` of a reference): per run, tokens per
    rank, outcome, peak memory (rank 0) and all-to-all bytes per step against the formula."""
    found = runs["fit outcomes"]
    ranks = next(r.world_size for k, r in runs.items() if k.startswith("fit: "))
    rows = []
    for name, outcome in sorted(found["outcomes"].items(), key=lambda kv: (kv[0].split("-")[0], int(kv[0].rsplit("-", 1)[1]))):
        seq = int(name.rsplit("-", 1)[1])
        r = runs.get(f"fit: {name}")
        size = group_size(r) if r is not None else (1 if name.startswith("one") else ranks)
        per_rank = seq // size
        peak = records.format_peak(r, 0) if r is not None else "-"
        a2a = "-"
        if r is not None and size and size > 1:
            shape = _shape_of(r)
            formula = all_to_all_bytes(shape.layers, 1, seq, shape.hidden, shape.heads, shape.heads, size, r.precision)
            measured = r.comm.by_op.get("all_to_all_single", {}).get("bytes", 0)
            a2a = f"{measured:,.0f} ({'= formula' if measured == formula * r.grad_accum else f'formula {formula:,.0f}'})"
        rows.append([name, per_rank, outcome, peak, a2a])
    return records.format_table(rows, ["run", "tokens per rank", f"within {found['cap_gib']:g} GiB", "peak (rank 0)",
                                       "all-to-all bytes/step"])


def fit_sentence(runs: Mapping[str, Any]) -> str:
    """The search's answer in one sentence: the longest sequence that fitted each way (and the first that did not)."""
    found = runs["fit outcomes"]["outcomes"]
    ranks = next(r.world_size for k, r in runs.items() if k.startswith("fit: "))
    parts = []
    for prefix, label in (("one-sequence", "one sequence per GPU"), ("ulysses", f"Ulysses over {ranks} GPUs")):
        fits, fails = longest_fitting(found, prefix)
        parts.append(f"{label}: {fits:,} tokens fit" if fits else f"{label}: none of the lengths fit")
        if fails:
            parts[-1] += f", {fails:,} did not"
    return "; ".join(parts) + f" (each GPU capped at {runs['fit outcomes']['cap_gib']:g} GiB)."


def timing_verdict(runs: Mapping[str, Any], load: load_guard.Load | None, run: str = "ulysses-compare",
                   baseline: str = "zero3", again: str = REPEAT) -> str:
    """The course's load guard (:func:`helpers.core.load_guard.compare`) on ``run``'s step times against
    ``baseline``'s, each after its warm-up step (:func:`measured_s`), with ``baseline`` measured ``again`` at the
    end of the launch as the sweep's repeat: a verdict only where ``load`` says the launch had its devices to
    itself, the repeat stayed within the spread (a launch without it is withheld) and the difference of the
    medians exceeds the spread of the measured steps; otherwise withheld, with the reason."""
    label, other = COMPARED.get(run, run), COMPARED.get(baseline, baseline)
    repeat = measured_s(runs[again]) if again in runs else None
    verdict = load_guard.compare({other: measured_s(runs[baseline]), label: measured_s(runs[run])}, load,
                                 repeat=repeat, sweep=True)
    head = (f"step time after the warm-up, {label} against {other}: {verdict.medians[1] * 1000:,.0f} ms against "
            f"{verdict.medians[0] * 1000:,.0f} ms (medians of {len(measured_s(runs[run]))} and "
            f"{len(measured_s(runs[baseline]))} steps), steps spread by up to {verdict.spread:.0%}")
    if not verdict.given:
        return f"{head}: verdict withheld: {verdict.withheld}"
    return (f"{head}: {label} was {'slower' if verdict.change[1] > 0 else 'faster'} here, "
            f"{verdict.ratio:.2f}x, more than the spread")


def _report_body(runs: Mapping[str, Any], load: load_guard.Load | None, divided: Sequence[str] = DIVIDED) -> str:
    """The GPU results of one launch: losses and gradient scales against data parallelism, the all-to-alls and
    each way's bytes against their formulas, the comparison with timings and its :func:`timing_verdict` under
    ``load``, and the longest-sequence search; the runs in ``divided`` labelled as such (:func:`equality_table`)."""
    body = "\n".join([equality_table(runs, divided=divided), scale_table(runs, divided), scale_findings(runs),
                      all_to_all_table(runs["ulysses"]), prediction_table(runs),
                      comparison_table(comparison_rows(runs), timings=True), timing_verdict(runs, load),
                      fit_table(runs), fit_sentence(runs)])
    return body.replace(records.PEAK_NOTE, "<= : an upper bound (see How this was measured)")


def run_report(runs: Mapping[str, Any], load: load_guard.Load | None, kept: Path | None = None,
               divided: Sequence[str] = DIVIDED) -> str:
    """This launch's GPU results (:func:`gpu_measurement`), labelled as this run with its devices and the
    ``load`` recorded beside it, and where they were ``kept``."""
    first = next(r for r in runs.values() if isinstance(r, records.Record))
    device = f"{first.world_size} x {first.device_name}"
    where = f"; kept as {kept}" if kept else ""
    return (f"THIS RUN, {device}, {datetime.date.today().isoformat()}{where}\n"
            f"{load.describe() if load is not None else 'Load beside the run: not recorded.'}\n"
            f"{_report_body(runs, load, divided)}")


def reference_report(name: str = REFERENCE) -> str:
    """Every committed GPU result of this chapter, each labelled "committed reference (device, date)" with its
    conditions, its results as :func:`run_report` prints a run's, and its timing verdict by the same rules: under
    the load recorded beside it where the reference kept one (:data:`LOAD_KEY`), else under its written
    conditions (:meth:`~helpers.core.load_guard.Load.from_conditions`); or a plain statement that none is.
    Peaks that may include earlier runs are marked ``<=`` (:data:`helpers.core.records.PEAK_NOTE`, printed in
    the chapter's closing section)."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, "")
    blocks = []
    for (device, date, note, runs), conditions in zip(found, references.reference_conditions(name)):
        load = (load_guard.Load.from_dict(runs[LOAD_KEY]) if LOAD_KEY in runs
                else load_guard.Load.from_conditions(conditions))
        blocks.append(f"COMMITTED REFERENCE ({device}, {date}; {note}):\nConditions: {conditions}\n"
                      f"{_report_body(runs, load)}")
    return "\n\n".join(blocks)


# --- figures -----------------------------------------------------------------------------------------

def layout_figure(ranks: int = 2, tokens: int = 8, heads: int = 4):
    """Who holds what around Ulysses' attention, one square per (token, head), coloured by the rank that holds
    it: before the all-to-all each rank holds a slice of the tokens with every head; after it, every token of
    heads/P heads; the second all-to-all goes back."""
    plt = plots.pyplot()
    from matplotlib.colors import ListedColormap  # deferred: with pyplot

    colours = ListedColormap(["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"][:ranks])
    by_tokens = [[t * ranks // tokens for _ in range(heads)] for t in range(tokens)]
    by_heads = [[h * ranks // heads for h in range(heads)] for _ in range(tokens)]
    fig, axes = plt.subplots(1, 3, figsize=(8.4, 3.0), gridspec_kw={"width_ratios": [1, 0.35, 1]})
    for ax, grid, title in ((axes[0], by_tokens, "q, k, v: rank r holds tokens\nr·s/P..(r+1)·s/P, every head"),
                            (axes[2], by_heads, "attention: rank r holds every token\nof heads r·a/P..(r+1)·a/P")):
        ax.imshow(grid, cmap=colours, vmin=-0.5, vmax=ranks - 0.5, aspect="auto")
        ax.set(xticks=range(heads), yticks=range(tokens), xlabel="head", ylabel="token", title=title)
        ax.title.set_fontsize(8)
    axes[1].axis("off")
    axes[1].annotate("", xy=(1, 0.6), xytext=(0, 0.6), arrowprops={"arrowstyle": "->", "lw": 2})
    axes[1].annotate("", xy=(0, 0.4), xytext=(1, 0.4), arrowprops={"arrowstyle": "->", "lw": 2})
    axes[1].text(0.5, 0.68, "all-to-all\n(q, k, v)", ha="center", fontsize=8)
    axes[1].text(0.5, 0.22, "all-to-all\n(output)", ha="center", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r)) for r in range(ranks)]
    fig.legend(handles, [f"rank {r}" for r in range(ranks)], loc="lower center", ncol=ranks, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    plt.close(fig)
    return fig


def key_figure(rows: Sequence[dict]):
    """The chapter's key result: bytes one decoder layer keeps for backward on a rank, one whole sequence
    against one split by Ulysses, as the sequence grows: measured (points) and :func:`activation_bytes_per_layer`
    (lines)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    seqs = [r["seq"] for r in rows]
    size = rows[0]["size"]
    ax.plot(seqs, [r["formula"] / 2**20 for r in rows], "-", color="#4c72b0", label="one sequence per rank (formula)")
    ax.plot(seqs, [r["layer"] / 2**20 for r in rows], "o", color="#4c72b0", label="measured")
    ax.plot(seqs, [r["formula_split"] / 2**20 for r in rows], "-", color="#dd8452",
            label=f"one sequence over {size} ranks, Ulysses (formula)")
    ax.plot(seqs, [r["layer_split"] / 2**20 for r in rows], "o", color="#dd8452", label="measured")
    ax.set(xscale="log", yscale="log", xlabel="tokens per sequence", ylabel="MiB per rank, one decoder layer",
           title="Activations one layer keeps for backward")
    ax.set_xticks(seqs, [f"{s:,}" for s in seqs])  # the measured lengths only: no crowded log-scale labels
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


def what_if_figure(rows: Sequence[dict], link: str = "NVLink 4", title: str | None = None):
    """Per way of splitting, against tokens per sequence: bytes sent per rank and step (left) and activations
    per rank (right), from :func:`what_if_rows`."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.8))
    # lines that coincide (ZeRO-3's and the pipeline's activations) stay visible: wide and solid under thin and dashed
    styles = {"zero3": {"lw": 4.0, "alpha": 0.5}, "autotp": {"lw": 1.5, "marker": "s"},
              "pipeline": {"lw": 1.5, "ls": "--", "marker": "^"}, "ulysses-compare": {"lw": 1.5, "marker": "o"}}
    for way, label in COMPARED.items():
        mine = [r for r in rows if r["way"] == way]
        for ax, key in ((axes[0], "sent"), (axes[1], "activations")):
            ax.plot([r["seq"] for r in mine], [r[key] / 2**30 for r in mine], label=label, markersize=4,
                    **styles.get(way, {}))
    seqs = sorted({r["seq"] for r in rows})
    axes[0].set(ylabel="GiB sent per rank and step", title=title or "Communication")
    axes[1].set(ylabel="GiB of activations per rank", title="Activation memory")
    for ax in axes:
        ax.set(xscale="log", yscale="log", xlabel="tokens per sequence")
        ax.set_xticks(seqs, [f"{s:,}" for s in seqs])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- exercises ----------------------------------------------------------------------------------------

def exercise_all_to_all_bytes(answer: object, record: records.Record) -> exercises.Verdict:
    """Exercise: predict the bytes of every all-to-all of one optimizer step of the run (as DeepSpeed's comms
    logger records them); checked against what it recorded."""
    measured = record.comm.by_op.get("all_to_all_single", {"bytes": 0})["bytes"]
    shape = _shape_of(record)
    return exercises.number(
        "all-to-all bytes", answer, measured, relative=0.001,
        task=(f"Predict the bytes of all the all-to-alls of one optimizer step of the '{record.name}' run "
              f"({shape.layers} layers, hidden {shape.hidden}, micro-batch {record.micro_batch}, "
              f"{record.grad_accum} micro-step(s), {shape.seq} tokens, {group_size(record)} ranks, {record.precision})."),
        hint="the quantity is what the logger records per call, one rank's whole tensor; the formula is the "
             "section's count of all-to-alls per layer and its message size, b·(s/P)·(a·d) values",
        why="DeepSpeed's comms logger recorded exactly that: 8 per layer and micro-step, each b·(s/P)·h elements.")


def ulysses_config_test(world_size: int, model: str, seq: int, samples: int, stage: int = 3) -> Any:
    """The test of :func:`exercise_ulysses_config`: the config passes :func:`findings` on ``world_size`` ranks,
    uses ZeRO ``stage``, splits each sequence over the largest group the model's heads and the ranks allow,
    and its optimizer steps train on ``samples`` samples."""
    heads = models.shape_of(model).heads
    largest = max(d for d in range(1, world_size + 1) if world_size % d == 0 and heads % d == 0 and seq % d == 0)

    def test(config: Any) -> tuple[bool, str]:
        if not isinstance(config, dict):
            return False, f"{type(config).__name__} is not a config: write a dict"
        errors = [f for f in findings(config, model, world_size, seq) if f.severity == "error"]
        if errors:
            return False, "the checker refuses it:\n" + findings_text(errors)
        size = config.get("sequence_parallel_size", 1)
        if config.get("zero_optimization", {}).get("stage", 0) != stage:
            return False, f"zero_optimization.stage: the task asks for ZeRO-{stage}"
        if size != largest:
            return False, f"sequence_parallel_size {size} is allowed, but not the largest group this model allows here"
        micro = config.get("train_micro_batch_size_per_gpu")
        accum = config.get("gradient_accumulation_steps", 1)
        train = config.get("train_batch_size")
        groups = world_size // size
        steps_samples = train if train is not None else (micro or 0) * accum * groups
        if steps_samples != samples:
            return False, (f"an optimizer step would train on {steps_samples} samples ({groups} groups read different "
                           f"samples), not {samples}")
        return True, (f"sequence_parallel_size {size}: {heads} heads / {size} = {heads // size} per rank, "
                      f"{seq} tokens / {size} = {seq // size} per rank, {groups} groups x {samples // groups} "
                      f"samples = {samples} per step, ZeRO-{stage}; the checker and DeepSpeed's parser accept it.")
    return test


def exercise_ulysses_config(answer: object, world_size: int = 24, model: str = "llama-medium", seq: int = 5000,
                            samples: int = 48, stage: int = 3) -> exercises.Verdict:
    """Exercise: write the DeepSpeed config that splits each sequence over the largest Ulysses group the model
    allows on ``world_size`` GPUs, under ZeRO ``stage``, with ``samples`` samples per optimizer step."""
    shape = models.shape_of(model)
    return exercises.satisfies(
        "Ulysses config", answer, ulysses_config_test(world_size, model, seq, samples, stage),
        task=(f"Write the DeepSpeed config (a dict: batch keys, sequence_parallel_size, an optimizer, ZeRO-{stage}) for "
              f"{world_size} GPUs training '{model}' ({shape.heads} heads) on sequences of {seq:,} tokens, split over "
              f"the largest Ulysses group it allows, {samples} samples per optimizer step. The length is no config "
              f"key (register_with_transformers takes it as seq_length); the check is told it."),
        hint="list the group sizes each of the three constraints of 'What DeepSpeed refuses' allows, keep the "
             "largest they share; then the batch arithmetic of that section")


def exercise_layer_bytes(answer: object, runs: Mapping[str, Any], seq: int = 4096) -> exercises.Verdict:
    """Exercise: predict the bytes one decoder layer keeps for backward on a Ulysses rank at ``seq`` tokens;
    checked against the run's activations probe."""
    r = runs[f"ulysses-{seq}"]
    measured = r.section("activations")["per_rank"][0]["per_layer"][-1]
    shape = _shape_of(r)

    def test(value: Any) -> tuple[bool, str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False, f"{value!r} is not a number: write your answer as one (e.g. 1024 or 2.5e6)."
        if math.isclose(value, measured, rel_tol=0.001):
            return True, f"{measured:,} bytes: the activations probe counted exactly that on rank 0."
        return False, f"{value:,.0f} bytes is not within 0.1% of what the probe counted."
    return exercises.satisfies(
        "Ulysses layer bytes", answer, test,
        task=(f"Predict the bytes decoder layer 1 keeps for backward on rank 0 of 'ulysses-{seq}' (one sequence of "
              f"{seq:,} tokens over {group_size(r)} ranks; hidden {shape.hidden}, {shape.heads} heads, MLP "
              f"{shape.intermediate}, {r.precision})."),
        hint=f"the section's formula, every term counted at the tokens one rank holds, times the bytes of "
             f"{r.precision}; remember the term Ulysses adds")


#: The source article's model, LLaMA-7B's shape (hidden 4096, 32 layers and heads, MLP 11008, 32k vocabulary).
ARTICLE_SHAPE = models.LlamaShape(hidden=4096, layers=32, heads=32, intermediate=11008, seq=4096, vocab=32000)
#: The sequence lengths of the what-if comparison.
WHAT_IF_SEQUENCES = (4096, 65536)


def what_if_sentence(rows: Sequence[dict], link: str = "NVLink 4", gpu_bytes: float = 80 * 2**30) -> str:
    """Which way sends the fewest bytes, which holds the fewest activations per rank, and which fit model states
    and activations in ``gpu_bytes`` per GPU (an 80 GiB card by default), at each sequence length of
    :func:`what_if_rows`, one sentence each."""
    sends, holds = cheapest(rows, link), cheapest(rows, "activations")
    def runs_of(best: Mapping[int, str]) -> str:
        return "; ".join(f"{seq:,} tokens: {COMPARED[way]}" for seq, way in best.items())
    fits = {}
    for r in rows:
        if r["states"] + r["activations"] <= gpu_bytes:
            fits.setdefault(r["seq"], []).append(COMPARED[r["way"]])
    within = "; ".join(f"{seq:,} tokens: {', '.join(fits.get(seq, [])) or 'none'}" for seq in sends)
    return (f"Fewest bytes sent per step: {runs_of(sends)}.\nFewest activations per rank: {runs_of(holds)}.\n"
            f"Model states and activations within {records.format_bytes(gpu_bytes)} per GPU: {within}.")
