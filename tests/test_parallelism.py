"""Chapters 10-12: the model variants, DeepSpeed's pipeline schedule, the saved-tensor counter, and one 2-rank
launch in which a pipeline, AutoTP and DeepSpeed's checkpoint train beside data parallelism, which must come
out the same before and after them in the same ranks."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import json
import os
import statistics
import time
import types
from typing import Sequence

import pytest
import torch

from helpers.core import launch, load_guard, models, records, references, theory
from helpers.topics import activations, pipeline, tensor_parallel
from helpers.core.environment import WORLD_SIZE_VARIABLE
from test_records import minimal_summary


@pytest.fixture(autouse=True)
def _two_ranks(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)


# --- no launch --------------------------------------------------------------------------------

def test_llama_names_parse_into_size_and_variant():
    assert models.llama_parts("llama-long-ckpt") == ("llama-long", "-ckpt")
    assert models.llama_parts("llama") == ("llama", "")
    assert pipeline.base_model("llama-gpu-pipe") == "llama-gpu" and models.shape_of("llama-gpu-pipe").hidden == 1024
    with pytest.raises(ValueError, match="e.g. 'llama-pipe'"):
        pipeline.check_options("llama-ckpt-pipe", {})
    assert models.seq_len_of("llama-long") == 512 and models.seq_len_of("gpt2") == models.LM_SEQ_LEN
    assert models.make_batch("llama-long", [0, 1]).inputs.shape == (2, 512)
    with pytest.raises(ValueError, match="llama-huge"):
        models.check_model_name("llama-huge")


def test_variants_of_one_size_start_from_the_same_weights():
    plain, ckpt = models.build("llama").state_dict(), models.build("llama-ckpt").state_dict()
    assert plain.keys() == ckpt.keys() and all(torch.equal(plain[k], ckpt[k]) for k in plain)


def test_the_stages_in_sequence_are_the_model():
    model = models.build("llama")
    batch = models.make_batch("llama", [0, 1, 2])
    hidden = batch.inputs
    for stage in pipeline.llama_stages(model):
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, model(input_ids=batch.inputs).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 8])
def test_deepspeeds_schedule_idles_as_the_bubble_formula_says(stages, micro_batches):
    assert pipeline.schedule_bubble(stages, micro_batches) == pytest.approx(pipeline.bubble_fraction(stages, micro_batches))
    grid = pipeline.schedule_grid(stages, micro_batches)
    for row in grid:  # every micro-batch goes forward, then backward, once per stage
        assert sorted(c for c in row if c) == sorted([f"F{m}" for m in range(micro_batches)]
                                                     + [f"B{m}" for m in range(micro_batches)])
        assert all(row.index(f"F{m}") < row.index(f"B{m}") for m in range(micro_batches))


# --- other schedules: DualPipeV, read from DeepSpeed's classes without processes ---------------------

def test_the_builder_takes_a_schedule_and_nothing_else():
    pipeline.check_options("llama-pipe", {"schedule": "dualpipev"})
    pipeline.check_options("llama-pipe", {})
    with pytest.raises(ValueError, match="choose one of '1f1b', 'dualpipev'"):
        pipeline.check_options("llama-pipe", {"schedule": "interleaved"})
    with pytest.raises(ValueError, match="only the model_option 'schedule'"):
        pipeline.check_options("llama-pipe", {"partition_method": "uniform"})


def test_the_shipped_schedules_are_read_from_deepspeeds_module_with_the_engines_that_build_them():
    found = {s["name"]: s for s in pipeline.shipped_schedules()}
    assert set(found) == {"TrainSchedule", "InferenceSchedule", "DataParallelSchedule", "DualPipeVSchedule"}
    assert found["TrainSchedule"]["built_by"] == ["PipelineEngine._train_schedule"]
    assert found["DualPipeVSchedule"]["built_by"] == ["DualPipeVEngine._train_schedule",
                                                      "DualPipeVEngine._inference_schedule"]
    assert found["DataParallelSchedule"]["built_by"] == []
    assert found["DualPipeVSchedule"]["doc"] == "The DualPipeV schedule of DeepSeek-V3."
    assert "built by: no engine" in pipeline.shipped_schedules_text()


@pytest.mark.parametrize("ranks, micro_batches", [(2, 4), (3, 7), (4, 8)])
def test_dualpipev_runs_each_phase_of_each_micro_batch_forward_then_backward_once_per_rank(ranks, micro_batches):
    for steps in pipeline.schedule_instructions("dualpipev", ranks, micro_batches):
        flat = [i for step in steps for i in step]
        for kind in ("ForwardPass", "BackwardPass"):  # buffer = phase * M + micro-batch: every one, once
            assert sorted(i.buffer_id for i in flat if i.name == kind) == list(range(2 * micro_batches))
        order = [(i.name, i.buffer_id) for i in flat if i.name in pipeline.COMPUTE]
        assert all(order.index(("ForwardPass", b)) < order.index(("BackwardPass", b)) for b in range(2 * micro_batches))
    with pytest.raises(ValueError, match="at least 2 \\* 2 micro-batches"):
        pipeline.schedule_instructions("dualpipev", 2, 3)


def test_instruction_labels_name_the_buffer_and_mark_the_way_back():
    steps = pipeline.schedule_instructions("dualpipev", 2, 4)
    labels = [pipeline.instruction_label(i) for step in steps[0] for i in step]
    assert labels[:4] == ["commit", "Load0", "F0", "sendA0"]
    assert "recvA4'" in labels and "F4" not in labels and labels[-3:] == ["reduceTied", "reduce", "step"]
    text = pipeline.instruction_text("1f1b", 2, 4)
    assert text.splitlines()[:3] == ["rank 0:", "  step 0: Load0 F0", "  step 1: sendA0"]
    assert "  step 8: (nothing)" in text


@pytest.mark.parametrize("ranks, micro_batches", [(2, 1), (2, 4), (3, 5), (4, 8), (8, 16)])
def test_replaying_deepspeeds_1f1b_lists_gives_its_bubble_formula(ranks, micro_batches):
    played = pipeline.replay("1f1b", ranks, micro_batches, forward=2.0, backward=4.0)
    assert played["busy"] == [6.0 * micro_batches] * ranks
    assert played["idle"] == pytest.approx([pipeline.bubble_fraction(ranks, micro_batches)] * ranks)
    assert played["span"] - played["busy"][0] == pytest.approx(pipeline.bubble_time("1f1b", ranks))


def test_replaying_dualpipev_idles_less_than_1f1b_and_no_more_than_the_readmes_formula():
    played = pipeline.replay("dualpipev", 2, 4)  # chunks: forward 1, backward 2
    assert played["busy"] == [24.0, 24.0] and played["span"] == 28.0
    for ranks, m in [(2, 4), (3, 6), (4, 8), (4, 16)]:
        dual = pipeline.replay("dualpipev", ranks, m)
        one = pipeline.replay("1f1b", ranks, m, 2.0, 4.0)
        assert dual["busy"] == one["busy"] and dual["span"] < one["span"]
        assert dual["span"] - dual["busy"][0] <= pipeline.bubble_time("dualpipev", ranks)
    # a backward as long as a forward: the replay is the formula
    assert pipeline.replay("dualpipev", 3, 7, 1.0, 1.0)["span"] - 28.0 == pipeline.bubble_time("dualpipev", 3, 1.0, 1.0)


def test_bubble_formulas_of_the_dualpipe_readme():
    assert pipeline.bubble_time("1f1b", 4, 1.0, 2.0) == 3 * 2 * 3.0  # (PP-1)(F+B), a stage two chunks
    assert pipeline.bubble_time("dualpipev", 4, 1.0, 2.0) == 3 * (3.0 + 2.0)  # (PP/2-1)(F&B+B-3W), F&B=F+B, W=0
    assert pipeline.bubble_time("dualpipev", 4, 1.0, 2.0, weight=0.5, overlapped=2.0) == 3 * (2.0 + 2.0 - 1.5)
    for ranks, m in [(2, 4), (4, 6)]:
        assert pipeline.bubble_share("1f1b", ranks, m) == pytest.approx(pipeline.bubble_fraction(ranks, m))
    assert pipeline.bubble_share("dualpipev", 2, 4) == pytest.approx(5 / (5 + 24))
    table = pipeline.schedule_bubble_table(cases=((2, 4),))
    assert table.splitlines()[2].split() == ["2", "4", "6", "6", "0.200", "0.200", "5", "4", "0.172", "0.143"]


def test_dualpipev_lists_twice_the_transfers_of_1f1b():
    assert [pipeline.schedule_transfers("1f1b", 3, 6, r) for r in range(3)] == [12, 24, 12]
    assert [pipeline.schedule_transfers("dualpipev", 3, 6, r) for r in range(3)] == [24, 48, 24]


def test_p2p_per_step_adds_every_point_to_point_op_and_no_collective():
    record = types.SimpleNamespace(comm_ops=lambda: {
        "send": {"count": 4.0, "bytes": 400.0}, "recv": {"count": 4.0, "bytes": 400.0},
        "batch_isend_irecv": {"count": 2.0, "bytes": 1000.0}, "all_reduce": {"count": 1.0, "bytes": 9999.0}})
    assert pipeline.p2p_per_step(record) == {"count": 10.0, "bytes": 1800.0}


def test_a_schedule_that_did_not_train_is_shown_by_its_error_and_kept_nowhere(monkeypatch):
    failed = launch.RunFailed("rank 0 failed: AssertionError: DualPipeV needs gradient_accumulation_steps >= 2 * 4, got 4")
    runs = {pipeline.DEFAULT: object(), pipeline.DUALPIPEV: failed}
    expected = f"did not train: {pipeline.DUALPIPEV}: {failed}"
    assert pipeline.schedule_comparison(runs) == expected == pipeline.schedule_timing_table(runs)
    monkeypatch.setattr(pipeline.references, "save_reference", lambda *a, **k: pytest.fail("saved"))
    assert pipeline.save_schedules_reference(runs, note="") is None
    assert pipeline.schedule_comparison({pipeline.DEFAULT: object()}) == f"did not train: {pipeline.DUALPIPEV}: not in these runs"


def test_the_chapters_records_are_the_runs_of_the_last_launch_in_the_order_they_trained(tmp_path):
    def write(name: str, file: str, text: str, at: float) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text(text)
        os.utime(tmp_path / name / file, (at, at))

    summary = json.dumps({**minimal_summary(), "name": "x"})
    write("old", "summary.json", summary, 100.0)  # an earlier launch's run, since renamed
    write("second", pipeline.REFUSED, "AssertionError: ZeRO-2 and ZeRO-3 are incompatible", 300.0)
    write("first", "summary.json", summary, 200.0)
    runs = pipeline.chapter_records(tmp_path, since=150.0)
    assert list(runs) == ["first", "second"]
    assert isinstance(runs["first"], records.Record) and isinstance(runs["second"], pipeline.Refused)
    assert pipeline._failed(runs, "second") == "second: AssertionError: ZeRO-2 and ZeRO-3 are incompatible"
    with pytest.raises(FileNotFoundError, match="newer than the launch"):
        pipeline.chapter_records(tmp_path, since=400.0)


def _stepped(*steps_ms: float) -> types.SimpleNamespace:
    """A stand-in record with these step times (the first one is the warm-up)."""
    return types.SimpleNamespace(timing=types.SimpleNamespace(all_s=[s / 1000 for s in steps_ms]))


ALONE = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
BUSY = load_guard.Load("cpu", 3, 0.6, 2, 10.0, 20, "test")


def _timed_runs(dualpipev_ms: float, data_parallel_ms: float) -> dict:
    return {pipeline.DEFAULT: _stepped(900, 100, 101, 99), pipeline.AGAIN: _stepped(900, 100, 100, 101),
            pipeline.DUALPIPEV: _stepped(900, dualpipev_ms, dualpipev_ms + 1, dualpipev_ms - 1),
            "data-parallel": _stepped(900, data_parallel_ms, data_parallel_ms + 1, data_parallel_ms - 1)}


def test_timing_verdicts_speak_only_for_a_launch_alone_and_beyond_the_spread():
    given = pipeline.timing_verdicts(_timed_runs(290, 110), ALONE).splitlines()
    assert given[0] == "Load beside the launch: none, it had its devices to itself."
    assert given[1].startswith("DualPipeV against 1F1B: pipeline is faster: pipeline-dualpipev takes 2.90x its time")
    assert given[2] == "  DualPipeV took 2.90x 1F1B's step time: its smaller bubble by the formula did not shorten the step here."
    assert given[4].startswith("  The pipeline took 0.91x data parallelism's step time: faster here")
    busy = pipeline.timing_verdicts(_timed_runs(290, 110), BUSY)
    assert busy.count("Verdict withheld: other processes (3) used 60% of the 2 cores' time") == 2
    assert "took" not in busy
    within = pipeline.timing_verdicts(_timed_runs(100.5, 100.5), ALONE)
    assert within.count("Verdict withheld: the difference") == 2
    drifted = {**_timed_runs(290, 110), pipeline.AGAIN: _stepped(900, 150, 151, 149)}
    assert pipeline.timing_verdicts(drifted, ALONE).count("the machine changed during the sweep") == 2


def test_timings_compare_the_runs_probed_alike_where_the_launch_has_them():
    light = {**_timed_runs(290, 110), pipeline.TIMED: _stepped(900, 50, 51, 49),
             pipeline.DATA_PARALLEL_TIMED: _stepped(900, 60, 61, 59), pipeline.AGAIN: _stepped(900, 50, 50, 51)}
    assert pipeline.timed_names(light) == (pipeline.TIMED, pipeline.DATA_PARALLEL_TIMED)
    assert pipeline.timed_names(_timed_runs(290, 110)) == (pipeline.DEFAULT, "data-parallel")
    lines = pipeline.timing_verdicts(light, ALONE).splitlines()
    assert lines[1].startswith(f"DualPipeV against 1F1B: {pipeline.TIMED} is faster: pipeline-dualpipev takes 5.80x")
    assert lines[3].startswith(f"the pipeline against data parallelism: {pipeline.TIMED} is faster")


def test_step_times_leave_the_warm_up_step_out():
    assert pipeline.step_median_s(_stepped(900, 100, 130, 99)) == pytest.approx(0.100)


def test_the_bubble_trend_is_said_from_the_points():
    assert "falls as M grows" in pipeline.bubble_trend({1: [0.5, 0.5], 2: [0.35, 0.3], 4: [0.2, 0.21]})
    assert "do not fall" in pipeline.bubble_trend({1: [0.5, 0.5], 2: [0.35, 0.3], 4: [0.2, 0.4]}, "a CPU")
    partly = pipeline.bubble_trend({1: [0.5, 0.5], 2: [0.35, 0.3], 4: [0.2, 0.21], 8: [0.24, 0.2]}, "a GPU")
    assert "from M = 1 to M = 4" in partly and "beyond M = 4 they do not fall" in partly
    figure = pipeline.bubble_vs_micro_batches({1: [0.5, 0.5], 4: [0.4, 0.4]}, 2,
                                              reference=("GPU, day", {1: [0.5, 0.5], 2: [0.3, 0.3], 8: [0.1, 0.1]}))
    labels = [line.get_label() for line in figure.axes[0].lines]
    assert labels == ["(S-1)/(M+S-1)", "stage 0, this launch", "stage 1, this launch", "stage 0, GPU, day",
                      "stage 1, GPU, day"]


def test_the_default_gradient_bucket_is_deepspeeds_documented_size():
    assert pipeline.default_bucket_elements() == 500_000_000  # DeepSpeed's docs: reduce_bucket_size 5e8


def test_the_gpu_reference_is_shown_beside_the_launch_and_a_disagreement_beyond_noise_is_said(monkeypatch):
    reference = {pipeline.SCHEDULES_REFERENCE: [("2 x GPU", "2026-01-01", "", _timed_runs(99, 75))],
                 "pipeline": [("2 x GPU", "2026-01-02", "", _timed_runs(99, 75))]}
    monkeypatch.setattr(pipeline.references, "reference_runs", lambda name: reference.get(name, []))
    lines = pipeline.reference_timings(_timed_runs(290, 110), ALONE).splitlines()
    assert lines[0].startswith("DualPipeV against 1F1B, reference (2 x GPU, 2026-01-01): "
                               "pipeline-dualpipev 0.99x pipeline's")
    assert lines[0].endswith("this launch DISAGREES beyond both spreads: 2.90x here against 0.99x in the reference")
    assert lines[1].startswith("the pipeline against data parallelism, reference (2 x GPU, 2026-01-02): "
                               "pipeline 1.33x data-parallel's")
    assert lines[1].endswith("this launch DISAGREES beyond both spreads: 0.91x here against 1.33x in the reference")
    agreeing = pipeline.reference_timings(_timed_runs(99, 75), ALONE)
    assert agreeing.count("this launch agrees within the spread") == 2
    assert pipeline.reference_timings(_timed_runs(290, 110), BUSY).count("no comparison with it is drawn") == 2
    assert pipeline.reference_timings().count("reference (2 x GPU") == 2


def _micro_batch_runs(*steps_ms: float) -> dict:
    """:func:`_timed_runs` with pipeline-M1, M2, M4, M8 at these step times (data parallelism: 110 ms)."""
    return {**_timed_runs(290, 110),
            **{f"pipeline-M{m}": _stepped(900, ms, ms, ms) for m, ms in zip(pipeline.MICRO_BATCH_COUNTS, steps_ms)}}


def test_the_utilization_reading_withholds_a_busy_launchs_direction_and_shows_the_gpu_reference(monkeypatch):
    reference = {"pipeline": [("2 x GPU", "2026-01-02", "", _timed_runs(99, 75))]}
    monkeypatch.setattr(pipeline.references, "reference_runs", lambda name: reference.get(name, []))
    busy = pipeline.utilization_reading(_micro_batch_runs(25, 30, 100, 50), BUSY).splitlines()
    assert busy[0].startswith("Verdicts withheld (other processes (3) used 60%")  # before any ratio
    assert ("This launch's step times below (the pipeline at 0.23x to 0.91x data parallelism's step time, not "
            "falling steadily as M grows)") in busy[0]
    assert busy[0].index("withheld") < busy[0].index("0.23x") and "say nothing for or against it" in busy[0]
    assert busy[1] == ("The GPU reference (2 x GPU, 2026-01-02) is what tests it: there pipeline took 1.33x "
                       "data-parallel's step time.")
    steady = pipeline.utilization_reading(_micro_batch_runs(180, 140, 100, 95), BUSY).splitlines()[0]
    assert "not falling steadily" not in steady
    alone = pipeline.utilization_reading(_micro_batch_runs(25, 30, 100, 50), ALONE).splitlines()[0]
    assert alone.startswith("This launch ran alone") and "withheld" not in alone
    drifted = {**_micro_batch_runs(25, 30, 100, 50), pipeline.AGAIN: _stepped(900, 150, 151, 149)}
    assert pipeline.utilization_reading(drifted, ALONE).splitlines()[0].endswith("show no direction either way.")


class _States(dict):
    """A stand-in record: ``world_size`` and, per rank, model-state bytes by kind."""

    def __init__(self, by_kind: dict[str, int]):
        super().__init__(world_size=1)
        self.by_kind = by_kind

    def states(self, rank: int = 0) -> dict[str, int]:
        return self.by_kind

    def model_state_bytes(self, rank: int = 0) -> int:
        return sum(self.by_kind.values())


def test_the_states_table_has_a_row_for_every_part_of_the_total():
    pipe = _States({"params": 10, "grads": 10, "optimizer": 20, "master": 10})
    baseline = _States({"params": 20, "grads": 20, "optimizer": 40, "master": 0})
    rows = [line.split() for line in pipeline.states_table(pipe, baseline).splitlines()[2:]]
    assert rows[3] == ["0", "master", "copy", "10", "0", "(none)"]
    assert rows[4] == ["0", "model", "states", "50", "80", "0.625"]
    assert sum(int(r[-3]) for r in rows[:4]) == int(rows[4][-3])  # the rows add up to the total


@pytest.mark.parametrize("name, checkpointed", [("llama", False), ("llama-ckpt", True)])
def test_saved_tensor_counter_matches_the_formula_in_process(name, checkpointed):
    model = models.build(name)
    batch = models.make_batch(name, list(range(4)))
    counter = activations.SavedTensorCounter(model)
    counter.start()
    models.loss_of(model, name, batch).backward()
    counter.stop()
    found = counter.summary()
    expected = activations.activation_bytes_per_layer(4, 64, 64, 4, 172, checkpointed=checkpointed)["total"]
    assert found["per_layer"][1] == expected
    assert found["per_layer"][0] == expected + (0 if checkpointed else activations.rotary_bytes(64, 16))
    floats = sum(elements * 4 for dtype, elements in found["outside_blocks"] if dtype == "float32")
    assert floats == activations.activation_bytes_outside_layers(4, 64, 64, 256)


def _checkpoint_function(kind: str):
    if kind == "torch":
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    import deepspeed  # deferred: as in the ranks, DeepSpeed comes after the course's environment

    return deepspeed.checkpointing.checkpoint


def _checkpointed_llama(kind: str, style: str) -> torch.nn.Module:
    """The course's 'llama' with every decoder layer checkpointed by ``kind``, as transformers 5.24 does it
    (``forward`` inside the checkpoint, module hooks outside) or as 5.17 did (``__call__``: hooks inside)."""
    model = models.build("llama")
    function = _checkpoint_function(kind)
    if style == "forward":
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)
        return model
    for layer in activations.decoder_layers(model):
        class CallCheckpointedDecoderLayer(type(layer)):
            def __call__(self, *args, **kwargs):  # transformers 5.17's GradientCheckpointingLayer.__call__
                return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        layer.__class__ = CallCheckpointedDecoderLayer
        layer._gradient_checkpointing_func = function
    return model


@pytest.mark.parametrize("kind", ["torch", "deepspeed"])
@pytest.mark.parametrize("style", ["forward", "__call__"])
def test_the_counter_sees_each_checkpointed_layer_input_whichever_side_of_the_checkpoint_its_hooks_run(kind, style):
    model = _checkpointed_llama(kind, style)
    functions = [layer._gradient_checkpointing_func for layer in activations.decoder_layers(model)]
    batch = models.make_batch("llama", list(range(4)))
    counter = activations.SavedTensorCounter(model)
    counter.start()
    models.loss_of(model, "llama", batch).backward()
    counter.stop()
    assert counter.summary()["per_layer"] == [4 * 64 * 64 * 4] * 2  # b·s·h fp32: each layer's input
    assert [layer._gradient_checkpointing_func for layer in activations.decoder_layers(model)] == functions


def test_with_hooks_inside_the_checkpoint_the_layer_hooks_alone_miss_the_inputs_as_on_the_gpu_reference(monkeypatch):
    # why the counter watches the checkpoint function: transformers 5.17 ran the layer's hooks inside it
    monkeypatch.setattr(activations.SavedTensorCounter, "_watched", lambda self, checkpoint, index: checkpoint)
    found = {}
    for kind in ("torch", "deepspeed"):
        counter = activations.SavedTensorCounter(model := _checkpointed_llama(kind, "__call__"))
        counter.start()
        models.loss_of(model, "llama", models.make_batch("llama", list(range(4)))).backward()
        counter.stop()
        found[kind] = counter.summary()
    inputs = 2 * 4 * 64 * 64 * 4
    assert found["torch"]["per_layer"] == found["deepspeed"]["per_layer"] == [0, 0]
    assert found["torch"]["outside"] == found["deepspeed"]["outside"] + inputs  # torch's, in the wrong place


@pytest.mark.parametrize("style", ["forward", "__call__"])
def test_the_phases_probe_times_each_layer_once_in_the_forward_not_again_in_its_replay(monkeypatch, style):
    ticks = itertools.count()
    monkeypatch.setattr(activations._Clock, "now", lambda self: next(ticks))  # one tick per time stamp
    model = _checkpointed_llama("deepspeed", style)
    ctx = types.SimpleNamespace(engine=types.SimpleNamespace(module=model), device_type="cpu")
    probe = activations.Phases()
    probe.start(ctx)
    probe.before_step(ctx, 0)                                  # tick 0
    loss = models.loss_of(model, "llama", models.make_batch("llama", list(range(4))))  # forward: ticks 1-6
    loss.backward()                                            # replays of both layers: no tick
    probe.after_backward(ctx, 0, 0)                            # tick 7
    probe.after_step(ctx, 0)                                   # tick 8
    assert probe.finish(ctx)["steps"] == [{"forward_s": 5, "layers_s": 2, "backward_s": 1, "step_s": 8, "rest_s": 2}]


#: A launch that had its devices to itself.
ALONE = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")


def _timed(step_ms: float, phases_ms: dict | None) -> records.Record:
    summary = minimal_summary()
    summary["step_time_s"] = {"median": step_ms / 1e3, "all": [step_ms / 1e3]}
    if phases_ms is not None:
        summary["probes"] = list(records.LEGACY_PROBES) + ["phases"]
        summary["phases"] = {"per_step": [{k: v / 1e3 for k, v in phases_ms.items()}], "rank": 0}
    return records.Record(summary)


def test_the_recomputation_findings_name_which_assumption_of_the_four_thirds_rule_failed():
    plain = {"forward_s": 10, "layers_s": 8, "backward_s": 15, "rest_s": 5, "step_s": 30}
    runs = {"plain": _timed(30, plain), "deepspeed": _timed(41, {**plain, "backward_s": 26, "step_s": 41})}
    found = activations.recompute_findings(runs, ["plain", "deepspeed"], ALONE).splitlines()
    assert found[0].startswith("no checkpointing is faster: deepspeed.checkpointing takes 1.37x its time, beyond")
    assert found[1:] == [
        "deepspeed.checkpointing: 1.37x the fastest step without checkpointing, above the rule's 1.33x.",
        "Without checkpointing the loss and backward took 1.50 times the forward (the rule assumes 2: shorter, so one "
        "forward is more than a third of forward + backward), and the decoder layers were 80% of the forward; one "
        "more forward of them predicts 1.27x.",
        "deepspeed.checkpointing: its backward grew by 1.38 times the layers' forward (more than the one forward "
        "the rule counts)."]
    unsplit = {"plain": _timed(30, None), "deepspeed": _timed(39, None)}
    assert activations.recompute_findings(unsplit, ["plain", "deepspeed"], ALONE).splitlines()[2].startswith(
        "These runs were not split into phases")


def test_the_recomputation_findings_say_nothing_of_time_when_the_load_guard_withholds_its_verdict():
    plain = {"forward_s": 10, "layers_s": 8, "backward_s": 15, "rest_s": 5, "step_s": 30}
    runs = {"plain": _timed(30, plain), "deepspeed": _timed(41, {**plain, "backward_s": 26, "step_s": 41})}
    busy = load_guard.Load("cpu", 3, 0.5, 2, 10.0, 20, "test")
    found = activations.recompute_findings(runs, ["plain", "deepspeed"], busy).splitlines()
    assert found[0].startswith("Verdict withheld: other processes (3) used 50%") and len(found) == 3
    assert found[1] == ("Under this load the step times cannot even rank the methods: other processes took the cores "
                        "for different steps of each run.")  # deepspeed is slower here, in median and fastest
    assert "rule" not in "\n".join(found)
    drifted = activations.recompute_findings(runs, ["plain", "deepspeed"], ALONE, again=_timed(45, plain))
    assert drifted.startswith("Verdict withheld: the machine changed during the sweep")


def _steps(step_ms: Sequence[float]) -> records.Record:
    """A record whose steps took ``step_ms`` (the first warms up), without phases."""
    summary = minimal_summary()
    summary["step_time_s"] = {"median": statistics.median(step_ms) / 1e3, "all": [t / 1e3 for t in step_ms]}
    return records.Record(summary)


def _reference(monkeypatch, runs: dict, conditions: str) -> None:
    """Make ``runs`` the chapter's one committed reference, measured under ``conditions``."""
    monkeypatch.setattr(activations.references, "reference_runs", lambda name: [("1 x GPU", "2026-11-28", "note", runs)])
    monkeypatch.setattr(activations.references, "reference_conditions", lambda name: [conditions])


