"""Pipeline parallelism: the LLaMA-style model cut into stages, DeepSpeed's schedule, and what each stage did.

- :func:`llama_pipeline` turns a ``LlamaForCausalLM`` into a ``deepspeed.pipe.PipelineModule``: embedding,
  one stage layer per decoder layer, final norm + LM head, with the same weights and arithmetic as the
  unsplit model (each decoder stage rebuilds the rotary embedding and causal mask it needs).
- :func:`schedule_grid` and :func:`schedule_bubble` read DeepSpeed's own ``TrainSchedule`` (pure Python,
  no process group): which micro-batch each stage computes in each step, and the share of idle steps.
- :func:`dispatch_after_backward` lets the probes' ``after_backward`` fire inside ``engine.train_batch``.
- The ``pipeline`` probe times every instruction each stage executes (forward, backward, send, receive,
  ...): busy time against the time the whole pipeline took, the measured bubble.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch
from torch import nn

from helpers.probes import Probe, RunContext, register

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
        from transformers.masking_utils import create_causal_mask

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
    import inspect

    from transformers.masking_utils import create_causal_mask

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


def llama_pipeline(model, num_stages: int | None = None, partition_method: str = "parameters"):
    """``model`` as a ``deepspeed.pipe.PipelineModule`` of ``num_stages`` stages (default: one per rank),
    balanced by parameter count; the loss is :func:`helpers.models.lm_loss`. Needs the process group."""
    import deepspeed.comm as dist
    from deepspeed.pipe import PipelineModule

    from helpers import models

    stages = num_stages or dist.get_world_size()
    return PipelineModule(layers=llama_stages(model), num_stages=stages, loss_fn=models.lm_loss,
                          partition_method=partition_method)


# --- DeepSpeed's schedule, read without running it ------------------------------------------------

def schedule_grid(stages: int, micro_batches: int) -> list[list[str]]:
    """What each stage computes in each step of DeepSpeed's ``TrainSchedule`` (1F1B): one row per stage,
    one cell per step: ``"F2"`` (forward of micro-batch 2), ``"B0"`` (backward of micro-batch 0) or ``""``
    (nothing to compute: the bubble)."""
    from deepspeed.runtime.pipe import schedule

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


# --- hooks inside engine.train_batch ----------------------------------------------------------------

def instruction_hooks(engine) -> list[Callable]:
    """The callbacks ``hook(kind, started, kwargs)`` run after each schedule instruction of this pipeline
    engine (``kind`` as ``"ForwardPass"``, ``started`` its ``time.perf_counter()`` start). The first call
    wraps the engine's instruction table; later calls return the same list."""
    hooks = engine.__dict__.get("_course_instruction_hooks")
    if hooks is None:
        if not hasattr(type(engine), "_INSTRUCTION_MAP"):
            raise TypeError(f"{type(engine).__name__} is not DeepSpeed's PipelineEngine: train a '-pipe' model")
        hooks = []

        def wrap(kind: str, run: Callable) -> Callable:
            def timed(self, **kwargs):
                started = time.perf_counter()
                run(self, **kwargs)
                for hook in hooks:
                    hook(kind, started, kwargs)
            return timed

        engine._course_instruction_hooks = hooks
        engine._INSTRUCTION_MAP = {cls: wrap(cls.__name__, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
    return hooks


def dispatch_after_backward(ctx: RunContext, step: int, probes: list) -> None:
    """Make every probe's ``after_backward(ctx, step, m)`` fire after the backward of micro-batch ``m`` of
    this stage during the next ``engine.train_batch`` (micro-batches counted in the order this stage runs
    their backward). Call before each ``train_batch``."""
    state = ctx.engine.__dict__.setdefault("_course_backward_state", {})
    if not state:
        def after_instruction(kind: str, started: float, kwargs: dict) -> None:
            if kind == "BackwardPass":
                for probe in state["probes"]:
                    probe.after_backward(state["ctx"], state["step"], state["micro"])
                state["micro"] += 1

        instruction_hooks(ctx.engine).append(after_instruction)
    state.update(ctx=ctx, step=step, probes=probes, micro=0)


# --- the probe ---------------------------------------------------------------------------------------

@register
class PipelineTimeline(Probe):
    """Every schedule instruction each stage runs in ``engine.train_batch``, timed (device synchronized
    after each), and the stage's layers and parameters.

    Per optimizer step (the first is left out: warm-up), the pipeline's span runs from the first
    instruction any stage starts to the end of the last backward any stage finishes; a stage's bubble
    is the share of that span it spent not computing (not in ``ForwardPass`` or ``BackwardPass``).
    Rank clocks are comparable because all ranks share one host's monotonic clock.
    Section: ``pipeline``.
    """

    name = "pipeline"
    trainer = "pipeline"

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
        return {"stage": int(ctx.engine.stage_id), "stages": int(ctx.engine.num_stages),
                "layers": [type(layer).__name__ for layer in module.forward_funcs],
                "first_layer": int(module._local_start),
                "params": sum(p.numel() for p in module.parameters()),
                "instructions": self.steps}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        measured = list(range(1, ctx.steps)) or [0]
        per_step = [step_bubbles([r["instructions"][s] for r in ranks]) for s in measured]
        stages = ranks[0]["stages"]
        last = [[(kind, begin, end) for kind, begin, end in r["instructions"][measured[-1]]] for r in ranks]
        return {"pipeline": {
            "stages": stages, "micro_batches": ctx.grad_accum,
            "per_rank": [{key: r[key] for key in ("stage", "layers", "first_layer", "params")} for r in ranks],
            "bubble_per_rank": [statistics.median(step[rank] for step in per_step) for rank in range(len(ranks))],
            "bubble_per_step": per_step, "measured_steps": [s + 1 for s in measured],
            "seconds_by_instruction": [seconds_by_kind(r["instructions"], measured) for r in ranks],
            "last_step": last,
        }}


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

PROBES = ("timing", "model_states", "comm", "pipeline", "activations")
#: Micro-batches per optimizer step for the bubble runs; the micro-batch shrinks so the global batch stays.
MICRO_BATCH_COUNTS = (1, 2, 4, 8)


def _batch(global_batch: int, micro_batches: int, data_parallel: int) -> dict:
    micro = global_batch // (micro_batches * data_parallel)
    if micro * micro_batches * data_parallel != global_batch:
        raise ValueError(f"global batch {global_batch} is not {micro_batches} micro-batches x {data_parallel} ranks")
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": micro_batches}


def pipeline_runs(size: str = "llama", global_batch: int = 16, steps: int = 4,
                  micro_batch_counts=MICRO_BATCH_COUNTS, world_size: int | None = None) -> dict:
    """One launch: data parallelism (ZeRO-0) and the same model as a pipeline of one stage per rank, at the
    same global batch: ZeRO-1 with 4 micro-batches (every probe), ZeRO-1 with each of ``micro_batch_counts``
    (the bubble), ZeRO-0 with and without gradient clipping (beside data parallelism without it), and
    ZeRO-2 and 3 (refused; recorded). Returns {run name: Record or RunFailed}."""
    from helpers import environment, launch

    world = environment.detect(world_size).default_world_size
    pipe = f"{size}-pipe"
    noclip = {"gradient_clipping": 0.0}
    spec = lambda config, model, m, dp, probes=PROBES, extra=None, **kw: launch.RunSpec(  # noqa: E731
        config, model=model, steps=steps, probes=probes, overrides={**_batch(global_batch, m, dp), **(extra or {})}, **kw)
    specs = {"data-parallel": spec("zero0", size, 2, world, ("timing", "model_states", "comm", "activations")),
             "pipeline": spec("zero1", pipe, 4, 1)}
    for m in micro_batch_counts:
        specs[f"pipeline-M{m}"] = spec("zero1", pipe, m, 1, ("timing", "pipeline"))
    specs.update({
        "pipeline-zero0": spec("zero0", pipe, 4, 1, ("timing",)),
        "data-parallel-noclip": spec("zero0", size, 2, world, ("timing",), noclip),
        "pipeline-zero0-noclip": spec("zero0", pipe, 4, 1, ("timing",), noclip),
        "pipeline-zero2": spec("zero2", pipe, 4, 1, ("timing",), on_error="record"),
        "pipeline-zero3": spec("zero3", pipe, 4, 1, ("timing",), on_error="record"),
    })
    return launch.sweep(specs, name=f"pipeline-{size}", world_size=world_size)


def stage_table(record) -> str:
    """Which layers each stage (rank) holds, with its parameters."""
    from helpers import records

    section = record.summary["pipeline"]
    rows = [[r["stage"], ", ".join(r["layers"]), f"{r['first_layer']}..{r['first_layer'] + len(r['layers']) - 1}",
             f"{r['params']:,}"] for r in section["per_rank"]]
    total = sum(r["params"] for r in section["per_rank"])
    rows.append(["all", "", "", f"{total:,}"])
    return records.format_table(rows, ["stage", "layers", "layer indices", "parameters"])


def states_table(pipe, baseline) -> str:
    """Model states per rank of the pipeline against the unsplit model trained with data parallelism."""
    from helpers import records

    rows = []
    for rank in range(pipe["world_size"]):
        p, b = pipe.states(rank), baseline.states(rank)
        for key in ("params", "grads", "optimizer"):
            rows.append([rank, key, f"{p[key]:,}", f"{b[key]:,}", f"{p[key] / b[key]:.3f}"])
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
    from helpers import records, theory

    rows = [[s, m, f"{schedule_bubble(s, m):.4f}", f"{theory.bubble_fraction(s, m):.4f}"]
            for s in stage_counts for m in micro_batch_counts]
    return records.format_table(rows, ["stages S", "micro-batches M", "idle steps in schedule", "(S-1)/(M+S-1)"])


def p2p_table(record) -> str:
    """send/recv per optimizer step on rank 0 (stage 0), per micro-batch, against the activation size."""
    from helpers import models, records, theory

    shape, m = models.shape_of(record["model.name"]), record["grad_accum"]
    activation = theory.pipeline_p2p_bytes(record["micro_batch"], shape.seq, shape.hidden, record["precision"])
    rows = []
    for op in ("send", "recv"):
        row = record.comm_ops().get(op, {"count": 0, "bytes": 0})
        rows.append([op, f"{row['count']:g}", f"{row['bytes'] / max(row['count'], 1):,.0f}", f"{activation:,.0f}",
                     f"{row['count'] / m:g}"])
    return records.format_table(rows, ["op (stage 0)", "calls/step", "bytes per call", "b·s·h·bytes", "calls per micro-batch"])


def in_flight_table(record) -> str:
    """Activations each stage holds when its first backward starts, in micro-batches (bytes saved in its
    decoder layers / bytes one micro-batch saves there), against 1F1B's min(S - stage, M)."""
    from helpers import records

    section = record.summary["activations"]["per_rank"]
    stages, m = record.summary["pipeline"]["stages"], record["grad_accum"]
    from helpers import activations

    rows = []
    for rank, measured in enumerate(section):
        if not measured["per_layer"]:  # a stage of only the embedding or the head
            rows.append([rank, "(no decoder layer)", "", "", min(stages - rank, m)])
            continue
        per_micro = activations.layer_formula(record, 0)  # every stage's first decoder layer saves the rotary too
        held = measured["per_layer"][0] / per_micro
        rows.append([rank, f"{measured['per_layer'][0]:,}", f"{per_micro:,.0f}", f"{held:g}", min(stages - rank, m)])
    return records.format_table(rows, ["stage", "saved by its first decoder layer", "one micro-batch (formula)",
                                       "micro-batches held", "min(S - stage, M)"])


def loss_table(runs: dict, pairs) -> str:
    """Loss agreement of pairs of runs, within :data:`helpers.records.REORDERED_TOLERANCE` (the runs cut the
    batch into micro-batches of other sizes)."""
    from helpers import records

    rows = [[a, b, records.loss_agreement(runs[a].losses, runs[b].losses,
                                          tolerance=records.REORDERED_TOLERANCE[runs[a]["precision"]])]
            for a, b in pairs]
    return records.format_table(rows, ["run", "against", "losses"])


def bubble_table(runs: dict, counts=MICRO_BATCH_COUNTS) -> str:
    """Per micro-batch count: measured bubble per stage (median over steps), the formula, step time.
    Timings: print in a cell nbval does not compare."""
    from helpers import records, theory

    rows = []
    for m in counts:
        r = runs[f"pipeline-M{m}"]
        section = r.summary["pipeline"]
        rows.append([m, r["micro_batch"], *(f"{b:.3f}" for b in section["bubble_per_rank"]),
                     f"{theory.bubble_fraction(section['stages'], m):.3f}", f"{r['step_time_s.median'] * 1000:.1f}"])
    stages = runs[f"pipeline-M{counts[0]}"].summary["pipeline"]["stages"]
    return records.format_table(rows, ["M", "micro-batch", *(f"stage {s} idle" for s in range(stages)),
                                       "(S-1)/(M+S-1)", "step ms"])


def memory_table(pipe, baseline) -> str:
    """Per rank: model states and activations saved for backward (measured), pipeline against data
    parallelism at the same micro-batch size."""
    from helpers import records

    rows = []
    for rank in range(pipe["world_size"]):
        pa = pipe.summary["activations"]["per_rank"][rank]["total"]
        ba = baseline.summary["activations"]["per_rank"][rank]["total"]
        rows.append([rank, f"{pipe.model_state_bytes(rank):,}", f"{baseline.model_state_bytes(rank):,}",
                     f"{pipe.model_state_bytes(rank) / baseline.model_state_bytes(rank):.3f}",
                     f"{pa:,}", f"{ba:,}", f"{pa / ba:.3f}"])
    return records.format_table(rows, ["rank", "model states: pipeline", "data parallel", "ratio",
                                       "activations: pipeline", "data parallel", "ratio"])


def utilization_table(runs: dict, counts=MICRO_BATCH_COUNTS) -> str:
    """Per micro-batch count: the share of the step each stage computed (1 - measured idle) against
    M/(M+S-1), and the step time against data parallelism's at the same global batch. Timings: print in a
    cell nbval does not compare."""
    from helpers import records, theory

    base = runs["data-parallel"]["step_time_s.median"]
    rows = []
    for m in counts:
        r = runs[f"pipeline-M{m}"]
        section = r.summary["pipeline"]
        busy = [1 - b for b in section["bubble_per_rank"]]
        rows.append([m, *(f"{b:.2f}" for b in busy), f"{1 - theory.bubble_fraction(section['stages'], m):.2f}",
                     f"{r['step_time_s.median'] * 1000:.1f}", f"{r['step_time_s.median'] / base:.2f}x"])
    stages = runs[f"pipeline-M{counts[0]}"].summary["pipeline"]["stages"]
    rows.append(["data parallel", *([""] * stages), "1.00 (no bubble)", f"{base * 1000:.1f}", "1.00x"])
    return records.format_table(rows, ["M", *(f"stage {s} computing" for s in range(stages)), "M/(M+S-1)",
                                       "step ms", "vs data parallel"])


def measured_bubbles(runs: dict, counts=MICRO_BATCH_COUNTS) -> dict[int, list[float]]:
    """M -> measured idle share per stage, for :func:`helpers.plots.bubble_vs_micro_batches`."""
    return {m: runs[f"pipeline-M{m}"].summary["pipeline"]["bubble_per_rank"] for m in counts}


def reference_report(name: str = "pipeline") -> str:
    """Every committed GPU result of this chapter (bubble and step time per M), or a plain statement that none is."""
    from helpers import experiments

    found = experiments.reference_runs(name)
    if not found:
        return experiments.no_references(name)
    blocks = []
    for device, date, note, runs in found:
        counts = sorted(int(k.removeprefix("pipeline-M")) for k in runs if k.startswith("pipeline-M"))
        blocks.append(f"Measured on {device}, {date} ({note}):\n{utilization_table(runs, counts)}")
    return "\n\n".join(blocks)
