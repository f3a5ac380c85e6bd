"""The models and data every run trains on, built the same way in a notebook and on every rank.

Models (all seeded, random weights, no downloads):

- ``linear``: the source article's ``nn.Linear(10, 10)`` (110 parameters).
- ``mlp``: eight equal 256-wide layers (526,336 parameters), big enough that ZeRO's partitions
  dwarf its alignment padding.
- ``llama``: a small LLaMA-style causal language model built from a ``transformers`` config.
- ``mlp_wide``: the ``mlp`` with 4096-wide layers (134,250,496 parameters), for the GPU measurements of
  the offload and precision chapters, where a step must be long enough to time and states large enough
  to weigh.
- ``llama-long`` (the same, 512-token sequences) and ``llama-gpu`` (hidden 1024, 8 layers, 1024 tokens,
  for GPUs), each also trained two more ways by a name suffix: ``-ckpt`` (transformers' activation
  checkpointing) and ``-dsckpt`` (``deepspeed.checkpointing.checkpoint`` around each decoder layer).
  Every variant of one size starts from the same weights.

Topics build other models from these (chapter 11's pipeline stages, :mod:`helpers.topics.pipeline`;
the capstone's sized LLaMA, :mod:`helpers.topics.capstone`) and name their builder in the run.
- ``llama-medium``: the same architecture at hidden 768 and 12 layers, for runs on GPUs.
- ``llama-265m``: a LLaMA-style model of 265M parameters for GPUs (hidden 1024, 16 layers, 32k vocabulary,
  sequence 1024), the shape of the GPU measurement in the course's notes; too slow for CPU ranks.

Data is a pure function of (sample index, seed), so the single-process baseline and every
rank of every ZeRO stage see exactly the same samples: see :func:`sample_indices`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
from torch import nn

from helpers.core import ds

LINEAR_SAMPLES = 100  # the source article's TensorDataset has 100 rows
MLP_WIDTH, MLP_BLOCKS = 256, 8
LM_SEQ_LEN = 64  # the sequence length of ``llama``
LM_VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The sizes of one LLaMA-style model: hidden width, decoder layers, attention heads, MLP width, tokens."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    seq: int
    vocab: int = LM_VOCAB  # the corpus is bytes: token ids stay below 256 even with a larger vocabulary
    attention: str = "eager"

    def describe(self) -> str:
        vocabulary = "byte vocabulary" if self.vocab == LM_VOCAB else f"{self.vocab:,}-token vocabulary"
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads, MLP {self.intermediate}, "
                f"{self.seq} tokens, {vocabulary}")


#: The LLaMA-style sizes: the course's small model, the same with long sequences, and one for GPUs.
LLAMA_SHAPES = {
    "llama": LlamaShape(hidden=64, layers=2, heads=4, intermediate=172, seq=LM_SEQ_LEN),
    "llama-long": LlamaShape(hidden=64, layers=2, heads=4, intermediate=172, seq=512),
    "llama-gpu": LlamaShape(hidden=1024, layers=8, heads=16, intermediate=2816, seq=1024),
    "llama-medium": LlamaShape(hidden=768, layers=12, heads=12, intermediate=2048, seq=LM_SEQ_LEN),
    # the shape of the 265M GPU measurement in the course's notes (LLaMA's MLP width, 8/3 of hidden)
    "llama-265m": LlamaShape(hidden=1024, layers=16, heads=16, intermediate=2688, seq=1024, vocab=32000,
                             attention="sdpa"),
}
#: Name suffix -> how that LLaMA-style model is trained (see the module docstring).
LLAMA_VARIANTS = {
    "": "",
    "-ckpt": ", activation checkpointing by transformers (torch.utils.checkpoint)",
    "-dsckpt": ", activation checkpointing by deepspeed.checkpointing.checkpoint",
}

#: Name -> (short description) of the models a run can use.
MODELS = {
    "linear": "nn.Linear(10, 10), the source article's model",
    "mlp": "MLP of 8 blocks Linear(256, 256) + GELU (526,336 parameters)",
    **{base + suffix: f"LLaMA-style causal LM ({shape.describe()}){how}"
       for base, shape in LLAMA_SHAPES.items() for suffix, how in LLAMA_VARIANTS.items()},
    "gpt2": "GPT-2-style causal LM (hidden 64, 2 layers, 4 heads, 64 tokens, byte vocabulary)",
    "mlp_wide": "MLP of 8 blocks Linear(4096, 4096) + GELU (134,250,496 parameters), for GPUs",
}


WIDE_MLP_WIDTH = 4096
#: Regression models: name -> width of their layers (and of their data).
REGRESSION_WIDTH = {"linear": 10, "mlp": MLP_WIDTH, "mlp_wide": WIDE_MLP_WIDTH}

def llama_parts(name: str) -> tuple[str, str]:
    """``"llama-long-ckpt"`` -> ``("llama-long", "-ckpt")``: the size and the variant of a LLaMA-style name."""
    check_model_name(name)
    for base in sorted(LLAMA_SHAPES, key=len, reverse=True):
        suffix = name[len(base):]
        if name.startswith(base) and suffix in LLAMA_VARIANTS:
            return base, suffix
    raise ValueError(f"model {name!r} is not a LLaMA-style model")


def is_llama(name: str) -> bool:
    """True for the LLaMA-style models of :data:`LLAMA_SHAPES` (all sizes and variants)."""
    check_model_name(name)
    return any(name == base + suffix for base in LLAMA_SHAPES for suffix in LLAMA_VARIANTS)


def is_language_model(name: str) -> bool:
    """True for the models that predict the next token of text (LLaMA-style, GPT-2-style)."""
    return is_llama(name) or name == "gpt2"


def shape_of(name: str) -> LlamaShape:
    """The sizes of a LLaMA-style model ``name``, or of a topic's model built on one and named after it
    (``"llama-gpu-pipe"``: chapter 11's pipeline stages of ``llama-gpu``)."""
    bases = [base for base in LLAMA_SHAPES if name == base or name.startswith(base + "-")]
    if not bases:
        check_model_name(name)
        raise ValueError(f"model {name!r} is not a LLaMA-style model")
    return LLAMA_SHAPES[max(bases, key=len)]


def seq_len_of(name: str) -> int:
    """Tokens per sample of a language model ``name``."""
    return shape_of(name).seq if is_llama(name) else LM_SEQ_LEN


def check_model_options(name: str, options: dict) -> None:
    """Raise a ValueError when ``options`` are given: the course's models take none (a topic's own
    builder, named in the run, checks its own: see :class:`helpers.core.launch.RunSpec`)."""
    if options:
        raise ValueError(f"model {name!r} takes no model_options (got {sorted(options)}); a model that takes "
                         "options is built by its topic's builder, named with builder=")


def check_model_name(name: str) -> None:
    """Raise a ValueError naming the choices when ``name`` is not a course model."""
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of the course's models: choose one of {', '.join(MODELS)}")


def llama_config(name: str = "llama"):
    """The ``transformers`` config of the LLaMA-style model ``name`` (default: the course's small one)."""
    from transformers import LlamaConfig  # deferred: slow, and most runs need none

    shape = shape_of(name)
    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=shape.seq,
        tie_word_embeddings=False,
        attn_implementation=shape.attention,
        use_cache=False,  # training: no key/value cache
    )