def test_the_reference_findings_judge_the_reference_under_its_written_conditions(monkeypatch):
    sweep = {"plain": _steps([600, 100, 101, 99]), "deepspeed": _steps([700, 150, 151, 149])}
    _reference(monkeypatch, sweep, "executed by check-gpu, alone")
    found = activations.reference_findings().splitlines()
    assert found[2] == "Median step over no checkpointing's: deepspeed.checkpointing 1.50x (the rule: 1.33x)."
    assert found[3].startswith("Verdict withheld: the sweep did not measure its first setting (no checkpointing) again")
    _reference(monkeypatch, {**sweep, "plain-again": _steps([200, 100, 100, 101])}, "executed by check-gpu, alone")
    assert activations.reference_findings().splitlines()[3].startswith(
        "no checkpointing is faster: deepspeed.checkpointing takes 1.50x its time")
    _reference(monkeypatch, {**sweep, "plain-again": _steps([200, 100, 100, 101])}, "4 notebooks at a time")
    assert activations.reference_findings().splitlines()[3].startswith(
        "Verdict withheld: not measured alone (4 notebooks at a time)")


def test_the_reference_price_is_one_table_of_medians_after_the_warm_up_one_column_per_method(monkeypatch):
    # the older reference names torch's checkpoint "transformers": the same column as "torch"
    sweep = {"plain": _steps([600, 100, 90, 110]), "transformers": _steps([100, 130, 120, 140]),
             "deepspeed": _steps([700, 150, 151, 149])}
    _reference(monkeypatch, sweep, "executed by check-gpu, alone")
    lines = activations.reference_price().splitlines()
    assert lines[0].split("  ")[0] == "measured on" and "torch.utils.checkpoint" in lines[0]
    row = lines[2].split()
    # the first step is left out: medians 100 ms and 130 ms (the warm-up's 600 ms would make plain's 105)
    assert row[-6:] == ["1", "100.0", "1.30x", "1.50x", "-", "1.33x"]
    assert lines[4] == "1 x GPU: verdict withheld, the sweep did not measure its first setting (no checkpointing) " \
                       "again at its end: the ratios are for reading only."
    _reference(monkeypatch, {**sweep, "plain-again": _steps([200, 100, 100, 101])}, "executed by check-gpu, alone")
    assert activations.reference_price().splitlines()[4].startswith("1 x GPU: the differences exceed the steps' spread")


