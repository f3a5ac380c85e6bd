"""Every rule of the config checker, each against what DeepSpeed 0.19.8 really does with that config.

Two kinds of evidence, never a belief:
- DeepSpeed's own parser (``DeepSpeedConfig``, through :func:`helpers.core.configs.deepspeed_parse`, or
  ``DeepSpeedConfig(path)`` for files) refuses or accepts the config;
- a real 2-rank launch: one sweep trains every config below in the same ranks, recording each
  run's error instead of stopping (``on_error="record"``), about 25 s for all of them.
"""

from __future__ import annotations

import pytest

from helpers.core import configs, environment, launch, records
from helpers.core.environment import WORLD_SIZE_VARIABLE

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
BF16 = {"enabled": True}
SGD = {"type": "SGD", "params": {"lr": 1e-3}}
m = configs.merged


def _findings(config, key, severity, world=2, client_optimizer=False, env=None):
    return [f for f in configs.check(config, world, env, client_optimizer)
            if f.key == key and f.severity == severity]


# --- rules DeepSpeed's own parser enforces ----------------------------------------------------

PARSER_CASES = {
    # name: (config, world size, checker key, text of DeepSpeed's refusal)
    "batch arithmetic": (configs.load("source_article"), 8, "train_batch_size", "Check batch related parameters"),
    "fp16 and bf16": (m(BASE, {"fp16": {"enabled": True}, "bf16": {"enabled": True}}), 2, "fp16.enabled",
                      "cannot be simultaneously enabled"),
    "zero stage 4": (m(BASE, {"zero_optimization": {"stage": 4}}), 2, "zero_optimization.stage", "stage"),
    "zero key typo": (m(BASE, {"zero_optimization": {"overlap_com": True}}), 2, "zero_optimization.overlap_com",
                      "overlap_com"),
    "offload key typo": (m(BASE, {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}}),
                         2, "zero_optimization.offload_optimizer.pin_memroy", "pin_memroy"),
    "partial offload below stage 3": (m(BASE, {"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                                       "ratio": 0.5}}}),
                                      2, "zero_optimization", "Partial offloading only supported for ZeRO Stage 3"),
    "loss_scale_window 0": (m(BASE, {"fp16": {"enabled": True, "loss_scale_window": 0}}), 2,
                            "fp16.loss_scale_window", "loss_scale_window"),
    "removed feature": (m(BASE, {"elasticity": {"enabled": True}}), 2, "(DeepSpeed's parser)", "Elastic training"),
    "comms logger typo": (m(BASE, {"comms_logger": {"enabled": True, "verbos": True}}), 2, "comms_logger.verbos",
                          "verbos"),
}


@pytest.mark.parametrize("name", PARSER_CASES)
def test_checker_names_what_deepspeeds_parser_refuses(name):
    config, world, key, refusal = PARSER_CASES[name]
    error = configs.deepspeed_parse(config, world)
    assert error is not None and refusal in str(error), f"DeepSpeed's parser: {error!r}"
    assert _findings(config, key, "error", world), configs.check(config, world)


def test_batch_check_with_tensor_parallelism_counts_every_rank_and_says_so():
    # AutoTP over 2 ranks: one data-parallel rank reads 8 x 2 = 16 samples per step, yet DeepSpeed wants 32
    config = m(BASE, {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "train_batch_size": 16,
                      "tensor_parallel": {"autotp_size": 2}})
    assert "16 != 8 * 2 * 2" in str(configs.deepspeed_parse(config, 2))
    (finding,) = _findings(config, "train_batch_size", "error")
    assert "tensor-parallel group read the same samples: 16 samples per step really" in finding.rule
    assert "set train_batch_size to 32" in finding.fix
    assert configs.deepspeed_parse(m(config, {"train_batch_size": 32}), 2) is None


def test_the_parser_accepts_what_the_checker_passes():
    for stage in (0, 1, 2, 3):
        config = configs.load(f"zero{stage}")
        assert configs.deepspeed_parse(config, 2) is None
        assert configs.check(config, 2) == []


def test_batch_check_counts_the_world_size_as_deepspeed_does():
    article = configs.load("source_article")  # 32 = 4 x 8 x 1
    assert configs.deepspeed_parse(article, 1) is None
    assert not _findings(article, "train_batch_size", "error", world=1)


def test_hjson_comments_and_trailing_commas_load_as_deepspeed_loads_them(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    path = tmp_path / "commented.json"
    path.write_text('{\n  // micro batch per rank\n  "train_micro_batch_size_per_gpu": 4,\n'
                    '  optimizer: {"type": "AdamW", "params": {"lr": 1e-3},},\n'
                    '  "zero_optimization": {"stage": 2,},\n}\n')
    DeepSpeedConfig(str(path))  # DeepSpeed reads it
    config = configs.load(path)
    assert config == {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                      "zero_optimization": {"stage": 2}}
    assert configs.check(config, 2) == []


def test_duplicate_keys_are_refused_as_deepspeed_refuses_them(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    path = tmp_path / "twice.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ValueError, match="Duplicate keys"):
        DeepSpeedConfig(str(path))
    with pytest.raises(configs.ConfigError) as caught:
        configs.load(path)
    assert [f.key for f in caught.value.findings] == ["stage"]


# --- rules only a launch shows ----------------------------------------------------------------

def _launch_cases(env: environment.Environment, nvme_dir: str) -> dict:
    """name -> (config, client optimizer, checker key, severity, expected outcome)."""
    offload = {"device": "cpu"}
    return {
        "control stage 2": (BASE, False, None, None, "ok"),
        "control stage 0": (m(BASE, {"zero_optimization": {"stage": 0}}), False, None, None, "ok"),
        "control CPU offload": (m(BASE, {"zero_optimization": {"offload_optimizer": offload}}), False, None, None,
                                "ok"),
        "unknown top-level key": (m(BASE, {"gradient_cliping": 0.5}), False, "gradient_cliping", "error", "ok"),
        "wrong type": (m(BASE, {"gradient_clipping": "1.0"}), False, "gradient_clipping", "error", "TypeError"),
        "optimizer typo": (m(BASE, {"optimizer": {"type": "Adamm"}}), False, "optimizer.type", "error",
                           "not a supported DeepSpeed Optimizer"),
        "torch optimizer at ZeRO": (m(BASE, {"optimizer": {"type": "RMSprop", "params": {"lr": 1e-3}}}), False,
                                    "optimizer.type", "error", "untested ZeRO Optimizer"),
        "max_grad_norm": (m(BASE, {"optimizer": {"params": {"max_grad_norm": 1.0}}}), False,
                          "optimizer.params.max_grad_norm", "error", "max_grad_norm"),
        "scheduler typo": (m(BASE, {"scheduler": {"type": "WarmupLRR", "params": {}}}), False, "scheduler.type",
                           "error", "does not recognize LR scheduler"),
        "ZeRO without optimizer": (m(BASE, {"optimizer": None}), False, "optimizer", "error",
                                   "requires an optimizer"),
        "offload with client optimizer": (m(BASE, {"zero_optimization": {"offload_optimizer": offload}}), True,
                                          "zero_optimization.offload_optimizer", "error", "ZeRO-Offload"),
        "client and config optimizer": (m(BASE, {"log_level": "info"}), True, "optimizer", "warning", "ok"),
        "offload_param at stage 2": (m(BASE, {"zero_optimization": {"offload_param": offload}}), False,
                                     "zero_optimization.offload_param", "warning", "ok"),
        "offload_optimizer at stage 0": (m(BASE, {"zero_optimization": {"stage": 0, "offload_optimizer": offload}}),
                                         False, "zero_optimization.offload_optimizer", "warning", "ok"),
        "nvme at stage 2": (m(BASE, {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}), False,
                            "zero_optimization.offload_optimizer.device", "warning", "ok"),
        "offload with torch_adam": (m(BASE, {"optimizer": {"params": {"torch_adam": True}},
                                              "zero_optimization": {"offload_optimizer": offload}}), False,
                                    "optimizer.params.torch_adam", "warning", "ok"),
        "offload with torch_adam in bf16": (m(BASE, {"optimizer": {"params": {"torch_adam": True}}, "bf16": BF16,
                                                      "zero_optimization": {"offload_optimizer": offload}}), False,
                                            "optimizer.params.torch_adam", "warning", "ok"),
        "offload with SGD": (m(BASE, {"optimizer": SGD, "zero_allow_untested_optimizer": True,
                                      "zero_optimization": {"offload_optimizer": offload}}), False, "optimizer.type",
                             "warning", "ok"),
        "offload with SGD in bf16": (m(BASE, {"optimizer": SGD, "zero_allow_untested_optimizer": True, "bf16": BF16,
                                              "zero_optimization": {"offload_optimizer": offload}}), False,
                                     "optimizer.type", "warning", "ok"),
        "pin_memory here": (m(BASE, {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}),
                            False, None, None, "ok"),
        "fp16 on this device": (m(BASE, {"fp16": {"enabled": True}}), False, "fp16.enabled",
                                None if env.supports("fp16") else "error",
                                "ok" if env.supports("fp16") else "not supported on your device"),
        # stage-3 failures last: a failed ZeRO-3 initialize leaves the least behind at the end
        "nvme without nvme_path": (m(BASE, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}),
                                   False, "zero_optimization.offload_param.nvme_path", "error", "nvme_path"),
        "nvme here": (m(BASE, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                                   "nvme_path": nvme_dir}}}),
                      False, "zero_optimization.offload_param.device",
                      None if environment.nvme_offload_support()[0] else "error",
                      "ok" if environment.nvme_offload_support()[0] else "any failure"),
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    import os

    os.environ.pop(WORLD_SIZE_VARIABLE, None)
    env = environment.detect(2)
    cases = _launch_cases(env, str(tmp_path_factory.mktemp("nvme")))
    folder = tmp_path_factory.mktemp("rules")
    specs = {name: launch.RunSpec(config, model="linear", steps=1, check=False, client_optimizer=client,
                                  on_error="record", out=folder / name.replace(" ", "-"),
                                  probes=("timing", "placement"))
             for name, (config, client, *_rest) in cases.items()}
    results = launch.sweep(specs, name=f"config-rules-{folder.name}", world_size=2, progress=False, timeout=600)
    log = (launch.RUNS_DIR / f"config-rules-{folder.name}" / "launch.log").read_text()
    return env, cases, results, log


