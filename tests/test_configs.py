"""helpers.core.configs: loading, merging and the checker's findings, plus `python -m helpers check`."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import torch

from helpers.core import configs, environment, probes
from helpers.core.environment import REPO_ROOT

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


def _env(precisions=("fp32", "bf16", "fp16"), device="cpu", gpus=0) -> environment.Environment:
    return environment.Environment(
        device=device, device_name="Test device", gpu_count=gpus, cpu_cores=2,
        backend="gloo" if device == "cpu" else "nccl", default_world_size=2, world_size_source="test",
        precisions=tuple(precisions), torch_version="0", deepspeed_version="0")


def _by_key(findings, key, severity=None):
    return [f for f in findings if f.key == key and (severity is None or f.severity == severity)]


def _errors(findings):
    return [f for f in findings if f.severity == "error"]


# --- the source article's config --------------------------------------------------------------

def test_source_article_on_8_ranks_batch_error_and_offload_param_warning():
    findings = configs.check(configs.load("source_article"), world_size=8)
    batch = _by_key(findings, "train_batch_size", "error")
    assert len(batch) == 1
    assert "32 != 4 * 8 * 8" in batch[0].rule
    assert "= 256" in batch[0].rule
    assert "256" in batch[0].fix
    assert len(_by_key(findings, "zero_optimization.offload_param", "warning")) == 1
    # errors come first
    severities = [f.severity for f in findings]
    assert severities == sorted(severities, key=lambda s: s != "error")


def test_source_article_on_one_rank_has_no_batch_error():
    findings = configs.check(configs.load("source_article"), world_size=1)
    assert _by_key(findings, "train_batch_size") == []
    assert _errors(findings) == []  # 32 == 4 * 8 * 1; the offload_param warning remains
    assert len(_by_key(findings, "zero_optimization.offload_param", "warning")) == 1


def test_client_optimizer_with_offload_optimizer_is_an_error():
    config = configs.load("source_article")
    assert _by_key(configs.check(config, 1), "zero_optimization.offload_optimizer") == []
    findings = configs.check(config, 1, client_optimizer=True)
    errors = _by_key(findings, "zero_optimization.offload_optimizer", "error")
    assert len(errors) == 1
    assert "client optimizer" in errors[0].rule


def test_offload_optimizer_without_any_optimizer_is_an_error():
    config = configs.merged(BASE, {"optimizer": None,
                                   "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert len(_by_key(configs.check(config, 2), "optimizer", "error")) == 1


def test_offload_optimizer_at_stage_0_is_a_warning():
    config = configs.merged(BASE, {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    warnings = _by_key(configs.check(config, 2), "zero_optimization.offload_optimizer", "warning")
    assert len(warnings) == 1 and "stage 0" in warnings[0].rule


def test_torch_optimizers_with_offload_warn_with_what_chapter_06_measures_only():
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    torch_adam = configs.merged(BASE, {**offloaded, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    sgd = configs.merged(BASE, {**offloaded, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    texts = [str(f) for f in _by_key(configs.check(torch_adam, 2), "optimizer.params.torch_adam", "warning")
             + _by_key(configs.check(sgd, 2), "optimizer.type", "warning")]
    assert len(texts) == 2
    for text in texts:  # chapter 06 times DeepSpeed's CPU Adam against torch's AdamW: no claim about SGD or a ratio
        assert "instead of its own CPU Adam" in text and "torch's AdamW, default and fused" in text
        assert "slower" not in text and "faster" not in text


def test_offload_param_at_stage_3_is_fine():
    config = configs.merged(BASE, {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert configs.check(config, 2) == []


# --- typos and types --------------------------------------------------------------------------

def test_misspelt_top_level_key_suggests_the_right_one():
    config = configs.merged(BASE, {"train_batch_szie": 8})
    errors = _by_key(configs.check(config, 2), "train_batch_szie", "error")
    assert len(errors) == 1
    assert "train_batch_size" in errors[0].fix


def test_unknown_top_level_key_with_no_close_match_is_an_error():
    errors = _by_key(configs.check(configs.merged(BASE, {"banana": 1}), 2), "banana", "error")
    assert len(errors) == 1
    assert "did you mean" not in errors[0].fix


def test_wrong_type_is_an_error():
    findings = configs.check({"train_batch_size": "32"}, 1)
    errors = _by_key(findings, "train_batch_size", "error")
    assert errors
    assert any("str" in f.rule and "'32'" in f.rule for f in errors)


def test_bool_is_not_a_number():
    errors = _by_key(configs.check(configs.merged(BASE, {"gradient_clipping": True}), 2), "gradient_clipping")
    assert len(errors) == 1 and errors[0].severity == "error"


@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_batch_size_is_an_error(value):
    config = configs.merged(BASE, {"train_micro_batch_size_per_gpu": value})
    assert len(_by_key(configs.check(config, 2), "train_micro_batch_size_per_gpu", "error")) == 1


def test_no_batch_size_at_all_is_an_error():
    config = configs.merged(BASE, {"train_micro_batch_size_per_gpu": None})
    assert len(_by_key(configs.check(config, 2), "train_batch_size", "error")) == 1


def test_train_batch_size_not_divisible_is_an_error():
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}
    errors = _by_key(configs.check(config, 2), "train_batch_size", "error")
    assert len(errors) == 1 and "8" in errors[0].rule
    assert configs.check({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 2) == []


def test_misspelt_zero_key_is_an_error():
    config = configs.merged(BASE, {"zero_optimization": {"overlap_com": True}})
    errors = _by_key(configs.check(config, 2), "zero_optimization.overlap_com", "error")
    assert len(errors) == 1
    assert "overlap_comm" in errors[0].fix


def test_bad_zero_stage_is_an_error():
    config = configs.merged(BASE, {"zero_optimization": {"stage": 4}})
    assert len(_by_key(configs.check(config, 2), "zero_optimization.stage", "error")) == 1


def test_unknown_optimizer_type_is_an_error():
    config = configs.merged(BASE, {"optimizer": {"type": "Adamm"}})
    errors = _by_key(configs.check(config, 2), "optimizer.type", "error")
    assert len(errors) == 1 and "adam" in errors[0].fix.lower()


def test_non_object_config_is_an_error():
    findings = configs.check([1, 2], 2)
    assert len(findings) == 1 and findings[0].severity == "error"


def test_offload_section_that_is_not_an_object_gives_a_finding_not_a_crash():
    # A string such as "cpu" instead of {"device": "cpu"} is a plausible learner mistake: a finding, not a crash.
    config = configs.merged(BASE, {"zero_optimization": {"offload_param": "cpu"}})
    findings = configs.check(config, 2)
    assert any(f.key.startswith("zero_optimization.offload_param") and f.severity == "error" for f in findings)


# --- precision --------------------------------------------------------------------------------

def test_fp16_on_a_device_without_fp16_is_an_error_naming_fp16_enabled():
    config = configs.merged(BASE, {"fp16": {"enabled": True}})
    assert configs.check(config, 2, _env(("fp32", "bf16", "fp16"))) == []
    findings = configs.check(config, 2, _env(("fp32", "bf16")))
    errors = _by_key(findings, "fp16.enabled", "error")
    assert len(errors) == 1
    assert "bf16" in errors[0].fix  # the alternative the device supports


def test_bf16_on_a_device_without_half_precision_suggests_fp32():
    config = configs.merged(BASE, {"bf16": {"enabled": True}})
    errors = _by_key(configs.check(config, 2, _env(("fp32",))), "bf16.enabled", "error")
    assert len(errors) == 1 and "fp32" in errors[0].fix


def test_fp16_and_bf16_both_enabled_is_an_error():
    config = configs.merged(BASE, {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    errors = _by_key(configs.check(config, 2), "fp16.enabled", "error")
    assert len(errors) == 1 and "bf16" in errors[0].rule


def test_more_ranks_than_gpus_is_a_warning():
    # A config may be checked for a bigger machine than this one (launch.run refuses it earlier).
    findings = configs.check(BASE, 4, _env(device="cuda", gpus=2))
    assert len(_by_key(findings, "(world size)", "warning")) == 1
    assert not _by_key(findings, "(world size)", "error")
    assert configs.check(BASE, 2, _env(device="cuda", gpus=2)) == []


# --- the course's configs ---------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_course_configs_are_clean_on_two_ranks(stage):
    config = configs.load(f"zero{stage}")
    assert config["zero_optimization"]["stage"] == stage
    assert configs.check(config, 2) == []
    assert configs.check(configs.for_run(config), 2, environment.detect(2)) == []


def test_load_and_path_of():
    assert configs.path_of("zero2") == REPO_ROOT / "ds_configs" / "zero2.json"
    assert configs.path_of("zero2.json") == REPO_ROOT / "ds_configs" / "zero2.json"
    assert configs.load("zero2") == json.loads((REPO_ROOT / "ds_configs" / "zero2.json").read_text())
    with pytest.raises(FileNotFoundError, match="zero2"):  # the message lists what ds_configs/ has
        configs.load("no_such_config")


def test_load_rejects_what_is_neither_json_nor_hjson(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": [1, }')
    with pytest.raises(configs.ConfigFileError, match="not valid JSON or hjson"):
        configs.load(bad)


# --- merged / for_run -------------------------------------------------------------------------

def test_merged_deep_merges_and_none_removes():
    base = {"a": 1, "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_param": {"device": "cpu"}},
            "fp16": {"enabled": True}}
    snapshot = json.loads(json.dumps(base))
    result = configs.merged(base, {"a": None, "zero_optimization": {"stage": 3, "offload_param": None},
                                   "fp16": 5, "new": {"x": [1]}})
    assert result == {"zero_optimization": {"stage": 3, "overlap_comm": True}, "fp16": 5, "new": {"x": [1]}}
    assert base == snapshot  # the input is not modified


def test_merged_returns_a_deep_copy():
    base = {"zero_optimization": {"stage": 2}}
    overrides = {"optimizer": {"params": {"lr": 1}}}
    result = configs.merged(base, overrides)
    result["zero_optimization"]["stage"] = 0
    result["optimizer"]["params"]["lr"] = 2
    assert base == {"zero_optimization": {"stage": 2}}
    assert overrides == {"optimizer": {"params": {"lr": 1}}}
    assert configs.merged(base) == base and configs.merged(base) is not base


def test_for_run_adds_what_the_probes_need_under_the_config():
    run = configs.for_run({"steps_per_print": 5, "comms_logger": {"verbose": True}}, probes.config_for(("comm",)))
    assert run["steps_per_print"] == 5
    assert run["comms_logger"]["enabled"] is True and run["comms_logger"]["verbose"] is True
    assert "comms_logger" not in configs.for_run({}, probes.config_for(("timing",)))  # no logger unless a probe asks


# --- check_or_raise ---------------------------------------------------------------------------

def test_check_or_raise_raises_config_error_listing_findings():
    config = configs.load("source_article")
    with pytest.raises(configs.ConfigError) as caught:
        configs.check_or_raise(config, 8, source="source_article")
    error = caught.value
    assert isinstance(error, ValueError)
    keys = {f.key for f in error.findings}
    assert {"train_batch_size", "zero_optimization.offload_param"} <= keys
    message = str(error)
    assert message.startswith("source_article: 1 error(s)")
    assert "32 != 4 * 8 * 8" in message
    assert "WARNING zero_optimization.offload_param" in message


def test_check_or_raise_returns_warnings_when_there_are_no_errors():
    warnings = configs.check_or_raise(configs.load("source_article"), 1)
    assert [f.key for f in warnings] == ["zero_optimization.offload_param"]
    assert configs.check_or_raise(configs.load("zero2"), 2) == []


def test_finding_str():
    finding = configs.Finding("error", "k", "rule text", "fix text")
    assert str(finding) == "ERROR k: rule text\n    fix: fix text"


# --- the command line -------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "helpers", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_cli_check_source_article_on_8_ranks_exits_1():
    result = _cli("check", "source_article", "--world-size", "8")
    assert result.returncode == 1, result.stderr
    assert "ERROR train_batch_size" in result.stdout
    assert "32 != 4 * 8 * 8" in result.stdout
    assert "WARNING zero_optimization.offload_param" in result.stdout
    assert "on 8 rank(s)" in result.stdout


def test_cli_check_clean_config_exits_0():
    result = _cli("check", "zero2", "--world-size", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 error(s), 0 warning(s)" in result.stdout


def test_zero_section_reads_a_block_as_deepspeed_does_and_names_its_refusal():
    assert configs.zero_section({"stage": 3}).stage == 3
    assert configs.zero_section({"stage": 2}).overlap_comm is not None  # DeepSpeed's default filled in
    with pytest.raises(ValueError, match="DeepSpeed refuses the block"):
        configs.zero_section({"stage": 3, "zero_hpz_partition_sise": 8})
    with pytest.raises(ValueError, match="list is not a block"):
        configs.zero_section([3])


def test_refusal_gives_the_checkers_findings_then_deepspeeds_own_refusal_in_one_sentence():
    good = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert configs.refusal(good, 2) is None and configs.refusal(good, 2, parse=True) is None
    bad_batch = {**good, "train_batch_size": 30}
    assert configs.refusal(bad_batch, 2).startswith("the checker finds: train_batch_size: ")
    assert configs.refusal(bad_batch, 2, warnings=True).startswith("the checker finds: error train_batch_size: ")


# --- keywords a constructor hands on, "auto", the machine checked for ---------------------------

class _Forwarding(torch.optim.AdamW):
    """An optimizer that takes one keyword of its own and hands the rest to torch's AdamW, as ZenFlowCPUAdam does."""

    def __init__(self, *args, extra: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra = extra


class _ForwardingStep(torch.optim.lr_scheduler.StepLR):
    def __init__(self, optimizer, *args, verbose_name: str = "", **kwargs):
        super().__init__(optimizer, *args, **kwargs)


def test_keywords_follow_kwargs_through_the_class_hierarchy():
    keywords = configs._keywords(_Forwarding)
    assert "extra" in keywords and {"lr", "betas", "eps", "weight_decay"} <= set(keywords)
    assert "params" not in keywords and "args" not in keywords and "kwargs" not in keywords
    assert keywords["lr"].default == inspect.signature(torch.optim.AdamW).parameters["lr"].default
    # the scheduler's own first argument (the optimizer) is left out; StepLR's keywords are followed
    assert {"verbose_name", "step_size", "gamma"} <= set(configs._keywords(_ForwardingStep))
    assert "optimizer" not in configs._keywords(_ForwardingStep)
    # a constructor without **kwargs stops there: torch's AdamW reaches no further than its own signature
    assert "defaults" not in configs._keywords(torch.optim.AdamW)


def test_a_forwarding_optimizer_takes_what_it_forwards():
    from unittest import mock

    config = configs.merged(BASE, {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99], "beta": 1}}})
    builder = configs.OptimizerBuilder(_Forwarding, {}, frozenset(), None)
    with mock.patch.object(configs, "optimizer_builder", lambda _config: builder):
        findings = [f for f in configs.check(config, 2) if f.key.startswith("optimizer.params")]
    assert [f.key for f in findings] == ["optimizer.params.beta"]  # betas reaches AdamW; beta is nobody's
    assert "'betas'" in findings[0].fix