def test_the_gpu_findings_judge_the_timed_runs_with_the_repeat_under_the_watched_load():
    runs = {"plain": _steps([600, 100, 101, 99]), "torch": _steps([200, 130, 131, 129]),
            "section-only": _steps([900, 300, 300, 300]), "plain-again": _steps([200, 100, 100, 101])}
    alone = load_guard.Load("gpu", 0, None, 1, 10.0, 20, "test")
    found = activations.gpu_findings(runs, alone).splitlines()
    assert found[0].startswith("no checkpointing is faster: torch.utils.checkpoint takes 1.30x its time")
    assert "config section" not in found[0]  # the section alone changes no computation: not among the timed runs
    busy = load_guard.Load("gpu", 1, 0.9, 1, 10.0, 20, "test")
    assert activations.gpu_findings(runs, busy).startswith("Verdict withheld: 1 other process used this GPU")
    del runs["plain-again"]
    assert "again at its end" in activations.gpu_findings(runs, alone)


def test_the_totals_table_adds_up_every_layer_and_the_rest():
    runs = {"plain": _Run("llama", [508, 500]), "torch": _Run("llama", [20, 20])}
    rows = activations.totals_table(runs, ["plain", "torch"]).splitlines()
    assert rows[2].split()[-4:] == ["1,008", "1,000", "2,008", "1.000"]  # 508 + 500 summed, the rest beside it
    assert rows[3].split()[-4:] == ["40", "1,000", "1,040", "0.518"]


