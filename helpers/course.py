"""Set up the course and open it, or test it: the README's two commands.

    python3 -m helpers.course lab     # set up, then open the notebooks in JupyterLab
    python3 -m helpers.course test    # set up, then pytest --nbval notebooks/ plus the unit tests
    python3 -m helpers.course setup   # set up only

Set-up, each step skipped when already done: a virtual environment in ``.venv`` (unless one is
already active), ``pip install -r requirements.txt``, then DeepSpeed's C++ ops built once, with
progress, so no notebook cell stalls on a silent compile. Needs only Python 3.10+ to start: this
module imports nothing outside the standard library.
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
    """Install the pinned requirements and build DeepSpeed's ops, skipping what is already done."""
    requirements = (ROOT / "requirements.txt").read_bytes()
    fingerprint = hashlib.sha256(requirements + python.encode()).hexdigest()
    if not STAMP.exists() or STAMP.read_text().strip() != fingerprint:
        _say("installing requirements.txt (torch, deepspeed, jupyterlab, nbval, ...)")
        _run([python, "-m", "pip", "install", "--quiet", "-r", "requirements.txt"])
        STAMP.write_text(fingerprint + "\n")
    else:
        _say("requirements already installed")
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
        os.execv(python, [python, "-m", "jupyter", "lab", "notebooks/", *args[1:]])
    if args[0] == "test":
        _say("pytest --nbval notebooks/ tests/")
        return subprocess.run([python, "-m", "pytest", "--nbval", "notebooks/", "tests/", *args[1:]],
                              cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
