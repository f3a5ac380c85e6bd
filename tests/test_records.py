"""helpers.core.records (summary.json schema, accessors, tables) and helpers.core.communication (comms-logger folding)."""

from __future__ import annotations

import copy
import json

import pytest

from helpers.core import communication, records, theory

PSI = 1000
STATES = {"params": 4000, "grads": 2000, "optimizer": 4000, "master": 2000, "buffers": 512}


def minimal_summary() -> dict:
    """A hand-built summary.json with every core key and the default probes' sections, consistent: 2 ranks,
    ZeRO-2, fp32, 2 steps (written before runs declared their probes' keys: no ``probe_keys``)."""
    return {
        "world_size": 2, "backend": "gloo", "device": "cpu", "zero_stage": 2, "precision": "fp32",
        "micro_batch": 4, "grad_accum": 1, "train_batch": 8, "steps": 2,
        "model": {"name": "mlp", "params": PSI},
        "losses": [1.0, 0.75],
        "step_time_s": {"median": 0.1, "all": [0.1, 0.1]},
        "samples_per_s": 80.0,
        "memory": {"model_states_bytes_per_rank": [dict(STATES), dict(STATES)], "peak_bytes_per_rank": [10, 11]},
        "comm": {"by_op": {"all_reduce": {"count": 1.0, "bytes": 4000.0},
                           "all_gather_into_tensor": {"count": 1.0, "bytes": 2000.0}},
                 "bytes_per_step": 6000.0, "wire_bytes_per_step": 6000.0},
        "theory": {"model_states_bytes_per_rank": theory.model_state_bytes(PSI, 2, 2, "fp32"),
                   "comm_bytes_per_step": 8000, "comm_wire_bytes_per_step": 4000.0},
    }


# --- validate ---------------------------------------------------------------------------------

def test_minimal_summary_is_valid():
    records.validate(minimal_summary())


def test_validate_names_every_missing_key():
    summary = minimal_summary()
    del summary["losses"]
    del summary["model"]["params"]
    del summary["theory"]["comm_bytes_per_step"]
    with pytest.raises(ValueError) as caught:
        records.validate(summary)
    message = str(caught.value)
    for key in ("missing losses", "missing model.params", "missing theory.comm_bytes_per_step"):
        assert key in message
    assert "missing world_size" not in message


@pytest.mark.parametrize("key", records.CORE_KEYS)
def test_validate_rejects_each_missing_required_key(key):
    summary = minimal_summary()
    *parents, last = key.split(".")
    node = summary
    for part in parents:
        node = node[part]
    del node[last]
    with pytest.raises(ValueError, match=f"missing {key}"):
        records.validate(summary)


def test_validate_requires_the_keys_each_probe_declared():
    summary = minimal_summary()
    summary["probes"] = ["timing", "toy"]
    summary["probe_keys"] = {"timing": ["step_time_s.median"], "toy": ["toy.seen"]}
    with pytest.raises(ValueError, match="missing toy.seen"):
        records.validate(summary)
    summary["toy"] = {"seen": 3}
    records.validate(summary)


def test_accessors_read_the_record_by_name():
    r = records.Record(minimal_summary())
    assert r.memory.model_states(rank=1).grads == STATES["grads"]
    assert r.memory.model_states(0).total == sum(STATES[k] for k in records.MODEL_STATE_KEYS)
    assert r.memory.peak() == 11 and r.memory.peak(rank=0) == 10
    assert r.comm.wire_bytes_per_step == 6000.0 and r.comm.calls_per_step == 2.0
    assert r.timing.median_s == 0.1 and r.timing.samples_per_s == 80.0
    assert r.theory.model_states.optimizer == theory.model_state_bytes(PSI, 2, 2, "fp32")["optimizer"]
    assert (r.world_size, r.stage, r.precision, r.model_name, r.params) == (2, 2, "fp32", "mlp", PSI)


