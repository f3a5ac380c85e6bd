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
   each verified by a launch in ``tests/test_config_rules.py``). ``optimizer.params`` and
   ``scheduler.params`` are checked against the classes DeepSpeed builds from them
   (:func:`optimizer_builder`): their signatures (unknown keys, types, required ones), and their
   constructors themselves, run on a stand-in parameter (the values they refuse).
3. The device: precisions DeepSpeed refuses here, NVMe offload without DeepSpeed's async I/O op,
   more ranks than GPUs; or, for a config meant for another machine, on that machine (:func:`target`:
   ``python -m helpers check --target cuda --gpus 8``), each such finding naming the target.

``"auto"`` is Hugging Face's placeholder, filled by its Trainer and by accelerate before DeepSpeed sees the
config: for plain ``deepspeed.initialize`` each one is a finding that says so and names the value to write; for
a config the Trainer starts (``starter="trainer"``, ``--for trainer``) the config is checked as the Trainer fills
it (:func:`trainer_fills`, transformers' own code).

:func:`helpers.core.launch.run` calls :func:`check` before any process starts, so a bad config fails in
a second with a readable message instead of after a launch with a stack trace from every rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import inspect
import json
import logging
import math
import re
import sys
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence
from unittest import mock

import torch

from helpers.core import ds
from helpers.core.environment import REPO_ROOT, Environment, nvme_offload_support
from helpers.core.environment import _cpu_precisions as cpu_precisions

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
    "zero-needs-optimizer": "AssertionError in deepspeed.initialize: 'zero stage N requires an optimizer' (stages 1-2)",
    "zero3-without-optimizer": "accepted by deepspeed.initialize (DeepSpeedZeRoOffload: ZeRO-3's parameter "
                               "partitioning, as for inference); the first backward fails: AttributeError, no "
                               "'set_gradient_accumulation_boundary'",
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
    # optimizer.params, against the class DeepSpeed builds (FusedAdam, DeepSpeedCPUAdam, torch's, ...)
    "optimizer-param-unknown": "TypeError in deepspeed.initialize: '__init__() got an unexpected keyword argument' "
                               "(or 'got multiple values for keyword argument' for one DeepSpeed passes itself)",
    "optimizer-param-type": "accepted until used: a TypeError or ValueError from the constructor or the first step "
                            "(FusedAdam: 'multi_tensor_adam(): incompatible function arguments'; betas [0.9]: "
                            "'not enough values to unpack')",
    "optimizer-param-refused": "raised by the optimizer's constructor in deepspeed.initialize (torch: 'ValueError: "
                               "Invalid learning rate'; FusedAdam, CPU Adam: 'does not support the AMSGrad variant')",
    "optimizer-param-unchecked": "accepted: DeepSpeed's own kernels check no range (a negative lr climbs the loss, "
                                 "beta2 = 1 makes the parameters NaN at the first step), where torch's class refuses",
    "optimizer-param-ignored": "accepted; DeepSpeed takes the key out and builds the same optimizer whatever its value "
                               "(adam_w_mode with AdamW, fp32_optimizer_states without optimizer offload)",
    "adam-is-adamw": "accepted; \"Adam\" with weight decay builds what \"AdamW\" builds (decoupled weight decay) "
                     "unless adam_w_mode is false",
    # scheduler.params, against the scheduler class DeepSpeed builds (its own, or torch's)
    "scheduler-param-unknown": "TypeError in deepspeed.initialize: 'got an unexpected keyword argument'",
    "scheduler-param-missing": "TypeError in deepspeed.initialize: 'missing 1 required positional argument'",
    "scheduler-param-type": "fails when the scheduler is built or steps (warmup_num_steps 10.0: 'ValueError: "
                            "warmup_num_steps must be a positive integer'; a string lr: 'TypeError: unsupported "
                            "operand')",
    "scheduler-param-refused": "ValueError from the scheduler's constructor in deepspeed.initialize "
                               "(warmup_num_steps 0: 'must be a positive integer, got 0')",
    "scheduler-warns": "accepted with a logged warning (an unknown warmup_type runs as log; total_num_steps below "
                       "warmup_num_steps)",
    "scheduler-param-replaced": "accepted; the scheduler silently uses another value (warmup_num_steps 1 runs as 2)",
    "scheduler-ignores-lr": "accepted; the scheduler sets every step's lr from its own parameters (WarmupDecayLR: "
                            "warmup_max_lr, default 0.001), so the optimizer's lr is never used",
    # settings that turn a feature off, or that nothing reads
    "gradient-clipping-off": "accepted; 0 or less clips nothing (without the key DeepSpeed clips at 1.0)",
    "fp16-without-enabled": "accepted; without \"enabled\" fp16 is off (the default) and its loss-scaling knobs are "
                            "never read: the run is fp32",
    "fp16-auto-cast-off": "accepted by deepspeed.initialize; the first forward fails (fp16 inputs, fp32 weights): "
                          "auto_cast casts the inputs although fp16 is off",
    "zero-knobs-stage-0": "accepted; at stage 0 no ZeRO optimizer reads overlap_comm, contiguous_gradients, "
                          "reduce_scatter, reduce_bucket_size or round_robin_gradients (the same collectives)",
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
    dict_raise_error_on_duplicate_keys = ds.load("deepspeed.runtime.config_utils").dict_raise_error_on_duplicate_keys

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
    DeepSpeedCommsConfig = ds.load("deepspeed.comm.config").DeepSpeedCommsConfig
    CompileConfig = ds.load("deepspeed.compile.config").CompileConfig
    get_monitor_config = ds.load("deepspeed.monitor.config").get_monitor_config
    precision = ds.load("deepspeed.runtime.precision_config")
    get_tensor_parallel_config = ds.load("deepspeed.runtime.tensor_parallel.config").get_tensor_parallel_config
    get_zero_config = ds.load("deepspeed.runtime.zero.config").get_zero_config

    monitor = lambda key: (lambda section: get_monitor_config({key: section}))  # noqa: E731
    return {
        "zero_optimization": lambda section: get_zero_config({"zero_optimization": section}),
        "fp16": lambda section: precision.get_float16_config({"fp16": section}),
        "bf16": lambda section: precision.get_bfloat16_config({"bf16": section}),
        "bfloat16": lambda section: precision.get_bfloat16_config({"bfloat16": section}),
        "comms_logger": lambda section: DeepSpeedCommsConfig({"comms_logger": section}),
        "tensor_parallel": lambda section: get_tensor_parallel_config({"tensor_parallel": section}),
        "compile": lambda section: CompileConfig(**section),
        **{key: monitor(key) for key in ("tensorboard", "wandb", "csv_monitor", "comet")},
    }


def _model_fields(section: str, path: list[str]) -> list[str]:
    """Field names of DeepSpeed's model for ``section`` (at ``path`` inside it), for "did you mean"."""
    precision = ds.load("deepspeed.runtime.precision_config")
    zero = ds.load("deepspeed.runtime.zero.config")
    offload = ds.load("deepspeed.runtime.zero.offload_config")

    models = {("zero_optimization",): zero.DeepSpeedZeroConfig, ("fp16",): precision.DeepSpeedFP16Config,
              ("bf16",): precision.DeepSpeedBF16Config,
              ("zero_optimization", "offload_param"): offload.DeepSpeedZeroOffloadParamConfig,
              ("zero_optimization", "offload_optimizer"): offload.DeepSpeedZeroOffloadOptimizerConfig}
    model = models.get((section, *path))
    return list(model.model_fields) if model else []


def _section_findings(config: dict) -> list[Finding]:
    """Every error DeepSpeed's config models find, section by section (pydantic lists them all)."""
    findings = []
    for section, validate in _section_validators().items():
        if not isinstance(config.get(section), dict):
            continue
        try:
            with _captured_messages() as messages:
                validate(config[section])
            for message in dict.fromkeys(messages):  # DeepSpeed's deprecation warnings, each naming its key
                named = re.match(r"Config parameter (\w+) is deprecated", message)
                if named:
                    findings.append(Finding("warning", f"{section}.{named[1]}", f"DeepSpeed accepts it and warns: "
                                            f"{message.strip()}", "write the setting DeepSpeed's message names"))
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


def deepspeed_parse(config: dict, world_size: int, device: str | None = None) -> Exception | None:
    """Parse ``config`` with DeepSpeed's own ``DeepSpeedConfig`` as ``world_size`` ranks would, and return
    the exception it raises (None when it accepts the config). No process group is needed. ``device``: the
    accelerator the parser's device checks ask about (GPUDirect Storage needs "cuda"), by default this machine's."""
    ds_config = ds.load("deepspeed.runtime.config")
    aio_config = ds.load("deepspeed.runtime.swap_tensor.aio_config")

    ranks = mock.Mock(get_rank=lambda *a, **k: 0, get_world_size=lambda *a, **k: world_size)
    accelerator = mock.Mock(device_name=lambda *a: device)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_captured_messages())  # its deprecation warnings: the section findings name them
            stack.enter_context(mock.patch.object(ds_config, "dist", ranks))
            if device is not None:
                stack.enter_context(mock.patch.object(aio_config, "get_accelerator", lambda: accelerator))
            ds_config.DeepSpeedConfig(copy.deepcopy(config))
    except Exception as error:  # noqa: BLE001 - any refusal is the answer
        return error
    return None


