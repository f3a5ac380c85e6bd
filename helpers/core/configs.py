"""DeepSpeed configs: load them as DeepSpeed does, derive variants, and check them before a launch.

:func:`load` reads a config with DeepSpeed's own parser settings: hjson (comments, trailing commas
and unquoted keys are fine) and duplicate keys refused. :func:`check` returns every problem as a
:class:`Finding` naming the key, the rule and the fix, from three sources:

1. DeepSpeed's own validation: each section through DeepSpeed's config model for it (ZeRO, fp16,
   bf16, comms logger, monitors, tensor parallelism, compile: unknown keys and bad values, all of
   them), then the whole config through ``DeepSpeedConfig`` at the run's world size (the batch
   arithmetic, removed features, precision conflicts).
2. The course's rules for what DeepSpeed accepts but ignores, or only fails on at
   ``deepspeed.initialize`` or later (:data:`RULES` lists them with DeepSpeed's real outcome,
   each verified by a launch in ``tests/test_config_rules.py``).
3. The device: precisions DeepSpeed refuses here, NVMe offload without DeepSpeed's async I/O op,
   more ranks than GPUs.

:func:`helpers.core.launch.run` calls :func:`check` before any process starts, so a bad config fails in
a second with a readable message instead of after a launch with a stack trace from every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

from helpers.core.environment import REPO_ROOT, Environment, nvme_offload_support

CONFIG_DIR = REPO_ROOT / "ds_configs"

#: Top-level keys DeepSpeed 0.19 reads, with the JSON types it works with. DeepSpeed itself accepts any
#: other key silently (and keeps it unused), and checks no type until the value is used.
TOP_LEVEL_KEYS: dict[str, tuple[type, ...]] = {
    "train_batch_size": (int,), "train_micro_batch_size_per_gpu": (int,), "gradient_accumulation_steps": (int,),
    "optimizer": (dict,), "scheduler": (dict,), "zero_optimization": (dict,), "fp16": (dict,), "bf16": (dict,),
    "bfloat16": (dict,), "amp": (dict,), "torch_autocast": (dict,), "gradient_clipping": (int, float),
    "prescale_gradients": (bool,), "gradient_predivide_factor": (int, float),
    "communication_data_type": (str,), "seq_parallel_communication_data_type": (str,),
    "steps_per_print": (int,), "wall_clock_breakdown": (bool,), "memory_breakdown": (bool,), "dump_state": (bool,),
    "log_level": (str,), "comms_logger": (dict,), "flops_profiler": (dict,), "activation_checkpointing": (dict,),
    "zero_allow_untested_optimizer": (bool,), "zero_force_ds_cpu_optimizer": (bool,), "tensorboard": (dict,),
    "wandb": (dict,), "csv_monitor": (dict,), "comet": (dict,), "checkpoint": (dict,), "data_types": (dict,),
    "pipeline": (dict,), "autotuning": (dict,), "aio": (dict,), "data_efficiency": (dict,),
    "sequence_parallel_size": (int,), "disable_allgather": (bool,), "tensor_parallel": (dict,),
    "weight_quantization": (dict,), "compile": (dict,), "use_data_before_expert_parallelism": (bool,),
    "timers": (dict,), "gradient_accumulation_dtype": (str,),
}

JSON_TYPE_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
                   dict: "an object { }"}

#: What the course adds to every run's config: quiet logs. (Probes add what they need, such as the
#: comms logger: :attr:`helpers.core.probes.Probe.config`.)
RUN_DEFAULTS: dict[str, Any] = {"steps_per_print": 1_000_000}

#: The course's rules beyond DeepSpeed's parser: rule id -> what DeepSpeed 0.19.8 really does with such
#: a config (each verified by a launch in tests/test_config_rules.py).
RULES = {
    "unknown-key": "accepted silently; the setting has no effect",
    "wrong-type": "accepted by the parser; fails in deepspeed.initialize (e.g. TypeError comparing str and float)",
    "optimizer-type": "AssertionError in deepspeed.initialize: '<type> is not a supported DeepSpeed Optimizer'",
    "untested-optimizer": "AssertionError in deepspeed.initialize: 'You are using an untested ZeRO Optimizer'",
    "scheduler-type": "AssertionError in deepspeed.initialize: 'DeepSpeed does not recognize LR scheduler'",
    "zero-needs-optimizer": "AssertionError in deepspeed.initialize: 'zero stage N requires an optimizer'",
    "offload-client-optimizer": "ZeRORuntimeException in deepspeed.initialize (ZeRO-Offload with a client optimizer)",
    "offload-param-below-3": "accepted; parameters stay where they are (silently ignored)",
    "offload-optimizer-stage-0": "accepted; DeepSpeed builds its CPU Adam, but nothing is partitioned or offloaded",
    "nvme-below-3": "accepted; below ZeRO stage 3 DeepSpeed offloads the optimizer to CPU memory, not the drive",
    "nvme-path": "fails in deepspeed.initialize (AssertionError naming nvme_path, or a TypeError)",
    "nvme-aio": "fails when DeepSpeed builds its async_io op (libaio missing)",
    "client-and-config-optimizer": "accepted; DeepSpeed uses the client's optimizer and ignores the config's",
    "precision-device": "ValueError in deepspeed.initialize: 'Type fp16 is not supported on your device.'",
    "offload-torch-adam": "accepted; with optimizer offload DeepSpeed builds torch's AdamW and steps it on the CPU "
                          "instead of its own CPU Adam (in every precision)",
    "offload-optimizer-type": "accepted; an optimizer without a DeepSpeed CPU version is torch's, stepped on the CPU",
    "fp16-static-knobs": "accepted; with loss_scale > 0 the scale is static and the dynamic knobs do nothing",
    "fp16-hysteresis-stage-0": "accepted; at stage 0 every overflow halves the scale (FP16_Optimizer ignores hysteresis)",
    "fp16-min-above-initial": "accepted; the first overflow raises the scale to min_loss_scale instead of halving it",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem in a config: where it is, what rule it breaks, and how to fix it."""

    severity: str  # "error": DeepSpeed refuses or misbehaves; "warning": silently ignored or risky
    key: str
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.severity.upper()} {self.key}: {self.rule}\n    fix: {self.fix}"


