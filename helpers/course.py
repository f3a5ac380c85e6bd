"""Set up the course and open it, or test it: the README's two commands.

    python3 -m helpers.course lab                 # set up, then open the notebooks in JupyterLab
    python3 -m helpers.course test                # set up, then pytest --nbval notebooks/
    python3 -m helpers.course test --unit         # the unit tests in tests/ (all but the system tests)
    python3 -m helpers.course test --lesser-cpu   # the notebooks again, as on a processor without AVX-512
    python3 -m helpers.course test --system       # the tests that need Chromium, or root with sshd and pdsh
    python3 -m helpers.course setup               # set up only
    python3 -m helpers.course setup --wheelhouse DIR   # set up offline, from `pip download -r requirements.txt -d DIR`
    python3 -m helpers.course check-gpu [--jobs N] [--timeout S] [--out DIR] [--no-setup] [NOTEBOOK ...]
                                                  # execute every notebook here; fail on any error cell

Set-up, each step skipped when already done: a virtual environment in ``.venv`` (unless one is
already active), ``pip install -r requirements.txt``, the course itself (``pip install -e .``: the
``helpers`` package, importable from any folder), then DeepSpeed's C++ ops built once, with
progress, so no notebook cell stalls on a silent compile. Needs only Python 3.10+ to start: this
module imports nothing outside the standard library.

``--lesser-cpu`` runs the notebooks with torch's kernels and oneDNN held to AVX2
(:data:`LESSER_CPU`), the instruction set of many laptops and AMD EPYCs. oneDNN then reports no fp16
support, so DeepSpeed's own fp16 check answers "no" even on a processor that has AVX512-FP16: the
notebooks take the path of a learner's machine without fp16, and their checked outputs must not change.

``check-gpu`` is the instructor's check of a GPU box before a workshop: it executes every notebook top
to bottom on this machine (stored outputs are the CPU's, so nothing is compared: a notebook passes when no
cell raises, as under nbval's ``--nbval-lax``), ``--jobs`` of them at a time, each with its own run folder
(``$COURSE_RUNS_DIR``) and master port, and notebooks that ask to run alone (the capstone) after them. It
writes the executed copies and ``report.json`` to ``runs/check-gpu/`` and exits 1 if any cell failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = ROOT / ".course-setup-stamp"

#: Environment that makes this processor look like an AVX2-only one to torch, oneDNN and DeepSpeed.
LESSER_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _say(message: str) -> None:
    print(f"==> {message}", flush=True)


def python_for_course() -> str:
    """The active virtual environment's Python, else ``.venv``'s (created when missing)."""
    if sys.prefix != sys.base_prefix:
        return sys.executable
    python = VENV / "bin" / "python"
    if not python.exists():
        _say(f"creating a virtual environment in {VENV.name}/")
        venv.EnvBuilder(with_pip=True).create(VENV)
    return str(python)


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, cwd=ROOT)
    if result.returncode:
        sys.exit(f"failed ({result.returncode}): {' '.join(argv)}")


def pip_source(wheelhouse: str | Path | None) -> list[str]:
    """pip's options for where packages come from: the package index, or only ``wheelhouse`` (offline)."""
    if wheelhouse is None:
        return []
    folder = Path(wheelhouse).resolve()
    if not folder.is_dir() or not any(folder.iterdir()):
        sys.exit(f"--wheelhouse {wheelhouse}: no such folder, or it is empty; fill it on a machine with internet "
                 "access with: pip download -r requirements.txt -d wheelhouse")
    return ["--no-index", "--find-links", str(folder)]


