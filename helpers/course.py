"""Set up the course and open it, or test it: the README's two commands.

    python3 -m helpers.course lab                 # set up, then open the notebooks in JupyterLab
    python3 -m helpers.course test                # set up, then pytest --nbval notebooks/ plus the unit tests
    python3 -m helpers.course test --lesser-cpu   # the notebooks again, as on a processor without AVX-512
    python3 -m helpers.course setup               # set up only

Set-up, each step skipped when already done: a virtual environment in ``.venv`` (unless one is
already active), ``pip install -r requirements.txt``, the course itself (``pip install -e .``: the
``helpers`` package, importable from any folder), then DeepSpeed's C++ ops built once, with
progress, so no notebook cell stalls on a silent compile. Needs only Python 3.10+ to start: this
module imports nothing outside the standard library.

``--lesser-cpu`` runs the notebooks with torch's kernels and oneDNN held to AVX2
(:data:`LESSER_CPU`), the instruction set of many laptops and AMD EPYCs. oneDNN then reports no fp16
support, so DeepSpeed's own fp16 check answers "no" even on a processor that has AVX512-FP16: the
notebooks take the path of a learner's machine without fp16, and their checked outputs must not change.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
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


def set_up(python: str) -> None:
    """Install the pinned requirements and the course, and build DeepSpeed's ops, skipping what is done."""
    inputs = (ROOT / "requirements.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    fingerprint = hashlib.sha256(inputs + python.encode()).hexdigest()
    if not STAMP.exists() or STAMP.read_text().strip() != fingerprint:
        _say("installing requirements.txt (torch, deepspeed, jupyterlab, nbval, ...)")
        _run([python, "-m", "pip", "install", "--quiet", "-r", "requirements.txt"])
        _say("installing the course's helpers package (pip install -e .)")
        _run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", "."])
        STAMP.write_text(fingerprint + "\n")
    else:
        _say("requirements and the course already installed")
    _say("building DeepSpeed's ops (only the first time takes minutes)")
    _run([python, "-m", "helpers", "build-ops"])
    _run([python, "-m", "helpers", "env"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("lab", "test", "setup"):
        print(__doc__)
        return 2
    python = python_for_course()
    set_up(python)
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
        _say("pytest --nbval notebooks/ tests/")
        return subprocess.run([python, "-m", "pytest", "--nbval", "notebooks/", "tests/", *rest], cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
