"""Mixed precision: what fp32, bf16 and fp16 keep and communicate per rank (chapter 07), and fp16's dynamic
loss scaling made visible (chapter 07b).

- Probe ``loss_scale``: on every optimizer step, the loss scale the step used, whether DeepSpeed applied
  the step or skipped it (``engine.was_step_applied()``, ``engine.skipped_steps``) and the learning rate.
- Probe ``loss_spike`` (:func:`spike`): one bad batch on purpose, ``options={"loss_spike_at_step": s}``.
  It multiplies the model's output on the first micro-step of optimizer step ``s`` by :data:`SPIKE_FACTOR`;
  in fp16 that overflows, in bf16 and fp32 it is only a huge loss. The training loop does not change: a
  forward hook does it.
- Probe :class:`AccumulatedGradient` (:func:`against_fp32` in a script): the gradient DeepSpeed accumulated
  over the first optimizer step against an fp32 reference computed apart.
- :func:`scaler_demo`: DeepSpeed's own loss scaler (``CreateLossScaler``, built from an ``fp16`` section by
  DeepSpeed's own config model) driving a small fp16 training loop on real fp16 gradients in this process,
  on every processor alike, where DeepSpeed's engine refuses fp16.
- :func:`scale_by_step`: the same for an ``fp16`` block the learner writes, printed step by step.
- :func:`load_runs`: chapter 07's script's records, keyed as its tables read them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import statistics
import textwrap
from pathlib import Path
from typing import Any, Mapping, NamedTuple
from unittest import mock

import torch

from helpers.core import configs, ds, exercises, load_guard, models, performance, plots, records, references, theory
from helpers.core.probes import Probe, RunContext

#: The largest finite fp16 number: a gradient above it becomes inf.
FP16_MAX = 65504.0
#: What the ``loss_spike_at_step`` fault multiplies one micro-step's model output by.
SPIKE_FACTOR = 1e6


def current_scale(engine) -> float | None:
    """The loss scale DeepSpeed's optimizer multiplies the loss by now (1.0 outside fp16), or None."""
    opt = engine.optimizer
    if hasattr(opt, "loss_scale_config"):  # stage 0: FP16_Optimizer / FP16_UnfusedOptimizer
        return float(opt.loss_scale_config.cur_scale)
    scaler = getattr(opt, "loss_scaler", None)  # stages 1-3: DeepSpeed's LossScaler / DynamicLossScaler
    if scaler is not None:
        return float(scaler.cur_scale)
    scale = getattr(opt, "cur_scale", None)
    return None if scale is None else float(scale)


# --- probes -------------------------------------------------------------------------------------

class LossScale(Probe):
    """The loss scale of every optimizer step, whether the step was applied, and the learning rate.

    Section ``loss_scale``: ``scale_per_step`` (the scale each step's backward used),
    ``applied_per_step``, ``skipped_steps`` (``engine.skipped_steps``), ``final_scale``, ``lr_per_step``
    (the learning rate each step would apply), ``fp16`` (the run's fp16 section, if any). Rank 0's view:
    DeepSpeed agrees the overflow verdict across ranks.
    """

    name = "loss_scale"
    keys = ("loss_scale.scale_per_step", "loss_scale.applied_per_step", "loss_scale.skipped_steps",
            "loss_scale.lr_per_step")

    def start(self, ctx: RunContext) -> None:
        self.scales: list[float | None] = []
        self.applied: list[bool] = []
        self.lrs: list[float] = []

    def before_step(self, ctx: RunContext, step: int) -> None:
        self.scales.append(current_scale(ctx.engine))
        lrs = ctx.engine.get_lr()
        self.lrs.append(float(lrs[0]) if lrs else math.nan)

    def after_step(self, ctx: RunContext, step: int) -> None:
        self.applied.append(bool(ctx.engine.was_step_applied()))

    def finish(self, ctx: RunContext) -> dict:
        return {"scales": self.scales, "applied": self.applied, "lrs": self.lrs,
                "skipped": int(ctx.engine.skipped_steps), "final": current_scale(ctx.engine)}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        r = ranks[0]
        return {"loss_scale": {"scale_per_step": r["scales"], "applied_per_step": r["applied"],
                               "skipped_steps": r["skipped"], "final_scale": r["final"], "lr_per_step": r["lrs"],
                               "fp16": ctx.config.get("fp16") if ctx.precision == "fp16" else None}}


def spike_steps(value: Any) -> list[int]:
    """``loss_spike_at_step`` as a sorted list of optimizer steps (counted from 1)."""
    return sorted({value} if isinstance(value, int) else set(value))


def _spiked(output: Any) -> Any:
    """The model's output multiplied by :data:`SPIKE_FACTOR` (a tensor, or a ``transformers`` output's logits)."""
    if hasattr(output, "logits"):
        output.logits = output.logits * SPIKE_FACTOR
        return output
    return output * SPIKE_FACTOR


class SpikeHook:
    """A forward hook that multiplies one forward's output by :data:`SPIKE_FACTOR` when armed, then disarms."""

    def __init__(self, module, steps: list[int]):
        self.steps, self.armed = set(steps), False
        self.handle = module.register_forward_hook(self)

    def arm_for(self, step: int) -> None:
        """Before optimizer step ``step`` (0-based): arm when it is one of the spiked steps (counted from 1)."""
        self.armed = step + 1 in self.steps

    def __call__(self, module, inputs, output):
        if not self.armed:
            return None
        self.armed = False  # only the first micro-step of the step: one bad batch
        return _spiked(output)

    def remove(self) -> None:
        self.handle.remove()


class LossSpike(Probe):
    """One bad batch on purpose (``options={"loss_spike_at_step": s}``): multiplies the model's output on the
    first micro-step of the given optimizer step(s) by :data:`SPIKE_FACTOR`. Section ``faults.loss_spike``:
    the steps and the factor."""

    name = "loss_spike"
    keys = ("faults.loss_spike.steps",)

    def start(self, ctx: RunContext) -> None:
        self.steps = spike_steps(ctx.options.get("loss_spike_at_step", []))
        self.hook = SpikeHook(ctx.engine.module, self.steps)

    def before_step(self, ctx: RunContext, step: int) -> None:
        self.hook.arm_for(step)

    def finish(self, ctx: RunContext) -> dict:
        self.hook.remove()
        return {}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"faults": {"loss_spike": {"steps": self.steps, "factor": SPIKE_FACTOR}}}

    @classmethod
    def check_options(cls, options: dict, steps: int) -> None:
        check_spikes(options, steps)


def check_spikes(options: dict, steps: int) -> None:
    """Raise a ValueError naming the key and the fix when ``options["loss_spike_at_step"]`` is missing or names
    no optimizer step of a run of ``steps`` steps (before any process starts)."""
    key = "loss_spike_at_step"
    value = options.get(key)
    values = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= steps]
    if bad or not values:
        raise ValueError(f"options {{'{key}': {value!r}}}: give an optimizer step from 1 to {steps} (the run's "
                         f"steps), or a list of them")


def spike(steps: int | list[int]) -> dict:
    """What a run adds for a loss spike at optimizer step(s) ``steps`` (from 1): ``RunSpec(**spike(6))`` or
    ``RunSpec(probes=(..., LossSpike), options=spike(6)["options"])``."""
    return {"options": {"loss_spike_at_step": steps}}


# --- DeepSpeed's loss scaler on real fp16 gradients, on any processor ------------------------------

def fp16_settings(section: Mapping[str, Any]):
    """DeepSpeed's own config model of an ``fp16`` section (``DeepSpeedFP16Config``): its validation, its
    defaults. Raises DeepSpeed's ValidationError for a bad value."""

    get_float16_config = ds.load("deepspeed.runtime.precision_config").get_float16_config

    return get_float16_config({"fp16": {**section, "enabled": True}})


def make_loss_scaler(section: Mapping[str, Any]):
    """The loss scaler DeepSpeed's ZeRO optimizers build from this ``fp16`` section: the same factory
    (``CreateLossScaler``) with the same arguments as ``deepspeed.initialize`` passes."""
    CreateLossScaler = ds.load("deepspeed.runtime.fp16.loss_scaler").CreateLossScaler

    settings = fp16_settings(section)
    return CreateLossScaler(dtype=torch.half, static_loss_scale=settings.loss_scale,
                            dynamic_scaling=settings.loss_scale == 0,
                            dynamic_loss_args=settings.dynamic_loss_scale_args())


# --- the chapter's loss-scaling scenarios -----------------------------------------------------------