def test_auto_for_plain_deepspeed_names_who_fills_it_and_the_trainer_mode_fills_it():
    config = configs.merged(BASE, {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                   "bf16": {"enabled": "auto"}})
    plain = {f.key: f for f in configs.check(config, 2)}
    assert set(plain) == {"train_micro_batch_size_per_gpu", "gradient_clipping", "bf16.enabled"}  # nothing else
    assert plain["train_micro_batch_size_per_gpu"].severity == "error"
    assert "Trainer" in plain["gradient_clipping"].rule and "write 1.0 " in plain["gradient_clipping"].fix
    assert plain["bf16.enabled"].severity == "warning" and "default, false" in plain["bf16.enabled"].rule
    assert configs.check(config, 2, starter="trainer") == []
    # an "auto" the Trainer does not fill stays a finding in the Trainer's mode
    unknown = configs.merged(BASE, {"zero_optimization": {"allgather_bucket_size": "auto"}})
    (left,) = configs.check(unknown, 2, starter="trainer")
    assert left.key == "zero_optimization.allgather_bucket_size" and "fills no" in left.rule
    with pytest.raises(ValueError, match="starter"):
        configs.check(BASE, 2, starter="accelerator")


def test_the_trainer_passes_its_own_optimizer_when_the_config_has_none():
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    assert _by_key(configs.check(config, 2), "optimizer", "error")
    assert configs.check(config, 2, starter="trainer") == []


