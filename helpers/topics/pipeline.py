"""Pipeline parallelism: the LLaMA-style model cut into stages, DeepSpeed's schedule, and what each stage did.

- :func:`llama_pipeline` turns a ``LlamaForCausalLM`` into a ``deepspeed.pipe.PipelineModule``: embedding,
  one stage layer per decoder layer, final norm + LM head, with the same weights and arithmetic as the
  unsplit model (each decoder stage rebuilds the rotary embedding and causal mask it needs).
- :func:`schedule_grid` and :func:`schedule_bubble` read DeepSpeed's own ``TrainSchedule`` (pure Python,
  no process group): which micro-batch each stage computes in each step, and the share of idle steps.
- Chapter 11 trains its pipelines in its own script (``runs/11/train_pipeline.py``, written by the notebook,
  measured by :mod:`helpers.measure`) and reads them with :func:`chapter_records`. :func:`build_model` and
  :func:`train_step` are the same pipeline as a sweep's builder and trainer (``RunSpec(builder=BUILDER,
  trainer=TRAINER)``), for chapter 12b's comparison of the ways of splitting a model;
  :func:`~helpers.core.pipeline_hooks.dispatch_after_backward` (the core's, as :mod:`helpers.measure` uses it)
  lets the probes' ``after_backward`` fire inside ``engine.train_batch``.
- The ``pipeline`` probe times every instruction each stage executes (forward, backward, send, receive,
  ...): busy time against the time the whole pipeline took, the measured bubble.
- The other schedules DeepSpeed ships (:func:`shipped_schedules`): DualPipeV, switched on by building a
  ``DualPipeVModule`` (``model_options={"schedule": "dualpipev"}``), its instruction lists
  (:func:`instruction_text`), its bubble by the DualPipe README's formulas and by replaying DeepSpeed's lists
  (:func:`bubble_time`, :func:`replay`), and its run beside the default's (:func:`schedule_comparison`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import statistics
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from helpers.core import ds, exercises, load_guard, models, plots, records, references, theory
from helpers.core.pipeline_hooks import dispatch_after_backward, instruction_hooks
from helpers.core.plan import PlannedRun, reference_of
from helpers.core.probes import Probe, RunContext
from helpers.topics import activations

#: Instructions of DeepSpeed's pipeline schedule that compute (the rest move data or wait for it).
COMPUTE = ("ForwardPass", "BackwardPass")


# --- the model as stages ------------------------------------------------------------------------

class EmbeddingStage(nn.Module):
    """Token ids -> hidden states (the model's ``embed_tokens``)."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderStage(nn.Module):
    """One ``LlamaDecoderLayer``: hidden states in, hidden states out. The rotary embedding and the causal
    mask are recomputed from the sequence length, as ``LlamaModel.forward`` computes them once for all
    layers, so only hidden states travel between stages."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # no parameters: its inverse frequencies are a buffer
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask  # deferred: slow to import, and most runs need none

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # the cache argument's name changed between transformers 5 releases (past_key_values -> cache)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  position_ids=positions, **{_cache_argument(): None})
        return self.layer(hidden, attention_mask=mask, position_embeddings=self.rotary(hidden, position_ids=positions),
                          position_ids=positions)


@functools.lru_cache(maxsize=None)
def _cache_argument() -> str:
    """The name transformers gives create_causal_mask's cache argument (asked on first use: importing
    transformers costs every rank about 2 s, and most runs never build a pipeline)."""

    from transformers.masking_utils import create_causal_mask  # deferred: slow to import, and most runs need none

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


class HeadStage(nn.Module):
    """Final RMSNorm and the LM head: hidden states -> logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def llama_stages(model) -> list[nn.Module]:
    """The layers of a ``LlamaForCausalLM`` as a sequence a ``PipelineModule`` can cut anywhere."""
    inner = model.model
    decoders = [DecoderStage(layer, inner.rotary_emb, model.config) for layer in inner.layers]
    return [EmbeddingStage(inner.embed_tokens), *decoders, HeadStage(inner.norm, model.lm_head)]


#: The pipeline schedules a run can train with (a run's ``model_options={"schedule": ...}``): DeepSpeed's
#: default 1F1B (``PipelineModule``, trained by ``PipelineEngine`` with ``TrainSchedule``) and DualPipeV
#: (``DualPipeVModule``, which ``deepspeed.initialize`` hands to ``DualPipeVEngine`` with ``DualPipeVSchedule``).
SCHEDULES = ("1f1b", "dualpipev")


def llama_pipeline(model, num_stages: int | None = None, partition_method: str = "parameters",
                   schedule: str = "1f1b"):
    """``model`` as a ``deepspeed.pipe.PipelineModule`` of ``num_stages`` stages (default: one per rank),
    balanced by parameter count; the loss is :func:`helpers.core.models.lm_loss`. With ``schedule="dualpipev"``
    a ``deepspeed.pipe.DualPipeVModule`` instead, which cuts the layers into ``2 * num_stages`` stages, two per
    rank (rank r holds stage r and stage 2·num_stages-1-r). Needs the process group."""
    dist = ds.load("deepspeed.comm")
    pipe = ds.load("deepspeed.pipe")

    check_schedule(schedule)
    stages = num_stages or dist.get_world_size()
    module = pipe.DualPipeVModule if schedule == "dualpipev" else pipe.PipelineModule
    return module(layers=llama_stages(model), num_stages=stages, loss_fn=models.lm_loss,
                  partition_method=partition_method)