def refusal(config: dict, world_size: int, *, warnings: bool = False, parse: bool = False) -> str | None:
    """Why ``config`` would not do on ``world_size`` ranks, in one sentence, or None: the course's checker's
    errors (its warnings too with ``warnings``; each finding ``key: rule``), then, with ``parse``, DeepSpeed's own
    refusal (:func:`deepspeed_parse`). For the exercises that ask a learner to write a config."""
    findings = [f for f in check(config, world_size) if warnings or f.severity == "error"]
    if findings:
        return "the checker finds: " + "; ".join(
            f"{f.severity + ' ' if warnings else ''}{f.key}: {f.rule}" for f in findings) + "."
    refused = deepspeed_parse(config, world_size) if parse else None
    if refused is not None:
        return f"DeepSpeed refuses it on {world_size} rank(s): {str(refused).splitlines()[0]}."
    return None


def zero_section(block: dict) -> Any:
    """A ``zero_optimization`` block as DeepSpeed reads it: its ``DeepSpeedZeroConfig`` (pydantic, with DeepSpeed's
    defaults filled in). Raises ValueError with DeepSpeed's own refusal (the first lines of its message)."""
    DeepSpeedZeroConfig = ds.load("deepspeed.runtime.zero.config").DeepSpeedZeroConfig

    if not isinstance(block, dict):
        raise ValueError(f"{type(block).__name__} is not a block: write a dict, {{\"stage\": 3, ...}}")
    try:
        return DeepSpeedZeroConfig(**block)
    except Exception as error:  # noqa: BLE001 - any refusal is the answer
        lines = [line.strip() for line in str(error).splitlines()[1:3]]
        raise ValueError(f"DeepSpeed refuses the block: {': '.join(lines) or error}") from None


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
    sequence = config.get("sequence_parallel_size", 1)
    if _is_type(sequence, (int,)) and sequence > 1:
        if world_size % sequence:
            return [Finding("error", "sequence_parallel_size",
                            f"{sequence} does not divide the {world_size} ranks into whole sequence-parallel groups",
                            f"use a divisor of {world_size} (or launch a multiple of {sequence} ranks)")]
        # the ranks of one sequence-parallel group share each sample: DeepSpeed counts the groups
        world_size //= sequence
    groups = (f" (with sequence_parallel_size {sequence}, DeepSpeed's world size counts the {world_size} "
              f"sequence-parallel groups, not the ranks)" if _is_type(sequence, (int,)) and sequence > 1 else "")
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
                f"but {train} != {micro} * {accum} * {world_size} = {micro * accum * world_size}{counted}{groups}",
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
    _REMOVED_TOP_LEVEL_CONFIG_KEYS = ds.load("deepspeed.runtime.config")._REMOVED_TOP_LEVEL_CONFIG_KEYS

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
    lr_schedules = ds.load("deepspeed.runtime.lr_schedules")
    DEEPSPEED_OPTIMIZERS = ds.load("deepspeed.runtime.config").DEEPSPEED_OPTIMIZERS

    findings = []
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and not client_optimizer:
        kind = str(optimizer.get("type", ""))
        is_deepspeed = kind.lower() in DEEPSPEED_OPTIMIZERS
        is_torch = not is_deepspeed and getattr(torch.optim, kind, None) is not None
        if not (is_deepspeed or is_torch):
            choices = list(DEEPSPEED_OPTIMIZERS) + [n for n in dir(torch.optim) if n[:1].isupper()]
            close = difflib.get_close_matches(kind, choices, n=1) or difflib.get_close_matches(kind.lower(), choices, n=1)
            removed = REMOVED_OPTIMIZERS.get(kind.lower())
            findings.append(Finding(
                "error", "optimizer.type", f"{kind!r} is not an optimizer DeepSpeed builds (deepspeed.initialize "
                "raises)" + (f": DeepSpeed removed {removed[0]} with its other 1-bit optimizers in pull request "
                             f"deepspeedai/DeepSpeed#8490 (tracking issue {REMOVED_FEATURES_ISSUE}); "
                             f"{_deepspeed_version()} has none" if removed else ""),
                f'use "{removed[1]}" (what {removed[0]} runs without its compressed communication)' if removed
                else f"use {close[0]!r}" if close else 'use "AdamW"'))
        elif is_torch and stage > 0 and not config.get("zero_allow_untested_optimizer"):
            findings.append(Finding("error", "optimizer.type", f"torch.optim.{kind} is untested with ZeRO: "
                                    "deepspeed.initialize refuses it",
                                    'set "zero_allow_untested_optimizer": true, or use "AdamW"'))
        if is_deepspeed or is_torch:
            findings += _optimizer_param_findings(config)
        if isinstance(optimizer.get("params"), dict) and "max_grad_norm" in optimizer["params"]:
            findings.append(Finding("error", "optimizer.params.max_grad_norm", "DeepSpeed refuses it as an optimizer "
                                    "parameter (ValueError)", 'remove it and set "gradient_clipping" instead'))
    if isinstance(optimizer, dict) and client_optimizer:
        findings.append(Finding("warning", "optimizer", "the script also passes its own optimizer: DeepSpeed uses "
                                "that one and ignores this section", "keep one: remove the config's optimizer, "
                                "or pass none to deepspeed.initialize"))
    if 0 < stage < 3 and not isinstance(optimizer, dict) and not client_optimizer:
        findings.append(Finding("error", "optimizer", f"ZeRO stage {stage} needs an optimizer, and neither the "
                                "config nor the script gives one (deepspeed.initialize raises)",
                                'add "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}'))
    elif stage == 3 and not isinstance(optimizer, dict) and not client_optimizer:
        findings.append(Finding("warning", "optimizer", "neither the config nor the script gives an optimizer: "
                                "deepspeed.initialize builds ZeRO-3's parameter partitioning alone (for inference), "
                                "and training fails at the first backward (AttributeError)",
                                'to train, add "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}'))
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        kind = str(scheduler.get("type", ""))
        if not hasattr(lr_schedules, kind) and not hasattr(torch.optim.lr_scheduler, kind):
            known = [n for n in dir(lr_schedules) if n[:1].isupper() and n.endswith(("LR", "Cycle", "Decay"))]
            close = difflib.get_close_matches(kind, known, n=1)
            findings.append(Finding("error", "scheduler.type", f"{kind!r} is not a scheduler DeepSpeed knows "
                                    "(deepspeed.initialize raises)", f"use {close[0]!r}" if close else
                                    f"use one of {', '.join(known)}"))
        else:
            findings += _scheduler_param_findings(config, client_optimizer)
    return findings


