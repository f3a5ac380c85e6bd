"""The capstone: train a LLaMA-style model as fast as the box allows, one measured step at a time.

A :class:`Setting` is one complete way to train the model (ZeRO stage, micro batch and accumulation,
buckets and overlap, activation checkpointing, optimizer kernel, ``engine.compile()``, sequence length).
A :class:`Rung` is one family of knobs: from the best setting so far it proposes candidates, and all of
them train one after the other in ONE launch (:func:`helpers.core.launch.sweep`). :func:`walk` climbs the
ladder: a candidate is kept when its model TFLOP/s per GPU beats the best so far by more than the noise
margin (measured: the first rung trains the baseline twice), and dropped otherwise, with the reason. It
stops starting rungs when the time budget would run out, and says which it skipped.

Every figure comes from the candidates' records (probes ``throughput``, ``comm_share``, ``peak_memory``;
formulas in :mod:`helpers.core.performance`). ``benchmarks/capstone.py`` runs the same ladder without Jupyter.

FSDP2: :func:`fsdp2_run` is the hook where PyTorch FSDP2's run of the best setting plugs in (the DDP/FSDP2
helpers are built with the chapter comparing DeepSpeed with PyTorch); until then it says so and measures
nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import torch

from helpers.core import (ds, environment, exercises, launch, load_guard, models, performance, plots, records,
                          references)
from helpers.core.plan import PlannedRun, reference_of
from helpers.core.probes import Probe, RunContext
from helpers.topics import frameworks

#: The probes every candidate runs with (no comms logger: it synchronizes every collective, which would
#: hide the overlap being tuned).
PROBES = ("timing", "throughput", "peak_memory", "comm_share")
#: A candidate must beat the best so far by at least this much (or twice the baseline's own spread).
MIN_MARGIN = 0.02
#: The issue's target: model FLOPs utilization per GPU with ZeRO-2 or ZeRO-3 on 2 or more GPUs.
TARGET_MFU = 0.50
#: How a skipped rung's or FSDP2's reason begins when no time was left to try it.
BUDGET_SKIP = "time budget: "
#: What :func:`walk` sets for the ranks unless already set: fewer, larger CUDA allocator segments (a
#: candidate that ran out of memory leaves less fragmentation to the next), and a rank stuck in a
#: collective after another rank failed gives up after 5 minutes instead of DeepSpeed's 10.
RANK_ENVIRONMENT = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "DEEPSPEED_TIMEOUT": "5"}


# --- the capstone's model -------------------------------------------------------------------------

#: The model's name in records, and the course data set it trains on (windows of the text corpus).
MODEL = "llama-capstone"
DATA = "llama"
#: Shapes of the capstone model: hidden size, MLP size, layers, attention heads, vocabulary. "1.2b" is the
#: issue's baseline (hidden 2048, 22 layers: 1,244,227,584 parameters); heads of 128 dimensions, as LLaMA's.
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 256},
    "1.2b": {"hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 22, "num_attention_heads": 16,
             "vocab_size": 32000},
    "2.7b": {"hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 32, "num_attention_heads": 20,
             "vocab_size": 32000},
    # the source article's case, LLaMA-7B's shapes (benchmarks/article_7b.py): 6,738,415,616 parameters
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "vocab_size": 32000},
}
#: The model's options (a run's ``model_options``) and their defaults (seq_len None: 64 for "tiny", else 2048).
OPTIONS = {"size": "tiny", "seq_len": None, "attention": "sdpa", "checkpointing": False, "compile": False}
ATTENTION_KERNELS = ("sdpa", "eager")


def full_options(options: dict | None = None) -> dict:
    """The capstone model's options with defaults filled in."""
    full = {**OPTIONS, **(options or {})}
    if full["seq_len"] is None:
        full["seq_len"] = models.LM_SEQ_LEN if full["size"] == "tiny" else 2048
    return full


