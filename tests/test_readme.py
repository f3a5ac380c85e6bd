"""The README a newcomer reads: short, with a chapter table that lists every chapter notebook and whose CPU
minutes are the committed check report's (``docs/cpu-check/``), so a re-measured report changes the README."""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers.tools import notebooks

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
#: What a newcomer reads before they start (nanoGPT's README is about 2,000 words).
MAX_WORDS = 1500


def words(text: str) -> int:
    """Words outside code blocks, counted as the course's prose checks count them."""
    return len(re.findall(r"[A-Za-z0-9][\w'.,%/-]*", re.sub(r"```.*?```", " ", text, flags=re.S)))


def table_rows(text: str) -> dict[str, str]:
    """Notebook file name -> the CPU minutes the README's chapter table gives it."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        link = re.search(r"\(notebooks/([^)]+\.ipynb)\)", cells[0]) if cells else None
        if link and len(cells) >= 3:
            rows[link.group(1)] = cells[2]
    return rows


def latest_cpu_seconds() -> dict[str, float]:
    """Each notebook's seconds in the newest 2-core check report that timed it."""
    seconds: dict[str, tuple[str, float]] = {}
    for path in sorted((REPO_ROOT / "docs" / "cpu-check").glob("*.json")):
        for check in json.loads(path.read_text()).get("checks", []):
            date = str(check.get("date", ""))
            for entry in check.get("notebooks", []):
                name = entry["notebook"]
                if entry.get("ok") and date >= seconds.get(name, ("",))[0]:
                    seconds[name] = (date, entry["seconds"])
    return {name: s for name, (_, s) in seconds.items()}


def test_readme_is_short():
    assert words(README.read_text()) <= MAX_WORDS


def test_readme_has_no_dates():
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", README.read_text()) == []


def test_chapter_table_lists_every_chapter_with_its_measured_cpu_minutes():
    rows = table_rows(README.read_text())
    chapters = sorted(p.name for p in (REPO_ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    assert sorted(rows) == chapters
    measured = latest_cpu_seconds()
    for name, minutes in rows.items():
        expected = f"{measured[name] / 60:.1f}" if name in measured else "not yet timed"
        assert minutes == expected, f"{name}: the README says {minutes!r}, docs/cpu-check says {expected}"


def test_durations_report_sums_each_notebooks_cells():
    out = ("14.82s call     notebooks/01_plain.ipynb::Cell 4\n1.08s setup    notebooks/01_plain.ipynb::Cell 0\n"
           "2.00s call     notebooks/02_x.ipynb::Cell 1\n0.5s call tests/test_a.py::test_b\n")
    report = notebooks.durations_report(out, "2-core CPU, test", "2026-01-01 00:00:00", "n")
    assert report["checks"][0]["notebooks"] == [{"notebook": "01_plain.ipynb", "ok": True, "seconds": 15.9},
                                                {"notebook": "02_x.ipynb", "ok": True, "seconds": 2.0}]


def test_table_reader_finds_rows_and_minutes():
    sample = "| [00 · A](notebooks/00_a.ipynb) | learn | 0.5 | |\n| not a row |\n"
    assert table_rows(sample) == {"00_a.ipynb": "0.5"}


def test_chapter_time_leaves_out_checks_with_too_few_ranks(tmp_path, monkeypatch):
    report = {"machine": "4 x NVIDIA H200", "checks": [
        {"date": "2026-11-27", "ranks": 1, "jobs": 6, "notebooks": [{"notebook": "12_x.ipynb", "ok": True, "seconds": 60}]},
        {"date": "2026-11-27", "ranks": 4, "jobs": 1, "notebooks": [{"notebook": "12_x.ipynb", "ok": True, "seconds": 120}]}]}
    (tmp_path / "gpu-check").mkdir()
    (tmp_path / "gpu-check" / "check.json").write_text(json.dumps(report))
    monkeypatch.setattr(notebooks, "CHECK_REPORTS", (tmp_path / "gpu-check",))
    assert notebooks.check_times("12_x")[("gpu-check", 1)] == ("2026-11-27", 60, "4 x NVIDIA H200", 6)
    assert "1.0-2.0 min on GPUs" in notebooks.chapter_time("12_x")
    assert "2.0 min on GPUs" in notebooks.chapter_time("12_x", min_ranks=2)
    assert notebooks.chapter_time("12_x", min_ranks=8).startswith("No committed check report")


def test_chapter_time_gives_a_range_per_kind_of_machine(tmp_path, monkeypatch):
    gpu = {"machine": "4 x NVIDIA H200", "checks": [
        {"date": "2026-11-27", "ranks": 1, "jobs": 6, "notebooks": [{"notebook": "12_x.ipynb", "ok": True, "seconds": 60}]},
        {"date": "2026-11-27", "ranks": 4, "jobs": 1, "notebooks": [{"notebook": "12_x.ipynb", "ok": True, "seconds": 180}]}]}
    cpu = {"machine": "2-core x86-64 CPU", "checks": [
        {"date": "2026-11-27", "ranks": 2, "jobs": 1, "notebooks": [{"notebook": "12_x.ipynb", "ok": True, "seconds": 30}]}]}
    (tmp_path / "gpu").mkdir()
    (tmp_path / "cpu-check").mkdir()
    (tmp_path / "gpu" / "check.json").write_text(json.dumps(gpu))
    (tmp_path / "cpu-check" / "check.json").write_text(json.dumps(cpu))
    monkeypatch.setattr(notebooks, "CHECK_REPORTS", (tmp_path / "gpu", tmp_path / "cpu-check"))
    assert notebooks.chapter_time("12_x") == ("This notebook takes about 0.5 min on a CPU and 1.0-3.0 min on GPUs "
                                              "(the course's check reports, not this run; other work on the machine "
                                              "makes it slower).")
    assert notebooks.chapter_time("13_y").startswith("No committed check report")
