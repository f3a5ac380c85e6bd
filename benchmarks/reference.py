"""Measure the course's GPU reference results on this machine, one thing at a time, and say how to commit them.

    python benchmarks/reference.py                       # chapters that save references, then the capstone
    python benchmarks/reference.py --budget 540 --notebooks 03,04,05 --capstone-budget 0

It executes, one after the other (no two measurements share the GPUs), every chapter notebook that keeps
GPU results (``references.save_reference``; those notebooks save to ``runs/reference/`` when they run on
GPUs), then the capstone ladder (``benchmarks/capstone.py``). Each reference file records the device and
count, ``nvidia-smi topo -m``, the driver, torch/CUDA/NCCL/DeepSpeed versions, the date and these
conditions. A manifest ``runs/reference/manifest-<device>.json`` lists what ran, how it ended and the files.
To make them the course's references::

    cp runs/reference/*.json notebooks/reference/ && git add notebooks/reference && git commit -m "GPU references"

then re-execute the notebooks that show them on CPU (their stored outputs print the committed tables).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helpers.core import environment, references  # noqa: E402
from helpers.tools import notebooks

CONDITIONS = "alone on the machine: benchmarks/reference.py ran one notebook or benchmark at a time"


def reference_notebooks() -> list[Path]:
    """Chapter notebooks that keep GPU results, except those that ask to run alone (the capstone, which
    benchmarks/capstone.py measures without Jupyter)."""
    return [p for p in notebooks.course_notebooks()
            if "save_reference(" in p.read_text() and not notebooks.is_exclusive(p)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=1800, help="seconds for everything (default 1800)")
    parser.add_argument("--notebooks", help="comma-separated notebook numbers or names (default: every one that "
                        "saves references); 'none' for none")
    parser.add_argument("--capstone-budget", type=float, help="seconds for the capstone ladder (default: what is "
                        "left; 0 skips it)")
    parser.add_argument("--cell-timeout", type=float, default=900)
    parser.add_argument("--allow-cpu", action="store_true", help="run on a machine without GPUs (saves nothing)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    env = environment.detect()
    if not env.is_gpu and not args.allow_cpu:
        print("no GPU here: GPU references can only be measured on GPUs (--allow-cpu runs the same steps anyway)")
        return 2
    os.environ[references.CONDITIONS_VARIABLE] = CONDITIONS
    chosen = reference_notebooks()
    if args.notebooks:
        wanted = [] if args.notebooks == "none" else args.notebooks.split(",")
        chosen = [p for p in notebooks.course_notebooks() if any(p.name.startswith(w) for w in wanted)]
    print(env.report(), flush=True)
    print(f"notebooks: {', '.join(p.name for p in chosen) or 'none'}", flush=True)

    done: list[dict] = []
    out = references.NEW_REFERENCE_DIR.parent / "reference-notebooks"
    for path in chosen:
        left = args.budget - (time.monotonic() - started)
        if left < 60:
            done.append({"notebook": path.name, "ok": False, "error": "skipped: time budget spent"})
            continue
        print(f"executing {path.name} ({left:.0f} s left)", flush=True)
        result = notebooks.execute(path, out / path.stem, min(args.cell_timeout, left))
        print(f"  {'ok' if result['ok'] else 'FAILED: ' + str(result.get('error'))} ({result['seconds']} s)", flush=True)
        done.append(result)

    capstone = {"ran": False}
    left = args.budget - (time.monotonic() - started)
    budget = left - 30 if args.capstone_budget is None else min(args.capstone_budget, left - 30)
    if budget >= 120:
        print(f"capstone ladder, {budget:.0f} s", flush=True)
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "capstone.py"), "--budget", str(int(budget)),
                              "--note", "benchmarks/reference.py"], cwd=ROOT)
        capstone = {"ran": True, "exit_code": run.returncode}
    else:
        capstone["why"] = f"{max(0.0, budget):.0f} s left for it (needs 120)"

    folder = references.NEW_REFERENCE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    device = env.device_name.replace(" ", "-")
    manifest = {"device": env.device_name, "hardware": environment.hardware(env), "software": environment.software(),
                "conditions": CONDITIONS, "seconds": round(time.monotonic() - started, 1), "notebooks": done,
                "capstone": capstone, "files": sorted(p.name for p in folder.glob("*.json") if not
                                                       p.name.startswith("manifest-"))}
    path = folder / f"manifest-{device}.json"
    path.write_text(json.dumps(manifest, indent=1))
    print(f"\nwritten: {', '.join(manifest['files']) or 'nothing'}\nmanifest: {path}")
    print("to commit: cp runs/reference/*.json notebooks/reference/ && git add notebooks/reference && "
          "git commit -m 'GPU references: " + env.device_name + "'")
    failed = [r for r in done if not r.get("ok")] or (capstone.get("exit_code") not in (None, 0))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
