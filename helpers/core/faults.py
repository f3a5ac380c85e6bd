"""Faults on purpose: a rank that fails or hangs, to show what the course does then.

A run asks for them with ``faults=`` (:class:`helpers.core.launch.RunSpec`); the launcher then adds the
:class:`Faults` probe to its probes, and the probe injects them at the start of an optimizer step, so
the training loop itself carries no fault switch:

- ``{"fail_on_rank": r}``: rank ``r`` raises a RuntimeError at the start of the first step (chapter 00
  shows the error a learner then sees);
- ``{"hang_on_rank": r}``: rank ``r`` sleeps for an hour at the start of the first step (the launch's
  timeout ends it; the course's tests).
"""

from __future__ import annotations

import time

from helpers.core.probes import Probe, RunContext

#: The faults a run can ask for, and what each takes.
FAULTS = {"fail_on_rank": "a rank number", "hang_on_rank": "a rank number"}


def check(faults: dict, world_size: int, steps: int) -> None:
    """Raise a ValueError naming the key and the fix for a fault that is unknown or cannot happen in a
    run of ``steps`` optimizer steps on ``world_size`` ranks (before any process starts)."""
    unknown = [key for key in faults if key not in FAULTS]
    if unknown:
        raise ValueError(f"faults {unknown}: not course faults; choose from {', '.join(FAULTS)}")
    for key in ("fail_on_rank", "hang_on_rank"):
        rank = faults.get(key)
        if rank is not None and not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world_size):
            raise ValueError(f"faults {{'{key}': {rank}}}: this launch has ranks 0-{world_size - 1}; "
                             f"choose one of them (the last is {world_size - 1})")


class Faults(Probe):
    """Injects the run's faults (:data:`FAULTS`) at the start of an optimizer step. Writes nothing."""

    name = "faults"

    def before_step(self, ctx: RunContext, step: int) -> None:
        faults = ctx.faults
        if step == 0 and faults.get("fail_on_rank") == ctx.rank:
            raise RuntimeError(f"deliberate failure on rank {ctx.rank} (fail_on_rank)")
        if step == 0 and faults.get("hang_on_rank") == ctx.rank:
            time.sleep(3600)
