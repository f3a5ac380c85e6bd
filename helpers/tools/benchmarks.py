"""Benchmarks of the course's own machinery (``python -m helpers bench-launch``).

:func:`launch_overhead` times a 2-step run of the linear model started two ways, both with
DeepSpeed's own launcher: the course's (``python -m deepspeed.launcher.launch``) and the
``deepspeed`` command a learner types. Each rank also reports where its seconds went
(``timeline_s`` in ``summary.json``): imports, process group, ``deepspeed.initialize``, training.
"""

from __future__ import annotations

import statistics

from helpers.core import launch, records

#: DeepSpeed's two ways to start ranks (``torchrun``, the third launcher, starts PyTorch's own strategies).
DEEPSPEED_LAUNCHERS = ("launch", "deepspeed")


def launch_overhead(repeats: int = 5, world_size: int | None = None) -> dict[str, dict]:
    """Wall seconds of ``repeats`` 2-step runs per launcher, alternating, plus rank 0's phases."""
    results: dict[str, dict] = {name: {"wall_s": [], "phases": []} for name in DEEPSPEED_LAUNCHERS}
    for _ in range(repeats):
        for name in DEEPSPEED_LAUNCHERS:
            record = launch.run("zero0", model="linear", steps=2, world_size=world_size, launcher=name,
                                name=f"bench-{name}", progress=False)
            results[name]["wall_s"].append(record.wall_s)
            results[name]["phases"].append(record["timeline_s"]["per_rank"][0])
    return results


def launch_overhead_report(results: dict[str, dict]) -> str:
    """A table of median wall seconds and rank 0's median phase ends, per launcher."""
    rows = []
    for name, data in results.items():
        phases = {p: statistics.median(r[p] for r in data["phases"]) for p in data["phases"][0]}
        rows.append([name, f"{statistics.median(data['wall_s']):.2f}", f"{min(data['wall_s']):.2f}",
                     *(f"{v:.2f}" for v in phases.values())])
        headers = ["launcher", "median wall s", "best s", *(f"{p} done" for p in phases)]
    return records.format_table(rows, headers) + (
        "\n(phase columns: seconds from rank 0's process start; the rest of the wall time is the launcher "
        "starting before the ranks, and the ranks' teardown and exit after)")
