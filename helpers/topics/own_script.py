"""Chapter 02b: your own DeepSpeed script, measured (notebooks/02b_your_own_script.ipynb).

The learner's scripts record themselves through :mod:`helpers.measure` (started with the stock ``deepspeed``
command, by Hugging Face's ``Trainer`` or with ``accelerate launch``); this module sets each record beside the
course's own run of the same config (:func:`course_runs`, one launch), shows how a config's ``"auto"`` values
resolved (:func:`auto_table`), and holds the chapter's exercises.
"""

from __future__ import annotations

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
    """The collectives of one optimizer step of ``record``, as DeepSpeed's comms logger counted them."""
    rows = [[op, f"{v['count']:g}", f"{v['bytes']:,.0f}"] for op, v in sorted(record.comm_ops().items())]
    rows.append(["total", "", f"{record.comm.bytes_per_step:,.0f}"])
    return records.format_table(rows, ["collective", "calls per step", "bytes per step"])


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


def auto_table(written: dict, resolved: dict) -> str:
    """Each ``"auto"`` of the ``written`` config beside the value the engine trained with (``resolved``: the
    config of the record, as DeepSpeed received it)."""
    rows = [[path, "auto", json.dumps(value_at(resolved, path))] for path in auto_paths(written)]
    return records.format_table(rows, ["key", "written", "DeepSpeed received"])


def write_config(config: dict, path: str | Path) -> Path:
    """Write a DeepSpeed config as JSON (for ``accelerate launch --deepspeed_config_file``); return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


# --- exercises ---------------------------------------------------------------------------------------

def exercise_bytes_per_step(answer: Any, record: records.Record) -> exercises.Verdict:
    """Predict the bytes DeepSpeed's comms logger records for one optimizer step of your script."""
    grad = 4 * record.params
    stage, accum = record.stage, record["grad_accum"]
    return exercises.number(
        "bytes per step", answer, record.comm.bytes_per_step, relative=0.01, unit=" bytes",
        task=(f"Your script trains ZeRO-{stage} in fp32 with {accum} micro-steps per optimizer step on "
              f"{record.world_size} ranks, a model of {record.params:,} parameters. How many bytes does the comms "
              "logger record for one optimizer step (all collectives together)? Within 1%."),
        hint=(f"ZeRO-{stage} all-reduces the whole fp32 gradient ({grad:,} bytes) in every micro-step (chapter 08), "
              "then all-gathers the updated parameters once per step (each rank's shard as the logger records it), "
              "and reduces the gradient norm (4 bytes)."),
        why=(f"From the record: {record.comm.bytes_per_step:,.0f} bytes, the sum of "
             + ", ".join(f"{v['count']:g} {op} ({v['bytes']:,.0f} bytes)" for op, v in sorted(record.comm_ops().items()))
             + ". Chapters 04 and 08 explain each term."))


def exercise_resolved_config(answer: Any, record: records.Record, written: dict) -> exercises.Verdict:
    """Write the values DeepSpeed received for each ``"auto"`` of the Trainer's config."""
    paths = auto_paths(written)

    def test(values: Any) -> tuple[bool, str]:
        if not isinstance(values, dict):
            raise TypeError("write a dict {dotted key: value}, e.g. {'train_micro_batch_size_per_gpu': 4, ...}")
        wrong = [p for p in paths if p not in values or values[p] != value_at(record["config"], p)]
        extra = sorted(set(values) - set(paths))
        if extra:
            return False, f"{extra} are not 'auto' in the written config."
        if wrong:
            return False, f"{len(wrong)} of {len(paths)} wrong or missing: {', '.join(wrong)}."
        return True, ("All " + str(len(paths)) + " right: the Trainer fills each 'auto' from its TrainingArguments "
                      "(transformers' HfTrainerDeepSpeedConfig.trainer_config_process) before DeepSpeed sees the "
                      "config; the record's config is what the engine received.")

    return exercises.satisfies(
        "auto values", answer, test,
        task=("Write, for each 'auto' of the Trainer's DeepSpeed config, the value DeepSpeed received, as a dict "
              f"{{dotted key: value}} with the keys {', '.join(paths)}."),
        hint=("read the TrainingArguments in the script: per_device_train_batch_size, gradient_accumulation_steps, "
              "max_grad_norm, learning_rate, weight_decay"))