class ConfigError(ValueError):
    """A config with errors; its message lists every finding."""

    def __init__(self, findings: list[Finding], source: str = "config"):
        self.findings = findings
        errors = [f for f in findings if f.severity == "error"]
        body = "\n".join(str(f) for f in findings)
        super().__init__(f"{source}: {len(errors)} error(s) found before launching\n{body}")


class ConfigFileError(ValueError):
    """A config file that cannot be read at all (missing, or not hjson/JSON)."""


def path_of(name: str | Path) -> Path:
    """``"zero2"`` or ``"zero2.json"`` -> ``ds_configs/zero2.json``; other paths are used as given."""
    path = Path(name)
    if path.exists():
        return path
    if path.suffix not in (".json", ".hjson"):
        path = path.with_suffix(".json")
    if not path.is_absolute() and not path.exists():
        path = CONFIG_DIR / path.name
    return path


def load(name: str | Path) -> dict:
    """Read a DeepSpeed config (a name in ``ds_configs/`` or a path) exactly as DeepSpeed reads a file.

    Raises FileNotFoundError for a missing file, :class:`ConfigFileError` for one that is not hjson, and :class:`ConfigError` for duplicate
    keys (which DeepSpeed refuses: ``ValueError: Duplicate keys in DeepSpeed config``).
    """
    import hjson  # deferred: only when a config file is read
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    path = path_of(name)
    if not path.exists():
        available = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
        raise FileNotFoundError(f"no DeepSpeed config {name!r} (looked for {path}); ds_configs/ has: {available}")
    duplicated: list[str] = []

    def refuse_duplicates(pairs: list) -> dict:  # DeepSpeed's own hook; remember which keys it refused
        keys = [key for key, _ in pairs]
        duplicated.extend(sorted({key for key in keys if keys.count(key) > 1}))
        return dict_raise_error_on_duplicate_keys(pairs)

    try:
        config = hjson.loads(path.read_text(), object_pairs_hook=refuse_duplicates)
    except hjson.HjsonDecodeError as error:
        raise ConfigFileError(f"{path}: not valid JSON or hjson ({error}); a DeepSpeed config is one object "
                              "{ ... } of settings") from None
    except ValueError as error:  # DeepSpeed's duplicate-key refusal
        raise ConfigError([Finding("error", key, f"appears more than once, and DeepSpeed refuses the file ({error})",
                                   f"keep one {key}") for key in duplicated], source=str(path)) from None
    return _plain(config)