#: Optimizer steps of each loss-scaling scenario.
DEMO_STEPS = 20
#: name -> (fp16 settings besides DeepSpeed's defaults, optimizer steps whose output spikes). Each name numbers
#: the scenario (its panel in the chapter's plot) and lists every knob it sets besides DeepSpeed's defaults. The
#: first is the source article's fp16 section, which restates DeepSpeed's defaults.
SCENARIOS: dict[str, tuple[dict, list[int]]] = {
    "1 · the defaults (the article's block)": ({"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                                                "hysteresis": 2, "min_loss_scale": 1}, [6]),
    "2 · loss_scale=1024": ({"loss_scale": 1024}, [6]),
    "3 · initial_scale_power=30": ({"initial_scale_power": 30}, [6]),
    "4 · initial_scale_power=20, loss_scale_window=2": ({"initial_scale_power": 20, "loss_scale_window": 2}, [6]),
    "5 · initial_scale_power=20, loss_scale_window=2, hysteresis=1": ({"initial_scale_power": 20,
                                                                       "loss_scale_window": 2, "hysteresis": 1}, [6]),
    "6 · hysteresis=1, min_loss_scale=32768, two spikes": ({"hysteresis": 1, "min_loss_scale": 32768}, [6, 12]),
    "7 · the defaults, two spikes": ({}, [6, 12]),
    "8 · consecutive_hysteresis=true, two spikes": ({"consecutive_hysteresis": True}, [6, 12]),
}


def demo_config(fp16: Mapping[str, Any], base: str = "zero2") -> dict:
    """The config a loss-scaling scenario runs with: ``ds_configs/<base>.json`` with fp16 on and ``fp16``'s
    settings, checked by DeepSpeed's own fp16 config model (a bad knob fails here, naming it)."""

    try:
        fp16_settings(fp16)
    except Exception as error:  # pydantic's ValidationError names the field
        raise ValueError(f"fp16 settings {dict(fp16)}: DeepSpeed refuses them: {error}") from None
    return configs.merged(configs.load(base), {"fp16": {"enabled": True, **fp16}})


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    """``logger`` at ERROR level inside the block, its own level after."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def scaler_demo(config: Mapping[str, Any], spikes: list[int] | tuple[int, ...] = (), steps: int = DEMO_STEPS,
                world: int = 2, model: str = "mlp", seed: int = 0) -> dict:
    """Mixed-precision training of ``model`` in fp16 in this process, with DeepSpeed's own loss scaler
    (:func:`make_loss_scaler`, from ``config["fp16"]``) deciding each step, on every processor alike.

    ``world`` data-parallel ranks are played one after the other, each on its own samples
    (:func:`helpers.core.models.sample_indices`), as DeepSpeed's fp16 optimizers do it per optimizer step: the
    scaler multiplies each micro-step's loss (divided by the accumulation steps) before backward; each rank's
    fp16 gradients are tested for inf/NaN (``deepspeed.runtime.utils.has_inf_or_nan``) and any rank's
    overflow skips the step for all; otherwise the gradients are summed over the ranks in fp32, divided by
    the ranks and the scale, clipped, and AdamW updates the fp32 master weights, copied back to the fp16
    model; then ``update_scale(overflow)``. When the scaler raises (an overflow at ``min_loss_scale``), the
    run stops there and says so. ``config`` gives the batch sizes, learning rate and clipping; ``spikes``
    the optimizer steps (from 1) whose first micro-step's output is multiplied by :data:`SPIKE_FACTOR`.

    Returns the scale each step used, overflow per step, skipped steps, losses (mean over ranks), the
    hysteresis left after each step's ``update_scale`` and the headroom of each applied step,
    log2(FP16_MAX / largest |scaled gradient|): halvings left before an overflow.
    """
    loss_scaler = ds.load("deepspeed.runtime.fp16.loss_scaler")
    has_inf_or_nan = ds.load("deepspeed.runtime.utils").has_inf_or_nan

    section = {k: v for k, v in config.get("fp16", {}).items() if k != "enabled"}
    scaler = make_loss_scaler(section)
    micro, accum = config.get("train_micro_batch_size_per_gpu", 4), config.get("gradient_accumulation_steps", 1)
    params = config.get("optimizer", {}).get("params", {})
    clip = config.get("gradient_clipping", 1.0)
    net = models.build(model, seed).half()
    weights = list(net.parameters())
    master = [w.detach().float().clone() for w in weights]
    optimizer = torch.optim.AdamW(master, lr=params.get("lr", 1e-3), weight_decay=params.get("weight_decay", 0.01))
    hook = SpikeHook(net, list(spikes))
    scales, overflows, losses, headroom, hysteresis, stopped = [], [], [], [], [], None
    # no process group here: DeepSpeed's scaler asks for the rank only to decide which rank logs, and its
    # "OVERFLOW! Skipping step" warnings are what overflow_per_step records
    with mock.patch.object(loss_scaler.dist, "get_rank", lambda: 0), _quiet(loss_scaler.logger):
        for step in range(steps):
            scales.append(float(scaler.cur_scale))
            hook.arm_for(step)
            summed, overflow, largest, step_losses = None, False, 0.0, []
            for rank in range(world):
                for w in weights:
                    w.grad = None
                for micro_step in range(accum):
                    indices = models.sample_indices(step, micro_step, rank, world, micro, accum)
                    batch = models.make_batch(model, indices, seed).to("cpu", torch.half)
                    loss = models.loss_of(net, model, batch)
                    scaler.backward(loss / accum)
                    step_losses.append(loss.item())
                grads = [w.grad for w in weights]
                if any(has_inf_or_nan(g) for g in grads):
                    overflow = True
                    continue
                largest = max(largest, *(float(g.abs().max()) for g in grads))
                flat = torch.cat([g.float().flatten() for g in grads])
                summed = flat if summed is None else summed + flat
            if not overflow:
                summed /= world * scaler.cur_scale
                norm = float(summed.norm())
                if clip and norm > clip:
                    summed *= clip / (norm + 1e-6)
                offset = 0
                for m in master:
                    m.grad = summed[offset:offset + m.numel()].view_as(m)
                    offset += m.numel()
                optimizer.step()
                with torch.no_grad():
                    for w, m in zip(weights, master):
                        w.copy_(m)
            overflows.append(overflow)
            headroom.append(None if overflow else math.log2(FP16_MAX / largest))
            losses.append(statistics.fmean(step_losses))
            try:
                scaler.update_scale(overflow)
            except Exception as error:  # DeepSpeed's scaler refuses to go below min_loss_scale
                stopped = f"{type(error).__name__}: {error}"
                break
            hysteresis.append(getattr(scaler, "cur_hysteresis", None))  # a static scale has none
    hook.remove()
    settings = fp16_settings(section)
    return {"world_size": world, "model": model, "steps": steps, "micro_batch": micro, "grad_accum": accum,
            "scaler": type(scaler).__name__,
            "fp16": {"loss_scale": settings.loss_scale, "initial_scale_power": settings.initial_scale_power,
                     "loss_scale_window": settings.loss_scale_window, "hysteresis": settings.hysteresis,
                     "min_loss_scale": settings.min_loss_scale},
            "spikes": list(spikes), "scale_per_step": scales, "overflow_per_step": overflows,
            "skipped_steps": sum(overflows), "losses": losses, "headroom_log2": headroom,
            "hysteresis_per_step": hysteresis, "stopped": stopped,
            "final_scale": float(scaler.cur_scale)}


def scenario_demos(scenarios: Mapping[str, tuple[dict, list[int]]] | None = None, steps: int = DEMO_STEPS,
                   world: int = 2) -> dict[str, dict]:
    """:func:`scaler_demo` for each scenario (default :data:`SCENARIOS`), on ``ds_configs/zero2.json`` with the
    scenario's fp16 settings (:func:`demo_config`); keyed by the scenario's name."""
    return {name: scaler_demo(demo_config(fp16), spikes, steps=steps, world=world)
            for name, (fp16, spikes) in (scenarios or SCENARIOS).items()}


def scale_by_step(fp16: Mapping[str, Any], spikes: list[int] | tuple[int, ...] = (), steps: int = DEMO_STEPS,
                  world: int = 2) -> str:
    """Train the scenario the learner wrote (an ``fp16`` block, the optimizer steps to spike) with
    :func:`scaler_demo` and say, step by step, what DeepSpeed's loss scaler did: the scale the step used,
    whether it overflowed (and so was skipped), the hysteresis left and the scale the next step will use."""
    section = {k: v for k, v in fp16.items() if k != "enabled"}
    result = scaler_demo(demo_config(section), spikes, steps=steps, world=world)
    rows = []
    for i, (scale, overflow) in enumerate(zip(result["scale_per_step"], result["overflow_per_step"])):
        ended = i >= len(result["hysteresis_per_step"])
        after = result["scale_per_step"][i + 1] if i + 1 < len(result["scale_per_step"]) else result["final_scale"]
        left = result["hysteresis_per_step"][i] if not ended else None
        rows.append([i + 1, "spike" if i + 1 in result["spikes"] else "", _power(scale),
                     "overflow: skipped" if overflow else "applied", "-" if left is None else left,
                     "run ended" if ended else _power(after) + {1: "", 2: " (doubled)", 0.5: " (halved)"}.get(after / scale, "")])
    table = records.format_table(rows, ["step", "", "scale used", "verdict", "hysteresis left", "next scale"])
    summary = (f"{result['scaler']}; {result['skipped_steps']} of {len(rows)} steps skipped"
               + (f"; DeepSpeed ended the run: {result['stopped']}" if result["stopped"] else ""))
    return f"{table}\n{summary}"


def trajectory(result, spikes: list[int] | None = None) -> dict:
    """The scale of each step, overflow per step and how the run ended, from a :func:`scaler_demo` result
    (a dict) or an engine run's record (its ``loss_scale`` section; ``spikes``: the steps the run spiked, where
    its record does not say)."""
    if isinstance(result, dict):
        return {"scales": result["scale_per_step"], "overflow": result["overflow_per_step"],
                "stopped": result["stopped"], "spikes": result["spikes"], "fp16": result["fp16"]}
    section = result["loss_scale"]
    return {"scales": section["scale_per_step"], "overflow": [not a for a in section["applied_per_step"]],
            "stopped": None,
            "spikes": result.summary.get("faults", {}).get("loss_spike", {}).get("steps", spikes or []),
            "fp16": section["fp16"]}


def _power(scale: float) -> str:
    exponent = math.log2(scale)
    return f"2^{exponent:.0f}" if exponent == int(exponent) else f"{scale:g}"


def trajectory_table(results: Mapping[str, Any]) -> str:
    """Per scenario: skipped steps (which), the scale at the first and last step, how often it halved and
    doubled, and whether DeepSpeed's scaler ended the run. Counts and powers of two only: they depend on
    which steps overflow, not on the digits of the losses."""

    rows = []
    for name, result in results.items():
        t = trajectory(result)
        scales = t["scales"]
        changes = [b / a for a, b in zip(scales, scales[1:])]
        skipped = [i + 1 for i, o in enumerate(t["overflow"]) if o]
        rows.append([name, f"{len(skipped)}: steps {_ranges(skipped)}" if skipped else "0",
                     f"{_power(scales[0])} -> {_power(scales[-1])}", sum(c < 1 for c in changes),
                     sum(c > 1 for c in changes),
                     f"at step {len(scales)}: scale already at min_loss_scale" if t["stopped"] else "-"])
    return records.format_table(rows, ["scenario", "skipped steps", "scale first -> last", "halvings",
                                       "doublings", "DeepSpeed ended the run"])


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 6] -> "1-3, 6"."""
    parts, start = [], None
    for i, step in enumerate(steps):
        if start is None:
            start = step
        if i == len(steps) - 1 or steps[i + 1] != step + 1:
            parts.append(f"{start}" if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)


def headroom_table(results: Mapping[str, Any]) -> str:
    """Per scenario: the smallest and largest headroom of an applied step (halvings left before an fp16
    overflow). A step's overflow verdict cannot hang on rounding while this stays well above 0."""

    rows = []
    for name, result in results.items():
        values = [h for h in result["headroom_log2"] if h is not None]
        rows.append([name, f"{min(values):.2f}" if values else "-", f"{max(values):.2f}" if values else "-"])
    return records.format_table(rows, ["scenario", "min headroom (halvings)", "max headroom"])


# --- what each precision keeps ------------------------------------------------------------------------

def kept_in_fp32_table(runs: Mapping[tuple[int, str], Any], rank: int = 0) -> str:
    """Per run: the dtype of each kind of model state DeepSpeed holds (from the tensors themselves)."""

    rows = []
    for (stage, precision), r in runs.items():
        dtypes = r.memory.placement(rank)["dtypes"]
        rows.append([f"ZeRO-{stage} {precision}", *(", ".join(dtypes.get(k, ["-"])) for k in records.MODEL_STATE_KEYS)])
    return records.format_table(rows, ["run", *records.MODEL_STATE_KEYS])


def bytes_per_parameter_table(runs: Mapping[tuple[int, str], Any], rank: int = 0) -> str:
    """Per run: measured model-state bytes per parameter on one rank, by kind, beside the paper's
    2 + 2 + K accounting for that stage (:func:`helpers.core.theory.model_state_bytes`, per parameter)."""

    rows = []
    for (stage, precision), r in runs.items():
        psi, world = r.params, r["world_size"]
        measured = r.states(rank)
        paper = theory.model_state_bytes(psi, stage, world, precision)
        rows.append([f"ZeRO-{stage} {precision}", *(f"{measured[k] / psi:.2f}" for k in records.MODEL_STATE_KEYS),
                     f"{r.model_state_bytes(rank) / psi:.2f}", f"{paper['total'] / psi:.2f}"])
    return records.format_table(rows, ["run", *(f"{k} B/param" for k in records.MODEL_STATE_KEYS),
                                       "total B/param", "paper B/param"])


def saving_lines(runs: Mapping[tuple[int, str], Any], rank: int = 0, half: str = "bf16") -> str:
    """Per ZeRO stage with an fp32 and a ``half`` run (keys (stage, precision)): each run's measured bytes per
    parameter on ``rank``, state by state, summed; then what the 16-bit run saves on its parameters and gradients
    and what its fp32 master adds beyond fp32's own master (a ZeRO optimizer keeps one in fp32 too)."""
    lines = []
    for stage in sorted({s for s, _ in runs}):
        pair = {p: runs.get((stage, p)) for p in ("fp32", half)}
        if not all(isinstance(r, records.Record) for r in pair.values()):
            continue
        per = {p: {k: r.states(rank)[k] / r.params for k in records.MODEL_STATE_KEYS} for p, r in pair.items()}
        sums = {p: " + ".join(f"{v:.2f}" + (" master" if k == "master" else "") for k, v in b.items()
                              if v or k != "master") + f" = {sum(b.values()):.2f}" for p, b in per.items()}
        saved = sum(per["fp32"][k] - per[half][k] for k in ("params", "grads"))
        added = per[half]["master"] - per["fp32"]["master"]
        net = sum(per["fp32"].values()) - sum(per[half].values())
        share = sum(per[half].values()) / sum(per["fp32"].values())
        lines.append(f"ZeRO-{stage}: fp32 {sums['fp32']}; {half} {sums[half]} B/param. {half} saves {saved:.2f} on "
                     f"parameters and gradients" + (f" and adds {added:.2f} of fp32 master" if added else
                                                   ", both keep the same fp32 master")
                     + (f": in all, {half} saves nothing (as many bytes as fp32)." if abs(net) < 0.005 else
                        f": in all, {half} needs {share:.0%} of fp32's bytes (saves {net:.2f} B/param)."))
    return "\n".join(lines)



# --- gradient accumulation in bf16 (data_types.grad_accum_dtype) -------------------------------------

class AccumulatedGradient(Probe):
    """How far the gradient DeepSpeed accumulated over the first optimizer step is from an fp32 reference.

    At the boundary of step 1 (after the last micro-step's backward, before ``engine.step``), every rank
    reads each parameter's full accumulated gradient with ``deepspeed.utils.safe_get_full_grad`` (in the
    dtype DeepSpeed accumulated it in); rank 0 also computes the same gradient itself, in fp32 with plain
    autograd, from the seeded initial weights and every rank's micro-batches of that step (the mean over
    ranks of each rank's sum of loss / accumulation steps, what ``engine.backward`` accumulates).

    Section ``accumulated_gradient``: ``dtypes`` (what ``safe_get_full_grad`` returned), ``relative_error``
    (``||g - g_fp32|| / ||g_fp32||`` over all parameters) and ``elements``. Regression models only (the
    course's ``linear``, ``mlp``, ``mlp_wide``).
    """

    name = "accumulated_gradient"
    keys = ("accumulated_gradient.relative_error", "accumulated_gradient.dtypes")
    #: The model and seed of the reference where the run's options name none (:func:`against_fp32`).
    model: str | None = None
    seed: int | None = None

    @classmethod
    def check_options(cls, options: dict, steps: int) -> None:
        model = options.get("reference_model")
        if model not in models.REGRESSION_WIDTH or not isinstance(options.get("reference_seed"), int):
            raise ValueError(f"options {{'reference_model': {model!r}, 'reference_seed': "
                             f"{options.get('reference_seed')!r}}}: name the run's model (one of "
                             f"{', '.join(models.REGRESSION_WIDTH)}) and seed, as grad_accum_specs does")

    def start(self, ctx: RunContext) -> None:
        self.found: dict | None = None

    def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
        if step != ctx.first_step or micro_step != ctx.grad_accum - 1:
            return
        safe_get_full_grad = ds.load("deepspeed.utils").safe_get_full_grad

        grads = [safe_get_full_grad(p) for p in ctx.engine.module.parameters()]  # a collective at stage 3
        if ctx.rank != 0:
            return
        reference = fp32_gradient(ctx.options.get("reference_model", self.model),
                                  ctx.options.get("reference_seed", self.seed), step, ctx.dp_size,
                                  ctx.micro_batch, ctx.grad_accum)
        got = torch.cat([g.detach().float().cpu().flatten() for g in grads])
        self.found = {"dtypes": sorted({str(g.dtype).removeprefix("torch.") for g in grads}),
                      "relative_error": float((got - reference).norm() / reference.norm()),
                      "elements": got.numel()}

    def finish(self, ctx: RunContext) -> dict:
        return {"found": self.found}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        return {"accumulated_gradient": ranks[0]["found"]}


def against_fp32(model: str, seed: int = 0) -> type[AccumulatedGradient]:
    """The :class:`AccumulatedGradient` probe for a script's own run (``measure.attach(..., probes=...)``, where
    no RunSpec options exist): its reference is ``model`` built with ``seed``, as the script builds it."""
    if model not in models.REGRESSION_WIDTH:
        raise ValueError(f"model {model!r}: the fp32 reference needs one of {', '.join(models.REGRESSION_WIDTH)}")
    return type("AccumulatedGradientAgainstFp32", (AccumulatedGradient,), {"model": model, "seed": seed})


def fp32_gradient(name: str, seed: int, step: int, world: int, micro: int, accum: int) -> torch.Tensor:
    """The gradient of optimizer step ``step`` (0-based; exact for the first, from the seeded weights) computed
    in fp32 by plain autograd on one process: every rank's micro-batches, each loss divided by ``accum``,
    averaged over the ``world`` ranks; flattened in the model's parameter order."""
    model = models.build(name, seed)
    for rank in range(world):
        for micro_step in range(accum):
            batch = models.make_batch(name, models.sample_indices(step, micro_step, rank, world, micro, accum), seed)
            (models.loss_of(model, name, batch) / (accum * world)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])



