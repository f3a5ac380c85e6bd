"""Tensor parallelism with DeepSpeed's AutoTP: which weights each rank keeps, and how much.

The ``param_shards`` probe records, on every rank after ``deepspeed.initialize``, each parameter's name,
shape, dtype and bytes as the engine's module holds it, with the engine's own view of the batch and of
the parallel groups. :func:`split_table` sets the shapes beside those of the unsplit model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import statistics
from pathlib import Path
from typing import Callable, Mapping, Sequence

from helpers.core import configs, ds, exercises, load_guard, models, plots, records, references, theory
from helpers.core.probes import Probe, RunContext


def parameter_shapes(module) -> dict[str, dict]:
    """name -> {shape, dtype, bytes} of every parameter of ``module`` (ZeRO-3 shards by their full shape)."""
    found = {}
    for name, p in module.named_parameters():
        shape = list(getattr(p, "ds_shape", p.shape))
        found[name.removeprefix("module.")] = {"shape": shape, "dtype": str(p.dtype).removeprefix("torch."),
                                               "bytes": p.numel() * p.element_size()}
    return found


class ParamShards(Probe):
    """Each parameter as this rank's engine holds it after ``deepspeed.initialize`` (name, shape, dtype,
    bytes), and the engine's batch and group sizes. Section: ``param_shards``."""

    name = "param_shards"
    keys = ("param_shards.per_rank",)

    def start(self, ctx: RunContext) -> None:
        engine = ctx.engine
        self.found = {"params": parameter_shapes(engine.module),
                      "autotp_size": int(engine.autotp_size()), "dp_world_size": int(engine.dp_world_size),
                      "deepspeed_train_batch": int(engine.train_batch_size())}

    def finish(self, ctx: RunContext) -> dict:
        return self.found

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"param_shards": {"per_rank": ranks}}


def split_table(before: Mapping[str, dict], ranks: list[dict], layer: int | None = 0) -> list[list]:
    """Rows [parameter, shape before, shape on each rank..., split along] for the parameters of decoder
    ``layer`` (all decoder layers are split alike) and those outside the decoder layers."""
    rows = []
    for name, info in before.items():
        if ".layers." in name and layer is not None and f".layers.{layer}." not in name:
            continue
        shapes = [r["params"][name]["shape"] for r in ranks]
        full = info["shape"]
        if all(s == full for s in shapes):
            how = "kept whole (replicated)"
        else:
            dims = [d for d in range(len(full)) if shapes[0][d] != full[d]]
            how = f"dim {dims[0]} ({'output' if dims[0] == 0 else 'input'} features)" if dims else "?"
        rows.append([name, "x".join(map(str, full)), *("x".join(map(str, s)) for s in shapes), how])
    return rows


# --- the chapter's experiment and tables (notebooks/12_tensor_parallelism.ipynb) ---------------------

def shards(record: records.Record) -> list[dict]:
    """What the ``param_shards`` probe found on each rank: ``params`` (name -> shape, dtype, bytes),
    ``autotp_size`` and the engine's batch and group sizes."""
    return record.section("param_shards")["per_rank"]