def _plain(value: Any) -> Any:
    """hjson's ordered dicts as plain dicts (so configs compare and print like JSON)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def merged(config: dict, overrides: dict | None = None) -> dict:
    """A deep copy of ``config`` with ``overrides`` merged in (nested dicts merge, other values replace).

    A value of ``None`` removes the key: ``merged(c, {"train_batch_size": None})``.
    """
    result = copy.deepcopy(config)
    for key, value in (overrides or {}).items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def for_run(config: dict, needs: dict | None = None) -> dict:
    """The config a run uses: the course's defaults (quiet logs) and what its probes need (``needs``, from
    :func:`helpers.core.probes.config_for`: the comms logger for ``comm``), under ``config`` itself."""
    return merged(merged(RUN_DEFAULTS, needs), config)


def _is_type(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a number
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, types)


# --- 1. DeepSpeed's own validation ------------------------------------------------------------

def _section_validators() -> dict[str, Callable[[dict], Any]]:
    """Config section -> DeepSpeed's own function that builds (and validates) its config model."""
    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.comm.config import DeepSpeedCommsConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.runtime.precision_config import (
        get_bfloat16_config,
        get_float16_config,
    )
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config
    from deepspeed.runtime.zero.config import get_zero_config

    monitor = lambda key: (lambda section: get_monitor_config({key: section}))  # noqa: E731
    return {
        "zero_optimization": lambda section: get_zero_config({"zero_optimization": section}),
        "fp16": lambda section: get_float16_config({"fp16": section}),
        "bf16": lambda section: get_bfloat16_config({"bf16": section}),
        "bfloat16": lambda section: get_bfloat16_config({"bfloat16": section}),
        "comms_logger": lambda section: DeepSpeedCommsConfig({"comms_logger": section}),
        "tensor_parallel": lambda section: get_tensor_parallel_config({"tensor_parallel": section}),
        "compile": lambda section: CompileConfig(**section),
        **{key: monitor(key) for key in ("tensorboard", "wandb", "csv_monitor", "comet")},
    }


def _model_fields(section: str, path: list[str]) -> list[str]:
    """Field names of DeepSpeed's model for ``section`` (at ``path`` inside it), for "did you mean"."""
    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.runtime.precision_config import (
        DeepSpeedBF16Config,
        DeepSpeedFP16Config,
    )
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    models = {("zero_optimization",): DeepSpeedZeroConfig, ("fp16",): DeepSpeedFP16Config,
              ("bf16",): DeepSpeedBF16Config, ("zero_optimization", "offload_param"): DeepSpeedZeroOffloadParamConfig,
              ("zero_optimization", "offload_optimizer"): DeepSpeedZeroOffloadOptimizerConfig}
    model = models.get((section, *path))
    return list(model.model_fields) if model else []