def test_the_pipeline_probe_on_a_model_that_is_no_pipeline_stops_before_any_process_starts(monkeypatch):
    importlib.import_module("helpers.core.train")  # its import asks py-cpuinfo, which runs `file`: not a launch
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="probe 'pipeline' measures training by helpers.topics.pipeline:train_step"):
        launch.run("zero1", model="llama", probes=(pipeline.PipelineTimeline,))
    with pytest.raises(ValueError, match="a pipeline model is a LLaMA-style model's name"):
        launch.run("zero1", model="llama", builder=pipeline.BUILDER, trainer=pipeline.TRAINER)


# --- one launch -------------------------------------------------------------------------------

STEPS = 2


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel")
    dp = launch.RunSpec("zero0", model="llama", steps=STEPS, probes=("model_states", "comm"),
                        overrides={"gradient_accumulation_steps": 1})  # 4 x 1 x 2 ranks = 8 samples
    specs = {
        "dp-before": dp,
        "pipe": launch.RunSpec("zero1", model="llama-pipe", steps=STEPS, builder=pipeline.BUILDER, trainer=pipeline.TRAINER,
                               probes=("model_states", "comm", pipeline.PipelineTimeline, activations.Activations),
                               overrides={"gradient_accumulation_steps": 2}),  # 4 x 2 micro-batches = 8
        "tp": launch.RunSpec("zero0", model="llama", steps=STEPS, probes=("model_states", "comm", tensor_parallel.ParamShards),
                             overrides={"tensor_parallel": {"autotp_size": 2}, "train_micro_batch_size_per_gpu": 8,
                                        "gradient_accumulation_steps": 1}),
        "dualpipev": launch.RunSpec("zero1", model="llama-pipe", steps=STEPS, builder=pipeline.BUILDER,
                                    trainer=pipeline.TRAINER, probes=("model_states", "comm", pipeline.PipelineTimeline),
                                    model_options={"schedule": "dualpipev"},  # 2 x 4 micro-batches = 8
                                    overrides={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}),
        "dsckpt": launch.RunSpec("zero0", model="llama-dsckpt", steps=STEPS, probes=(activations.Activations,),
                                 overrides={"gradient_accumulation_steps": 1}),
        "dp-after": dp,
    }
    specs = {name: launch.RunSpec(**{**spec.__dict__, "out": folder / name}) for name, spec in specs.items()}
    return launch.sweep(specs, name=f"test-parallel-{folder.name}", world_size=2, progress=False)


