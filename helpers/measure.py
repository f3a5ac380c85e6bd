"""Measure your own DeepSpeed script with the course's probes, whatever launched it.

Two lines in any training script (started by the stock ``deepspeed`` command, ``torchrun``, ``accelerate
launch`` or Hugging Face's ``Trainer``)::

    from helpers import measure

    config = measure.configure(config)          # adds what the probes need (the comms logger)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    meter = measure.attach(engine, steps=4, out="runs/my-script")
    ...  # your loop, unchanged: engine(batch), engine.backward(loss), engine.step()
    meter.finish()                              # rank 0 writes runs/my-script/summary.json

:func:`attach` wraps the engine's ``backward`` and ``step`` (on this engine object only): every
``engine.backward(loss)`` records the micro-batch's loss and calls the probes' ``after_backward``; every
``engine.step()`` at a gradient-accumulation boundary closes an optimizer step. The probes and the record are
the course's own (:class:`helpers.core.train.Recorder`), so ``records.load("runs/my-script")`` reads the
script's run like any run of the chapters, with the same tables and plots. For Hugging Face's ``Trainer``,
:func:`trainer_callback` does the attaching. A pipeline engine (``deepspeed.pipe.PipelineModule``) trains
with ``engine.train_batch(data_iter)`` alone: there every ``train_batch`` is one optimizer step, and the
probes' ``after_backward`` fire inside it, after each micro-batch's backward on the rank's stage.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import psutil
import torch

from helpers.core import ds, memory, models
from helpers.core.pipeline_hooks import dispatch_after_backward
from helpers.core.plan import emit, write_json
from helpers.core.probes import RunContext, config_for, deep_update, defaults_for
from helpers.core.train import Recorder, data_parallel_coords, precision_of, release_zero3_references

#: The probes a script gets unless it names others: step time, model states, peak memory, collectives.
PROBES = ("timing", "model_states", "peak_memory", "comm")


def configure(config: dict, probes: Sequence[str] = PROBES) -> dict:
    """``config`` with what ``probes`` need from DeepSpeed (the comms logger for ``comm``) merged in; the
    script's own settings win. Call it before ``deepspeed.initialize``."""
    merged = deep_update({}, config_for(probes))
    return deep_update(merged, config)