def sequence_length(name: str) -> int:
    """Tokens per sample of a language model (1 for the regression models)."""
    return seq_len_of(name) if is_language_model(name) else 1


def parameters_of(name: str) -> int:
    """Parameters of model ``name``, counted on PyTorch's meta device (no memory, no weights)."""
    check_model_name(name)
    with torch.device("meta"):
        return count_parameters(build(name))


def build(name: str, seed: int = 0, config: dict | None = None, **options) -> nn.Module:
    """Build model ``name`` with weights drawn from ``torch.manual_seed(seed)``.

    ``config`` is the run's DeepSpeed config (the ranks pass it): a ``-dsckpt`` model hands it to
    ``deepspeed.checkpointing.configure``, the call that applies its ``activation_checkpointing`` block
    (``deepspeed.initialize`` does not). The course's models take no ``options``.
    """
    check_model_name(name)
    check_model_options(name, options)
    torch.manual_seed(seed)
    if name == "linear":
        return nn.Linear(10, 10)
    if name in ("mlp", "mlp_wide"):
        # Equal blocks, so a partition boundary between ranks falls between whole layers.
        width = REGRESSION_WIDTH[name]
        layers: list[nn.Module] = []
        for i in range(MLP_BLOCKS):
            layers.append(nn.Linear(width, width))
            if i < MLP_BLOCKS - 1:
                layers.append(nn.GELU())
        return nn.Sequential(*layers)
    if name == "gpt2":
        from transformers import (  # deferred: slow, and most runs need none
            GPT2Config,
            GPT2LMHeadModel,
        )

        return GPT2LMHeadModel(GPT2Config(vocab_size=LM_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=LM_SEQ_LEN,
                                          attn_implementation="eager", use_cache=False))
    from transformers import LlamaForCausalLM  # deferred: slow, and most runs need none

    base, variant = llama_parts(name)
    model = LlamaForCausalLM(llama_config(base))  # the same weights for every variant of one size
    if variant == "-ckpt":
        # newer transformers call it activation_checkpointing_enable; 5.17 (the GPU image) only has gradient_checkpointing_enable
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    elif variant == "-dsckpt":
        deepspeed = ds.load()

        # transformers' own switch, with DeepSpeed's checkpoint function in place of torch's
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
        # What a training script must do for the config's "activation_checkpointing" block to apply. The
        # settings are module globals of DeepSpeed: set them on every build (defaults without a block).
        block = (config or {}).get("activation_checkpointing")
        deepspeed.checkpointing.configure(None, deepspeed_config={"train_micro_batch_size_per_gpu": 1,
                                                                  "activation_checkpointing": block} if block else None)
    return model