def _section_findings(config: dict) -> list[Finding]:
    """Every error DeepSpeed's config models find, section by section (pydantic lists them all)."""
    findings = []
    for section, validate in _section_validators().items():
        if not isinstance(config.get(section), dict):
            continue
        try:
            validate(config[section])
        except Exception as error:  # pydantic's ValidationError: one entry per bad field
            entries = getattr(error, "errors", lambda: [])() or [{"loc": (), "msg": str(error)}]
            for entry in entries:
                loc = [str(part) for part in entry.get("loc", ())]
                if not loc:  # a check across fields: name the field its message names, if any
                    named = [f for f in _model_fields(section, []) if f in entry.get("msg", "")]
                    loc = [max(named, key=len)] if named else []
                key = ".".join([section, *loc])
                if entry.get("type") == "extra_forbidden":
                    close = difflib.get_close_matches(loc[-1], _model_fields(section, loc[:-1]), n=1)
                    fix = f"did you mean {close[0]!r}?" if close else "remove it"
                    findings.append(Finding("error", key, f"is not a {'.'.join([section, *loc[:-1]])} setting "
                                            "DeepSpeed knows (its config model refuses it)", fix))
                else:
                    message = entry.get("msg", str(error)).removeprefix("Assertion failed, ")
                    findings.append(Finding("error", key, f"DeepSpeed refuses it: {message}",
                                            "see DeepSpeed's config documentation for this setting"))
    return findings


def deepspeed_parse(config: dict, world_size: int) -> Exception | None:
    """Parse ``config`` with DeepSpeed's own ``DeepSpeedConfig`` as ``world_size`` ranks would, and return
    the exception it raises (None when it accepts the config). No process group is needed."""
    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.runtime import config as ds_config

    ranks = mock.Mock(get_rank=lambda *a, **k: 0, get_world_size=lambda *a, **k: world_size)
    try:
        with mock.patch.object(ds_config, "dist", ranks):
            ds_config.DeepSpeedConfig(copy.deepcopy(config))
    except Exception as error:  # noqa: BLE001 - any refusal is the answer
        return error
    return None


# --- 2. the course's rules --------------------------------------------------------------------

def _batch_findings(config: dict, world_size: int) -> list[Finding]:
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    values = {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum}
    for key, value in values.items():
        if value is not None and (not _is_type(value, (int,)) or value < 1):
            return [Finding("error", key, f"must be a positive whole number, got {type(value).__name__} {value!r}",
                            f"set {key} to e.g. 1")]
    findings = []
    if train is None and micro is None:
        findings.append(Finding("error", "train_batch_size",
                                "DeepSpeed needs train_batch_size or train_micro_batch_size_per_gpu",
                                "set train_micro_batch_size_per_gpu (samples per rank per micro-step)"))
    elif train is not None and micro is not None and accum is not None:
        if train != micro * accum * world_size:
            options = [f"set train_batch_size to {micro * accum * world_size}"]
            if train % (micro * world_size) == 0:
                options.append(f"or gradient_accumulation_steps to {train // (micro * world_size)}")
            options.append("or remove train_batch_size and let DeepSpeed compute it")
            tp = (config.get("tensor_parallel") or {}).get("autotp_size", 0) if isinstance(config.get("tensor_parallel"), dict) else 0
            counted = (f" (DeepSpeed counts all {world_size} ranks, although the {tp} ranks of each tensor-parallel "
                       f"group read the same samples: {micro * accum * world_size // tp} samples per step really)"
                       if isinstance(tp, int) and tp > 1 else "")
            findings.append(Finding(
                "error", "train_batch_size",
                f"must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, "
                f"but {train} != {micro} * {accum} * {world_size} = {micro * accum * world_size}{counted}",
                ", ".join(options)))
    elif train is not None:
        other, other_key = (micro, "train_micro_batch_size_per_gpu") if micro is not None else (accum, "gradient_accumulation_steps")
        divisor = (other or 1) * world_size
        if train % divisor:
            findings.append(Finding(
                "error", "train_batch_size",
                f"{train} is not divisible by {other_key} * world size = {divisor}, so DeepSpeed cannot derive the rest",
                f"use a train_batch_size that is a multiple of {divisor}"))
    return findings