def check_schedule(schedule: object) -> None:
    """Raise a ValueError naming the choices when ``schedule`` is not one of :data:`SCHEDULES`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(map(repr, SCHEDULES))}")


#: The suffix of a pipeline model's name: ``"llama-pipe"`` is ``llama`` cut into stages.
SUFFIX = "-pipe"


def base_model(name: str) -> str:
    """The course model a pipeline model is cut from: ``"llama-gpu-pipe"`` -> ``"llama-gpu"``."""
    if not name.endswith(SUFFIX):
        raise ValueError(f"model {name!r}: a pipeline model is a LLaMA-style model's name + {SUFFIX!r}, e.g. 'llama-pipe'")
    return name.removesuffix(SUFFIX)


def check_options(name: str, options: dict) -> None:
    """Raise a ValueError naming the fix when ``name`` is no pipeline model or ``options`` are other than
    ``schedule`` (one of :data:`SCHEDULES`)."""
    base = base_model(name)
    if not models.is_llama(base) or models.llama_parts(base)[1]:
        raise ValueError(f"model {name!r}: cut a plain LLaMA-style model ({', '.join(models.LLAMA_SHAPES)}) into "
                         f"stages, e.g. 'llama{SUFFIX}'")
    options = dict(options)
    if "schedule" in options:
        check_schedule(options.pop("schedule"))
    if options:
        raise ValueError(f"model {name!r} takes only the model_option 'schedule' (got {sorted(options)})")


def build_model(name: str, seed: int = 0, config: dict | None = None, schedule: str = "1f1b",
                **options) -> nn.Module:
    """A run's builder: the LLaMA-style model ``base_model(name)`` (the same weights as unsplit) as a
    ``PipelineModule`` of one stage per rank, or with ``schedule="dualpipev"`` (``model_options``) as a
    ``DualPipeVModule`` of two stages per rank; each rank keeps only its own stages' layers. Build it on the
    ranks: it needs the process group."""
    check_options(name, {"schedule": schedule, **options})
    return llama_pipeline(models.build(base_model(name), seed, config), schedule=schedule)


build_model.check_options = check_options  # the launcher checks a run's model with it


def train_step(ctx: RunContext, run: PlannedRun, step: int, probes: list[Probe]) -> list[float]:
    """A run's trainer: one optimizer step of a pipeline, ``engine.train_batch``, which runs DeepSpeed's
    schedule over ``grad_accum`` micro-batches (forward, backward and the send/recv between stages, then
    the gradient reduction and the optimizer step). Every stage reads the same micro-batches: the first
    uses the inputs, the last the targets.

    The probes' ``after_backward`` still fire, from inside ``train_batch``: after each micro-batch's
    backward on this stage (:func:`dispatch_after_backward`). Returns the step's loss, which DeepSpeed
    averages over the micro-batches on the last stage and broadcasts to every stage.
    """
    engine = ctx.engine
    dispatch_after_backward(ctx, step, probes)
    batches = []
    for micro_step in range(ctx.grad_accum):
        indices = models.sample_indices(step, micro_step, ctx.dp_rank, ctx.dp_size, ctx.micro_batch, ctx.grad_accum)
        batch = models.make_batch(base_model(run.model), indices, run.seed).to(engine.device)
        batches.append((batch.inputs, batch.targets))
    return [engine.train_batch(data_iter=iter(batches)).item()]


#: How a run names them (:class:`helpers.core.launch.RunSpec`).
BUILDER, TRAINER = reference_of(build_model), reference_of(train_step)


# --- DeepSpeed's schedule, read without running it ------------------------------------------------

def schedule_grid(stages: int, micro_batches: int) -> list[list[str]]:
    """What each stage computes in each step of DeepSpeed's ``TrainSchedule`` (1F1B): one row per stage,
    one cell per step: ``"F2"`` (forward of micro-batch 2), ``"B0"`` (backward of micro-batch 0) or ``""``
    (nothing to compute: the bubble)."""
    schedule = ds.load("deepspeed.runtime.pipe.schedule")

    grid = []
    for stage in range(stages):
        plan = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        row = []
        for step_id, cmds in enumerate(plan):
            kinds = {type(cmd).__name__ for cmd in cmds}
            micro = plan._step_to_micro_batch(step_id)[0]
            row.append(f"F{micro}" if "ForwardPass" in kinds else f"B{micro}" if "BackwardPass" in kinds else "")
        grid.append(row)
    return grid


def schedule_bubble(stages: int, micro_batches: int) -> float:
    """The share of a stage's schedule steps with nothing to compute, counted in DeepSpeed's ``TrainSchedule``
    (the same for every stage)."""
    grid = schedule_grid(stages, micro_batches)
    shares = {sum(cell == "" for cell in row) / len(row) for row in grid}
    if len(shares) != 1:
        raise AssertionError(f"stages idle for different shares of the schedule: {shares}")
    return shares.pop()


# --- the probe ---------------------------------------------------------------------------------------

class PipelineTimeline(Probe):
    """Every schedule instruction each stage runs in ``engine.train_batch``, timed (device synchronized
    after each), and the stage's layers and parameters.

    Per optimizer step (the first is left out: warm-up), the pipeline's span runs from the first
    instruction any stage starts to the end of the last backward any stage finishes; a stage's bubble
    is the share of that span it spent not computing (not in ``ForwardPass`` or ``BackwardPass``).
    Rank clocks are comparable because all ranks share one host's monotonic clock. Under DualPipeV each rank
    also records its two stages (``phases``: stage r on the way out, stage 2·ranks-1-r on the way back).
    Section: ``pipeline``.
    """

    name = "pipeline"
    keys = ("pipeline.per_rank", "pipeline.bubble_per_rank", "pipeline.last_step")
    trainer = TRAINER

    def start(self, ctx: RunContext) -> None:
        self.steps: list[list[tuple[str, float, float]]] = []
        self.current = None

        def record(kind: str, started: float, kwargs: dict) -> None:
            ctx.synchronize()
            self.current.append((kind, started, time.perf_counter()))

        instruction_hooks(ctx.engine).insert(0, record)  # before other hooks, so they do not count as work

    def before_step(self, ctx: RunContext, step: int) -> None:
        self.current = []
        self.steps.append(self.current)

    def finish(self, ctx: RunContext) -> dict:
        module = ctx.engine.module
        found = {"stage": int(ctx.engine.stage_id), "stages": int(ctx.engine.num_stages),
                 "layers": [type(layer).__name__ for layer in module.forward_funcs],
                 "first_layer": int(module._local_start),
                 "params": sum(p.numel() for p in module.parameters()),
                 "instructions": self.steps}
        if hasattr(module, "phase_funcs"):  # a DualPipeVModule: two stages on this rank, one per phase
            stages = 2 * int(ctx.engine.num_stages)
            found["phases"] = [{"stage": stage, "first_layer": int(bounds[0]),
                                "layers": [type(layer).__name__ for layer in funcs]}
                               for stage, bounds, funcs in zip((found["stage"], stages - 1 - found["stage"]),
                                                               module.phase_bounds, module.phase_funcs)]
            found["layers"], found["first_layer"] = found["phases"][0]["layers"], found["phases"][0]["first_layer"]
        return found

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        measured = list(range(1, ctx.steps)) or [0]
        per_step = [step_bubbles([r["instructions"][s] for r in ranks]) for s in measured]
        stages = ranks[0]["stages"]
        last = [[(kind, begin, end) for kind, begin, end in r["instructions"][measured[-1]]] for r in ranks]
        return {"pipeline": {
            "stages": stages, "micro_batches": ctx.grad_accum,
            "schedule": "dualpipev" if "phases" in ranks[0] else "1f1b",
            "per_rank": [{key: r[key] for key in ("stage", "layers", "first_layer", "params", "phases") if key in r}
                         for r in ranks],
            "bubble_per_rank": [statistics.median(step[rank] for step in per_step) for rank in range(len(ranks))],
            "bubble_per_step": per_step, "measured_steps": [s + 1 for s in measured],
            "seconds_by_instruction": [seconds_by_kind(r["instructions"], measured) for r in ranks],
            "last_step": last,
        }}


def stages(record: records.Record) -> int:
    """The number of pipeline stages a run had (the ``pipeline`` probe)."""
    return record.section("pipeline")["stages"]


def step_bubbles(instructions_per_rank: list[list[tuple[str, float, float]]]) -> list[float]:
    """For one optimizer step, each rank's share of the pipeline's span spent not computing."""
    begin = min(i[1] for rank in instructions_per_rank for i in rank)
    end = max(i[2] for rank in instructions_per_rank for i in rank if i[0] == "BackwardPass")
    span = end - begin
    return [1 - sum(e - b for kind, b, e in rank if kind in COMPUTE) / span for rank in instructions_per_rank]


def seconds_by_kind(steps: list[list[tuple[str, float, float]]], measured: list[int]) -> dict[str, float]:
    """Seconds per optimizer step a rank spent in each kind of instruction, averaged over ``measured`` steps."""
    totals: dict[str, float] = {}
    for s in measured:
        for kind, begin, end in steps[s]:
            totals[kind] = totals.get(kind, 0.0) + (end - begin) / len(measured)
    return totals


# --- the chapter's experiment and tables (notebooks/11_pipeline_parallelism.ipynb) ---------------------

PROBES = ("timing", "model_states", "comm", PipelineTimeline, activations.Activations)
#: Micro-batches per optimizer step for the bubble runs; the micro-batch shrinks so the global batch stays.
MICRO_BATCH_COUNTS = (1, 2, 4, 8)
#: The sweep's run of the DualPipeV schedule, and the run of the default 1F1B schedule it repeats (same
#: config, micro-batches and probes).
DUALPIPEV, DEFAULT = "pipeline-dualpipev", "pipeline"


#: Probes of the data-parallel baseline: the pipeline's, less the one that times schedule instructions.
DATA_PARALLEL_PROBES = ("timing", "model_states", "comm", activations.Activations)
#: The chapter script's run of the first timed run's config again, last in its launch (the load guard's repeat).
AGAIN = "pipeline-again"
#: The runs the chapter compares step times between, each carrying only the light probes (timer, comms logger
#: and, in a pipeline, the instruction timer): 1F1B at M = 4 and data parallelism. Records without them (the GPU
#: references, measured before) fall back to :data:`DEFAULT` and ``data-parallel``.
TIMED, DATA_PARALLEL_TIMED = "pipeline-M4", "data-parallel-timed"


def timed_names(runs: Mapping) -> tuple[str, str]:
    """The 1F1B run and the data-parallel run whose step times ``runs`` compares: :data:`TIMED` and
    :data:`DATA_PARALLEL_TIMED` where present, else :data:`DEFAULT` and ``data-parallel``."""
    return (TIMED if TIMED in runs else DEFAULT,
            DATA_PARALLEL_TIMED if DATA_PARALLEL_TIMED in runs else "data-parallel")
#: The file a chapter script writes in a run's folder where DeepSpeed refused the run (:func:`record_refusal`).
REFUSED = "refused.txt"


class Refused(RuntimeError):
    """A run DeepSpeed refused when it built the engine: the error it raised, as the script recorded it."""


def record_refusal(folder: str | Path, error: BaseException) -> None:
    """On rank 0, write why DeepSpeed refused a run (its error) into the run's ``folder``, where
    :func:`chapter_records` reads it back."""
    dist = ds.load("deepspeed.comm")

    if dist.get_rank() == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / REFUSED).write_text(f"{type(error).__name__}: {error}")


def chapter_records(folder: str | Path, since: float = 0.0) -> dict[str, records.Record | Refused]:
    """The runs the chapter script wrote into ``folder`` since ``since`` (a ``time.time()``; folders of older
    launches are left out), in the order they trained: {run name: Record, or :class:`Refused` where DeepSpeed
    refused the run}."""
    found = []
    for path in Path(folder).glob("*/*"):
        if path.name in ("summary.json", REFUSED) and path.stat().st_mtime >= since:
            run = records.load(path) if path.name == "summary.json" else Refused(path.read_text())
            found.append((path.stat().st_mtime, path.parent.name, run))
    if not found:
        raise FileNotFoundError(f"no record in {folder} newer than the launch: did the script run?")
    return {name: run for _, name, run in sorted(found, key=lambda item: item[0])}


def stage_table(record) -> str:
    """Which layers each stage (rank) holds, with its parameters."""

    section = record.summary["pipeline"]
    rows = [[r["stage"], ", ".join(r["layers"]), f"{r['first_layer']}..{r['first_layer'] + len(r['layers']) - 1}",
             f"{r['params']:,}"] for r in section["per_rank"]]
    total = sum(r["params"] for r in section["per_rank"])
    rows.append(["all", "", "", f"{total:,}"])
    return records.format_table(rows, ["stage", "layers", "layer indices", "parameters"])


def states_table(pipe, baseline) -> str:
    """Model states per rank of the pipeline against the unsplit model trained with data parallelism, by kind: the
    rows add up to the "model states" row (the master copy is ZeRO-1's fp32 copy of the weights; none at ZeRO-0)."""

    rows = []
    for rank in range(pipe["world_size"]):
        p, b = pipe.states(rank), baseline.states(rank)
        for key in ("params", "grads", "optimizer", "master"):
            ratio = f"{p[key] / b[key]:.3f}" if b[key] else "(none)"
            rows.append([rank, "master copy" if key == "master" else key, f"{p[key]:,}", f"{b[key]:,}", ratio])
        rows.append([rank, "model states", f"{pipe.model_state_bytes(rank):,}", f"{baseline.model_state_bytes(rank):,}",
                     f"{pipe.model_state_bytes(rank) / baseline.model_state_bytes(rank):.3f}"])
    return records.format_table(rows, ["rank", "state", "pipeline bytes", "data parallel bytes", "ratio"])


def schedule_text(stages: int, micro_batches: int) -> str:
    """DeepSpeed's TrainSchedule as a grid: one line per stage, one column per schedule step."""
    grid = schedule_grid(stages, micro_batches)
    width = max(2, *(len(c) for row in grid for c in row))
    lines = ["step     " + " ".join(f"{i:>{width}}" for i in range(len(grid[0])))]
    lines += [f"stage {s}  " + " ".join(f"{c or '.':>{width}}" for c in row) for s, row in enumerate(grid)]
    return "\n".join(lines)


def bubble_formula_table(stage_counts=(2, 4, 8), micro_batch_counts=MICRO_BATCH_COUNTS) -> str:
    """Idle share of DeepSpeed's schedule (counted) against (S-1)/(M+S-1), for several S and M."""

    rows = [[s, m, f"{schedule_bubble(s, m):.4f}", f"{bubble_fraction(s, m):.4f}"]
            for s in stage_counts for m in micro_batch_counts]
    return records.format_table(rows, ["stages S", "micro-batches M", "idle steps in schedule", "(S-1)/(M+S-1)"])


def p2p_table(record) -> str:
    """send/recv per optimizer step on rank 0 (stage 0), per micro-batch, against the activation size."""

    shape, m = models.shape_of(record.model_name), record["grad_accum"]
    activation = pipeline_p2p_bytes(record["micro_batch"], shape.seq, shape.hidden, record["precision"])
    rows = []
    for op in ("send", "recv"):
        row = record.comm_ops().get(op, {"count": 0, "bytes": 0})
        rows.append([op, f"{row['count']:g}", f"{row['bytes'] / max(row['count'], 1):,.0f}", f"{activation:,.0f}",
                     f"{row['count'] / m:g}"])
    return records.format_table(rows, ["op (stage 0)", "calls/step", "bytes per call", "b·s·h·bytes", "calls per micro-batch"])


def default_bucket_elements() -> int:
    """DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements): the size of ZeRO-1/2's gradient
    bucket, allocated whatever the model's size."""
    DeepSpeedZeroConfig = ds.load("deepspeed.runtime.zero.config").DeepSpeedZeroConfig
    return int(DeepSpeedZeroConfig().reduce_bucket_size)


def in_flight_table(record) -> str:
    """Activations each stage holds when its first backward starts, in micro-batches (bytes saved in its
    decoder layers / bytes one micro-batch saves there), against 1F1B's min(S - stage, M)."""

    section = [activations.measured(record, r) for r in range(record.world_size)]
    stages, m = record.summary["pipeline"]["stages"], record["grad_accum"]

    rows = []
    for rank, measured in enumerate(section):
        if not measured["per_layer"]:  # a stage of only the embedding or the head
            rows.append([rank, "(no decoder layer)", "", "", min(stages - rank, m)])
            continue
        per_micro = activations.layer_formula(record, 0)  # every stage's first decoder layer saves the rotary too
        held = measured["per_layer"][0] / per_micro
        rows.append([rank, f"{measured['per_layer'][0]:,}", f"{per_micro:,.0f}", f"{held:g}", min(stages - rank, m)])
    return records.format_table(rows, ["stage", "saved by its first decoder layer", "one micro-batch (chapter 10's formula)",
                                       "micro-batches held", "min(S - stage, M)"])


def loss_table(runs: dict, pairs) -> str:
    """Loss agreement of pairs of runs, within :data:`helpers.core.records.REORDERED_TOLERANCE` (the runs cut the
    batch into micro-batches of other sizes)."""

    rows = [[a, b, records.loss_agreement(runs[a].losses, runs[b].losses,
                                          tolerance=records.REORDERED_TOLERANCE[runs[a]["precision"]])]
            for a, b in pairs]
    return records.format_table(rows, ["run", "against", "losses"])


def memory_table(pipe: records.Record, baseline: records.Record) -> str:
    """Per rank: model states, buffers (ZeRO's gradient bucket among them) and activations saved for backward
    (measured), pipeline against data parallelism at the same micro-batch size."""
    rows = []
    for rank in range(pipe.world_size):
        pa = activations.saved_bytes(pipe, rank)
        ba = activations.saved_bytes(baseline, rank)
        rows.append([rank, f"{pipe.model_state_bytes(rank):,}", f"{baseline.model_state_bytes(rank):,}",
                     f"{pipe.model_state_bytes(rank) / baseline.model_state_bytes(rank):.3f}",
                     records.format_bytes(pipe.states(rank)["buffers"]),
                     records.format_bytes(baseline.states(rank)["buffers"]), f"{pa:,}", f"{ba:,}", f"{pa / ba:.3f}"])
    return records.format_table(rows, ["rank", "model states: pipeline", "data parallel", "ratio",
                                       "buffers: pipeline", "data parallel", "activations: pipeline",
                                       "data parallel", "ratio"])


def utilization_table(runs: dict, counts=MICRO_BATCH_COUNTS) -> str:
    """Per micro-batch count: the share of the step each stage computed (1 - measured idle) against
    M/(M+S-1), and the step time against data parallelism's at the same global batch. Timings: print in a
    cell nbval does not compare."""

    base = step_median_s(runs[timed_names(runs)[1]])
    rows = []
    for m in counts:
        r = runs[f"pipeline-M{m}"]
        section = r.summary["pipeline"]
        busy = [1 - b for b in section["bubble_per_rank"]]
        rows.append([m, *(f"{b:.2f}" for b in busy), f"{1 - bubble_fraction(section['stages'], m):.2f}",
                     f"{step_median_s(r) * 1000:.1f}", f"{step_median_s(r) / base:.2f}x"])
    stages = runs[f"pipeline-M{counts[0]}"].summary["pipeline"]["stages"]
    rows.append(["data parallel", *([""] * stages), "1.00 (no bubble)", f"{base * 1000:.1f}", "1.00x"])
    return records.format_table(rows, ["M", *(f"stage {s} computing" for s in range(stages)), "M/(M+S-1)",
                                       "step ms", "step time / data parallel's (lower is faster)"])


def utilization_reading(runs: Mapping, load: load_guard.Load | None, counts=MICRO_BATCH_COUNTS) -> str:
    """What the step times of :func:`utilization_table` may be read for, to print above that table: where the load
    guard withholds the verdict of the pipeline against data parallelism (a busy machine, a drift, a difference
    within the spread), that first, then the range of this launch's ratios and why they do not show the schedule's
    cost; then the committed GPU reference's ratio, labelled with its device and date, which does."""
    first, base = timed_names(runs)
    ratios = [step_median_s(runs[f"pipeline-M{m}"]) / step_median_s(runs[base]) for m in counts]
    repeat = step_seconds(runs[AGAIN]) if AGAIN in runs and not _failed(runs, AGAIN) else None
    verdict = load_guard.compare({first: step_seconds(runs[first]), base: step_seconds(runs[base])}, load,
                                 repeat=repeat)
    steady = all(a >= b for a, b in zip(ratios, ratios[1:]))
    spread = f"{min(ratios):.2f}x to {max(ratios):.2f}x data parallelism's step time"
    if verdict.given:
        lines = [f"This launch ran alone: its step times may be read (verdicts below); the pipeline took {spread}."]
    else:
        busy = load is None or bool(load.reason())
        why = ("they hold the machine's other load and the Python work between instructions, not the cost of the "
               "bubble and the transfers, so they say nothing for or against it" if busy
               else "so they show no direction either way")
        lines = [f"Verdicts withheld ({verdict.withheld}). This launch's step times below (the pipeline at {spread}"
                 f"{'' if steady else ', not falling steadily as M grows'}): {why}."]
    for device, day, _, ref in references.reference_runs("pipeline")[-1:]:
        pipe, other = timed_names(ref)
        lines.append(f"The GPU reference ({device}, {day}) is what tests it: there {pipe} took "
                     f"{step_median_s(ref[pipe]) / step_median_s(ref[other]):.2f}x {other}'s step time.")
    return "\n".join(lines)


def measured_bubbles(runs: dict, counts=MICRO_BATCH_COUNTS) -> dict[int, list[float]]:
    """M -> measured idle share per stage, for :func:`helpers.topics.pipeline.bubble_vs_micro_batches`."""
    return {m: runs[f"pipeline-M{m}"].summary["pipeline"]["bubble_per_rank"] for m in counts}


def reference_report(name: str = "pipeline") -> str:
    """Every committed GPU result of this chapter (bubble and step time per M, memory per rank), or a plain
    statement that none is."""

    found = references.reference_runs(name)
    if not found:
        return references.no_references(name)
    blocks = []
    for device, date, note, runs in found:
        counts = sorted(int(k.removeprefix("pipeline-M")) for k in runs if k.startswith("pipeline-M"))
        blocks.append(f"Measured on {device}, {date} ({note}):\n{utilization_table(runs, counts)}\n\n"
                      f"{memory_table(runs['pipeline'], runs['data-parallel'])}")
    return "\n\n".join(blocks)


# --- other schedules DeepSpeed ships: DualPipeV -------------------------------------------------------

#: Short names of DeepSpeed's pipeline instructions (``deepspeed/runtime/pipe/schedule.py``), for
#: :func:`instruction_text`.
SHORT_NAMES = {"LoadMicroBatch": "Load", "ForwardPass": "F", "BackwardPass": "B", "SendActivation": "sendA",
               "RecvActivation": "recvA", "SendGrad": "sendG", "RecvGrad": "recvG", "CommitP2P": "commit",
               "ReduceTiedGrads": "reduceTied", "ReduceGrads": "reduce", "OptimizerStep": "step"}
#: The instructions that move a tensor between pipeline ranks.
TRANSFERS = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
#: The comms logger's names for the point-to-point calls of the two engines: ``PipelineEngine`` sends and
#: receives one tensor a call, ``DualPipeVEngine`` launches a step's queued transfers as one ``batch_isend_irecv``.
P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
#: Name of the committed GPU reference of DualPipeV against the default schedule (``notebooks/reference/``).
SCHEDULES_REFERENCE = "dualpipev"


def shipped_schedules() -> list[dict]:
    """The schedule classes DeepSpeed's ``deepspeed.runtime.pipe.schedule`` defines (every ``PipeSchedule``
    subclass there), each with the first sentence of its docstring and the engine methods whose source builds
    it (``_train_schedule`` and ``_inference_schedule`` of ``PipelineEngine`` and ``DualPipeVEngine``)."""
    ds_schedule = ds.load("deepspeed.runtime.pipe.schedule")
    DualPipeVEngine = ds.load("deepspeed.runtime.pipe.dualpipev").DualPipeVEngine
    PipelineEngine = ds.load("deepspeed.runtime.pipe.engine").PipelineEngine

    methods = {f"{engine.__name__}.{name}": inspect.getsource(vars(engine)[name])
               for engine in (PipelineEngine, DualPipeVEngine) for name in ("_train_schedule", "_inference_schedule")}
    found = []
    for name, cls in vars(ds_schedule).items():
        if not (isinstance(cls, type) and issubclass(cls, ds_schedule.PipeSchedule) and cls is not ds_schedule.PipeSchedule):
            continue
        paragraph = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
        found.append({"name": name, "doc": paragraph.split(". ")[0].rstrip(".") + ".",
                      "built_by": [method for method, source in methods.items() if f"{name}(" in source]})
    return found


def shipped_schedules_text() -> str:
    """:func:`shipped_schedules` as text: per class, its docstring's first sentence and who builds it."""
    return "\n".join(f"{s['name']}: \"{s['doc']}\"\n    built by: {', '.join(s['built_by']) or 'no engine'}"
                     for s in shipped_schedules())


def schedule_class(schedule: str):
    """DeepSpeed's schedule class that trains with ``schedule``: ``TrainSchedule`` (1F1B, what
    ``PipelineEngine`` runs) or ``DualPipeVSchedule`` (what ``DualPipeVEngine`` runs)."""
    ds_schedule = ds.load("deepspeed.runtime.pipe.schedule")

    check_schedule(schedule)
    return ds_schedule.DualPipeVSchedule if schedule == "dualpipev" else ds_schedule.TrainSchedule


def schedule_instructions(schedule: str, ranks: int, micro_batches: int) -> list[list[list]]:
    """The instructions of one ``train_batch`` as DeepSpeed's schedule class yields them to its engine: per
    pipeline rank, per schedule step, the list of ``PipeInstruction`` objects. Pure Python, no process group.
    DualPipeVSchedule raises a ValueError below ``2 * ranks`` micro-batches."""
    cls = schedule_class(schedule)
    return [[list(step) for step in cls(micro_batches=micro_batches, stages=ranks, stage_id=rank)]
            for rank in range(ranks)]


def instruction_label(instruction) -> str:
    """One instruction in a few characters: its short name (:data:`SHORT_NAMES`), then the buffer it works
    on, then ``'`` where it belongs to DualPipeV's phase 1 (the way back): ``F0``, ``recvA5'``, ``commit``."""
    label = SHORT_NAMES.get(instruction.name, instruction.name)
    if "buffer_id" in instruction.kwargs:
        label += str(instruction.kwargs["buffer_id"])
    return label + ("'" if instruction.kwargs.get("phase") == 1 else "")


def instruction_text(schedule: str, ranks: int, micro_batches: int) -> str:
    """DeepSpeed's schedule for ``ranks`` pipeline ranks and ``micro_batches`` micro-batches as text: per rank,
    one line per schedule step with that step's instructions (:func:`instruction_label`), as the engine runs them."""
    lines = []
    for rank, steps in enumerate(schedule_instructions(schedule, ranks, micro_batches)):
        lines.append(f"rank {rank}:")
        width = len(str(len(steps) - 1))
        lines += [f"  step {i:>{width}}: " + (" ".join(map(instruction_label, step)) or "(nothing)")
                  for i, step in enumerate(steps)]
    return "\n".join(lines)


def _peer(rank: int, name: str, phase: int) -> int:
    """The pipeline rank a transfer instruction sends to or receives from. Phase 0 (1F1B's only one) flows
    towards the last rank, DualPipeV's phase 1 back towards rank 0."""
    downstream, upstream = (rank + 1, rank - 1) if phase == 0 else (rank - 1, rank + 1)
    return downstream if name in ("SendActivation", "RecvGrad") else upstream


def replay(schedule: str, ranks: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> dict:
    """Play DeepSpeed's instruction lists (:func:`schedule_instructions`) on a model clock: each rank runs its
    instructions in order; a ``ForwardPass`` takes ``forward``, a ``BackwardPass`` ``backward``, everything
    else no time. Transfers rendezvous: ``PipelineEngine``'s sends and receives each block until the other side
    has launched its half; ``DualPipeVEngine`` queues them and its next ``CommitP2P`` launches them all and waits
    until every other side has launched its half (the k-th send from one rank to another matches the k-th
    receive there; moving the tensor takes no time). ``forward`` and ``backward`` are one stage's times: at the
    same model and ranks, a 1F1B stage holds the layers of two DualPipeV stages.

    Returns {"span": when the last rank finishes, "busy": compute time per rank, "idle": per rank, the share
    of the span it does not compute}."""
    programs = []
    for steps in schedule_instructions(schedule, ranks, micro_batches):
        program = []
        for instruction in (i for step in steps for i in step):
            program.append((instruction.name, instruction.kwargs.get("phase", 0)))
            if schedule == "1f1b" and instruction.name in TRANSFERS:
                program.append(("CommitP2P", 0))  # a blocking send or receive: a rendezvous of its own
        programs.append(program)

    pc, clock, busy = [0] * ranks, [0.0] * ranks, [0.0] * ranks
    queued: list[list[tuple]] = [[] for _ in range(ranks)]  # (sender, receiver, k, is_send) not yet committed
    launched: dict[tuple, float] = {}  # the same keys -> when that side launched its half
    sent: dict[tuple, int] = {}  # (sender, receiver, is_send) -> transfers counted so far
    waiting = [False] * ranks  # a rank whose CommitP2P launched its transfers and waits for the other sides
    while any(pc[r] < len(programs[r]) for r in range(ranks)):
        moved = False
        for rank in range(ranks):
            while pc[rank] < len(programs[rank]):
                name, phase = programs[rank][pc[rank]]
                if name in TRANSFERS:
                    send = name.startswith("Send")
                    peer = _peer(rank, name, phase)
                    link = (rank, peer) if send else (peer, rank)
                    k = sent[(*link, send)] = sent.get((*link, send), -1) + 1
                    queued[rank].append((*link, k, send))
                elif name == "CommitP2P":
                    if not waiting[rank]:
                        launched.update({op: clock[rank] for op in queued[rank]})
                        waiting[rank] = moved = True
                    partners = [(a, b, k, not send) for a, b, k, send in queued[rank]]
                    if not all(p in launched for p in partners):
                        break
                    clock[rank] = max([clock[rank], *(launched[p] for p in partners)])
                    queued[rank], waiting[rank] = [], False
                elif name in COMPUTE:
                    took = forward if name == "ForwardPass" else backward
                    clock[rank] += took
                    busy[rank] += took
                pc[rank] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the {schedule} schedule of {ranks} ranks and {micro_batches} micro-batches deadlocks "
                               f"in the replay, at instructions {pc}")
    span = max(clock)
    return {"span": span, "busy": busy, "idle": [1 - b / span for b in busy]}


def bubble_time(schedule: str, ranks: int, forward: float = 1.0, backward: float = 2.0, weight: float = 0.0,
                overlapped: float | None = None) -> float:
    """The idle time per rank of one step by the formulas of the DualPipe repository's README (table "Pipeline
    Bubbles and Memory Usage Comparison"), in the time of one DualPipeV stage's ``forward`` and ``backward`` at
    the same model and ranks: 1F1B (PP-1)(F+B) with PP = ``ranks`` stages, each the layers of two DualPipeV
    stages, so (ranks-1)·2(F+B); DualPipeV (PP/2-1)(F&B+B-3W) with PP = 2·``ranks`` stages. ``weight`` (W) is
    the part of a backward that computes weight gradients and DualPipe defers; DeepSpeed's DualPipeVSchedule
    keeps it inside ``BackwardPass``: 0. ``overlapped`` (F&B) is a forward and a backward run overlapped; one
    after the other (DeepSpeed's engine, one instruction at a time): F + B, the default."""
    check_schedule(schedule)
    if schedule == "1f1b":
        return (ranks - 1) * 2 * (forward + backward)
    both = forward + backward if overlapped is None else overlapped
    return (ranks - 1) * (both + backward - 3 * weight)


def bubble_share(schedule: str, ranks: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """The share of a step each rank idles by :func:`bubble_time`: idle / (idle + compute), a rank computing
    the forward and backward of every micro-batch through the layers it holds (2·M DualPipeV stages' worth).
    For 1F1B it is (S-1)/(M+S-1)."""
    idle = bubble_time(schedule, ranks, forward, backward)
    return idle / (idle + 2 * micro_batches * (forward + backward))


def schedule_bubble_table(cases=((2, 4), (2, 8), (4, 8), (4, 16)), forward: float = 1.0, backward: float = 2.0) -> str:
    """Per (ranks, micro-batches): the idle time per rank of 1F1B and DualPipeV by the formulas
    (:func:`bubble_time`) and by replaying DeepSpeed's own instruction lists (:func:`replay`), in units of one
    DualPipeV stage's forward, and the share of the step it is."""
    rows = []
    for ranks, m in cases:
        one = replay("1f1b", ranks, m, 2 * forward, 2 * backward)  # a 1F1B stage: two DualPipeV stages' layers
        two = replay("dualpipev", ranks, m, forward, backward)
        idle = [run["span"] - max(run["busy"]) for run in (one, two)]
        rows.append([ranks, m, f"{bubble_time('1f1b', ranks, forward, backward):g}", f"{idle[0]:g}",
                     f"{bubble_share('1f1b', ranks, m, forward, backward):.3f}", f"{max(one['idle']):.3f}",
                     f"{bubble_time('dualpipev', ranks, forward, backward):g}", f"{idle[1]:g}",
                     f"{bubble_share('dualpipev', ranks, m, forward, backward):.3f}", f"{max(two['idle']):.3f}"])
    return records.format_table(rows, ["ranks", "M", "1F1B idle: formula", "replayed", "share: formula", "replayed",
                                       "DualPipeV idle: formula", "replayed", "share: formula", "replayed"])


def schedule_transfers(schedule: str, ranks: int, micro_batches: int, rank: int = 0) -> int:
    """How many tensors ``rank`` sends or receives in one step of DeepSpeed's schedule (its ``SendActivation``,
    ``RecvActivation``, ``SendGrad`` and ``RecvGrad`` instructions)."""
    steps = schedule_instructions(schedule, ranks, micro_batches)[rank]
    return sum(i.name in TRANSFERS for step in steps for i in step)


def p2p_per_step(record) -> dict[str, float]:
    """Point-to-point traffic of rank 0 per optimizer step, from the comms logger (:data:`P2P_OPS`):
    {"calls", "bytes"}, a ``batch_isend_irecv`` counted as one call with the bytes of every tensor it moves."""
    ops = record.comm_ops()
    return {key: sum(ops.get(op, {}).get(key, 0) for op in P2P_OPS) for key in ("count", "bytes")}


def _failed(runs: Mapping, name: str) -> str | None:
    """Why run ``name`` of a sweep did not train (its recorded failure), or None when it did."""
    run = runs.get(name)
    if run is None:
        return f"{name}: not in these runs"
    return f"{name}: {run}" if isinstance(run, Exception) else None


def schedule_p2p_table(runs: Mapping, names=(DEFAULT, DUALPIPEV)) -> str:
    """Per schedule: rank 0's send/recv calls and bytes per step (comms logger) against the transfers its
    DeepSpeed schedule lists times one micro-batch's activation, b·s·h·bytes (:func:`pipeline_p2p_bytes`)."""
    rows = []
    for name in names:
        r = runs[name]
        schedule = r.summary["pipeline"]["schedule"]
        shape, ranks, m = models.shape_of(r.model_name), r.summary["pipeline"]["stages"], r["grad_accum"]
        transfers = schedule_transfers(schedule, ranks, m)
        expected = transfers * pipeline_p2p_bytes(r["micro_batch"], shape.seq, shape.hidden, r["precision"])
        measured = p2p_per_step(r)
        rows.append([name, schedule, m, f"{measured['count']:g}", f"{measured['bytes']:,.0f}", transfers,
                     f"{expected:,.0f}"])
    return records.format_table(rows, ["run", "schedule", "M", "p2p calls/step", "bytes/step (rank 0)",
                                       "transfers in schedule", "transfers x b·s·h·bytes"])


def phase_table(record) -> str:
    """Which layers each stage of a DualPipeV run holds, and on which rank: stage r (phase 0, the way out) and
    stage 2·ranks-1-r (phase 1, the way back) on rank r; parameters per rank."""
    section = record.summary["pipeline"]
    rows = []
    for r in section["per_rank"]:
        for phase, found in enumerate(r["phases"]):
            last = found["first_layer"] + len(found["layers"]) - 1
            rows.append([found["stage"], r["stage"], phase, ", ".join(found["layers"]),
                         f"{found['first_layer']}..{last}", f"{r['params']:,}" if phase == 0 else ""])
    rows.sort(key=lambda row: row[0])
    return records.format_table(rows, ["stage", "rank", "phase", "layers", "layer indices", "parameters (rank)"])


def schedule_comparison(runs: Mapping, names=(DEFAULT, DUALPIPEV), baseline: str = "data-parallel") -> str:
    """DualPipeV against the default schedule in one sweep, in what does not depend on the processor: whether
    their losses agree (within :data:`helpers.core.records.LOSS_TOLERANCE`: the same micro-batches, added in the
    same order) and with data parallelism's (:data:`helpers.core.records.REORDERED_TOLERANCE`), which layers each
    DualPipeV stage holds, and the point-to-point traffic. Where DualPipeV did not train: its recorded error."""
    failure = next(filter(None, (_failed(runs, n) for n in names)), None)
    if failure:
        return f"did not train: {failure}"
    default, other = (runs[n] for n in names)
    lines = [f"losses, {names[1]} against {names[0]}: "
             + records.loss_agreement(other.losses, default.losses, default["precision"])]
    if baseline in runs and not isinstance(runs[baseline], Exception):
        tolerance = records.REORDERED_TOLERANCE[default["precision"]]
        lines.append(f"losses, {names[1]} against {baseline}: "
                     + records.loss_agreement(other.losses, runs[baseline].losses, tolerance=tolerance))
    bytes_ = [p2p_per_step(r)["bytes"] for r in (default, other)]
    lines += ["", phase_table(other), "", schedule_p2p_table(runs, names), "",
              f"{names[1]} moves {records.format_ratio(bytes_[1], bytes_[0], suffix='x')} the point-to-point bytes "
              f"of {names[0]} per step"]
    return "\n".join(lines)


def schedule_timing_table(runs: Mapping, names: Sequence[str] | None = None) -> str:
    """Per schedule: step time (median), against the first, and each rank's measured idle share (the
    ``pipeline`` probe) beside the formula's (:func:`bubble_share`, backward = 2 x forward); ``names`` default
    to the 1F1B run probed as DualPipeV's (:func:`timed_names`). Timings: print in a cell nbval does not compare."""
    names = names or (timed_names(runs)[0], DUALPIPEV)
    failure = next(filter(None, (_failed(runs, n) for n in names)), None)
    if failure:
        return f"did not train: {failure}"
    base = step_median_s(runs[names[0]])
    rows = []
    for name in names:
        r = runs[name]
        section = r.summary["pipeline"]
        rows.append([name, section["schedule"], f"{step_median_s(r) * 1000:.1f}", f"{step_median_s(r) / base:.2f}x",
                     *(f"{b:.2f}" for b in section["bubble_per_rank"]),
                     f"{bubble_share(section['schedule'], section['stages'], section['micro_batches']):.3f}"])
    ranks = runs[names[0]].summary["pipeline"]["stages"]
    return records.format_table(rows, ["run", "schedule", "step ms", "step time / 1F1B's (lower is faster)",
                                       *(f"rank {s} idle" for s in range(ranks)),
                                       "idle by formula"])


def step_seconds(record: records.Record) -> list[float]:
    """A run's step times in seconds after the first step (which warms up)."""
    return record.timing.all_s[1:]


def step_median_s(record: records.Record) -> float:
    """The median of :func:`step_seconds`: the step time every table and verdict of the chapter quotes."""
    return statistics.median(step_seconds(record))


#: The launch's two timing comparisons: (label, the run compared with 1F1B; ``None``: data parallelism's timed run).
TIMED_PAIRS = (("DualPipeV against 1F1B", DUALPIPEV), ("the pipeline against data parallelism", None))


def _meaning(other: str, ratio: float) -> str:
    """What a given verdict of ``other`` against the M = 4 pipeline means (``ratio``: other's median over the
    pipeline's)."""
    if other == DUALPIPEV:
        return (f"DualPipeV took {ratio:.2f}x 1F1B's step time: its smaller bubble by the formula did not shorten the "
                "step here." if ratio > 1 else
                f"DualPipeV took {ratio:.2f}x 1F1B's step time: it shortened the step here.")
    return (f"The pipeline took {1 / ratio:.2f}x data parallelism's step time: for a model that fits one device, "
            "splitting it into stages cost time here (its bubble and transfers)." if ratio < 1 else
            f"The pipeline took {1 / ratio:.2f}x data parallelism's step time: faster here, as what data parallelism "
            "pays instead (every rank runs every layer and all-reduces every gradient) cost more than the bubble.")


def timing_verdicts(runs: Mapping, load: load_guard.Load | None) -> str:
    """This launch's timing comparisons (:data:`TIMED_PAIRS`) through the course's load guard: a verdict only
    where the launch had its devices to itself (``load``), the ``pipeline`` run repeated at the end
    (:data:`AGAIN`) stayed within its first run's spread, and the difference exceeds the steps' spread;
    then one sentence on what it means. Otherwise the line says why it withholds one."""
    reason = load.reason() if load is not None else "not recorded"
    lines = [f"Load beside the launch: {reason or 'none, it had its devices to itself'}."]
    repeat = step_seconds(runs[AGAIN]) if AGAIN in runs and not _failed(runs, AGAIN) else None
    first, baseline = timed_names(runs)
    for label, other in TIMED_PAIRS:
        other = other or baseline
        failure = _failed(runs, other) or _failed(runs, first)
        if failure:
            lines.append(f"{label}: no verdict, {failure}")
            continue
        verdict = load_guard.compare({first: step_seconds(runs[first]), other: step_seconds(runs[other])}, load,
                                     repeat=repeat)
        lines.append(f"{label}: {load_guard.sentence(verdict)}")
        if verdict.given:
            lines.append("  " + _meaning(other, verdict.medians[1] / verdict.medians[0]))
    return "\n".join(lines)


def reference_timings(runs: Mapping | None = None, load: load_guard.Load | None = None) -> str:
    """The committed GPU references' step times for :data:`TIMED_PAIRS` (device and date, the ratio of the medians
    and the steps' spread). With ``runs`` and their ``load``: where this launch's verdict was given and its ratio
    differs from a reference's by more than both spreads, a line says they disagree; where it was withheld for the
    load or a drift, that no comparison is drawn."""
    found = {**{n: (d, day, r) for d, day, _, r in references.reference_runs(SCHEDULES_REFERENCE)
                for n in (DUALPIPEV,)},
             **{n: (d, day, r) for d, day, _, r in references.reference_runs("pipeline") for n in (None,)}}
    lines = []
    for label, key in TIMED_PAIRS:
        if key not in found:
            lines.append(f"{label}: no committed GPU reference")
            continue
        device, day, ref = found[key]
        pipe, other = timed_names(ref)[0], key or timed_names(ref)[1]
        first, second = step_seconds(ref[pipe]), step_seconds(ref[other])
        # shown as DualPipeV against 1F1B, and as the pipeline against data parallelism
        slow, fast = (other, pipe) if other == DUALPIPEV else (pipe, other)
        ratio = statistics.median(step_seconds(ref[slow])) / statistics.median(step_seconds(ref[fast]))
        spread = max(load_guard.spread(first), load_guard.spread(second))
        line = (f"{label}, reference ({device}, {day}): {slow} {ratio:.2f}x {fast}'s step time "
                f"(medians {statistics.median(step_seconds(ref[slow])) * 1e3:,.1f} and "
                f"{statistics.median(step_seconds(ref[fast])) * 1e3:,.1f} ms, steps' spread {spread:.0%})")
        mine_pipe, mine_other = timed_names(runs or {})[0], key or timed_names(runs or {})[1]
        if runs is not None and not (_failed(runs, mine_other) or _failed(runs, mine_pipe)):
            repeat = step_seconds(runs[AGAIN]) if AGAIN in runs and not _failed(runs, AGAIN) else None
            mine = load_guard.compare({mine_pipe: step_seconds(runs[mine_pipe]),
                                       mine_other: step_seconds(runs[mine_other])}, load, repeat=repeat)
            mine_slow, mine_fast = (mine_other, mine_pipe) if key == DUALPIPEV else (mine_pipe, mine_other)
            measured = (statistics.median(step_seconds(runs[mine_slow]))
                        / statistics.median(step_seconds(runs[mine_fast])))
            # a launch whose two runs differ within their spread still compares; one not alone, or drifting, does not
            if not mine.given and not mine.withheld.startswith("the difference"):
                line += "; this launch's verdict is withheld, so no comparison with it is drawn"
            elif abs(measured / ratio - 1) > max(spread, mine.spread):
                line += (f"; this launch DISAGREES beyond both spreads: {measured:.2f}x here against {ratio:.2f}x "
                         "in the reference")
            else:
                line += f"; this launch agrees within the spread ({measured:.2f}x)"
        lines.append(line)
    return "\n".join(lines)


def save_schedules_reference(runs: Mapping, note: str, names: Sequence[str] | None = None):
    """On GPUs, keep the default schedule's runs (the memory-probed one and :data:`TIMED`, where present) and
    DualPipeV's (:data:`SCHEDULES_REFERENCE`) the way :func:`helpers.core.references.save_reference` keeps a
    chapter's results, when they trained. Returns the file written, or None (a schedule that did not train)."""
    names = names or (DEFAULT, *((TIMED,) if TIMED in runs else ()), DUALPIPEV)
    if any(_failed(runs, n) for n in names):
        return None
    return references.save_reference(SCHEDULES_REFERENCE, {n: runs[n] for n in names}, note=note)


def schedules_reference_report() -> str:
    """Every committed GPU comparison of DualPipeV with the default schedule, or a plain statement that none is."""
    def render(runs: dict) -> str:
        return f"{schedule_timing_table(runs)}\n\n{schedule_comparison(runs)}"
    return references.references_report(SCHEDULES_REFERENCE, render, references.GPU_HOW)


# --- figures ----------------------------------------------------------------------------------------

def pipeline_timeline(record, title: str | None = None):
    """One optimizer step of a pipeline run as a Gantt chart: per stage, what each instruction took (from the
    ``pipeline`` probe). Forward and backward passes are labelled with their micro-batch; the legend names every
    colour."""
    plt = plots.pyplot()
    from matplotlib import patches  # after plots.pyplot() has chosen the backend
    section = record.summary["pipeline"]
    steps = section["last_step"]
    start = min(i[1] for rank in steps for i in rank)
    kinds = {"ForwardPass": ("#4C72B0", "forward (blue)"), "BackwardPass": ("#DD8452", "backward (orange)"),
             "SendActivation": ("#999999", "send (dark grey)"), "SendGrad": ("#999999", None),
             "RecvActivation": ("#cccccc", "receive (light grey)"), "RecvGrad": ("#cccccc", None),
             "ReduceGrads": ("#C44E52", "gradient reduction (red)"), "OptimizerStep": ("#55A868", "optimizer step (green)")}
    other = ("#eeeeee", "load micro-batch, other (lightest grey)")
    fig, ax = plt.subplots(figsize=(9.5, 0.9 + 0.7 * len(steps)))
    for rank, instructions in enumerate(steps):
        counters = {"ForwardPass": 0, "BackwardPass": 0}
        for kind, begin, end in instructions:
            ax.barh(rank, (end - begin) * 1000, left=(begin - start) * 1000, color=kinds.get(kind, other)[0],
                    edgecolor="white", linewidth=0.3)
            if kind in counters:
                ax.text((begin + end) / 2 * 1000 - start * 1000, rank, f"{kind[0]}{counters[kind]}", ha="center",
                        va="center", fontsize=6, color="white")
                counters[kind] += 1
    handles = [patches.Patch(facecolor=colour, edgecolor="#888888", linewidth=0.5, label=label) for colour, label in (*kinds.values(), other) if label]
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_yticks(range(len(steps)), [f"stage {s}" for s in range(len(steps))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first instruction")
    ax.set_title(title or f"One step, {section['stages']} stages x {section['micro_batches']} micro-batches "
                          "(F0, B0: forward and backward of micro-batch 0)", fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def reference_bubbles(name: str = "pipeline") -> tuple[str, dict[int, list[float]]] | None:
    """The first committed GPU reference's measured idle shares per M (:func:`measured_bubbles`), labelled with
    its device and date; None where none is committed."""
    for device, day, _, runs in references.reference_runs(name):
        counts = sorted(int(n.removeprefix("pipeline-M")) for n in runs if n.startswith("pipeline-M"))
        return f"{device}, {day}", measured_bubbles(runs, counts)
    return None


def bubble_trend(measured: Mapping[int, Sequence[float]], where: str = "this launch") -> str:
    """Whether each stage's measured idle share falls as M grows, as (S-1)/(M+S-1) does, said of ``where``; where
    it falls over the first three or more counts only, up to which M."""
    counts = sorted(measured)
    falling = [all(measured[a][s] > measured[b][s] for s in range(len(measured[counts[0]])))
               for a, b in zip(counts, counts[1:])]
    if all(falling):
        return f"{where}: every stage's idle share falls as M grows, as the formula's does."
    steps = falling.index(False)  # how many steps from the smallest M fall on every stage
    if steps >= 2:
        return (f"{where}: every stage's idle share falls from M = {counts[0]} to M = {counts[steps]}, as the "
                f"formula's does; beyond M = {counts[steps]} they do not fall, while the formula's still does.")
    return f"{where}: the idle shares do not fall steadily as M grows; the formula's trend does not show here."


def bubble_vs_micro_batches(measured: Mapping[int, Sequence[float]], stages: int, title: str | None = None,
                            reference: tuple[str, Mapping[int, Sequence[float]]] | None = None):
    """Measured idle share of each stage against the number of micro-batches M, beside (S-1)/(M+S-1);
    ``reference``: (label, the same for a committed run), drawn with open markers."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    counts = sorted(set(measured) | set(reference[1] if reference else ()))
    dense = list(range(1, max(counts) + 1))
    ax.plot(dense, [bubble_fraction(stages, m) for m in dense], "k--", label="(S-1)/(M+S-1)")
    for label, points, style in ([("this launch", measured, "o-")]
                                 + ([(reference[0], reference[1], "s:")] if reference else [])):
        ms = sorted(points)
        for stage in range(len(points[ms[0]])):
            ax.plot(ms, [points[m][stage] for m in ms], style, mfc="none" if style == "s:" else None,
                    label=f"stage {stage}, {label}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="micro-batches per step M", ylabel="share of the step idle", ylim=(0, 1),
           title=title or f"Pipeline bubble, {stages} stages")
    ax.minorticks_off()
    ax.set_xticks(counts, [str(m) for m in counts])
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- exercises: the micro-batches for a bubble, partition a pipeline, the bytes between stages --------------------

def exercise_p2p_bytes(answer: object, record: records.Record) -> exercises.Verdict:
    """Exercise: the bytes stage 0 of the pipeline run ``record`` sends and receives per optimizer step, read from
    DeepSpeed's comms logger on rank 0 (``send`` plus ``recv``); within 1%."""
    ops = record.comm_ops()
    sent, received = (ops.get(op, {"count": 0, "bytes": 0}) for op in ("send", "recv"))
    return exercises.number(
        "stage bytes", answer, sent["bytes"] + received["bytes"], relative=0.01,
        task=f"Predict the bytes stage 0 sends plus receives per optimizer step in the run '{record.name}': the same "
             f"global batch of {record['train_batch']} samples, cut into M = {record['grad_accum']} micro-batches of "
             f"{record['micro_batch']} (within 1%).",
        hint="ask what crosses the boundary between the stages for one micro-batch, in each direction, and its "
             "shape (the sizes 'The stages' printed); then what cutting the same global batch into more "
             "micro-batches changes in the total.",
        why=f"DeepSpeed's comms logger on rank 0: {sent['count']:g} sends and {received['count']:g} receives per step, "
            f"{sent['bytes']:,.0f} + {received['bytes']:,.0f} bytes: one activation of b·s·h elements out and its "
            "gradient back per micro-batch. M·b is the global batch, so the bytes per step do not depend on M; only "
            "the number of calls does.")


def exercise_micro_batches(answer: object, stages: int = 4, share: float = 0.1) -> exercises.Verdict:
    """Exercise: predict the fewest micro-batches M that bring each stage's idle share in DeepSpeed's schedule of
    ``stages`` stages under ``share``, counted in DeepSpeed's own ``TrainSchedule`` for M = 1, 2, ..."""
    fewest = next(m for m in itertools.count(1) if schedule_bubble(stages, m) < share)
    return exercises.number(
        "micro-batches", answer, fewest, absolute=0.5,
        task=f"Predict the fewest micro-batches M per step for which each stage of a {stages}-stage pipeline idles "
             f"less than {share:.0%} of its steps in DeepSpeed's schedule.",
        hint="the quantity is each stage's idle share, and the formula is the bubble counted under 'The schedule "
             "and its bubble'; M is a whole number.",
        why=f"(S-1)/(M+S-1) < {share:g} needs M > {(stages - 1) / share - (stages - 1):g}: M = {fewest} gives "
            f"{schedule_bubble(stages, fewest):.4f} in DeepSpeed's TrainSchedule, M = {fewest - 1} still "
            f"{schedule_bubble(stages, fewest - 1):.4f}. The S-1 idle steps at each end do not shrink; only more "
            "micro-batches dilute them, and at a fixed global batch each gets smaller.")


def pipeline_layers(name: str = "llama-gpu", vocab: int | None = None) -> list[nn.Module]:
    """The pipeline layers of the LLaMA-style model ``name`` (:func:`llama_stages`), with a vocabulary of ``vocab``
    tokens where given, built on the meta device: their parameters have shapes but no memory, enough for
    DeepSpeed to count them."""
    from transformers import LlamaForCausalLM  # deferred: slow to import

    config = models.llama_config(name)
    if vocab is not None:
        config.vocab_size = vocab
    with torch.device("meta"):
        return llama_stages(LlamaForCausalLM(config))


def deepspeed_partition(layers: Sequence[nn.Module], num_stages: int, partition_method: str) -> list[int]:
    """The stage boundaries ``PipelineModule(layers, num_stages, partition_method=...)`` computes, by DeepSpeed's
    own ``PipelineModule._partition_layers`` (run on a stand-in that has the layers and no process group):
    stage k holds ``layers[parts[k]:parts[k+1]]``."""
    PipelineModule = ds.load("deepspeed.pipe").PipelineModule

    if not isinstance(partition_method, str):
        raise TypeError(f"partition_method is a string, not {type(partition_method).__name__}")
    stand_in = type("StandIn", (), {})()
    stand_in.num_stages, stand_in.global_rank, stand_in.loss_fn = num_stages, 1, None  # rank 1: DeepSpeed prints nothing
    stand_in._layer_specs = list(layers)
    stand_in._topo = type("Topology", (), {"get_coord": staticmethod(lambda rank: type("Coord", (), {"pipe": 0})())})()
    stand_in._count_layer_params = lambda: PipelineModule._count_layer_params(stand_in)
    stand_in._find_layer_type = lambda name: PipelineModule._find_layer_type(stand_in, name)
    stand_in._set_bounds = lambda start, stop: None
    PipelineModule._partition_layers(stand_in, method=partition_method)
    return [int(part) for part in stand_in.parts]


def exercise_partition(answer: object, name: str = "llama-gpu", num_stages: int = 4,
                       vocab: int = 32_000) -> exercises.Verdict:
    """Exercise: a ``partition_method`` for ``PipelineModule`` that gives each of ``num_stages`` stages of
    ``name``'s pipeline layers, with a vocabulary of ``vocab`` tokens, the same number of decoder layers, checked
    by DeepSpeed's own partitioning."""
    layers = pipeline_layers(name, vocab)

    def decoders(cuts: list[int]) -> list[int]:
        return [sum(isinstance(layer, DecoderStage) for layer in layers[a:b]) for a, b in zip(cuts, cuts[1:])]

    def test(method: str) -> tuple[bool, str]:
        try:
            parts = deepspeed_partition(layers, num_stages, method)
        except (NotImplementedError, RuntimeError) as error:  # DeepSpeed's refusals of a method
            return False, f"DeepSpeed refuses it: {str(error).rstrip('.')}."
        found = f"DeepSpeed cuts at {parts}: decoder layers per stage {decoders(parts)}."
        others = "; ".join(f"'{m}' gives {decoders(deepspeed_partition(layers, num_stages, m))}"
                           for m in ("parameters", "uniform") if m != method)
        return len(set(decoders(parts))) == 1, (
            f"{found} {others}: with {vocab:,} tokens the embedding and the head each weigh more than two decoder "
            "layers, so balancing parameters or layer counts leaves the decoders unequal; 'type:DecoderStage' "
            "counts only the layers whose class name matches.")
    return exercises.satisfies(
        "partition_method", answer, test,
        task=f"Write the partition_method of PipelineModule(layers, num_stages={num_stages}, partition_method=...) "
             f"that gives each stage the same number of decoder layers of {name} ({models.shape_of(name).layers} "
             f"decoder layers between an embedding and a head: {len(layers)} pipeline layers) with a vocabulary "
             f"of {vocab:,} tokens, as LLaMA's.",
        hint="with this vocabulary the embedding and the head each hold far more parameters than a decoder layer; "
             "ask of each option of 'The stages' what it makes equal across stages.")


# --- formulas ---------------------------------------------------------------------------------------

def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The pipeline bubble of a synchronous schedule (GPipe, 1F1B): each stage idles (S-1)/(M+S-1) of a step."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages={stages}, micro_batches={micro_batches}: both must be at least 1")
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_p2p_bytes(batch: int, seq: int, hidden: int, precision: str = "fp32") -> float:
    """Bytes one stage sends to the next per micro-batch (its output activations, b·s·h); the gradient of the
    same size comes back in backward."""
    theory.bytes_per_element(precision)  # a clear error for an unknown precision
    return batch * seq * hidden * theory.BYTES_PER_ELEMENT[precision]