def llama_7b_parameters() -> int:
    """Parameters of a LLaMA-7B-shaped model (hidden 4096, 32 layers, MLP 11008, vocabulary 32000),
    counted from the architecture built on PyTorch's meta device (no memory, no download)."""
    from transformers import (  # deferred: slow, and most runs need none
        LlamaConfig,
        LlamaForCausalLM,
    )

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        return count_parameters(LlamaForCausalLM(config))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (the paper's Ψ). A parameter built partitioned by
    ``deepspeed.zero.Init`` holds an empty tensor: its count is ``ds_numel``, as DeepSpeed's engine counts it."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


@dataclasses.dataclass
class Batch:
    """Inputs and targets of one micro-batch."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def to(self, device, dtype: torch.dtype | None = None) -> "Batch":
        """Move to ``device``; floating inputs (not token ids) are cast to ``dtype`` when given."""
        inputs = self.inputs.to(device)
        if dtype is not None and inputs.is_floating_point():
            inputs = inputs.to(dtype)
        return Batch(inputs, self.targets.to(device))


@functools.lru_cache(maxsize=4)
def _regression_data(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = REGRESSION_WIDTH[name]
    rows = LINEAR_SAMPLES if name == "linear" else 4096
    gen = torch.Generator().manual_seed(10_000 + seed)
    inputs = torch.randn(rows, width, generator=gen)
    # A learnable target (a fixed random linear map plus noise), so the loss visibly falls.
    mixing = torch.randn(width, width, generator=gen) / width**0.5
    targets = inputs @ mixing + 0.1 * torch.randn(rows, width, generator=gen)
    return inputs, targets


def text_corpus() -> bytes:
    """Real text that every machine with the course installed has: DeepSpeed's own ZeRO sources.

    The files come from the pinned ``deepspeed`` package, so the bytes (and the losses) are the
    same on every machine with that version.
    """
    zero = Path(ds.load().__file__).parent / "runtime" / "zero"
    return b"".join((zero / f).read_bytes() for f in ("stage_1_and_2.py", "stage3.py", "partition_parameters.py"))


@functools.lru_cache(maxsize=1)
def _tokens() -> torch.Tensor:
    return torch.frombuffer(bytearray(text_corpus()), dtype=torch.uint8).long()


def sample_indices(step: int, micro_step: int, rank: int, world_size: int, micro_batch: int, grad_accum: int) -> list[int]:
    """Global sample indices of one rank's micro-batch.

    Optimizer step ``step`` consumes samples ``[step*B, (step+1)*B)`` with ``B = micro_batch *
    grad_accum * world_size``, split micro-step by micro-step, then rank by rank. A plain loop
    that takes the whole range at once sees the same samples.
    """
    start = ((step * grad_accum + micro_step) * world_size + rank) * micro_batch
    return list(range(start, start + micro_batch))


def make_batch(name: str, indices: list[int], seed: int = 0, seq_len: int | None = None) -> Batch:
    """The samples ``indices`` of model ``name``'s data set (deterministic for a given seed).

    The language models read windows of the text corpus (bytes as token ids), ``seq_len`` tokens each
    (default: the small model's 64)."""
    check_model_name(name)
    if name in REGRESSION_WIDTH:
        inputs, targets = _regression_data(name, seed)
        rows = torch.tensor([i % inputs.shape[0] for i in indices])
        return Batch(inputs[rows], targets[rows])
    seq = seq_len or seq_len_of(name)
    tokens = _tokens()
    windows = tokens.numel() - seq - 1
    gen = torch.Generator()
    starts = []
    for i in indices:  # each sample index picks a window by its own seeded draw
        gen.manual_seed(seed * 1_000_003 + i)
        starts.append(int(torch.randint(windows, (1,), generator=gen)))
    chunk = torch.stack([tokens[s : s + seq + 1] for s in starts])
    return Batch(chunk[:, :-1], chunk[:, 1:])


def loss_of(model: nn.Module, name: str, batch: Batch) -> torch.Tensor:
    """The training loss of ``model`` on ``batch``: MSE for regression, cross-entropy for the LM."""
    if is_language_model(name):
        return lm_loss(model(input_ids=batch.inputs).logits, batch.targets)
    output = model(batch.inputs)
    return nn.functional.mse_loss(output.float(), batch.targets.float())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a language model's logits (computed in fp32)."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def plain_training(name: str, steps: int, batch_size: int, lr: float = 1e-3, seed: int = 0,
                   weight_decay: float = 0.01, micro_batch: int | None = None,
                   max_grad_norm: float | None = 1.0) -> list[float]:
    """Train ``name`` for ``steps`` AdamW steps in this process, no DeepSpeed: the baseline loop.

    Each step takes ``batch_size`` samples, the same ones a DeepSpeed run with ``micro_batch *
    grad_accum * world_size == batch_size`` takes. With ``micro_batch``, each step's batch is
    processed in chunks of that size whose gradients add up (plain gradient accumulation): the
    same math in another order of floating-point additions. Gradients are clipped to a total
    norm of ``max_grad_norm``, as DeepSpeed does by default (``gradient_clipping`` = 1.0; None
    turns clipping off). Returns one loss per step.
    """
    model = build(name, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    chunk = micro_batch or batch_size
    if batch_size % chunk:
        raise ValueError(f"micro_batch={micro_batch} must divide batch_size={batch_size}")
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for start in range(step * batch_size, (step + 1) * batch_size, chunk):
            batch = make_batch(name, list(range(start, start + chunk)), seed)
            loss = loss_of(model, name, batch) * (chunk / batch_size)
            loss.backward()
            total += loss.item()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(total)
    return losses


# --- LLaMA-style shapes for planning (the calculator; no weights are ever built) --------------

@dataclasses.dataclass(frozen=True)
class LlamaPreset:
    """The shape of a LLaMA-style decoder: what its parameter count depends on."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 32000
    tied_embeddings: bool = False

    def parameters(self) -> int:
        """Ψ by formula: embeddings V·h (and an LM head of the same size unless tied), and per layer
        the attention projections h·h (query, output) and h·(kv_heads·h/heads) (key, value), the
        gated MLP 3·h·i, two RMSNorm weights of h; one final norm of h. No biases."""
        h, head_dim = self.hidden, self.hidden // self.heads
        attention = 2 * h * h + 2 * h * self.kv_heads * head_dim
        per_layer = attention + 3 * h * self.intermediate + 2 * h
        embeddings = self.vocab * h * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * per_layer + h

    def largest_layer(self) -> int:
        """Parameters of the largest single tensor (the embedding, V·h, or the MLP's h·i)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)

    def config(self):
        """The ``transformers`` LlamaConfig of this shape."""
        from transformers import LlamaConfig  # deferred: slow, and most runs need none

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                           tie_word_embeddings=self.tied_embeddings)


#: Planning presets, nominal size -> shape: the LLaMA-1 7B and 13B shapes, Llama-2-70B (grouped-query
#: attention, 8 key/value heads), and smaller ones of the same family's proportions. The exact Ψ of
#: each is :meth:`LlamaPreset.parameters` (checked against ``transformers`` on the meta device).
LLAMA_PRESETS: dict[str, LlamaPreset] = {
    "125M": LlamaPreset(hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=12),
    "350M": LlamaPreset(hidden=1024, layers=24, intermediate=2816, heads=16, kv_heads=16),
    "1.3B": LlamaPreset(hidden=2048, layers=24, intermediate=5504, heads=16, kv_heads=16),
    "7B": LlamaPreset(hidden=4096, layers=32, intermediate=11008, heads=32, kv_heads=32),
    "13B": LlamaPreset(hidden=5120, layers=40, intermediate=13824, heads=40, kv_heads=40),
    "70B": LlamaPreset(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8),
}


def meta_parameters(shape: LlamaPreset) -> int:
    """Ψ of ``shape`` counted from ``transformers``' LlamaForCausalLM built on PyTorch's meta device
    (no memory, no download): the check on :meth:`LlamaPreset.parameters`."""
    from transformers import LlamaForCausalLM  # deferred: slow, and most runs need none

    with torch.device("meta"):
        return count_parameters(LlamaForCausalLM(shape.config()))