#: DeepSpeed's removed 1-bit optimizers: the type a config named them by (any case, as DeepSpeed read it) ->
#: (their name, the optimizer with the same update and no compression).
REMOVED_OPTIMIZERS = {"onebitadam": ("1-bit Adam", "Adam"), "zerooneadam": ("0/1 Adam", "Adam"),
                      "onebitlamb": ("1-bit LAMB", "Lamb")}
#: DeepSpeed's tracking issue for the features it removed (its config parser's messages link to it).
REMOVED_FEATURES_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"


def _deepspeed_version() -> str:
    return ds.load().__version__


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
        usable, reason = nvme_offload_support() if env is not None and not isinstance(env, Target) else (True, "")
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
    outcome = ("DeepSpeed accepts it and steps torch's optimizer on the CPU instead of its own CPU Adam (chapter 06 "
               "times DeepSpeed's CPU Adam against torch's AdamW, default and fused, on this machine)")
    if kind in ("adam", "adamw") and params.get("torch_adam"):
        return [Finding("warning", "optimizer.params.torch_adam", f"with offload_optimizer this builds torch's "
                        f"{optimizer.get('type')} instead of DeepSpeed's CPU Adam: {outcome}", "remove torch_adam")]
    if kind and kind not in CPU_OPTIMIZERS:
        return [Finding("warning", "optimizer.type", f"{optimizer.get('type')!r} has no DeepSpeed CPU version: with "
                        f"offload_optimizer {outcome}",
                        f'use "AdamW" (DeepSpeed\'s CPU Adam), or one of {", ".join(CPU_OPTIMIZERS)}')]
    return []


# --- the optimizer's and the scheduler's parameters, against the classes DeepSpeed builds from them -----

@dataclasses.dataclass(frozen=True)
class OptimizerBuilder:
    """What ``deepspeed.initialize`` builds from a config's optimizer section:
    ``cls(model_parameters, **params, **passed)`` once DeepSpeed has taken the keys ``taken`` out of
    ``params``. ``counterpart`` is torch's class with the same update rule when ``cls`` is one of
    DeepSpeed's own kernels (FusedAdam, CPU Adam, ...), which check none of their arguments."""

    cls: type
    passed: dict[str, Any]
    taken: frozenset[str]
    counterpart: type | None

    def builds(self) -> str:
        """``FusedAdam(adam_w_mode=True)``: the class and what DeepSpeed passes it besides the parameters."""
        return f"{self.cls.__name__}({', '.join(f'{k}={v!r}' for k, v in self.passed.items())})"


def optimizer_builder(config: dict) -> OptimizerBuilder | None:
    """The optimizer DeepSpeed 0.19.8's ``_configure_basic_optimizer`` builds from ``config["optimizer"]``,
    with the same choices (type, ``torch_adam``, ``adam_w_mode``, optimizer offload); for Adam and AdamW
    DeepSpeed's own ``get_optimizer_configuration`` makes them. None for a type it does not build from the
    config alone (unknown, MuP's, Muon)."""
    ds_config = ds.load("deepspeed.runtime.config")

    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    name = str(optimizer.get("type", ""))
    kind = name.lower()
    given = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
    params = dict(given)
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    on_cpu = offload.get("device") in ("cpu", "nvme")  # the engine's zero_use_cpu_optimizer()
    torch_names = {n.lower(): n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)}
    counterpart = getattr(torch.optim, torch_names.get(kind, ""), None)
    passed: dict[str, Any] = {}
    if kind in (ds_config.ADAM_OPTIMIZER, ds_config.ADAMW_OPTIMIZER):
        DeepSpeedEngine = ds.load("deepspeed.runtime.engine").DeepSpeedEngine

        adam_w_mode = params.pop(ds_config.ADAM_W_MODE, ds_config.ADAM_W_MODE_DEFAULT)
        bf16 = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
        zenflow = zero.get("zenflow") if isinstance(zero.get("zenflow"), dict) else None
        engine = types.SimpleNamespace(  # what get_optimizer_configuration asks of the engine
            zero_use_cpu_optimizer=lambda: on_cpu,
            bf16_optimizer_states=lambda: bool(bf16.get("bf16_optimizer_states")),
            zenflow=zenflow is not None, overlap_step=(zenflow or {}).get("overlap_step", False))
        effective_adam_w_mode = kind == ds_config.ADAMW_OPTIMIZER or adam_w_mode  # as _configure_basic_optimizer has it
        try:
            cls, passed = DeepSpeedEngine.get_optimizer_configuration(engine, params, effective_adam_w_mode)
        except (AttributeError, TypeError):  # a DeepSpeed that asks the engine for more: check nothing, never crash
            return None
    elif kind == ds_config.ADAGRAD_OPTIMIZER:
        DeepSpeedCPUAdagrad = ds.load("deepspeed.ops.adagrad").DeepSpeedCPUAdagrad

        cls = DeepSpeedCPUAdagrad if on_cpu else torch.optim.Adagrad
    elif kind == ds_config.LAMB_OPTIMIZER:
        FusedLamb = ds.load("deepspeed.ops.lamb").FusedLamb

        cls = FusedLamb
    elif kind == ds_config.LION_OPTIMIZER:
        lion = ds.load("deepspeed.ops.lion")
        cls = lion.DeepSpeedCPULion if on_cpu else lion.FusedLion
    elif kind in ds_config.DEEPSPEED_OPTIMIZERS:
        return None  # MuP's (another package) and Muon (parameter groups of its own)
    else:
        cls = getattr(torch.optim, name, None)
        if not isinstance(cls, type):
            return None
    own = cls.__module__.startswith("deepspeed.")
    return OptimizerBuilder(cls, dict(passed), frozenset(given) - frozenset(params), counterpart if own else None)


