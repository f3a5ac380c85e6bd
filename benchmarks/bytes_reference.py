"""Measure only the bytes half of chapter 15 on GPUs (no timing), as a reference file of its own.

    python3 benchmarks/bytes_reference.py frameworks    # -> runs/reference/frameworks-bytes-<N>x<GPU>.json

Bytes per collective do not depend on what else runs on the GPUs, so two jobs can share them; timings come
from the notebook's own runs (``benchmarks/reference.py``). This is how the committed ``*-bytes-*`` files were
made: ``benchmarks/device_run.py jobs "0,1:python3 benchmarks/bytes_reference.py frameworks"``, with
``COURSE_REFERENCE_CONDITIONS`` saying so. Chapter 13's GPU runs launch the script its page writes
(``runs/13/train_zeropp.py``), so they are measured by running that notebook.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.topics import frameworks  # noqa: E402
from helpers.core import profiler_comm, references  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapter", choices=("frameworks",))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    by_bytes = frameworks.ordered(frameworks.compare(frameworks.GPU_MODEL, args.steps, frameworks.GPU_OVERRIDES,
                                                     tag="gpu-bytes", progress=False))
    print(references.save_reference("frameworks-bytes", {f"bytes: {k}": r for k, r in by_bytes.items()},
                                     "frameworks chapter, one node; bytes only"))
    print(frameworks.gpu_table(by_bytes, {}))
    print(profiler_comm.profiler_check_table(by_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