def test_zero_3_without_an_optimizer_is_accepted_for_inference():
    (finding,) = configs.check({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, 2)
    assert finding.key == "optimizer" and finding.severity == "warning" and "first backward" in finding.rule


def test_a_gpu_target_accepts_fp16_this_cpu_may_refuse():
    config = configs.merged(BASE, {"fp16": {"enabled": True}})
    assert _by_key(configs.check(config, 2, _env(precisions=("fp32",))), "fp16.enabled", "error")
    assert configs.check(config, 8, configs.target("cuda", 8)) == []
    target = configs.target("cuda:7.0", 8)
    assert target.supports("fp16") and not target.supports("bf16") and target.gpu_count == 8
    (bf16,) = configs.check(configs.merged(BASE, {"bf16": {"enabled": True}}), 8, target)
    assert bf16.rule.startswith("DeepSpeed refuses bf16 on the target") and "on that device use fp16" in bf16.fix


def test_cli_check_for_the_trainer_and_for_a_target(tmp_path, capsys):
    from helpers.__main__ import main

    path = tmp_path / "hf.json"
    path.write_text(json.dumps(configs.merged(BASE, {"train_micro_batch_size_per_gpu": "auto",
                                                     "fp16": {"enabled": True}})))
    assert main(["check", str(path), "--world-size", "8", "--target", "cuda"]) == 1  # "auto" for plain DeepSpeed
    out = capsys.readouterr().out
    assert "device checks for the target: 8 x CUDA GPU" in out and "fp16" not in out.split("\n", 1)[1]
    assert main(["check", str(path), "--world-size", "8", "--target", "cuda", "--for", "trainer"]) == 0
    out = capsys.readouterr().out
    assert "started by Hugging Face's Trainer" in out
    assert "filled by the Trainer: train_micro_batch_size_per_gpu \"auto\" -> 8" in out
    assert main(["check", str(path), "--gpus", "8"]) == 2  # --gpus says nothing without --target
