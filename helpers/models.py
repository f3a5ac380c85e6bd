"""The models and data every run trains on, built the same way in a notebook and on every rank.

Models (all seeded, random weights, no downloads):

- ``linear``: the source article's ``nn.Linear(10, 10)`` (110 parameters).
- ``mlp``: eight equal 256-wide layers (526,336 parameters), big enough that ZeRO's partitions
  dwarf its alignment padding.
- ``llama``: a small LLaMA-style causal language model built from a ``transformers`` config.
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

#: Name -> (short description) of the models a run can use.
MODELS = {
    "linear": "nn.Linear(10, 10), the source article's model",
    "mlp": "MLP of 8 blocks Linear(256, 256) + GELU (526,336 parameters)",
    "llama": "LLaMA-style causal LM (hidden 64, 2 layers, byte vocabulary)",
    "llama-265m": "LLaMA-style causal LM for GPUs (hidden 1024, 16 layers, 32k vocabulary, sequence 1024)",
}

LINEAR_SAMPLES = 100  # the source article's TensorDataset has 100 rows
MLP_WIDTH, MLP_BLOCKS = 256, 8
LM_SEQ_LEN = 64
LM_VOCAB = 256  # bytes
#: The LLaMA-style models: their ``transformers`` config and sequence length. The GPU model's shape is
#: LLaMA's (MLP width 8/3 of hidden, rounded down to a multiple of 128); its tokens are still bytes (ids < 256).
LM_SHAPES = {
    "llama": {"config": dict(vocab_size=LM_VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, attn_implementation="eager"),
              "seq_len": LM_SEQ_LEN},
    "llama-265m": {"config": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2688, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, attn_implementation="sdpa"),
                   "seq_len": 1024},
}


def trainer_of(name: str) -> str:
    """How model ``name`` takes an optimizer step: a key of ``helpers.train.TRAINERS``."""
    check_model_name(name)
    return "data_parallel"


def check_model_name(name: str) -> None:
    """Raise a ValueError naming the choices when ``name`` is not a course model."""
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of the course's models: choose one of {', '.join(MODELS)}")


def llama_config(name: str = "llama"):
    """The ``transformers`` config of one of the course's LLaMA-style models (:data:`LM_SHAPES`)."""
    from transformers import LlamaConfig

    shape = LM_SHAPES[name]
    return LlamaConfig(**shape["config"], max_position_embeddings=shape["seq_len"], tie_word_embeddings=False)


def sequence_length(name: str) -> int:
    """Tokens per sample of a language model (1 for the regression models)."""
    return LM_SHAPES[name]["seq_len"] if name in LM_SHAPES else 1


def parameters_of(name: str) -> int:
    """Parameters of model ``name``, counted on PyTorch's meta device (no memory, no weights)."""
    check_model_name(name)
    with torch.device("meta"):
        return count_parameters(build(name))


def build(name: str, seed: int = 0) -> nn.Module:
    """Build model ``name`` with weights drawn from ``torch.manual_seed(seed)``."""
    check_model_name(name)
    torch.manual_seed(seed)
    if name == "linear":
        return nn.Linear(10, 10)
    if name == "mlp":
        # Equal blocks, so a partition boundary between ranks falls between whole layers.
        layers: list[nn.Module] = []
        for i in range(MLP_BLOCKS):
            layers.append(nn.Linear(MLP_WIDTH, MLP_WIDTH))
            if i < MLP_BLOCKS - 1:
                layers.append(nn.GELU())
        return nn.Sequential(*layers)
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(name))


def llama_7b_parameters() -> int:
    """Parameters of a LLaMA-7B-shaped model (hidden 4096, 32 layers, MLP 11008, vocabulary 32000),
    counted from the architecture built on PyTorch's meta device (no memory, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        return count_parameters(LlamaForCausalLM(config))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (the paper's Ψ)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


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
    width = 10 if name == "linear" else MLP_WIDTH
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
    from helpers.environment import quiet_deepspeed_import

    quiet_deepspeed_import()
    import deepspeed

    zero = Path(deepspeed.__file__).parent / "runtime" / "zero"
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


def make_batch(name: str, indices: list[int], seed: int = 0) -> Batch:
    """The samples ``indices`` of model ``name``'s data set (deterministic for a given seed)."""
    check_model_name(name)
    if name in ("linear", "mlp"):
        inputs, targets = _regression_data(name, seed)
        rows = torch.tensor([i % inputs.shape[0] for i in indices])
        return Batch(inputs[rows], targets[rows])
    tokens = _tokens()
    seq_len = LM_SHAPES[name]["seq_len"]
    windows = tokens.numel() - seq_len - 1
    gen = torch.Generator()
    starts = []
    for i in indices:  # each sample index picks a window by its own seeded draw
        gen.manual_seed(seed * 1_000_003 + i)
        starts.append(int(torch.randint(windows, (1,), generator=gen)))
    chunk = torch.stack([tokens[s : s + seq_len + 1] for s in starts])
    return Batch(chunk[:, :-1], chunk[:, 1:])


def loss_of(model: nn.Module, name: str, batch: Batch) -> torch.Tensor:
    """The training loss of ``model`` on ``batch``: MSE for regression, cross-entropy for the LM."""
    if name in LM_SHAPES:
        logits = model(input_ids=batch.inputs).logits
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))
    output = model(batch.inputs)
    return nn.functional.mse_loss(output.float(), batch.targets.float())


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