def _signature(function: Callable) -> inspect.Signature:
    """``function``'s signature, with annotations resolved where Python can."""
    try:
        return inspect.signature(function, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: keep them as text
        return inspect.signature(function)


def _keywords(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword parameters ``cls(first, **keywords)`` takes, the first argument (the parameters to optimize,
    or the optimizer) left out. A constructor that ends in ``**kwargs`` (and ``*args``) hands them on to the next
    ``__init__`` of its class hierarchy, as ``super().__init__(*args, **kwargs)`` does: its keywords are followed
    there (``ZenFlowCPUAdam(*args, overlap_step=False, **kwargs)`` takes DeepSpeedCPUAdam's lr, betas, ...)."""
    owners = [owner for owner in cls.__mro__ if "__init__" in vars(owner) and owner is not object]
    if not owners:
        return {}
    found: dict[str, inspect.Parameter] = {}
    for index, owner in enumerate(owners):
        signature = _signature(cls) if index == 0 else _signature(owner.__init__)
        parameters = list(signature.parameters.values())[0 if index == 0 else 1:]  # an __init__'s self
        named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if named and named[0].kind is named[0].POSITIONAL_OR_KEYWORD:
            named = named[1:]  # this level's first positional argument: the parameters (or the optimizer)
        for parameter in named:
            found.setdefault(parameter.name, parameter)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break  # the keywords stop here
    return found


def _annotated_type(annotation: Any) -> tuple[str, Callable[[Any], bool]] | None:
    """The JSON values a constructor's annotation allows (a tensor cannot come from JSON, so a
    ``float | Tensor`` is a number); None where the annotation says nothing JSON can be checked against."""

    simple = {bool: ("true or false", lambda v: isinstance(v, bool)),
              int: ("a whole number", lambda v: _is_type(v, (int,))),
              float: ("a number", lambda v: _is_type(v, (int, float))),
              str: ("a string", lambda v: isinstance(v, str)),
              type(None): ("null", lambda v: v is None)}
    if annotation in simple:
        return simple[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return (" or ".join(repr(a) for a in args), lambda v: v in args)
    if origin in (typing.Union, types.UnionType):
        arms = [_annotated_type(a) for a in args if a is not torch.Tensor]
        if not arms or None in arms:
            return None
        return (" or ".join(d for d, _ in arms), lambda v: any(accepts(v) for _, accepts in arms))
    if origin in (tuple, list) and args and Ellipsis not in args:
        arms = [_annotated_type(a) for a in args]
        if None in arms:
            return None
        if origin is list:
            return (f"a list of {_plural(arms[0][0])}", lambda v: isinstance(v, list) and all(arms[0][1](x) for x in v))
        same = len({d for d, _ in arms}) == 1
        return (f"a list of {len(arms)} {_plural(arms[0][0])}" if same else
                f"a list of {len(arms)}: {', '.join(d for d, _ in arms)}",
                lambda v: isinstance(v, (list, tuple)) and len(v) == len(arms)
                and all(accepts(x) for (_, accepts), x in zip(arms, v)))
    return None


def _plural(description: str) -> str:
    """"a number" -> "numbers" (for "a list of 2 numbers")."""
    return f"{description.removeprefix('a ')}s" if description.startswith("a ") and " or " not in description \
        else f"values ({description})"


def _expected_type(parameter: inspect.Parameter, per_group: bool = False) -> tuple[str, Callable[[Any], bool]] | None:
    """The JSON values ``parameter`` takes: from its annotation, else (DeepSpeed's kernels declare no types)
    from its default; ``per_group``: a number may also be a list, one per parameter group."""
    default = parameter.default
    if parameter.annotation is not inspect.Parameter.empty:
        expected = _annotated_type(parameter.annotation)
    elif isinstance(default, bool):
        expected = _annotated_type(bool)
    elif isinstance(default, (int, float)):
        expected = _annotated_type(float)  # weight_decay=0 is a number, not a count
    elif isinstance(default, str):
        expected = _annotated_type(str)
    elif isinstance(default, tuple) and default and all(_is_type(x, (int, float)) for x in default):
        expected = _annotated_type(tuple[tuple(float for _ in default)])
    else:
        expected = None
    if expected is None:
        return None
    description, accepts = expected
    if per_group and description == "a number":
        description, accepts = ("a number or a list of numbers (one per parameter group)",
                                lambda v: _is_type(v, (int, float)) or (isinstance(v, list) and v
                                                                       and all(_is_type(x, (int, float)) for x in v)))
    if default is None and not accepts(None):
        return (f"{description} or null", lambda v: v is None or accepts(v))
    return description, accepts


class _KernelsReached(Exception):
    """Raised where a DeepSpeed optimizer's constructor starts using the machine (its compiled op, the CPU)."""


def _reach_kernels(*args: Any, **kwargs: Any) -> Any:
    raise _KernelsReached


@contextlib.contextmanager
def _stopped_at_kernels(cls: type):
    """Run a DeepSpeed optimizer's constructor only up to where it loads its op or reads the CPU's
    features: what it checks before that, it checks for any machine; nothing is built or loaded."""
    stub = type("NotLoaded", (), {"__init__": lambda self, *a, **k: None, "load": _reach_kernels})
    with contextlib.ExitStack() as stack:
        for owner in cls.__mro__:
            module = sys.modules.get(owner.__module__)
            if module is not None and owner.__module__.startswith("deepspeed."):
                for name in [n for n in vars(module) if n.endswith("Builder")]:
                    stack.enter_context(mock.patch.object(module, name, stub))
        try:
            import cpuinfo  # deferred: only this function needs it

            stack.enter_context(mock.patch.object(cpuinfo, "get_cpu_info", _reach_kernels))
        except ImportError:
            pass
        yield


@contextlib.contextmanager
def _without_compile_guard():
    """torch's ``Optimizer.add_param_group`` without its torch.compile guard, whose first call imports
    torch._dynamo (seconds, once per process) only to step around a compiler that a config check never runs."""

    add = torch.optim.Optimizer.add_param_group
    with mock.patch.object(torch.optim.Optimizer, "add_param_group", getattr(add, "__wrapped__", add)):
        yield


def _construct_optimizer(cls: type, params: dict) -> None:
    """``cls([p], **params)`` on one stand-in parameter, as DeepSpeed would call it; raises what it raises."""

    stand_in = [torch.nn.Parameter(torch.zeros(1))]
    with _without_compile_guard():
        if not cls.__module__.startswith("deepspeed."):
            cls(stand_in, **params)
            return
        with _stopped_at_kernels(cls):
            try:
                cls(stand_in, **params)
            except _KernelsReached:
                pass


def _refusal(build: Callable[[dict], Any], params: dict) -> str | None:
    """``"ValueError: ..."`` if ``build(params)`` raises, else None."""
    try:
        build(params)
    except Exception as error:  # noqa: BLE001 - any refusal is the answer
        return f"{type(error).__name__}: {error}"
    return None


def _refusals(build: Callable[[dict], Any], params: dict, required: Sequence[str] = ()) -> dict[str, str]:
    """key -> what ``build`` raises for that key (each tried alone, beside the required ones); ``""`` ->
    the refusal when only the keys together fail. Empty when ``build(params)`` succeeds."""
    whole = _refusal(build, params)
    if whole is None:
        return {}
    base = {k: params[k] for k in required if k in params}
    base_refusal = _refusal(build, base) if base else None
    if base_refusal is not None:
        named = [k for k in base if re.search(rf"\b{re.escape(k)}\b", base_refusal)]
        return {(named or list(base))[0]: base_refusal}
    found = {key: refusal for key in params if key not in base
             for refusal in [_refusal(build, {**base, key: params[key]})] if refusal is not None}
    return found or {"": whole}


def _optimizer_param_findings(config: dict) -> list[Finding]:
    """``optimizer.params`` against the class DeepSpeed builds: unknown keys, wrong types, values its
    constructor refuses, values its kernel takes although torch refuses them, and DeepSpeed's own keys
    that change nothing."""
    ds_config = ds.load("deepspeed.runtime.config")

    optimizer = config["optimizer"]
    params = optimizer.get("params", {})
    if not isinstance(params, dict):
        return [Finding("error", "optimizer.params", f"must be an object {{ }} of keyword arguments, got "
                        f"{type(params).__name__} {params!r} (deepspeed.initialize fails unpacking it)",
                        'write e.g. "params": {"lr": 1e-4}')]
    builder = optimizer_builder(config)
    if builder is None:
        return []
    what = f"{builder.cls.__module__}.{builder.cls.__qualname__}"
    keywords = {k: p for k, p in _keywords(builder.cls).items() if k not in builder.passed}
    findings, usable = [], {}
    for key, value in params.items():
        path = f"optimizer.params.{key}"
        if key == "max_grad_norm" or key in builder.taken:
            continue  # the first has a rule of its own; DeepSpeed's own keys: below
        if key in builder.passed:
            findings.append(Finding("error", path, f"DeepSpeed passes {key} to {builder.builds()} itself: a second "
                                    "one fails deepspeed.initialize (TypeError: got multiple values)", "remove it"))
        elif key not in keywords:
            choices = list(keywords)
            if str(optimizer.get("type")).lower() in (ds_config.ADAM_OPTIMIZER, ds_config.ADAMW_OPTIMIZER):
                choices += [ds_config.ADAM_W_MODE, ds_config.TORCH_ADAM_PARAM]  # DeepSpeed's own keys for Adam
            close = difflib.get_close_matches(key, choices, n=1)
            findings.append(Finding("error", path, f"is not a parameter of {what}, the optimizer DeepSpeed builds "
                                    "here (deepspeed.initialize fails: TypeError, unexpected keyword argument)",
                                    f"did you mean {close[0]!r}?" if close else
                                    f"remove it; {builder.cls.__name__} takes {', '.join(keywords)}"))
        elif (expected := _expected_type(keywords[key])) and not expected[1](value):
            findings.append(Finding("error", path, f"must be {expected[0]} for {builder.cls.__name__}, got "
                                    f"{type(value).__name__} {value!r} (accepted until its constructor or the first "
                                    "step uses it, then a TypeError or ValueError from inside it)",
                                    f"write {key} as {expected[0]}"))
        else:
            usable[key] = value
    for key in sorted(builder.taken):
        if not _changes_the_builder(config, key):
            hint = ('; for Adam with L2 weight decay write "type": "Adam" with "adam_w_mode": false'
                    if key == ds_config.ADAM_W_MODE else "")
            findings.append(Finding("warning", f"optimizer.params.{key}", f"changes nothing here: DeepSpeed takes it "
                                    f"out of the parameters and builds {builder.builds()} whatever its value",
                                    f"remove it{hint}"))
    build = lambda p: _construct_optimizer(builder.cls, {**p, **builder.passed})  # noqa: E731
    for key, refusal in _refusals(build, usable).items():
        findings.append(Finding("error", f"optimizer.params.{key}".rstrip("."), f"{builder.cls.__name__} refuses it "
                                f"when deepspeed.initialize builds it ({refusal})",
                                _default_fix(key, keywords, builder.cls.__name__)))
    if builder.counterpart is not None and not any(f.severity == "error" for f in findings):
        counterpart = builder.counterpart
        comparable = {k: v for k, v in usable.items() if k in _keywords(counterpart)}
        for key, refusal in _refusals(lambda p: _construct_optimizer(counterpart, p), comparable).items():
            findings.append(Finding("warning", f"optimizer.params.{key}".rstrip("."), f"{builder.cls.__name__}, "
                                    f"DeepSpeed's own kernel, checks nothing and trains with it, where "
                                    f"torch.optim.{counterpart.__name__} refuses it ({refusal})",
                                    _default_fix(key, keywords, f"torch.optim.{counterpart.__name__}")))
    findings += _adam_is_adamw_findings(config, builder)
    return findings


def _default_fix(key: str, keywords: dict[str, inspect.Parameter], accepter: str) -> str:
    """The fix for a refused value: the key's default, where it has one."""
    default = keywords[key].default if key in keywords else inspect.Parameter.empty
    if default is inspect.Parameter.empty:
        return f"change it to a value {accepter} accepts" if key else f"change what {accepter} refuses together"
    return f"remove {key} for its default, {default!r}, or give a value {accepter} accepts"


def _changes_the_builder(config: dict, key: str) -> bool:
    """Whether DeepSpeed builds anything else with ``optimizer.params[key]`` removed, or (true/false) flipped."""
    params = config["optimizer"]["params"]
    base = optimizer_builder(config)
    variants = [{k: v for k, v in params.items() if k != key}]
    if isinstance(params[key], bool):
        variants.append({**params, key: not params[key]})
    for variant in variants:
        other = optimizer_builder({**config, "optimizer": {**config["optimizer"], "params": variant}})
        if other is None or (other.cls, other.passed) != (base.cls, base.passed):
            return True
    return False


def _adam_is_adamw_findings(config: dict, builder: OptimizerBuilder) -> list[Finding]:
    """"Adam" with weight decay builds exactly what "AdamW" builds, unless adam_w_mode says otherwise."""
    ds_config = ds.load("deepspeed.runtime.config")

    optimizer = config["optimizer"]
    decay = optimizer["params"].get("weight_decay", 0) if isinstance(optimizer.get("params"), dict) else 0
    if str(optimizer.get("type")).lower() != ds_config.ADAM_OPTIMIZER or not _is_type(decay, (int, float)) or decay == 0:
        return []
    as_adamw = optimizer_builder(merged(config, {"optimizer": {"type": "AdamW"}}))
    if as_adamw is None or (as_adamw.cls, as_adamw.passed) != (builder.cls, builder.passed):
        return []
    return [Finding("warning", "optimizer.type", f'"{optimizer["type"]}" with weight_decay {decay:g}: DeepSpeed builds '
                    f'{builder.builds()}, exactly what it builds for "AdamW": decoupled weight decay, not the L2 '
                    "penalty torch.optim.Adam adds to the gradient",
                    f'add "{ds_config.ADAM_W_MODE}": false to the params for Adam with L2 weight decay, or write "AdamW" '
                    "to say what runs")]


@contextlib.contextmanager
def _captured_messages():
    """The warnings DeepSpeed logs and Python warns while the block runs (kept from the console)."""
    logger = ds.load("deepspeed.utils").logger

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handlers, level = logger.handlers[:], logger.level
    logger.handlers[:] = [Keep(logging.WARNING)]
    logger.setLevel(min(level or logging.WARNING, logging.WARNING))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages.extend(str(w.message) for w in caught)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)


def _scheduler_trial(cls: type, params: dict, optimizer: Callable[[float], Any], lr: float,
                     steps: int = 5) -> tuple[dict, list[float], list[str]]:
    """Build ``cls`` on a stand-in optimizer with learning rate ``lr`` and take ``steps`` steps, as the engine
    does after each optimizer step: the scheduler's attributes once built, the learning rate before and
    after each step, and the warnings on the way. (The stand-in never steps: no parameter would change.)"""
    with _captured_messages() as messages, _without_compile_guard():
        stand_in = optimizer(lr)
        scheduler = cls(stand_in, **params)
        built = dict(vars(scheduler))
        lrs = [stand_in.param_groups[0]["lr"]]
        for _ in range(steps):
            try:
                scheduler.step()
            except TypeError:  # as the engine does for a step that wants an argument (ReduceLROnPlateau)
                scheduler.step(1)
            lrs.append(stand_in.param_groups[0]["lr"])
    return built, lrs, messages


def _scheduler_param_findings(config: dict, client_optimizer: bool) -> list[Finding]:
    """``scheduler.params`` against the scheduler class DeepSpeed builds (its own, or torch's of that name):
    unknown keys, missing required ones, wrong types, what its constructor and first steps refuse or warn
    about, values it silently replaces, and an optimizer ``lr`` that it never uses."""
    lr_schedules = ds.load("deepspeed.runtime.lr_schedules")

    scheduler = config["scheduler"]
    kind = str(scheduler.get("type", ""))
    cls = getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind, None)  # the engine's order
    if not isinstance(cls, type):
        return []
    params = scheduler.get("params", {})
    if not isinstance(params, dict):
        return [Finding("error", "scheduler.params", f"must be an object {{ }} of keyword arguments, got "
                        f"{type(params).__name__} {params!r} (deepspeed.initialize fails unpacking it)",
                        'write e.g. "params": {"warmup_num_steps": 100}')]
    deepspeeds = cls.__module__ == lr_schedules.__name__
    what = f"{cls.__module__}.{cls.__qualname__}"
    keywords = _keywords(cls)
    required = [k for k, p in keywords.items() if p.default is inspect.Parameter.empty]
    findings, usable = [], {}
    for key, value in params.items():
        path = f"scheduler.params.{key}"
        if key not in keywords:
            close = difflib.get_close_matches(key, list(keywords), n=1)
            findings.append(Finding("error", path, f"is not a parameter of {what} (deepspeed.initialize fails: "
                                    "TypeError, unexpected keyword argument)", f"did you mean {close[0]!r}?" if close
                                    else f"remove it; {kind} takes {', '.join(keywords)}"))
        elif (expected := _expected_type(keywords[key], per_group=deepspeeds)) and not expected[1](value):
            findings.append(Finding("error", path, f"must be {expected[0]} for {kind}, got {type(value).__name__} "
                                    f"{value!r} (fails when the scheduler is built or steps)",
                                    f"write {key} as {expected[0]}"))
        else:
            usable[key] = value
    missing = [k for k in required if k not in params]
    for key in missing:
        findings.append(Finding("error", f"scheduler.params.{key}", f"{kind} needs it (deepspeed.initialize fails: "
                                "TypeError, missing required argument)", f"set scheduler.params.{key}"))
    if missing or len(usable) < len(params):
        return findings
    # build it on a stand-in of the optimizer DeepSpeed builds (torch's class, or the kernel's counterpart)
    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    opt_params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
    builder = optimizer_builder(config) if optimizer and not client_optimizer else None
    stand_in_cls = torch.optim.AdamW
    if builder is not None and not builder.cls.__module__.startswith("deepspeed."):
        stand_in_cls = builder.cls
    elif builder is not None and builder.counterpart is not None:
        stand_in_cls = builder.counterpart
    lr = opt_params.get("lr") if builder is not None else None
    lr = lr if _is_type(lr, (int, float)) and lr > 0 else None
    if _refusal(lambda _: _construct_optimizer(stand_in_cls, {"lr": lr or 1e-3}), {}):
        stand_in_cls = torch.optim.AdamW
    stand_in = lambda rate: stand_in_cls([torch.nn.Parameter(torch.zeros(1))], lr=rate)  # noqa: E731
    refusals = _refusals(lambda p: _scheduler_trial(cls, p, stand_in, lr or 1e-3), usable, required)
    for key, refusal in refusals.items():
        findings.append(Finding("error", f"scheduler.params.{key}".rstrip("."), f"{kind} refuses it when "
                                f"deepspeed.initialize builds it or at its first steps ({refusal})",
                                _default_fix(key, keywords, kind)))
    if refusals:
        return findings
    built, lrs, messages = _scheduler_trial(cls, usable, stand_in, lr or 1e-3)
    warned = set()
    for message in dict.fromkeys(messages):
        named = [k for k in usable if re.search(rf"\b{re.escape(k)}\b", message)]
        if named:
            warned.update(named)
            findings.append(Finding("warning", f"scheduler.params.{named[0]}", f"{kind} warns when "
                                    f"deepspeed.initialize builds it: {message.strip()}",
                                    f"change {' or '.join(named)} until {kind} builds without the warning"))
    if deepspeeds:  # torch's schedulers take a first step in their constructor, which moves their counters
        for key, value in usable.items():
            if key not in warned and key in built and built[key] != value:
                findings.append(Finding("warning", f"scheduler.params.{key}", f"{kind} silently uses "
                                        f"{key} = {built[key]!r}, not {value!r}",
                                        f"write {built[key]!r} to say what runs"))
    if lr is not None:  # the optimizer's lr, as the config gives it: does the schedule depend on it?
        _, doubled, _ = _scheduler_trial(cls, usable, stand_in, 2 * lr)
        defaults = {k: p.default for k, p in keywords.items() if p.default is not inspect.Parameter.empty}
        numbers = [v for v in {**defaults, **usable}.values() for v in (v if isinstance(v, list) else [v])
                   if _is_type(v, (int, float))]
        if doubled == lrs and not any(math.isclose(lr, v) for v in numbers):
            findings.append(Finding("warning", "optimizer.params.lr", f"{lr:g} is never used: {kind} sets every "
                                    f"step's learning rate from its own parameters (over its first steps: "
                                    f"{', '.join(f'{x:g}' for x in lrs[:4])}, ...), whatever the optimizer's lr",
                                    f"set the learning rates in scheduler.params, or make {kind}'s peak equal lr"))
    return findings


#: ZeRO settings only DeepSpeed's ZeRO optimizers read (engine._configure_zero_optimizer hands them over);
#: at stage 0 there is none, and DeepSpeed reduces the gradients in its own fixed-size buckets.
ZERO_OPTIMIZER_KNOBS = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
                        "round_robin_gradients")

#: The dynamic loss scaler's knobs (read only when fp16 is on, and its loss_scale is 0).
DYNAMIC_LOSS_SCALE_KNOBS = ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
                            "consecutive_hysteresis")


