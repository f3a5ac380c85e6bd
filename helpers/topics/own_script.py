"""Chapter 02b: your own DeepSpeed script, measured (notebooks/02b_your_own_script.ipynb).

The learner's scripts record themselves through :mod:`helpers.measure` (started with the stock ``deepspeed``
command, by Hugging Face's ``Trainer`` or with ``accelerate launch``); this module sets each record beside the
course's own run of the same config (:func:`course_runs`, one launch), shows how a config's ``"auto"`` values
resolved (:func:`auto_table`, :func:`trainer_fields`), and holds the chapter's exercises.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping

from helpers.core import exercises, launch, records

#: Keys the course's launcher or the probes add to every config: left out when a record's config is run again.
ADDED_KEYS = ("comms_logger", "steps_per_print")


def runnable_config(record: records.Record) -> dict:
    """The DeepSpeed config a record trained with, as the course runs it again: without the keys the course and
    its probes add by themselves, and without blocks that only switch a feature off."""
    config = {k: v for k, v in record["config"].items() if k not in ADDED_KEYS}
    return {k: v for k, v in config.items() if not (isinstance(v, dict) and v == {"enabled": False})}


def course_runs(own: Mapping[str, records.Record]) -> dict[str, records.Record]:
    """In one launch, the course's own run of each record's config: same model, steps and ranks (the course's
    seed and samples, which the chapter's scripts read too). Returns them under the same names."""
    worlds = {r.world_size for r in own.values()}
    if len(worlds) != 1:
        raise ValueError(f"the records ran on different numbers of ranks ({sorted(worlds)}): compare them one by one")
    specs = [launch.RunSpec(config=runnable_config(r), model=r.model_name, steps=r["steps"], name=f"course-{name}")
             for name, r in own.items()]
    found = launch.sweep(specs, name="own-script-course", world_size=worlds.pop())
    return {name: found[f"course-{name}"] for name in own}


def _collectives(record: records.Record) -> str:
    return " ".join(f"{op}:{v['count']:g}x{v['bytes']:,.0f}B" for op, v in sorted(record.comm_ops().items()))


def agreement_rows(own: Mapping[str, records.Record], course: Mapping[str, records.Record]) -> list[dict]:
    """Per record: its losses against the course's run of its config (within the precision's tolerance), its
    model-state bytes per rank (rank 0) and its collectives per optimizer step, each equal or not."""
    rows = []
    for name, mine in own.items():
        theirs = course[name]
        losses = records.loss_agreement(mine.losses, theirs.losses, mine.precision)
        states = (mine.memory.model_states(0).total, theirs.memory.model_states(0).total)
        rows.append({"name": name, "losses": losses, "states": states, "collectives": (_collectives(mine),
                                                                                         _collectives(theirs)),
                     "same": losses.startswith("within") and states[0] == states[1]
                     and _collectives(mine) == _collectives(theirs)})
    return rows


def agreement_table(own: Mapping[str, records.Record], course: Mapping[str, records.Record]) -> str:
    """:func:`agreement_rows` as a table: does each record equal the course's run of the same config?"""
    table = []
    for row in agreement_rows(own, course):
        mine, theirs = row["states"]
        table.append([row["name"], row["losses"], records.format_bytes(mine), records.format_bytes(theirs),
                      "equal" if row["collectives"][0] == row["collectives"][1] else "DIFFER",
                      "yes" if row["same"] else "no"])
    return records.format_table(table, ["record", "losses vs the course's run", "model states/rank",
                                        "course's", "collectives per step", "same run"])


def collectives_table(record: records.Record) -> str:
    """The collectives of one optimizer step of ``record``, by the DeepSpeed function that issued them, as
    DeepSpeed's comms logger counted them (its totals over the measured steps, divided by their number)."""
    rows = [[op, caller or "-", f"{row['count']:g}", f"{row['bytes']:,.0f}"]
            for op, by_caller in sorted(record.comm.callers.items()) for caller, row in sorted(by_caller.items())]
    rows.append(["total", "", "", f"{record.comm.bytes_per_step:,.0f}"])
    return records.format_table(rows, ["collective", "issued by (DeepSpeed function)", "calls per step",
                                       "bytes per step"])


def model_states_line(record: records.Record, rank: int = 0) -> str:
    """One rank's model-state bytes and what they are made of, as the record measured them."""
    states = record.memory.model_states(rank)
    parts = [(f"{record.precision} parameters", states.params), ("gradients", states.grads),
             ("optimizer states", states.optimizer), ("fp32 master copy", states.master)]
    return (f"model states per rank (rank {rank}): {records.format_bytes(states.total)} = "
            + " + ".join(f"{name} {records.format_bytes(n)}" for name, n in parts if n))


#: DeepSpeed functions whose collectives come once per optimizer step, whatever the accumulation: the
#: gradient norm's all-reduce (a collective of the all_gather family is the updated parameters', once too).
ONCE_PER_STEP = ("get_grad_norm",)


def once_per_step(op: str, caller: str) -> bool:
    """Whether a collective comes once per optimizer step (else once per micro-step: a gradient reduction)."""
    return op.startswith("all_gather") or caller.startswith(ONCE_PER_STEP)


def gradient_callers(record: records.Record) -> list[str]:
    """The DeepSpeed functions whose collectives reduce gradients, once per micro-step, in ``record``."""
    return sorted(caller for op, by_caller in (record.comm.by_caller or {}).items() for caller in by_caller
                  if not once_per_step(op, caller))


def bytes_at_accumulation(record: records.Record, accumulation: int) -> float:
    """Bytes per optimizer step the comms logger would record for ``record``'s run at ``accumulation`` micro-steps
    per optimizer step: its gradient reductions scale with the micro-steps, the other collectives stay (ZeRO-2:
    other stages reduce or gather at other times, chapters 03 and 05)."""
    if record.stage != 2:
        raise ValueError(f"{record.name or 'this run'} is ZeRO-{record.stage}: this rule is ZeRO-2's")
    callers = record.comm.by_caller
    if not callers:
        raise records.NotMeasured(f"{record.name or 'this run'} has no collectives by DeepSpeed function")
    total = 0.0
    for op, by_caller in callers.items():
        for caller, row in by_caller.items():
            total += row["bytes"] * (1 if once_per_step(op, caller) else accumulation / record.grad_accum)
    return total


def auto_paths(config: Any, prefix: str = "") -> list[str]:
    """The dotted paths of every ``"auto"`` value of a DeepSpeed config, in order."""
    if isinstance(config, dict):
        return [p for k, v in config.items() for p in auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if config == "auto" else []


def value_at(config: dict, path: str) -> Any:
    """The value at a dotted ``path`` of a config (KeyError naming the path if it is not there)."""
    value: Any = config
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(path)
        value = value[key]
    return value


def trainer_fields(config: dict) -> dict[str, str]:
    """For each ``"auto"`` of ``config``, the ``TrainingArguments`` field that fills it, as transformers' own code
    names it (``HfTrainerDeepSpeedConfig.trainer_config_process`` passes the field's name with each value)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig  # deferred: a heavy import

    class AnyArgs:
        """TrainingArguments stand-in: every field reads 1 (only the names of the fields are wanted)."""

        def __getattr__(self, name: str) -> int:
            return 1

    named: dict[str, str] = {}
    hf_config = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    hf_config.fill_match = lambda key, value, field=None, must_match=True: named.setdefault(key, field)
    hf_config.trainer_config_process(AnyArgs())
    return {path: named.get(path, "-") for path in auto_paths(config)}


def auto_table(written: dict, resolved: dict) -> str:
    """Each ``"auto"`` of the ``written`` config, the ``TrainingArguments`` field that fills it, and the value the
    engine trained with (``resolved``: the config of the record, as DeepSpeed received it)."""
    fields = trainer_fields(written)
    rows = [[path, fields[path], json.dumps(value_at(resolved, path))] for path in auto_paths(written)]
    return records.format_table(rows, ["key (written: auto)", "TrainingArguments field", "DeepSpeed received"])


def write_config(config: dict, path: str | Path) -> Path:
    """Write a DeepSpeed config as JSON (for ``accelerate launch --deepspeed_config_file``); return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


# --- exercises ---------------------------------------------------------------------------------------

def exercise_bytes_at_accumulation(answer: Any, record: records.Record, accumulation: int = 4) -> exercises.Verdict:
    """Predict the bytes per optimizer step of your script at ``accumulation`` micro-steps per optimizer step."""
    expected = bytes_at_accumulation(record, accumulation)
    measured = record.grad_accum == accumulation
    return exercises.number(
        "bytes at more micro-steps", answer, expected, relative=0.01, unit=" bytes",
        task=(f"my_train.py ran {record.grad_accum} micro-steps per optimizer step. With "
              f'"gradient_accumulation_steps": {accumulation} (all else the same), how many bytes would the comms '
              "logger record per optimizer step, all collectives together? Within 1%."),
        hint=("in the record's collectives table, which calls repeat with every micro-step (each backward makes a "
              "gradient) and which come once per optimizer step (the update)? Scale only the former, by their bytes "
              "per call."),
        why=(f"Measured: your run at {accumulation} micro-steps, the table's total." if measured else
             f"From the record: the gradient reduction ({', '.join(gradient_callers(record))}) comes once per "
             f"micro-step, so {accumulation}/{record.grad_accum} of its bytes; the other calls once per optimizer "
             f'step. Check it with a run: set "gradient_accumulation_steps": {accumulation} in my_train.py, run its '
             "cell, its launch and the record's cell, then this one again: it then checks against your run."))


def exercise_trainer_fields(answer: Any, written: dict) -> exercises.Verdict:
    """Name the ``TrainingArguments`` field that fills each ``"auto"`` of the Trainer's config."""
    fields = trainer_fields(written)

    def test(named: Any) -> tuple[bool, str]:
        if not isinstance(named, dict):
            raise TypeError("write a dict {dotted key: field name}, e.g. {'optimizer.params.lr': '...', ...}")
        extra = sorted(set(named) - set(fields))
        if extra:
            return False, f"{extra} are not 'auto' in the written config."
        wrong = [p for p in fields if str(named.get(p, "")).strip() != fields[p]]
        if wrong:
            return False, f"{len(wrong)} of {len(fields)} wrong or missing: {', '.join(wrong)}."
        return True, (f"All {len(fields)} right, as transformers' HfTrainerDeepSpeedConfig.trainer_config_process "
                      "fills them before DeepSpeed sees the config.")

    return exercises.satisfies(
        "auto fields", answer, test,
        task=("For each 'auto' of the Trainer's DeepSpeed config, name the TrainingArguments field whose value "
              f"DeepSpeed receives there, as a dict {{dotted key: field name}} with the keys {', '.join(fields)}."),
        hint=("the fields are the keyword arguments of TrainingArguments(...) in my_trainer.py; transformers documents "
              "which fills which in its DeepSpeed integration guide (Trainer docs, 'DeepSpeed', the 'auto' values) and "
              "in HfTrainerDeepSpeedConfig.trainer_config_process (transformers/integrations/deepspeed.py)."))