#: ZeRO's gradient buckets default to 5e8 elements (2 GB in fp32, allocated at stages 1-3): far beyond these
#: models, and slow to allocate on a CPU. One bucket of 1e7 elements still holds every gradient of them.
SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 10_000_000}}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A run a chapter's script expected DeepSpeed to refuse: the exception's type, message and (where the script
    kept it) traceback, as the script wrote them to ``<run>/refused.json``."""

    type: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"refused: {self.type}: {self.message}"


def chapter_runs(folder: str | Path, since: float = 0.0) -> dict[str, records.Record | Refusal]:
    """What the chapter's script wrote into ``folder`` since ``since`` (a ``time.time()``): {run name: its
    record, or the :class:`Refusal` of a run DeepSpeed refused}, in the order they were written."""
    found = []
    for path in Path(folder).glob("*/summary.json"):
        if path.stat().st_mtime >= since:
            found.append((path.stat().st_mtime, path.parent.name, records.load(path)))
    for path in Path(folder).glob("*/refused.json"):
        if path.stat().st_mtime >= since:
            found.append((path.stat().st_mtime, path.parent.name, Refusal(**json.loads(path.read_text()))))
    if not found:
        raise FileNotFoundError(f"no record in {folder} newer than the launch: did the script run?")
    return {name: result for _, name, result in sorted(found, key=lambda item: item[0])}


def shapes_before(name: str) -> dict[str, dict]:
    """Each parameter of model ``name`` as built, before any engine splits it (no process group needed)."""

    return parameter_shapes(models.build(name))


def shapes_table(record, before: Mapping[str, dict]) -> str:
    """Parameter shapes before AutoTP and on each rank after it: decoder layer 0 and the rest."""

    ranks = shards(record)
    return records.format_table(split_table(before, ranks),
                                ["parameter", "before", *(f"rank {r}" for r in range(len(ranks))), "split"])


def tp_parameter_count(before: Mapping[str, dict], ranks: list[dict]) -> tuple[int, int]:
    """(elements kept whole on every rank, elements split across the ranks), from the shapes."""
    whole = split = 0
    for name, info in before.items():
        n = 1
        for d in info["shape"]:
            n *= d
        if all(r["params"][name]["shape"] == info["shape"] for r in ranks):
            whole += n
        else:
            split += n
    return whole, split


def _plan(name: str) -> dict[str, bool]:
    """transformers' tensor-parallel plan for model ``name`` as DeepSpeed converts it: module pattern ->
    whether DeepSpeed splits the module (False for the entries it skips)."""
    TPPlanConverter = ds.load("deepspeed.module_inject.tp_plan_converter").TPPlanConverter
    _get_hf_tp_plan = ds.load("deepspeed.runtime.tensor_parallel.config")._get_hf_tp_plan

    plan = _get_hf_tp_plan(models.build(name))
    return {pattern: TPPlanConverter.convert({pattern: style})[0].partition_type.value != "skip"
            for pattern, style in plan.items()}


def planned_parameter_count(before: Mapping[str, dict], name: str) -> tuple[int, int]:
    """(elements kept whole, elements split), from transformers' plan for model ``name`` (:func:`_plan`)
    applied to the unsplit model's parameters ``before``, independently of what the ranks hold."""
    plan = _plan(name)
    whole = split = 0
    for parameter, info in before.items():
        module = parameter.rsplit(".", 1)[0]
        splits = any(fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, f"model.{pattern}")
                     for pattern, partitions in plan.items() if partitions)
        n = math.prod(info["shape"])
        whole, split = (whole, split + n) if splits else (whole + n, split)
    return whole, split


def memory_table(runs: Mapping) -> str:
    """Parameter bytes and model states per rank (rank 0): unsplit (data parallel), ZeRO-3, AutoTP, and the
    formula for AutoTP: whole + split / t parameters, whole and split as transformers' tensor-parallel plan
    says (:func:`planned_parameter_count`), against what the AutoTP ranks hold."""

    base = runs["data-parallel"]
    before = shards(base)[0]["params"]
    tp = runs["autotp"]
    t = len(shards(tp))
    whole, split = planned_parameter_count(before, models.llama_parts(tp.model_name)[0])
    width = 4 if tp["precision"] == "fp32" else 2
    rows = []
    for name in ("data-parallel", "zero3", "autotp", "autotp-zero1"):
        r = runs[name]
        rows.append([name, f"{r.states(0)['params']:,}", f"{r.states(0)['params'] / base.states(0)['params']:.3f}",
                     f"{r.model_state_bytes(0):,}", f"{r.model_state_bytes(0) / base.model_state_bytes(0):.3f}"])
    rows.append([f"plan: (whole + split/{t}) params", f"{(whole + split // t) * width:,}",
                 f"{(whole + split / t) / (whole + split):.3f}", "", ""])
    return records.format_table(rows, ["run", "parameter bytes", "vs unsplit", "model states", "vs unsplit"])


def collectives_table(record) -> str:
    """Collectives per micro-step of the AutoTP run (rank 0, by op and pass) against
    :func:`helpers.topics.tensor_parallel.tensor_parallel_collectives`."""

    shape, t = models.shape_of(record.model_name), shards(record)[0]["autotp_size"]
    formula = tensor_parallel_collectives(shape.layers, record["micro_batch"], shape.seq, shape.hidden,
                                                 models.LM_VOCAB, t, record["precision"])
    accum = record["grad_accum"]
    by_caller = record.comm.by_caller
    rows = []
    for (op, where), (count, size) in formula.items():
        row = by_caller.get(op, {}).get(where, {"count": 0, "bytes": 0})
        rows.append([op, where, f"{row['count'] / accum:g}", f"{count}",
                     f"{row['bytes'] / max(row['count'], 1):,.0f}", f"{size:,.0f}"])
    return records.format_table(rows, ["collective", "pass", "count/micro-step", "formula count",
                                       "bytes each", "formula bytes"])