def test_data_parallelism_after_a_pipeline_and_autotp_in_the_same_ranks_is_unchanged(swept):
    before, after = swept["dp-before"].summary, swept["dp-after"].summary
    assert after["losses"] == before["losses"]
    assert after["comm"]["by_caller"] == before["comm"]["by_caller"]
    assert after["memory"]["model_states_bytes_per_rank"] == before["memory"]["model_states_bytes_per_rank"]


@pytest.mark.parametrize("name", ["pipe", "dualpipev", "tp", "dsckpt"])
def test_every_way_of_splitting_lands_on_data_parallel_losses(swept, name):
    tolerance = records.REORDERED_TOLERANCE["fp32"]
    assert records.loss_agreement(swept[name].losses, swept["dp-before"].losses, tolerance=tolerance) == "within 1e-05"
    # the one known departure, DeepSpeed's stage-0 clipping of a pipeline, is 1e-3 away: far outside it
    assert records.max_loss_difference(swept[name].losses, swept["dp-before"].losses) < tolerance


def test_pipeline_record(swept):
    pipe, dp = swept["pipe"], swept["dp-before"]
    assert (pipe["train_batch"], pipe["data_parallel_size"], pipe["deepspeed_train_batch"]) == (8, 1, 8)
    # model_states fired inside train_batch: each stage holds its own half of the parameters
    assert pipe.states(0)["params"] + pipe.states(1)["params"] == dp.states(0)["params"]
    # one activation out and one gradient back per micro-batch, b·s·h fp32 each
    for op in ("send", "recv"):
        assert pipe.comm_ops()[op] == {"count": 2, "bytes": 2 * pipeline.pipeline_p2p_bytes(4, 64, 64)}
    # 1F1B: stage 0 holds 2 micro-batches when its first backward starts, stage 1 one
    saved = [r["per_layer"][0] for r in pipe.summary["activations"]["per_rank"]]
    one = activations.activation_bytes_per_layer(4, 64, 64, 4, 172)["total"] + activations.rotary_bytes(64, 16)
    assert saved == [2 * one, one]
    section = pipe.summary["pipeline"]
    assert section["stages"] == 2 and section["micro_batches"] == 2
    assert [r["layers"] for r in section["per_rank"]] == [["EmbeddingStage", "DecoderStage"], ["DecoderStage", "HeadStage"]]
    assert all(0 <= b < 1 for b in section["bubble_per_rank"])
    kinds = {kind for kind, _, _ in section["last_step"][0]}
    assert {"ForwardPass", "BackwardPass", "SendActivation", "RecvGrad", "OptimizerStep"} <= kinds


def test_dualpipev_record(swept):
    dual = swept["dualpipev"]
    section = dual.summary["pipeline"]
    assert section["schedule"] == "dualpipev" and swept["pipe"].summary["pipeline"]["schedule"] == "1f1b"
    # rank 0 holds stages 0 and 3 (the embedding and the head), rank 1 stages 1 and 2 (the decoder layers)
    assert [[(f["stage"], f["layers"]) for f in r["phases"]] for r in section["per_rank"]] == [
        [(0, ["EmbeddingStage"]), (3, ["HeadStage"])], [(1, ["DecoderStage"]), (2, ["DecoderStage"])]]
    assert "3         0      1       HeadStage" in pipeline.phase_table(dual)
    # model_states fired once both backwards of a micro-batch had run on the rank: every parameter has its gradient
    assert all(dual.states(r)["grads"] == dual.states(r)["params"] for r in range(2))
    assert dual.states(0)["params"] + dual.states(1)["params"] == swept["dp-before"].states(0)["params"]
    # out and back: 4 transfers of one b·s·h activation or gradient per micro-batch on rank 0, in batches
    assert "send" not in dual.comm_ops()
    assert pipeline.p2p_per_step(dual)["bytes"] == 4 * 4 * pipeline.pipeline_p2p_bytes(2, 64, 64)
    assert "  16  " in pipeline.schedule_p2p_table(swept, ["dualpipev"])
    kinds = {kind for kind, _, _ in section["last_step"][0]}
    assert {"CommitP2P", "ForwardPass", "BackwardPass", "OptimizerStep"} <= kinds


PIPELINE_SCRIPT = """
import deepspeed
from deepspeed.pipe import PipelineModule

from helpers import measure
from helpers.core import models
from helpers.topics import activations, pipeline

deepspeed.init_distributed()
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
          "zero_optimization": {"stage": 1}}
model = PipelineModule(layers=pipeline.llama_stages(models.build("llama", seed=0)), num_stages=2,
                       partition_method="parameters", loss_fn=models.lm_loss)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=measure.configure(config))
meter = measure.attach(engine, steps=STEPS, out=OUT, model="llama-pipe",
                       probes=("model_states", "comm", pipeline.PipelineTimeline, activations.Activations))
for step in range(STEPS):
    batches = [models.make_batch("llama", models.sample_indices(step, m, 0, 1, 4, 2)) for m in range(2)]
    engine.train_batch(data_iter=iter([(b.inputs, b.targets) for b in batches]))
meter.finish()
deepspeed.comm.destroy_process_group()
"""


def test_measure_records_a_pipeline_scripts_train_batch_as_the_sweep_records_the_same_run(swept, tmp_path):
    script = tmp_path / "train_pipeline.py"
    script.write_text(f"STEPS, OUT = {STEPS}, {str(tmp_path / 'run')!r}\n" + PIPELINE_SCRIPT)
    launch.run_script(script, world_size=2, show=False, timeout=300)
    mine, swept_run = records.load(tmp_path / "run"), swept["pipe"]
    assert mine.losses == swept_run.losses and len(mine.losses) == STEPS
    # the probes' after_backward fired inside train_batch, as in the sweep: the same states, saved tensors and sends
    assert [mine.states(r) for r in range(2)] == [swept_run.states(r) for r in range(2)]
    assert mine.summary["activations"]["per_rank"] == swept_run.summary["activations"]["per_rank"]
    assert mine.comm_ops()["send"] == swept_run.comm_ops()["send"]
    assert mine.summary["pipeline"]["micro_batches"] == 2 and mine.summary["pipeline"]["schedule"] == "1f1b"


def test_autotp_record(swept):
    tp = swept["tp"]
    assert (tp["train_batch"], tp["data_parallel_size"], tp["deepspeed_train_batch"]) == (8, 1, 16)
    expected = tensor_parallel.tensor_parallel_collectives(2, 8, 64, 64, 256, 2)
    for (op, where), (count, size) in expected.items():  # one micro-step per optimizer step here
        assert tp.summary["comm"]["by_caller"][op][where] == {"count": count, "bytes": count * size}
    shards = tp.summary["param_shards"]["per_rank"]
    assert shards[0]["params"]["model.layers.0.self_attn.q_proj.weight"]["shape"] == [32, 64]
    assert shards[1]["params"]["model.layers.0.mlp.down_proj.weight"]["shape"] == [64, 86]
    assert shards[0]["params"]["model.embed_tokens.weight"]["shape"] == [256, 64]
    assert tp.states(0)["params"] == sum(p["bytes"] for p in shards[0]["params"].values())


def test_deepspeed_checkpoint_keeps_each_layer_input_only(swept):
    found = swept["dsckpt"].summary["activations"]["per_rank"][0]
    assert found["per_layer"] == [4 * 64 * 64 * 4] * 2


# --- chapter 10's exercises, on runs made up of what the activations probe records ----------------------

class _Run(dict):
    """A record stand-in: the summary fields and the activations section the exercises read."""

    def __init__(self, model: str, per_layer: list[int], outside: int = 1000):
        super().__init__(micro_batch=4, precision="fp32")
        self.model_name = model
        self._section = {"per_rank": [{"per_layer": per_layer, "outside": outside,
                                       "total": sum(per_layer) + outside, "by_device": {"cpu": sum(per_layer) + outside}}]}

    def section(self, name: str) -> dict:
        assert name == "activations"
        return self._section


