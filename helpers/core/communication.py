"""Turn DeepSpeed's comms logger output into per-collective counts and bytes.

The ranks call ``deepspeed.comm.log_summary(return_dict=True)``; :func:`by_op` folds its
``summary`` (op -> message size -> stats) into op -> {count, bytes, wire_bytes}, where
``bytes`` is what the logger recorded (the message sizes) and ``wire_bytes`` what one rank sends
for them on a ring (:func:`helpers.core.theory.wire_bytes`).

Only the logger's counts and sizes are read, never its times: in DeepSpeed 0.19.8 ``timed_op`` records
``timers(name).elapsed(reset=False)``, the running total of every call of that op and size so far, so the
summary's latencies grow with the number of calls (on 4 x H200, ZeRO-3's all-gathers of 384 B to 768 KB
"averaged" 0.35-0.77 s; chapter 13's logs). Chapter 09 times collectives itself, with the logger off.
"""

from __future__ import annotations

from helpers.core import theory

#: Ops the logger records that move no training data (synchronisation of the logger itself).
IGNORED_OPS = ("barrier", "log_summary_barrier")


def split_name(record_name: str) -> tuple[str, str]:
    """``"all_reduce | [Caller Func: allreduce_bucket]"`` -> ("all_reduce", "allreduce_bucket").

    With ``"debug": true`` the comms logger appends the DeepSpeed function that issued the call.
    """
    op, _, rest = record_name.partition(" | ")
    caller = rest.removeprefix("[Caller Func: ").removesuffix("]")
    return op, caller


def _fold(summary: dict, world_size: int, with_caller: bool) -> dict:
    table: dict = {}
    for record_name, sizes in sorted(summary.items()):
        op, caller = split_name(record_name)
        if op in IGNORED_OPS:
            continue
        key = (op, caller) if with_caller else op
        row = table.setdefault(key, {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        for size, stats in sizes.items():
            count = int(stats["count"])
            row["count"] += count
            row["bytes"] += int(size) * count
            row["wire_bytes"] += theory.wire_bytes(op, int(size), world_size) * count
    return table


def by_op(summary: dict, world_size: int) -> dict[str, dict[str, float]]:
    """Fold ``log_summary(return_dict=True)["summary"]`` into op -> {count, bytes, wire_bytes}."""
    return _fold(summary, world_size, with_caller=False)


def by_caller(summary: dict, world_size: int) -> dict[str, dict[str, dict[str, float]]]:
    """Like :func:`by_op`, split further by the DeepSpeed function that issued each call:
    op -> caller -> {count, bytes, wire_bytes} (caller "" without the logger's debug mode)."""
    nested: dict = {}
    for (op, caller), row in _fold(summary, world_size, with_caller=True).items():
        nested.setdefault(op, {})[caller] = row
    return nested


def counts_and_bytes(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The table as summary.json keeps it: {count, bytes} per entry (wire bytes are derived)."""
    return {key: {"count": row["count"], "bytes": row["bytes"]} for key, row in table.items()}


def per_step(table: dict[str, dict[str, float]], steps: int) -> dict[str, dict[str, float]]:
    """Divide every count and byte figure by ``steps``."""
    return {op: {k: v / steps for k, v in row.items()} for op, row in table.items()}


def record_section(summary: dict, world_size: int, steps: int) -> dict:
    """The ``comm`` section of summary.json from one rank's ``log_summary(return_dict=True)["summary"]``
    covering ``steps`` optimizer steps: per-step counts and bytes by op and by issuing function,
    logged bytes and ring wire bytes per step, and the raw totals."""
    table = by_op(summary, world_size)
    step_rows = per_step(table, steps)
    return {
        "by_op": counts_and_bytes(step_rows),
        "bytes_per_step": sum(row["bytes"] for row in step_rows.values()),
        "wire_bytes_per_step": sum(row["wire_bytes"] for row in step_rows.values()),
        "by_caller": {op: counts_and_bytes(per_step(rows, steps))
                      for op, rows in by_caller(summary, world_size).items()},
        "measured_steps": steps,
        "totals": counts_and_bytes(table),
    }
