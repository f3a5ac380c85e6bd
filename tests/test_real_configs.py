"""The config checker on real configs from DeepSpeed's and Hugging Face's own repositories (tests/real_configs/,
origins in tests/real_configs/SOURCES.md), checked for the machine they were written for: 8 GPUs.

Every finding on them is listed here with why it is right; a new finding, or one gone, fails the test. Two
starters: plain ``deepspeed.initialize`` (``"deepspeed"``) and Hugging Face's Trainer (``"trainer"``), which
fills each ``"auto"`` it knows before DeepSpeed sees the config.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.core import configs

FOLDER = Path(__file__).parent / "real_configs"
WORLD = 8

#: The placeholders a Hugging Face config leaves for the Trainer: each one an error for plain DeepSpeed
#: (DeepSpeed receives the string), or, inside a section DeepSpeed's config model reads, a warning (the model
#: drops "auto" and uses its default).
HF_TOP = [("error", k) for k in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                                 "train_micro_batch_size_per_gpu")]
HF_OPTIMIZER = [("error", f"optimizer.params.{k}") for k in ("lr", "betas", "eps", "weight_decay")]
HF_WARMUP = [("error", f"scheduler.params.{k}") for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")]
HF_ZERO3 = [("warning", f"zero_optimization.{k}") for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                                             "stage3_param_persistence_threshold")]
#: ZeRO-3 inference configs (sglang): "auto" in keys the Trainer does not fill; DeepSpeed's model drops them.
SGLANG = [("error", "train_batch_size"),  # 1 sample on 8 ranks: DeepSpeed's parser refuses (micro batch 0)
          ("warning", "zero_optimization.stage3_max_live_parameters"),
          ("warning", "zero_optimization.offload_param.buffer_size")]
SGLANG_PLAIN = SGLANG + [("warning", "zero_optimization.stage3_prefetch_bucket_size"),
                         ("warning", "zero_optimization.stage3_param_persistence_threshold"),
                         ("warning", "optimizer")]  # ZeRO-3 without optimizer: inference only

#: file -> (findings with plain deepspeed.initialize, findings with the Trainer), each (severity, key), on 8 GPUs.
EXPECTED: dict[str, tuple[list, list]] = {
    # written for accelerate on 2 ranks: at 8 ranks with sequence_parallel_size 2, DeepSpeed counts 4 groups
    # and refuses train_batch_size 1 (its parser's batch check); gradient_clipping "auto" is accelerate's to fill
    "DeepSpeedExamples__benchmarks_autosp_configs_autosp_config.json": (
        [("error", "gradient_clipping"), ("error", "train_batch_size")], [("error", "train_batch_size")]),
    # a 1-GPU batch (train_batch_size = micro batch) on 8 ranks: DeepSpeed's parser refuses it; "Adam" with
    # weight decay builds DeepSpeed's AdamW (tests/test_config_rules.py measures it)
    "DeepSpeedExamples__compression_cifar_config_ds_config.json": (
        [("error", "train_batch_size"), ("warning", "optimizer.type")],
        [("error", "train_batch_size"), ("warning", "optimizer.type")]),
    "DeepSpeedExamples__inference_sglang_ds_offload_cpu.json": (SGLANG_PLAIN, SGLANG),
    # GPUDirect Storage: DeepSpeed's parser accepts it for a CUDA target (it refuses it on a CPU)
    "DeepSpeedExamples__inference_sglang_ds_offload_nvme_gds.json": (SGLANG_PLAIN, SGLANG),
    # DeepSpeed removed its 1-bit optimizers
    "DeepSpeedExamples__training_BingBertSquad_1-bit_adam_nccl_deepspeed_onebitadam_bsz96_config.json": (
        [("error", "optimizer.type")], [("error", "optimizer.type")]),
    # fp16 on GPUs: nothing to say
    "DeepSpeedExamples__training_BingBertSquad_deepspeed_bsz24_config.json": ([], []),
    # ZenFlowCPUAdam(*args, overlap_step=False, **kwargs) hands lr, betas, eps, weight_decay to DeepSpeedCPUAdam
    "DeepSpeedExamples__training_DeepSpeed-ZenFlow_finetuning_zf_config.json": ([], []),
    # the Trainer's configs: micro batch "auto"; ZeRO-1 with no optimizer (the Trainer passes its own)
    "DeepSpeedExamples__training_autotuning_hf_dsconfigs_ds_config_fp16_z1.json": (
        [("error", "train_micro_batch_size_per_gpu"), ("error", "optimizer")], []),
    "DeepSpeedExamples__training_autotuning_hf_dsconfigs_ds_config_tune.json": (
        [("error", "train_micro_batch_size_per_gpu")], []),
    "DeepSpeedExamples__training_autotuning_hf_dsconfigs_ds_config_z3.json": (
        [("error", "train_micro_batch_size_per_gpu"), ("warning", "optimizer")], []),
    "DeepSpeedExamples__training_bf16_master_weight_configs_bf16_full.json": ([], []),
    # sparse attention: removed from DeepSpeed, its parser says so
    "DeepSpeedExamples__training_bing_bert_deepspeed_bsz64k_lamb_config_seq128.json": (
        [("error", "(DeepSpeed's parser)")], [("error", "(DeepSpeed's parser)")]),
    "DeepSpeedExamples__training_gan_gan_deepspeed_config.json": ([], []),
    # cuda_visible_devices is no DeepSpeed key (ignored); gradient_clipping 0 turns clipping off
    "DeepSpeedExamples__training_imagenet_config_ds_fp16_z1_config.json": (
        [("error", "cuda_visible_devices"), ("warning", "optimizer.type"), ("warning", "gradient_clipping")],
        [("error", "cuda_visible_devices"), ("warning", "optimizer.type"), ("warning", "gradient_clipping")]),
    "DeepSpeedExamples__training_pipeline_parallelism_ds_config.json": ([], []),
    "DeepSpeedExamples__training_tensor_parallel_hf_integration_configs_ds_config.json": (
        HF_OPTIMIZER + [("error", "scheduler.params.total_num_steps")] + HF_WARMUP + HF_TOP
        + [("warning", "bf16.enabled")], []),
    # torch_adam with offload steps torch's AdamW on the CPU; adam_w_mode changes nothing for AdamW
    "accelerate__tests_deepspeed_ds_config_zero3.json": (
        [("error", "optimizer.params.lr"), ("error", "optimizer.params.weight_decay")] + HF_WARMUP + HF_TOP[1:]
        + [("warning", "fp16.enabled"), ("warning", "bf16.enabled")] + HF_ZERO3
        + [("warning", "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
           ("warning", "optimizer.params.adam_w_mode"), ("warning", "optimizer.params.torch_adam")],
        [("warning", "optimizer.params.adam_w_mode"), ("warning", "optimizer.params.torch_adam")]),
    "transformers__tests_deepspeed_ds_config_zero2.json": (HF_OPTIMIZER + HF_WARMUP + HF_TOP
                                                            + [("warning", "fp16.enabled")], []),
    # stage3_gather_fp16_weights_on_model_save: DeepSpeed warns that it is deprecated
    "transformers__tests_deepspeed_ds_config_zero3.json": (
        HF_OPTIMIZER + HF_WARMUP + HF_TOP + [("warning", "fp16.enabled")] + HF_ZERO3
        + [("warning", "zero_optimization.stage3_gather_fp16_weights_on_model_save")],
        [("warning", "zero_optimization.stage3_gather_fp16_weights_on_model_save")]),
}


def test_every_real_config_is_listed():
    assert sorted(p.name for p in FOLDER.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("starter", ["deepspeed", "trainer"])
def test_findings_on_real_configs(name, starter):
    config = configs.load(FOLDER / name)
    found = configs.check(config, WORLD, configs.target("cuda", WORLD), starter=starter)
    expected = EXPECTED[name][configs.STARTERS.index(starter)]
    assert sorted((f.severity, f.key) for f in found) == sorted(expected), [str(f) for f in found]


def test_auto_findings_name_who_fills_them_and_the_number_to_write():
    config = configs.load(FOLDER / "transformers__tests_deepspeed_ds_config_zero2.json")
    found = {f.key: f for f in configs.check(config, WORLD, configs.target("cuda", WORLD))}
    micro = found["train_micro_batch_size_per_gpu"]
    assert "Trainer" in micro.rule and "accelerate" in micro.rule and "--for trainer" in micro.fix
    # the number the Trainer would write with its default TrainingArguments, and where it takes it from
    assert "write 8 " in micro.fix and "per_device_train_batch_size" in micro.fix
    assert f"write {WORLD * 8} " in found["train_batch_size"].fix
    assert "write false" in found["fp16.enabled"].fix and "default, false" in found["fp16.enabled"].rule


def test_the_trainer_fills_what_transformers_fills():
    config = configs.load(FOLDER / "transformers__tests_deepspeed_ds_config_zero3.json")
    filled, fills = configs.trainer_fills(config, WORLD)
    assert filled["train_micro_batch_size_per_gpu"] == 8 and filled["train_batch_size"] == WORLD * 8
    assert filled["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert fills["optimizer.params.lr"].source == "TrainingArguments.learning_rate"
    assert configs.auto_paths(filled) == []  # nothing left for DeepSpeed
    assert config["train_batch_size"] == "auto"  # the config itself is left as written


def test_zenflow_takes_the_cpu_adam_parameters_it_forwards():
    config = configs.load(FOLDER / "DeepSpeedExamples__training_DeepSpeed-ZenFlow_finetuning_zf_config.json")
    assert configs.optimizer_builder(config).cls.__name__ == "ZenFlowCPUAdam"
    bad = configs.merged(config, {"optimizer": {"params": {"betas2": [0.9, 0.99]}}})
    (typo,) = [f for f in configs.check(bad, WORLD, configs.target("cuda", WORLD)) if f.key.startswith("optimizer")]
    assert typo.key == "optimizer.params.betas2" and "'betas'" in typo.fix  # DeepSpeedCPUAdam's keyword


def test_removed_one_bit_optimizers_are_named_with_deepspeeds_history():
    config = configs.load(FOLDER / "DeepSpeedExamples__training_BingBertSquad_1-bit_adam_nccl_deepspeed_onebitadam"
                                   "_bsz96_config.json")
    (finding,) = configs.check(config, WORLD, configs.target("cuda", WORLD))
    assert "removed 1-bit Adam" in finding.rule and "#8490" in finding.rule and '"Adam"' in finding.fix


def test_a_target_decides_the_precisions():
    fp16 = configs.load(FOLDER / "DeepSpeedExamples__training_BingBertSquad_deepspeed_bsz24_config.json")
    bf16 = configs.load(FOLDER / "DeepSpeedExamples__training_bf16_master_weight_configs_bf16_full.json")
    assert fp16["fp16"]["enabled"] and bf16["bf16"]["enabled"]
    v100 = configs.target("cuda:7.0", WORLD)
    assert configs.check(fp16, WORLD, v100) == []
    (refused,) = configs.check(bf16, WORLD, v100)
    assert refused.key == "bf16.enabled" and "the target" in refused.rule and "compute capability 7.0" in refused.rule
    (count,) = [f for f in configs.check(fp16, 2 * WORLD, configs.target("cuda", WORLD)) if f.key == "(world size)"]
    assert f"the target has {WORLD} GPU(s)" in count.rule and "launch it there" in count.fix
    with pytest.raises(ValueError, match="cuda:7.0"):
        configs.target("tpu")
