"""Every rule of the config checker, each against what DeepSpeed 0.19.8 really does with that config.

Two kinds of evidence, never a belief:
- DeepSpeed's own parser (``DeepSpeedConfig``, through :func:`helpers.core.configs.deepspeed_parse`, or
  ``DeepSpeedConfig(path)`` for files) refuses or accepts the config;
- a real 2-rank launch: one sweep trains every config below in the same ranks, recording each
  run's error instead of stopping (``on_error="record"``). A case that shows its effect in the losses or
  the collectives trains a few steps (or with the comm probe); the others one step.
"""

from __future__ import annotations

import math

import pytest

from helpers.core import configs, environment, launch, records
from helpers.core.environment import WORLD_SIZE_VARIABLE

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
BF16 = {"enabled": True}
SGD = {"type": "SGD", "params": {"lr": 1e-3}}
m = configs.merged
DECAY = {"optimizer": {"params": {"weight_decay": 0.5}}}  # strong enough to tell decoupled decay from L2 in 3 steps
CLIPPED = m(BASE, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True})
WARMUP_DECAY = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}}
STEPS = lambda n: {"steps": n}  # noqa: E731
COMM = {"steps": 2, "probes": ("timing", "placement", "comm")}  # the comm probe measures step 2


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
    """name -> (config, client optimizer, checker key, severity, expected outcome[, RunSpec options]);
    without options a case trains one step with the timing and placement probes."""
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
        # optimizer.params against the class DeepSpeed builds (FusedAdam here, DeepSpeedCPUAdam with offload)
        "optimizer param typo": (m(BASE, {"optimizer": {"params": {"beta1": 0.9}}}), False,
                                 "optimizer.params.beta1", "error", "unexpected keyword argument 'beta1'"),
        "optimizer param DeepSpeed passes": (m(BASE, {"optimizer": {"params": {"adamw_mode": False}},
                                                       "zero_optimization": {"offload_optimizer": offload}}), False,
                                             "optimizer.params.adamw_mode", "error",
                                             "multiple values for keyword argument 'adamw_mode'"),
        "lr as a string": (m(BASE, {"optimizer": {"params": {"lr": "1e-3"}}}), False, "optimizer.params.lr", "error",
                           "incompatible function arguments"),
        "betas not a pair": (m(BASE, {"optimizer": {"params": {"betas": [0.9]}}}), False, "optimizer.params.betas",
                             "error", "not enough values to unpack"),
        "torch Adam with a negative lr": (m(BASE, {"optimizer": {"params": {"lr": -1e-3, "torch_adam": True}}}), False,
                                          "optimizer.params.lr", "error", "Invalid learning rate"),
        "amsgrad": (m(BASE, {"optimizer": {"params": {"amsgrad": True}}}), False, "optimizer.params.amsgrad", "error",
                    "does not support the AMSGrad variant"),
        "control stage 2, 3 steps": (BASE, False, None, None, "ok", STEPS(3)),
        "FusedAdam with a negative lr": (m(BASE, {"optimizer": {"params": {"lr": -1e-2}}}), False,
                                         "optimizer.params.lr", "warning", "ok", STEPS(3)),
        "FusedAdam with beta2 = 1": (m(BASE, {"optimizer": {"params": {"betas": [0.9, 1.0]}}}), False,
                                     "optimizer.params.betas", "warning", "ok", STEPS(3)),
        "fp32_optimizer_states without offload": (m(BASE, {"optimizer": {"params": {"fp32_optimizer_states": False}}}),
                                                  False, "optimizer.params.fp32_optimizer_states", "warning", "ok",
                                                  STEPS(3)),
        "AdamW with weight decay": (m(BASE, DECAY), False, None, None, "ok", STEPS(3)),
        "AdamW with adam_w_mode false": (m(BASE, m(DECAY, {"optimizer": {"params": {"adam_w_mode": False}}})), False,
                                         "optimizer.params.adam_w_mode", "warning", "ok", STEPS(3)),
        "Adam with weight decay": (m(BASE, m(DECAY, {"optimizer": {"type": "Adam"}})), False, "optimizer.type",
                                   "warning", "ok", STEPS(3)),
        "Adam with L2 weight decay": (m(BASE, m(DECAY, {"optimizer": {"type": "Adam",
                                                                      "params": {"adam_w_mode": False}}})),
                                      False, None, None, "ok", STEPS(3)),
        "torch_adam Adam with weight decay": (m(BASE, m(DECAY, {"optimizer": {"type": "Adam",
                                                                               "params": {"torch_adam": True}}})),
                                              False, "optimizer.type", "warning", "ok"),
        # scheduler.params against the scheduler DeepSpeed builds
        "scheduler param typo": (m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}}), False,
                                 "scheduler.params.warmup_steps", "error",
                                 "unexpected keyword argument 'warmup_steps'"),
        "scheduler without total_num_steps": (m(BASE, {"scheduler": {"type": "WarmupDecayLR", "params": {}}}), False,
                                              "scheduler.params.total_num_steps", "error",
                                              "missing 1 required positional argument: 'total_num_steps'"),
        "warmup steps as a float": (m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}}}),
                                    False, "scheduler.params.warmup_num_steps", "error", "must be a positive integer"),
        "warmup_max_lr as a string": (m(BASE, {"scheduler": {"type": "WarmupLR",
                                                             "params": {"warmup_max_lr": "1e-3"}}}), False,
                                      "scheduler.params.warmup_max_lr", "error", "unsupported operand"),
        "warmup of 0 steps": (m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}), False,
                              "scheduler.params.warmup_num_steps", "error", "must be a positive integer, got 0"),
        "unknown warmup_type": (m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}),
                                False, "scheduler.params.warmup_type", "warning", "ok"),
        "total below warmup": (m(BASE, {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 2,
                                                                                         "warmup_num_steps": 4}}}),
                               False, "scheduler.params.total_num_steps", "warning", "ok"),
        "warmup of 1 step": (m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}}), False,
                             "scheduler.params.warmup_num_steps", "warning", "ok", STEPS(4)),
        "warmup of 2 steps": (m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}), False,
                              None, None, "ok", STEPS(4)),
        "warmup of 3 steps": (m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}), False,
                              None, None, "ok", STEPS(4)),
        "warmup of 2 steps, lr 1e-2": (m(BASE, {"optimizer": {"params": {"lr": 1e-2}},
                                                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}),
                                       False, None, None, "ok", STEPS(4)),
        "WarmupDecayLR, lr 1e-4": (m(BASE, m(WARMUP_DECAY, {"optimizer": {"params": {"lr": 1e-4}}})), False,
                                   "optimizer.params.lr", "warning", "ok", STEPS(4)),
        "WarmupDecayLR, lr 1e-2": (m(BASE, m(WARMUP_DECAY, {"optimizer": {"params": {"lr": 1e-2}}})), False,
                                   "optimizer.params.lr", "warning", "ok", STEPS(4)),
        # settings that turn a feature off, or that nothing reads
        "gradient_clipping 0": (m(CLIPPED, {"gradient_clipping": 0}), False, "gradient_clipping", "warning", "ok",
                                STEPS(3)),
        "gradient_clipping 1e9": (m(CLIPPED, {"gradient_clipping": 1e9}), False, None, None, "ok", STEPS(3)),
        "gradient_clipping 1e-3": (m(CLIPPED, {"gradient_clipping": 1e-3}), False, None, None, "ok", STEPS(3)),
        "fp16 knobs without enabled": (m(BASE, {"fp16": {"loss_scale": 128, "initial_scale_power": 8}}), False,
                                       "fp16.loss_scale", "warning", "ok", STEPS(3)),
        "fp16 auto_cast with fp16 off": (m(BASE, {"fp16": {"enabled": False, "auto_cast": True}}), False,
                                         "fp16.auto_cast", "error", "dtype"),
        "control stage 0, comm": (m(BASE, {"zero_optimization": {"stage": 0}}), False, None, None, "ok", COMM),
        "ZeRO knobs at stage 0": (m(BASE, {"zero_optimization": {"stage": 0, "overlap_comm": True,
                                                                 "contiguous_gradients": True,
                                                                 "reduce_bucket_size": 10}}),
                                  False, "zero_optimization.overlap_comm", "warning", "ok", COMM),
        "control stage 2, comm": (BASE, False, None, None, "ok", COMM),
        "small reduce buckets at stage 2": (m(BASE, {"zero_optimization": {"reduce_bucket_size": 10}}), False, None,
                                            None, "ok", COMM),
        # stage-3 failures last: a failed ZeRO-3 initialize leaves the least behind at the end
        "ZeRO-3 without optimizer": (m(BASE, {"optimizer": None, "zero_optimization": {"stage": 3}}), False,
                                     "optimizer", "warning", "set_gradient_accumulation_boundary"),
        "nvme without nvme_path": (m(BASE, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}),
                                   False, "zero_optimization.offload_param.nvme_path", "error", "nvme_path"),
        "nvme here": (m(BASE, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                                   "nvme_path": nvme_dir}}}),
                      False, "zero_optimization.offload_param.device",
                      None if environment.nvme_offload_support()[0] else "error",
                      "ok" if environment.nvme_offload_support()[0] else "any failure"),
    }