def _silent_off_findings(config: dict, zero: dict, stage: int) -> list[Finding]:
    """Settings DeepSpeed accepts and then does not use, or uses to turn a feature off, without a word."""
    GRADIENT_CLIPPING_DEFAULT = ds.load("deepspeed.runtime.constants").GRADIENT_CLIPPING_DEFAULT

    findings = []
    clipping = config.get("gradient_clipping")
    if _is_type(clipping, (int, float)) and clipping <= 0:
        findings.append(Finding("warning", "gradient_clipping", f"{clipping:g} turns gradient clipping off "
                                "(DeepSpeed clips only above 0; without the key it clips at "
                                f"{GRADIENT_CLIPPING_DEFAULT!r})",
                                "remove it to clip at DeepSpeed's default, or give the largest gradient norm to allow"))
    fp16 = config.get("fp16") if isinstance(config.get("fp16"), dict) else None
    if fp16 is not None and fp16.get("enabled", False) is False:
        knobs = [k for k in ("loss_scale", *DYNAMIC_LOSS_SCALE_KNOBS) if k in fp16]
        if knobs and "enabled" not in fp16:  # an explicit false says it; a missing one is DeepSpeed's default
            findings.append(Finding("warning", f"fp16.{knobs[0]}", "fp16 is off: the section has no \"enabled\", "
                                    f"and DeepSpeed's default is false, so it trains without fp16 and never reads "
                                    f"{', '.join(knobs)}", 'add "enabled": true to fp16 (or remove the section)'))
        if fp16.get("auto_cast") is True:
            findings.append(Finding("error", "fp16.auto_cast", "casts every floating-point input to fp16 although "
                                    "fp16 is off: the model keeps its own dtype, and its first forward fails on "
                                    "the dtype mismatch", 'remove auto_cast, or set "enabled": true in fp16'))
    if stage == 0:
        knobs = [k for k in ZERO_OPTIMIZER_KNOBS if k in zero]
        if knobs:
            findings.append(Finding("warning", f"zero_optimization.{knobs[0]}", f"is ignored at stage 0: "
                                    f"{', '.join(knobs)} steer DeepSpeed's ZeRO optimizers, and stage 0 builds none "
                                    "(gradients are all-reduced in DeepSpeed's fixed buckets)",
                                    "set zero_optimization.stage to 1-3, or remove them"))
    return findings