#: The issuing functions of AutoTP's own collectives: the forward and backward of the layers it replaced.
AUTOTP_CALLERS = ("forward", "backward")

#: What the other collectives of an AutoTP step are, by issuing function (DeepSpeed 0.19.8).
ONCE_A_STEP = {"allreduce_bucket": "the gradients, over the data-parallel group",
               "clip_grad_norm_": "gradient clipping's norm, over the tensor-parallel group, then the data-parallel one"}


def calls_breakdown(record) -> str:
    """How the AutoTP run's collective calls per optimizer step follow from the model: the calls AutoTP's layers
    issued per micro-step (measured) against L x (calls per decoder layer) + the LM head's (the passes of
    :func:`tensor_parallel_collectives`), times the micro-steps, plus the calls DeepSpeed makes once a step, by
    issuing function."""
    shape, t = models.shape_of(record.model_name), shards(record)[0]["autotp_size"]

    def formula(layers: int) -> dict[tuple[str, str], int]:
        return {key: count for key, (count, _) in tensor_parallel_collectives(
            layers, record["micro_batch"], shape.seq, shape.hidden, models.LM_VOCAB, t, record["precision"]).items()}

    head, one = formula(0), formula(1)
    per_layer = {key: one[key] - head[key] for key in one}
    layer_parts = ", ".join(f"{op} in {where} {n}" for (op, where), n in per_layer.items() if n)
    head_parts = ", ".join(f"{op} in {where} {n}" for (op, where), n in head.items() if n)
    expected = sum(formula(shape.layers).values())
    accum = record["grad_accum"]
    by_caller = record.comm.by_caller
    autotp = sum(row["count"] for callers in by_caller.values() for caller, row in callers.items()
                 if caller in AUTOTP_CALLERS)
    others = [(op, caller, row["count"]) for op, callers in by_caller.items() for caller, row in callers.items()
              if caller not in AUTOTP_CALLERS and row["count"]]
    total = sum(row["count"] for callers in by_caller.values() for row in callers.values())
    return "\n".join([
        f"{total:g} calls per step = {accum} micro-steps x {autotp / accum:g} calls of AutoTP's layers "
        f"+ {sum(n for *_, n in others):g} once a step.",
        f"Per micro-step, {autotp / accum:g} measured; the formula: {shape.layers} decoder layers x "
        f"{sum(per_layer.values())} ({layer_parts}) + {sum(head.values())} for the LM head ({head_parts}) "
        f"= {expected}.",
        *(f"Once a step: {op} by {caller}, {n:g} ({ONCE_A_STEP.get(caller, 'not in the formula')})."
          for op, caller, n in others)])


def attention_heads(record) -> str:
    """The attention heads of the AutoTP run's model (its transformers config) and the share one rank computes,
    read from the rows of ``q_proj`` that rank holds."""
    config = models.llama_config(models.llama_parts(record.model_name)[0])
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    ranks = shards(record)
    rows = ranks[0]["params"]["model.layers.0.self_attn.q_proj.weight"]["shape"][0]
    return (f"{heads} attention heads of {head_dim} (num_attention_heads in the model's config); rank 0's q_proj "
            f"keeps {rows} of its {config.hidden_size} rows: {rows // head_dim} of the {heads} heads, on each of "
            f"{len(ranks)} ranks.")


def against_zero3_table(runs: Mapping, timings: bool = False) -> str:
    """AutoTP against ZeRO-3 on the same ranks and global batch: model states (rank 0), collective calls and
    bytes per optimizer step (logged; sent by rank 0 on a ring, beside the formula), and with ``timings``
    the median step time after the first step (the steps :func:`speed_verdict` compares) and peak memory
    (print those in a cell nbval does not compare)."""

    rows = []
    for name in ("zero3", "autotp"):
        r = runs[name]
        shape, n = models.shape_of(r.model_name), r["world_size"]
        if name == "zero3":
            formula = theory.zero3_wire_bytes(r.params, n, r["precision"])
        else:
            formula = tensor_parallel_wire_bytes(shape.layers, r["micro_batch"], shape.seq, shape.hidden,
                                                        models.LM_VOCAB, n, r["precision"])
        row = [name, f"{r.model_state_bytes(0):,}", f"{sum(o['count'] for o in r.comm_ops().values()):g}",
               f"{r.comm.bytes_per_step:,.0f}", f"{moved_bytes_per_step(r):,.0f}", f"{formula * r['grad_accum']:,.0f}"]
        if timings:  # a CPU's peak resident set only grows from run to run of a sweep: GPU peaks only
            row += [f"{statistics.median(_steps_s(r)) * 1000:.1f}"]  # the steps the load guard compares
            row += [records.format_peak(r, 0)] if r["device"] == "cuda" else []
        rows.append(row)
    headers = ["run", "model states", "calls/step", "logged bytes/step", "sent bytes/step", "formula sent"]
    if timings:
        headers += ["median step ms, after the 1st"] + (["peak (torch.cuda.max_memory_allocated)"] if runs["zero3"]["device"] == "cuda" else [])
    return records.format_table(rows, headers)


