"""Hooks inside a DeepSpeed pipeline engine's ``train_batch``, where a probe cannot otherwise reach.

A pipeline engine (``deepspeed.runtime.pipe.engine.PipelineEngine``, and ``DualPipeVEngine``) trains a whole
optimizer step in one call, ``engine.train_batch(data_iter)``, which runs its schedule's instructions
(``ForwardPass``, ``BackwardPass``, ``SendActivation``, ...). :func:`instruction_hooks` lets code run after each
instruction; :func:`dispatch_after_backward` uses it so that the probes' ``after_backward`` fire after each
micro-batch's backward on the rank's stage, as they do in a loop of ``engine.backward`` and ``engine.step``.
Both the ranks' loop of a sweep and :mod:`helpers.measure` (a learner's own script) use them.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from helpers.core.probes import RunContext


def instruction_hooks(engine: Any) -> list[Callable]:
    """The callbacks ``hook(kind, started, kwargs)`` run after each schedule instruction of this pipeline
    engine (``kind`` as ``"ForwardPass"``, ``started`` its ``time.perf_counter()`` start). The first call
    wraps the engine's instruction table; later calls return the same list."""
    hooks = engine.__dict__.get("_course_instruction_hooks")
    if hooks is None:
        if not hasattr(type(engine), "_INSTRUCTION_MAP"):
            raise TypeError(f"{type(engine).__name__} is not DeepSpeed's PipelineEngine: train a pipeline model "
                            "(a deepspeed.pipe.PipelineModule)")
        hooks = []

        def wrap(kind: str, run: Callable) -> Callable:
            def timed(self, **kwargs):
                started = time.perf_counter()
                run(self, **kwargs)
                for hook in hooks:
                    hook(kind, started, kwargs)
            return timed

        engine._course_instruction_hooks = hooks
        engine._INSTRUCTION_MAP = {cls: wrap(cls.__name__, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
    return hooks


def dispatch_after_backward(ctx: RunContext, step: int, probes: list) -> None:
    """Make every probe's ``after_backward(ctx, step, m)`` fire after the backward of micro-batch ``m`` of
    this stage during the next ``engine.train_batch`` (micro-batches counted in the order this stage runs
    their backward). Under DualPipeV a rank runs two backwards of each micro-batch, phase 1's (the way back)
    and then phase 0's: it fires after phase 0's, when the micro-batch's gradients on this rank are complete.
    Call before each ``train_batch``."""
    state = ctx.engine.__dict__.setdefault("_course_backward_state", {})
    if not state:
        def after_instruction(kind: str, started: float, kwargs: dict) -> None:
            if kind == "BackwardPass" and kwargs.get("phase", 0) == 0:
                for probe in state["probes"]:
                    probe.after_backward(state["ctx"], state["step"], state["micro"])
                state["micro"] += 1

        instruction_hooks(ctx.engine).append(after_instruction)
    state.update(ctx=ctx, step=step, probes=probes, micro=0)