def _loss_scale_findings(config: dict, stage: int) -> list[Finding]:
    """fp16 loss-scaling knobs that do nothing, or not what their name says."""
    fp16 = config.get("fp16") if isinstance(config.get("fp16"), dict) else {}
    if not fp16.get("enabled"):
        return []
    findings = []
    dynamic_knobs = [k for k in DYNAMIC_LOSS_SCALE_KNOBS if k in fp16]
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
                fix = (f"set {name}.enabled to false; on {'that' if isinstance(env, Target) else 'this'} "
                       f"device use {alternative}"
                       + (" (\"bf16\": {\"enabled\": true})" if alternative == "bf16" else ""))
                findings.append(Finding("error", f"{name}.enabled",
                                        f"DeepSpeed refuses {name} on {env.device_name} "
                                        f"(ValueError: Type {name} is not supported on your device)", fix))
        if env.is_gpu and world_size > env.gpu_count:
            where = "the target" if isinstance(env, Target) else "this machine"
            findings.append(Finding("warning", "(world size)",
                                    f"checked for {world_size} ranks, but {where} has {env.gpu_count} GPU(s)",
                                    f"launch it {'there' if isinstance(env, Target) else 'here'} with at most "
                                    f"{env.gpu_count} ranks"))
    return findings


def _explained(error: Exception, findings: list[Finding]) -> bool:
    """Whether DeepSpeed's parser refusal is one the findings already name (its first refusal only)."""
    text, errors = str(error), [f for f in findings if f.severity == "error"]
    if "Check batch related parameters" in text or re.match(r"(Gradient accumulation steps|Micro batch size per "
                                                               r"gpu): 0 has to be greater than 0", text):
        return any(f.key in _BATCH_KEYS for f in errors)
    if "cannot be simultaneously enabled" in text:
        return any(f.key == "fp16.enabled" for f in errors)
    if type(error).__name__ == "ValidationError":  # a section model: the section findings list each field
        return any(f.key.split(".")[0] in _section_validators() for f in errors)
    return any(f.key in text for f in errors)  # e.g. a value of the wrong type, named by its key