def test_exercise_checkpointed_layer_bytes_is_checked_against_the_probes_measurement():
    shape = models.shape_of("llama-long")
    kept = 4 * shape.seq * shape.hidden * 4  # b s h elements in fp32
    runs = {"long-torch": _Run("llama-long-ckpt", [kept, kept])}
    assert activations.exercise_checkpointed_layer_bytes(kept, runs)
    assert not activations.exercise_checkpointed_layer_bytes(kept // 4, runs)  # elements, not bytes
    assert not activations.exercise_checkpointed_layer_bytes(..., runs).answered


def test_exercise_host_bytes_is_checked_against_the_references_host_memory(monkeypatch):
    one = 4 * 1024 * 1024 * 4  # llama-gpu: b s h elements in fp32
    moved = _Run("llama-gpu-dsckpt", [one] * 9, outside=500)
    moved._section["per_rank"][0]["by_device"] = {"cuda": 2 * one + 500, "cpu": 7 * one}
    monkeypatch.setattr(activations.references, "reference_runs",
                        lambda name: [("1 x GPU", "2026-11-28", "note", {"plain": _Run("llama-gpu", [1])}),
                                      ("2 x GPU", "2026-11-29", "note", {"deepspeed-cpu": moved})])
    assert activations.exercise_host_bytes(7 * 16)  # MiB
    assert not activations.exercise_host_bytes(8 * 16)  # the newest input stays on the GPU
    assert not activations.exercise_host_bytes(7 * one)  # bytes, not MiB
    blank = activations.exercise_host_bytes(...)
    assert not blank.answered and "2 x GPU" in str(blank) and "8 checkpointed decoder layers" in str(blank)
    assert "7 inputs of 16 MiB" in str(activations.exercise_host_bytes(7 * 16))
    monkeypatch.setattr(activations.references, "reference_runs", lambda name: [])
    assert not activations.exercise_host_bytes(7 * 16)


def test_the_exercises_hints_name_the_quantity_not_the_solution():
    hint = lambda verdict: str(verdict).split("Hint: ", 1)[1]
    host = hint(activations.exercise_host_bytes(...))
    assert "exercise 1" in host and "layers - 1" not in host and "7" not in host
    shape = models.shape_of("llama-long")
    layer = hint(activations.exercise_checkpointed_layer_bytes(..., {"long-torch": _Run("llama-long-ckpt", [1, 1])}))
    assert "b·s·h" not in layer and "elements" not in layer
    bubble = hint(pipeline.exercise_micro_batches(..., stages=4, share=0.1))
    assert "bubble" in bubble and "(S-1)" not in bubble and "solve" not in bubble
    sends = {"by_op": {"send": {"count": 4.0, "bytes": 262144.0}}, "bytes_per_step": 262144.0,
             "wire_bytes_per_step": 262144.0}
    record = records.Record({**minimal_summary(), "name": "pipeline", "model": {"name": "llama-pipe", "params": 1},
                             "grad_accum": 4, "train_batch": 32, "comm": sends})
    p2p = hint(pipeline.exercise_p2p_bytes(..., record))
    assert "b·s·h" not in p2p and "b x s x h" not in p2p
    assert "class name" not in hint(pipeline.exercise_partition(...))


def test_the_rotary_note_names_the_cos_and_sin_only_where_they_make_the_difference():
    shape = models.shape_of("llama")
    rotary = 2 * shape.seq * (shape.hidden // shape.heads) * 4
    assert activations.rotary_note(_Run("llama", [1000 + rotary, 1000])) == (
        f"Layer 0 saved {rotary:,} bytes more than layer 1: the rotary cos and sin, 2·s·d = 2 x {shape.seq} x "
        f"{shape.hidden // shape.heads} x 4 bytes = {rotary:,}, which the first layer keeps for every layer.")
    assert "something else differs" in activations.rotary_note(_Run("llama", [1000 + rotary + 4, 1000]))


def test_the_softmax_share_finds_the_a_s2_b_block_of_layer_0():
    shape = models.shape_of("llama-long")
    softmax = shape.heads * shape.seq ** 2 * 4  # elements at micro-batch 4
    run = _Run("llama-long", [8 * softmax, 8 * softmax])
    run._section["per_rank"][0]["layer0_blocks"] = [("float32", 1000), ("float32", softmax)]
    assert activations.softmax_share(run) == (f"{shape.seq} tokens: the a·s²·b softmax keeps "
                                              f"{records.format_bytes(4 * softmax)} of a layer's "
                                              f"{records.format_bytes(8 * softmax)} (50%)")
    run._section["per_rank"][0]["layer0_blocks"] = [("float32", 1000)]
    assert "no block" in activations.softmax_share(run)


def test_the_section_settings_are_deepspeeds_six():
    from deepspeed.runtime.activation_checkpointing import config
    assert set(activations.SECTION_SETTINGS) == set(config.ACT_CHKPT_DEFAULT)
    table = activations.section_settings_table().splitlines()
    assert len(table) == 2 + len(config.ACT_CHKPT_DEFAULT)
    assert table[2].startswith("partition_activations") and "model parallelism" in table[2]


def test_exercise_section_bytes_is_checked_against_the_block_only_run():
    same = {"plain": _Run("llama", [500, 500]), "section-only": _Run("llama", [500, 500])}
    assert activations.exercise_section_bytes(1.0, same)
    assert not activations.exercise_section_bytes(0.5, same)  # the layers alone, not the step's total
    assert "the same as the plain run's 2,000" in str(activations.exercise_section_bytes(1.0, same))
    fewer = {"plain": _Run("llama", [500, 500]), "section-only": _Run("llama", [20, 20])}
    assert activations.exercise_section_bytes(0.52, fewer) and "unlike the plain run's" in str(
        activations.exercise_section_bytes(0.52, fewer))
    assert not activations.exercise_section_bytes(..., same).answered


def test_cpu_checkpointing_findings_comment_the_launch_they_are_given():
    plain = _Run("llama", [500, 500])
    plain["device"] = "cpu"
    assert "leaves cpu_checkpointing out (its comment says why)" in activations.cpu_checkpointing_findings(
        {"plain": plain})
    one = 65_536  # llama-dsckpt: b s h elements in fp32
    without = _Run("llama-dsckpt", [one, one], outside=400)
    without._section["per_rank"][0]["by_device"] = {"cuda": 2 * one + 400}
    moved = _Run("llama-dsckpt", [2 * one, one], outside=400)  # layer 0's input counted on both sides
    moved._section["per_rank"][0]["by_device"] = {"cuda": 2 * one + 400, "cpu": one}
    moved["device"] = "cuda"
    found = activations.cpu_checkpointing_findings({"plain": plain, "deepspeed": without, "deepspeed-cpu": moved})
    rows = {line.split("  ")[0]: line.split() for line in found.splitlines()[2:6]}
    assert rows["on the GPU"][-3:] == ["2", "400", "B"] and rows["in host memory"][-3] == "1"
    assert rows["counted in the layers"][-2] == "3"
    assert found.splitlines()[-2] == ("2 layers, so 2 inputs: 1 were in host memory and 2 on the GPU, 1 of them on "
                                      "both sides (a copy still running), which the layers' count holds twice; 0 B "
                                      "left the GPU.")
    assert found.splitlines()[-1] == ("So the 64 KiB in host memory did not free 64 KiB on the GPU: 128 KiB "
                                      "without cpu_checkpointing, 128 KiB with it, 0 B freed.")


def test_crossover_terms_count_the_fp32_copies_of_bf16(monkeypatch):
    found = activations.crossover_terms().splitlines()
    softmax = next(line for line in found if line.startswith("a·s²·b")).split()
    assert softmax[1:3] == ["1", "6"]  # one tensor, kept in fp32 and in bf16
    assert softmax[3:] == ["96", "GiB", "32", "GiB"]  # 32 layers x 32 heads x 4096² x 6 (or 2) bytes
    assert next(line for line in found if line.startswith("b·s·h")).split()[1:3] == ["10", "24"]
    assert "fp32 output" in found[-1]
    assert activations.crossover_terms("fp32").splitlines()[4].split()[1:3] == ["1", "4"]


def test_outside_table_names_the_blocks_by_their_shape():
    run = _Run("llama", [500, 500])
    b, s, h, v = 4, 64, 64, models.LM_VOCAB
    run._section["per_rank"][0]["outside_blocks"] = [["float32", b * s * v], ["float32", b * s * h],
                                                     ["float32", b * s * h], ["int64", b * s], ["float32", b * s],
                                                     ["int64", b * (s + 1)],
                                                     ["float32", 1], ["float32", 3]]
    found = activations.outside_table(run)
    assert "final norm: input, normalized, weighted (b·s·h) 2 x float32 131,072" in " ".join(found.split())
    assert "targets, flattened for the loss (b·s) 1 x int64 2,048" in " ".join(found.split())
    assert "token windows, b·(s+1): the ids 1 x int64 2,080" in " ".join(found.split())
    assert "3 elements" in found and found.splitlines()[-1].startswith("formula, floating point only: ")


def test_recompute_table_shows_the_medians_the_verdict_quotes_and_the_load_sentence():
    runs = {"plain": _steps([600, 100, 300, 99]), "torch": _steps([200, 90, 95, 94])}
    table = activations.recompute_table(runs, ["plain", "torch"]).splitlines()
    assert table[0].split()[:4] == ["run", "median", "step", "ms"]
    assert table[3].split()[1:3] == ["94.0", "0.94x"]  # median of the steps after the first: 94 ms over 100 ms
    busy = load_guard.Load("cpu", 3, 0.6, 2, 10.0, 20, "test")
    found = activations.recompute_findings(runs, ["plain", "torch"], busy)
    assert ("Under this load the step times cannot even rank the methods" in found
            and "(torch.utils.checkpoint came out faster than no checkpointing in its median or fastest" in found)
    alone = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
    assert "cannot even rank" not in activations.recompute_findings(runs, ["plain", "torch"], alone)


def test_chapter_records_reads_the_runs_newer_than_the_launch_in_training_order(tmp_path):
    import json
    import os
    for age, name in ((300, "stale"), (20, "plain"), (10, "torch")):
        (tmp_path / name).mkdir()
        summary = tmp_path / name / "summary.json"
        summary.write_text(json.dumps({**minimal_summary(), "name": name}))
        os.utime(summary, (1e9 - age, 1e9 - age))
    assert list(activations.chapter_records(tmp_path, since=1e9 - 100)) == ["plain", "torch"]
    with pytest.raises(FileNotFoundError, match="did the script run"):
        activations.chapter_records(tmp_path, since=1e9)


# --- chapter 11's exercises: DeepSpeed's schedule and partitioning, run without processes ---------------

def test_exercise_micro_batches_counts_deepspeeds_schedule():
    assert pipeline.exercise_micro_batches(28, stages=4, share=0.1)  # 3/31 < 0.1
    assert not pipeline.exercise_micro_batches(27, stages=4, share=0.1)  # 3/30: the bubble is 0.1, not under it
    assert not pipeline.exercise_micro_batches(30, stages=4, share=0.1)  # (S-1)/share: the fill left in M
    assert pipeline.exercise_micro_batches(8, stages=2, share=0.12)  # 1/9 < 0.12 <= 1/8
    assert not pipeline.exercise_micro_batches(..., stages=4, share=0.1).answered


def test_exercise_p2p_bytes_reads_the_comms_loggers_sends_and_receives():
    call = 2 * 64 * 64 * 4  # one micro-batch of b = 2 samples, s = h = 64, fp32
    both = {"by_op": {"send": {"count": 8.0, "bytes": 8.0 * call}, "recv": {"count": 8.0, "bytes": 8.0 * call}},
            "bytes_per_step": 16.0 * call, "wire_bytes_per_step": 16.0 * call}
    record = records.Record({**minimal_summary(), "name": "pipeline-M8", "model": {"name": "llama-pipe", "params": 1},
                             "grad_accum": 8, "micro_batch": 2, "train_batch": 16, "data_parallel_size": 1,
                             "comm": both})
    assert pipeline.exercise_p2p_bytes(2 * 8 * call, record)  # an activation out, its gradient back, per micro-batch
    assert not pipeline.exercise_p2p_bytes(8 * call, record)  # the sends only
    assert not pipeline.exercise_p2p_bytes(2 * 8 * 4 * 64 * 64 * 4, record)  # M = 8 micro-batches of the M = 4 size
    assert "16 samples" in str(pipeline.exercise_p2p_bytes(..., record))
    assert not pipeline.exercise_p2p_bytes(..., record).answered


def test_exercise_partition_runs_deepspeeds_own_partitioning():
    assert pipeline.deepspeed_partition(pipeline.pipeline_layers("llama-gpu"), 4, "parameters") == [0, 3, 5, 7, 10]
    large = pipeline.pipeline_layers("llama-gpu", vocab=32_000)
    assert pipeline.deepspeed_partition(large, 4, "parameters") == [0, 2, 5, 8, 10]  # a heavy embedding and head
    assert pipeline.deepspeed_partition(large, 4, "uniform") == [0, 3, 6, 8, 10]
    assert pipeline.exercise_partition("type:DecoderStage")
    assert not pipeline.exercise_partition("parameters") and not pipeline.exercise_partition("uniform")
    assert pipeline.exercise_partition("parameters", vocab=256)  # the course's own vocabulary: light layers
    assert "DeepSpeed refuses it" in str(pipeline.exercise_partition("profile"))
    assert not pipeline.exercise_partition(...).answered


# --- chapter 12's exercises ---------------------------------------------------------------------------

def test_exercise_parameter_bytes_divides_only_what_the_plan_splits():
    whole, split = tensor_parallel.planned_parameter_count(tensor_parallel.shapes_before("llama"), "llama")
    assert tensor_parallel.exercise_parameter_bytes((whole + split // 4) * 4, tp=4)
    assert not tensor_parallel.exercise_parameter_bytes((whole + split) // 4 * 4, tp=4)  # the embedding split too
    assert not tensor_parallel.exercise_parameter_bytes(..., tp=4).answered


def test_crossover_tokens_is_where_autotps_bytes_meet_zero3s():
    psi, layers, hidden, vocab = 6_738_415_616, 32, 4096, 32_000
    tokens = tensor_parallel.crossover_tokens(psi, layers, hidden, vocab, tp=2)
    # on 2 ranks an all-reduce sends its size and ZeRO-3 sends psi elements: psi / ((7L + 1) h + V / 2)
    assert tokens == pytest.approx(psi / ((7 * layers + 1) * hidden + vocab / 2))
    at = tensor_parallel.tensor_parallel_wire_bytes(layers, 1, round(tokens), hidden, vocab, 2)
    assert at == pytest.approx(theory.zero3_wire_bytes(psi, 2), rel=1e-3)
    # both sides carry the same ring factor (n-1)/n: the crossing does not depend on the ranks
    assert tensor_parallel.crossover_tokens(psi, layers, hidden, vocab, tp=4) == pytest.approx(tokens)
    assert tensor_parallel.crossover_tokens(psi, 2 * layers, hidden, vocab, tp=2) < tokens


def test_exercise_crossover_tokens_takes_the_solution_and_refuses_the_bytes_without_the_logits():
    psi = 6_738_415_616
    assert tensor_parallel.exercise_crossover_tokens(psi / ((7 * 32 + 1) * 4096 + 16_000), psi)
    assert not tensor_parallel.exercise_crossover_tokens(psi / (2 * 32 * 4096), psi)  # Megatron's 2 per layer, no backward
    assert not tensor_parallel.exercise_crossover_tokens(..., psi).answered


def test_chapter_runs_reads_records_and_refusals_written_since_the_launch(tmp_path):
    old = tmp_path / "old-run"
    old.mkdir()
    (old / "refused.json").write_text(json.dumps({"type": "ValueError", "message": "before the launch"}))
    os.utime(old / "refused.json", (1.0, 1.0))
    refused = tmp_path / "autotp-gpt2"
    refused.mkdir()
    (refused / "refused.json").write_text(json.dumps({"type": "AssertionError", "message": "AutoTP not supported"}))
    found = tensor_parallel.chapter_runs(tmp_path, since=100.0)
    assert list(found) == ["autotp-gpt2"]
    assert str(found["autotp-gpt2"]) == "refused: AssertionError: AutoTP not supported"
    with pytest.raises(FileNotFoundError):
        tensor_parallel.chapter_runs(tmp_path, since=time.time() + 60)


def _stepped_record(steps_s):
    summary = minimal_summary()
    summary["step_time_s"] = {"median": sorted(steps_s)[len(steps_s) // 2], "all": list(steps_s)}
    return records.Record(summary)


def test_speed_verdict_is_withheld_without_a_load_and_given_alone_beyond_the_spread():
    runs = {"autotp": _stepped_record([9.0, 2.0, 2.02, 2.01]), "zero3": _stepped_record([9.0, 1.0, 1.01, 1.02]),
            "data-parallel": _stepped_record([9.0, 1.0, 1.01, 1.0]), "autotp-again": _stepped_record([2.0, 2.01, 2.02, 2.0])}
    assert "withheld" in tensor_parallel.speed_verdict(runs, load_guard.Load.unknown("gpu"))
    alone = load_guard.Load("gpu", 0, None, 2, 10.0, 20, "test")
    assert "faster" in tensor_parallel.speed_verdict(runs, alone)
    warmed = {**runs, "autotp-again": _stepped_record([1.0, 1.01, 1.0, 1.02])}  # AutoTP's repeat far from its first run
    assert "changed during the sweep" in tensor_parallel.speed_verdict(warmed, alone)


def test_exercise_autotp_config_is_parsed_by_deepspeed_and_counts_the_real_samples():
    right = {"train_micro_batch_size_per_gpu": 16, "tensor_parallel": {"autotp_size": 4}}
    assert tensor_parallel.exercise_autotp_config(right, world_size=8, tp=4, samples=32)
    stated = {**right, "train_batch_size": 32}  # the real batch: DeepSpeed's check counts all 8 ranks
    assert "DeepSpeed refuses it" in str(tensor_parallel.exercise_autotp_config(stated, world_size=8, tp=4, samples=32))
    assert not tensor_parallel.exercise_autotp_config({"train_micro_batch_size_per_gpu": 16}, world_size=8, tp=4, samples=32)
    assert not tensor_parallel.exercise_autotp_config(..., world_size=8, tp=4, samples=32).answered


def test_gpu_runs_keep_the_load_beside_them_and_a_later_reading_gets_it_back(tmp_path):
    for name in ("autotp", "zero3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({**minimal_summary(), "name": name}))
    (tmp_path / "autotp-mlp").mkdir()
    (tmp_path / "autotp-mlp" / "refused.json").write_text(json.dumps({"type": "AssertionError", "message": "no"}))
    seen = load_guard.Load("gpu", 1, 0.5, 2, 10.0, 20, "test")
    kept = tensor_parallel.keep_gpu_runs(tmp_path, 0.0, seen, note="test")  # a CPU record: nothing is saved
    assert set(kept) == {"autotp", "zero3"}
    assert tensor_parallel.saved_load(kept) == seen
    assert tensor_parallel.saved_load({"zero3": _stepped_record([1.0, 2.0])}).samples == 0  # saved without one: unknown


def _reference_tp_runs() -> dict:
    """The committed GPU reference's runs (a fresh copy each call)."""
    return references.reference_runs("tensor-parallel")[0][3]


def test_model_size_states_the_shape_and_the_tokens_per_micro_step():
    text = tensor_parallel.model_size(_reference_tp_runs()["autotp"])  # llama-gpu, 8 samples per group
    assert "8 decoder layers, hidden size 1024, MLP width 2816" in text
    assert "8 samples x 1024 = 8,192 tokens per micro-step" in text


def test_calls_breakdown_rebuilds_the_calls_per_step_from_the_layers():
    runs = _reference_tp_runs()  # llama-gpu: 8 decoder layers, 2 micro-steps a step
    text = tensor_parallel.calls_breakdown(runs["autotp"])
    assert text.startswith("119 calls per step = 2 micro-steps x 58 calls of AutoTP's layers + 3 once a step.")
    assert "8 decoder layers x 7 (all_reduce in forward 2, all_reduce in backward 5) + 2 for the LM head" in text
    assert "= 58." in text and "clip_grad_norm_, 2" in text and "allreduce_bucket, 1" in text
    runs["autotp"].summary["comm"]["by_caller"]["all_reduce"]["mystery"] = {"count": 4.0, "bytes": 16.0}
    text = tensor_parallel.calls_breakdown(runs["autotp"])  # a call of unknown origin is counted and named
    assert text.startswith("123 calls per step") and "mystery, 4 (not in the formula)" in text


def test_attention_heads_come_from_the_config_and_the_ranks_q_proj():
    text = tensor_parallel.attention_heads(_reference_tp_runs()["autotp"])  # llama-gpu on 2 ranks
    assert text.startswith("16 attention heads of 64") and "512 of its 1024 rows: 8 of the 16 heads, on each of 2" in text


def test_beyond_formula_finds_the_gradient_norms_all_reduce():
    runs = _reference_tp_runs()
    assert tensor_parallel.beyond_formula(runs).count("8 (its gradient norm's all-reduce: 8)") == 2
    runs["autotp"].summary["comm"]["by_caller"]["all_reduce"].pop("clip_grad_norm_")  # a record without it
    assert "autotp 0 (its gradient norm's all-reduce: 0)" in tensor_parallel.beyond_formula(runs)  # the gap was it


def _without_load_or_repeat(runs: dict) -> dict:
    """``runs`` as a reference saved without a load, its sweep without AutoTP's repeat."""
    runs.pop(tensor_parallel.AGAIN, None)
    for record in runs.values():
        record.summary.pop("load", None)
    return runs


def test_reference_sentence_judges_autotp_against_zero3_through_the_load_guard():
    runs = _without_load_or_repeat(_reference_tp_runs())
    text = tensor_parallel.reference_sentence(runs)
    assert "Verdict withheld: nothing recorded" in text and "recorded peak was higher" in text
    alone = load_guard.Load("gpu", 0, None, 2, 10.0, 20, "test")
    for record in runs.values():
        record.summary["load"] = dataclasses.asdict(alone)
    assert "did not measure its first setting (AutoTP) again" in tensor_parallel.reference_sentence(runs)
    runs["autotp"].summary["step_time_s"]["all"] = [9.0, 0.010, 0.011, 0.010]
    runs[tensor_parallel.AGAIN] = records.Record(json.loads(json.dumps(runs["autotp"].summary)))
    faster = tensor_parallel.reference_sentence(runs, who="This run")
    assert faster.startswith("This run, AutoTP against ZeRO-3: AutoTP is faster: ZeRO-3 takes")
    runs[tensor_parallel.AGAIN].summary["step_time_s"]["all"] = [9.0, 0.030, 0.031, 0.030]  # AutoTP slowed down
    assert "the machine changed during the sweep" in tensor_parallel.reference_sentence(runs)


def test_a_reference_saved_without_a_load_is_judged_under_its_written_conditions():
    runs = _without_load_or_repeat(_reference_tp_runs())
    assert tensor_parallel.reference_load(runs, "executed by check-gpu, alone").alone
    beside = tensor_parallel.reference_load(runs, "beside 2 other notebooks")
    assert not beside.alone and "beside 2 other notebooks" in beside.reason()
    busy = load_guard.Load("gpu", 2, 0.9, 2, 10.0, 20, "test")
    for record in runs.values():
        record.summary["load"] = dataclasses.asdict(busy)
    assert not tensor_parallel.reference_load(runs, "executed by check-gpu, alone").alone  # the saved load wins
    # the committed reference: alone on its own GPUs by its conditions and its saved load, but AutoTP's repeat
    # at the end of its sweep took far longer than AutoTP at the start
    assert "Verdict withheld: the machine changed during the sweep" in tensor_parallel.reference_sentences()


def test_the_timelines_legend_names_the_colour_of_every_bar():
    class _Timed:
        summary = {"pipeline": {"stages": 2, "micro_batches": 1, "last_step": [
            [("LoadMicroBatch", 0.0, 0.1), ("ForwardPass", 0.1, 1.0), ("SendActivation", 1.0, 1.2),
             ("RecvGrad", 1.2, 3.0), ("BackwardPass", 3.0, 5.0), ("ReduceGrads", 5.0, 5.1), ("OptimizerStep", 5.1, 6.0)],
            [("RecvActivation", 0.0, 1.2), ("ForwardPass", 1.2, 2.0), ("BackwardPass", 2.0, 3.0),
             ("SendGrad", 3.0, 3.1), ("ReduceTiedGrads", 3.1, 3.2)]]}}

    ax = pipeline.pipeline_timeline(_Timed()).axes[0]
    named = {tuple(h.get_facecolor()): t.get_text() for h, t in zip(ax.get_legend().legend_handles,
                                                                     ax.get_legend().get_texts())}
    drawn = {tuple(bar.get_facecolor()) for bar in ax.patches}
    assert drawn <= set(named)  # every colour on the chart is in the legend
    labels = " ".join(named.values())
    assert "send (dark grey)" in labels and "receive (light grey)" in labels and "lightest grey" in labels
