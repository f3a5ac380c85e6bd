"""Execute the course's notebooks top to bottom, outside Jupyter, and say which cell failed.

This is the instructor's check of a GPU box (``python3 -m helpers.course check-gpu``) and the way
``benchmarks/reference.py`` runs the chapters that save GPU references. A notebook's stored outputs are
the CPU's, so nothing is compared: a notebook passes when no cell raises (nbval's ``--nbval-lax`` judges
the same way). The executed copy, with this machine's outputs, is written beside a JSON result.

    python -m helpers.tools.notebooks notebooks/03_zero1_optimizer_states.ipynb --out runs/check/03 [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from helpers.core.environment import REPO_ROOT

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
#: The kernel the notebooks run in: this very Python, whatever kernels Jupyter has installed elsewhere.
KERNEL_NAME = "course-python"


#: The committed reports of executing every notebook (``check-gpu``), on GPUs and on a CPU.
CHECK_REPORTS = (REPO_ROOT / "docs" / "gpu-check", REPO_ROOT / "docs" / "cpu-check")
#: The folder of :data:`CHECK_REPORTS` whose reports ran on a CPU.
CPU_REPORTS = "cpu-check"
#: The notebook files of the chapters: ``NN_name.ipynb`` (and ``NNx_name.ipynb`` for a chapter between two).
CHAPTER_GLOB = "[0-9][0-9]*_*.ipynb"


def course_notebooks() -> list[Path]:
    """Every chapter notebook, in order (``notebooks/NN_*.ipynb``)."""
    return sorted(NOTEBOOK_DIR.glob(CHAPTER_GLOB))


def check_times(notebook: str, min_ranks: int = 1) -> dict[tuple[str, int], tuple[str, float, str, int]]:
    """How long executing ``notebook`` (its file name or stem) took in the committed check reports
    (``docs/gpu-check/``, ``docs/cpu-check/``): per (report folder, ranks), the latest check's date, seconds,
    machine and how many notebooks shared the machine. Checks on fewer than ``min_ranks`` ranks are left out."""
    name = notebook if notebook.endswith(".ipynb") else f"{notebook}.ipynb"
    latest: dict[tuple[str, int], tuple[str, float, str, int]] = {}
    for folder in CHECK_REPORTS:
        for path in sorted(folder.glob("*.json")):
            report = json.loads(path.read_text())
            for check in report.get("checks", []):
                machine = report.get("machine", "?")  # a description, or one per machine the checks name
                machine = check.get("machine") or (machine if isinstance(machine, str) else next(iter(machine), "?"))
                machine = machine.split(" (")[0].split(",")[0]
                date, ranks, shared = str(check.get("date", ""))[:10], check.get("ranks", 0), check.get("jobs", 1)
                for entry in check.get("notebooks", []):
                    key = (folder.name, ranks)
                    if (entry.get("notebook") == name and entry.get("ok") and ranks >= min_ranks
                            and date >= latest.get(key, ("",))[0]):
                        latest[key] = (date, entry["seconds"], machine, shared)
    return latest


def chapter_time(notebook: str, min_ranks: int = 1) -> str:
    """One line for the opening of a chapter: the range of minutes executing ``notebook`` took on CPUs and on
    GPUs in the committed check reports (:func:`check_times` gives each machine's)."""
    latest = check_times(notebook, min_ranks)
    if not latest:
        return (f"No committed check report has timed {Path(notebook).stem} yet "
                "(python3 -m helpers.course check-gpu makes one).")
    found: dict[str, list[float]] = {}
    for (folder, _), (_, seconds, _, _) in sorted(latest.items(), key=lambda item: item[0][0] != CPU_REPORTS):
        found.setdefault("a CPU" if folder == CPU_REPORTS else "GPUs", []).append(seconds / 60)
    spans = [f"{min(m):.1f} min" if round(min(m), 1) == round(max(m), 1) else f"{min(m):.1f}-{max(m):.1f} min"
             for m in found.values()]
    return (f"This notebook takes about {' and '.join(f'{span} on {where}' for span, where in zip(spans, found))} "
            "(the course's check reports, not this run; other work on the machine makes it slower).")


def is_exclusive(path: Path) -> bool:
    """Whether a notebook asks to run alone on the machine (notebook metadata ``course.exclusive``: the
    capstone, which fills the GPUs' memory)."""
    metadata = json.loads(Path(path).read_text()).get("metadata", {})
    return bool(metadata.get("course", {}).get("exclusive"))


def _kernel_dir() -> str:
    """A Jupyter data folder holding one kernel spec that starts this Python's ipykernel."""
    folder = Path(tempfile.mkdtemp(prefix="course-kernel-"))
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "course (this Python)", "language": "python"}))
    return str(folder)