def check_options(name: str, options: dict) -> None:
    """Raise a ValueError naming the key and the choices when ``options`` do not fit the capstone model
    (the launcher calls it before any process starts)."""
    if name != MODEL:
        raise ValueError(f"model {name!r}: the capstone's builder builds {MODEL!r}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"model_options {unknown}: {MODEL} takes {', '.join(OPTIONS)}")
    full = full_options(options)
    if full["size"] not in SIZES:
        raise ValueError(f"model_options size={full['size']!r}: choose one of {', '.join(SIZES)}")
    if not isinstance(full["seq_len"], int) or full["seq_len"] < 2:
        raise ValueError(f"model_options seq_len={full['seq_len']!r}: a whole number of tokens, at least 2")
    if full["attention"] not in ATTENTION_KERNELS:
        raise ValueError(f"model_options attention={full['attention']!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    for key in ("checkpointing", "compile"):
        if not isinstance(full[key], bool):
            raise ValueError(f"model_options {key}={full[key]!r}: true or false")


def model_config(size: str = "tiny", seq_len: int | None = None, attention: str = "sdpa"):
    """The ``transformers`` config of the capstone model: :data:`SIZES` [size], untied embeddings,
    ``max_position_embeddings`` = the sequence length it trains on."""
    from transformers import LlamaConfig  # deferred: slow, and the ranks of most chapters need none

    full = full_options({"size": size, "seq_len": seq_len, "attention": attention})
    return LlamaConfig(**SIZES[size], num_key_value_heads=SIZES[size]["num_attention_heads"],
                       max_position_embeddings=full["seq_len"], tie_word_embeddings=False, use_cache=False,
                       attn_implementation=attention)


@functools.lru_cache(maxsize=None)
def model_parameters(size: str) -> int:
    """Parameters of the capstone model of ``size``, counted on PyTorch's meta device (no memory)."""
    from transformers import LlamaForCausalLM  # deferred: as above

    with torch.device("meta"):
        return models.count_parameters(LlamaForCausalLM(model_config(size)))


def build_model(name: str, seed: int = 0, config: dict | None = None, **options) -> torch.nn.Module:
    """The capstone model (a run's ``builder``), built on this rank's GPU where there is one (a 1.24B model
    initialises in a fraction of a second there, in many seconds on a CPU). ``options``: :data:`OPTIONS`
    (``compile`` is applied by :func:`initialize`)."""
    from transformers import LlamaForCausalLM  # deferred: as above

    check_options(name, options)
    full = full_options(options)
    model_conf = model_config(full["size"], full["seq_len"], full["attention"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = LlamaForCausalLM(model_conf)
    if full["checkpointing"]:
        # transformers' switch: torch.utils.checkpoint around each decoder layer, without re-entrance
        # (activation_checkpointing_enable since transformers 5; gradient_checkpointing_enable before)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


build_model.check_options = check_options  # the launcher checks a run's model options with it
build_model.data = DATA  # what a torchrun task trains this model on (helpers.topics.frameworks)


def initialize(model: torch.nn.Module, config: dict, run: PlannedRun):
    """The capstone's engine (a run's ``initialize``): ``deepspeed.initialize`` with the candidate's config, then
    ``engine.compile()`` when the run's options ask for it (torch.compile compiles at the first forward, so the
    compilation lands in the first, warm-up, step)."""
    deepspeed = ds.load()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if full_options(run.model_options)["compile"]:
        engine.compile()
    return engine


def train_step(ctx: RunContext, run: PlannedRun, step: int, probes: list[Probe]) -> list[float]:
    """One optimizer step of the capstone model (a run's ``trainer``): ``grad_accum`` micro-steps of
    forward, ``engine.backward``, ``engine.step`` on windows of the text corpus ``seq_len`` tokens long.
    Losses are read once per step, not per micro-step, so the host never waits for the device mid-step."""
    engine = ctx.engine
    options = full_options(run.model_options)
    losses = []
    for micro_step in range(ctx.grad_accum):
        indices = models.sample_indices(step, micro_step, ctx.rank, ctx.world_size, ctx.micro_batch, ctx.grad_accum)
        batch = models.make_batch(DATA, indices, run.seed, seq_len=options["seq_len"]).to(engine.device)
        loss = models.loss_of(engine, DATA, batch)
        engine.backward(loss)
        for probe in probes:
            probe.after_backward(ctx, step, micro_step)
        engine.step()
        losses.append(loss.detach())
    return [loss.item() for loss in losses]


#: How a run names them (:class:`helpers.core.launch.RunSpec`).
BUILDER, INITIALIZE, TRAINER = reference_of(build_model), reference_of(initialize), reference_of(train_step)


def page_code(path: str | Path) -> tuple[str, str]:
    """The import paths of ``initialize`` and ``train_step`` in the module chapter 16 wrote at ``path`` (inside the
    repository, which the ranks import from), as :func:`walk`'s ``initialize`` and ``trainer``; the module is made
    importable here too (the launcher imports it to check it), an edited one read again."""
    module = ".".join(Path(path).resolve().relative_to(environment.REPO_ROOT).with_suffix("").parts)
    environment.importable_repository()
    sys.modules.pop(module, None)
    return f"{module}:initialize", f"{module}:train_step"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to train the capstone model. ``None`` leaves a knob at DeepSpeed's default."""

    stage: int = 2
    micro_batch: int = 8
    grad_accum: int = 2
    seq_len: int = 2048
    precision: str = "bf16"
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None  # stages 1-2
    prefetch_bucket_size: int | None = None  # stage 3
    checkpointing: bool = False
    optimizer: str = "fused"  # "fused": DeepSpeed's FusedAdam (AdamW mode); "torch": torch.optim.AdamW
    compile: bool = False
    attention: str = "sdpa"

    def config(self, world_size: int) -> dict:
        """The full DeepSpeed config of this setting on ``world_size`` ranks."""
        zero: dict = {"stage": self.stage}
        knobs = {"overlap_comm": self.overlap_comm, "contiguous_gradients": self.contiguous_gradients,
                 "reduce_bucket_size": self.reduce_bucket_size}
        if self.stage in (1, 2):
            knobs["allgather_bucket_size"] = self.allgather_bucket_size
        if self.stage == 3:
            knobs["stage3_prefetch_bucket_size"] = self.prefetch_bucket_size
        zero.update({k: v for k, v in knobs.items() if v is not None})
        params: dict = {"lr": 1e-4, "weight_decay": 0.01}
        if self.optimizer == "torch":
            params["torch_adam"] = True
        config = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "train_batch_size": self.micro_batch * self.grad_accum * world_size,
            "optimizer": {"type": "AdamW", "params": params},
            "gradient_clipping": 1.0,
            "zero_optimization": zero,
            "steps_per_print": 1_000_000,
        }
        if self.precision in ("bf16", "fp16"):
            config[self.precision] = {"enabled": True}
        return config

    def model_options(self, size: str) -> dict:
        return {"size": size, "seq_len": self.seq_len, "attention": self.attention,
                "checkpointing": self.checkpointing, "compile": self.compile}

    def changes_from(self, other: "Setting") -> str:
        """What differs from ``other``, as ``knob=value`` pairs ("same" when nothing does)."""
        diffs = [f"{f.name}={_short(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(other, f.name)]
        return ", ".join(diffs) or "same"

    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    def with_knobs(self, text: str) -> "Setting":
        """This setting with ``"knob=value,knob=value"`` applied (``compile=true``, ``reduce_bucket_size=2e8``,
        ``overlap_comm=none`` for DeepSpeed's default): where a walk starts when it is not the baseline.
        Raises ``ValueError`` naming the knob and what it takes."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict = {}
        for pair in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = pair.partition("=")
            key, raw = key.strip(), raw.strip()
            if not sep or key not in fields:
                raise ValueError(f"{pair!r}: write knob=value, with a knob among {', '.join(fields)}")
            # the annotation, a string here ("bool | None"): its first type, and whether None is allowed
            annotation = str(fields[key].type)
            kind = {"int": int, "bool": bool, "str": str}[annotation.split(" |")[0]]
            nullable = "None" in annotation
            if raw.lower() == "none" and nullable:
                changes[key] = None
            elif kind is bool and raw.lower() in ("true", "false"):
                changes[key] = raw.lower() == "true"
            elif kind is int and re.fullmatch(r"\d+(\.\d+)?(e\d+)?", raw.lower()) and float(raw) == int(float(raw)):
                changes[key] = int(float(raw))
            elif kind is str and raw:
                changes[key] = raw
            else:
                wants = {bool: "true or false", int: "a whole number (2e8 is fine)", str: "a word"}[kind]
                none = " (or none: DeepSpeed's default)" if nullable else ""
                raise ValueError(f"{key}={raw!r}: {key} takes {wants}{none}")
        return dataclasses.replace(self, **changes)


def _short(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000_000:
        return f"{value:.0e}".replace("e+0", "e")
    return str(value)


#: Where the ladder starts on GPUs: the issue's measured baseline (1.24B, sequence 2048, bf16, SDPA,
#: ZeRO-2, micro batch 8 x accumulation 2, DeepSpeed's defaults otherwise).
GPU_BASELINE = Setting()
#: Where it starts on CPU ranks: the tiny model, in fp32 (bf16 is emulated, slowly, on most CPUs), with
#: torch's AdamW (DeepSpeed's FusedAdam is a compiled op on CPUs too, and loading it costs each launch seconds).
CPU_BASELINE = Setting(micro_batch=4, grad_accum=2, seq_len=64, precision="fp32", optimizer="torch")


@dataclasses.dataclass(frozen=True)
class Rung:
    """One family of knobs: ``propose(best)`` gives (label, candidate) pairs; ``eligible`` says which
    settings may be kept (the target asks for ZeRO-2 or ZeRO-3)."""

    name: str
    what: str
    propose: Callable[[Setting], list[tuple[str, Setting]]]
    eligible: Callable[[Setting], bool] = lambda s: s.stage in (2, 3)


def _batch(s: Setting) -> list[tuple[str, Setting]]:
    found = []
    if s.grad_accum >= 2:
        found.append(("micro x2, accumulation /2", dataclasses.replace(s, micro_batch=s.micro_batch * 2,
                                                                         grad_accum=s.grad_accum // 2)))
    if s.micro_batch >= 2:
        found.append(("micro /2, accumulation x2", dataclasses.replace(s, micro_batch=s.micro_batch // 2,
                                                                         grad_accum=s.grad_accum * 2)))
    found.append(("accumulation x2", dataclasses.replace(s, grad_accum=s.grad_accum * 2)))
    return found


def _overlap(s: Setting) -> list[tuple[str, Setting]]:
    if s.stage == 3:
        return [("prefetch bucket 2e8", dataclasses.replace(s, prefetch_bucket_size=200_000_000)),
                ("reduce bucket 2e8", dataclasses.replace(s, reduce_bucket_size=200_000_000))]
    return [("overlap_comm", dataclasses.replace(s, overlap_comm=True)),
            ("overlap_comm, buckets 2e8", dataclasses.replace(s, overlap_comm=True, reduce_bucket_size=200_000_000,
                                                              allgather_bucket_size=200_000_000))]


def _checkpointing(s: Setting) -> list[tuple[str, Setting]]:
    on = dataclasses.replace(s, checkpointing=True)
    found = [("checkpointing, micro x2", dataclasses.replace(on, micro_batch=s.micro_batch * 2))]
    if s.grad_accum >= 2:
        found.append(("checkpointing, micro x2, accumulation /2",
                      dataclasses.replace(on, micro_batch=s.micro_batch * 2, grad_accum=s.grad_accum // 2)))
    return found


#: The GPU ladder, in the order it is climbed: the knobs that usually pay most come first, so a short
#: budget spends itself on them (the stage rung shares the baseline's launch).
GPU_LADDER: list[Rung] = [
    Rung("stage", "ZeRO stage (stage 1 is measured for comparison; the target asks for 2 or 3)",
         lambda s: [("ZeRO-3", dataclasses.replace(s, stage=3)), ("ZeRO-1", dataclasses.replace(s, stage=1))]),
    Rung("batch", "micro batch and gradient accumulation, first, with eager kernels: the shape that fills the GPU "
         "before any other knob moves", _batch),
    Rung("overlap", "communication overlap and bucket sizes", _overlap),
    Rung("compile", "torch.compile through engine.compile()",
         lambda s: [("engine.compile()", dataclasses.replace(s, compile=True))] if not s.compile else []),
    Rung("rebatch", "micro batch and accumulation again, from what was kept above (compiled kernels move the "
         "balance between compute, the optimizer step and memory)", _batch),
    Rung("sequence", "sequence length x2 at the same tokens per micro-batch",
         lambda s: [("sequence x2, micro /2", dataclasses.replace(s, seq_len=s.seq_len * 2,
                                                                  micro_batch=max(1, s.micro_batch // 2)))]),
    Rung("checkpointing", "activation checkpointing, spending the memory it frees on a larger micro batch",
         _checkpointing),
    Rung("fused", "fused optimizer kernel: DeepSpeed's FusedAdam against torch.optim.AdamW (foreach)",
         lambda s: [("torch AdamW", dataclasses.replace(s, optimizer="torch" if s.optimizer == "fused" else "fused"))]),
    Rung("accumulate", "longer accumulation at the kept micro batch: the optimizer step is paid once per step, so "
         "it weighs less per token (the global batch grows: a real run weighs that against convergence)",
         lambda s: [(f"accumulation x{k}", dataclasses.replace(s, grad_accum=s.grad_accum * k)) for k in (2, 4)]),
]

#: On CPU ranks the notebook climbs one rung in one launch: the baseline (twice) and one candidate from
#: each of three knob families, so the learner sees the rule at work within the notebook's time.
CPU_LADDER: list[Rung] = [
    Rung("cpu", "one candidate per knob family, in one launch",
         lambda s: [("ZeRO-3", dataclasses.replace(s, stage=3)),
                    ("accumulation x2", dataclasses.replace(s, grad_accum=s.grad_accum * 2)),
                    ("checkpointing", dataclasses.replace(s, checkpointing=True))]),
]


# --- what each candidate measured -------------------------------------------------------------

def metric(record: records.Record) -> float:
    """The number the ladder ranks by: model TFLOP/s per GPU (tokens/s where no FLOPs are known)."""
    section = record["throughput"]
    return section["tflops_per_gpu"] if section["tflops_per_gpu"] is not None else section["tokens_per_s"]


def measurements(record: records.Record) -> dict:
    """The figures a ladder row shows, from one candidate's record."""
    t, share = record["throughput"], record.summary.get("comm_share", {})
    return {"tokens_per_s": t["tokens_per_s"], "tflops_per_gpu": t["tflops_per_gpu"], "mfu": t["mfu"],
            "step_time_s": t["step_time_s"], "peak_bytes": record.memory.peak(),
            "peak_upper_bound": records.peak_may_include_earlier_runs(record),
            "comm_exposed_share": share.get("exposed_share"), "comm_busy_share": share.get("busy_share"),
            "losses": record.losses, "metric": metric(record)}


# --- the ladder ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Candidate:
    rung: str
    label: str
    setting: Setting
    run_name: str
    record: records.Record | None = None
    failure: str | None = None
    verdict: str = ""
    note: str = ""  # how it was trained, where that differs from its rung's one launch


@dataclasses.dataclass
class Ladder:
    """What :func:`walk` did: every candidate with its verdict, the best setting and why it stopped."""

    size: str
    params: int
    world_size: int
    device: str
    baseline: Setting
    budget_s: float
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    rungs: list[dict] = dataclasses.field(default_factory=list)
    best: Setting | None = None
    best_label: str = "baseline"
    margin: float = MIN_MARGIN
    spread: float | None = None
    seconds: float = 0.0
    fsdp2: dict = dataclasses.field(default_factory=dict)
    previous: dict | None = None  # the ladder this walk resumed (Ladder.to_dict() of an earlier walk)
    # (seconds, candidates, compiled) of every launch, earlier walks' first: what budget estimates start from
    launches: list[tuple[float, int, bool]] = dataclasses.field(default_factory=list)
    name: str = "capstone"  # runs/<name>/ holds every candidate's record

    def best_candidate(self) -> Candidate | None:
        kept = [c for c in self.candidates if c.verdict.startswith(("kept", "baseline"))]
        return kept[-1] if kept else None

    def best_run(self) -> str | None:
        kept = [c for c in self.candidates if c.verdict.startswith("kept")]
        if kept:
            return kept[-1].run_name
        if self.previous is not None:
            return self.previous["best_run"]
        best = self.best_candidate()
        return best.run_name if best else None

    def to_dict(self) -> dict:
        """Plain data (settings, verdicts, each candidate's figures), for ladder.json and the references."""
        before = self.previous or {"candidates": [], "rungs": [], "budget_s": 0, "seconds": 0}
        climbed_now = {r["rung"] for r in self.rungs}
        before_rungs = [r for r in before["rungs"] if r["ran"] or r["rung"] not in climbed_now]
        return {"size": self.size, "params": self.params, "world_size": self.world_size, "device": self.device,
                "baseline": dataclasses.asdict(self.baseline), "budget_s": before["budget_s"] + self.budget_s,
                "seconds": before["seconds"] + self.seconds, "margin": self.margin, "spread": self.spread,
                "rungs": before_rungs + self.rungs, "walks": 1 + before.get("walks", 0),
                "best": dataclasses.asdict(self.best) if self.best else None, "best_label": self.best_label,
                "best_run": self.best_run(), "target_mfu": TARGET_MFU, "launches": [list(x) for x in self.launches],
                "fsdp2": _carry_fsdp2(before.get("fsdp2") or {}, self.fsdp2),
                "candidates": before["candidates"] + [
                    {"rung": c.rung, "label": c.label, "run": c.run_name, "verdict": c.verdict, "engines_released": True,
                     "changes": c.setting.changes_from(self.baseline), "failure": c.failure,
                     "setting": dataclasses.asdict(c.setting), **({"note": c.note} if c.note else {}),
                     **(measurements(c.record) if c.record else {})}
                    for c in self.candidates]}


def _may_train_again(candidate: dict) -> bool:
    """Whether a stored candidate (``Ladder.to_dict()``) failed for a reason that may not be its setting's,
    so a resumed walk may propose it again: another reason than running out of memory (the machine, or what
    failed before it in the same launch), or running out of memory after earlier candidates of its launch in
    a walk from before engines were released between runs (they may have held the memory)."""
    failure = candidate.get("failure")
    if not failure or "tokens_per_s" in candidate:
        return False
    return not _out_of_memory(failure) or _memory_maybe_held_by_earlier(candidate)


def _out_of_memory(failure: str | None) -> bool:
    """Whether a candidate's failure is running out of memory (CUDA's or the host's wording)."""
    return bool(re.search(r"out of memory|OutOfMemory", failure or ""))


def _memory_maybe_held_by_earlier(candidate: dict) -> bool:
    """Whether a stored candidate ran out of memory after earlier candidates of its launch, in a walk from
    before engines were released between runs: those engines may have held the memory."""
    return (_out_of_memory(candidate.get("failure")) and not candidate.get("engines_released")
            and _launch_index(candidate.get("run", "")) > 0)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


#: Label of the kept setting trained again in a resumed walk's first launch.
AGAIN = "best so far, again"
#: The verdict of a resumed walk's first run, the best setting trained again: its later candidates' yardstick.
AGAIN_VERDICT = "best so far, trained again"

#: How much longer a candidate takes when it compiles, where no compiled launch has been timed yet.
COMPILE_FACTOR = 2.5


def _estimate(history: list[tuple[float, int, bool]], count: int, compiles: bool, is_gpu: bool) -> float:
    """Seconds a launch of ``count`` candidates should take, from earlier launches (wall, candidates,
    compiled): the slowest candidate of earlier launches of the same kind, else of any kind scaled by
    :data:`COMPILE_FACTOR` for a compiled launch, else a first guess."""
    same = [wall / runs for wall, runs, compiled in history if compiled == compiles]
    if same:
        return max(same) * count
    if history:
        return max(wall / runs for wall, runs, _ in history) * count * (COMPILE_FACTOR if compiles else 1.0)
    return ((60 + 30 * count) if is_gpu else (10 + 5 * count)) * (COMPILE_FACTOR if compiles else 1.0)


def _launch_rung(rung_index: int, rung: Rung, pairs: list[tuple[str, Setting]], size: str, steps: int,
                 world: int, name: str, timeout: float, prefix: str = "", trainer: str = TRAINER,
                 initialize: str = INITIALIZE, progress: bool = True) -> list[Candidate]:
    """Train ``pairs`` in one launch; a candidate that fails (out of memory, say) is recorded, not fatal.

    A failure can leave the ranks unfit for what follows in the same processes (on 2 x H200 a compiled
    candidate that ran out of memory was followed by an NCCL error in the next one), so the candidates that
    fail after another failed are trained again in one more launch, and their ``note`` says so. Run names
    start with ``prefix`` (a resumed walk's number), so no walk overwrites another's records."""
    folder = launch.RUNS_DIR / name
    candidates, specs = [], []
    for i, (label, setting) in enumerate(pairs):
        run_name = f"{prefix}{rung_index}-{rung.name}-{i}-{_slug(label)}"
        candidates.append(Candidate(rung.name, label, setting, run_name))
        specs.append(launch.RunSpec(setting.config(world), model=MODEL, steps=steps, name=run_name,
                                    out=folder / run_name, probes=PROBES, on_error="record",
                                    model_options=setting.model_options(size), builder=BUILDER,
                                    initialize=initialize, trainer=trainer))
    # the retried ones together: each compiled candidate alone would pay the compile's start again
    results, again = launch.sweep_retrying(specs, name=f"{name}/{prefix}{rung_index}-{rung.name}", world_size=world,
                                           timeout_each=timeout / len(specs), together=True, progress=progress)
    # the launch's first failure: the one candidate that failed and was not trained again
    first = next((c.label for c in candidates if c.run_name not in again
                  and not isinstance(results.get(c.run_name), records.Record)), None)
    for c in candidates:
        result = results.get(c.run_name)
        if isinstance(result, records.Record):
            c.record = result
        else:
            c.failure = str(result).splitlines()[0][:160] if result is not None else "did not run"
        if c.run_name in again:
            c.note = f"trained again in one more launch: it failed after {first!r} failed in the rung's launch"
    return candidates


def decide(measured: list[tuple[Candidate, float | None]], best_value: float, margin: float,
           rung: Rung) -> Candidate | None:
    """Give each candidate of a rung its verdict from its number (None: it failed) against the best so
    far, and return the one to keep: the fastest eligible candidate whose gain exceeds ``margin``, or None."""
    winner, winner_value = None, best_value
    for c, value in measured:
        if value is None:
            c.verdict = f"failed: {c.failure}"
            continue
        gain = value / best_value - 1
        if not rung.eligible(c.setting):
            c.verdict = f"not eligible ({gain:+.1%}): {rung.what}"
        elif gain <= margin:
            c.verdict = f"dropped: {gain:+.1%}, not above the {margin:.1%} margin"
        else:
            c.verdict = f"better: {gain:+.1%}"
            if value > winner_value:
                winner, winner_value = c, value
    for c, _ in measured:
        if c.verdict.startswith("better"):
            gain = c.verdict[len("better: "):]
            c.verdict = f"kept: {gain}" if c is winner else f"dropped: {gain}, another candidate of this rung did better"
    return winner


def walk(size: str = "tiny", ladder: Sequence[Rung] | None = None, baseline: Setting | None = None,
         budget_s: float = 300, steps: int | None = None, world_size: int | None = None,
         name: str = "capstone", resume: dict | None = None, climb_again: Collection[str] = (),
         trainer: str = TRAINER, initialize: str = INITIALIZE, progress: bool = True) -> Ladder:
    """Climb ``ladder`` from ``baseline`` with the capstone model of ``size`` within ``budget_s`` seconds.

    Defaults: on GPUs the 1.24B model would be ``size="1.2b"`` with :data:`GPU_LADDER` from
    :data:`GPU_BASELINE`; on CPU ranks :data:`CPU_LADDER` from :data:`CPU_BASELINE`. Each rung is one
    launch; the first also trains the baseline twice, which sets the noise margin. A walk that goes on
    from the ladder ``resume`` skips the rungs it climbed, except those named in ``climb_again`` (proposed anew from
    the best so far; a setting measured before is not trained again). Sets
    :data:`RANK_ENVIRONMENT` in this process (unless set) for the ranks. ``initialize`` and ``trainer``: the
    import paths of the call that makes every candidate's engine and of the step it trains with (chapter 16's
    page module, :func:`page_code`; this module's :func:`initialize` and :func:`train_step` by default).
    ``progress=False`` shows no progress bar per run (:func:`trained_lines` sums the runs up after). Returns
    the :class:`Ladder`; every candidate's record is in ``runs/<name>/``.
    """
    for key, value in RANK_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    env = environment.detect(world_size)
    world = env.default_world_size
    ladder = list(ladder if ladder is not None else (GPU_LADDER if env.is_gpu else CPU_LADDER))
    baseline = baseline or (GPU_BASELINE if env.is_gpu else CPU_BASELINE)
    if not env.supports(baseline.precision):
        raise ValueError(f"baseline precision {baseline.precision}: not supported on {env.device_name}")
    steps = steps or 8  # the first two warm up and the last is profiled: five measured steps
    started = time.monotonic()
    result = Ladder(size=size, params=model_parameters(size), world_size=world, device=env.device_name,
                    baseline=baseline, budget_s=budget_s, name=name)
    best, best_value, seen = None, None, set()
    history = result.launches  # (seconds, candidates, compiled) of each launch
    done: set[str] = set()
    if resume is not None:
        if (resume["size"], resume["world_size"]) != (size, world):
            raise ValueError(f"resume: that ladder trained size {resume['size']} on {resume['world_size']} ranks, "
                             f"not {size} on {world}")
        result.previous, result.baseline = resume, Setting(**resume["baseline"])
        result.margin, result.spread = resume["margin"], resume["spread"]
        result.best_label = resume["best_label"]
        best = Setting(**resume["best"])
        rows = {c["run"]: c for c in resume["candidates"]}
        base = [c["metric"] for c in resume["candidates"] if c["verdict"] == "baseline"]
        best_value = (sum(base) / len(base)) if rows[resume["best_run"]]["verdict"] == "baseline" \
            else rows[resume["best_run"]]["metric"]
        # a setting that ran out of memory will again; one that failed otherwise (an NCCL error after another
        # candidate's failure, a hang) may train on another try
        seen = {Setting(**c["setting"]) for c in resume["candidates"] if not _may_train_again(c)}
        done = {r["rung"] for r in resume["rungs"] if r["ran"]} - set(climb_again)
        # the earlier walks' launches: a resumed walk's first estimate need not be a guess
        history.extend((float(seconds), int(n), bool(compiled))
                       for seconds, n, compiled in resume.get("launches", []))
    # a resumed walk may run on another machine, or the same one another day: its first launch trains the
    # kept setting again beside the new candidates, and they are judged against that figure
    again = resume is not None
    # a resumed walk's run names carry its number: rung indices restart in every walk
    prefix = f"w{resume.get('walks', 1) + 1}-" if resume is not None else ""
    for index, rung in enumerate(ladder):
        if rung.name in done:
            continue
        current = best or baseline
        pairs = [(label, s) for label, s in rung.propose(current) if s not in seen and env.supports(s.precision)]
        if not pairs:
            result.rungs.append({"rung": rung.name, "what": rung.what, "ran": False, "why": "nothing new to try"})
            continue
        if best is None:
            pairs = [("baseline", baseline), ("baseline, again", baseline)] + pairs
        elif again:
            pairs = [(AGAIN, best)] + pairs
        left = budget_s - (time.monotonic() - started)
        estimate = _estimate(history, len(pairs), any(s.compile for _, s in pairs), env.is_gpu)
        reduced = best is None and estimate > left
        if reduced:  # the baseline is measured whatever the budget
            result.rungs.append({"rung": rung.name, "what": rung.what, "ran": False,
                                 "why": f"{BUDGET_SKIP}about {estimate:.0f} s needed, {max(0, left):.0f} s left; "
                                        "the baseline alone was measured"})
            pairs = pairs[:2]
            estimate = _estimate(history, 2, False, env.is_gpu)
        elif estimate > left:
            result.rungs.append({"rung": rung.name, "what": rung.what, "ran": False,
                                 "why": f"{BUDGET_SKIP}about {estimate:.0f} s needed, {max(0, left):.0f} s left"})
            continue
        launched = time.monotonic()
        # the budget decides which rungs start; a started launch gets room (a loaded machine is slow)
        found = _launch_rung(index, rung, pairs, size, steps, world, name, timeout=max(300.0, min(left, 3 * estimate)),
                             prefix=prefix, trainer=trainer, initialize=initialize, progress=progress)
        history.append((time.monotonic() - launched, len(pairs), any(s.compile for _, s in pairs)))
        seen.update(s for _, s in pairs)
        if best is None:
            base = [c for c in found[:2] if c.record is not None]
            if not base:
                reason = found[0].failure or "no record"
                raise launch.RunFailed(f"the baseline did not train: {reason}")
            values = [metric(c.record) for c in base]
            best, best_value = baseline, sum(values) / len(values)
            if len(values) == 2:
                result.spread = abs(values[0] - values[1]) / best_value
                result.margin = max(MIN_MARGIN, 2 * result.spread)
            for c in found[:2]:
                c.verdict = "baseline" if c.record else f"failed: {c.failure}"
            found_rest = found[2:]
        elif again:
            first, found_rest, again = found[0], found[1:], False
            if first.record is not None:
                best_value = metric(first.record)
                first.verdict = f"{AGAIN_VERDICT}: the candidates below are judged against it"
            else:
                first.verdict = f"failed: {first.failure}; the candidates are judged against the earlier figure"
        else:
            found_rest = found
        winner = decide([(c, metric(c.record) if c.record else None) for c in found_rest], best_value,
                        result.margin, rung)
        if winner is not None:
            best, best_value, result.best_label = winner.setting, metric(winner.record), f"{rung.name}: {winner.label}"
        result.candidates.extend(found)
        if not reduced:
            result.rungs.append({"rung": rung.name, "what": rung.what, "ran": True, "candidates": len(found),
                                 "kept": winner.label if winner else None})
    result.best = best
    left = budget_s - (time.monotonic() - started)
    estimate = _estimate(history, len(FSDP2_STRATEGIES), False, env.is_gpu)
    if estimate > left:
        result.fsdp2 = {"measured": False,
                        "reason": f"{BUDGET_SKIP}about {estimate:.0f} s needed, {max(0, left):.0f} s left"}
    else:
        result.fsdp2 = fsdp2_run(best or baseline, size, steps, world, name, timeout=max(300.0, 3 * estimate),
                                 progress=progress)
    result.seconds = time.monotonic() - started
    return result


#: PyTorch's strategies the capstone sets beside DeepSpeed's best (:data:`helpers.topics.frameworks.STRATEGIES`):
#: FSDP2 with ZeRO-3's sharding, and with ZeRO-2's traffic (layers stay gathered until their backward).
FSDP2_STRATEGIES = ("fsdp2", "fsdp2-grad-op")


def fsdp2_run(setting: Setting, size: str, steps: int, world_size: int, name: str = "capstone",
              timeout: float = 600.0, progress: bool = True) -> dict:
    """PyTorch FSDP2 on the ladder's best setting, the alternative a user would weigh: the capstone model
    trained under ``torchrun`` by :func:`helpers.topics.frameworks.train_run` with each of
    :data:`FSDP2_STRATEGIES`, at the same micro batch, accumulation, sequence length, precision and
    activation checkpointing as ``setting``, with the same probes, in one launch.

    What differs, and the figures say so: FSDP2 runs eagerly (``setting.compile`` is not applied: DeepSpeed's
    ``engine.compile()`` has no FSDP2 counterpart in the course's PyTorch loop) and steps
    ``torch.optim.AdamW``. Returns ``{"measured": True, "runs": {strategy label: measurements}, "mfu": the
    best MFU, "eager": True}`` or ``{"measured": False, "reason": ...}``.
    """

    plain = dataclasses.replace(setting, compile=False)
    folder = launch.RUNS_DIR / name
    specs = {f"fsdp2-{strategy}": launch.RunSpec(
        plain.config(world_size), model=MODEL, steps=steps, name=f"fsdp2-{strategy}",
        out=folder / f"fsdp2-{strategy}", probes=PROBES, model_options=plain.model_options(size),
        builder=BUILDER, task=frameworks.TASK, options={"strategy": strategy}) for strategy in FSDP2_STRATEGIES}
    try:
        found = launch.sweep(specs, name=f"{name}/fsdp2", world_size=world_size, launcher="torchrun",
                             timeout=timeout, progress=progress)
    except launch.RunFailed as failure:
        return {"measured": False, "reason": f"the FSDP2 launch failed: {str(failure).splitlines()[0][:200]}"}
    runs = {frameworks.STRATEGIES[s].label: measurements(found[f"fsdp2-{s}"]) for s in FSDP2_STRATEGIES}
    mfus = [r["mfu"] for r in runs.values() if r["mfu"] is not None]
    return {"measured": True, "eager": True, "setting": dataclasses.asdict(plain), "runs": runs,
            "mfu": max(mfus) if mfus else None, "metric": max(r["metric"] for r in runs.values())}


# --- tables ---------------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _launch_index(run_name: str) -> int:
    """A candidate's place in its rung's launch, from its run name (``[w<walk>-]<launch>-<rung>-<i>-<label>``)."""
    match = re.search(r"\d+-[a-z]+-(\d+)-", run_name)
    return int(match.group(1)) if match else 0


#: The mark of a peak that may include memory of earlier runs of its launch, explained once where tables show it
#: (the course's tables print :data:`helpers.core.records.PEAK_NOTE` under each; the capstone prints this once).
PEAK_NOTE = ("<= : an upper bound: an earlier run of the same launch may still have held GPU memory when this "
             "run peaked (docs/capstone-walks.md says which runs, and why).")


def _without_peak_note(table: str) -> str:
    """A table of :func:`records.format_table` without the footnote it adds under marked peaks."""
    return table.replace("\n" + records.PEAK_NOTE, "")


def marks_peaks(ladder: dict) -> bool:
    """Whether a ladder's tables mark any peak as an upper bound (so :data:`PEAK_NOTE` belongs under them)."""
    rows = list(ladder["candidates"]) + list(((ladder.get("fsdp2") or {}).get("runs") or {}).values())
    return any(r.get("peak_upper_bound") or _memory_maybe_held_by_earlier(r) for r in rows)


def whole_sentences(failure: str, stored: int = 150) -> str:
    """A failure message as a ladder stores it (cut at a fixed length), shown without a cut word: an
    out-of-memory message back to its last whole sentence, another one at least ``stored`` characters long back to
    its last whole word, marked "...", where it does not end a sentence."""
    if _out_of_memory(failure) and ". " in failure:
        return failure[:failure.rindex(". ") + 1]
    if len(failure) >= stored and not failure.endswith((".", ")")) and " " in failure:
        return failure[:failure.rindex(" ")] + " ..."
    return failure


def _peak(figures: dict) -> str:
    """A candidate's peak memory, marked where it may include earlier candidates of its launch."""
    return records.format_bytes_bound(figures["peak_bytes"], bool(figures.get("peak_upper_bound")))


def ladder_table(ladder: dict) -> str:
    """Every candidate of a ladder (``Ladder.to_dict()``, live or from a committed reference): what it
    changed from the baseline, its figures and its verdict."""
    rows = []
    for c in ladder["candidates"]:
        verdict = whole_sentences(c["verdict"]) + (f" ({c['note']})" if c.get("note") else "")
        if c.get("failure") and "tokens_per_s" not in c:
            if _memory_maybe_held_by_earlier(c):
                verdict = f"{records.UPPER_BOUND}memory: earlier candidates of its launch may have held some; " + verdict
            rows.append([c["rung"], c["label"], "-", "-", "-", "-", "-", verdict])
            continue
        tflops = "-" if c["tflops_per_gpu"] is None else f"{c['tflops_per_gpu']:.4g}"
        rows.append([c["rung"], c["label"], f"{c['tokens_per_s']:,.0f}", tflops, _pct(c["mfu"]),
                     _peak(c), _pct(c["comm_exposed_share"]), verdict])
    per = "rank" if ladder["device"].startswith("CPU") else "GPU"
    return _without_peak_note(records.format_table(rows, ["rung", "candidate", "tokens/s", f"TFLOP/s/{per}", "MFU",
                                                          "peak mem", "comm exposed", "verdict"]))


def fsdp2_table(ladder: dict) -> str:
    """DeepSpeed's baseline and best beside FSDP2's runs of the best setting: tokens/s, model TFLOP/s, MFU,
    peak memory (FSDP2 eager; see :func:`fsdp2_run`)."""
    best = {c["run"]: c for c in ladder["candidates"]}.get(ladder.get("best_run"))
    entries = [(f"DeepSpeed {c['label']}", c) for c in ladder["candidates"]
               if c["verdict"] == "baseline" and "tokens_per_s" in c]
    if best is not None and best["verdict"] != "baseline":
        entries.append((f"DeepSpeed best: {best['label']}", best))
    partner = fsdp2_partner(ladder)
    if partner is not None and partner is not best and partner["verdict"] != "baseline":
        entries.append((f"DeepSpeed, FSDP2's batch: {partner['label']}", partner))
    fsdp2 = ladder.get("fsdp2") or {}
    eager = next((c for c in ladder["candidates"] if fsdp2.get("measured") and "tokens_per_s" in c
                  and not c["setting"].get("compile") and _samples(c["setting"]) == _samples(fsdp2["setting"])
                  and c is not partner and c["verdict"] != "baseline"), None)
    if eager is not None and (partner is None or partner["setting"].get("compile")):
        entries.append((f"DeepSpeed, FSDP2's batch, eager: {eager['label']}", eager))
    entries += [(f"{label}, eager", r) for label, r in (fsdp2.get("runs") or {}).items()]
    rows = [[name, f"{r['tokens_per_s']:,.0f}", "-" if r["tflops_per_gpu"] is None else f"{r['tflops_per_gpu']:.4g}",
             _pct(r["mfu"]), _peak(r)] for name, r in entries if r]
    per = "rank" if ladder["device"].startswith("CPU") else "GPU"
    return _without_peak_note(records.format_table(rows, ["run", "tokens/s", f"TFLOP/s/{per}", "MFU", "peak mem"]))


def rungs_table(ladder: dict) -> str:
    """Each rung: what it tunes, whether it ran (or why not) and what it kept."""
    rows = [[r["rung"], r["what"], "ran" if r["ran"] else f"skipped: {r['why']}", r.get("kept") or "-"]
            for r in ladder["rungs"]]
    return records.format_table(rows, ["rung", "tunes", "outcome", "kept"])


def best_mfu_and_exposed(ladder: dict) -> tuple[float, float] | None:
    """The best setting's MFU and the share of its step that was exposed communication (the baseline's: the
    mean of its two runs, as in :func:`summary`), or None where the device has no MFU or no such share."""
    best = next(c for c in ladder["candidates"] if c["run"] == ladder["best_run"])
    rows = [c for c in ladder["candidates"] if c["verdict"] == "baseline"] if best["verdict"] == "baseline" else [best]
    if any(r.get("mfu") is None or r.get("comm_exposed_share") is None for r in rows):
        return None
    mfu, exposed = (sum(r[k] for r in rows) / len(rows) for k in ("mfu", "comm_exposed_share"))
    return mfu, exposed


def shortfall(ladder: dict) -> str:
    """What stands between the ladder's best candidate and the MFU target, from its own figures: the share of
    its step that was exposed communication bounds what hiding communication could still give
    (MFU / (1 - exposed share)); the rest of the gap is time the GPU spent below its peak while computing."""
    best = next(c for c in ladder["candidates"] if c["run"] == ladder["best_run"])
    target = ladder["target_mfu"]
    found = best_mfu_and_exposed(ladder)
    if found is None:
        return "no MFU or no communication share for this device: nothing to bound"
    mfu, exposed = found
    if mfu >= target:
        return f"the target is reached: {mfu:.1%} MFU against {target:.0%}"
    bound = mfu / (1 - exposed)
    line = (f"best {mfu:.1%} MFU with {exposed:.1%} of its step exposed communication: hiding all of it would give "
            f"at most {bound:.1%}")
    again = best_repeats(ladder)
    if len(again) > 1 and target - mfu < max(again) - min(again):
        line = (f"best {mfu:.1%} MFU, {100 * (target - mfu):.2f} points short of {target:.0%}: less than the spread of "
                f"the same setting over its {len(again)} launches ({min(again):.2%} to {max(again):.2%}), so the "
                f"target is at the edge of the noise. {exposed:.1%} of its step was exposed communication: hiding all "
                f"of it would give at most {bound:.1%}")
    if bound < target:
        return line + (f", still {100 * (target - bound):.1f} points short of {target:.0%}. The rest is compute below the GPU's peak "
                       "(the kernels between the matrix products, attention, the optimizer step), not communication.")
    # measured overlap candidates that were dropped: hiding was tried and did not pay on this setting
    tried = [(c["label"], m.group(1), c["setting"]) for c in ladder["candidates"]
             if c.get("rung") == "overlap" and "tokens_per_s" in c and c["verdict"].startswith("dropped")
             and (m := re.search(r"([+-]\d+(?:\.\d+)?%)", c["verdict"]))]
    if tried:
        best_setting = Setting(**best["setting"])
        on = ", ".join(f"{label} {gain}" + ("" if _samples(setting) == _samples(best["setting"]) else
                                           f" (tried on micro batch {setting['micro_batch']} x accumulation "
                                           f"{setting['grad_accum']}, before the kept {best_setting.micro_batch} x "
                                           f"{best_setting.grad_accum})")
                       for label, gain, setting in tried)
        return line + f", enough for {target:.0%} on paper; but the overlap rung did not hide it here ({on})."
    return line + f", enough for {target:.0%}: the communication left is what stands in the way."


def summary(ladder: dict) -> str:
    """The best setting against the baseline and the target, in words and numbers from the ladder."""
    rows = {c["run"]: c for c in ladder["candidates"]}
    base = [c for c in ladder["candidates"] if c["verdict"] == "baseline"]
    best = rows.get(ladder["best_run"])
    if not base or best is None:
        return "The ladder has no measured baseline."
    unit = "model TFLOP/s per " + ("rank" if ladder["device"].startswith("CPU") else "GPU")
    base_value = sum(c["metric"] for c in base) / len(base)
    lines = [f"{ladder['device']}, {ladder['world_size']} rank(s), {ladder['params']:,} parameters"]
    usual = CPU_BASELINE if ladder["device"].startswith("CPU") else GPU_BASELINE
    start = Setting(**ladder["baseline"]) if "baseline" in ladder else usual
    if start != usual:
        lines.append(f"the walk started from {start.changes_from(usual)} (--start), not the usual baseline: "
                     "'baseline' below is that setting")
    if ladder.get("withheld"):
        value, mfu = base_value, _mean([c.get("mfu") for c in base])
        lines.append(f"verdicts withheld: {ladder['withheld']}; the baseline's {unit} {value:.3g} "
                     "(mean of its two runs), and no candidate is called kept or dropped")
    elif best["verdict"] == "baseline":
        value, mfu = base_value, _mean([c.get("mfu") for c in base])
        lines.append(f"no candidate beat the baseline by more than the {ladder['margin']:.1%} margin: "
                     f"{unit} {value:.3g} (mean of its two runs)")
    else:
        value, mfu = best["metric"], best.get("mfu")
        lines.append(f"best: {ladder['best_label']} ({best['changes']})")
        lines.append(f"{unit} {value:.3g}, {value / base_value:.2f}x the baseline's {base_value:.3g}")
    if mfu is not None:
        verdict = "reached" if mfu >= ladder["target_mfu"] else "not reached"
        lines.append(f"MFU {mfu:.1%} (target {ladder['target_mfu']:.0%}: {verdict}); "
                     f"exposed communication {_pct(best['comm_exposed_share'])} of a step")
    else:
        lines.append("MFU: none (no dense bf16 peak for this device)")
    again = best_repeats(ladder)
    if len(again) > 1 and mfu is not None:
        reached = sum(m >= ladder["target_mfu"] for m in again)
        lines.append(f"the best setting in all {len(again)} launches that trained it: MFU {min(again):.2%} to "
                     f"{max(again):.2%}, median {statistics.median(again):.2%}; {reached} of {len(again)} at or "
                     f"above the target")
    lines.append(fsdp2_line(ladder))
    return "\n".join(lines)


def setting_label(setting: dict | Setting, start: Setting | None = None) -> str:
    """A setting by what it trains with, not by what changed ("micro 16 x accum 2, compiled"): its ZeRO stage
    where not 2, micro batch x accumulation, and each knob it sets; its sequence length and optimizer only where
    they differ from ``start`` (the ladder's baseline; the GPU baseline by default)."""
    s = setting if isinstance(setting, Setting) else Setting(**setting)
    start = start or GPU_BASELINE
    parts = ([f"ZeRO-{s.stage}"] if s.stage != 2 else []) + [f"micro {s.micro_batch} x accum {s.grad_accum}"]
    if s.seq_len != start.seq_len:
        parts.append(f"sequence {s.seq_len}")
    if s.overlap_comm:
        parts.append("overlap_comm")
    buckets = {name: getattr(s, f"{name}_bucket_size") for name in ("reduce", "allgather", "prefetch")}
    if buckets["reduce"] is not None and buckets["reduce"] == buckets["allgather"]:
        buckets = {"": buckets["reduce"], "prefetch": buckets["prefetch"]}  # both ZeRO-2 buckets at one size
    parts += [f"{name} bucket{'s' if not name else ''} {_short(size)}".strip() for name, size in buckets.items()
              if size is not None]
    if s.checkpointing:
        parts.append("checkpointing")
    if s.optimizer != start.optimizer:
        parts.append("torch AdamW" if s.optimizer == "torch" else "FusedAdam")
    if s.compile:
        parts.append("compiled")
    return ", ".join(parts)


def _near_target(ladder: dict, mfu: float) -> str:
    """The MFU against the target, and whether the ladder's margin can tell them apart."""
    target = ladder["target_mfu"]
    verdict = f"MFU {mfu:.1%}, target {target:.0%} {'reached' if mfu >= target else 'not reached'}"
    if abs(mfu / target - 1) <= ladder["margin"]:
        verdict += (f", but within the {ladder['margin']:.1%} margin of it: the noise cannot tell "
                    f"{mfu:.1%} from {target:.0%}")
    return verdict


def kept_path(ladder: dict) -> str:
    """The path a ladder kept, as a table from its data: the setting it started from (the mean of its two runs),
    each kept candidate with the figure it beat and its gain, and each time a later walk trained the kept setting
    again ("best so far, again", the yardstick of that walk's candidates; its rung column says "re-run before" the
    rung whose candidates it judged) with how far it moved from that setting's last figure; then the setting it
    ended with, its MFU as measured when it was kept against the target, whether the margin can tell, and the MFU
    its re-runs measured. Where no candidate trained, it says so and which rungs the time budget skipped."""
    per = "rank" if ladder["device"].startswith("CPU") else "GPU"
    start = Setting(**ladder["baseline"])
    base = [c for c in ladder["candidates"] if c["verdict"] == "baseline" and "metric" in c]
    against = sum(c["metric"] for c in base) / len(base)
    rows = [["start", setting_label(start, start), f"{against:.4g}", _pct(_mean([c.get("mfu") for c in base])),
             f"mean of {len(base)} runs; margin {ladder['margin']:.1%}"]]
    moves = []
    for c in ladder["candidates"]:
        if c["verdict"].startswith(AGAIN_VERDICT) and "metric" in c:
            move = c["metric"] / against - 1
            moves.append(abs(move))
            rows.append([f"re-run before {c['rung']}", setting_label(c["setting"], start), f"{c['metric']:.4g}",
                         _pct(c.get("mfu")), f"trained again: {move:+.1%} from {against:.4g}"])
            against = c["metric"]
        elif c["verdict"].startswith("kept"):
            rows.append([c["rung"], setting_label(c["setting"], start), f"{c['metric']:.4g}", _pct(c.get("mfu")),
                         f"kept: {c['metric'] / against - 1:+.1%} over {against:.4g}"])
            against = c["metric"]
    lines = [records.format_table(rows, ["rung", "setting", f"TFLOP/s/{per}", "MFU", "verdict"])]
    if len(rows) == 1:
        lines.append(_nothing_kept(ladder))
    if moves:
        lines.append(f"trained again, the same setting moved by up to {max(moves):.1%} between launches, against the "
                     f"{ladder['margin']:.1%} margin: a gain close to the margin is at the edge of the noise")
    found = best_mfu_and_exposed(ladder)
    if found is not None:
        best = next(c for c in ladder["candidates"] if c["run"] == ladder["best_run"])
        lines.append(f"ends at {setting_label(best['setting'], start)}: {_near_target(ladder, found[0])}")
        line = "that MFU is " + ("the mean of its two runs" if best["verdict"] == "baseline" else
                                 f"its figure when it was kept ({best['metric']:.4g} TFLOP/s/{per})")
        again = [c["mfu"] for c in ladder["candidates"] if c["verdict"].startswith(AGAIN_VERDICT)
                 and c.get("mfu") is not None and c["setting"] == best["setting"]]
        if again:
            line += f"; its re-runs measured MFU {min(again):.1%} to {max(again):.1%}"
        lines.append(line)
    return "\n".join(lines)


def _nothing_kept(ladder: dict) -> str:
    """Why a ladder kept nothing: no candidate trained (and the rungs the time budget skipped), or none beat the
    start by more than the margin."""
    tried = [c for c in ladder["candidates"] if c["verdict"] != "baseline"]
    if tried:
        return f"nothing kept: no candidate beat the start by more than the {ladder['margin']:.1%} margin"
    skipped = [r["rung"] for r in ladder["rungs"] if not r["ran"] and r["why"].startswith(BUDGET_SKIP)]
    return ("no candidate trained: only the start, measured twice"
            + (f"; the time budget skipped rung{'s' if len(skipped) > 1 else ''} {', '.join(skipped)}"
               if skipped else ""))


def dropped_lines(ladder: dict) -> str:
    """One line per rung of what a ladder did not keep, each setting once, by what it trains with: its gain over
    the figure it was judged against, or why it failed; a failed setting that a later walk measured shows only
    that measurement."""
    start = Setting(**ladder["baseline"])
    measured = {setting_label(c["setting"], start) for c in ladder["candidates"] if "metric" in c}
    by_rung: dict[str, dict[str, str]] = {}
    for c in ladder["candidates"]:
        verdict = _short_verdict(c)
        label = setting_label(c["setting"], start)
        if verdict.startswith(("dropped", "not eligible")):
            by_rung.setdefault(c["rung"], {})[label] = f"{label} {verdict.replace('dropped ', '')}"
        elif verdict.startswith("failed") and label not in measured:
            by_rung.setdefault(c["rung"], {})[label] = f"{label} {verdict.replace('failed: ', '')}"
    return "\n".join(f"not kept at {rung!r}: " + "; ".join(found.values()) for rung, found in by_rung.items())


def best_repeats(ladder: dict) -> list[float]:
    """The MFU of every measured candidate that trained the best setting, in walk order: the run that kept it and
    each "best so far, again" of later launches (the spread between machines and launches)."""
    best = ladder.get("best")
    return [c["mfu"] for c in ladder["candidates"]
            if best and c.get("setting") == best and c.get("mfu") is not None and c["verdict"] != "baseline"]


def fsdp2_line(ladder: dict) -> str:
    """What PyTorch FSDP2 reached on the best setting (eager), beside DeepSpeed's best, or why it did not run."""
    fsdp2 = ladder.get("fsdp2") or {}
    if not fsdp2.get("measured"):
        return "FSDP2: " + whole_sentences(fsdp2.get("reason", "not run"))
    parts = []
    for label, r in fsdp2["runs"].items():
        figure = f"{r['mfu']:.1%} MFU" if r.get("mfu") is not None else f"{r['tokens_per_s']:,.0f} tokens/s"
        parts.append(f"{label} {figure}")
    best, setting = ladder.get("best") or {}, fsdp2["setting"]
    earlier = bool(best) and _samples(best) != _samples(setting)
    on = (f"an earlier best setting (micro batch {setting['micro_batch']} x accumulation {setting['grad_accum']}, "
          "measured before a resumed walk changed the batch)" if earlier else "the best setting")
    latest = (f"; on the best setting since: {whole_sentences(fsdp2['latest']['reason'])}"
              if earlier and "latest" in fsdp2 else "")
    return (f"FSDP2 on {on}, eager, torch.optim.AdamW: " + "; ".join(parts)
            + (" (DeepSpeed's best above was compiled)" if best.get("compile") else "") + latest)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def same_math(ladder: dict) -> str:
    """Candidates that train the same samples in the same precision as the baseline (same micro batch x
    accumulation and sequence length): their losses must agree with the baseline's, within the precision's
    tolerance (:data:`helpers.core.records.LOSS_TOLERANCE`), since stage, buckets, overlap, checkpointing and
    compilation change where and when the work happens, not the arithmetic."""
    rows = [c for c in ladder["candidates"] if "losses" in c]
    base = next((c for c in rows if c["verdict"] == "baseline"), None)
    if base is None:
        return "No baseline was measured."

    def batch(c: dict) -> tuple:
        s = c["setting"]
        return s["micro_batch"] * s["grad_accum"], s["seq_len"], s["precision"]

    table = [[c["label"], c["changes"], records.loss_agreement(c["losses"], base["losses"], c["setting"]["precision"])]
             for c in rows if c is not base and batch(c) == batch(base)]
    return records.format_table(table, ["candidate", "changed from the baseline", "losses vs the baseline"])


def _samples(setting: dict) -> tuple:
    """What decides the losses a setting trains: micro batch, accumulation, sequence length, precision."""
    return setting["micro_batch"], setting["grad_accum"], setting["seq_len"], setting["precision"]


def fsdp2_partner(ladder: dict) -> dict | None:
    """The DeepSpeed candidate FSDP2's runs are set beside: the ladder's best when FSDP2 trained its micro batch,
    accumulation, sequence length and precision, else (FSDP2 measured in an earlier walk of a resumed
    ladder) the last kept or baseline candidate that trained those; None when none did or FSDP2 did not run."""
    fsdp2 = ladder.get("fsdp2") or {}
    if not fsdp2.get("measured"):
        return None

    rows = {c["run"]: c for c in ladder["candidates"]}
    best = rows.get(ladder.get("best_run"))
    if best is not None and _samples(best["setting"]) == _samples(fsdp2["setting"]):
        return best
    return next((c for c in reversed(ladder["candidates"]) if c["verdict"].startswith(("kept", "baseline"))
                 and _samples(c["setting"]) == _samples(fsdp2["setting"])), None)


def trained_lines(ladder: dict) -> str:
    """One line per run a walk launched, in order, from its dict (:meth:`Ladder.to_dict`): each candidate's label
    and rung with how many steps it recorded a loss for, or why it failed; then FSDP2's runs, or why it did not
    run. What the progress bars show while it trains, summed up after."""
    lines = []
    for c in ladder["candidates"]:
        done = f"{len(c['losses'])} steps" if c.get("losses") else c["verdict"]
        lines.append(f"{c['rung']}: {c['label']}: {done}")
    fsdp2 = ladder.get("fsdp2") or {}
    if fsdp2.get("measured"):
        lines += [f"torchrun: {label}: {len(run['losses'])} steps" for label, run in fsdp2["runs"].items()]
    else:
        lines.append(f"torchrun: FSDP2 {_no_fsdp2_figure(fsdp2.get('reason', 'not run'))}")
    return "\n".join(lines)


def fsdp2_same_math(ladder: dict) -> str:
    """FSDP2's runs against the DeepSpeed run whose samples, precision and checkpointing they trained
    (:func:`fsdp2_partner`: DeepSpeed's best, normally): another framework sums the same numbers in another
    order, so the losses must agree within :data:`helpers.core.records.REORDERED_TOLERANCE`; or why FSDP2 did not run."""
    fsdp2 = ladder.get("fsdp2") or {}
    if not fsdp2.get("measured"):
        return "FSDP2 did not run: " + fsdp2.get("reason", "not run")
    partner = fsdp2_partner(ladder)
    if partner is None or "losses" not in partner:
        return "No DeepSpeed run here trained FSDP2's samples with its losses kept: no comparison"
    tolerance = records.REORDERED_TOLERANCE[fsdp2["setting"]["precision"]]
    table = [[label, f"{len(r['losses'])} steps", records.loss_agreement(r["losses"], partner["losses"], tolerance=tolerance)]
             for label, r in fsdp2["runs"].items()]
    against = "DeepSpeed's best" if partner["run"] == ladder.get("best_run") else f"DeepSpeed's {partner['label']}"
    return records.format_table(table, ["PyTorch run (torchrun)", "trained", f"losses vs {against}"])


def save(ladder: Ladder, note: str = "", earlier: dict | None = None) -> tuple[Path, Path | None]:
    """Write ``runs/<name>/ladder.json``; on GPUs also keep the ladder and its records as the reference
    ``capstone-ladder`` (:func:`helpers.core.references.save_reference`), carrying on ``earlier``, the reference
    a resumed walk started from (:func:`load_resume`, :func:`combine_references`). Returns both paths."""

    data = ladder.to_dict()
    folder = launch.RUNS_DIR / "capstone"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ladder-{ladder.size}-{ladder.world_size}r.json"
    path.write_text(json.dumps(data, indent=1))
    runs = {}
    for row in (ladder.previous or {}).get("candidates", []):  # a resumed walk: the earlier records, if here
        try:
            runs[row["run"]] = records.load(launch.RUNS_DIR / ladder.name / row["run"])
        except (OSError, ValueError):
            pass
    runs.update({c.run_name: c.record for c in ladder.candidates if c.record is not None})
    reference = references.save_reference(f"capstone-ladder-{ladder.size}", {**runs, "ladder": data}, note) if runs else None
    if reference is not None and earlier is not None:
        reference.write_text(json.dumps(combine_references(earlier, json.loads(reference.read_text())), indent=1))
    return path, reference


def _skipped(fsdp2: dict) -> bool:
    """FSDP2 was not tried in that walk: no time was left for it."""
    return not fsdp2.get("measured") and fsdp2.get("reason", "").startswith(BUDGET_SKIP)


def _carry_fsdp2(before: dict, now: dict) -> dict:
    """The FSDP2 entry of a walk that resumed a ladder: this walk's measurement; else the earlier walks' one,
    with this walk's outcome as ``latest`` (why it did not measure), unless it did not try and an earlier
    walk's ``latest`` says more."""
    if now.get("measured") or not before.get("measured"):
        return now
    return {**before, "latest": before["latest"] if _skipped(now) and before.get("latest") else
            {"reason": now.get("reason", "not run")}}


def load_resume(path: str | Path) -> tuple[dict, dict | None]:
    """What ``benchmarks/capstone.py --resume`` names: a ``ladder-<size>-<N>r.json`` (returns it, None) or a
    committed reference ``capstone-ladder-<size>-<device>.json`` (returns its ladder and the reference, whose
    records, note and conditions the resumed walk's reference carries on)."""
    data = json.loads(Path(path).read_text())
    if "experiment" not in data:
        return data, None
    if not str(data["experiment"]).startswith("capstone-ladder") or "ladder" not in data.get("runs", {}):
        raise ValueError(f"--resume {path}: a reference of {data['experiment']!r}, not of a capstone ladder; "
                         "give a runs/capstone/ladder-<size>-<N>r.json or a notebooks/reference/capstone-ladder-*.json")
    return data["runs"]["ladder"], data


def combine_references(earlier: dict, later: dict) -> dict:
    """One reference for a ladder climbed in several walks: ``later`` (a resumed walk's reference: its ladder
    holds every walk's candidates; its software and hardware) with ``earlier``'s records added (``later``'s win
    where names repeat) and both notes and conditions, earlier first. Raises a ValueError where ``later`` did
    not resume ``earlier`` (another experiment or device, or earlier candidates missing from its ladder)."""
    if (earlier["experiment"], earlier["device"]) != (later["experiment"], later["device"]):
        raise ValueError(f"{later['experiment']} on {later['device']} does not continue "
                         f"{earlier['experiment']} on {earlier['device']}")
    kept = {c["run"] for c in later["runs"]["ladder"]["candidates"]}
    missing = [c["run"] for c in earlier["runs"]["ladder"]["candidates"] if c["run"] not in kept]
    if missing:
        raise ValueError(f"the later ladder did not resume the earlier one: {len(missing)} earlier candidates are "
                         f"not in it ({missing[0]}, ...); resume with --resume <the earlier file>")
    runs = {k: v for k, v in earlier["runs"].items() if k != "ladder"} | later["runs"]
    after = later["runs"]["ladder"].get("fsdp2") or {}
    if "latest" in after:  # the later walk did not measure FSDP2: the rule its save applies, for walks saved before it
        runs["ladder"] = {**later["runs"]["ladder"],
                          "fsdp2": _carry_fsdp2(earlier["runs"]["ladder"].get("fsdp2") or {}, after["latest"])}
    return {**later, "runs": runs,
            "note": "; ".join(x for x in (earlier.get("note"), later.get("note")) if x),
            "conditions": "; ".join(x for x in (earlier.get("conditions"), later.get("conditions")) if x)}


def reference_ladders(size: str = "1.2b") -> list[tuple[str, str, str, str, dict]]:
    """Committed GPU ladders of ``size``: (device, date, note, conditions, ladder dict), oldest file name first."""

    name = f"capstone-ladder-{size}"
    return [(device, date, note, conditions, _mark_peaks(runs["ladder"], runs)) for (device, date, note, runs), conditions
            in zip(references.reference_runs(name), references.reference_conditions(name)) if "ladder" in runs]


def _mark_peaks(ladder: dict, runs: dict) -> dict:
    """A committed ladder with each candidate's ``peak_upper_bound`` read from its record beside it (ladders
    saved before that flag existed lack it)."""
    def marked(figures: dict, record) -> dict:
        known = isinstance(record, records.Record) and "peak_bytes" in figures
        return {**figures, "peak_upper_bound": records.peak_may_include_earlier_runs(record)} if known else figures

    # FSDP2's runs keep no record in a reference: the second of their one launch (FSDP2_STRATEGIES) is marked
    gpu, fsdp2 = not ladder["device"].startswith("CPU"), ladder.get("fsdp2") or {}
    fsdp2_runs = {label: r if not r or "peak_upper_bound" in r else {**r, "peak_upper_bound": gpu and i > 0}
                  for i, (label, r) in enumerate((fsdp2.get("runs") or {}).items())}
    return {**ladder, "candidates": [marked(c, runs.get(c.get("run"))) for c in ladder["candidates"]],
            **({"fsdp2": {**fsdp2, "runs": fsdp2_runs}} if fsdp2_runs else {})}


# --- figures ----------------------------------------------------------------------------------------

def ladder(ladder: dict, title: str | None = None, horizontal: bool = False):
    """One bar per candidate of a capstone ladder (``Ladder.to_dict()``): its model TFLOP/s per GPU (or
    tokens/s), coloured by verdict, with the baseline's mean as a line and, where the device has a known
    peak, the MFU target as a second line. ``horizontal``: one row per candidate, top to bottom in the
    order they trained (readable for a long ladder)."""
    plt = plots.pyplot()
    rows = [c for c in ladder["candidates"] if "metric" in c]
    colours = {"baseline": "#8C8C8C", "kept": "#55A868", "dropped": "#C44E52", "not eligible": "#DD8452",
               WITHHELD: "#C8C8C8"}
    size = (7.0, 1.0 + 0.26 * max(1, len(rows))) if horizontal else (1.2 + 0.9 * max(1, len(rows)), 3.8)
    fig, ax = plt.subplots(figsize=size)
    values = [c["metric"] for c in rows]
    colour = [next((v for k, v in colours.items() if c["verdict"].startswith(k)), "#4C72B0") for c in rows]
    start = Setting(**ladder["baseline"])
    names = [f"{c['rung']}: {setting_label(c['setting'], start)}" for c in rows]
    line = ax.axvline if horizontal else ax.axhline
    if horizontal:
        ax.barh(range(len(rows)), values, color=colour)
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()  # the first candidate on top
    else:
        ax.bar(range(len(rows)), values, color=colour)
        ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=7)
    uses_flops = bool(rows) and rows[0].get("tflops_per_gpu") is not None
    per = "rank" if ladder["device"].startswith("CPU") else "GPU"
    (ax.set_xlabel if horizontal else ax.set_ylabel)(f"model TFLOP/s per {per}" if uses_flops else "tokens/s")
    base = [c["metric"] for c in rows if c["verdict"] == "baseline"]
    if base:
        line(sum(base) / len(base), color="#8C8C8C", linestyle="--", linewidth=1, label="baseline (mean)")
    peak_rows = [c for c in rows if c.get("mfu")]
    if uses_flops and peak_rows:
        peak = peak_rows[0]["tflops_per_gpu"] / peak_rows[0]["mfu"]
        line(ladder["target_mfu"] * peak, color="#4C72B0", linestyle=":", linewidth=1,
             label=f"{ladder['target_mfu']:.0%} MFU target")
    if base:
        ax.legend(fontsize=8)
    ax.set_title(title or f"Capstone ladder: {ladder['device']}, {ladder['world_size']} rank(s)", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- the key result and the exercises -------------------------------------------------------------

def takeaway(ladder: dict) -> str:
    """One line from a ladder's data: the rungs that kept a candidate and the setting it ended at, its MFU against
    the target (within the margin or not), and what hiding its exposed communication could add."""
    kept = [c["rung"] for c in ladder["candidates"] if c["verdict"].startswith("kept")]
    skipped = [r["rung"] for r in ladder["rungs"] if not r["ran"] and r["why"].startswith(BUDGET_SKIP)]
    found = best_mfu_and_exposed(ladder)
    best = next(c for c in ladder["candidates"] if c["run"] == ladder["best_run"])
    line = "Takeaway: " + (f"kept at rungs {', '.join(kept)}, ending at "
                           f"{setting_label(best['setting'], Setting(**ladder['baseline']))}" if kept else
                           _nothing_kept(ladder))
    if found is not None:
        mfu, exposed = found
        line += (f"; {_near_target(ladder, mfu)}; "
                 f"exposed communication {exposed:.1%} of a step, so hiding it could add at most "
                 f"{(mfu / (1 - exposed) - mfu) * 100:.1f} points of MFU")
    if skipped and any(c["verdict"] != "baseline" for c in ladder["candidates"]):
        line += f"; rungs the time budget skipped: {', '.join(skipped)}"
    return line + "."


def reference_block(entry: tuple[str, str, str, str, dict]) -> str:
    """One committed GPU ladder (an entry of :func:`reference_ladders`) as the chapter shows it: headed by its
    device and date (then :data:`PEAK_NOTE` where a peak is marked), its candidates, rungs, summary, shortfall,
    FSDP2 beside it, and its takeaway."""
    device, date, note, _conditions, gpu_ladder = entry
    parts = [f"{gpu_ladder['params'] / 1e9:.2f}B parameters, measured on {device}, {date} ({note}):"]
    parts += [PEAK_NOTE] if marks_peaks(gpu_ladder) else []
    parts += [ladder_table(gpu_ladder), rungs_table(gpu_ladder), summary(gpu_ladder), shortfall(gpu_ladder)]
    if (gpu_ladder.get("fsdp2") or {}).get("measured"):
        parts += [fsdp2_table(gpu_ladder), fsdp2_same_math(gpu_ladder)]
    return "\n".join(parts + [takeaway(gpu_ladder)])


def _short_verdict(c: dict) -> str:
    """A candidate's verdict in a few words: kept / dropped / not eligible with its gain, the reason a run
    failed (out of memory, or its error's name), or baseline / the kept setting trained again."""
    verdict = c["verdict"]
    if verdict.startswith(AGAIN_VERDICT):
        return AGAIN
    if verdict.startswith("failed"):
        if _out_of_memory(verdict):
            return "failed: out of memory"
        error = re.search(r"(\w+Error)", verdict)
        return f"failed: {error.group(1) if error else 'error'}"
    for word in ("kept", "dropped", "not eligible", WITHHELD):
        if verdict.startswith(word):
            return f"{word} {_gain(verdict)}"
    return verdict


def condensed_block(entry: tuple[str, str, str, str, dict], with_takeaway: bool = True) -> str:
    """One committed GPU ladder (an entry of :func:`reference_ladders`) in a few lines: its model, device and
    date, the path it kept (:func:`kept_path`), one line per rung of what it did not keep (:func:`dropped_lines`)
    and its takeaway (unless ``with_takeaway`` is False). :func:`reference_block` prints the whole record (peaks, exposed communication, failures)."""
    device, date, _note, _conditions, gpu_ladder = entry
    parts = [f"{gpu_ladder['params'] / 1e9:.2f}B on {device}, {date}:", kept_path(gpu_ladder),
             dropped_lines(gpu_ladder), takeaway(gpu_ladder) if with_takeaway else ""]
    return "\n".join(p for p in parts if p)


def _same_batch_run(ladder: dict, setting: dict, compiled: bool) -> dict | None:
    """The measured DeepSpeed candidate that trained ``setting``'s samples without checkpointing, compiled or
    eager (the baseline first, then the earliest other), or None."""
    rows = [c for c in ladder["candidates"] if c.get("tflops_per_gpu") is not None
            and _samples(c["setting"]) == _samples(setting) and bool(c["setting"].get("compile")) == compiled
            and not c["setting"].get("checkpointing")]
    return next((c for c in rows if c["verdict"] == "baseline"), rows[0] if rows else None)


def _no_fsdp2_figure(reason: str) -> str:
    return "ran out of memory" if _out_of_memory(reason) else f"has no figure ({whole_sentences(reason)})"


def fsdp2_takeaway(ladder: dict) -> str:
    """FSDP2 against DeepSpeed in one line, from a committed ladder: eager against eager on the batch FSDP2
    trained (DeepSpeed's baseline: the mean of its two runs), each gap set against the ladder's margin, and
    compiled DeepSpeed on that batch where the ladder measured it; or why FSDP2 has no figure there."""
    where = f"{ladder['params'] / 1e9:.2f}B on {ladder['device']}"
    fsdp2 = ladder.get("fsdp2") or {}
    if not fsdp2.get("measured"):
        return f"{where}: FSDP2 {_no_fsdp2_figure(fsdp2.get('reason', 'not run'))}"
    setting = fsdp2["setting"]
    line = f"{where}, micro batch {setting['micro_batch']} x accumulation {setting['grad_accum']}: "
    eager = _same_batch_run(ladder, setting, compiled=False)
    if eager is not None:
        runs = [c for c in ladder["candidates"] if c["verdict"] == "baseline"] if eager["verdict"] == "baseline" \
            else [eager]
        ds = sum(c["tflops_per_gpu"] for c in runs) / len(runs)
        gaps = [r["tflops_per_gpu"] / ds - 1 for r in fsdp2["runs"].values()]
        within = all(abs(g) <= ladder["margin"] for g in gaps)
        line += (f"eager against eager, " + ", ".join(f"{label} {g:+.1%}" for label, g in zip(fsdp2["runs"], gaps))
                 + f" against DeepSpeed's {ds:.4g} model TFLOP/s per GPU, "
                 + ("within" if within else "not all within") + f" the {ladder['margin']:.1%} margin")
    compiled = _same_batch_run(ladder, setting, compiled=True)
    if compiled is not None:
        line += f"; DeepSpeed with engine.compile() on that batch: {compiled['tflops_per_gpu']:.4g} (FSDP2 ran eager only)"
    if "latest" in fsdp2:
        line += f"; on the best setting since, FSDP2 {_no_fsdp2_figure(fsdp2['latest']['reason'])}"
    return line + _eager_oom_note(ladder)


def _eager_out_of_memory(ladder: dict) -> dict | None:
    """Where FSDP2 ran out of memory on the setting a ladder ended with: the DeepSpeed candidate of that ladder that
    trained the same micro batch, sequence, stage and checkpointing eagerly and ran out of memory too, or None."""
    fsdp2 = ladder.get("fsdp2") or {}
    if not any(r and _out_of_memory(r) for r in (fsdp2.get("reason"), (fsdp2.get("latest") or {}).get("reason"))):
        return None
    best = next(c for c in ladder["candidates"] if c["run"] == ladder["best_run"])["setting"]
    keys = ("micro_batch", "seq_len", "stage", "checkpointing")
    return next((c for c in ladder["candidates"] if not c["setting"].get("compile") and "metric" not in c
                 and _out_of_memory(c.get("failure") or c["verdict"])
                 and all(c["setting"].get(k) == best.get(k) for k in keys)), None)


def _eager_oom_note(ladder: dict) -> str:
    found = _eager_out_of_memory(ladder)
    if found is None:
        return ""
    return (f" (DeepSpeed too ran out of memory at micro batch {found['setting']['micro_batch']} when eager, "
            f"rung {found['rung']!r}: FSDP2 runs eagerly)")


def overlap_line(ladder: dict) -> str | None:
    """What ``overlap_comm`` did in a committed ladder, from its data: each measured overlap candidate's model
    TFLOP/s per GPU against the setting it started from (the kept setting trained again in its launch, else the
    last kept or baseline candidate before it), set against the margin; None where no overlap candidate was
    measured. The probes measure how much communication stayed exposed, not where a step's time went: the line
    says so where overlap was slower."""
    rows = ladder["candidates"]
    tried = [i for i, c in enumerate(rows) if c.get("rung") == "overlap" and c.get("tflops_per_gpu") is not None
             and c["setting"].get("overlap_comm")]
    start = next((c for c in reversed(rows[:tried[0]]) if c.get("tflops_per_gpu") is not None
                  and c["verdict"].startswith((AGAIN_VERDICT, "kept", "baseline"))), None) if tried else None
    if start is None:
        return None
    parts, slower = [], False
    for i in tried:
        gain = rows[i]["tflops_per_gpu"] / start["tflops_per_gpu"] - 1
        slower |= gain < -ladder["margin"]
        parts.append(f"{rows[i]['label']} {rows[i]['tflops_per_gpu']:.4g} ({gain:+.1%})")
    why = (f"slower by more than the {ladder['margin']:.1%} margin (the probes record how much communication stayed "
           "exposed, not where a step's time went)" if slower else f"within the {ladder['margin']:.1%} margin")
    where = setting_label(start["setting"], Setting(**ladder["baseline"]))
    exposed = start.get("comm_exposed_share")
    hidden = "" if exposed is None else f", {exposed:.1%} of its step exposed communication"
    return (f"{ladder['params'] / 1e9:.2f}B on {ladder['device']}, ZeRO-{start['setting']['stage']}, {where}: without "
            f"overlap {start['tflops_per_gpu']:.4g} model TFLOP/s per GPU{hidden}; " + "; ".join(parts) + f": {why}.")


def fsdp2_eager_gap(ladder: dict) -> float | None:
    """FSDP2's faster eager run against DeepSpeed's eager run on the same batch (the baseline: the mean of its two
    runs), as a fraction (-0.003: 0.3% slower), or None where FSDP2 or that DeepSpeed run was not measured."""
    fsdp2 = ladder.get("fsdp2") or {}
    if not fsdp2.get("measured"):
        return None
    eager = _same_batch_run(ladder, fsdp2["setting"], compiled=False)
    if eager is None:
        return None
    runs = [c for c in ladder["candidates"] if c["verdict"] == "baseline"] if eager["verdict"] == "baseline" \
        else [eager]
    ds = sum(c["tflops_per_gpu"] for c in runs) / len(runs)
    return max(r["tflops_per_gpu"] for r in fsdp2["runs"].values()) / ds - 1


def rung_order(ladder: dict, rungs: Sequence[Rung] | None = None) -> str:
    """The rungs a committed ladder ran, in the order it ran them, and those of ``rungs`` (default
    :data:`GPU_LADDER`, the order the chapter lists) it never ran."""
    ran = [r["rung"] for r in ladder["rungs"] if r["ran"]]
    missing = [r.name for r in (GPU_LADDER if rungs is None else rungs) if r.name not in ran]
    return (f"rungs in the order this walk ran them: {', '.join(ran) or 'none'}"
            + (f"; never run: {', '.join(missing)}" if missing else ""))


def takeaway_table(ladders: list[dict]) -> str:
    """One row per committed ladder, from its data: where it ended (MFU, exposed communication of that step),
    FSDP2's faster eager run against DeepSpeed's eager one on the same batch, and whether FSDP2 ran out of memory
    (on the setting it trained or on the best setting since). A second ladder of the same size and GPUs is
    named "walk 2"."""
    rows: list[list[str]] = []
    for ladder in ladders:
        found = best_mfu_and_exposed(ladder)
        fsdp2 = ladder.get("fsdp2") or {}
        reasons = [r for r in (fsdp2.get("reason"), (fsdp2.get("latest") or {}).get("reason")) if r]
        gap = fsdp2_eager_gap(ladder)
        oom = "yes" if any(_out_of_memory(r) for r in reasons) else "no" if fsdp2.get("measured") else "not run"
        name = f"{ladder['params'] / 1e9:.2f}B on {ladder['world_size']} GPU(s)"
        again = sum(row[0].startswith(name) for row in rows)
        rows.append([name + (f", walk {again + 1}" if again else ""),
                     "-" if found is None else f"{found[0]:.1%}", "-" if found is None else f"{found[1]:.1%}",
                     "-" if gap is None else f"{gap:+.1%} (margin {ladder['margin']:.1%})", oom])
    return records.format_table(rows, ["ladder", "end MFU", "exposed comm", "FSDP2 eager delta", "FSDP2 OOM?"])


def fsdp2_takeaways(ladders: list[dict]) -> str:
    """:func:`fsdp2_takeaway` for each committed ladder, then one line that sums them up from the same data: in how
    many ladders FSDP2's eager runs came within the margin of DeepSpeed's eager ones, how far compiled DeepSpeed
    ran ahead of FSDP2's best eager run on the same batch, and where FSDP2 ran out of memory."""
    lines, within, compared, ahead, oom = [], 0, 0, [], []
    for ladder in ladders:
        lines.append(fsdp2_takeaway(ladder))
        fsdp2 = ladder.get("fsdp2") or {}
        where = f"{ladder['params'] / 1e9:.2f}B on {ladder['world_size']} GPU(s)"
        for reason in (fsdp2.get("reason"), (fsdp2.get("latest") or {}).get("reason")):
            if reason and _out_of_memory(reason):
                oom.append(where)
        if not fsdp2.get("measured"):
            continue
        eager = _same_batch_run(ladder, fsdp2["setting"], compiled=False)
        best_fsdp2 = max(r["tflops_per_gpu"] for r in fsdp2["runs"].values())
        if eager is not None:
            compared += 1
            runs = [c for c in ladder["candidates"] if c["verdict"] == "baseline"] \
                if eager["verdict"] == "baseline" else [eager]
            ds = sum(c["tflops_per_gpu"] for c in runs) / len(runs)
            within += abs(best_fsdp2 / ds - 1) <= ladder["margin"]
        compiled = _same_batch_run(ladder, fsdp2["setting"], compiled=True)
        if compiled is not None:
            ahead.append(compiled["tflops_per_gpu"] / best_fsdp2 - 1)
    line = (f"Takeaway: eager against eager, FSDP2's faster strategy came within the ladder's margin of DeepSpeed in "
            f"{within} of {compared} ladders")
    if ahead:
        line += (f"; DeepSpeed with engine.compile() ran {min(ahead):.0%} to {max(ahead):.0%} ahead of FSDP2's "
                 "eager runs on the same batch (the course's FSDP2 code does not compile)")
    if oom:
        line += f"; FSDP2 ran out of memory on the setting DeepSpeed ended with ({', '.join(oom)})"
        eager = [f"{ladder['params'] / 1e9:.2f}B on {ladder['world_size']} GPU(s)" for ladder in ladders
                 if _eager_out_of_memory(ladder) is not None]
        if eager:
            line += f", a micro batch DeepSpeed fitted only compiled where it tried it eagerly ({', '.join(eager)})"
    return "\n".join(lines + [line + "."])


def compile_lines(ladders: list[dict]) -> str:
    """What ``engine.compile()`` gained where a committed ladder kept it, from their data: its gain over the figure it
    was judged against, and whether that was the largest gain the ladder kept; one line per ladder, then the range."""
    lines, gains = [], []
    for ladder in ladders:
        kept = [(c["rung"], float(_gain(c["verdict"]).rstrip("%")) / 100) for c in ladder["candidates"]
                if c["verdict"].startswith("kept")]
        compiled = next((gain for rung, gain in kept if rung == "compile"), None)
        if compiled is None:
            continue
        gains.append(compiled)
        largest = "the largest" if compiled == max(gain for _, gain in kept) else "not the largest"
        lines.append(f"{ladder['params'] / 1e9:.2f}B on {ladder['device']}: engine.compile() kept at "
                     f"{compiled:+.1%}, {largest} of the {len(kept)} gains that ladder kept")
    if gains:
        lines.append(f"engine.compile() gained {min(gains):+.0%} to {max(gains):+.0%} where it was tried")
    return "\n".join(lines)


def knobs() -> str:
    """The knobs :meth:`Setting.with_knobs` accepts, read from :class:`Setting`'s fields, with their types and
    the values of both baselines, each named: the GPU ladder's and the CPU ladder's."""
    return "\n".join(f"{f.name}: {f.type} (GPU baseline {_short(getattr(GPU_BASELINE, f.name))}, "
                     f"CPU baseline {_short(getattr(CPU_BASELINE, f.name))})" for f in dataclasses.fields(Setting))


def key_ladder(size: str = "2.7b", world_size: int = 2) -> dict | None:
    """The committed GPU ladder of ``size`` climbed on ``world_size`` GPUs (the newest such file), or None."""
    found = [entry[4] for entry in reference_ladders(size) if entry[4]["world_size"] == world_size]
    return found[-1] if found else None


def exercise_hidden_bound(answer: Any, ladder: dict) -> exercises.Verdict:
    """Exercise: predict the highest MFU the ladder's best setting could reach if all of its exposed
    communication were hidden behind compute (the same FLOPs in a step shorter by that share); the answer is the
    bound :func:`shortfall` prints, within 1%."""
    mfu, exposed = best_mfu_and_exposed(ladder)
    bound = mfu / (1 - exposed)
    return exercises.number(
        "what hiding communication could give", answer, bound, relative=0.01,
        task=(f"The best setting of the {ladder['params'] / 1e9:.2f}B ladder on {ladder['device']} reached "
              f"{mfu:.2%} MFU, with {exposed:.2%} of its step exposed communication. Predict the highest MFU it "
              "could reach if overlap hid all of that communication, as a fraction (0.5 for 50%)."),
        hint="MFU's definition (section 2): which of its quantities does hiding communication change, and by how much?",
        why=(f"{mfu:.2%} / (1 - {exposed:.2%}) = {bound:.2%}: the same FLOPs in {1 - exposed:.2%} of the time. "
             "That bounds what overlap can still give; the rest of the gap to the peak is compute (section 5)."))


def exercise_margin(answer: Any, ladder: dict) -> exercises.Verdict:
    """Exercise: predict the noise margin a committed walk's candidates had to beat, from its baseline's two runs
    (the rule of :func:`walk`); the answer is the margin the walk recorded, within 3%."""
    runs = [c["metric"] for c in ladder["candidates"] if c["verdict"] == "baseline"][:2]
    where = f"the {ladder['params'] / 1e9:.2f}B walk on {ladder['device']}"
    return exercises.number(
        "the noise margin", answer, ladder["margin"], relative=0.03,
        task=(f"{where[0].upper()}{where[1:]} trained its baseline twice: {runs[0]:.2f} and {runs[1]:.2f} model "
              "TFLOP/s per GPU. Predict the margin a candidate had to beat to be kept, as a fraction (0.05 for 5%)."),
        hint="the rule of section 3, with the two runs' spread (their difference over their mean).",
        why=(f"the two runs differ by {ladder['spread']:.2%} of their mean; the rule keeps a candidate only above "
             f"max({MIN_MARGIN:.0%}, twice that) = {ladder['margin']:.2%}: a gain smaller than what the same setting "
             "moves between two runs is not a gain."))


#: The verdict column's entry for a candidate the rule judged while the load guard saw other processes
WITHHELD = "withheld: the machine was not alone"


def guarded(ladder: dict, load: load_guard.Load) -> dict:
    """``ladder`` (``Ladder.to_dict()``) as the chapter shows it beside the load its launch ran under: where the
    launch did not have its devices to itself (``load``), every verdict the rule gave (kept, dropped, not
    eligible) reads :data:`WITHHELD` instead, with the rule's figure after it, as does each rung's kept
    candidate, and ``withheld`` holds the load's reason; alone, the ladder as it is. The walk's own data is left
    as it was."""
    if load.alone:
        return ladder
    judged = ("kept", "dropped", "not eligible")
    candidates = [{**c, "verdict": f"{WITHHELD}; the rule: {_gain(c['verdict'])}"}
                  if c["verdict"].startswith(judged) else c for c in ladder["candidates"]]
    rungs = [{**r, "kept": WITHHELD} if r.get("kept") else r for r in ladder.get("rungs", [])]
    return {**ladder, "candidates": candidates, "rungs": rungs, "withheld": load.reason()}


def _gain(verdict: str) -> str:
    """The signed percentage a rule's verdict gives (``kept: +3.3%`` -> ``+3.3%``), or the verdict's first word."""
    found = re.search(r"[+-]\d+(?:\.\d+)?%", verdict)
    return found.group(0) if found else verdict.split(":")[0]


def warm_up(ladder: Ladder, load: load_guard.Load) -> str:
    """The baseline's first step against its measured steps, in one line from its two runs' records: how many
    times slower each first step ran (no figure counts it), and whether the data shows a warm-up beyond it,
    given the machine's ``load``."""
    runs = [c for c in ladder.candidates if c.label in ("baseline", "baseline, again") and c.record is not None]
    if len(runs) < 2:
        return "Warm-up: the baseline was not measured twice, nothing to compare."
    first = [c.record["throughput"]["all_step_times_s"][0] for c in runs]
    median = [statistics.median(_steps(c.record)) for c in runs]
    line = (f"Warm-up: the baseline's first step took {first[0] / median[0]:.1f}x its measured median, its "
            f"repeat's {first[1] / median[1]:.1f}x; the figures leave the warm-up steps out. ")
    if median[0] <= median[1]:
        return line + "Its measured steps show no warm-up beyond them."
    if load.alone:
        return line + "The first run's measured steps were still the slower: a warm-up beyond them."
    return line + "The first run's measured steps were the slower: with other processes running, warm-up or load."


def _steps(record: records.Record) -> list[float]:
    """A record's measured step times (seconds): the middle steps, without warm-up and the profiled last."""
    section = record["throughput"]
    return [section["all_step_times_s"][i - 1] for i in section["measured_steps"]]


def timing_check(ladder: Ladder, load: load_guard.Load) -> str:
    """The baseline's two runs against each other, then each candidate's measured steps against the baseline's,
    through the course's load guard (:func:`load_guard.compare`, the baseline's second run as the repeat): a
    verdict only where the launch had its devices to itself and the difference exceeds the steps' spread;
    otherwise the reason it is withheld."""
    measured = [c for c in ladder.candidates if c.record is not None]
    base = next((c for c in measured if c.label == "baseline"), None)
    again = next((c for c in measured if c.label == "baseline, again"), None)
    lines = [f"Load beside the launch: {load.reason() or 'none, it had its devices to itself'}."]
    if base is None:
        return "\n".join(lines + ["No baseline was measured: nothing to compare."])
    if again is not None and ladder.spread is not None:
        noise = load_guard.compare({"baseline": _steps(base.record), "baseline, again": _steps(again.record)}, load)
        why = (f"the same setting ran {noise.ratio:.2f}x apart with the machine to itself, beyond its steps' spread: "
               "that is this machine's own noise, and the margin absorbs it" if noise.given else
               f"no verdict on that difference, {_withheld(noise, load)}"
               + ("; on a busy machine the margin measures the other processes, not DeepSpeed, and can grow until no "
                  "candidate is kept" if not load.alone else ""))
        lines.append(f"The baseline's two runs differ by {ladder.spread:.1%} of their mean model FLOP/s, hence the "
                     f"{ladder.margin:.1%} margin: {why}.")
        ratio = (1 + ladder.spread / 2) / (1 - ladder.spread / 2)  # the faster run over the slower
        if ratio >= 1.5:
            lines.append(f"The same setting ran {ratio:.2f}x faster in one run than in the other: a difference "
                         "between candidates smaller than that says nothing about them.")
    for c in measured:
        if c is not base and c is not again:
            verdict = load_guard.compare({"baseline": _steps(base.record), c.label: _steps(c.record)}, load,
                                         repeat=_steps(again.record) if again else None)
            tokens = _tokens_per_rank_step(c.setting) / _tokens_per_rank_step(base.setting)
            said = load_guard.sentence(verdict) if verdict.given else f"{_withheld(verdict, load).capitalize()}."
            lines.append(f"{c.label}, step time (its step trains {tokens:g}x the baseline's tokens): {said}")
    return "\n".join(lines)


def _tokens_per_rank_step(setting: Setting) -> int:
    """The tokens one rank trains per optimizer step with ``setting``: micro batch x accumulation x sequence."""
    return setting.micro_batch * setting.grad_accum * setting.seq_len


def _withheld(verdict: load_guard.Verdict, load: load_guard.Load) -> str:
    """Why a step-time verdict is withheld, in the words the chapter's tables use: the load guard's
    :data:`WITHHELD`, or "withheld: within the steps' spread" where the difference does not exceed it."""
    if not load.alone:
        return WITHHELD
    if verdict.withheld.startswith("the difference"):
        return f"withheld: within the steps' spread ({verdict.spread:.0%})"
    return f"withheld: {verdict.withheld}"


def fsdp2_check(ladder: Ladder, load: load_guard.Load) -> str:
    """FSDP2's measured steps against DeepSpeed's on the same setting (the kept candidate's, else the baseline's)
    through the load guard: a verdict only for a launch alone whose difference exceeds the steps' spread."""
    kept = [c for c in ladder.candidates if c.verdict.startswith("kept") and c.record is not None]
    deepspeed_run = kept[-1] if kept else next((c for c in ladder.candidates if c.label == "baseline"
                                                and c.record is not None), None)
    folder = launch.RUNS_DIR / ladder.name
    found = {label: folder / f"fsdp2-{strategy}" for strategy, label in
             ((s, frameworks.STRATEGIES[s].label) for s in FSDP2_STRATEGIES)}
    samples = {label: _steps(records.load(out)) for label, out in found.items()
               if (ladder.fsdp2 or {}).get("measured") and out.exists()}
    if deepspeed_run is None or not samples:
        return "FSDP2 against DeepSpeed: " + whole_sentences((ladder.fsdp2 or {}).get("reason", "not measured"))
    verdict = load_guard.compare({f"DeepSpeed {deepspeed_run.label}": _steps(deepspeed_run.record), **samples}, load)
    return ("FSDP2 against DeepSpeed on the same setting: " + load_guard.sentence(verdict)
            + (" Both do the same fp32 arithmetic here (the losses above match), so on a model this small a verdict "
               "compares the work each does around it per step, not the GPU ladders' question."
               if verdict.given and ladder.baseline.precision == "fp32" else ""))


def exercise_mfu(answer: Any, ladder: dict, label: str = "baseline") -> exercises.Verdict:
    """Exercise: compute the MFU of one candidate of a committed ladder from its tokens/s with the course's
    formula (:func:`helpers.core.performance.flops_per_token`, the device's dense bf16 peak); the answer is the
    MFU the throughput probe recorded for it."""
    c = next(c for c in ladder["candidates"] if c["label"] == label)
    name = "first of the start's two runs" if label == "baseline" else f"candidate {label!r}"
    shape = performance.config_shape(model_config(ladder["size"], seq_len=c["setting"]["seq_len"]))
    flops = performance.flops_per_token(ladder["params"], shape["layers"], shape["hidden"], shape["seq_len"],
                                        shape["lookup_params"])["total"]
    peak, _ = performance.peak_tflops(ladder["device"])
    gpus = ladder["world_size"]
    task = (f"The {name} of the {ladder['params'] / 1e9:.2f}B ladder on {ladder['device']} "
            f"({setting_label(c['setting'], Setting(**ladder['baseline']))}) trained "
            f"{c['tokens_per_s']:,.0f} tokens/s over its {gpus} GPUs, sequences of {shape['seq_len']} tokens. "
            "Compute its MFU, as a fraction (0.5 for 50%).")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and 1 < answer <= 100:
        return exercises.Verdict("MFU", False, f"{answer:g} looks like a per cent: write MFU as a fraction "
                                               f"({answer / 100:g}).")
    return exercises.number(
        "MFU", answer, c["mfu"], relative=0.02, task=task,
        hint=("MFU as section 2 defines it, with its FLOPs-per-token row for this model and sequence length; the "
              "tokens/s count all the GPUs, the peak one."),
        why=(f"{flops:.4g} FLOPs/token x {c['tokens_per_s']:,.0f} tokens/s / {gpus} GPUs = "
             f"{flops * c['tokens_per_s'] / gpus / 1e12:.4g} TFLOP/s per GPU, over {peak:g} TFLOP/s dense bf16: "
             f"{c['mfu']:.1%}, the MFU the throughput probe recorded for that run"
             + (f" (the ladder's table shows the mean of the start's two runs, {_start_mean(ladder):.4g} TFLOP/s)."
                if label == "baseline" else ".")))


def _start_mean(ladder: dict) -> float:
    """The start's model TFLOP/s per GPU: the mean of its two runs, as :func:`kept_path` shows it."""
    base = [c["tflops_per_gpu"] for c in ladder["candidates"] if c["verdict"] == "baseline"]
    return sum(base) / len(base)