def accumulated_gradient(record: records.Record) -> dict:
    """What the :class:`AccumulatedGradient` probe found: ``dtypes``, ``relative_error``, ``elements``."""
    return record.section("accumulated_gradient")


def _accum_label(stage: int, dtype: str) -> str:
    return f"ZeRO-{stage}, " + ("fp32 training" if dtype == "fp32 training" else f"bf16, accumulated in {dtype}")


def _grads_per_param(r: records.Record, rank: int) -> tuple[float, float]:
    """Gradient bytes per parameter ``rank`` held after the first micro-step's backward (while accumulating)
    and after the last one (at the boundary, once DeepSpeed has reduced)."""
    placement = r.memory.placement(rank)
    return r.states(rank)["grads"] / r.params, (placement["accelerator"]["grads"] + placement["host"]["grads"]) / r.params


def grad_accum_table(runs: Mapping[Any, Any], rank: int = 0) -> str:
    """Per accumulation run (keys ("accum", (stage, dtype))): DeepSpeed's optimizer, the dtypes of the gradients
    ``rank`` holds, their bytes per parameter while accumulating and at the boundary, and its losses against the
    same stage accumulating in fp32 (bf16's tolerance; the first step's exactly). Runs ``deepspeed.initialize``
    refused follow the table, one line each. Device-independent: nbval checks it."""

    rows, refused = [], []
    for (_, (stage, dtype)), r in sorted(((k, r) for k, r in runs.items() if k[0] == "accum"), key=lambda kr: kr[0][1]):
        label = _accum_label(stage, dtype)
        if isinstance(r, Exception):
            refused.append(f"{label}: refused by deepspeed.initialize: {str(r).split('failed: ', 1)[-1].splitlines()[0]}")
            continue
        during, boundary = _grads_per_param(r, rank)
        base = runs.get(("accum", (stage, "fp32")))
        versus = "-"
        if dtype == "bf16" and isinstance(base, records.Record):
            first = "step 1 equal (no update yet)" if r.losses[0] == base.losses[0] else "step 1 differs"
            versus = f"{first}, all {records.loss_agreement(base.losses, r.losses, 'bf16')}"
        rows.append([label, r["optimizer"], ", ".join(r.memory.placement(rank)["dtypes"]["grads"]),
                     f"{during:.2f}", f"{boundary:.2f}", versus])
    table = records.format_table(rows, ["run", "DeepSpeed's optimizer", "gradients held", "grad B/param accumulating",
                                        "at the boundary", "losses vs accumulated in fp32"]) if rows else ""
    return "\n".join([table] * bool(rows) + refused)