class _Stopped(BaseException):
    """SIGTERM from outside while a notebook executes (BaseException: no cell's ``except Exception`` eats it)."""


def execute(path: Path, out_dir: Path, timeout: float = 900) -> dict:
    """Run every cell of ``path`` in a fresh kernel (cell timeout ``timeout`` s); write the executed
    notebook and ``result.json`` into ``out_dir``; return the result: ``ok``, seconds, and for a failure
    the cell number, its first source line and the error; ``stopped`` when SIGTERM ended the execution
    (a deadline outside it: no verdict on the notebook)."""
    import nbformat  # deferred: only the GPU check needs it
    from nbclient import NotebookClient

    path, out_dir = Path(path).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:  # the stored (CPU) outputs go: a cell not reached shows nothing, not stale figures
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [_kernel_dir(), os.environ.get("JUPYTER_PATH")]))
    client = NotebookClient(notebook, timeout=max(1, int(timeout)), kernel_name=KERNEL_NAME, allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    started = time.monotonic()
    result: dict = {"notebook": path.name, "ok": True}

    received: list[str] = []

    def stop(signum, frame):  # a deadline outside (a job's time budget) ended this execution
        received.append(signal.Signals(signum).name)
        raise _Stopped(received[0])

    previous = signal.signal(signal.SIGTERM, stop)
    # starting the kernel sets SIGTERM back to its default (jupyter_client): take it again before each cell
    client.on_cell_start = lambda **_: signal.signal(signal.SIGTERM, stop)
    try:
        client.execute()
    except BaseException as error:
        if not received and not isinstance(error, Exception):
            raise  # Ctrl-C and the like: not a notebook's failure
        result.update(_failure(notebook, error, received, time.monotonic() - started))
    finally:
        signal.signal(signal.SIGTERM, previous)
    result["seconds"] = round(time.monotonic() - started, 1)
    nbformat.write(notebook, out_dir / path.name)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _failure(notebook, error: BaseException, received: list[str], seconds: float) -> dict:
    """What ended an execution early: a signal from outside (whatever it broke on the way out), an error
    cell or a cell's timeout, or a kernel that died or did not start."""
    from nbclient.exceptions import (  # deferred: only the GPU check needs it
        CellExecutionError,
        CellTimeoutError,
    )

    started_cells = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and c.get("execution_count")]
    if received:
        return {"ok": False, "stopped": True, "cell": max(started_cells, default=None),
                "error": f"stopped from outside ({received[0]}) after {seconds:.0f} s, before the notebook "
                         "finished: no verdict"}
    if isinstance(error, (CellExecutionError, CellTimeoutError)):
        result: dict = {"ok": False}
        failed = next((i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and any(
            o.get("output_type") == "error" for o in c.get("outputs", []))), None)
        if failed is None:  # a timeout leaves no error output: the last cell that started
            failed = max(started_cells, default=None)
        result["cell"] = failed
        if failed is not None:
            result["cell_source"] = notebook.cells[failed].source.splitlines()[:3]
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()  # IPython's colours
        result["error"] = text.splitlines()[-1][:500] if text else type(error).__name__
        return result
    return {"ok": False, "cell": None, "error": f"{type(error).__name__}: {error}"[:500]}  # the kernel died


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(?:setup|call|teardown)\s+notebooks/([^:\s]+\.ipynb)::", re.M)


def durations_report(pytest_output: str, machine: str, date: str, note: str) -> dict:
    """The committed CPU check report (``docs/cpu-check/``, read by :func:`chapter_time` and the README's
    chapter table) from the output of ``pytest --nbval notebooks/ --durations=0``: each notebook's seconds,
    the sum of its cells' setup, call and teardown durations as pytest reported them."""
    seconds: dict[str, float] = {}
    for value, name in _DURATION.findall(pytest_output):
        seconds[name] = seconds.get(name, 0.0) + float(value)
    if not seconds:
        raise ValueError("no notebook durations in this output: run pytest --nbval notebooks/ --durations=0")
    return {"machine": machine, "command": "python3 -m helpers.course test --durations=0", "note": note,
            "checks": [{"check": "readme-test", "ranks": 2, "machine": machine.split(",")[0],
                        "how": "nbval, one notebook at a time", "source": "pytest --durations=0", "jobs": 1,
                        "date": date, "notebooks": [{"notebook": name, "ok": True, "seconds": round(s, 1)}
                                                    for name, s in sorted(seconds.items())]}]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for the executed copy and result.json")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one cell may take")
    args = parser.parse_args(argv)
    result = execute(args.notebook, args.out, args.timeout)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
