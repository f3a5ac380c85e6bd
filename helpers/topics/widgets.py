"""The interactive layer: a config builder, a memory and communication calculator, live runs, my runs.

Each panel is a few ipywidgets around plain functions that notebooks and tests call without them:

==========================  ===============================================================================
panel                       the functions it shows
==========================  ===============================================================================
:class:`ConfigBuilder`      :func:`build_config` (settings -> DeepSpeed config), :func:`helpers.core.configs.check`
                            (the checker of ``python -m helpers check``), :func:`helpers.core.launch.run`
:class:`Calculator`         :func:`calculator_rows` / :func:`calculator_table`: every figure from
                            :mod:`helpers.core.theory` (model states, offload, collectives, predicted time)
:class:`LiveRun`            :func:`watch_run`: :func:`helpers.core.launch.run` with its ``on_event`` hook
:class:`MyRuns`             :func:`helpers.core.records.load_all` and :func:`helpers.core.records.runs_table`
==========================  ===============================================================================

:func:`config_lab` puts all four together (``notebooks/17_config_lab.ipynb``). Every panel's text
form (what a notebook stores beside the widget, and what nbval compares) is one line that depends
only on its settings, never on timings or on other runs.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import inspect
import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ipywidgets as w

from helpers.core import configs, ds, environment, exercises, launch, models, performance, plots, records, theory
from helpers.core import train

#: Where the builder saves the learner's configs (git-ignored; ``python -m helpers check my_configs/x.json``).
MY_CONFIGS = environment.REPO_ROOT / "my_configs"
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PRECISIONS = ("fp32", "bf16", "fp16")
#: Bucket sizes (elements) the builder offers; DeepSpeed's defaults are among them.
BUCKET_SIZES = (10_000, 100_000, 1_000_000, 10_000_000, 50_000_000, 100_000_000, 500_000_000, 1_000_000_000)
#: The zero_optimization knobs the builder sets, and the stages that use them (stage 0's all-reduce
#: bucket is DeepSpeed's constant, not a config key).
ZERO_KNOBS = {"reduce_bucket_size": (1, 2, 3), "allgather_bucket_size": (1, 2), "stage3_prefetch_bucket_size": (3,),
              "overlap_comm": (1, 2, 3)}
#: Builder control -> the zero_optimization key it sets.
KNOB_OF_CONTROL = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
                   "prefetch_bucket_size": "stage3_prefetch_bucket_size", "overlap_comm": "overlap_comm"}
#: Most ranks the builder launches on a machine without GPUs: each rank is a process with its own torch
#: and DeepSpeed (about half a GB), sharing the cores.
CPU_LAUNCH_LIMIT = 8
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: overlap_comm as the builder's dropdown holds it (a dropdown cannot hold None: it would show nothing)
OVERLAP_CHOICES = {None: "DeepSpeed's default", True: "on", False: "off"}


def _field(key: str) -> str:
    return {"stage3_prefetch_bucket_size": "prefetch_bucket_size"}.get(key, key)


@functools.lru_cache(maxsize=1)
def zero_defaults() -> dict[str, Any]:
    """DeepSpeed's own defaults for the builder's zero_optimization knobs, read from its config model."""
    DeepSpeedZeroConfig = ds.load("deepspeed.runtime.zero.config").DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    return {key: (int(fields[_field(key)].default) if key != "overlap_comm" else None) for key in ZERO_KNOBS}


# --- 1. the config builder ---------------------------------------------------------------------

@dataclasses.dataclass
class BuilderSettings:
    """What the builder's controls hold. ``train_batch=0`` leaves ``train_batch_size`` out (DeepSpeed
    derives it); ``overlap_comm=None`` keeps DeepSpeed's default (on at stage 3 only)."""

    stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str = ""
    precision: str = "fp32"
    micro_batch: int = 4
    grad_accum: int = 2
    world_size: int = 2
    train_batch: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    overlap_comm: bool | None = None

    def validate(self) -> None:
        """Raise ValueError naming the setting and the fix for a value no config could hold."""
        choices = {"stage": theory.STAGES, "precision": PRECISIONS, "offload_optimizer": OFFLOAD_DEVICES,
                   "offload_param": OFFLOAD_DEVICES, "overlap_comm": (None, True, False)}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: choose one of {', '.join(map(str, allowed))}")
        for key, least in (("micro_batch", 1), ("grad_accum", 1), ("world_size", 1), ("train_batch", 0),
                           ("reduce_bucket_size", 1), ("allgather_bucket_size", 0), ("prefetch_bucket_size", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{key}={value!r}: needs a whole number of at least {least}")


def build_config(settings: BuilderSettings) -> dict:
    """The DeepSpeed config the builder makes: ``ds_configs/zero<stage>.json`` (the chapters' config) with the
    settings applied, writing only what differs from it and from DeepSpeed's defaults.

    A knob the stage does not use (:data:`ZERO_KNOBS`) is left out. With the optimizer offloaded,
    ``torch_adam`` goes, so DeepSpeed builds its CPU Adam (ZeRO-Offload's optimizer).
    """
    s = settings
    s.validate()
    config = configs.load(f"zero{s.stage}")
    config["train_micro_batch_size_per_gpu"] = s.micro_batch
    config["gradient_accumulation_steps"] = s.grad_accum
    if s.train_batch:
        config = {"train_batch_size": s.train_batch, **config}
    if s.precision != "fp32":
        config[s.precision] = {"enabled": True}
    zero = config["zero_optimization"]
    defaults = zero_defaults()
    values = {"reduce_bucket_size": s.reduce_bucket_size, "allgather_bucket_size": s.allgather_bucket_size,
              "stage3_prefetch_bucket_size": s.prefetch_bucket_size, "overlap_comm": s.overlap_comm}
    for key, stages in ZERO_KNOBS.items():
        if s.stage in stages and values[key] != defaults[key]:
            zero[key] = values[key]
    for section, device in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
        if device != "none":
            zero[section] = {"device": device, **({"nvme_path": s.nvme_path} if device == "nvme" and s.nvme_path else {})}
    if s.offload_optimizer != "none":
        config.get("optimizer", {}).get("params", {}).pop("torch_adam", None)
    return config


def findings_text(findings: Sequence[configs.Finding]) -> str:
    """The checker's findings as ``python -m helpers check`` prints them, with the count line."""
    errors = sum(f.severity == "error" for f in findings)
    return "\n".join([*(str(f) for f in findings), f"{errors} error(s), {len(findings) - errors} warning(s)"])


@functools.lru_cache(maxsize=None)
def model_parameters(name: str) -> int:
    """Ψ of a course model (built once, on CPU)."""
    return models.count_parameters(models.build(name))


def prediction_text(settings: BuilderSettings, model: str) -> str:
    """What the paper's formulas predict for this config on a course model, per rank: the figures the
    run's record sets its measurements beside (its ``theory`` section comes from the same functions)."""
    s, psi = settings, model_parameters(model)
    gpu = theory.placement(psi, s.stage, s.world_size, s.precision, s.offload_optimizer != "none",
                           s.offload_param != "none")
    sent = theory.comm_bytes_per_step(psi, s.stage, s.precision) * theory.ring_factor(s.world_size)
    moved = gpu["offloaded"]["total"]
    return (f"paper, for '{model}' ({psi:,} parameters) on {s.world_size} rank(s): model states "
            f"{records.format_bytes(gpu['gpu']['total'] + moved)} per rank"
            + (f" ({records.format_bytes(moved)} of them offloaded)" if moved else "")
            + f", {records.format_bytes(sent)} sent per rank per step")


def _pre(text: str, cls: str = "") -> str:
    return (f'<pre class="{cls}" style="margin:0;font-size:12px;line-height:1.3;white-space:pre;overflow-x:auto">'
            f'{html.escape(text)}</pre>')


def _findings_html(findings: Sequence[configs.Finding]) -> str:
    if not findings:
        return '<div style="color:#1a7f37"><b>✓ the checker finds nothing</b>: DeepSpeed will accept this config</div>'
    items = []
    for f in findings:
        colour = "#cf222e" if f.severity == "error" else "#9a6700"
        items.append(f'<li><b style="color:{colour}">{f.severity.upper()}</b> <code>{html.escape(f.key)}</code>: '
                     f'{html.escape(f.rule)}<br><i>fix:</i> {html.escape(f.fix)}</li>')
    return f'<ul style="margin:0;padding-left:18px">{"".join(items)}</ul>'


def _panel_repr(widget: w.Widget, text: str) -> dict:
    bundle = widget._repr_mimebundle_()
    bundle["text/plain"] = text
    return bundle


def _classed(widget: w.Widget, name: str) -> w.Widget:
    widget.add_class(f"course-{name}")
    return widget


class ConfigBuilder:
    """Controls for a DeepSpeed config, the config they make, the checker's findings, Save and Launch.

    Every change rebuilds the config (:func:`build_config`) and checks it for this machine
    (:func:`helpers.core.configs.check`); Launch stays off while there is an error. :meth:`set` changes
    controls from code, exactly as a click does.
    """

    def __init__(self, settings: BuilderSettings | None = None, name: str = "my-config", model: str = "llama",
                 steps: int = 6, env: environment.Environment | None = None, live: "LiveRun | None" = None,
                 **values: Any):
        self.env = env or environment.detect()
        fields = {f.name for f in dataclasses.fields(BuilderSettings)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a builder setting; use one of {', '.join(sorted(fields))}")
        self.settings = settings or BuilderSettings(world_size=self.env.default_world_size)
        self.settings = dataclasses.replace(self.settings, **values)
        self.settings.validate()
        models.check_model_name(model)
        self.live = live or LiveRun()
        #: called with the settings after every change, and with the record after every launch
        self.listeners: list[Callable[[BuilderSettings], None]] = []
        self.after_launch: list[Callable[[records.Record], None]] = []
        self.config: dict = {}
        self.findings: list[configs.Finding] = []
        self.last_record: records.Record | None = None
        s, defaults = self.settings, zero_defaults()

        def buckets(default: int, value: int) -> list[tuple[str, int]]:
            sizes = sorted({*BUCKET_SIZES, value})
            return [(f"{size:.0e}" + (" (default)" if size == default else ""), size) for size in sizes]

        style = {"description_width": "150px"}

        def control(kind: type, description: str, **kwargs: Any) -> w.ValueWidget:
            return kind(description=description, style=style, layout=w.Layout(width="360px"), **kwargs)

        self.controls: dict[str, w.ValueWidget] = {
            "stage": w.ToggleButtons(options=[(str(x), x) for x in theory.STAGES], value=s.stage,
                                     description="ZeRO stage", style={**style, "button_width": "48px"}),
            "offload_optimizer": control(w.Dropdown, "offload optimizer", options=OFFLOAD_DEVICES,
                                         value=s.offload_optimizer),
            "offload_param": control(w.Dropdown, "offload params", options=OFFLOAD_DEVICES, value=s.offload_param),
            "nvme_path": control(w.Text, "nvme_path", value=s.nvme_path, placeholder="folder on a fast drive",
                                 continuous_update=False),
            "precision": control(w.Dropdown, "precision", options=PRECISIONS, value=s.precision),
            "micro_batch": control(w.BoundedIntText, "micro batch / rank", value=s.micro_batch, min=1, max=4096),
            "grad_accum": control(w.BoundedIntText, "accumulation steps", value=s.grad_accum, min=1, max=1024),
            "world_size": control(w.BoundedIntText, "world size (ranks)", value=s.world_size, min=1, max=1024),
            "train_batch": control(w.BoundedIntText, "train batch (0: derive)", value=s.train_batch, min=0,
                                   max=1 << 20),
            **{key: control(w.Dropdown, key, options=buckets(defaults[KNOB_OF_CONTROL[key]], getattr(s, key)),
                            value=getattr(s, key))
               for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size")},
            "overlap_comm": control(w.Dropdown, "overlap_comm", options=list(OVERLAP_CHOICES.values()),
                                    value=OVERLAP_CHOICES[s.overlap_comm]),
        }
        for key, widget in self.controls.items():
            _classed(widget, key.replace("_", "-"))
            widget.observe(self._changed, names="value")
        self.name = _classed(control(w.Text, "name", value=name, continuous_update=False), "name")
        self.model = _classed(control(w.Dropdown, "model", options=list(models.MODELS), value=model), "model")
        self.steps = _classed(control(w.BoundedIntText, "steps", value=steps, min=1, max=1000), "steps")
        self.model.observe(self._changed, names="value")
        self.name.observe(self._changed, names="value")
        self.config_view = _classed(w.HTML(), "config")
        self.findings_view = _classed(w.HTML(), "findings")
        self.prediction_view = _classed(w.HTML(), "prediction")
        self.status = _classed(w.HTML(), "status")
        self.save_button = _classed(w.Button(description="Save", icon="save"), "save")
        self.launch_button = _classed(w.Button(description="Launch", icon="play", button_style="success"), "launch")
        self.save_button.on_click(lambda _: self._guarded(self.save))
        self.launch_button.on_click(lambda _: self._guarded(self.launch))
        controls = w.VBox(list(self.controls.values()) + [self.model, self.steps, self.name,
                                                           w.HBox([self.save_button, self.launch_button])],
                          layout=w.Layout(width="380px"))
        shown = w.VBox([w.HTML("<b>ds_config.json</b>"), self.config_view, w.HTML("<b>checker</b>"),
                        self.findings_view, self.prediction_view, self.status], layout=w.Layout(width="560px"))
        self.widget = _classed(w.VBox([w.HBox([controls, shown]), self.live.widget]), "builder")
        self.refresh()

    # state -----------------------------------------------------------------------------------

    def current_settings(self) -> BuilderSettings:
        """The settings the controls hold now."""
        values = {key: control.value for key, control in self.controls.items()}
        values["overlap_comm"] = {label: value for value, label in OVERLAP_CHOICES.items()}[values["overlap_comm"]]
        return BuilderSettings(**values)

    def refresh(self) -> None:
        """Rebuild and check the config from the controls, and update every view."""
        s = self.settings = self.current_settings()
        for key, control in self.controls.items():  # show only the knobs this config uses
            used = ((key not in KNOB_OF_CONTROL or s.stage in ZERO_KNOBS[KNOB_OF_CONTROL[key]])
                    and (key != "nvme_path" or "nvme" in (s.offload_optimizer, s.offload_param)))
            control.layout.display = None if used else "none"
        self.config = build_config(self.settings)
        self.findings = configs.check(self.config, self.settings.world_size, self.env)
        self.config_view.value = _pre(json.dumps(self.config, indent=1), "course-config-json")
        self.findings_view.value = _findings_html(self.findings)
        folder = f"runs/{self.name.value}-{self.model.value}-{s.world_size}r"
        self.prediction_view.value = (f"<i>{html.escape(prediction_text(s, self.model.value))}</i><br>"
                                      f"<small>Save writes <code>my_configs/{html.escape(self.name.value)}.json</code>; "
                                      f"Launch trains it into <code>{html.escape(folder)}</code></small>")
        self.launch_button.disabled = bool(self.errors())
        for listener in self.listeners:
            listener(self.settings)

    def _changed(self, change: dict) -> None:
        self.refresh()

    def set(self, **values: Any) -> "ConfigBuilder":
        """Change controls by name (as :class:`BuilderSettings` fields, or ``model``, ``steps``, ``name``),
        as if the learner had; the config and findings update as they do on a click."""
        fields = {f.name for f in dataclasses.fields(BuilderSettings)}
        dataclasses.replace(self.settings, **{k: v for k, v in values.items() if k in fields}).validate()
        for key, value in values.items():
            if key == "overlap_comm":
                self.controls[key].value = OVERLAP_CHOICES[value]
            elif key in self.controls:
                self.controls[key].value = value
            elif key in ("model", "steps", "name"):
                getattr(self, key).value = value
            else:
                raise ValueError(f"{key!r} is not a control of the builder: use one of "
                                 f"{', '.join([*self.controls, 'model', 'steps', 'name'])}")
        return self

    def errors(self) -> list[configs.Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def report(self) -> str:
        """The config as JSON and the checker's findings, as text (what a checked notebook cell prints)."""
        return f"{json.dumps(self.config, indent=1)}\n{findings_text(self.findings)}"

    # actions ---------------------------------------------------------------------------------

    def save(self, name: str | None = None) -> Path:
        """Write the config to ``my_configs/<name>.json`` and return the path."""
        name = name or self.name.value
        if not NAME_PATTERN.match(name):
            raise ValueError(f"name {name!r}: use letters, digits, '-', '_' or '.' (up to 64), e.g. 'my-zero3'")
        MY_CONFIGS.mkdir(exist_ok=True)
        path = MY_CONFIGS / f"{name}.json"
        path.write_text(json.dumps(self.config, indent=1) + "\n")
        shown = environment.shown_path(path)
        self.status.value = (f"saved <code>{html.escape(str(shown))}</code> "
                             f"(check it in a terminal: <code>python -m helpers check {html.escape(str(shown))}</code>)")
        return path

    def launch(self, model: str | None = None, steps: int | None = None) -> records.Record:
        """Save the config, then train it for real (:func:`watch_run`) on ``world_size`` ranks, with the
        live view below the builder; return the record."""
        if self.errors():
            raise configs.ConfigError(self.findings, source=self.name.value)
        world = self.settings.world_size
        most = self.env.gpu_count if self.env.is_gpu else CPU_LAUNCH_LIMIT
        if world > most:
            where = f"this machine has {most} GPU(s)" if self.env.is_gpu else f"a CPU launch takes at most {most} ranks"
            raise ValueError(f"world size {world}: {where}; set world size to at most {most} to launch here "
                             "(the config and the calculator still plan for any size)")
        path = self.save()
        self.launch_button.disabled = True
        try:
            self.last_record = watch_run(path, live=self.live, world_size=world, model=model or self.model.value,
                                         steps=steps or self.steps.value, name=self.name.value)
        finally:
            self.launch_button.disabled = bool(self.errors())
        for listener in self.after_launch:
            listener(self.last_record)
        return self.last_record

    def _guarded(self, action: Callable[[], Any]) -> None:
        """A button's action: its error goes to the status line, not to a log the learner never sees."""
        try:
            action()
        except (ValueError, OSError, launch.RunFailed) as error:  # ConfigError is a ValueError
            self.status.value = f'<span style="color:#cf222e">{html.escape(str(error).splitlines()[0])}</span>'

    def __repr__(self) -> str:
        s, errors = self.settings, len(self.errors())
        return (f"ConfigBuilder: ZeRO-{s.stage} {s.precision}, {s.world_size} rank(s), offload "
                f"optimizer={s.offload_optimizer} params={s.offload_param}: {errors} error(s), "
                f"{len(self.findings) - errors} warning(s)")

    def _repr_mimebundle_(self, **kwargs) -> dict:
        return _panel_repr(self.widget, repr(self))


def config_builder(**values: Any) -> ConfigBuilder:
    """A :class:`ConfigBuilder` with some controls preset, e.g. ``config_builder(stage=3, model="mlp")``. The default model, the small LLaMA-style one,
    learns visibly in a few dozen steps (its loss falls from about ln 256), which a live plot should show."""
    return ConfigBuilder(**values)


# --- 2. the calculator -------------------------------------------------------------------------

#: The offload settings the calculator lists for each stage: (optimizer, parameters). Stage 0 offloads
#: nothing in DeepSpeed, and parameters only move at stage 3 (see :func:`helpers.core.theory.placement`).
OFFLOAD_ROWS = {0: [(False, False)], 1: [(False, False), (True, False)], 2: [(False, False), (True, False)],
                3: [(False, False), (True, False), (False, True), (True, True)]}
CUSTOM = "your own number"


def offload_label(offload_optimizer: bool, offload_param: bool) -> str:
    return {(False, False): "none", (True, False): "optimizer", (False, True): "params",
            (True, True): "optimizer+params"}[(offload_optimizer, offload_param)]


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One line of the calculator: a stage and offload setting on a cluster (all from helpers.core.theory)."""

    stage: int
    offload_optimizer: bool
    offload_param: bool
    gpu: dict[str, float]  # model-state bytes one GPU keeps, by state
    offloaded_per_node: float  # bytes each node's CPU memory (or drive) holds for its GPUs
    largest_fitting: float | None  # parameters whose states fit one GPU's memory (None: nothing on the GPU)
    sent_per_step: float  # bytes each GPU sends per optimizer step (ring)
    comm_seconds: float  # predicted communication time per optimizer step
    deepspeed_estimate: float | None  # DeepSpeed's own estimator for the GPU (stages 2 and 3)

    @property
    def offload(self) -> str:
        return offload_label(self.offload_optimizer, self.offload_param)


def calculator_rows(psi: float, cluster: theory.Cluster, precision: str = "bf16", stages: Sequence[int] = theory.STAGES,
                    largest_layer: int = 0) -> list[PlanRow]:
    """Every stage (and its offload settings, :data:`OFFLOAD_ROWS`) for ``psi`` parameters on ``cluster``."""
    n, rows = cluster.world_size, []
    for stage in stages:
        sent = sum(theory.ring_bytes(op, size, n) for op, size in theory.step_collectives(psi, stage, precision))
        seconds = theory.comm_seconds_per_step(psi, stage, cluster, precision)
        for offload_optimizer, offload_param in OFFLOAD_ROWS[stage]:
            where = theory.placement(psi, stage, n, precision, offload_optimizer, offload_param)
            rows.append(PlanRow(
                stage, offload_optimizer, offload_param, where["gpu"],
                where["offloaded"]["total"] * cluster.gpus_per_node,
                theory.largest_model_that_fits(cluster.gpu_memory_bytes, stage, n, precision, offload_optimizer,
                                               offload_param),
                sent, seconds,
                theory.deepspeed_estimate_bytes(int(psi), stage, n, largest_layer, offload_optimizer, offload_param)))
    return rows


def format_count(n: float) -> str:
    """A parameter count in thousands, millions, billions or trillions, three significant digits."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale * 0.9995:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def format_seconds(s: float) -> str:
    """Seconds as s, ms or µs, three significant digits."""
    for unit, scale in (("s", 1), ("ms", 1e-3)):
        if s >= scale * 0.9995:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-6:.3g} µs"


def calculator_table(psi: float, cluster: theory.Cluster, precision: str = "bf16", stages: Sequence[int] = theory.STAGES,
                     largest_layer: int = 0, marked: tuple[int, bool, bool] | None = None, offload: bool = True,
                     sent_label: str = "sent/GPU/step") -> str:
    """The calculator as text: model states per GPU for every stage with and without offload, what the
    offload puts in each node's CPU memory, the largest model that fits a GPU, bytes each GPU sends
    per step (the paper's volume, headed ``sent_label``) and the predicted communication time; ``marked`` =
    (stage, offload optimizer, offload params) points at one row (the builder's config). Without ``offload``,
    only the rows without offload, and neither the offloaded bytes nor the largest model that fits."""
    link = cluster.link_bytes_per_s
    lines = [f"Ψ = {psi:,.0f} parameters, {precision}; {cluster.nodes} node(s) x {cluster.gpus_per_node} GPU(s) = "
             f"{cluster.world_size} ranks of {records.format_bytes(cluster.gpu_memory_bytes)}; link {link / 1e9:g} GB/s"
             + (" (stated default, not measured)" if link == theory.DEFAULT_LINK_BYTES_PER_S else ""),
             "model states only: activations, buffers and fragmentation come on top", ""]
    table = []
    for r in calculator_rows(psi, cluster, precision, stages, largest_layer):
        if not offload and r.offload != "none":
            continue
        total = r.gpu["total"]
        fits = "-" if r.largest_fitting is None else format_count(r.largest_fitting)
        mark = "◀" if marked == (r.stage, r.offload_optimizer, r.offload_param) else ""
        table.append([f"{r.stage}", *([r.offload] if offload else []), records.format_bytes(total),
                      f"{100 * total / cluster.gpu_memory_bytes:.0f}%",
                      *([records.format_bytes(r.offloaded_per_node), fits] if offload else []),
                      records.format_bytes(r.sent_per_step), format_seconds(r.comm_seconds),
                      "-" if r.deepspeed_estimate is None else records.format_bytes(r.deepspeed_estimate), mark])
    lines.append(records.format_table(table, ["ZeRO", *(["offload"] if offload else []), "GPU states", "of GPU",
                                              *(["offloaded/node", "fits up to"] if offload else []), sent_label,
                                              "comm time/step", "DeepSpeed est.", ""]))
    return "\n".join(line.rstrip() for line in "\n".join(lines).splitlines())


def _effective(stage: int, offload_optimizer: str, offload_param: str) -> tuple[int, bool, bool]:
    """A builder setting as the row the calculator lists for it (offload where DeepSpeed ignores it is none)."""
    return stage, offload_optimizer != "none" and stage >= 1, offload_param != "none" and stage == 3


class Calculator:
    """Model and cluster controls, and :func:`calculator_table` with its figure, recomputed on every change."""

    def __init__(self, preset: str = "7B", params: float | None = None, precision: str = "bf16", gpus_per_node: int = 8,
                 nodes: int = 1, gpu_memory_gib: float = 80, link_gb_per_s: float | None = None,
                 stages: Sequence[int] = theory.STAGES):
        if preset not in models.LLAMA_PRESETS and preset != CUSTOM:
            raise ValueError(f"preset {preset!r}: choose one of {', '.join(models.LLAMA_PRESETS)} or {CUSTOM!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        self.stages = tuple(stages)
        self.marked: tuple[int, bool, bool] | None = None
        style = {"description_width": "150px"}
        options = [(f"{name} ({format_count(shape.parameters())} parameters, LLaMA-style)", name)
                   for name, shape in models.LLAMA_PRESETS.items()]
        self.controls: dict[str, w.ValueWidget] = {
            "preset": w.Dropdown(options=options + [(CUSTOM, CUSTOM)], value=preset, description="model", style=style),
            "params_b": w.BoundedFloatText(value=params / 1e9 if params else 1.0, min=1e-6, max=1e5, step=0.1,
                                           description="parameters (billions)", style=style),
            "precision": w.Dropdown(options=PRECISIONS, value=precision, description="precision", style=style),
            "gpus_per_node": w.BoundedIntText(value=gpus_per_node, min=1, max=64, description="GPUs per node", style=style),
            "nodes": w.BoundedIntText(value=nodes, min=1, max=4096, description="nodes", style=style),
            "gpu_memory_gib": w.BoundedFloatText(value=gpu_memory_gib, min=1, max=4096, description="GPU memory (GiB)",
                                                 style=style),
            "link_gb_per_s": w.BoundedFloatText(value=link_gb_per_s or theory.DEFAULT_LINK_BYTES_PER_S / 1e9, min=0.01,
                                                max=1e5, description="link (GB/s per GPU)", style=style),
        }
        if params:
            self.controls["preset"].value = CUSTOM
        for key, control in self.controls.items():
            control.layout = w.Layout(width="360px")
            _classed(control, f"calc-{key.replace('_', '-')}")
            control.observe(lambda _: self.refresh(), names="value")
        self.table_view = _classed(w.HTML(), "calculator-table")
        self.plot = _classed(w.Image(format="png", layout=w.Layout(width="520px")), "calculator-plot")
        self.widget = _classed(w.VBox([w.HBox([w.VBox(list(self.controls.values()), layout=w.Layout(width="380px")),
                                               self.plot]), self.table_view]), "calculator")
        self.refresh()

    @property
    def psi(self) -> float:
        preset = self.controls["preset"].value
        return self.controls["params_b"].value * 1e9 if preset == CUSTOM else models.LLAMA_PRESETS[preset].parameters()

    @property
    def largest_layer(self) -> int:
        preset = self.controls["preset"].value
        return 0 if preset == CUSTOM else models.LLAMA_PRESETS[preset].largest_layer()

    @property
    def cluster(self) -> theory.Cluster:
        c = self.controls
        return theory.Cluster(c["gpus_per_node"].value, c["nodes"].value, c["gpu_memory_gib"].value * 2**30,
                              c["link_gb_per_s"].value * 1e9)

    @property
    def precision(self) -> str:
        return self.controls["precision"].value

    def rows(self) -> list[PlanRow]:
        return calculator_rows(self.psi, self.cluster, self.precision, self.stages, self.largest_layer)

    def table(self) -> str:
        return calculator_table(self.psi, self.cluster, self.precision, self.stages, self.largest_layer, self.marked)

    def mark(self, stage: int, offload_optimizer: str = "none", offload_param: str = "none") -> "Calculator":
        """Point at the row of a builder setting (◀)."""
        marked = _effective(stage, offload_optimizer, offload_param)
        if marked != self.marked:  # redraw only when the row moves
            self.marked = marked
            self.refresh()
        return self

    def set(self, **values: Any) -> "Calculator":
        """Change controls by name (``preset``, ``params_b``, ``precision``, ``gpus_per_node``, ``nodes``,
        ``gpu_memory_gib``, ``link_gb_per_s``), as a learner would."""
        for key, value in values.items():
            if key not in self.controls:
                raise ValueError(f"{key!r} is not a control of the calculator: use one of {', '.join(self.controls)}")
            self.controls[key].value = value
        return self

    def refresh(self) -> None:
        self.controls["params_b"].layout.display = None if self.controls["preset"].value == CUSTOM else "none"
        self.table_view.value = _pre(self.table())
        bars = [(f"ZeRO-{r.stage} {r.offload}" + (" ◀" if self.marked == (r.stage, r.offload_optimizer, r.offload_param)
                                                   else ""), r.gpu) for r in self.rows()]
        self.plot.value = plots.png(calculator_bars(bars, self.cluster.gpu_memory_bytes,
                                                         f"Model states per GPU, {self.psi / 1e9:.3g}B parameters"))

    def __repr__(self) -> str:
        preset = self.controls["preset"].value
        c = self.cluster
        return (f"Calculator: {preset + ' preset' if preset != CUSTOM else 'custom'} ({self.psi:,.0f} parameters, "
                f"{self.precision}) on {c.nodes} x {c.gpus_per_node} GPU(s) of {records.format_bytes(c.gpu_memory_bytes)}, "
                f"{c.link_bytes_per_s / 1e9:g} GB/s")

    def _repr_mimebundle_(self, **kwargs) -> dict:
        return _panel_repr(self.widget, repr(self))


def calculator(**values: Any) -> Calculator:
    """A :class:`Calculator`, e.g. ``calculator(preset="70B", nodes=4)`` or ``calculator(params=3e9)``."""
    return Calculator(**values)


def offload_calculator(preset: str = "7B", gpu_memory_gib: float = 80, gpus_per_node: int = 1, nodes: int = 1,
                       precision: str = "bf16") -> Calculator:
    """The calculator for the offload chapter: stages 1-3 with and without offload, one GPU by default, and
    the largest model whose states fit a GPU of ``gpu_memory_gib`` for each. Its checked twin is
    :func:`calculator_table` with the same arguments (``stages=(1, 2, 3)``)."""
    return Calculator(preset=preset, gpu_memory_gib=gpu_memory_gib, gpus_per_node=gpus_per_node, nodes=nodes,
                      precision=precision, stages=(1, 2, 3))


# --- 3. live runs ------------------------------------------------------------------------------

class LiveRun:
    """A progress bar, a loss plot that grows step by step, and the record as a small table at the end:
    a listener for :func:`helpers.core.launch.run`'s ``on_event``."""

    #: Seconds between two redraws of the plot (every step's loss is kept; only drawing is spaced out).
    REDRAW_S = 0.3

    def __init__(self):
        self.bar = _classed(w.IntProgress(value=0, min=0, max=1, description="", bar_style="info",
                                          layout=w.Layout(width="300px")), "progress")
        self.label = _classed(w.HTML("waiting for a launch"), "live-status")
        self.plot = _classed(w.Image(format="png", layout=w.Layout(display="none", width="560px")), "loss-plot")
        self.record_view = _classed(w.HTML(), "record")
        self.losses: dict[str, list[float]] = {}
        self.steps = 0
        self.events: list[dict] = []
        self._drawn = 0.0
        self.widget = _classed(w.VBox([w.HBox([self.bar, self.label]), self.plot, self.record_view]), "live")

    def on_event(self, event: dict) -> None:
        """Take one event of :data:`helpers.core.launch.EventListener`."""
        self.events.append(event)
        kind, name = event["event"], event["name"]
        if kind == "run_start":
            self.steps = event["steps"]
            self.losses[name] = []
            self.bar.max, self.bar.value, self.bar.bar_style = self.steps, 0, "info"
            self.label.value = f"<b>{html.escape(name)}</b>: starting"
            self.record_view.value = ""
        elif kind == "step":
            self.bar.value = event["step"]
            if event["loss"] is not None:
                self.losses[name].append(event["loss"])
            self.label.value = (f"<b>{html.escape(name)}</b>: step {event['step']}/{event['steps']}"
                                + (f", loss {event['loss']:.4f}" if event["loss"] is not None else ""))
            if time.monotonic() - self._drawn > self.REDRAW_S or event["step"] == event["steps"]:
                self.draw(name)
        elif kind == "done":
            self.bar.bar_style = "success"
            self.label.value = f"<b>{html.escape(name)}</b>: done, {self.steps} steps"
            self.draw(name)

    def draw(self, name: str) -> None:
        self._drawn = time.monotonic()
        self.plot.value = plots.png(plots.loss_curves({name: self.losses[name]}, title=f"{name}: loss, live",
                                                      steps=self.steps))
        self.plot.layout.display = None

    def show_record(self, record: records.Record, name: str) -> None:
        shown = environment.shown_path(record.out / "summary.json")
        self.record_view.value = (_pre(records.runs_table({name: record})) +
                                  f"<small>record: <code>{html.escape(str(shown))}</code>"
                                  + (f", launch to exit {record.wall_s:.1f} s" if record.wall_s else "") + "</small>")

    def show_failure(self, error: Exception) -> None:
        self.bar.bar_style = "danger"
        text = error.explain() if isinstance(error, launch.RunFailed) else str(error)
        self.record_view.value = f'<pre style="color:#cf222e">{html.escape(text)}</pre>'

    def __repr__(self) -> str:
        return "LiveRun: progress, loss and record of the next launch"

    def _repr_mimebundle_(self, **kwargs) -> dict:
        return _panel_repr(self.widget, repr(self))


def watch_run(config: str | Path | dict, live: LiveRun | None = None, **run_args: Any) -> records.Record:
    """:func:`helpers.core.launch.run` with a live view: progress bar and loss plot while it trains, its record as
    a table at the end. A new :class:`LiveRun` is displayed unless ``live`` is given. Raises what
    ``launch.run`` raises, after showing it."""
    if live is None:
        from IPython.display import display  # deferred: only in a notebook

        live = LiveRun()
        display(live)
    run_args.setdefault("progress", False)
    try:
        record = launch.run(config, on_event=live.on_event, **run_args)
    except (configs.ConfigError, launch.RunFailed, ValueError) as error:
        live.show_failure(error)
        raise
    live.show_record(record, record.out.name)
    return record


# --- 4. my runs --------------------------------------------------------------------------------

class MyRuns:
    """Every run record under ``runs/`` in one table, and the chosen ones' losses, memory and communication."""

    def __init__(self, folder: str | Path = launch.RUNS_DIR, selected: Sequence[str] | None = None, newest: int = 3):
        self.folder, self.newest = Path(folder), newest
        self.runs: dict[str, records.Record] = {}
        self.skipped: dict[str, str] = {}
        self.choice = _classed(w.SelectMultiple(description="compare", rows=8, layout=w.Layout(width="420px")),
                               "my-runs-choice")
        self.refresh_button = _classed(w.Button(description="Refresh", icon="refresh"), "my-runs-refresh")
        self.table_view = _classed(w.HTML(), "my-runs-table")
        self.plots = [_classed(w.Image(format="png", layout=w.Layout(width="460px")), f"my-runs-plot-{i}")
                      for i in range(3)]
        self.refresh_button.on_click(lambda _: self.refresh())
        self.choice.observe(lambda _: self.show(), names="value")
        self.widget = _classed(w.VBox([w.HBox([self.choice, self.refresh_button]), self.table_view,
                                       w.HBox(self.plots[:2]), self.plots[2]]), "my-runs")
        self.refresh(selected)

    def refresh(self, selected: Sequence[str] | None = None) -> None:
        """Read every ``summary.json`` again; choose ``selected``, else the ``newest`` runs."""
        self.runs, self.skipped = records.load_all(self.folder)
        by_age = sorted(self.runs, key=lambda n: (self.runs[n].out / "summary.json").stat().st_mtime, reverse=True)
        self.choice.options = sorted(self.runs)
        wanted = selected if selected is not None else by_age[:self.newest]
        self.choice.value = tuple(sorted(name for name in wanted if name in self.runs))
        self.show()

    def show(self) -> None:
        chosen = {name: self.runs[name] for name in self.choice.value}
        shown = environment.shown_path(self.folder)
        note = (f"<small>{len(self.runs)} run(s) in <code>{html.escape(str(shown))}</code>"
                + (f"; not training records: {html.escape(', '.join(self.skipped))}" if self.skipped else "")
                + "</small>")
        self.table_view.value = note + _pre(records.runs_table(self.runs)) if self.runs else note
        figures = [plots.loss_curves({n: r.losses for n, r in chosen.items()}, title="Chosen runs: loss")] if chosen else []
        with_states = [r for r in chosen.values() if "model_states" in r.probes]
        with_comm = [r for r in chosen.values() if "comm" in r.probes]
        if with_states:
            figures.append(plots.measured_vs_theory(with_states))
        if with_comm:
            figures.append(plots.comm_per_step(with_comm))
        for i, image in enumerate(self.plots):
            image.value = plots.png(figures[i]) if i < len(figures) else b""
            image.layout.display = None if i < len(figures) else "none"

    def __repr__(self) -> str:
        return f"MyRuns: the records under {self.folder.name}/"

    def _repr_mimebundle_(self, **kwargs) -> dict:
        return _panel_repr(self.widget, repr(self))


def my_runs(**kwargs: Any) -> MyRuns:
    """A :class:`MyRuns` view of ``runs/`` (every record the learner produced)."""
    return MyRuns(**kwargs)


# --- all together -----------------------------------------------------------------------------

class ConfigLab:
    """The builder with its live run, the calculator pointing at the builder's row, and my runs."""

    def __init__(self, builder: ConfigBuilder, calculator: Calculator, runs: MyRuns):
        self.builder, self.calculator, self.runs = builder, calculator, runs
        builder.listeners.append(lambda s: calculator.mark(s.stage, s.offload_optimizer, s.offload_param))
        builder.after_launch.append(lambda record: runs.refresh())  # a new record is listed at once
        builder.refresh()
        heading = lambda text: w.HTML(f"<h3 style='margin:6px 0'>{text}</h3>")  # noqa: E731
        self.widget = _classed(w.VBox([heading("1 · Build a DeepSpeed config, check it, launch it"), builder.widget,
                                       heading("2 · What it takes at scale: memory and communication"),
                                       calculator.widget, heading("3 · My runs"), runs.widget]), "lab")

    def __repr__(self) -> str:
        return f"ConfigLab\n  {self.builder!r}\n  {self.calculator!r}\n  {self.runs!r}"

    def _repr_mimebundle_(self, **kwargs) -> dict:
        return _panel_repr(self.widget, repr(self))


def config_lab(calculator_preset: str = "7B", **builder_values: Any) -> ConfigLab:
    """The whole interactive lab (``notebooks/17_config_lab.ipynb``): :func:`config_builder` (with
    ``builder_values``), :func:`calculator` and :func:`my_runs`, linked."""
    return ConfigLab(config_builder(**builder_values), Calculator(preset=calculator_preset), MyRuns())


# --- figures ----------------------------------------------------------------------------------------

def calculator_bars(rows: Sequence[tuple[str, Mapping[str, float]]], gpu_memory_bytes: float,
                   title: str = "Model states per GPU"):
    """Stacked horizontal bars of the model states one GPU keeps, one bar per (label, states) row (states as
    :func:`helpers.core.theory.placement` gives them), with the GPU's memory as a dashed line."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.32 * len(rows)))
    labelled: set[str] = set()
    for i, (label, states) in enumerate(rows):
        left = 0.0
        for key in records.MODEL_STATE_KEYS:
            value = states.get(key, 0) / 2**30
            if value:
                ax.barh(i, value, left=left, color=plots.STATE_COLOURS[key], label=None if key in labelled else key)
                labelled.add(key)
                left += value
    ax.axvline(gpu_memory_bytes / 2**30, color="black", linestyle="--", label="GPU memory")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GiB on one GPU")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- what the lab's figures mean: one printed sentence each, from the data --------------------------

def precision_note(builder_precision: str, calc: Calculator) -> str:
    """Say that the calculator's precision is its own control, whatever the builder trains in."""
    return (f"calculator precision: {calc.precision} (its own control: a model of "
            f"{format_count(calc.psi)} parameters trains in mixed precision); the builder's {builder_precision} "
            f"only moves the ◀ to its stage and offload")


def estimate_note(calc: Calculator, stage: int = 2) -> str:
    """Reconcile the paper's GPU states with DeepSpeed's estimator for ``stage`` without offload, in bytes per
    parameter read back from both figures (the estimator's extra is an fp32 gradient partition)."""
    row = next(r for r in calc.rows() if r.stage == stage and r.offload == "none")
    psi, n = calc.psi, calc.cluster.world_size
    whole = theory.bytes_per_element(calc.precision)  # the parameters every GPU keeps whole at stage 1-2
    paper = (row.gpu["total"] - whole * psi) * n / psi
    ours = (row.deepspeed_estimate - whole * psi) * n / psi
    return (f"ZeRO-{stage}, no offload: the paper's {whole}Ψ + {paper:.0f}Ψ/{n} = {records.format_bytes(row.gpu['total'])}; "
            f"DeepSpeed's estimator {whole}Ψ + {ours:.0f}Ψ/{n} = {records.format_bytes(row.deepspeed_estimate)}: its "
            f"{ours:.0f} partitioned bytes are the paper's {paper:.0f} plus a {ours - paper:.0f}-byte fp32 gradient, "
            f"the same copy that makes the offloaded/node column a lower bound")


def hiding_note(row: PlanRow, psi: float, cluster: theory.Cluster, peak_tflops: float | None = None) -> str:
    """Compare a row's communication time with computation: the tokens per step whose forward and backward
    (6Ψ FLOPs a token) take as long at the GPUs' peak (an H100's by default)."""
    if peak_tflops is None:
        peak_tflops = next(t for pattern, t, _ in performance.PEAK_BF16_DENSE_TFLOPS if pattern == "H100")
    tokens = row.comm_seconds * cluster.world_size * peak_tflops * 1e12 / (6 * psi)
    return (f"{format_seconds(row.comm_seconds)} is what {cluster.world_size} GPUs at {peak_tflops:g} TFLOP/s "
            f"(H100 bf16 peak) need to compute {format_count(tokens)} tokens (6Ψ FLOPs each): a global batch "
            f"smaller than that waits on the network even at peak")


def _straddling(model: str, world_size: int, rank: int = 0) -> tuple[str, int]:
    """The parameter that crosses the end of ``rank``'s partition of the flat parameter list (ZeRO-1/2
    partitions it in equal slices), and how many of its elements lie past that end."""
    end = -(-model_parameters(model) // world_size) * (rank + 1)
    start = 0
    for name, p in models.build(model).named_parameters():
        if start < end < start + p.numel():
            return name, start + p.numel() - end
        start += p.numel()
    return "", 0


def sent_note(record: records.Record) -> str | None:
    """Why a ZeRO-2 or ZeRO-3 run's bytes sent per step differ from the paper's: the collectives DeepSpeed makes,
    once per step or once per micro-step, and whether their ring bytes give the measured figure (else None)."""
    n, accum = record.world_size, record.grad_accum
    size = theory.bytes_per_element(record.precision) * record.params
    if record.stage == 2:
        predicted = accum * theory.ring_bytes("all_reduce", size, n) + theory.ring_bytes("all_gather", size, n)
        how = (f"DeepSpeed all-reduces the gradients (2(n-1)/n of them, not the paper's reduce-scatter, (n-1)/n) "
               f"once per micro-step, {accum} times a step, and all-gathers the parameters once per step")
    elif record.stage == 3:
        predicted = accum * theory.ring_bytes("reduce_scatter", size, n) + 2 * theory.ring_bytes("all_gather", size, n)
        how = (f"DeepSpeed reduce-scatters the gradients once per micro-step, {accum} times a step (the paper once "
               f"per step), and all-gathers the parameters twice per step, as the paper does")
    else:
        return None
    measured = record.comm.wire_bytes_per_step
    if n < 2:
        return (f"ZeRO-{record.stage} on one rank: a collective has no other rank to send to, so the ring sends "
                f"nothing (measured: {records.format_bytes(measured)} a step)")
    return (f"ZeRO-{record.stage} sent/step {records.format_ratio(measured, record.theory.comm_wire_bytes_per_step, suffix='x')} "
            f"the paper's: {how}; that predicts {records.format_bytes(predicted)}, within 1% of the measured: "
            f"{abs(measured / predicted - 1) < 0.01}")


def record_notes(record: records.Record) -> str:
    """One reason each for where a ZeRO-1/2 run's record departs from the paper: bytes sent per step
    (:func:`sent_note`), the master row, the gradients' ratio (each computed from the record, with whether it
    accounts for the gap)."""
    n = record.world_size
    lines = [note] if (note := sent_note(record)) else []
    states, paper = record.states(), record.theory_states
    if states.get("master") and not paper.get("master"):
        lines.append(f"master: DeepSpeed's ZeRO optimizer updates an fp32 copy of this rank's slice of the weights "
                     f"even when the model is fp32 ({states['master']:,} bytes = Ψ/{n} x 4); the paper's fp32 count "
                     f"has none")
    extra = states["grads"] - paper["grads"]
    if extra and record.stage in (1, 2):
        name, past = _straddling(record.model_name, n)
        element = theory.bytes_per_element(record.precision)
        lines.append(f"grads {states['grads'] / paper['grads']:.3f}x: {extra:,.0f} extra bytes; the parameter "
                     f"'{name}' straddles rank 0's partition boundary and {past:,} of its elements lie past it: "
                     f"rank 0 keeps those gradients too, the whole extra: {extra == past * element}")
    return "\n".join(lines)


def deepspeed_calls(functions: Sequence[Callable] | None = None,
                    calls: Sequence[str] = ("deepspeed.initialize(", "engine.backward(", "engine.step(")) -> str:
    """The statements that make ``calls`` in the source of ``functions`` (read from their files, not copied), with
    the file and function they are in: by default what a lab launch's ranks run (``helpers.core.train``)."""
    if functions is None:
        functions = (train.initialize, train.data_parallel_step)
    out = []
    for function in functions:
        lines, _ = inspect.getsourcelines(function)
        where = environment.shown_path(Path(inspect.getsourcefile(function)))
        i = 0
        while i < len(lines):
            if any(call in lines[i] for call in calls):
                statement = [lines[i].strip()]
                while statement[-1].count("(") + sum(s.count("(") for s in statement[:-1]) > \
                        sum(s.count(")") for s in statement):
                    i += 1
                    statement.append(lines[i].strip())
                out.append(f"{where}, {function.__name__}(): {' '.join(statement)}")
            i += 1
    return "\n".join(out)


def plain_command(config_path: str | Path, world_size: int, script: str = "my_train.py") -> str:
    """The ``deepspeed`` command that runs a saved config with a script of your own that reads
    ``--deepspeed_config`` (and passes it as ``deepspeed.initialize(..., config=args.deepspeed_config)``)."""
    shown = environment.shown_path(Path(config_path))
    return f"deepspeed --num_gpus {world_size} {script} --deepspeed_config {shown}"


# --- the lab's exercise ------------------------------------------------------------------------------

#: The exercise's answers: a stage, or "none" when no stage fits without offload.
STAGE_CHOICES = (*theory.STAGES, "none")


def exercise_smallest_stage(answer: Any, preset: str = "70B", gpus: int = 8, nodes: int = 2, gpu_gib: float = 40,
                            precision: str = "bf16") -> exercises.Verdict:
    """The smallest ZeRO stage, without offload, whose model states for ``preset`` fit one GPU of ``gpu_gib``
    GiB on ``nodes`` nodes of ``gpus`` GPUs, or ``"none"``, as the calculator computes it
    (``theory.placement``, the ZeRO paper's formulas)."""
    psi = models.LLAMA_PRESETS[preset].parameters()
    cluster = theory.Cluster(gpus_per_node=gpus, nodes=nodes, gpu_memory_bytes=gpu_gib * 2**30)
    rows = [r for r in calculator_rows(psi, cluster, precision) if r.offload == "none"]
    fitting = [r.stage for r in rows if r.gpu["total"] <= cluster.gpu_memory_bytes]
    states = ", ".join(f"ZeRO-{r.stage} {records.format_bytes(r.gpu['total'])}" for r in rows)
    task = (f"Which is the smallest ZeRO stage (0-3, no offload) whose model states for the {preset} preset "
            f"({psi:,} parameters, {precision} mixed precision) fit one GPU of {gpu_gib:g} GiB, on {nodes} node(s) of "
            f"{gpus} GPUs? Answer 'none' if no stage does.")
    return exercises.choice(
        "smallest stage", answer, min(fitting) if fitting else "none", choices=STAGE_CHOICES, task=task,
        hint="use the paper's model states per GPU (the GPU states column of section 2): the bytes per parameter "
             "of mixed precision, and which of them each stage divides by the number of GPUs, all GPUs of all nodes",
        why=f"Model states per GPU on {cluster.world_size} GPUs: {states}; the GPU holds "
            f"{records.format_bytes(cluster.gpu_memory_bytes)}"
            + ("." if fitting else ": even ZeRO-3 does not fit, so offload or more GPUs it is."))