def gradient_held_lines(runs: Mapping[Any, Any], rank: int = 0) -> str:
    """A line per accumulation run whose gradient bytes differ while accumulating and at the boundary: what it
    holds in each phase (a stage that keeps whole gradients until the boundary reduction, then its partition)."""
    lines = []
    for (_, (stage, dtype)), r in sorted(((k, r) for k, r in runs.items() if k[0] == "accum"), key=lambda kr: kr[0][1]):
        if not isinstance(r, records.Record):
            continue
        during, boundary = _grads_per_param(r, rank)
        if during != boundary:
            lines.append(f"{_accum_label(stage, dtype)}: {during:.2f} B/param while it accumulates (the whole gradient "
                         f"on every rank), {boundary:.2f} at the boundary (after the reduction, its 1/{r['world_size']}"
                         f" partition{' only' if boundary * r['world_size'] == during else ''})")
    return "\n".join(lines)


def bf16_optimizer_lines(runs: Mapping[Any, Any], rank: int = 0) -> str:
    """A line per accumulation run that DeepSpeed gave ``BF16_Optimizer``, from its record: its gradient bytes per
    parameter split by the dtypes it holds (a whole gradient in each, where the bytes add up to that), and whether
    its fp32 master and Adam's two moments are a 1/N_d partition of fp32's 4 + 8 bytes (as ZeRO-1's) or whole."""
    lines = []
    for (_, (stage, dtype)), r in sorted(((k, r) for k, r in runs.items() if k[0] == "accum"), key=lambda kr: kr[0][1]):
        if not isinstance(r, records.Record) or r["optimizer"] != "BF16_Optimizer":
            continue
        during, boundary = _grads_per_param(r, rank)
        held = r.memory.placement(rank)["dtypes"]["grads"]
        sizes = {d: torch.finfo(getattr(torch, d)).bits / 8 for d in held}
        grads = (" = " + " + ".join(f"a whole {d} gradient ({b:g})" for d, b in sizes.items())
                 if abs(sum(sizes.values()) - during) < 0.01 else f" ({', '.join(held)})")
        states, world = r.states(rank), r["world_size"]
        master, moments = states["master"] / r.params, states["optimizer"] / r.params
        share = (master + moments) / 12  # fp32's master (4) and two moments (8) per parameter
        split = (f"1/{world} of fp32's 4 + 8: partitioned over the {world} ranks, as ZeRO-1 does"
                 if abs(share * world - 1) < 0.01 else f"{share:.2f} of fp32's 4 + 8")
        lines.append(f"{_accum_label(stage, dtype)} (BF16_Optimizer): gradients {during:.2f} B/param{grads}, "
                     f"{'the same' if abs(during - boundary) < 0.005 else f'{boundary:.2f}'} at the boundary; "
                     f"master {master:.2f} + Adam's moments {moments:.2f} B/param = {split}")
    return "\n".join(lines)


def grad_accum_verdicts(runs: Mapping[Any, Any], gradient_tolerance: float = records.LOSS_TOLERANCE["fp32"] * 10,
                        loss_tolerance: float = records.LOSS_TOLERANCE["bf16"]) -> str:
    """Device-independent properties of the accumulation runs: fp32 training's accumulated gradient against
    the probe's fp32 reference within ``gradient_tolerance`` (two fp32 sums: an fp32 tolerance), and per stage
    whether accumulating in bf16 left the gradient further from the reference than accumulating in fp32, and
    whether the two runs' losses agree within ``loss_tolerance`` (bf16's, as every bf16 loss comparison)."""
    lines = []
    fp32 = runs.get(("accum", (2, "fp32 training")))
    if isinstance(fp32, records.Record):
        error = accumulated_gradient(fp32)["relative_error"]
        lines.append(f"fp32 training (ZeRO-2): DeepSpeed's step-1 gradient vs the fp32 reference computed apart: "
                     f"{'within' if error <= gradient_tolerance else 'differ by more than'} {gradient_tolerance:.0e} "
                     "(relative; two fp32 sums)")
    for (_, (stage, dtype)), r in sorted(((k, r) for k, r in runs.items() if k[0] == "accum"), key=lambda kr: kr[0][1]):
        other = runs.get(("accum", (stage, "fp32")))
        if dtype != "bf16" or not isinstance(r, records.Record) or not isinstance(other, records.Record):
            continue
        bf16_error, fp32_error = accumulated_gradient(r)["relative_error"], accumulated_gradient(other)["relative_error"]
        lines.append(f"ZeRO-{stage}: accumulated in bf16, the step-1 gradient is further from the fp32 reference than "
                     f"accumulated in fp32: {bf16_error > fp32_error}; losses of the two runs "
                     f"{records.loss_agreement(r.losses, other.losses, tolerance=loss_tolerance)}")
    return "\n".join(lines)


def grad_accum_error_table(runs: Mapping[Any, Any]) -> str:
    """Per accumulation run: the first step's accumulated gradient against the fp32 reference (relative error),
    and the largest loss difference over the run against the same stage's bf16 run accumulating in fp32 and
    against fp32 training. Digits that depend on the processor: print where nbval does not compare."""

    fp32 = runs.get(("accum", (2, "fp32 training")))
    rows = []
    for (_, (stage, dtype)), r in sorted(((k, r) for k, r in runs.items() if k[0] == "accum"), key=lambda kr: kr[0][1]):
        if isinstance(r, Exception):
            continue
        base = None if dtype == "fp32 training" else runs.get(("accum", (stage, "fp32")))
        gap = lambda other: (f"{max(abs(a - b) for a, b in zip(r.losses, other.losses)):.1e}"  # noqa: E731
                             if isinstance(other, records.Record) and other is not r else "-")
        rows.append([_accum_label(stage, dtype), f"{accumulated_gradient(r)['relative_error']:.1e}", gap(base), gap(fp32)])
    return records.format_table(rows, ["run", "step-1 gradient vs fp32 reference (relative)",
                                       "max loss gap vs bf16 accumulated in fp32", "max loss gap vs fp32 training"])


def grad_accum_error_summary(runs: Mapping[Any, Any]) -> str:
    """One sentence from the accumulation runs' gradient errors: how much of bf16 accumulation's error remains
    when the same stage accumulates in fp32 (what computing in bf16 costs alone), beside fp32 training's error."""
    shares, errors = [], []
    for (_, (stage, dtype)), r in sorted(((k, r) for k, r in runs.items() if k[0] == "accum"), key=lambda kr: kr[0][1]):
        other = runs.get(("accum", (stage, "fp32")))
        if dtype == "bf16" and isinstance(r, records.Record) and isinstance(other, records.Record):
            bf16, fp32 = accumulated_gradient(r)["relative_error"], accumulated_gradient(other)["relative_error"]
            shares.append(fp32 / bf16)
            errors.append(f"ZeRO-{stage} {bf16:.1e} -> {fp32:.1e}")
    if not shares:
        return "no pair of bf16 runs accumulated in bf16 and in fp32"
    low, high = min(shares), max(shares)
    training = runs.get(("accum", (2, "fp32 training")))
    tail = (f"; fp32 training's gradient is {accumulated_gradient(training)['relative_error']:.1e} from the reference"
            if isinstance(training, records.Record) else "")
    part = "most" if low > 0.5 else "about half" if high >= 0.4 else "a small part"
    removed = f"{1 - high:.0%}" if f"{1 - high:.0%}" == f"{1 - low:.0%}" else f"{1 - high:.0%}-{1 - low:.0%}"
    return (f"Accumulating in fp32 instead of bf16 makes the step-1 gradient's error {removed} smaller "
            f"({'; '.join(errors)}). The rest, {part} of it, comes from computing the forward and backward in bf16, "
            f"which the accumulation dtype does not change{tail}.")


# --- the source article's configuration ---------------------------------------------------------------

ARTICLE = "source_article"
def corrected_article(half: str = "bf16") -> dict:
    """The article's config, corrected: ``gradient_accumulation_steps`` left to DeepSpeed (32 samples per
    step on any world size that divides it), ``offload_param`` removed (ignored at stage 2), and bf16 in
    place of fp16 (the same bytes, fp32's exponent range: no loss scaling, so none of its five knobs)."""

    corrected = configs.merged(configs.load(ARTICLE), {"gradient_accumulation_steps": None,
                                                       "zero_optimization": {"offload_param": None}})
    if half == "fp16":  # a device without bf16 (V100, T4): keep the article's fp16
        return corrected
    return configs.merged(corrected, {"fp16": None, "bf16": {"enabled": True}})


def article_changes_table(world_size: int) -> str:
    """The source article's config beside :func:`corrected_article`: each line the correction changes, and what
    the course's checker finds in each config on ``world_size`` ranks."""

    def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        found = {}
        for key, value in config.items():
            if isinstance(value, Mapping):
                found.update(flat(value, f"{prefix}{key}."))
            else:
                found[f"{prefix}{key}"] = value
        return found

    article, corrected = flat(configs.load(ARTICLE)), flat(corrected_article())
    rows = [[key, json.dumps(article[key]) if key in article else "(absent)",
             json.dumps(corrected[key]) if key in corrected else "(removed)"]
            for key in list(article) + [k for k in corrected if k not in article]
            if article.get(key) != corrected.get(key)]
    table = records.format_table(rows, ["line", "the article", "corrected"])

    def findings(config: dict) -> str:
        return "\n".join(f"  {f}" for f in configs.check(config, world_size)) or "  no findings"

    return (f"{table}\n\nThe checker on {world_size} ranks, the article's config:\n"
            f"{findings(configs.load(ARTICLE))}\nthe corrected one:\n{findings(corrected_article())}")


# --- the chapter's launch: its script's records -------------------------------------------------------