class Meter:
    """The course's probes attached to one DeepSpeed engine in a script (made by :func:`attach`)."""

    def __init__(self, engine: Any, steps: int, out: str | Path, name: str, model: str, probes: Sequence[str],
                 progress: int | None = None):
        if steps < 1:
            raise ValueError(f"steps={steps}: attach needs the number of optimizer steps the script trains (>= 1)")
        self.engine, self.steps, self.out, self.progress = engine, steps, Path(out), progress
        self.out.mkdir(parents=True, exist_ok=True)
        # the dict the script passed to deepspeed.initialize, or the one DeepSpeed parsed from a file
        config = engine.config if isinstance(engine.config, dict) else dict(getattr(engine._config, "_param_dict", {}))
        dist = ds.load("deepspeed.comm")

        self.ctx = RunContext(
            engine=engine, rank=dist.get_rank(), world_size=dist.get_world_size(),
            device_type="cuda" if engine.device.type == "cuda" else "cpu", precision=precision_of(config),
            stage=engine.zero_optimization_stage(), micro_batch=engine.train_micro_batch_size_per_gpu(),
            grad_accum=engine.gradient_accumulation_steps(), steps=steps, params=models.count_parameters(engine.module),
            born=psutil.Process().create_time(), run_started=time.time(), config=config)
        self.ctx.dp_rank, self.ctx.dp_size = data_parallel_coords(engine)
        # a folder measured before keeps its ranks' files: every rank removes its own before any rank can
        # read it at the end (the barrier is raw torch, which the comms logger does not count)
        (self.out / f"rank{self.ctx.rank}.json").unlink(missing_ok=True)
        if self.ctx.rank == 0:
            (self.out / "summary.json").unlink(missing_ok=True)
        torch.distributed.barrier()
        wanted = dict.fromkeys([*probes, *(p for p in defaults_for(config) if p == "placement")])  # once each
        self.recorder = Recorder(self.ctx, list(wanted), str(self.out), name, model)
        self.step, self.micro_step, self.micro_losses = 0, 0, []
        self.finished = False
        self._backward, self._step = engine.backward, engine.step
        engine.backward, engine.step = self._measured_backward, self._measured_step
        PipelineEngine = ds.load("deepspeed.runtime.pipe.engine").PipelineEngine

        self._train_batch = engine.train_batch if isinstance(engine, PipelineEngine) else None
        if self._train_batch is not None:  # DualPipeVEngine too: a schedule that runs inside train_batch
            engine.train_batch = self._measured_train_batch
        self.recorder.before_step(0)

    def _measured_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = self._backward(loss, *args, **kwargs)
        if self.step < self.steps:
            value = float(loss.detach().float().item())
            if kwargs.get("scale_wrt_gas") is False:  # the caller divided the loss by the accumulation (HF's Trainer)
                value *= self.ctx.grad_accum
            self.micro_losses.append(value)
            self.recorder.after_backward(self.step, self.micro_step)
        return result

    def _measured_step(self, *args: Any, **kwargs: Any) -> Any:
        boundary = self.engine.is_gradient_accumulation_boundary()
        result = self._step(*args, **kwargs)
        if self.step >= self.steps:
            return result
        self.micro_step += 1
        if boundary:
            self._close_step()
        return result

    def _measured_train_batch(self, *args: Any, **kwargs: Any) -> Any:
        if self.step >= self.steps:
            return self._train_batch(*args, **kwargs)
        dispatch_after_backward(self.ctx, self.step, self.recorder.probes)
        loss = self._train_batch(*args, **kwargs)  # the step's loss, averaged over its micro-batches
        self.micro_losses = [float(loss.detach().float().item())]
        self._close_step()
        return loss

    def _close_step(self) -> None:
        """Close the optimizer step the script just took and open the next."""
        loss = self.recorder.after_step(self.step, self.micro_losses)
        if self.progress is not None:  # a run of a course launch: its progress bar advances
            emit("step", run=self.progress, rank=self.ctx.rank, step=self.step + 1, steps=self.steps, loss=loss)
        elif self.ctx.rank == 0:
            print(f"[measure] step {self.step + 1}/{self.steps}: loss {loss:.4f} (rank 0)", flush=True)
        self.step, self.micro_step, self.micro_losses = self.step + 1, 0, []
        if self.step < self.steps:
            self.recorder.before_step(self.step)

    def finish(self) -> Path | None:
        """Unwrap the engine and write the record: rank 0 returns the path of ``summary.json``. Raises if the
        script trained fewer optimizer steps than it announced to :func:`attach`."""
        if self.finished:
            return self.out / "summary.json" if self.ctx.rank == 0 else None
        self.finished = True
        self.engine.backward, self.engine.step = self._backward, self._step
        if self._train_batch is not None:
            self.engine.train_batch = self._train_batch
        # what DeepSpeed's ZeRO-3 keeps of the engine at module level: a script that trains several engines
        # in one process would otherwise hold them all until it exits, and exit with them (an abort)
        release_zero3_references(self.engine.module)
        if self.step < self.steps:
            raise RuntimeError(f"measure: the script announced steps={self.steps} to attach() but trained {self.step} "
                               "optimizer steps: pass the number it trains")
        summary = self.recorder.finish({"optimizer": memory.describe_optimizer(self.engine),
                                        "deepspeed_train_batch": self.engine.train_batch_size()})
        if summary is None:
            return None
        path = self.out / "summary.json"
        write_json(path, summary)
        return path


def attach(engine: Any, *, steps: int, out: str | Path, name: str = "my-script", model: str = "custom",
           probes: Sequence[str] = PROBES, progress: int | None = None) -> Meter:
    """Attach the course's ``probes`` to ``engine`` (after ``deepspeed.initialize``, on every rank) for a run of
    ``steps`` optimizer steps; ``model`` names the model in the record (a course model's name lets the chapters'
    theory columns apply). ``progress``: in a rank-side task of a course launch, the run's position there (the
    task's second argument): each step then advances the launch's progress bar instead of printing a line. Call
    :meth:`Meter.finish` after the last step."""
    return Meter(engine, steps, out, name, model, probes, progress)


def trainer_callback(out: str | Path, name: str = "trainer", model: str = "custom",
                     probes: Sequence[str] = PROBES) -> Any:
    """A Hugging Face ``TrainerCallback`` that attaches the course's probes to the DeepSpeed engine the
    ``Trainer`` made (at ``on_train_begin``, for ``state.max_steps`` optimizer steps) and writes the record at
    ``on_train_end``. Pass the Trainer to it after building it: ``trainer.add_callback(cb); cb.trainer = trainer``."""
    from transformers import TrainerCallback  # deferred: only Trainer scripts need transformers' trainer

    class MeasureCallback(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None
            self.meter: Meter | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            engine = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
            if engine is None or not hasattr(engine, "zero_optimization_stage"):
                raise RuntimeError("measure.trainer_callback: set callback.trainer = trainer, and train with a "
                                   "DeepSpeed config (TrainingArguments(deepspeed=...))")
            self.meter = Meter(engine, state.max_steps, out, name, model, probes)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.meter is not None:
                self.meter.finish()

    return MeasureCallback()