def _top_level_findings(config: dict) -> list[Finding]:
    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    findings = []
    for key, value in config.items():
        if key in _REMOVED_TOP_LEVEL_CONFIG_KEYS:
            continue  # DeepSpeed's parser names these itself
        if key not in TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(key, TOP_LEVEL_KEYS, n=1, cutoff=0.6)
            fix = f"did you mean {close[0]!r}?" if close else "remove it"
            findings.append(Finding("error", key, "is not a key DeepSpeed reads: it would be accepted and silently "
                                    "ignored", fix))
        elif not _is_type(value, TOP_LEVEL_KEYS[key]) and key not in _BATCH_KEYS:
            wanted = " or ".join(JSON_TYPE_NAMES[t] for t in TOP_LEVEL_KEYS[key])
            findings.append(Finding("error", key, f"must be {wanted}, got {type(value).__name__} {value!r} "
                                    "(DeepSpeed accepts it, then fails when it uses the value)",
                                    f"write {key} as {wanted}"))
    return findings


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _optimizer_findings(config: dict, stage: int, client_optimizer: bool) -> list[Finding]:
    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    findings = []
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and not client_optimizer:
        kind = str(optimizer.get("type", ""))
        is_deepspeed = kind.lower() in DEEPSPEED_OPTIMIZERS
        is_torch = not is_deepspeed and getattr(torch.optim, kind, None) is not None
        if not (is_deepspeed or is_torch):
            choices = list(DEEPSPEED_OPTIMIZERS) + [n for n in dir(torch.optim) if n[:1].isupper()]
            close = difflib.get_close_matches(kind, choices, n=1) or difflib.get_close_matches(kind.lower(), choices, n=1)
            findings.append(Finding("error", "optimizer.type", f"{kind!r} is not an optimizer DeepSpeed builds "
                                    "(deepspeed.initialize raises)", f"use {close[0]!r}" if close else 'use "AdamW"'))
        elif is_torch and stage > 0 and not config.get("zero_allow_untested_optimizer"):
            findings.append(Finding("error", "optimizer.type", f"torch.optim.{kind} is untested with ZeRO: "
                                    "deepspeed.initialize refuses it",
                                    'set "zero_allow_untested_optimizer": true, or use "AdamW"'))
        if "max_grad_norm" in (optimizer.get("params") or {}):
            findings.append(Finding("error", "optimizer.params.max_grad_norm", "DeepSpeed refuses it as an optimizer "
                                    "parameter (ValueError)", 'remove it and set "gradient_clipping" instead'))
    if isinstance(optimizer, dict) and client_optimizer:
        findings.append(Finding("warning", "optimizer", "the script also passes its own optimizer: DeepSpeed uses "
                                "that one and ignores this section", "keep one: remove the config's optimizer, "
                                "or pass none to deepspeed.initialize"))
    if stage > 0 and not isinstance(optimizer, dict) and not client_optimizer:
        findings.append(Finding("error", "optimizer", f"ZeRO stage {stage} needs an optimizer, and neither the "
                                "config nor the script gives one (deepspeed.initialize raises)",
                                'add "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}'))
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        kind = str(scheduler.get("type", ""))
        if not hasattr(lr_schedules, kind) and not hasattr(torch.optim.lr_scheduler, kind):
            known = [n for n in dir(lr_schedules) if n[:1].isupper() and n.endswith(("LR", "Cycle", "Decay"))]
            close = difflib.get_close_matches(kind, known, n=1)
            findings.append(Finding("error", "scheduler.type", f"{kind!r} is not a scheduler DeepSpeed knows "
                                    "(deepspeed.initialize raises)", f"use {close[0]!r}" if close else
                                    f"use one of {', '.join(known)}"))
    return findings