#: How chapter 07's script names its runs' folders (the keys the chapter's tables read them by: run_key).
RUN_NAME = re.compile(r"^(?:zero(?P<stage>\d)-(?P<precision>fp32|bf16|fp16)"
                      r"|accum-zero(?P<accum_stage>\d)-(?P<accum>bf16|fp32)|(?P<training>fp32)-zero(?P<training_stage>\d)"
                      r"|speed-zero2-(?P<speed>fp32|bf16|fp16))$")
#: What a run the script could not start leaves in its folder instead of a record.
REFUSED = "refused.json"


def run_key(name: str) -> tuple | None:
    """The chapter's key for a run folder's name: ``zero2-bf16`` -> (2, "bf16"); ``accum-zero3-fp32`` (a bf16 run
    accumulating in fp32) -> ("accum", (3, "fp32")); ``fp32-zero2`` (the accumulation runs' fp32 training) ->
    ("accum", (2, "fp32 training")); ``speed-zero2-fp16`` -> ("speed", "fp16"); None for any other name."""
    found = RUN_NAME.match(name)
    if found is None:
        return None
    if found["stage"]:
        return int(found["stage"]), found["precision"]
    if found["accum_stage"]:
        return "accum", (int(found["accum_stage"]), found["accum"])
    if found["training"]:
        return "accum", (int(found["training_stage"]), "fp32 training")
    return "speed", found["speed"]


def _run_order(path: Path) -> tuple:
    """Folders in the order the chapter's tables list them: by kind, stage, then fp32, bf16, fp16."""
    key = run_key(path.name)
    if key is None:
        return (9, path.name)
    formats = ("fp32", "bf16", "fp16", "fp32 training")
    if key[0] == "accum":
        return (1, key[1][0], formats.index(key[1][1]) if key[1][1] in formats else 0)
    if key[0] == "speed":
        return (2, 0, formats.index(key[1]))
    return (0, key[0], formats.index(key[1]))


def load_runs(folder: str | Path) -> dict:
    """Every run the chapter's script measured into ``folder`` (one sub-folder per run), keyed by
    :func:`run_key`: its record, or, where ``deepspeed.initialize`` refused the config, a RuntimeError with
    DeepSpeed's message (the script wrote it to :data:`REFUSED`)."""
    found: dict = {}
    for path in sorted(Path(folder).iterdir(), key=_run_order):
        key = run_key(path.name)
        if key is None or not path.is_dir():
            continue
        if (path / REFUSED).is_file():
            found[key] = RuntimeError(json.loads((path / REFUSED).read_text())["error"])
        elif (path / "summary.json").is_file():
            found[key] = records.load(path)
    return found


# --- what each precision communicates ---------------------------------------------------------------------

def collective_bytes_table(runs: Mapping[Any, Any]) -> str:
    """Per run (keys (stage, precision)): the bytes DeepSpeed's comms logger logged per optimizer step, by
    collective, and the total against fp32 at the same stage. Message sizes: the same on every machine."""
    rows = []
    for (stage, precision), r in runs.items():
        fp32 = runs.get((stage, "fp32"))
        rows.append([f"ZeRO-{stage} {precision}",
                     ", ".join(f"{op} {row['bytes']:,.0f}" for op, row in sorted(r.comm.by_op.items())),
                     f"{r.comm.bytes_per_step:,.0f}",
                     f"{r.comm.bytes_per_step / fp32.comm.bytes_per_step:.3f}" if fp32 is not None else "-"])
    return records.format_table(rows, ["run", "bytes per step, by collective", "total", "total / fp32's"])


def gradient_bytes_verdict(runs: Mapping[Any, Any]) -> str:
    """Lines per ZeRO stage from the runs' collectives (keys (stage, precision)), in bytes as DeepSpeed's comms
    logger counts them (each rank's input to the call): the gradient reduction (the largest caller of the fp32
    step) in calls per step times bytes per call, each 16-bit run against fp32's; then the same collective's
    other callers (a norm, an overflow flag)."""
    lines = []
    for stage in sorted({s for s, _ in runs}):
        fp32 = runs.get((stage, "fp32"))
        if fp32 is None or not fp32.comm.by_caller:
            continue
        op, caller, _ = max(((op, caller, row["bytes"]) for op, callers in fp32.comm.by_caller.items()
                             for caller, row in callers.items()), key=lambda found: found[2])
        here = {p: r.comm.by_caller[op][caller] for (s, p), r in runs.items()
                if s == stage and caller in (r.comm.by_caller or {}).get(op, {})}
        base = here["fp32"]["bytes"]
        lines.append(f"ZeRO-{stage}, gradient reduction ({op} issued by DeepSpeed's {caller}), per step: " + "; ".join(
            f"{p} {row['count']:g} x {row['bytes'] / row['count']:,.0f} = {row['bytes']:,.0f} bytes"
            + (f" ({row['bytes'] / base:.2f} of fp32's)" if p != "fp32" else "") for p, row in here.items()))
        rest = [f"{p} {other} {row['bytes']:,.0f}" for (s, p), r in runs.items() if s == stage
                for other, row in (r.comm.by_caller or {}).get(op, {}).items() if other != caller]
        if rest:
            lines.append(f"  the few other bytes: {'; '.join(rest)}")
    return "\n".join(lines)


# --- verdicts, references ------------------------------------------------------------------------------

def memory_verdict_table(runs: Mapping[Any, Any], rank: int = 0) -> str:
    """16-bit against fp32, measured on ``rank``: total model-state bytes at each stage both precisions ran
    (keys (stage, precision))."""

    rows = []
    for stage in sorted({s for s, _ in runs}):
        if (stage, "fp32") in runs and (stage, "bf16") in runs:
            a, b = runs[(stage, "fp32")], runs[(stage, "bf16")]
            rows.append([f"ZeRO-{stage}, {a['world_size']} ranks", records.format_bytes(a.model_state_bytes(rank)),
                         records.format_bytes(b.model_state_bytes(rank)),
                         f"{b.model_state_bytes(rank) / a.model_state_bytes(rank):.2f}"])
    return records.format_table(rows, ["model states per rank", "fp32", "bf16", "bf16 / fp32"])


def engine_against_demo(engine: Mapping[str, Any], demos: Mapping[str, Any]) -> str:
    """Per scenario, one row: the steps DeepSpeed's fp16 engine skipped and those DeepSpeed's scaler skipped in
    :func:`scaler_demo`, whether both used the same scale at every step, and whether the demo's gradients came
    within :data:`EDGE_HALVINGS` of fp16's largest value (where last-digit differences decide an overflow). An
    engine run DeepSpeed ended is a dict ``{"failed": message}``."""

    def skipped(t: dict) -> str:
        steps = [i + 1 for i, o in enumerate(t["overflow"]) if o]
        return (_ranges(steps) or "none") + ("; then ended at min_loss_scale" if t["stopped"] else "")

    rows = []
    for name in (n for n in demos if n in engine):
        run, demo = engine[name], trajectory(demos[name])
        if isinstance(run, dict) and "failed" in run:
            same = "yes" if demo["stopped"] else "no"
            engine_side = "ended at min_loss_scale"
        else:
            t = trajectory(run)
            same = "yes" if t["scales"] == demo["scales"] and t["overflow"] == demo["overflow"] else "no"
            engine_side = skipped(t)
        rows.append([name, skipped(demo), engine_side, same,
                     "yes" if _min_headroom(demos[name]) < EDGE_HALVINGS else "no"])
    return records.format_table(rows, ["scenario", "demo skipped steps", "engine skipped steps", "same decisions",
                                       f"demo within {EDGE_HALVINGS:g} halving of overflow"])


def loss_scale_reference_report(demos: Mapping[str, Any], name: str = "loss-scale") -> str:
    """The fp16 engine's runs measured on GPUs (committed references, labelled with their device and date) beside
    the scaler demo here: :func:`engine_against_demo`, then :func:`engine_demo_differences`'s sentence."""

    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    return "\n\n".join(f"DeepSpeed's fp16 engine on {device}, {date} ({note}), beside the demo here:\n"
                         f"{engine_against_demo(runs, demos)}\n{engine_demo_differences(runs, demos, f'{device}, {date}')}"
                         for device, date, note, runs in found)


def speed_table(runs: Mapping[Any, Any], rank: int = 0, peak: bool = True) -> str:
    """Per run: median step time, samples per second, and (``peak``) peak memory of ``rank`` (timings: not
    for nbval)."""

    rows = [[r.label, f"{r.timing.median_s * 1000:.1f}", f"{r['samples_per_s']:,.0f}"]
            + [records.format_peak(r, rank)] * peak for r in runs.values()]
    source = next(iter(runs.values())).memory.peak_source
    return records.format_table(rows, ["run", "step ms", "samples/s"]
                                + [PEAK_HEADERS.get(source, f"peak ({source})")] * peak)


#: :func:`speed_table`'s plain header for each way :func:`helpers.core.memory.peak_bytes` measures a peak.
PEAK_HEADERS = {"peak RSS (ru_maxrss)": "peak memory of a rank's process",
                "torch.cuda.max_memory_allocated": "peak GPU memory in tensors"}


# --- the formats, from torch itself ----------------------------------------------------------------

def formats_table(adds: Mapping[str, str] | None = None) -> str:
    """fp32, bf16 and fp16 as ``torch.finfo`` describes them: bits of sign / exponent / mantissa, the largest
    value, the smallest normal value, the spacing just above 1 (``eps``), and what DeepSpeed adds for each
    (``adds`` replaces that column's text for the formats it names)."""
    adds = {"fp32": "nothing (a ZeRO optimizer keeps its fp32 partition)", "bf16": "an fp32 master copy",
            "fp16": "an fp32 master copy, and a loss scale", **(adds or {})}
    rows = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))
        rows.append([name, f"1 / {info.bits - 1 - mantissa} / {mantissa}", f"{info.max:.4g}", f"{info.tiny:.3g}",
                     f"2^-{mantissa}", adds[name]])
    return records.format_table(rows, ["format", "bits: sign / exponent / mantissa", "largest", "smallest normal",
                                       "eps (spacing above 1)", "what DeepSpeed adds"])


# --- fp16 against bf16, measured -------------------------------------------------------------------