def check(config: dict, world_size: int, env: Environment | None = None, client_optimizer: bool = False,
          starter: str = "deepspeed") -> list[Finding]:
    """Every finding for ``config`` on ``world_size`` ranks (errors first).

    ``env`` (from :func:`helpers.core.environment.detect`, or :func:`target` for another machine) enables the
    device checks (fp16 on a CPU, NVMe, GPU count); ``client_optimizer=True`` says the script passes its own
    optimizer to ``deepspeed.initialize``, as the source article's does. ``starter`` says what starts the
    config (:data:`STARTERS`): ``"deepspeed"``, plain ``deepspeed.initialize``, which takes every ``"auto"`` as
    written; ``"trainer"``, Hugging Face's Trainer, which fills the ``"auto"`` values it knows
    (:func:`trainer_fills`) and passes its own optimizer when the config has none. Either way each ``"auto"``
    left for DeepSpeed is one finding, and the rest is checked as the Trainer would fill it.
    """
    if not isinstance(config, dict):
        return [Finding("error", "(top level)", "a DeepSpeed config is a JSON object", "wrap the settings in { }")]
    if starter not in STARTERS:
        raise ValueError(f"starter {starter!r}: use one of {', '.join(STARTERS)}")
    paths = auto_paths(config)
    if not paths and starter == "deepspeed":
        return _check(config, world_size, env, client_optimizer)
    filled, fills = trainer_fills(config, world_size) if paths else (copy.deepcopy(config), {})
    if starter == "trainer" and "optimizer" not in config:  # the Trainer builds its own and says it is tested
        client_optimizer = True
        filled.setdefault("zero_allow_untested_optimizer", True)
    findings = _auto_findings(config, paths, fills, starter)
    placeholders = tuple(paths)
    findings += [f for f in _check(filled, world_size, env, client_optimizer)
                 if not (f.key in placeholders or f.key.startswith(tuple(p + "." for p in placeholders)))]
    return sorted(findings, key=lambda f: f.severity != "error")


def _check(config: dict, world_size: int, env: Environment | None, client_optimizer: bool) -> list[Finding]:
    findings = _top_level_findings(config) + _batch_findings(config, world_size) + _section_findings(config)
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", 0)
    stage = stage if isinstance(stage, int) and stage in (0, 1, 2, 3) else 0
    findings += _optimizer_findings(config, stage, client_optimizer)
    findings += _offload_findings(zero, stage, config, client_optimizer, env)
    findings += _loss_scale_findings(config, stage)
    findings += _silent_off_findings(config, zero, stage)
    findings += _precision_findings(config, world_size, env)
    refusal = deepspeed_parse(config, world_size, env.device if isinstance(env, Target) else None)
    if refusal is not None and not _explained(refusal, findings):
        findings.append(Finding("error", "(DeepSpeed's parser)", f"{type(refusal).__name__}: {refusal}",
                                "change the setting it names"))
    return sorted(findings, key=lambda f: f.severity != "error")


def check_or_raise(config: dict, world_size: int, env: Environment | None = None, client_optimizer: bool = False,
                   source: str = "config", starter: str = "deepspeed") -> list[Finding]:
    """Run :func:`check`; raise :class:`ConfigError` if anything is an error, else return the warnings."""
    findings = check(config, world_size, env, client_optimizer, starter)
    if any(f.severity == "error" for f in findings):
        raise ConfigError(findings, source)
    return findings


# --- "auto": the placeholder Hugging Face's Trainer and accelerate fill --------------------------------------

#: Who a config is written for: plain ``deepspeed.initialize`` takes the file as written; Hugging Face's Trainer
#: first fills each ``"auto"`` it knows from its TrainingArguments (transformers'
#: ``HfTrainerDeepSpeedConfig``), and passes its own optimizer when the config has none.
STARTERS = ("deepspeed", "trainer")

#: Where the Trainer takes the ``"auto"`` values it fills only once it has the model and the data
#: (``trainer_config_finalize``); the check fills them with stand-ins and reports none of them.
LATE_FILLS = {
    "zero_optimization.reduce_bucket_size": "hidden_size * hidden_size, from the model's config",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 * hidden_size * hidden_size, from the model's config",
    "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size, from the model's config",
    "scheduler.params.total_num_steps": "the number of training steps",
    "scheduler.params.warmup_num_steps": "TrainingArguments.warmup_steps (at least 1)",
}

#: Where the Trainer's other fills come from, where transformers names no single TrainingArguments field.
TRAINER_SOURCES = {"train_batch_size": "world size x per_device_train_batch_size x gradient_accumulation_steps",
                   "scheduler.params.warmup_min_lr": "a constant of the Trainer's"}

#: The "auto" that accelerate's ``Accelerator.prepare`` fills after the Trainer's own fills (accelerate 1.x,
#: ``accelerate/accelerator.py``: its ``config_kwargs`` for DeepSpeed), with the value it writes.
ACCELERATE_FILLS = {"zero_optimization.stage3_gather_16bit_weights_on_model_save": False}

_AUTO_SOURCE = ("\"auto\" is a placeholder that Hugging Face's Trainer and accelerate fill from their own arguments; "
                "plain deepspeed.initialize takes it as written")