def _options(case: tuple) -> dict:
    return case[5] if len(case) > 5 else {}


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    import os

    os.environ.pop(WORLD_SIZE_VARIABLE, None)
    env = environment.detect(2)
    cases = _launch_cases(env, str(tmp_path_factory.mktemp("nvme")))
    folder = tmp_path_factory.mktemp("rules")
    specs = {name: launch.RunSpec(config, model="linear", check=False, client_optimizer=client,
                                  on_error="record", out=folder / _folder_name(name),
                                  **{"steps": 1, "probes": ("timing", "placement"), **options})
             for name, (config, client, *_rest) in cases.items() for options in [_options(cases[name])]}
    results = launch.sweep(specs, name=f"config-rules-{folder.name}", world_size=2, progress=False, timeout=600)
    log = (launch.RUNS_DIR / f"config-rules-{folder.name}" / "launch.log").read_text()
    return env, cases, results, log


CASE_NAMES = list(_launch_cases(environment.Environment("cpu", "x", 0, 2, "gloo", 2, "", ("fp32",), "", ""),
                                "/tmp"))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_checker_agrees_with_what_a_launch_does(outcomes, name):
    env, cases, results, _ = outcomes
    config, client, key, severity, expected = cases[name][:5]
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


def test_deepspeeds_adam_trains_with_what_torchs_adam_refuses(outcomes):
    _, _, results, _ = outcomes
    control = results["control stage 2, 3 steps"].losses  # lr 1e-3, on the same batches
    ascent = results["FusedAdam with a negative lr"].losses  # lr -1e-2: a step up the gradient, every step
    assert ascent[0] == control[0] and all(a > c for a, c in zip(ascent[1:], control[1:]))
    never_decays = results["FusedAdam with beta2 = 1"].losses  # 1 - beta2**t = 0: the first step divides 0 by 0
    assert math.isfinite(never_decays[0]) and all(math.isnan(x) for x in never_decays[1:])