def half_bytes_table(runs: Mapping[str, Any], rank: int = 0) -> str:
    """fp16 against bf16 in the same runs (``{"ZeRO-2 fp16": record, "ZeRO-2 bf16": record, ...}``): each kind
    of model state ``rank`` holds, equal or not, and the dtypes. Both measured, neither from a formula."""
    rows = []
    for fp16_name, fp16 in runs.items():
        if not fp16_name.endswith("fp16") or fp16_name.replace("fp16", "bf16") not in runs:
            continue
        bf16 = runs[fp16_name.replace("fp16", "bf16")]
        a, b = fp16.memory.placement(rank), bf16.memory.placement(rank)
        same = [k for k in records.MODEL_STATE_KEYS
                if a["accelerator"][k] + a["host"][k] == b["accelerator"][k] + b["host"][k]]
        differ = [k for k in records.MODEL_STATE_KEYS if k not in same]
        rows.append([f"{fp16_name} vs {fp16_name.replace('fp16', 'bf16')}",
                     f"the same for {', '.join(same) or 'none'}" + (f"; differ: {', '.join(differ)}" if differ else ""),
                     " | ".join(f"{k} {', '.join(a['dtypes'].get(k, ['-']))}" for k in ("params", "grads"))])
    return records.format_table(rows, ["runs", "bytes held by each kind of state", "fp16 run's 16-bit states"])