def _offload_findings(zero: dict, stage: int, config: dict, client_optimizer: bool,
                      env: Environment | None) -> list[Finding]:
    findings = []
    param = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else {}
    optim = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    param_device, optim_device = param.get("device", "none"), optim.get("device", "none")
    if param_device != "none" and stage < 3:
        findings.append(Finding(
            "warning", "zero_optimization.offload_param",
            f"is ignored below stage 3 (stage is {stage}): DeepSpeed keeps all parameters where they are, silently",
            "remove offload_param, or use stage 3 to offload parameters"))
    if optim_device != "none" and stage == 0:
        findings.append(Finding(
            "warning", "zero_optimization.offload_optimizer",
            "does nothing at stage 0: DeepSpeed switches to its CPU Adam but partitions and offloads nothing",
            "set zero_optimization.stage to 1, 2 or 3 (or remove offload_optimizer)"))
    if optim_device != "none" and stage > 0 and client_optimizer and config.get("zero_force_ds_cpu_optimizer", True):
        findings.append(Finding(
            "error", "zero_optimization.offload_optimizer",
            "DeepSpeed refuses ZeRO-Offload with a client optimizer such as torch.optim.AdamW (ZeRORuntimeException)",
            "pass no optimizer to deepspeed.initialize and keep the config's \"optimizer\" section "
            "(DeepSpeed then builds its CPU Adam)"))
    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else None
    if optim_device != "none" and stage > 0 and optimizer is not None and not client_optimizer:
        findings += _offload_optimizer_findings(optimizer)
    for name, section, device in (("offload_param", param, param_device), ("offload_optimizer", optim, optim_device)):
        if device != "nvme":
            continue
        key = f"zero_optimization.{name}"
        if stage < 3:
            findings.append(Finding("warning", f"{key}.device", f"NVMe offload needs stage 3 (stage is {stage}): "
                                    "DeepSpeed silently keeps the offloaded states in CPU memory instead",
                                    "use stage 3 for NVMe offload, or say device \"cpu\""))
            continue
        if not section.get("nvme_path"):
            findings.append(Finding("error", f"{key}.nvme_path", "NVMe offload needs a folder on a fast drive "
                                    "(deepspeed.initialize fails without one)",
                                    f'set {key}.nvme_path, e.g. "runs/nvme"'))
        usable, reason = nvme_offload_support() if env is not None else (True, "")
        if not usable:
            findings.append(Finding("error", f"{key}.device", "NVMe offload needs DeepSpeed's async_io op, which "
                                    f"cannot be built here ({reason})",
                                    'install libaio (Debian: apt-get install libaio-dev), or use device "cpu"'))
    return findings


#: Optimizer types DeepSpeed runs on the CPU with its own kernels when the optimizer is offloaded.
CPU_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion")


def _offload_optimizer_findings(optimizer: dict) -> list[Finding]:
    """Optimizer offload wants DeepSpeed's CPU optimizers; torch's are accepted and step on the CPU, slowly."""
    kind = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
    outcome = ("DeepSpeed accepts it and steps torch's optimizer on the CPU, several times slower per step than its "
               "own CPU Adam (chapter 06 measures both)")
    if kind in ("adam", "adamw") and params.get("torch_adam"):
        return [Finding("warning", "optimizer.params.torch_adam", f"with offload_optimizer this builds torch's "
                        f"{optimizer.get('type')} instead of DeepSpeed's CPU Adam: {outcome}", "remove torch_adam")]
    if kind and kind not in CPU_OPTIMIZERS:
        return [Finding("warning", "optimizer.type", f"{optimizer.get('type')!r} has no DeepSpeed CPU version: with "
                        f"offload_optimizer {outcome}",
                        f'use "AdamW" (DeepSpeed\'s CPU Adam), or one of {", ".join(CPU_OPTIMIZERS)}')]
    return []


