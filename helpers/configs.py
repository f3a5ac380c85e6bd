"""DeepSpeed configs: load them from ``ds_configs/``, derive variants, and check them for traps.

:func:`check` knows the rules DeepSpeed enforces (and the ones it silently ignores). Each
:class:`Finding` names the key, the rule and the fix. :func:`helpers.launch.run` calls it before
any process starts, so a bad config fails in a second with a readable message instead of
after a launch with a stack trace from every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from helpers.environment import REPO_ROOT, Environment

CONFIG_DIR = REPO_ROOT / "ds_configs"

#: Top-level keys DeepSpeed 0.19 reads, with the JSON types it accepts.
TOP_LEVEL_KEYS: dict[str, tuple[type, ...]] = {
    "train_batch_size": (int,), "train_micro_batch_size_per_gpu": (int,), "gradient_accumulation_steps": (int,),
    "optimizer": (dict,), "scheduler": (dict,), "zero_optimization": (dict,), "fp16": (dict,), "bf16": (dict,),
    "bfloat16": (dict,), "amp": (dict,), "torch_autocast": (dict,), "gradient_clipping": (int, float),
    "prescale_gradients": (bool,), "gradient_predivide_factor": (int, float), "sparse_gradients": (bool,),
    "communication_data_type": (str,), "seq_parallel_communication_data_type": (str,),
    "steps_per_print": (int,), "wall_clock_breakdown": (bool,), "memory_breakdown": (bool,), "dump_state": (bool,),
    "log_level": (str,), "comms_logger": (dict,), "flops_profiler": (dict,), "activation_checkpointing": (dict,),
    "zero_allow_untested_optimizer": (bool,), "zero_force_ds_cpu_optimizer": (bool,), "tensorboard": (dict,),
    "wandb": (dict,), "csv_monitor": (dict,), "comet": (dict,), "checkpoint": (dict,), "data_types": (dict,),
    "pipeline": (dict,), "elasticity": (dict,), "autotuning": (dict,), "aio": (dict,), "compression_training": (dict,),
    "data_efficiency": (dict,), "curriculum_learning": (dict,), "sequence_parallel_size": (int,),
    "disable_allgather": (bool,), "tensor_parallel": (dict,), "nebula": (dict,), "weight_quantization": (dict,),
    "compile": (dict,), "use_data_before_expert_parallelism": (bool,), "timers": (dict,),
    "graph_harvesting": (bool,), "gradient_accumulation_dtype": (str,),
}

JSON_TYPE_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
                   dict: "an object { }"}

#: Optimizer types DeepSpeed builds from a config (case-insensitive).
OPTIMIZER_TYPES = ("adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion",
                   "muadam", "muadamw", "musgd", "muon", "sgd")

#: What the course adds to every run's config: the comms logger (the source of the comm figures)
#: and quiet logs.
RUN_DEFAULTS: dict[str, Any] = {
    # debug: the logger also records which DeepSpeed function issued each collective
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": True},
    "steps_per_print": 1_000_000,
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


def path_of(name: str | Path) -> Path:
    """``"zero2"`` or ``"zero2.json"`` -> ``ds_configs/zero2.json``; other paths are used as given."""
    path = Path(name)
    if path.suffix != ".json":
        path = path.with_suffix(".json")
    if not path.is_absolute() and not path.exists():
        path = CONFIG_DIR / path.name
    return path


def load(name: str | Path) -> dict:
    """Read a DeepSpeed config (a name in ``ds_configs/`` or a path)."""
    path = path_of(name)
    if not path.exists():
        available = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
        raise FileNotFoundError(f"no DeepSpeed config {name!r} (looked for {path}); ds_configs/ has: {available}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error}); DeepSpeed configs are plain JSON objects") from None


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


def for_run(config: dict) -> dict:
    """The config a run uses: the course's defaults (comms logger on, quiet logs) under ``config``."""
    return merged(RUN_DEFAULTS, config)


