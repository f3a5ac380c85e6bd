"""Helpers for the DeepSpeed communication course.

Notebooks import the modules they need, each named for what it deals with:

- ``environment``: what this machine offers (CPU/gloo or GPUs/NCCL, ranks, precisions).
- ``configs``: DeepSpeed configs from ``ds_configs/`` and the checker for their traps.
- ``launch``: starting real multi-rank runs with DeepSpeed's launcher.
- ``records``: reading the ``summary.json`` each run writes, and tables of them.
- ``theory``: the ZeRO paper's memory and communication formulas.
- ``plots``: the figures every chapter draws.
- ``models``: the models and data every run and baseline trains on.
- ``experiments``: the experiments chapters repeat (a stage against its baseline, a knob's effect).
- ``memory`` and ``communication``: what each rank measures (model-state bytes, the comms logger).
- ``offload`` and ``precision``: chapters 06 and 07 (where model states live; fp16 loss scaling).
- ``activations``, ``pipeline``, ``tensor_parallel``: chapters 10-12 (bytes saved for backward; the model as
  pipeline stages and DeepSpeed's schedule; AutoTP's shards), each with its probe and tables.
- ``train``: the script each rank runs (started by ``launch``, never imported by a notebook).
- ``checkpoints``: saving, crashing, resuming; what a sharded checkpoint holds; ``zero_to_fp32``, universal.
- ``compression``: ZeRO++ and the removed 1-bit optimizers (chapter 13).
- ``pytorch_train`` and ``frameworks``: PyTorch's DDP and FSDP2 under torchrun, beside ZeRO (chapter 15).
- ``benchmarks``: timing the course's own machinery; ``course``: the README's set-up commands.

This file imports nothing heavy, so ``python3 -m helpers.course`` works before torch is installed.
"""

__all__ = ["environment", "configs", "launch", "records", "theory", "plots", "models", "experiments", "offload",
           "precision"]
