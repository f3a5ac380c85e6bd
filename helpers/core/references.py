"""GPU results committed with the course: save them on a GPU machine, read them in any notebook.

A chapter that measures something worth keeping from a GPU calls :func:`save_reference` with its records;
on a GPU machine that writes ``runs/reference/<name>-<N>x<device>.json`` with the machine's software,
hardware and conditions, for an instructor to copy to ``notebooks/reference/``. Every learner's copy of
the chapter then reads them back (:func:`reference_runs`, :func:`references_report`) beside their own runs.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Callable, Mapping

from helpers.core import environment, launch, records

#: Results measured on GPU machines, committed with the course (one JSON file per experiment and device).
REFERENCE_DIR = environment.REPO_ROOT / "notebooks" / "reference"



#: Where a GPU run saves its own results for an instructor to commit.
NEW_REFERENCE_DIR = launch.RUNS_DIR / "reference"



#: Set by ``benchmarks/reference.py``: under what conditions references were measured (alone on the
#: machine, or beside other notebooks), stored with each reference.
CONDITIONS_VARIABLE = "COURSE_REFERENCE_CONDITIONS"



def save_reference(name: str, runs: Mapping[str, records.Record | dict], note: str = "",
                   machine: Mapping | None = None, conditions: str | None = None) -> Path | None:
    """On a GPU machine, keep ``runs`` (records, or the summary dicts of other tasks) as
    ``runs/reference/<name>-<N>x<device>.json`` for an instructor to commit to ``notebooks/reference/``,
    with the software and hardware that measured them (versions, GPUs, ``nvidia-smi topo -m``, driver, date)
    and the conditions (:data:`CONDITIONS_VARIABLE`). Runs a sweep recorded as failures
    (``RunSpec(on_error="record")``) are left out. ``machine`` ({"software": ..., "hardware": ...}) and
    ``conditions`` stand in for this machine's and the variable's where the runs were measured elsewhere
    (:func:`adopt_records`). Does nothing for CPU runs; returns the file written."""
    summaries = {k: (r.summary if isinstance(r, records.Record) else r) for k, r in runs.items()
                 if not isinstance(r, Exception)}
    first = next(iter(summaries.values()))
    if first.get("device") != "cuda":
        return None
    device = f"{first['world_size']}x{first['device_name']}".replace(" ", "-")
    NEW_REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    conditions = (conditions or os.environ.get(CONDITIONS_VARIABLE)
                  or "not stated (measured outside benchmarks/reference.py)")
    machine = machine or {"software": environment.software(), "hardware": environment.hardware()}
    payload = {"experiment": name, "device": f"{first['world_size']} x {first['device_name']}",
               "date": datetime.date.today().isoformat(), "note": note, "software": dict(machine["software"]),
               "hardware": dict(machine["hardware"]), "conditions": conditions, "runs": summaries}
    path = NEW_REFERENCE_DIR / f"{name}-{device}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path



def adopt_records(name: str, folders: Mapping[str, str | Path], note: str, conditions: str, why: str,
                  machine_file: str | Path | None = None) -> Path:
    """Keep GPU run records that came back without their reference file (a device call stopped before it
    wrote one) as the reference ``name``: the records are the GPU's own, as written by its ranks; the
    conditions are given; software and hardware come from ``machine_file`` (the ``device-environment.json``
    that ``benchmarks/device_run.py`` writes on the GPU machine) or, without one, are marked as not recorded,
    with ``why``. Raises a ValueError for a folder without a record or a record not measured on GPUs."""
    runs = {}
    for label, folder in folders.items():
        if not (Path(folder) / "summary.json").exists():
            raise ValueError(f"{label}: {folder} holds no summary.json (a run's record); give a run's folder")
        runs[label] = records.load(folder)
        if runs[label].summary.get("device") != "cuda":
            raise ValueError(f"{label}: {folder} was not measured on GPUs (device {runs[label].summary.get('device')})")
    if machine_file:
        found = json.loads(Path(machine_file).read_text())
        machine = {"software": found["software"], "hardware": {**found["hardware"], "adopted": why}}
    else:
        machine = {"software": {"recorded": False, "why": why}, "hardware": {"recorded": False, "why": why}}
    path = save_reference(name, runs, note, machine=machine, conditions=conditions)
    assert path is not None  # every record is a GPU's (checked above)
    return path



def reference_runs(name: str) -> list[tuple[str, str, str, dict[str, records.Record | dict]]]:
    """Committed GPU results of experiment ``name``: a list of (device, date, note, {setting: record}).
    Training runs come back as :class:`helpers.core.records.Record`, other tasks' results as dicts."""
    return [(payload["device"], payload["date"], payload.get("note", ""),
             {k: records.Record(v) if "zero_stage" in v else v for k, v in payload["runs"].items()})
            for payload in _reference_payloads(name)]