def set_up(python: str, wheelhouse: str | Path | None = None) -> None:
    """Install the pinned requirements and the course, and build DeepSpeed's ops, skipping what is done.
    With ``wheelhouse``, pip installs from that folder alone and never reaches the network."""
    source = pip_source(wheelhouse)
    inputs = (ROOT / "requirements.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    fingerprint = hashlib.sha256(inputs + python.encode()).hexdigest()
    if not STAMP.exists() or STAMP.read_text().strip() != fingerprint:
        where = f" from {wheelhouse}" if wheelhouse else ""
        _say(f"installing requirements.txt{where} (torch, deepspeed, jupyterlab, nbval, ...)")
        _run([python, "-m", "pip", "install", "--quiet", *source, "-r", "requirements.txt"])
        _say("installing the course's helpers package (pip install -e .)")
        _run([python, "-m", "pip", "install", "--quiet", *source, "--no-deps", "--no-build-isolation", "-e", "."])
        STAMP.write_text(fingerprint + "\n")
    else:
        _say("requirements and the course already installed")
    _say("building DeepSpeed's ops (only the first time takes minutes)")
    # the ops, then what the course uses here, in one Python: each start imports torch and DeepSpeed again
    _run([python, "-c", "import sys; from helpers.__main__ import main; sys.exit(main(['build-ops']) or main(['env']))"])


def _option(args: list[str], name: str, default: str | None = None) -> str | None:
    """Remove ``name VALUE`` (or ``name=VALUE``) from ``args`` and return VALUE."""
    for i, arg in enumerate(args):
        if arg == name:
            if i + 1 >= len(args):
                sys.exit(f"{name} needs a value")
            value = args[i + 1]
            del args[i:i + 2]
            return value
        if arg.startswith(name + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return default


def _notebook_is_exclusive(path: Path) -> bool:
    return bool(json.loads(path.read_text()).get("metadata", {}).get("course", {}).get("exclusive"))


def check_notebooks(python: str, notebooks: list[Path], jobs: int = 1, timeout: float = 900,
                    out: Path | None = None) -> list[dict]:
    """Execute ``notebooks`` (``jobs`` at a time; those that ask to run alone afterwards, one by one),
    each in its own process with its own run folder; return each one's result (see helpers.tools.notebooks)."""
    out = out or ROOT / "runs" / "check-gpu"
    out.mkdir(parents=True, exist_ok=True)
    shared = [n for n in notebooks if not _notebook_is_exclusive(n)]
    alone = [n for n in notebooks if _notebook_is_exclusive(n)]
    results: list[dict] = []

    def start(path: Path, together: int) -> tuple[Path, subprocess.Popen]:
        folder = out / path.stem
        # the capstone measures its baseline and what fits in 2 minutes: enough to show it runs here
        # load_guard's LOCK_VARIABLE (timed launches take turns) and LOG_VARIABLE (each verdict, counted below)
        env = {"COURSE_CAPSTONE_BUDGET": "120", **os.environ, "COURSE_RUNS_DIR": str(folder / "runs"),
               "COURSE_TIMING_LOCK": str(out / "timing.lock"), "COURSE_VERDICT_LOG": str(folder / "verdicts.jsonl"),
               "COURSE_REFERENCE_CONDITIONS": (f"executed by check-gpu beside {together - 1} other notebook(s)"
                                               if together > 1 else "executed by check-gpu, alone")}
        log = open(folder.with_suffix(".log"), "w")
        _say(f"executing {path.name}")
        return path, subprocess.Popen([python, "-m", "helpers.tools.notebooks", str(path), "--out", str(folder),
                                       "--timeout", str(timeout)], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT)

    def collect(path: Path, process: subprocess.Popen, stopped: str = "") -> None:
        process.wait()
        result_file = out / path.stem / "result.json"
        result = (json.loads(result_file.read_text()) if result_file.exists()
                  else {"notebook": path.name, "ok": False, "error": f"exited {process.returncode}, see "
                        f"{out / path.stem}.log", "seconds": None})
        result["verdicts"] = _verdict_counts(out / path.stem / "verdicts.jsonl")
        if stopped and not result["ok"] and not result.get("stopped"):  # ended by the same stop, no result of its own
            result.update(stopped=True, error=f"stopped from outside ({stopped}) before it finished: no verdict")
        results.append(result)
        _say(f"{path.name}: {_verdict(result)} ({result.get('seconds')} s)")

    def on_sigterm(signum, frame):  # a deadline outside (a job's time budget) or `kill`: report, then leave
        raise _CheckStopped("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    running: list[tuple[Path, subprocess.Popen]] = []
    try:
        for batch in (shared, alone):
            width = max(1, jobs) if batch is shared else 1
            pending, running = list(batch), []
            while pending or running:
                while pending and len(running) < width:
                    running.append(start(pending.pop(0), min(width, len(batch))))
                for item in list(running):
                    if item[1].poll() is not None:
                        running.remove(item)
                        collect(*item)
                time.sleep(0.5)
    except (_CheckStopped, KeyboardInterrupt) as stop:
        # Whoever stopped the check usually stopped the executions too (a signal to the process group);
        # pass it on where not, give them a moment to write their result, and report what is known.
        why = str(stop) if isinstance(stop, _CheckStopped) else "Ctrl-C"
        for _, process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3  # device_run.py, for one, sends SIGKILL 5 s after its SIGTERM
        for path, process in running:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
            collect(path, process, why)
        done = {r["notebook"] for r in results}
        results.extend({"notebook": path.name, "ok": False, "stopped": True, "seconds": None,
                        "error": f"not started: the check was stopped ({why}) first"}
                       for path in notebooks if path.name not in done)
    finally:
        signal.signal(signal.SIGTERM, previous)
    order = {n.name: i for i, n in enumerate(notebooks)}
    return sorted(results, key=lambda r: order.get(r["notebook"], 0))


class _CheckStopped(BaseException):
    """SIGTERM to the check itself: the notebooks still running are reported as stopped, not lost."""


def _verdict_counts(log: Path) -> dict:
    """The timing verdicts a notebook's load guard gave and withheld (helpers.core.load_guard.read_log's
    counts; read here with the standard library only)."""
    counts = {"given": 0, "withheld": 0}
    if log.exists():
        for line in log.read_text().splitlines():
            counts["withheld" if json.loads(line)["withheld"] else "given"] += 1
    return counts


def _verdict(result: dict) -> str:
    """ok, FAILED (an error cell, a dead kernel) or STOPPED (ended from outside: no verdict)."""
    return "ok" if result["ok"] else ("STOPPED" if result.get("stopped") else "FAILED")


def check_gpu(python: str, args: list[str]) -> int:
    """``check-gpu``: execute the notebooks named in ``args`` (default: all), report, exit 1 on a failed cell."""
    jobs = int(_option(args, "--jobs", "1"))
    timeout = float(_option(args, "--timeout", "900"))
    out = Path(_option(args, "--out", str(ROOT / "runs" / "check-gpu"))).resolve()
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        sys.exit(f"check-gpu: unknown option(s) {' '.join(unknown)}; it takes --jobs N, --timeout S, --out DIR, "
                 "--no-setup and notebook paths")
    names = [a for a in args if not a.startswith("-")]
    notebooks = [Path(n).resolve() for n in names] or sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    missing = [str(n) for n in notebooks if not n.exists()]
    if missing:
        sys.exit(f"no such notebook: {', '.join(missing)}")
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                           text=True, cwd=ROOT)
    gpus = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    chosen = os.environ.get("COURSE_GPUS", "").strip()  # environment.GPUS_VARIABLE; this module stays stdlib-only
    where = (f"GPU(s) {chosen} of {gpus} (set by $COURSE_GPUS)" if chosen else f"{gpus} GPU(s)") if gpus \
        else "no GPU (CPU ranks): this checks the CPU path"
    _say(f"{len(notebooks)} notebook(s), {jobs} at a time, on {where}")
    started = time.monotonic()
    results = check_notebooks(python, notebooks, jobs, timeout, out)
    verdicts = {k: sum(r.get("verdicts", {}).get(k, 0) for r in results) for k in ("given", "withheld")}
    report = {"gpus": gpus, "jobs": jobs, "seconds": round(time.monotonic() - started, 1), "verdicts": verdicts,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "notebooks": results,
              "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "course_gpus": chosen or None}
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=1))
    failed = [r for r in results if not r["ok"]]
    stopped = [r for r in failed if r.get("stopped")]
    for r in results:
        line = f"  {_verdict(r):<7} {r['notebook']:<40} {r.get('seconds')} s"
        if not r["ok"]:
            line += f"  cell {r.get('cell')}: {r.get('error')}"
        print(line)
    _say(f"{len(results) - len(failed)} of {len(results)} notebook(s) ran without an error cell"
         + (f", {len(stopped)} stopped from outside before they finished" if stopped else "")
         + f"; timing verdicts given {verdicts['given']}, withheld {verdicts['withheld']}"
         + f"; report: {path}, executed copies beside it")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("lab", "test", "setup", "check-gpu"):
        print(__doc__)
        return 2
    if "-h" in args or "--help" in args:  # help before any set-up (which can take minutes)
        print(__doc__)
        return 0
    if args[0] == "check-gpu" and "--no-setup" in args:
        args.remove("--no-setup")  # a machine set up otherwise (the offline GPU box): use this Python
        return check_gpu(sys.executable, args[1:])
    wheelhouse = _option(args, "--wheelhouse")
    python = python_for_course()
    set_up(python, wheelhouse)
    if args[0] == "check-gpu":
        return check_gpu(python, args[1:])
    if args[0] == "lab":
        _say("opening JupyterLab on notebooks/")
        # Jupyter refuses to start as root (containers, CI machines) unless told it is on purpose
        as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        os.execv(python, [python, "-m", "jupyter", "lab", "notebooks/", *as_root, *args[1:]])
    if args[0] == "test":
        rest = args[1:]
        if "--lesser-cpu" in rest:
            rest.remove("--lesser-cpu")
            _say("pytest --nbval notebooks/ with " + " ".join(f"{k}={v}" for k, v in LESSER_CPU.items()))
            return subprocess.run([python, "-m", "pytest", "--nbval", "notebooks/", *rest], cwd=ROOT,
                                  env={**os.environ, **LESSER_CPU}).returncode
        if "--system" in rest:
            rest.remove("--system")
            _say("pytest -m system tests/ (the tests that need Chromium, or root with sshd and pdsh)")
            return subprocess.run([python, "-m", "pytest", "-m", "system", "tests/", *rest], cwd=ROOT).returncode
        if "--unit" in rest:
            rest.remove("--unit")
            _say("pytest -m 'not system' tests/ (the unit tests; test --system runs the rest)")
            return subprocess.run([python, "-m", "pytest", "-m", "not system", "tests/", *rest], cwd=ROOT).returncode
        _say("pytest --nbval notebooks/ (every notebook, its checked outputs compared with the stored ones)")
        return subprocess.run([python, "-m", "pytest", "--nbval", "notebooks/", *rest], cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