def dtype_setting() -> str:
    """What DeepSpeed's tensor-parallel config model says ``dtype`` is when a config leaves it out."""
    get_tensor_parallel_config = ds.load("deepspeed.runtime.tensor_parallel.config").get_tensor_parallel_config

    return str(get_tensor_parallel_config({"tensor_parallel": {"autotp_size": 2}}).dtype)


#: Collectives DeepSpeed issues over the data-parallel group (not the tensor-parallel one), by issuing function.
DATA_PARALLEL_CALLERS = ("allreduce_bucket",)


def moved_bytes_per_step(record) -> float:
    """Bytes rank 0 sends per optimizer step (ring), each collective counted over the group it runs in:
    gradient reductions over the data-parallel ranks (a group of one moves nothing), the rest over all."""

    world, readers = record["world_size"], record.summary.get("data_parallel_size", record["world_size"])
    total = 0.0
    for op, callers in record.comm.by_caller.items():
        for caller, row in callers.items():
            n = readers if caller in DATA_PARALLEL_CALLERS else world
            per_call = row["bytes"] / row["count"] if row["count"] else 0
            total += theory.wire_bytes(op, per_call, n) * row["count"]
    return total


def traffic_curves(record_tp, record_zero3, tokens=(64, 256, 1024, 4096, 16384, 65536)) -> tuple:
    """Wire bytes per micro-step against tokens per micro-step, AutoTP and ZeRO-3 (formulas), and the two
    runs' measured points, for :func:`helpers.topics.tensor_parallel.traffic_vs_tokens`."""

    shape = models.shape_of(record_tp.model_name)
    t, n = record_tp["world_size"], record_zero3["world_size"]
    precision = record_tp["precision"]
    lines = {f"AutoTP, {t} ranks": [tensor_parallel_wire_bytes(shape.layers, 1, k, shape.hidden, models.LM_VOCAB,
                                                                       t, precision) for k in tokens],
             f"ZeRO-3, {n} ranks": [theory.zero3_wire_bytes(record_zero3.params, n, precision) for _ in tokens]}
    measured = {"AutoTP (measured)": (record_tp["micro_batch"] * shape.seq,
                                      moved_bytes_per_step(record_tp) / record_tp["grad_accum"]),
                "ZeRO-3 (measured)": (record_zero3["micro_batch"] * shape.seq,
                                      moved_bytes_per_step(record_zero3) / record_zero3["grad_accum"])}
    return list(tokens), lines, measured


def _steps_s(record: records.Record) -> list[float]:
    """A run's step times in seconds after the first step (which warms up)."""
    return list(record.timing.all_s[1:])


#: AutoTP trained again at the end of the chapter's launch (the sweep's repeat of its first timed setting).
AGAIN = "autotp-again"


def speed_verdict(runs: Mapping, load: load_guard.Load | None, again: str = AGAIN) -> str:
    """AutoTP's, ZeRO-3's and plain data parallelism's step times on the same ranks and global batch, through the
    course's load guard (:func:`helpers.core.load_guard.compare`, with ``runs[again]``, AutoTP trained again at
    the end of the launch, where there is one): a verdict only for a launch alone on its devices and a difference
    beyond the steps' spread, otherwise the reason it is withheld."""
    samples = {"AutoTP": _steps_s(runs["autotp"]), "ZeRO-3": _steps_s(runs["zero3"]),
               "data parallelism": _steps_s(runs["data-parallel"])}
    repeat = _steps_s(runs[again]) if isinstance(runs.get(again), records.Record) else None
    return load_guard.sentence(load_guard.compare(samples, load, repeat=repeat))