CASE_NAMES = list(_launch_cases(environment.Environment("cpu", "x", 0, 2, "gloo", 2, "", ("fp32",), "", ""),
                                "/tmp"))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_checker_agrees_with_what_a_launch_does(outcomes, name):
    env, cases, results, _ = outcomes
    config, client, key, severity, expected = cases[name]
    result = results[name]
    if expected == "ok":
        assert isinstance(result, records.Record), f"DeepSpeed refused it: {result}"
    else:
        assert isinstance(result, launch.RunFailed), "DeepSpeed trained it"
        assert expected == "any failure" or expected in str(result), str(result)
    findings = configs.check(config, 2, env, client)
    if key is None:
        assert [f for f in findings if f.severity == "error"] == [], findings
    elif severity is not None:
        assert [f for f in findings if f.key == key and f.severity == severity], findings


def test_ignored_settings_change_nothing_measured(outcomes):
    _, _, results, _ = outcomes
    control2, control0 = results["control stage 2"], results["control stage 0"]
    for name in ("offload_param at stage 2", "unknown top-level key"):
        assert results[name].losses == control2.losses, name
        assert results[name]["basic_optimizer"] == control2["basic_optimizer"], name
    # NVMe below stage 3 becomes CPU offload: DeepSpeed's CPU Adam, as with device "cpu"
    cpu_offload = results["control CPU offload"]
    assert results["nvme at stage 2"]["basic_optimizer"] == cpu_offload["basic_optimizer"] == "DeepSpeedCPUAdam"
    assert results["nvme at stage 2"].losses == cpu_offload.losses
    # at stage 0, offload_optimizer only swaps in DeepSpeed's CPU Adam
    assert results["offload_optimizer at stage 0"]["basic_optimizer"] == "DeepSpeedCPUAdam"
    assert control0["basic_optimizer"] != "DeepSpeedCPUAdam"


