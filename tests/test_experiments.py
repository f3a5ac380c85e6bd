"""helpers.topics.zero tables (no launches): ratios of one run against others, committed GPU references."""

from __future__ import annotations

import copy

from helpers.core import records, references
from helpers.topics import zero
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
    lines = zero.comparison_table(half, {"stage 0": base}).splitlines()
    rows = {line[:25].strip(): line[25:].strip() for line in lines[2:]}
    assert lines[0].endswith("vs stage 0")
    assert rows["Adam states per rank"] == "0.50x"
    assert rows["gradients per rank"] == "0.50x"
    assert rows["parameters per rank"] == "1.00x"
    # model states leave buffers out: (4000 + 1000 + 2000 + 2000) / (4000 + 2000 + 4000 + 2000)
    assert rows["model states per rank"] == "0.75x"
    assert rows["collective calls per step"] == "2 vs 2"
    assert rows["losses"] == "differ by more than 1e-06"
    assert zero.comparison_table(base, {"itself": copy.deepcopy(base)}).splitlines()[-1].endswith("within 1e-06")


def test_every_committed_gpu_reference_loads_and_names_its_device():
    for name in ("zero1-knobs", "zero2-knobs", "zero3-knobs"):
        found = references.reference_runs(name)
        assert found, f"notebooks/reference/{name}-*.json is missing"
        for device, date, note, runs in found:
            assert "x" in device and date and note
            assert all(r.summary["device"] == "cuda" for r in runs.values())
        assert zero.reference_report(name).startswith("Measured on ")


def _gpu_folder(tmp_path, name: str, **changes) -> str:
    import json

    summary = {**minimal_summary(), "device": "cuda", "device_name": "NVIDIA H200", "backend": "nccl", **changes}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    return str(folder)


def test_adopted_records_keep_the_gpu_figures_and_say_what_was_not_recorded(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(references, "NEW_REFERENCE_DIR", tmp_path / "out")
    monkeypatch.delenv(references.CONDITIONS_VARIABLE, raising=False)
    path = references.adopt_records("adopted", {"time: a": _gpu_folder(tmp_path, "a")}, "a note", "alone", "stopped")
    payload = json.loads(path.read_text())
    assert path.name == "adopted-2xNVIDIA-H200.json"
    assert payload["software"] == payload["hardware"] == {"recorded": False, "why": "stopped"}
    assert payload["conditions"] == "alone" and payload["runs"]["time: a"]["step_time_s"]["median"] == 0.1
    assert references.CONDITIONS_VARIABLE not in __import__("os").environ  # left as it was
    machine = tmp_path / "device-environment.json"
    machine.write_text(json.dumps({"software": {"torch": "2.11"}, "hardware": {"gpu_count": 4}}))
    payload = json.loads(references.adopt_records("adopted", {"time: a": _gpu_folder(tmp_path, "b")}, "n", "c",
                                                   "stopped", machine).read_text())
    assert payload["software"] == {"torch": "2.11"} and payload["hardware"] == {"gpu_count": 4, "adopted": "stopped"}


def test_adopting_a_cpu_record_or_a_folder_without_one_is_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="no summary.json"):
        references.adopt_records("x", {"a": str(tmp_path)}, "n", "c", "w")
    with pytest.raises(ValueError, match="not measured on GPUs"):
        references.adopt_records("x", {"a": _gpu_folder(tmp_path, "cpu", device="cpu")}, "n", "c", "w")


def test_reference_reports_state_conditions_only_where_a_reference_records_them(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(references, "REFERENCE_DIR", tmp_path)
    runs = {"a": {"ratio": 1.5}}
    (tmp_path / "x-1xA.json").write_text(json.dumps({"device": "1 x A", "date": "d1", "note": "while others ran",
                                                     "runs": runs}))
    (tmp_path / "x-2xA.json").write_text(json.dumps({"device": "2 x A", "date": "d2", "note": "n",
                                                     "conditions": "alone", "runs": runs}))
    blocks = references.references_report("x", lambda found: f"{len(found)} run").split("\n\n")
    assert blocks[0].splitlines() == ["Measured on 1 x A, d1 (while others ran):", "1 run"]
    assert blocks[1].splitlines() == ["Measured on 2 x A, d2 (n):", "Conditions: alone", "1 run"]


def test_the_zero_references_state_their_conditions_in_their_note():
    report = zero.reference_report("zero1-knobs")
    assert "Conditions: " not in report and "ran at the same time" in report.splitlines()[0]