def keep_gpu_runs(folder: str | Path, since: float, load: load_guard.Load, note: str) -> dict[str, records.Record]:
    """On GPUs: the records the script wrote into ``folder`` since ``since``, each with the ``load`` the guard
    saw beside the launch (so a later reading can give or withhold its verdict), saved as the chapter's reference
    (:func:`helpers.core.references.save_reference`, for an instructor to commit)."""
    runs = {name: r for name, r in chapter_runs(folder, since).items() if isinstance(r, records.Record)}
    for record in runs.values():
        record.summary["load"] = dataclasses.asdict(load)
    references.save_reference("tensor-parallel", runs, note=note)
    return runs


def saved_load(runs: Mapping) -> load_guard.Load:
    """The load the GPU cell saved with its runs (``summary["load"]``), or an unknown one (every verdict withheld)
    for runs saved without it."""
    found = next((r.summary.get("load") for r in runs.values()
                  if isinstance(r, records.Record) and r.summary.get("load")), None)
    return load_guard.Load.unknown("gpu") if found is None else load_guard.Load.from_dict(found)


def reference_load(runs: Mapping, conditions: str | None) -> load_guard.Load:
    """The load a committed result was measured under: the one saved with its runs (:func:`saved_load`), or, for
    runs saved without one, the load its written ``conditions`` state
    (:meth:`~helpers.core.load_guard.Load.from_conditions`: alone only where they say so)."""
    saved = saved_load(runs)
    return saved if saved.samples else load_guard.Load.from_conditions(conditions)


def _references_with_load(name: str, render: Callable[[Mapping, load_guard.Load], str]) -> str:
    """Every committed GPU result of ``name``, labelled with its device, date and conditions, as
    ``render(runs, load)`` under :func:`reference_load`; or a plain statement that none is."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    return "\n\n".join(f"Measured on {device}, {date} ({note}):\nConditions: {conditions}\n"
                        f"{render(runs, reference_load(runs, conditions))}"
                        for (device, date, note, runs), conditions in zip(found, references.reference_conditions(name)))


def reference_report(name: str = "tensor-parallel") -> str:
    """Every committed GPU result of this chapter (AutoTP against ZeRO-3 with timings, memory, and the step times
    through the load guard under :func:`reference_load`), or a plain statement that none is."""

    return _references_with_load(
        name, lambda runs, load: f"{against_zero3_table(runs, timings=True)}\n{memory_table(runs)}\n"
                                 f"{speed_verdict(runs, load)}")


def model_size(record: records.Record) -> str:
    """The shape of a run's model and its tokens per micro-step (on an AutoTP rank: its group's micro-batch)."""
    shape = models.shape_of(record.model_name)
    tokens = record["micro_batch"] * shape.seq
    return (f"Model {record.model_name!r}: {shape.layers} decoder layers, hidden size {shape.hidden}, MLP width "
            f"{shape.intermediate}, vocabulary {models.LM_VOCAB}, sequence length {shape.seq}; "
            f"{record['micro_batch']} samples x {shape.seq} = {tokens:,} tokens per micro-step.")


def reference_sentence(runs: Mapping, who: str = "The reference", load: load_guard.Load | None = None) -> str:
    """What GPU runs (a committed reference, or ``who``: the run just made) measured for AutoTP against ZeRO-3:
    the course's load guard on their steps after the first (:func:`helpers.core.load_guard.compare` under ``load``,
    by default the one saved with the runs; AutoTP's repeat at the end of the launch, :data:`AGAIN`, where there is
    one; without it the sweep is not judged), then peak memory and model states on rank 0."""
    tp, z3 = runs["autotp"], runs["zero3"]
    again = runs.get(AGAIN)
    verdict = load_guard.compare({"AutoTP": _steps_s(tp), "ZeRO-3": _steps_s(z3)},
                                 saved_load(runs) if load is None else load,
                                 repeat=_steps_s(again) if isinstance(again, records.Record) else None, sweep=True)
    tp_peak, z3_peak = (r.summary["memory"]["peak_bytes_per_rank"][0] for r in (tp, z3))
    states = tp.model_state_bytes(0) / z3.model_state_bytes(0)
    return (f"{who}, AutoTP against ZeRO-3: {load_guard.sentence(verdict)} AutoTP's recorded peak was "
            f"{'higher' if tp_peak > z3_peak else 'lower'} ({records.format_peak(tp, 0)} against "
            f"{records.format_peak(z3, 0)}) although its model states were {states:.2f} times ZeRO-3's.")


def reference_sentences(name: str = "tensor-parallel") -> str:
    """:func:`reference_sentence` for every committed GPU result of this chapter, labelled with its device and
    date, under :func:`reference_load`."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    return "\n".join(f"{device}, {date}: {reference_sentence(runs, load=reference_load(runs, conditions))}"
                      for (device, date, _, runs), conditions in zip(found, references.reference_conditions(name)))