def _loss_scale_findings(config: dict, stage: int) -> list[Finding]:
    """fp16 loss-scaling knobs that do nothing, or not what their name says."""
    fp16 = config.get("fp16") if isinstance(config.get("fp16"), dict) else {}
    if not fp16.get("enabled"):
        return []
    findings = []
    dynamic_knobs = [k for k in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
                                 "consecutive_hysteresis") if k in fp16]
    loss_scale = fp16.get("loss_scale", 0)
    if isinstance(loss_scale, (int, float)) and loss_scale > 0 and dynamic_knobs:
        findings.append(Finding("warning", f"fp16.{dynamic_knobs[0]}", f"loss_scale is {loss_scale:g}, a static "
                                f"scale: {', '.join(dynamic_knobs)} steer only a dynamic scale, so here nothing",
                                'set "loss_scale": 0 for dynamic scaling, or remove the dynamic knobs'))
        return findings
    if stage == 0 and "hysteresis" in fp16 and fp16["hysteresis"] != 1:
        findings.append(Finding("warning", "fp16.hysteresis", "is ignored at ZeRO stage 0: DeepSpeed's FP16_Optimizer "
                                "halves the scale on every overflow", "use stage 1-3 for hysteresis, or set it to 1"))
    power, floor = fp16.get("initial_scale_power", 16), fp16.get("min_loss_scale", 1)
    if isinstance(power, int) and isinstance(floor, (int, float)) and floor > 2**power:
        findings.append(Finding("warning", "fp16.min_loss_scale", f"{floor:g} is above the initial scale "
                                f"2**{power} = {2**power:g}: the first overflow raises the scale to it",
                                f"set min_loss_scale to at most {2**power:g}, or raise initial_scale_power"))
    return findings


def _precision_findings(config: dict, world_size: int, env: Environment | None) -> list[Finding]:
    findings = []
    fp16 = config.get("fp16") if isinstance(config.get("fp16"), dict) else {}
    bf16 = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
    if fp16.get("enabled") and bf16.get("enabled"):
        findings.append(Finding("error", "fp16.enabled", "fp16 and bf16 cannot both be enabled (DeepSpeed's "
                                "parser refuses it)", "set one of fp16.enabled / bf16.enabled to false"))
    if env is not None:
        for name, section in (("fp16", fp16), ("bf16", bf16)):
            if section.get("enabled") and not env.supports(name):
                alternative = next((p for p in ("bf16", "fp16") if p != name and env.supports(p)), "fp32")
                fix = (f"set {name}.enabled to false; on this device use {alternative}"
                       + (" (\"bf16\": {\"enabled\": true})" if alternative == "bf16" else ""))
                findings.append(Finding("error", f"{name}.enabled",
                                        f"DeepSpeed refuses {name} on {env.device_name} "
                                        f"(ValueError: Type {name} is not supported on your device)", fix))
        if env.is_gpu and world_size > env.gpu_count:
            findings.append(Finding("warning", "(world size)",
                                    f"checked for {world_size} ranks, but this machine has {env.gpu_count} GPU(s)",
                                    f"launch it here with at most {env.gpu_count} ranks"))
    return findings


def _explained(error: Exception, findings: list[Finding]) -> bool:
    """Whether DeepSpeed's parser refusal is one the findings already name (its first refusal only)."""
    text, errors = str(error), [f for f in findings if f.severity == "error"]
    if "Check batch related parameters" in text:
        return any(f.key in _BATCH_KEYS for f in errors)
    if "cannot be simultaneously enabled" in text:
        return any(f.key == "fp16.enabled" for f in errors)
    if type(error).__name__ == "ValidationError":  # a section model: the section findings list each field
        return any(f.key.split(".")[0] in _section_validators() for f in errors)
    return any(f.key in text for f in errors)  # e.g. a value of the wrong type, named by its key