def test_a_figure_no_probe_measured_says_which_probe_would_have():
    summary = minimal_summary()
    summary["probes"] = ["timing"]
    del summary["memory"], summary["comm"]
    r = records.Record(summary)
    with pytest.raises(records.NotMeasured, match="did not use the 'model_states' probe .*it used timing"):
        r.memory.model_states(0)
    with pytest.raises(records.NotMeasured, match="'comm' probe"):
        r.comm.wire_bytes_per_step
    with pytest.raises(records.NotMeasured, match="'activations' probe"):
        r.section("activations")


@pytest.mark.parametrize("change, problem", [
    (lambda s: s.update(losses=[1.0]), "losses has 1 entries for 2 steps"),
    (lambda s: s["memory"]["model_states_bytes_per_rank"].pop(), "one entry per rank"),
    (lambda s: s.update(train_batch=16), "train_batch != micro_batch * grad_accum * data_parallel_size"),
    # a pipeline of 2 stages on 2 ranks: one data-parallel reader, so 4 * 1 * 1 samples per step
    (lambda s: s.update(data_parallel_size=1), "train_batch != micro_batch * grad_accum * data_parallel_size"),
    (lambda s: s["comm"]["by_op"]["all_reduce"].pop("bytes"), "comm.by_op.all_reduce needs count and bytes"),
    (lambda s: s["comm"]["by_op"]["all_reduce"].update(wire_bytes=1), "comm.by_op.all_reduce needs count and bytes"),
])
def test_validate_rejects_inconsistent_summaries(change, problem):
    summary = minimal_summary()
    change(summary)
    with pytest.raises(ValueError) as caught:
        records.validate(summary)
    assert problem in str(caught.value)


# --- Record and load --------------------------------------------------------------------------

def test_record_round_trips_through_load(tmp_path):
    summary = minimal_summary()
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    for where in (tmp_path, tmp_path / "summary.json", str(tmp_path)):
        record = records.load(where)
        assert record.summary == summary
        assert record.out == tmp_path
    assert record.losses == [1.0, 0.75]
    assert record.stage == 2
    assert record.params == PSI
    assert record.label == "ZeRO-2 fp32"
    assert record.states(1) == STATES
    assert record.theory_states == theory.model_state_bytes(PSI, 2, 2, "fp32")
    assert record.comm_ops() == summary["comm"]["by_op"]
    assert record["model.name"] == "mlp"
    assert record["memory.peak_bytes_per_rank"] == [10, 11]
    assert record.wall_s is None
    assert repr(record) == "<Record ZeRO-2 fp32, mlp (1,000 params), 2 x cpu, 2 steps>"


def test_load_refuses_an_invalid_summary(tmp_path):
    summary = minimal_summary()
    summary["probes"], summary["probe_keys"] = ["comm"], {"comm": ["comm.by_op", "comm.bytes_per_step"]}
    del summary["comm"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="missing comm.by_op"):
        records.load(tmp_path)


# --- formatting -------------------------------------------------------------------------------

@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (1_315_072, "1.25 MiB"),
    (3 * 1024**3, "3 GiB"), (2.5 * 1024**4, "2.5 TiB"), (-2048, "-2 KiB"),
])
def test_format_bytes(n, text):
    assert records.format_bytes(n) == text


def test_format_bytes_never_uses_scientific_notation():
    # Values of 1000-1023 of a unit must not print as "1e+03 KiB" (the next unit is used instead).
    for n in (1000 * 1024, 1024**2 - 1, 1010 * 1024**2, 1023 * 1024**3):
        text = records.format_bytes(n)
        assert "e+" not in text, f"format_bytes({n}) == {text!r}"
        number, unit = text.split()
        scale = 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit)
        assert float(number) * scale == pytest.approx(n, rel=0.01)


def test_format_table_aligns_columns():
    table = records.format_table([["a", 1], ["bb", 22]], ["name", "n"])
    assert table == "name   n\n----  --\na      1\nbb    22"