#: The callers of the gradient norm's all-reduce (ZeRO-3's, and the one gradient clipping runs beside AutoTP).
NORM_CALLERS = ("get_grad_norm_direct", "clip_grad_norm_")


def beyond_formula(runs: Mapping) -> str:
    """For ZeRO-3 and AutoTP: the bytes rank 0 sent per step beyond the formula, beside those the gradient norm's
    all-reduce sent (a scalar the formulas leave out)."""
    parts = []
    for name in ("zero3", "autotp"):
        r = runs[name]
        shape, n = models.shape_of(r.model_name), r["world_size"]
        formula = (theory.zero3_wire_bytes(r.params, n, r["precision"]) if name == "zero3" else
                   tensor_parallel_wire_bytes(shape.layers, r["micro_batch"], shape.seq, shape.hidden,
                                              models.LM_VOCAB, n, r["precision"]))
        norm = sum(theory.wire_bytes("all_reduce", row["bytes"] / row["count"], n) * row["count"]
                   for caller, row in r.comm.by_caller.get("all_reduce", {}).items()
                   if caller in NORM_CALLERS and row["count"])
        parts.append(f"{name} {moved_bytes_per_step(r) - formula * r['grad_accum']:,.0f} "
                     f"(its gradient norm's all-reduce: {norm:,.0f})")
    return "Sent minus formula, bytes per step: " + "; ".join(parts) + "."


def traffic_sentence(runs: Mapping) -> str:
    """The key result in one sentence from the runs: AutoTP's bytes sent per optimizer step over ZeRO-3's, at the
    run's tokens per micro-step."""
    tp, z3 = runs["autotp"], runs["zero3"]
    ratio = records.format_ratio(moved_bytes_per_step(tp), moved_bytes_per_step(z3))
    tokens = tp["micro_batch"] * models.seq_len_of(tp.model_name)
    return (f"At {tokens:,} tokens per micro-step AutoTP sent {ratio} times ZeRO-3's bytes per step "
            f"({records.format_bytes(moved_bytes_per_step(tp))} against {records.format_bytes(moved_bytes_per_step(z3))}).")


def plan_table(name: str = "llama") -> str:
    """transformers' tensor-parallel plan for model ``name`` (``config.base_model_tp_plan`` and the model
    class's ``_tp_plan``, merged as DeepSpeed merges them) and what DeepSpeed's converter makes of each entry."""
    TPPlanConverter = ds.load("deepspeed.module_inject.tp_plan_converter").TPPlanConverter
    _get_hf_tp_plan = ds.load("deepspeed.runtime.tensor_parallel.config")._get_hf_tp_plan

    plan = _get_hf_tp_plan(models.build(name))
    rows = []
    for pattern, style in plan.items():
        (spec,) = TPPlanConverter.convert({pattern: style})
        how = spec.partition_type.value + (", output gathered" if spec.gather_output else "")
        rows.append([pattern, style, how])
    return records.format_table(rows, ["module (transformers' pattern)", "transformers' style", "DeepSpeed partition"])


# --- figures ----------------------------------------------------------------------------------------

