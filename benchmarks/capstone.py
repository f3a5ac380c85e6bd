"""The capstone without Jupyter: climb the tuning ladder of notebook 16 on this machine's GPUs.

    python benchmarks/capstone.py                      # 1.24B model on every GPU, 540 s budget
    python benchmarks/capstone.py --size 2.7b --budget 900 --world-size 4
    COURSE_GPUS=0,1 python benchmarks/capstone.py      # two GPUs of a shared box
    python benchmarks/capstone.py --resume runs/capstone/ladder-1.2b-2r.json   # climb the rungs left
    python benchmarks/capstone.py --resume runs/capstone/ladder-1.2b-2r.json --rungs overlap,rebatch
                                                       # these two, from the best so far, climbed or not
    python benchmarks/capstone.py --size 2.7b --resume notebooks/reference/capstone-ladder-2.7b-2xNVIDIA-H200.json
                                                       # go on from a committed ladder: the new reference
                                                       # keeps its records, note and conditions
    python benchmarks/capstone.py --size 2.7b --world-size 4 --start micro_batch=16,compile=true --rungs accumulate
                                                       # a new walk that starts from a setting found elsewhere
                                                       # (a 2-GPU walk's best, say) instead of the baseline
    python benchmarks/capstone.py --combine EARLIER.json LATER.json
                                                       # one reference from two walks' (LATER resumed EARLIER)

A resumed walk may run on another machine: its first launch trains the setting kept so far again, beside the
new candidates, and judges them against that figure rather than the stored one.

Each rung of ``helpers.topics.capstone.GPU_LADDER`` is one launch of its candidates; a candidate is kept when its
model TFLOP/s per GPU beats the best so far by more than the noise margin. Writes every candidate's
record to ``runs/capstone/``, the ladder to ``runs/capstone/ladder-<size>-<N>r.json`` and, on GPUs, the
reference ``runs/reference/capstone-ladder-<size>-<device>.json`` to commit under ``notebooks/reference/``.
On CPU ranks it climbs the one-launch CPU ladder with the tiny model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's helpers, from any folder

from helpers.core import environment, references  # noqa: E402
from helpers.topics import capstone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(capstone.SIZES), help="default: 1.2b on GPUs, tiny on CPU")
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole ladder (default 540)")
    parser.add_argument("--world-size", type=int, help="ranks (default: every GPU chosen)")
    parser.add_argument("--steps", type=int, help="optimizer steps per candidate (default 8 on GPUs, 5 on CPU)")
    parser.add_argument("--rungs", help="comma-separated rung names to climb, in ladder order (default: all)")
    parser.add_argument("--note", default="benchmarks/capstone.py", help="stored with the reference")
    parser.add_argument("--resume", type=Path, help="an earlier ladder-<size>-<N>r.json or a committed "
                        "capstone-ladder-*.json reference: go on where it stopped (its rungs are not climbed again, "
                        "unless --rungs names them)")
    parser.add_argument("--start", help="knob=value pairs, comma-separated, applied to the baseline: where a new walk "
                        "starts (e.g. micro_batch=16,grad_accum=2,compile=true; knobs: the fields of "
                        "helpers.topics.capstone.Setting)")
    parser.add_argument("--combine", type=Path, nargs=2, metavar=("EARLIER", "LATER"),
                        help="write one reference from two walks' references (LATER's walk resumed EARLIER's) to "
                        "runs/reference/, and train nothing")
    args = parser.parse_args(argv)
    if args.combine:
        return combine(*args.combine)
    try:
        resume, earlier = capstone.load_resume(args.resume) if args.resume else (None, None)
    except (OSError, ValueError) as error:
        parser.error(str(error))

    if args.start and args.resume:
        parser.error("--start and --resume: a resumed walk goes on from its own best setting; give one of them")
    env = environment.detect(args.world_size)
    size = args.size or ("1.2b" if env.is_gpu else "tiny")
    baseline = usual = capstone.GPU_BASELINE if env.is_gpu else capstone.CPU_BASELINE
    if args.start:
        try:
            baseline = baseline.with_knobs(args.start)
        except ValueError as error:
            parser.error(f"--start {error}")
    ladder = capstone.GPU_LADDER if env.is_gpu else capstone.CPU_LADDER
    if args.rungs:
        wanted = args.rungs.split(",")
        unknown = sorted(set(wanted) - {r.name for r in ladder})
        if unknown:
            parser.error(f"--rungs {unknown}: choose from {', '.join(r.name for r in ladder)}")
        ladder = [r for r in ladder if r.name in wanted]
    print(env.report(), flush=True)
    print(f"capstone: {size} model ({capstone.model_parameters(size):,} parameters), budget {args.budget:.0f} s, "
          f"rungs: {', '.join(r.name for r in ladder)}", flush=True)
    if args.start:
        print(f"capstone: starting from {baseline.changes_from(usual)} instead of the baseline", flush=True)
    result = capstone.walk(size, ladder=ladder, baseline=baseline, budget_s=args.budget, steps=args.steps,
                           world_size=args.world_size, resume=resume,
                           climb_again=[r.name for r in ladder] if resume and args.rungs else ())
    data = result.to_dict()
    path, reference = capstone.save(result, note=args.note, earlier=earlier)
    print(capstone.ladder_table(data))
    print()
    print(capstone.rungs_table(data))
    print()
    print(capstone.summary(data))
    print(f"\nladder: {path}")
    if reference:
        print(f"reference to commit: {reference}  (cp it to notebooks/reference/)")
    return 0


def combine(earlier: Path, later: Path) -> int:
    """``--combine``: :func:`helpers.topics.capstone.combine_references` of two reference files, written under
    ``runs/reference/`` with the later file's name."""
    try:
        data = capstone.combine_references(json.loads(earlier.read_text()), json.loads(later.read_text()))
    except (OSError, ValueError) as error:
        print(f"--combine: {error}", file=sys.stderr)
        return 2
    except KeyError as error:
        print(f"--combine: {earlier} or {later} is not a capstone ladder's reference (it has no {error})",
              file=sys.stderr)
        return 2
    out = references.NEW_REFERENCE_DIR / later.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(capstone.summary(data["runs"]["ladder"]))
    print(f"reference to commit: {out}  (cp it to notebooks/reference/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
