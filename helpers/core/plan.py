"""The contract between the launcher and the ranks: one typed plan, written by :mod:`helpers.core.launch`
into ``plan.json`` and read back by every rank (:mod:`helpers.core.train`), the same classes on both sides.

Also here: the events the ranks send back on stdout (:func:`emit` writes them, the launcher parses lines
that start with :data:`EVENT_PREFIX`), the signal that asks a hung rank for its stack, and how a name
such as ``"helpers.topics.pipeline:train_step"`` becomes the function or class it names (:func:`resolve`):
runs name their trainer, model builder, engine maker, probes, task and hooks that way, so the core imports no topic.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

#: Lines starting with this on a rank's stdout are events for the launcher (progress, errors).
EVENT_PREFIX = "@@course "
#: Ranks share the launcher's stdout; one write() of at most this many bytes is never interleaved
#: with another process's write (POSIX PIPE_BUF).
ATOMIC_WRITE_BYTES = 4096
#: The launcher sends this to every rank of a launch that outlives its timeout: each rank prints its
#: Python stack (faulthandler), so a hang shows where it waited.
STACK_SIGNAL = signal.SIGUSR1

#: The default trainer, model builder and engine maker of a run (:class:`PlannedRun`).
DATA_PARALLEL_STEP = "helpers.core.train:data_parallel_step"
COURSE_MODELS = "helpers.core.models:build"
DEEPSPEED_INITIALIZE = "helpers.core.train:initialize"


@dataclasses.dataclass
class PlannedRun:
    """One run of a launch, as every rank reads it.

    ``config`` is the path of the run's checked DeepSpeed config; ``probes`` the import paths of its
    probe classes (``"helpers.core.probes:Timing"``); ``trainer`` takes one optimizer step
    (``function(ctx, run, step, probes) -> micro-batch losses``); ``builder`` builds the model
    (``function(name, seed, config, **model_options) -> model``); ``initialize`` wraps it in DeepSpeed's engine
    (``function(model, config, run) -> engine``: the call to ``deepspeed.initialize``); ``task`` is ``"train"`` or
    the import path of other work (``function(run, position, count, born)``); ``before_training`` an optional hook
    (``function(engine, run) -> first step``). ``faults`` are the course's fault injections
    (:mod:`helpers.core.faults`), ``options`` settings that probes, tasks and hooks read.
    """

    name: str
    out: str
    config: str
    model: str
    steps: int
    seed: int
    probes: list[str]
    trainer: str = DATA_PARALLEL_STEP
    builder: str = COURSE_MODELS
    initialize: str = DEEPSPEED_INITIALIZE
    task: str = "train"
    client_optimizer: bool = False
    cast_inputs: bool = True
    on_error: str = "raise"
    faults: dict = dataclasses.field(default_factory=dict)
    model_options: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    before_training: str | None = None
    plan: str = ""  # the plan.json this run came from

    def read_config(self) -> dict:
        """The run's DeepSpeed config, as checked and written by the launcher."""
        return json.loads(Path(self.config).read_text())


@dataclasses.dataclass
class Plan:
    """Everything one launch does: its world size, its launcher and its runs, in order."""

    world_size: int
    launcher: str
    runs: list[PlannedRun]

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def read(cls, path: str | Path) -> "Plan":
        data = json.loads(Path(path).read_text())
        return cls(data["world_size"], data["launcher"], [PlannedRun(**run) for run in data["runs"]])


def resolve(reference: str) -> Any:
    """``"package.module:name"`` -> that function or class, imported where it is called (on the ranks too).
    Raises a ValueError naming the reference and how to write it."""
    module, colon, name = reference.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"{reference!r}: write it as 'package.module:name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{reference!r}: could not be imported ({error})") from None


def reference_of(obj: Any) -> str:
    """The ``"package.module:name"`` of a module-level function or class (what :func:`resolve` takes)."""
    return f"{obj.__module__}:{obj.__qualname__}"


def emit(event: str, **fields) -> None:
    """Send one event to the process that launched the run, as one line written in one piece."""
    line = (EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n").encode()
    if len(line) > ATOMIC_WRITE_BYTES and "traceback" in fields:  # keep the end of a long traceback
        fields["traceback"] = "...\n" + fields["traceback"][-(ATOMIC_WRITE_BYTES // 2):]
        line = (EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n").encode()
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line)


def write_json(path: str | Path, data: dict) -> None:
    """Write ``data`` so that readers never see half a file."""
    path = str(path)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def publish(run: PlannedRun, position: int, summary: dict) -> None:
    """Rank 0: write a run's ``summary.json`` into its folder and tell the launcher it is done."""
    write_json(os.path.join(run.out, "summary.json"), summary)
    emit("done", run=position, out=run.out)