def check(config: dict, world_size: int, env: Environment | None = None, client_optimizer: bool = False) -> list[Finding]:
    """Every finding for ``config`` on ``world_size`` ranks (errors first).

    ``env`` (from :func:`helpers.core.environment.detect`) enables the device checks (fp16 on a CPU,
    NVMe, GPU count); ``client_optimizer=True`` says the script passes its own optimizer to
    ``deepspeed.initialize``, as the source article's does.
    """
    if not isinstance(config, dict):
        return [Finding("error", "(top level)", "a DeepSpeed config is a JSON object", "wrap the settings in { }")]
    findings = _top_level_findings(config) + _batch_findings(config, world_size) + _section_findings(config)
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", 0)
    stage = stage if isinstance(stage, int) and stage in (0, 1, 2, 3) else 0
    findings += _optimizer_findings(config, stage, client_optimizer)
    findings += _offload_findings(zero, stage, config, client_optimizer, env)
    findings += _loss_scale_findings(config, stage)
    findings += _precision_findings(config, world_size, env)
    refusal = deepspeed_parse(config, world_size)
    if refusal is not None and not _explained(refusal, findings):
        findings.append(Finding("error", "(DeepSpeed's parser)", f"{type(refusal).__name__}: {refusal}",
                                "change the setting it names"))
    return sorted(findings, key=lambda f: f.severity != "error")


def check_or_raise(config: dict, world_size: int, env: Environment | None = None, client_optimizer: bool = False,
                   source: str = "config") -> list[Finding]:
    """Run :func:`check`; raise :class:`ConfigError` if anything is an error, else return the warnings."""
    findings = check(config, world_size, env, client_optimizer)
    if any(f.severity == "error" for f in findings):
        raise ConfigError(findings, source)
    return findings


# --- DeepSpeed's defaults, line by line -----------------------------------------------------------

NO_DEFAULT = object()  # a key DeepSpeed has no default for (the batch sizes, the optimizer's type)


def _leaves(config: dict, prefix: str = "") -> list[tuple[str, Any]]:
    found = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found += _leaves(value, path + ".")
        else:
            found.append((path, value))
    return found


def deepspeed_defaults(config: dict) -> dict[str, Any]:
    """For each leaf of ``config`` ("zero_optimization.overlap_comm", ...), the value DeepSpeed uses when
    the line is absent: from DeepSpeed's own config models (at the config's ZeRO stage, whose defaults
    differ) and its ``*_DEFAULT`` constants; :data:`NO_DEFAULT` where there is none."""

    # deferred: DeepSpeed is imported after the course has chosen its accelerator
    from deepspeed.runtime import constants, lr_schedules
    from deepspeed.runtime.precision_config import (
        get_bfloat16_config,
        get_float16_config,
    )
    from deepspeed.runtime.zero.config import get_zero_config
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    sections = {
        "zero_optimization": get_zero_config({"zero_optimization": {"stage": zero.get("stage", 0)}}).model_dump(),
        "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig().model_dump(),
        "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig().model_dump(),
        "fp16": get_float16_config({"fp16": {}}).model_dump(),
        "bf16": get_bfloat16_config({"bf16": {}}).model_dump(),
    }
    scheduler = config.get("scheduler") if isinstance(config.get("scheduler"), dict) else {}
    scheduler_class = getattr(lr_schedules, str(scheduler.get("type")), None)
    if scheduler_class is not None:  # a DeepSpeed scheduler's keyword defaults
        sections["scheduler.params"] = {name: p.default for name, p in
                                        inspect.signature(scheduler_class).parameters.items()
                                        if p.default is not inspect.Parameter.empty}
    defaults = {}
    for path, _ in _leaves(config):
        section, _, key = path.rpartition(".")
        if section in sections and key in sections[section]:
            value = sections[section][key]
            defaults[path] = getattr(value, "value", value)  # enums (offload device) as their JSON value
        elif not section and hasattr(constants, f"{key.upper()}_DEFAULT"):
            defaults[path] = getattr(constants, f"{key.upper()}_DEFAULT")
        else:
            defaults[path] = NO_DEFAULT
    if "zero_optimization.stage" in defaults:
        defaults["zero_optimization.stage"] = 0
    return {path: NO_DEFAULT if value is None else value for path, value in defaults.items()}


def restates_default(config: dict) -> list[str]:
    """The lines of ``config`` whose value is what DeepSpeed uses anyway: removing them changes nothing."""
    defaults = deepspeed_defaults(config)
    return [path for path, value in _leaves(config)
            if defaults[path] is not NO_DEFAULT and value == defaults[path] and not isinstance(value, dict)]
