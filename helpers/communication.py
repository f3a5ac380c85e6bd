"""Turn DeepSpeed's comms logger output into per-collective counts and bytes.

The ranks call ``deepspeed.comm.log_summary(return_dict=True)``; :func:`by_op` folds its
``summary`` (op -> message size -> stats) into op -> {count, bytes, wire_bytes}, where
``bytes`` is what the logger recorded (the message sizes) and ``wire_bytes`` what one rank sends
for them on a ring (:func:`helpers.theory.wire_bytes`).
"""

from __future__ import annotations

from helpers import theory

#: Ops the logger records that move no training data (synchronisation of the logger itself).
IGNORED_OPS = ("barrier", "log_summary_barrier")


def by_op(summary: dict, world_size: int) -> dict[str, dict[str, float]]:
    """Fold ``log_summary(return_dict=True)["summary"]`` into op -> {count, bytes, wire_bytes}."""
    table: dict[str, dict[str, float]] = {}
    for op, sizes in sorted(summary.items()):
        if op in IGNORED_OPS:
            continue
        row = {"count": 0, "bytes": 0, "wire_bytes": 0.0}
        for size, stats in sizes.items():
            count = int(stats["count"])
            row["count"] += count
            row["bytes"] += int(size) * count
            row["wire_bytes"] += theory.wire_bytes(op, int(size), world_size) * count
        table[op] = row
    return table


def per_step(table: dict[str, dict[str, float]], steps: int) -> dict[str, dict[str, float]]:
    """Divide every count and byte figure by ``steps``."""
    return {op: {k: v / steps for k, v in row.items()} for op, row in table.items()}