def _reference_payloads(name: str) -> list[dict]:
    """The committed reference files of experiment ``name``, oldest file name first."""
    return [json.loads(path.read_text()) for path in sorted(REFERENCE_DIR.glob(f"{name}-*.json"))]



#: How a learner gets a chapter's GPU results where none are committed.
GPU_HOW = "run this chapter on a GPU machine to measure them."



def no_references(name: str, how: str = "") -> str:
    """The plain statement that no GPU result of experiment ``name`` is committed (and ``how`` to measure one)."""
    return (f"No GPU results for {name!r} are committed yet (notebooks/reference/{name}-*.json)"
            + (f": {how}" if how else "."))



def references_report(name: str, render: Callable[[dict], str], how: str = "") -> str:
    """Every committed GPU result of experiment ``name``: a "Measured on <device>, <date> (<note>):" line, a
    "Conditions: ..." line where the reference records them (its note may state them instead), and
    ``render(runs)`` below, one block per reference; or :func:`no_references`."""
    found = reference_runs(name)
    if not found:
        return no_references(name, how)
    stated = [f"Conditions: {payload['conditions']}\n" if payload.get("conditions") else ""
              for payload in _reference_payloads(name)]
    return "\n\n".join(f"Measured on {device}, {date} ({note}):\n{conditions}{render(runs)}"
                        for (device, date, note, runs), conditions in zip(found, stated))



def reference_conditions(name: str) -> list[str]:
    """What else ran while each committed GPU result of ``name`` was measured, in :func:`reference_runs`' order."""
    return [payload.get("conditions", "not stated") for payload in _reference_payloads(name)]



def each_reference(name: str, render: Callable[[str, str, str, dict, str], str], how: str = GPU_HOW,
                   sep: str = "\n\n") -> str:
    """``render(device, date, note, runs, conditions)`` for every committed GPU result of experiment ``name``
    (:func:`reference_runs`, :func:`reference_conditions`), joined by ``sep``; or :func:`no_references`."""
    found = reference_runs(name)
    if not found:
        return no_references(name, how)
    return sep.join(render(device, date, note, runs, conditions)
                    for (device, date, note, runs), conditions in zip(found, reference_conditions(name)))


def bytes_and_time_report(name: str, table: Callable[[dict, dict], str], how: str = "") -> str:
    """:func:`references_report` for references that keep two sets of the same runs, ``"bytes: <run>"`` (with
    the probes that measure communication) and ``"time: <run>"`` (timing only): ``table(by_bytes, by_time)``,
    ``by_time`` empty where a reference has no timing-only runs."""
    def render(runs: dict) -> str:
        by_bytes = {k.removeprefix("bytes: "): r for k, r in runs.items() if k.startswith("bytes: ")}
        by_time = {k.removeprefix("time: "): r for k, r in runs.items() if k.startswith("time: ")}
        return table(by_bytes, by_time)
    return references_report(name, render, how)