def test_loss_table_rounds_and_pads_short_runs():
    table = records.loss_table({"zero0": [1.0, 0.5], "zero2": [1.0]}, digits=2)
    assert table.splitlines() == ["step  zero0  zero2", "----  -----  -----", "1      1.00   1.00",
                                  "2      0.50       "]
    assert records.loss_table({"zero0": [1.23456, 0.5]}).splitlines()[2:] == ["1     1.2346", "2     0.5000"]


def test_max_loss_difference():
    assert records.max_loss_difference([1.0, 2.0, 3.0], [1.0, 2.5, 2.9]) == pytest.approx(0.5)


def test_memory_table_lists_measured_beside_paper():
    record = records.Record(minimal_summary())
    lines = records.memory_table([record]).splitlines()
    rows = {line.split()[2]: line for line in lines[2:]}  # "ZeRO-2 fp32 <state> ..."
    assert set(rows) == {"params", "grads", "optimizer", "master", "buffers"}
    assert rows["params"].split()[3:] == ["4,000", "4,000", "1.000"]
    assert rows["grads"].split()[3:] == ["2,000", "2,000", "1.000"]
    assert rows["optimizer"].split()[3:] == ["4,000", "4,000", "1.000"]
    assert rows["buffers"].endswith("(not in paper)")  # the paper has no buffers
    assert rows["master"].endswith("(not in paper)")  # nor a master copy in fp32


def test_comm_table_rows():
    record = records.Record(minimal_summary())
    lines = records.comm_table([record]).splitlines()
    assert lines[0].split() == ["run", "collective", "issued", "by", "(DeepSpeed", "function)", "count/step",
                                "bytes/step"]
    # without the logger's caller names (no comm.by_caller) the caller column reads "-"
    assert lines[2].split() == ["ZeRO-2", "fp32", "all_reduce", "-", "1", "4,000"]
    assert lines[3].split() == ["ZeRO-2", "fp32", "all_gather_into_tensor", "-", "1", "2,000"]
    assert lines[4].endswith("6,000") and "wire bytes" in lines[4]
    assert lines[5].endswith("4,000") and "paper" in lines[5]
    logged = records.comm_table([record], totals=False).splitlines()
    assert len(logged) == 4 and logged[0].split() == lines[0].split()  # the logged rows only
    assert [line.split() for line in logged[2:]] == [line.split() for line in lines[2:4]]


def test_comm_table_names_the_calling_function_when_logged():
    summary = minimal_summary()
    summary["comm"]["by_caller"] = {"all_reduce": {"allreduce_bucket": {"count": 1.0, "bytes": 4000.0}}}
    lines = records.comm_table([records.Record(summary)]).splitlines()
    assert lines[2].split() == ["ZeRO-2", "fp32", "all_reduce", "allreduce_bucket", "1", "4,000"]


def test_split_name_reads_the_debug_caller():
    assert communication.split_name("all_reduce | [Caller Func: allreduce_bucket]") == ("all_reduce", "allreduce_bucket")
    assert communication.split_name("all_reduce") == ("all_reduce", "")


def test_a_summary_that_validates_can_be_shown_in_comm_table():
    # comm_table reads comm.wire_bytes_per_step and theory.comm_wire_bytes_per_step: validate() must
    # require them, so a summary it accepts can always be shown.
    summary = minimal_summary()
    del summary["comm"]["wire_bytes_per_step"]
    del summary["theory"]["comm_wire_bytes_per_step"]
    try:
        records.validate(summary)
    except ValueError:
        return  # validate names the missing keys: consistent
    records.comm_table([records.Record(summary)])


# --- communication.by_op ----------------------------------------------------------------------