def half_bytes_reference_report(name: str = "precision-speed") -> str:
    """:func:`half_bytes_table` for every committed GPU result of the precision-speed experiment."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    return "\n\n".join(f"Measured on {device}, {date} ({note}):\n{half_bytes_table(runs)}" for device, date, note, runs in found)


# --- the engine against the scaler demo ----------------------------------------------------------------

#: Headroom (halvings) below which a step's overflow verdict can hang on rounding: the largest scaled
#: gradient came within a factor of 2 of fp16's largest value.
EDGE_HALVINGS = 1.0


def engine_demo_differences(engine: Mapping[str, Any], demos: Mapping[str, Any], label: str) -> str:
    """Which scenarios the fp16 engine's runs ``engine`` (records, or ``{"failed": ...}`` where DeepSpeed ended
    the run) and the scaler demo ``demos`` decide differently, against how close the demo's applied steps came
    to an fp16 overflow (:data:`EDGE_HALVINGS`): one sentence, from the data, opening with ``label``."""
    differ, agree = [], []
    for scenario, run in engine.items():
        if scenario not in demos:
            continue
        demo = trajectory(demos[scenario])
        if isinstance(run, dict) and "failed" in run:
            (agree if demo["stopped"] else differ).append(scenario)
            continue
        t = trajectory(run)
        (agree if t["scales"] == demo["scales"] and t["overflow"] == demo["overflow"] else differ).append(scenario)
    near = {s for s in differ + agree if _min_headroom(demos[s]) < EDGE_HALVINGS}

    def named(scenarios: list[str]) -> str:  # numbered scenarios ("3 · ...") by their numbers
        if scenarios and all(" · " in s for s in scenarios):
            return "scenarios " + ", ".join(s.split(" · ")[0] for s in scenarios)
        return "; ".join(scenarios) or "none"

    return (f"{label}: the engine and the demo decide {len(agree)} of {len(agree) + len(differ)} scenarios alike; they "
            f"differ in {len(differ)} ({named(differ)}). Scenarios whose demo came within "
            f"{EDGE_HALVINGS:g} halving of an fp16 overflow: {named(sorted(near, key=list(demos).index))}. "
            f"The scenarios that differ are exactly those: {set(differ) == near}.")


def _min_headroom(result: Mapping[str, Any]) -> float:
    values = [h for h in result["headroom_log2"] if h is not None]
    return min(values) if values else math.inf


# --- what a 16-bit step can gain on a GPU -----------------------------------------------------------

#: fp32 (non-tensor-core) peak TFLOP/s by device name, for the bound on what 16-bit matrix products can save.
PEAK_FP32_TFLOPS: list[tuple[str, float, str]] = [
    (r"H100.*PCIe", 51.0, "NVIDIA H100 datasheet, H100 PCIe: FP32 51 TFLOPS"),
    (r"H100|H200|GH200", 67.0, "NVIDIA H100 and H200 datasheets, SXM: FP32 67 TFLOPS"),
    (r"A100", 19.5, "NVIDIA A100 datasheet: FP32 19.5 TFLOPS"),
]


def peak_fp32_tflops(device_name: str) -> tuple[float | None, str]:
    """(fp32 TFLOP/s peak, its source) for a device name, or (None, why)."""
    for pattern, tflops, source in PEAK_FP32_TFLOPS:
        if re.search(pattern, device_name):
            return tflops, source
    return None, f"no fp32 peak known for {device_name!r}: add it to helpers.topics.precision.PEAK_FP32_TFLOPS"


def timed_steps(record: records.Record) -> list[float]:
    """The step times of ``record`` after its first (warm-up) step, in seconds, fastest first."""
    return sorted(record["step_time_s"]["all"][1:])


def _against_base(runs: Mapping[str, records.Record], base: str,
                  load: load_guard.Load | None) -> dict[str, tuple[float, load_guard.Verdict]]:
    """Each run but ``base``: its median step speed against ``base``'s, and the load guard's verdict on their
    timed steps (:func:`timed_steps`) under ``load``."""
    fp32 = runs[base]
    return {name: (fp32.timing.median_s / r.timing.median_s,
                   load_guard.compare({base: timed_steps(fp32), name: timed_steps(r)}, load))
            for name, r in runs.items() if name != base}


def speed_explanation(runs: Mapping[str, records.Record], load: load_guard.Load | None, base: str = "ZeRO-2 fp32",
                      flops: bool = True) -> str:
    """What the step times of ``runs`` ({"ZeRO-2 fp32": record, "ZeRO-2 bf16": record, ...}, one device) show,
    from their own data: the range of each run's timed steps; a speed verdict for each 16-bit run against
    ``base`` through the course's load guard (:func:`helpers.core.load_guard.compare` under ``load``: given only
    where the run had its devices to itself and the difference exceeds the spread of the measured steps), else
    why it is withheld; and how long the model's matrix products take at least, at the datasheets' fp32 and dense
    16-bit peaks (6 x parameters x samples FLOPs per rank: an MLP's FLOPs are its matrix products), a lower bound
    on their time in the step, not a measure of it (``flops``)."""
    fp32 = runs.get(base)
    if fp32 is None:
        return f"no {base} run to compare with"
    spread = {name: timed_steps(r) for name, r in runs.items()}
    lines = ["Timed steps after the first, fastest to slowest: " + "; ".join(
        f"{name} {t[0] * 1e3:.1f}-{t[-1] * 1e3:.1f} ms" for name, t in spread.items()) + "."]
    for name, (ratio, verdict) in _against_base(runs, base, load).items():
        if verdict.given:
            lines.append(f"{name}: {ratio:.2f}x {base}'s speed (median step), beyond the steps' spread of "
                         f"{verdict.spread:.0%}.")
        else:
            lines.append(f"{name}: median step {ratio:.2f}x {base}'s speed; verdict withheld: {verdict.withheld}.")
    if not flops:
        return "\n".join(lines)
    least = _products_least_time(fp32)
    if isinstance(least, str):
        return "\n".join([*lines, least])
    lines.append(f"The step's matrix products, {least.flops:.3g} FLOPs per rank (6 x {fp32.params:,} parameters x "
                 f"{fp32.micro_batch * fp32.grad_accum} samples), need at least {least.math32 * 1e3:.2f} ms at the fp32 "
                 f"peak ({least.peak32:g} TFLOP/s) and at least {least.math16 * 1e3:.2f} ms at the dense 16-bit peak "
                 f"({least.peak16:g} TFLOP/s), beside a {least.step * 1e3:.1f} ms fp32 step. Sources: {least.sources}. "
                 "These are lower bounds on the products' time: how long they really took in the step, and so how "
                 "much of any gain they account for, needs a kernel profile, which these runs did not take.")
    return "\n".join(lines)


def speed_summary(runs: Mapping[str, records.Record], load: load_guard.Load | None, base: str = "ZeRO-2 fp32") -> str:
    """One sentence on ``runs``' step times: each 16-bit run's median speed against ``base``'s, then the load
    guard's verdict (:func:`speed_explanation`'s rule) or why it is withheld."""
    fp32 = runs.get(base)
    if fp32 is None:
        return f"no {base} run to compare with"
    parts = []
    for name, (ratio, verdict) in _against_base(runs, base, load).items():
        parts.append(f"{name} {ratio:.2f}x ({'faster' if ratio > 1 else 'slower'}, beyond the steps' spread"
                     if verdict.given else f"{name} {ratio:.2f}x (verdict withheld: {verdict.withheld}")
        parts[-1] += ")"
    return f"Median step speed against {base}: " + "; ".join(parts) + "."


def speed_bounds(runs: Mapping[str, records.Record], load: load_guard.Load | None, base: str = "ZeRO-2 fp32",
                 pair: tuple[str, str] = ("ZeRO-2 bf16", "ZeRO-2 fp16")) -> str:
    """What the datasheets' peaks allow 16-bit to gain in ``runs``' step, from their data: the least time the
    step's matrix products take in fp32 and in 16-bit (:func:`speed_explanation`'s lower bounds), the speed-up
    ``base`` would get if its products ran at the fp32 peak and became free of all but their 16-bit time, against
    each 16-bit run's measured one; then ``pair`` (fp16 against bf16: the same bytes, the same dense peak)
    compared through the load guard, and that these runs do not explain a difference between them."""
    least = _base_least_time(runs, base)
    if isinstance(least, str):
        return least
    math32, math16, step, bound = least.math32, least.math16, least.step, least.bound
    against = _against_base(runs, base, load)
    measured = {name: ratio for name, (ratio, _) in against.items()}
    above = [name for name, (ratio, verdict) in against.items() if ratio > bound and verdict.given]  # and the spread
    lines = [f"At the datasheets' peaks the step's matrix products need at least {math32 * 1e3:.2f} ms of the "
             f"{step * 1e3:.1f} ms fp32 step ({math32 / step:.0%}) and {math16 * 1e3:.2f} ms in 16-bit: were they at "
             f"the fp32 peak, 16-bit could speed the step up {bound:.2f}x at most, the rest of the step unchanged. "
             "Measured: " + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in measured.items()) + "."
             + (f" {' and '.join(above)} beat{'s' if len(above) == 1 else ''} that bound: either the fp32 products "
                "ran below the peak, or other work got faster in 16-bit too (such as the halved gradient reduction); "
                "a kernel profile, which these runs did not take, would say which." if above else
                " Within that bound; how long the products really took needs a kernel profile, which these runs "
                "did not take.")]
    if all(name in runs for name in pair):
        slow, fast = (runs[name] for name in pair)
        verdict = load_guard.compare({pair[0]: timed_steps(slow), pair[1]: timed_steps(fast)}, load)
        lines.append(f"{pair[1]} against {pair[0]}: "
                     + (f"{verdict.faster} faster by {verdict.ratio - 1:.0%}, beyond the steps' spread"
                        if verdict.given else f"verdict withheld: {verdict.withheld}")
                     + ". The two keep the same bytes and have the same dense peak: nothing these runs measured "
                     "explains a difference.")
    return "\n".join(lines)


class ProductsTime(NamedTuple):
    """The least time an fp32 run's matrix products take (6 x parameters x samples FLOPs per rank) at the
    datasheets' fp32 and dense 16-bit peaks, beside its median step (seconds), and the speed-up 16-bit could
    give were those products at the fp32 peak and the rest of the step unchanged (``bound``)."""
    flops: float
    peak32: float
    peak16: float
    sources: str
    math32: float
    math16: float
    step: float
    bound: float


def _products_least_time(fp32: records.Record) -> ProductsTime | str:
    """:class:`ProductsTime` of an fp32 run; or why not (no peak known)."""
    peak32, source32 = peak_fp32_tflops(fp32["device_name"])
    peak16, source16 = performance.peak_tflops(fp32["device_name"])
    if not (peak32 and peak16):
        return source32 if not peak32 else source16
    flops = 6 * fp32.params * fp32.micro_batch * fp32.grad_accum
    math32, math16, step = flops / (peak32 * 1e12), flops / (peak16 * 1e12), fp32.timing.median_s
    return ProductsTime(flops, peak32, peak16, f"{source32}; {source16}", math32, math16, step,
                        step / (step - math32 + math16))


def _base_least_time(runs: Mapping[str, records.Record], base: str) -> ProductsTime | str:
    """:func:`_products_least_time` of ``runs[base]``; or why not (no such run, no peak known)."""
    return _products_least_time(runs[base]) if base in runs else f"no {base} run to compare with"


def speed_takeaway(runs: Mapping[str, records.Record], load: load_guard.Load | None, base: str = "ZeRO-2 fp32") -> str:
    """The speed comparison's takeaway, from ``runs``' data: the least time ``base``'s matrix products need at
    the datasheet's fp32 peak, as a share of its step (a lower bound on their time, so no bound on what 16-bit can
    save), then each 16-bit run's median speed-up, fastest first, and whether it is beyond the steps' spread (the
    load guard's rule; :func:`speed_bounds` gives the arithmetic)."""
    least = _base_least_time(runs, base)
    if isinstance(least, str):
        return least
    math32, step = least.math32, least.step
    against = _against_base(runs, base, load)
    ratios = {name: ratio for name, (ratio, _) in against.items()}
    spread = {name: "beyond the steps' spread" if verdict.given else "within the spread"
              for name, (_, verdict) in against.items()}
    return (f"On this model the matrix products need at least {math32 / step:.0%} of an fp32 step (at the "
            "datasheet's peak; their real share is unknown without a kernel profile). Measured: "
            + ", ".join(f"{name.split()[-1]} {ratios[name]:.2f}x ({spread[name]})"
                        for name in sorted(ratios, key=ratios.get, reverse=True)) + ".")


def speed_takeaway_reference(name: str = "precision-speed") -> str:
    """:func:`speed_takeaway` for each committed GPU result of experiment ``name``, under its written conditions."""
    return references.each_reference(name, lambda device, date, _, runs, conditions: (
        f"Takeaway ({device}, {date}): " + speed_takeaway(runs, load_guard.Load.from_conditions(conditions))))


def speed_bounds_reference(name: str = "precision-speed") -> str:
    """:func:`speed_bounds` for each committed GPU result of experiment ``name``, under its written conditions."""
    return references.each_reference(name, lambda device, date, _, runs, conditions: (
        f"{device}, {date}: {speed_bounds(runs, load_guard.Load.from_conditions(conditions))}"))


def speed_reference_report(name: str = "precision-speed", detail: bool = False) -> str:
    """Step times per precision, measured on GPUs (committed references): each device's table and
    :func:`speed_summary` (alone: what its conditions say); with ``detail``, its conditions, peak device memory
    and :func:`speed_explanation` instead."""
    found = references.reference_runs(name)
    if not found:
        return references.no_references(name, references.GPU_HOW)
    parts = []
    for (device, date, note, runs), conditions in zip(found, references.reference_conditions(name)):
        load = load_guard.Load.from_conditions(conditions)
        if detail:
            parts.append(f"Measured on {device}, {date} ({note}):\nConditions: {conditions}\n{speed_table(runs)}\n"
                         f"{speed_explanation(runs, load)}")
        else:
            parts.append(f"Measured on {device}, {date}:\n{speed_table(runs, peak=False)}\n{speed_summary(runs, load)}")
    return "\n\n".join(parts)


def loss_scale_trajectories(trajectories: Mapping[str, dict], title: str = "fp16 loss scale, step by step"):
    """One panel per scenario: log2 of the loss scale each optimizer step used (a step line), skipped steps
    marked with a red x, injected spikes with a dashed line, and where DeepSpeed's scaler ended the run."""
    plt = plots.pyplot()

    count = len(trajectories)
    columns = min(3, count)
    rows = (count + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.7 * rows), squeeze=False, sharey=True)
    for ax, (name, t) in zip(axes.flat, trajectories.items()):
        steps = range(1, len(t["scales"]) + 1)
        powers = [math.log2(s) for s in t["scales"]]
        ax.step(steps, powers, where="mid", color="#4C72B0")
        skipped = [(s, p) for s, p, o in zip(steps, powers, t["overflow"]) if o]
        if skipped:
            ax.scatter(*zip(*skipped), marker="x", color="#C44E52", zorder=3, label="skipped step")
        for spike in t["spikes"]:
            ax.axvline(spike, color="grey", linestyle="--", linewidth=0.8)
        if t["stopped"]:
            ax.annotate("run ended", (len(powers), powers[-1]), textcoords="offset points", xytext=(-40, 12), fontsize=8)
        ax.set_title(textwrap.fill(name, 44), fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("log2(loss scale)", fontsize=8)
    for ax in list(axes.flat)[count:]:
        ax.axis("off")
    marked = next((ax for ax in axes.flat if ax.get_legend_handles_labels()[0]), None)
    if marked is not None:
        marked.legend(fontsize=7, loc="lower right")
    fig.suptitle(title + " (dashed: injected spike)", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


def bytes_per_parameter_bars(runs: Mapping[tuple[int, str], Any], rank: int = 0):
    """One stacked bar per run: measured model-state bytes per parameter on ``rank``, by kind of state,
    with the paper's total for the run's stage and precision marked."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(runs), 3.6))
    labelled = set()
    for i, ((stage, precision), r) in enumerate(runs.items()):
        bottom, measured = 0.0, r.states(rank)
        for key in records.MODEL_STATE_KEYS:
            value = measured[key] / r.params
            if value:
                ax.bar(i, value, 0.6, bottom=bottom, color=plots.STATE_COLOURS[key],
                       label=None if key in labelled else key)
                labelled.add(key)
                bottom += value
        paper = theory.model_state_bytes(r.params, stage, r["world_size"], precision)["total"] / r.params
        ax.plot([i - 0.35, i + 0.35], [paper, paper], color="black", linewidth=1.2,
                label=None if "paper" in labelled else "paper's total")
        labelled.add("paper")
    ax.set_xticks(range(len(runs)), [f"ZeRO-{stage}\n{precision}" for stage, precision in runs])
    ax.set_ylabel(f"bytes per parameter, rank {rank}")
    ax.set_title("Model states per parameter, by precision and stage")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- exercises ----------------------------------------------------------------------------------------

#: Exercise 2: an fp16 section and the overflow verdicts of ten optimizer steps (True: inf/NaN found).
SCALE_TASK_SECTION = {"initial_scale_power": 16, "loss_scale_window": 4, "hysteresis": 2}
SCALE_TASK_OVERFLOWS = (False, True, False, True, True, False, False, False, False, False)
#: Exercise 3: what the learner's fp16 section must make DeepSpeed's scaler do.
SCALER_TASK = {"initial scale": 4096, "loss_scale_window": 100, "hysteresis": 1, "min_loss_scale": 1024}


def drive_loss_scaler(section: Mapping[str, Any], overflows: tuple[bool, ...] | list[bool]) -> list[tuple[float, int]]:
    """(scale, hysteresis left) after each of ``overflows`` as DeepSpeed's own scaler, built from ``section`` by
    :func:`make_loss_scaler`, updates them (``update_scale``); ends early where DeepSpeed ends the run (at
    ``min_loss_scale``), the last entry then ``(scale, -1)``. Outside a launch no process group exists, so
    the rank DeepSpeed asks for (only to decide which rank logs) is taken as 0."""
    loss_scaler = ds.load("deepspeed.runtime.fp16.loss_scaler")

    scaler, found = make_loss_scaler(section), []
    with mock.patch.object(loss_scaler.dist, "get_rank", lambda: 0):
        for overflow in overflows:
            try:
                scaler.update_scale(overflow)
            except Exception as error:  # DeepSpeed's own end of the run
                if "minimum" not in str(error):
                    raise
                found.append((scaler.cur_scale, -1))
                break
            found.append((scaler.cur_scale, getattr(scaler, "cur_hysteresis", 0)))
    return found


def exercise_bf16_bytes(answer: float, runs: Mapping[Any, Any], key: Any = ("accum", (3, "bf16")),
                        rank: int = 0) -> exercises.Verdict:
    """Exercise: predict the model-state bytes per parameter on ``rank`` of the chapter's run ``key`` (default:
    ZeRO-3 in bf16, gradients accumulated in bf16), checked against the states the run measured."""
    r = runs[key]
    world, stage, measured = r["world_size"], r.stage, r.states(rank)
    per = {k: measured[k] / r.params for k in records.MODEL_STATE_KEYS}
    split = {0: "nothing", 1: "Adam's states and the master", 2: "the gradients, Adam's states and the master",
             3: "every state"}[stage]
    why = (f"measured on rank {rank} of {world}: bf16 parameters {per['params']:.2f} + bf16 gradients "
           f"{per['grads']:.2f} + Adam's fp32 moments {per['optimizer']:.2f} + the fp32 master {per['master']:.2f}. "
           f"The paper's 2 + 2 + K, with ZeRO-{stage} dividing {split} by N_d = {world}: mixed precision halves "
           "the 16-bit states, never the fp32 ones.")
    measured_total = round(r.model_state_bytes(rank) / r.params, 2)  # a few bytes of step counters aside
    return exercises.number("bf16 bytes per parameter", answer, measured_total, relative=0.01,
                            task=f"Predict the model-state bytes per parameter on one rank of ZeRO-{stage} in bf16 "
                                 f"({world} ranks).",
                            hint="list the four states with their dtype (2 or 4 bytes; Adam has two moments), then "
                                 f"divide what ZeRO-{stage} partitions by the number of ranks",
                            why=why)


def exercise_loss_scale(answer: float, section: Mapping[str, Any] = SCALE_TASK_SECTION,
                        overflows: tuple[bool, ...] = SCALE_TASK_OVERFLOWS) -> exercises.Verdict:
    """Exercise: predict the loss scale after ``overflows`` with the fp16 ``section``, checked by driving
    DeepSpeed's own loss scaler through them (:func:`drive_loss_scaler`)."""
    path = drive_loss_scaler(section, overflows)
    trace = "; ".join(f"{i} {'overflow' if o else 'ok'} -> 2^{math.log2(s):.0f}" + (f" (h {h})" if h >= 0 else " (ended)")
                      for i, (o, (s, h)) in enumerate(zip(overflows, path), 1))
    steps = "".join("X" if o else "." for o in overflows)
    why = (f"DeepSpeed's DynamicLossScaler, step by step (scale after the step, h = hysteresis left): {trace}. "
           "An overflow uses up one unit of hysteresis, and halves the scale once only one unit is left; the scale "
           "doubles, and hysteresis is refilled, on the first clean step after loss_scale_window clean steps in a "
           "row (update_scale's stable_interval in DeepSpeed 0.19.8).")
    return exercises.number("loss scale", answer, path[-1][0],
                            task=f"Predict the loss scale after the steps {steps} (X: overflow) with fp16 {dict(section)}.",
                            hint="start at 2**initial_scale_power; an overflow halves it only when hysteresis is down "
                                 "to 1; clean steps double it only after a whole window without overflow",
                            why=why)


def exercise_fp16_block(answer: dict, task: Mapping[str, float] = SCALER_TASK, world_size: int = 2) -> exercises.Verdict:
    """Exercise: write an ``fp16`` block whose dynamic loss scaler, as DeepSpeed builds it (:func:`make_loss_scaler`),
    has the ``task``'s initial scale, window, hysteresis and floor; the block must also pass the course's checker
    on ``ds_configs/zero2.json``."""
    loss_scaler = ds.load("deepspeed.runtime.fp16.loss_scaler")

    def test(block: dict) -> tuple[bool, str]:
        if not isinstance(block, dict):
            raise TypeError("write the fp16 block as a dict, e.g. {\"enabled\": True}")
        if block.get("enabled") is not True:
            return False, "fp16 is not enabled: DeepSpeed ignores the block unless it says \"enabled\": True."
        if refused := configs.refusal(configs.merged(configs.load("zero2"), {"fp16": block}), world_size, warnings=True):
            return False, refused
        scaler = make_loss_scaler({k: v for k, v in block.items() if k != "enabled"})
        if not isinstance(scaler, loss_scaler.DynamicLossScaler):
            return False, f"DeepSpeed builds a static scale of {scaler.cur_scale:g} from it: loss_scale must be 0 (dynamic)."
        got = {"initial scale": scaler.cur_scale, "loss_scale_window": scaler.scale_window,
               "hysteresis": scaler.delayed_shift, "min_loss_scale": scaler.min_scale}
        path = drive_loss_scaler(block, [True] * 4)
        scales = [f"{s:g}" for s, left in path if left >= 0]
        story = (f"DeepSpeed's scaler starts at {got['initial scale']:g}; after each of four overflows in a row it is "
                 f"{', '.join(scales) or 'the floor'}" + (f", and overflow {len(path)} ends the run (the scale is "
                                                          "already at min_loss_scale)" if path[-1][1] < 0 else ""))
        wrong = [f"{k} is {got[k]:g}, not {v:g}" for k, v in task.items() if got[k] != v]
        if wrong:
            return False, f"{story}; but {', '.join(wrong)}."
        return True, (f"{story}. initial_scale_power sets 2^power, hysteresis 1 halves at the first overflow, "
                      "and min_loss_scale is the floor where DeepSpeed's ZeRO optimizers end the run.")

    nth = ("first", "second", "third", "fourth")[int(task["hysteresis"]) - 1]
    wanted = (f"starts at {task['initial scale']:g}, halves the scale at the {nth} overflow, doubles it after {task['loss_scale_window']:g} clean steps and never goes below "
              f"{task['min_loss_scale']:g}")
    return exercises.satisfies("fp16 block", answer, test,
                               task=f"Write an fp16 block for dynamic loss scaling that {wanted}.",
                               hint="the knobs are loss_scale (0: dynamic), initial_scale_power (the scale starts at "
                                    "2**power), loss_scale_window, hysteresis and min_loss_scale; the checker's cases "
                                    "above show the block's form")


def how_measured(names: tuple[str, ...] = ("precision-speed", "loss-scale")) -> str:
    """What measured each committed GPU result the chapter reads (experiments ``names``): device, date, the
    note stored with it and the conditions (what else ran on the machine)."""
    lines = []
    for name in names:
        found = references.reference_runs(name)
        if not found:
            lines.append(references.no_references(name, references.GPU_HOW))
        for (device, date, note, _), conditions in zip(found, references.reference_conditions(name)):
            lines.append(f"{name}: measured on {device}, {date} ({note}).\nConditions: {conditions}")
    return "\n".join(lines)


def exercise_half_ratio(answer: float, runs: Mapping[Any, Any], world_size: int = 8, rank: int = 0) -> exercises.Verdict:
    """Exercise: predict bf16's model states over fp32's, per rank, at ZeRO-2 on ``world_size`` ranks, checked
    against the chapter's ZeRO-2 runs (keys (2, "fp32"), (2, "bf16")): each kind of state they measured per
    parameter, the partitioned kinds (gradients, optimizer states, master) rescaled from their ranks to
    ``world_size``, the parameters kept whole."""
    totals, why = {}, []
    for precision in ("fp32", "bf16"):
        r = runs[(2, precision)]
        per = {k: v / r.params for k, v in r.states(rank).items() if k in records.MODEL_STATE_KEYS}
        share = r["world_size"] / world_size
        totals[precision] = per["params"] + share * (per["grads"] + per["optimizer"] + per["master"])
        why.append(f"{precision}: parameters {per['params']:.0f} + (gradients {per['grads'] * r['world_size']:.0f} + "
                   f"optimizer {per['optimizer'] * r['world_size']:.0f} + master {per['master'] * r['world_size']:.0f}) "
                   f"/ {world_size} = {totals[precision]:.3f} bytes per parameter")
    expected = totals["bf16"] / totals["fp32"]
    return exercises.number("bf16 / fp32 at ZeRO-2", answer, expected, relative=0.01,
                            task=f"Predict bf16's model-state bytes per rank over fp32's at ZeRO-2 on {world_size} ranks.",
                            hint="each state's bytes per parameter (the table above) and ZeRO-2's rule for "
                                 "which states it splits; the ratio of the two totals",
                            why="; ".join(why) + ". DeepSpeed keeps an fp32 master slice in fp32 training too, "
                                "so the ratio tends to 1/2 only as the split states vanish per rank.")


# --- chapter 07b: the fp16 engine's runs ---------------------------------------------------------------

#: What an fp16 engine run that DeepSpeed ended (an overflow at min_loss_scale) leaves in its folder.
ENDED = "ended.json"


def load_engine_runs(folder: str | Path, scenarios: Mapping[str, tuple[dict, list[int]]] | None = None) -> dict:
    """The fp16 engine's runs of chapter 07b's script (folders ``engine-<i>``, in the order of ``scenarios``,
    default :data:`SCENARIOS`), keyed by scenario: each run's record, or ``{"failed": message, "device":
    "cuda"}`` where DeepSpeed ended it (the form the "loss-scale" reference keeps), records first."""
    found: dict = {}
    for i, name in enumerate(scenarios or SCENARIOS):
        path = Path(folder) / f"engine-{i}"
        if (path / ENDED).is_file():
            found[name] = {**json.loads((path / ENDED).read_text()), "device": "cuda"}
        elif (path / "summary.json").is_file():
            found[name] = records.load(path)
    return dict(sorted(found.items(), key=lambda item: isinstance(item[1], dict)))


def scenarios_table(scenarios: Mapping[str, tuple[dict, list[int]]] | None = None) -> str:
    """Each loss-scaling scenario: the fp16 knobs it changes from DeepSpeed's defaults, and the optimizer steps
    whose loss it spikes."""
    rows = [[name, ", ".join(f"{k}={json.dumps(v)}" for k, v in knobs.items()) or "(the defaults)", _ranges(spikes)]
            for name, (knobs, spikes) in (scenarios or SCENARIOS).items()]
    return records.format_table(rows, ["scenario", "fp16 knobs", "spiked steps"])