def test_client_optimizer_wins_over_the_configs(outcomes):
    _, _, results, log = outcomes
    assert results["client and config optimizer"]["basic_optimizer"] == "AdamW"  # torch's, the script's
    assert results["control stage 2"]["basic_optimizer"] != "AdamW"
    assert "Using client Optimizer as basic optimizer" in log


def test_offload_runs_the_optimizer_the_checker_names(outcomes):
    _, _, results, _ = outcomes
    # torch_adam or a torch optimizer with offload: torch's class steps on the CPU, not DeepSpeed's CPU Adam
    assert results["control CPU offload"]["basic_optimizer"] == "DeepSpeedCPUAdam"
    for precision in ("", " in bf16"):
        assert results[f"offload with torch_adam{precision}"]["basic_optimizer"] == "AdamW"
        assert results[f"offload with SGD{precision}"]["basic_optimizer"] == "SGD"


def test_pinning_pins_nothing_on_cpu_ranks(outcomes):
    env, _, results, _ = outcomes
    placement = results["pin_memory here"]["memory.placement_bytes_per_rank"]
    host = [sum(rank["host"].values()) for rank in placement]
    assert all(bytes_ > 0 for bytes_ in host)  # the optimizer really is on the host side
    if not env.is_gpu:
        assert [rank["pinned_bytes"] for rank in placement] == [0, 0]
    else:
        assert all(rank["pinned_bytes"] > 0 for rank in placement)


