"""helpers.core.pipeline_hooks: code run after each instruction of a pipeline engine's schedule, and the probes'
``after_backward`` fired from there, on a stand-in engine (no process group, no DeepSpeed)."""

from __future__ import annotations

import types

import pytest

from helpers.core import pipeline_hooks


class ForwardPass:
    pass


class BackwardPass:
    pass


class StandInEngine:
    """What the hooks use of DeepSpeed's PipelineEngine: a class-level table instruction -> method."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def _forward(self, **kwargs) -> None:
        self.ran.append("F")

    def _backward(self, **kwargs) -> None:
        self.ran.append("B")

    _INSTRUCTION_MAP = {ForwardPass: _forward, BackwardPass: _backward}

    def run(self, *instructions: tuple[type, dict]) -> None:
        """As ``PipelineEngine._exec_schedule`` does: look each instruction up in the engine's table."""
        for cls, kwargs in instructions:
            self._INSTRUCTION_MAP[cls](self, **kwargs)


class Probe:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def after_backward(self, ctx, step: int, micro: int) -> None:
        self.calls.append((step, micro))


def test_hooks_run_after_each_instruction_of_this_engine_only():
    engine, other = StandInEngine(), StandInEngine()
    seen = []
    hooks = pipeline_hooks.instruction_hooks(engine)
    hooks.append(lambda kind, started, kwargs: seen.append((kind, engine.ran[-1], kwargs)))
    assert pipeline_hooks.instruction_hooks(engine) is hooks  # wrapped once
    engine.run((ForwardPass, {"buffer_id": 0}), (BackwardPass, {"buffer_id": 0}))
    other.run((ForwardPass, {}))
    assert seen == [("ForwardPass", "F", {"buffer_id": 0}), ("BackwardPass", "B", {"buffer_id": 0})]
    assert other.ran == ["F"] and "_course_instruction_hooks" not in other.__dict__


def test_after_backward_fires_per_micro_batch_and_once_per_dualpipev_pair():
    engine, probe = StandInEngine(), Probe()
    ctx = types.SimpleNamespace(engine=engine)
    pipeline_hooks.dispatch_after_backward(ctx, 0, [probe])
    engine.run((ForwardPass, {}), (BackwardPass, {}), (ForwardPass, {}), (BackwardPass, {}))
    pipeline_hooks.dispatch_after_backward(ctx, 1, [probe])  # the next step counts its micro-batches from 0
    engine.run((BackwardPass, {"phase": 1}), (BackwardPass, {"phase": 0}))  # DualPipeV: phase 0's completes it
    assert probe.calls == [(0, 0), (0, 1), (1, 0)]
    assert len(pipeline_hooks.instruction_hooks(engine)) == 1  # one dispatcher, however many steps


def test_an_engine_without_a_schedule_is_refused():
    with pytest.raises(TypeError, match="not DeepSpeed's PipelineEngine"):
        pipeline_hooks.instruction_hooks(types.SimpleNamespace())


def test_chapter_11s_topic_uses_the_cores_hooks():
    """helpers.measure (core-level) and chapter 11's topic share one copy of the hooks: the core's."""
    from helpers.topics import pipeline

    assert pipeline.dispatch_after_backward is pipeline_hooks.dispatch_after_backward
    assert pipeline.instruction_hooks is pipeline_hooks.instruction_hooks