LOG_SUMMARY = {
    "all_reduce": {
        1024: {"count": 2, "total_latency_ms": 1.0, "avg_latency_ms": 0.5, "msg_size_bytes": 1024},
        4096: {"count": 1, "total_latency_ms": 1.0, "avg_latency_ms": 1.0, "msg_size_bytes": 4096},
    },
    "all_gather_into_tensor": {512: {"count": 3, "total_latency_ms": 1.0, "msg_size_bytes": 512}},
    "reduce_scatter_tensor": {2048: {"count": 1, "total_latency_ms": 1.0, "msg_size_bytes": 2048}},
    "log_summary_barrier": {0: {"count": 1, "total_latency_ms": 1.0, "msg_size_bytes": 0}},
    "barrier": {0: {"count": 5, "total_latency_ms": 1.0, "msg_size_bytes": 0}},
}


@pytest.mark.parametrize("n", [2, 4])
def test_by_op_folds_sizes_and_ignores_barriers(n):
    table = communication.by_op(copy.deepcopy(LOG_SUMMARY), n)
    assert set(table) == {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
    assert table["all_reduce"]["count"] == 3
    assert table["all_reduce"]["bytes"] == 1024 * 2 + 4096
    assert table["all_reduce"]["wire_bytes"] == pytest.approx(2 * (n - 1) / n * (1024 * 2 + 4096))
    assert table["all_gather_into_tensor"] == pytest.approx(
        {"count": 3, "bytes": 1536, "wire_bytes": (n - 1) * 512 * 3})
    assert table["reduce_scatter_tensor"] == pytest.approx(
        {"count": 1, "bytes": 2048, "wire_bytes": (n - 1) / n * 2048})
    for op, row in table.items():
        sizes = LOG_SUMMARY[op]
        assert row["wire_bytes"] == pytest.approx(
            sum(theory.wire_bytes(op, size, n) * stats["count"] for size, stats in sizes.items()))


def test_by_op_accepts_string_sizes_from_json():
    table = communication.by_op({"all_reduce": {"1024": {"count": 2}}}, 2)
    assert table == {"all_reduce": {"count": 2, "bytes": 2048, "wire_bytes": 2048.0}}


def test_by_op_on_one_rank_has_no_wire_bytes():
    table = communication.by_op({"all_reduce": {1024: {"count": 2}}, "log_summary_barrier": {0: {"count": 1}}}, 1)
    assert table == {"all_reduce": {"count": 2, "bytes": 2048, "wire_bytes": 0.0}}


def test_per_step_divides_every_figure():
    table = {"all_reduce": {"count": 4, "bytes": 4096, "wire_bytes": 4096.0}}
    assert communication.per_step(table, 2) == {"all_reduce": {"count": 2, "bytes": 2048, "wire_bytes": 2048.0}}


def test_a_ratio_over_nothing_says_why_instead_of_dividing_by_zero():
    from helpers.core import records

    assert records.format_ratio(3.0, 2.0, suffix="x") == "1.50x"
    assert records.format_ratio(3.0, 0.0) == "- (one rank sends nothing)"


def test_a_gpu_peak_measured_after_other_runs_of_its_launch_before_engines_were_released_is_an_upper_bound():
    from helpers.core import records

    run = {"device": "cuda", "launch": {"position": 2, "of": 3}, "memory": {"peak_bytes_per_rank": [2**30, 3 * 2**30]}}
    assert records.format_peak(run) == records.UPPER_BOUND + "3 GiB" and records.format_peak(run, 0).endswith(" 1 GiB")
    assert records.format_peak({**run, "launch": {"position": 1, "of": 3}}) == "3 GiB"  # the first of its launch
    assert records.format_peak({**run, "device": "cpu"}) == "3 GiB"  # CPU peaks say they grow, in the probe's doc
    released = {**run, "memory": {**run["memory"], "earlier_runs_released": True}}
    assert not records.peak_may_include_earlier_runs(released)
    table = records.format_table([["a", records.format_peak(run)], ["b", records.format_peak(released)]], ["run", "peak"])
    assert table.endswith(records.PEAK_NOTE) and table.count(records.UPPER_BOUND) == 2  # the cell and the note
    assert records.PEAK_NOTE not in records.format_table([["b", "3 GiB"]], ["run", "peak"])