@dataclasses.dataclass(frozen=True)
class AutoFill:
    """One ``"auto"`` of a config as the Trainer fills it: the value, and where the Trainer takes it from."""

    path: str
    value: Any
    source: str


def auto_paths(config: Any, prefix: str = "") -> list[str]:
    """The dotted paths of every ``"auto"`` value of a DeepSpeed config, in order."""
    if isinstance(config, dict):
        return [p for k, v in config.items() for p in auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if config == "auto" else []


def trainer_fills(config: dict, world_size: int) -> tuple[dict, dict[str, AutoFill]]:
    """``config`` as Hugging Face's Trainer hands it to ``deepspeed.initialize`` on ``world_size`` ranks with its
    default TrainingArguments (transformers' own ``HfTrainerDeepSpeedConfig``: ``trainer_config_process``, then
    ``trainer_config_finalize`` on a stand-in model and step count, for :data:`LATE_FILLS`), and each ``"auto"``
    it filled. Values the config states are kept as written (the Trainer would ask its arguments to agree with
    them). Without transformers: the config unchanged, nothing filled."""
    try:
        # deferred: transformers is imported only for a config with "auto" values
        from transformers import TrainingArguments
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        return copy.deepcopy(config), {}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)
                if f.default is not dataclasses.MISSING}
    args = types.SimpleNamespace(**defaults, world_size=world_size)
    args.get_warmup_steps = lambda steps: TrainingArguments.get_warmup_steps(args, steps)
    stand_in_model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=1024))
    with _captured_messages():
        hf = hf_deepspeed.HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    hf_deepspeed.unset_hf_deepspeed_config()  # the Trainer's global: this check trains nothing
    fills: dict[str, AutoFill] = {}
    fill_match = hf.fill_match

    def recorded(path: str, value: Any, hf_key: str | None = None, must_match: bool = True) -> None:
        if hf.is_auto(path):
            source = LATE_FILLS.get(path) or TRAINER_SOURCES.get(path) or (
                f"TrainingArguments.{hf_key.replace('+', ', ').replace('|', ' or ')}" if hf_key else "fixed")
            fills[path] = AutoFill(path, value, source)
        fill_match(path, value, hf_key, must_match=False)  # the config's own values stay as written

    hf.fill_match = recorded
    hf.fill_only = lambda path, value, hf_key=None: recorded(path, value, hf_key, must_match=False)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, stand_in_model, 1000)
    for path, value in ACCELERATE_FILLS.items():  # then the Trainer's accelerate.Accelerator.prepare
        if hf.is_auto(path):
            fills[path] = AutoFill(path, value, "accelerate's Accelerator.prepare, which the Trainer calls")
            hf.fill_only(path, value)
    return _plain(hf.config), fills


def _auto_findings(config: dict, paths: list[str], fills: dict[str, AutoFill], starter: str) -> list[Finding]:
    """One finding per ``"auto"`` the config's starter leaves unfilled (with the Trainer: those it does not know)."""
    DEFAULT_HF_CONFIG = ds.load("deepspeed.autotuning.constants").DEFAULT_HF_CONFIG

    defaults = deepspeed_defaults(config)
    models = set(_section_validators())
    tuning = isinstance(config.get("autotuning"), dict) and config["autotuning"].get("enabled") is True
    findings = []
    for path in paths:
        fill = fills.get(path)
        if starter == "trainer" and fill is not None:
            continue
        if starter == "trainer":
            rule = "the Trainer fills no \"auto\" for this key, so DeepSpeed receives it as written"
        elif fill is None:
            rule = f"{_AUTO_SOURCE}, and the Trainer fills no \"auto\" for this key"
        else:
            rule = _AUTO_SOURCE
        if tuning and path in DEFAULT_HF_CONFIG:  # the batch keys DeepSpeed's autotuner searches itself
            rule += " (with \"autotuning\" enabled, DeepSpeed's autotuner, deepspeed --autotuning, tries values itself)"
        if fill is None:
            fix = f"write the value {path} should have"
        elif path in LATE_FILLS:
            fix = (f"write a number (the Trainer writes {fill.source}); if the Trainer or accelerate starts this "
                   "config, check it with --for trainer")
        else:
            fix = (f"write {json.dumps(fill.value)} (what the Trainer writes by default: {fill.source}) or your own "
                   "value; if the Trainer or accelerate starts this config, check it with --for trainer")
        if path.split(".")[0] in models:  # DeepSpeed's config models drop an "auto" and use their default
            default = defaults.get(path, NO_DEFAULT)
            said = "its default" if default is NO_DEFAULT else f"its default, {json.dumps(default)}"
            findings.append(Finding("warning", path, f"{rule}: DeepSpeed's config model drops an \"auto\" and "
                                    f"uses {said}", fix))
        else:
            findings.append(Finding("error", path, f"{rule}: DeepSpeed receives the string and fails when it uses "
                                    "it", fix))
    return findings


# --- the machine a config is checked for ----------------------------------------------------------------

class Target(Environment):
    """A machine other than this one that a config is checked for (``python -m helpers check --target``)."""


#: GPUs' precisions by compute capability: DeepSpeed's CUDA accelerator accepts fp16 from 7.0
#: (``is_fp16_supported``) and bf16 where torch does (``torch.cuda.is_bf16_supported``: from 8.0).
CUDA_PRECISIONS = ((8.0, ("fp32", "bf16", "fp16")), (7.0, ("fp32", "fp16")), (0.0, ("fp32",)))


def target(device: str, gpus: int | None = None) -> Target:
    """The machine to check a config for: ``"cuda"`` (a GPU of compute capability 8.0 or above: A100, H100, ...),
    ``"cuda:7.0"`` (V100: no bf16) or ``"cpu"`` (DeepSpeed's CPU accelerator, as here), with ``gpus`` GPUs."""
    kind, _, capability = device.partition(":")
    if kind == "cpu":
        return Target("cpu", "the target: CPU", 0, 0, "gloo", gpus or 2, "--target", cpu_precisions(),
                      torch.__version__, "")
    if kind != "cuda":
        raise ValueError(f"--target {device!r}: give cpu, cuda, or cuda:<compute capability> (e.g. cuda:7.0)")
    try:
        level = float(capability) if capability else 8.0
    except ValueError:
        raise ValueError(f"--target {device!r}: the compute capability is a number, e.g. cuda:7.0") from None
    precisions = next(p for floor, p in CUDA_PRECISIONS if level >= floor)
    count = gpus or 1
    name = f"the target: {count} x CUDA GPU of compute capability {capability or '8.0 or above'}"
    return Target("cuda", name, count, 0, "nccl", count, "--target", precisions, torch.__version__, "")


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

    constants = ds.load("deepspeed.runtime.constants")
    lr_schedules = ds.load("deepspeed.runtime.lr_schedules")
    precision = ds.load("deepspeed.runtime.precision_config")
    get_zero_config = ds.load("deepspeed.runtime.zero.config").get_zero_config
    offload = ds.load("deepspeed.runtime.zero.offload_config")

    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    sections = {
        "zero_optimization": get_zero_config({"zero_optimization": {"stage": zero.get("stage", 0)}}).model_dump(),
        "zero_optimization.offload_optimizer": offload.DeepSpeedZeroOffloadOptimizerConfig().model_dump(),
        "zero_optimization.offload_param": offload.DeepSpeedZeroOffloadParamConfig().model_dump(),
        "fp16": precision.get_float16_config({"fp16": {}}).model_dump(),
        "bf16": precision.get_bfloat16_config({"bf16": {}}).model_dump(),
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
