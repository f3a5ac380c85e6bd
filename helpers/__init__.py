"""Helpers for the DeepSpeed communication course, in three layers, each a folder:

- ``helpers.core``: what every chapter uses. ``environment`` (CPU/gloo or GPUs/NCCL), ``configs`` (DeepSpeed
  configs and the checker for their traps), ``launch`` (real multi-rank runs), ``plan`` (what the launcher
  tells the ranks), ``train`` (the loop each rank runs), ``probes`` and ``faults`` (what the ranks measure,
  what they break on purpose), ``memory``, ``communication`` and ``performance`` (the figures behind them),
  ``records`` and ``references`` (each run's ``summary.json``, read by name; committed GPU results),
  ``models``, ``theory`` (the ZeRO paper's formulas) and ``plots``. The core imports no topic.
- ``helpers.topics``: one module per chapter topic, each with its probes, runs, tables, formulas and
  figures: ``zero`` (03-05), ``offload``, ``precision``, ``accumulation``, ``bandwidth``, ``activations``,
  ``pipeline``, ``tensor_parallel``, ``sequence_parallel`` (12b), ``compression``, ``checkpoints``, ``frameworks``, ``capstone``,
  ``own_script`` (02b) and ``widgets`` (the lab).
- ``helpers.tools``: the course's own tooling (``notebooks``: executing notebooks for the GPU check;
  ``multinode``; ``benchmarks``).

On top: ``python3 -m helpers.course`` (set-up, ``lab``, ``test``), ``python -m helpers`` (the command line) and
``helpers.measure`` (the course's probes in a learner's own DeepSpeed script, chapter 02b).

This file imports nothing, so ``python3 -m helpers.course`` works before torch is installed.
"""