# --- fp16 loss-scaling rules, against DeepSpeed's own loss scalers (a CPU cannot launch fp16) ------

@pytest.fixture(autouse=False)
def rank_zero():
    """DeepSpeed's DynamicLossScaler asks deepspeed.comm for the rank to log an overflow: answer 0."""
    from unittest import mock

    from deepspeed.runtime.fp16 import loss_scaler

    with mock.patch.object(loss_scaler, "dist", mock.Mock(get_rank=lambda *a, **k: 0)):
        yield

def test_static_loss_scale_ignores_the_dynamic_knobs():
    from helpers.topics import precision

    section = {"loss_scale": 1024, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 1}
    scaler = precision.make_loss_scaler(section)
    for overflow in (True, False, False, False, True):
        scaler.update_scale(overflow)
    assert type(scaler).__name__ == "LossScaler" and scaler.cur_scale == 1024
    config = m(BASE, {"fp16": {"enabled": True, **section}})
    assert _findings(config, "fp16.initial_scale_power", "warning")
    assert not _findings(m(BASE, {"fp16": {"enabled": True, "initial_scale_power": 20}}),
                         "fp16.initial_scale_power", "warning")


def test_stage_0_halves_on_every_overflow_whatever_the_hysteresis(rank_zero):
    import types

    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from helpers.topics import precision

    section = {"initial_scale_power": 16, "hysteresis": 2}
    args = precision.fp16_settings(section).dynamic_loss_scale_args()
    # stage 0's optimizers keep the scale in a LossScaleConfig and update it with this method
    stage0 = types.SimpleNamespace(verbose=False, loss_scale_config=LossScaleConfig(torch.float16, True, 0, args))
    FP16_UnfusedOptimizer._update_scale(stage0, True)
    assert stage0.loss_scale_config.cur_scale == 2**15  # halved at the first overflow
    zero = precision.make_loss_scaler(section)  # stages 1-3
    zero.update_scale(True)
    assert zero.cur_scale == 2**16  # hysteresis 2: the first overflow only uses up hysteresis
    config = m(BASE, {"fp16": {"enabled": True, **section}})
    assert _findings(m(config, {"zero_optimization": {"stage": 0}}), "fp16.hysteresis", "warning")
    assert not _findings(config, "fp16.hysteresis", "warning")


def test_min_loss_scale_above_the_initial_scale_raises_it_at_the_first_overflow(rank_zero):
    from helpers.topics import precision

    section = {"initial_scale_power": 10, "min_loss_scale": 4096, "hysteresis": 1}
    scaler = precision.make_loss_scaler(section)
    scaler.update_scale(True)
    assert scaler.cur_scale == 4096 > 2**10
    assert _findings(m(BASE, {"fp16": {"enabled": True, **section}}), "fp16.min_loss_scale", "warning")
    assert not _findings(m(BASE, {"fp16": {"enabled": True, "min_loss_scale": 1024, "initial_scale_power": 10}}),
                         "fp16.min_loss_scale", "warning")