def traffic_vs_tokens(tokens: Sequence[int], lines: Mapping[str, Sequence[float]],
                      measured: Mapping[str, tuple[int, float]] | None = None,
                      title: str = "Bytes each rank sends per micro-step"):
    """Per way of splitting the model: wire bytes per micro-step (formula) against tokens per micro-step, with
    measured points."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    for label, values in lines.items():
        ax.plot(tokens, [v / 2**20 for v in values], label=label)
    for label, (x, y) in (measured or {}).items():
        ax.plot([x], [y / 2**20], "ko", markersize=5)
        ax.annotate(label, (x, y / 2**20), textcoords="offset points", xytext=(5, 5), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="tokens per micro-step (b·s)", ylabel="MiB per rank", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- formulas ---------------------------------------------------------------------------------------

# --- exercises: predict what AutoTP keeps and sends, configure it ----------------------------------------

def exercise_parameter_bytes(answer: object, name: str = "llama", tp: int = 4, precision: str = "fp32") -> exercises.Verdict:
    """Exercise: predict the parameter bytes each rank holds when AutoTP splits model ``name`` over ``tp`` ranks:
    the modules transformers' tensor-parallel plan splits, as DeepSpeed converts it (:func:`planned_parameter_count`),
    divided by ``tp``, the rest whole."""
    before = shapes_before(name)
    whole, split = planned_parameter_count(before, name)
    if split % tp:
        raise ValueError(f"{split} split elements do not divide by {tp} ranks")
    width = theory.bytes_per_element(precision)
    expected = (whole + split // tp) * width
    return exercises.number(
        "AutoTP parameter bytes", answer, expected, unit=" bytes",
        task=f"Predict the parameter bytes each rank holds when AutoTP splits the course's '{name}' model over "
             f"autotp_size = {tp} ranks ({precision}).",
        hint="the memory table above gives the elements at autotp_size 2; what the plan splits (shapes table) "
             f"divides by {tp}, what it keeps whole (the embedding, the norms) stays whole; {width} bytes an element.",
        why=f"{whole:,} elements kept whole + {split:,} split / {tp} = {whole + split // tp:,} elements x {width} "
            f"bytes: {(whole + split / tp) / (whole + split):.3f} of the model, not 1/{tp}, because the "
            "replicated embedding does not shrink with more ranks.")


def crossover_tokens(psi: int, layers: int, hidden: int, vocab: int, tp: int, precision: str = "fp32") -> float:
    """Tokens per micro-step at which AutoTP over ``tp`` ranks sends as many bytes as ZeRO-3 over as many ranks:
    :func:`tensor_parallel_wire_bytes` grows in proportion to the tokens, :func:`helpers.core.theory.zero3_wire_bytes`
    does not."""
    per_token = tensor_parallel_wire_bytes(layers, 1, 1, hidden, vocab, tp, precision)
    return theory.zero3_wire_bytes(psi, tp, precision) / per_token


def exercise_crossover_tokens(answer: object, psi: int, layers: int = 32, hidden: int = 4096, vocab: int = 32_000,
                              tp: int = 2) -> exercises.Verdict:
    """Exercise: predict the tokens per micro-step at which AutoTP's traffic equals ZeRO-3's for a model of ``psi``
    parameters (LLaMA-7B by default) on ``tp`` ranks; the answer is :func:`crossover_tokens`."""
    expected = crossover_tokens(psi, layers, hidden, vocab, tp)
    return exercises.number(
        "AutoTP against ZeRO-3", answer, expected, relative=0.05, unit=" tokens",
        task=f"Predict the tokens per micro-step (b x s) at which AutoTP on {tp} ranks sends as many bytes per "
             f"micro-step as ZeRO-3 on {tp} ranks, for {psi:,} parameters in {layers} layers, hidden size {hidden:,}, "
             f"vocabulary {vocab:,}.",
        hint="the two formulas of this section, each collective on its ring: ZeRO-3's bytes do not depend on the "
             "tokens, AutoTP's grow with b x s (count its messages per token, the logits' all-gather included).",
        why=f"{expected:,.0f} tokens: below it AutoTP moves fewer bytes than ZeRO-3, above it more. A real model's "
            f"hidden size makes the crossing {expected / hidden:.1f} x h tokens, a few samples of a long sequence: "
            "at training batches AutoTP moves more, which is why it stays on fast links inside a node.")


def autotp_config_facts(config: dict, world_size: int) -> dict:
    """What DeepSpeed makes of ``config`` on ``world_size`` ranks: its refusal (``DeepSpeedConfig``, None when it
    accepts), ``autotp_size`` (its ``TPTrainingConfig``), the train batch DeepSpeed reports (all ranks counted) and
    the samples a step really trains on (micro-batch x accumulation x data-parallel ranks = world / autotp_size)."""
    get_tensor_parallel_config = ds.load("deepspeed.runtime.tensor_parallel.config").get_tensor_parallel_config

    if not isinstance(config, dict):
        raise TypeError(f"the config is a dict, not {type(config).__name__}")
    tp = get_tensor_parallel_config(config).autotp_size
    refusal = configs.deepspeed_parse(config, world_size)
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps", 1)
    reported = config.get("train_batch_size") or ((micro or 0) * accum * world_size)
    if micro is None and config.get("train_batch_size"):  # DeepSpeed derives the micro-batch from the batch
        micro = config["train_batch_size"] // (accum * world_size)
    real = (micro or 0) * accum * (world_size // tp) if tp else None
    return {"refusal": refusal, "autotp_size": tp, "reported": reported, "real": real}


def exercise_autotp_config(answer: object, world_size: int = 8, tp: int = 4, samples: int = 32) -> exercises.Verdict:
    """Exercise: a DeepSpeed config for AutoTP of ``tp`` ranks on ``world_size`` ranks whose steps train on
    ``samples`` samples, checked by DeepSpeed's own parser (the batch arithmetic) and the tensor-parallel
    config model, and by counting the samples its data-parallel ranks really read."""
    def test(config: dict) -> tuple[bool, str]:
        facts = autotp_config_facts(config, world_size)
        if facts["refusal"] is not None:
            return False, f"DeepSpeed refuses it: {type(facts['refusal']).__name__}: {facts['refusal']}"
        if facts["autotp_size"] != tp:
            return False, f"tensor_parallel.autotp_size is {facts['autotp_size']} (0: AutoTP off)."
        if facts["real"] != samples:
            return False, (f"DeepSpeed accepts it, but a step trains on {facts['real']} samples: micro-batch x "
                           f"accumulation x {world_size // tp} data-parallel ranks.")
        return True, (f"DeepSpeed accepts it with autotp_size {tp}; a step trains on {samples} samples "
                      f"({world_size // tp} data-parallel ranks), while DeepSpeed reports a train batch of "
                      f"{facts['reported']}: it counts all {world_size} ranks, each of a tensor-parallel group "
                      "reading the same samples.")
    return exercises.satisfies(
        "AutoTP config", answer, test,
        task=f"Write a DeepSpeed config (a dict) for {world_size} GPUs with AutoTP over groups of {tp}, whose optimizer "
             f"steps train on {samples} samples, with no gradient accumulation.",
        hint="count the ranks that read different samples (this section's table), and mind DeepSpeed's batch check.")


def tensor_parallel_collectives(layers: int, batch: int, seq: int, hidden: int, vocab: int, tp: int,
                                precision: str = "fp32") -> dict[tuple[str, str], tuple[int, float]]:
    """Collectives per micro-step of DeepSpeed AutoTP on a LLaMA model, as {(op, pass): (count, logged bytes
    each)}.

    Forward: one all-reduce of b·s·h after each row-parallel linear (``o_proj``, ``down_proj``): 2L; one
    all-gather of the vocabulary-split logits (each rank logs its b·s·V/t share). Backward: one all-reduce
    of the input gradient, b·s·h, after each column-parallel linear (``q_proj``, ``k_proj``, ``v_proj``,
    ``gate_proj``, ``up_proj`` and ``lm_head``): 5L + 1. Megatron-LM fuses the column-parallel inputs of
    one block and needs 2L in backward; AutoTP replaces each linear on its own.
    """
    theory.bytes_per_element(precision)  # a clear error for an unknown precision
    width = theory.BYTES_PER_ELEMENT[precision]
    activation = batch * seq * hidden * width
    return {("all_reduce", "forward"): (2 * layers, activation),
            ("all_gather_into_tensor", "forward"): (1, batch * seq * vocab // tp * width),
            ("all_reduce", "backward"): (5 * layers + 1, activation)}


def tensor_parallel_wire_bytes(layers: int, batch: int, seq: int, hidden: int, vocab: int, tp: int,
                               precision: str = "fp32") -> float:
    """Bytes one rank sends per micro-step for AutoTP's collectives (:func:`tensor_parallel_collectives`),
    by the ring algorithm: they grow with the tokens b·s, whatever the number of parameters."""
    return sum(count * theory.wire_bytes(op, size, tp)
               for (op, _), (count, size) in tensor_parallel_collectives(layers, batch, seq, hidden, vocab, tp,
                                                                        precision).items())


def key_figure(runs: Mapping):
    """The chapter's key result: bytes sent per micro-step by AutoTP and by ZeRO-3 against tokens per
    micro-step, the formula lines and this run's measurements (:func:`traffic_curves`)."""
    tokens, lines, measured = traffic_curves(runs["autotp"], runs["zero3"])
    return traffic_vs_tokens(tokens, lines, measured)