def test_deepspeeds_own_keys_that_change_nothing(outcomes):
    _, cases, results, _ = outcomes
    assert results["fp32_optimizer_states without offload"].losses == results["control stage 2, 3 steps"].losses
    decoupled = results["AdamW with weight decay"].losses
    assert results["AdamW with adam_w_mode false"].losses == decoupled  # "AdamW" is AdamW whatever adam_w_mode says
    assert results["Adam with weight decay"].losses == decoupled  # "Adam" is AdamW too ...
    assert results["Adam with L2 weight decay"].losses != decoupled  # ... unless adam_w_mode is false
    assert results["torch_adam Adam with weight decay"]["basic_optimizer"] == "AdamW"
    for quiet in ("AdamW with weight decay", "Adam with L2 weight decay"):
        assert [f for f in configs.check(cases[quiet][0], 2) if f.severity == "warning"] == [], quiet
    offloaded = m(BASE, {"optimizer": {"params": {"fp32_optimizer_states": False}},
                         "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})  # CPU Adam takes it
    assert not _findings(offloaded, "optimizer.params.fp32_optimizer_states", "warning")


def test_scheduler_warnings_are_the_ones_deepspeed_logs(outcomes):
    _, _, _, log = outcomes
    assert "Using unknown warmup_type: cosine" in log
    assert "total_num_steps 2 is less than warmup_num_steps 4" in log


def test_a_warmup_of_one_step_runs_as_two(outcomes):
    _, _, results, _ = outcomes
    one, two, three = (results[f"warmup of {n}"].losses for n in ("1 step", "2 steps", "3 steps"))
    assert one == two != three


def test_warmup_decay_sets_the_learning_rate_itself(outcomes):
    _, cases, results, _ = outcomes
    assert results["WarmupDecayLR, lr 1e-4"].losses == results["WarmupDecayLR, lr 1e-2"].losses
    # WarmupLR without warmup_max_lr warms up to the optimizer's lr: there the lr counts, and no warning
    assert results["warmup of 2 steps"].losses != results["warmup of 2 steps, lr 1e-2"].losses
    assert not _findings(cases["warmup of 2 steps, lr 1e-2"][0], "optimizer.params.lr", "warning")
    assert not _findings(m(BASE, WARMUP_DECAY), "optimizer.params.lr", "warning")  # lr 1e-3 is its peak


def test_gradient_clipping_0_clips_nothing(outcomes):
    _, _, results, _ = outcomes
    off, never, tight = (results[f"gradient_clipping {v}"].losses for v in ("0", "1e9", "1e-3"))
    assert off == never != tight


def test_fp16_knobs_without_enabled_train_as_fp32(outcomes):
    _, _, results, _ = outcomes
    assert results["fp16 knobs without enabled"].losses == results["control stage 2, 3 steps"].losses
    assert not _findings(m(BASE, {"fp16": {"enabled": False, "loss_scale": 128}}), "fp16.loss_scale", "warning")


def test_zero_knobs_change_no_collective_at_stage_0(outcomes):
    _, _, results, _ = outcomes
    by_op = lambda name: results[name]["comm.by_op"]  # noqa: E731
    assert by_op("ZeRO knobs at stage 0") == by_op("control stage 0, comm")
    assert by_op("small reduce buckets at stage 2") != by_op("control stage 2, comm")  # where ZeRO reads it, it shows


# --- optimizer and scheduler parameters: what the checker derives from the builders' signatures --------

def _torch_optimizers() -> list[str]:
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"
            and n.lower() not in DEEPSPEED_OPTIMIZERS]


@pytest.mark.parametrize("name", _torch_optimizers())
def test_every_torch_optimizer_takes_its_own_defaults(name):
    import inspect

    import torch

    defaults = {k: list(p.default) if isinstance(p.default, tuple) else p.default
                for k, p in list(inspect.signature(getattr(torch.optim, name)).parameters.items())[1:]
                if p.default is not inspect.Parameter.empty and (p.default is None or isinstance(
                    p.default, (bool, int, float, str, tuple)))}
    config = m(BASE, {"optimizer": {"type": name, "params": defaults}, "zero_optimization": {"stage": 0}})
    assert [f for f in configs.check(config, 2) if f.key.startswith("optimizer")] == []


@pytest.mark.parametrize("params", [{"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-6,
                                     "bias_correction": True},
                                    {"lr": 1e-3, "torch_adam": True, "foreach": False, "amsgrad": True,
                                     "maximize": False},
                                    {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}])
@pytest.mark.parametrize("offload", [False, True])
def test_adam_parameters_deepspeed_takes_are_clean(params, offload):
    config = m(BASE, {"optimizer": {"type": "Adam", "params": params}})
    if offload:
        config = m(config, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    findings = [f for f in configs.check(config, 2) if f.key.startswith("optimizer.params")
                and f.key != "optimizer.params.torch_adam"]  # torch_adam with offload has a rule of its own
    assert findings == []


def test_optimizer_parameter_types_come_from_the_signature():
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 0}}
    (nesterov,) = _findings(m(BASE, m(sgd, {"optimizer": {"params": {"nesterov": "yes"}}})),
                            "optimizer.params.nesterov", "error")
    assert "true or false" in nesterov.rule
    (decay,) = _findings(m(BASE, m(sgd, {"optimizer": {"type": "Adagrad", "params": {"lr_decay": -1}}})),
                         "optimizer.params.lr_decay", "error")
    assert "Invalid lr_decay value" in decay.rule  # torch's own constructor, not the course, refuses it
    (typo,) = _findings(m(BASE, m(sgd, {"optimizer": {"type": "RMSprop", "params": {"alfa": 0.9}}})),
                        "optimizer.params.alfa", "error")
    assert "'alpha'" in typo.fix
    (lion,) = _findings(m(BASE, {"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}}), "optimizer.params.eps",
                        "error")
    assert "FusedLion" in lion.rule  # DeepSpeed's Lion takes no eps
    amsgrad = m(BASE, {"optimizer": {"params": {"amsgrad": True}},
                       "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    (cpu,) = _findings(amsgrad, "optimizer.params.amsgrad", "error")
    assert "DeepSpeedCPUAdam" in cpu.rule  # with optimizer offload, the class checked is DeepSpeed's CPU Adam
    (params,) = _findings({**BASE, "optimizer": {"type": "AdamW", "params": [1e-3]}}, "optimizer.params", "error")
    assert "an object" in params.rule


def test_the_client_optimizer_replaces_the_sections_parameters():
    config = m(BASE, {"optimizer": {"params": {"beta1": 0.9}}})
    assert _findings(config, "optimizer.params.beta1", "error")
    assert not _findings(config, "optimizer.params.beta1", "error", client_optimizer=True)


SCHEDULER_REQUIRED = {"WarmupDecayLR": {"total_num_steps": 2000}, "WarmupCosineLR": {"total_num_steps": 2000},
                      "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
def test_deepspeeds_schedulers_take_their_own_defaults(kind):
    import inspect

    from deepspeed.runtime import lr_schedules

    defaults = {k: p.default for k, p in list(inspect.signature(getattr(lr_schedules, kind)).parameters.items())[1:]
                if p.default is not inspect.Parameter.empty}
    config = m(BASE, {"scheduler": {"type": kind, "params": {**defaults, **SCHEDULER_REQUIRED.get(kind, {})}}})
    assert configs.check(config, 2) == []


def test_torch_schedulers_are_checked_too():
    (missing,) = _findings(m(BASE, {"scheduler": {"type": "StepLR", "params": {"gamma": 0.5}}}),
                           "scheduler.params.step_size", "error")
    assert "StepLR needs it" in missing.rule
    assert configs.check(m(BASE, {"scheduler": {"type": "StepLR", "params": {"step_size": 2}}}), 2) == []
    # OneCycleLR sets the learning rate from max_lr: the optimizer's lr is never used
    assert _findings(m(BASE, {"scheduler": {"type": "OneCycleLR", "params": {"max_lr": 0.1, "total_steps": 100}}}),
                     "optimizer.params.lr", "warning")


def test_checking_a_scheduler_keeps_deepspeeds_log_quiet(capsys):
    from deepspeed.utils import logger

    handlers, level = logger.handlers[:], logger.level
    config = m(BASE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})
    assert _findings(config, "scheduler.params.warmup_type", "warning")
    captured = capsys.readouterr()
    assert "warmup_type" not in captured.out + captured.err
    assert (logger.handlers, logger.level) == (handlers, level)


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
