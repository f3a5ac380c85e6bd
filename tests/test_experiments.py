"""helpers.experiments tables (no launches): ratios of one run against others, committed GPU references."""

from __future__ import annotations

import copy

from helpers import experiments, records
from test_records import minimal_summary


def _record(**states) -> records.Record:
    summary = minimal_summary()
    for rank_states in summary["memory"]["model_states_bytes_per_rank"]:
        rank_states.update(states)
    return records.Record(summary)


def test_comparison_table_gives_ratios_per_state_and_loss_agreement():
    base = _record()
    half = _record(optimizer=2000, grads=1000)  # Adam states and gradients halved, params kept
    half.summary["losses"] = [1.0, 0.7499]
    lines = experiments.comparison_table(half, {"stage 0": base}).splitlines()
    rows = {line[:25].strip(): line[25:].strip() for line in lines[2:]}
    assert lines[0].endswith("vs stage 0")
    assert rows["Adam states per rank"] == "0.50x"
    assert rows["gradients per rank"] == "0.50x"
    assert rows["parameters per rank"] == "1.00x"
    # model states leave buffers out: (4000 + 1000 + 2000 + 2000) / (4000 + 2000 + 4000 + 2000)
    assert rows["model states per rank"] == "0.75x"
    assert rows["collective calls per step"] == "2 vs 2"
    assert rows["losses"] == "differ by more than 1e-06"
    assert experiments.comparison_table(base, {"itself": copy.deepcopy(base)}).splitlines()[-1].endswith("within 1e-06")


def test_every_committed_gpu_reference_loads_and_names_its_device():
    for name in ("zero1-knobs", "zero2-knobs", "zero3-knobs"):
        found = experiments.reference_runs(name)
        assert found, f"notebooks/reference/{name}-*.json is missing"
        for device, date, note, runs in found:
            assert "x" in device and date and note
            assert all(r.summary["device"] == "cuda" for r in runs.values())
        assert experiments.reference_report(name).startswith("Measured on ")