def _is_type(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a number
    return isinstance(value, types)


def _check_batch(config: dict, world_size: int) -> list[Finding]:
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    values = {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum}
    for key, value in values.items():
        if value is not None and (not _is_type(value, (int,)) or value < 1):
            return [Finding("error", key, f"must be a positive whole number, got {value!r}", f"set {key} to e.g. 1")]
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
            findings.append(Finding(
                "error", "train_batch_size",
                f"must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, "
                f"but {train} != {micro} * {accum} * {world_size} = {micro * accum * world_size}",
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


def _check_zero(zero: dict, stage: Any, has_config_optimizer: bool, client_optimizer: bool) -> list[Finding]:
    findings = []
    if not _is_type(stage, (int,)) or stage not in (0, 1, 2, 3):
        findings.append(Finding("error", "zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage!r}",
                                "set zero_optimization.stage to one of 0, 1, 2, 3"))
        return findings
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        DeepSpeedZeroConfig(**zero)
    except ImportError:
        pass
    except Exception as error:  # pydantic's ValidationError: one line per bad field
        for err in getattr(error, "errors", lambda: [])() or [{"loc": (), "msg": str(error)}]:
            where = ".".join(str(part) for part in err.get("loc", ()))
            key = "zero_optimization" + (f".{where}" if where else "")
            if err.get("type") == "extra_forbidden":
                close = difflib.get_close_matches(where.split(".")[-1], DeepSpeedZeroConfig.model_fields, n=1)
                fix = f"did you mean {close[0]!r}?" if close else "remove it"
                findings.append(Finding("error", key, "is not a zero_optimization setting DeepSpeed knows", fix))
            else:
                findings.append(Finding("error", key, err.get("msg", "invalid value"), "see DeepSpeed's ZeRO config docs"))
    # A non-object offload section is already an error from DeepSpeed's own validation above.
    offload_param = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else {}
    offload_optimizer = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    if offload_param.get("device", "none") != "none" and stage < 3:
        findings.append(Finding(
            "warning", "zero_optimization.offload_param",
            f"is ignored below stage 3 (stage is {stage}): DeepSpeed keeps all parameters on the device, silently",
            "remove offload_param, or use stage 3 to offload parameters"))
    if offload_optimizer.get("device", "none") != "none":
        if stage == 0:
            findings.append(Finding("error", "zero_optimization.offload_optimizer", "needs ZeRO stage 1, 2 or 3",
                                    "set zero_optimization.stage to 2 (or remove offload_optimizer)"))
        if client_optimizer:
            findings.append(Finding(
                "error", "zero_optimization.offload_optimizer",
                "DeepSpeed refuses ZeRO-Offload with a client optimizer such as torch.optim.AdamW "
                "(ZeRORuntimeException)",
                "pass no optimizer to deepspeed.initialize and keep the config's \"optimizer\" section "
                "(DeepSpeed then builds its CPU Adam)"))
        elif not has_config_optimizer:
            findings.append(Finding("error", "optimizer", "offload_optimizer needs an optimizer DeepSpeed builds",
                                    'add "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}'))
    return findings


def check(config: dict, world_size: int, env: Environment | None = None, client_optimizer: bool = False) -> list[Finding]:
    """Every finding for ``config`` on ``world_size`` ranks (errors first).

    ``env`` (from :func:`helpers.environment.detect`) enables device checks such as fp16 on a
    CPU; ``client_optimizer=True`` says the script passes its own optimizer to
    ``deepspeed.initialize``, as the source article's does.
    """
    findings: list[Finding] = []
    if not isinstance(config, dict):
        return [Finding("error", "(top level)", "a DeepSpeed config is a JSON object", "wrap the settings in { }")]
    for key, value in config.items():
        if key not in TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(key, TOP_LEVEL_KEYS, n=1, cutoff=0.6)
            fix = f"did you mean {close[0]!r}?" if close else "remove it (DeepSpeed would silently ignore it)"
            findings.append(Finding("error", key, "is not a key DeepSpeed reads; it would be silently ignored", fix))
        elif not _is_type(value, TOP_LEVEL_KEYS[key]):
            wanted = " or ".join(JSON_TYPE_NAMES[t] for t in TOP_LEVEL_KEYS[key])
            findings.append(Finding("error", key, f"must be {wanted}, got {type(value).__name__} {value!r}",
                                    f"write {key} as {wanted}"))
    findings += _check_batch(config, world_size)

    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        kind = str(optimizer.get("type", ""))
        if kind.lower() not in OPTIMIZER_TYPES:
            close = difflib.get_close_matches(kind.lower(), OPTIMIZER_TYPES, n=1)
            findings.append(Finding("error", "optimizer.type", f"{kind!r} is not an optimizer DeepSpeed builds",
                                    f"use {close[0]!r}" if close else "use \"AdamW\""))
        if client_optimizer:
            findings.append(Finding(
                "warning", "optimizer",
                "the script also passes its own optimizer; DeepSpeed uses one of the two",
                "keep one: remove the config's optimizer, or pass none to deepspeed.initialize"))

    fp16 = config.get("fp16") if isinstance(config.get("fp16"), dict) else {}
    bf16 = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
    if fp16.get("enabled") and bf16.get("enabled"):
        findings.append(Finding("error", "fp16.enabled", "fp16 and bf16 cannot both be enabled",
                                "set one of fp16.enabled / bf16.enabled to false"))
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

    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        findings += _check_zero(zero, zero.get("stage", 0), isinstance(optimizer, dict), client_optimizer)
    return sorted(findings, key=lambda f: f.severity != "error")


def check_or_raise(config: dict, world_size: int, env: Environment | None = None, client_optimizer: bool = False,
                   source: str = "config") -> list[Finding]:
    """Run :func:`check`; raise :class:`ConfigError` if anything is an error, else return the warnings."""
    findings = check(config, world_size, env, client_optimizer)
    if any(f.severity == "error" for f in findings):
        raise ConfigError(findings, source)
    return findings
