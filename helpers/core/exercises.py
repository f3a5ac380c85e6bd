"""Exercises: predict, then run, then check.

Chapters 02-16 each hold two to four tasks. The learner edits one line of an exercise cell (a number, a config
dict, a knob) and runs it; the cell's last line checks the answer against the real one, which the check
computes or measures itself (from the chapter's runs, a formula of the course, or a small launch), and says
right or not yet, and why. A chapter's checks live in its topic module, each a function that takes the
learner's answer (and the chapter's runs where it needs them) and returns a :class:`Verdict`
(``zero.exercise_stage2_bytes(answer, runs)``); this module holds what they share.

In a notebook an exercise is three cells:

- a markdown cell opening with ``**Exercise N: <title>.**`` that states the task;
- the exercise cell, tagged ``exercise``, that the stored notebook ships with the answer ``...`` (Python's
  Ellipsis): its check answers that with the task and a hint (``to do``), the same on every machine::

      answer = ...  # your prediction, in bytes
      zero.exercise_stage2_bytes(answer, runs)

- the solution cell right after it, tagged ``solution``, its source and output collapsed in JupyterLab
  (``metadata.jupyter.source_hidden`` and ``outputs_hidden``): the same check with the answer filled in, whose
  stored output says ``right``. ``pytest --nbval notebooks/`` executes it like any cell, so every exercise is
  known solvable; ``tests/test_exercises.py`` checks the form.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

#: What the learner's cell holds until they answer.
BLANK = ...
#: The tags of an exercise cell and of the (collapsed) solution cell that follows it.
EXERCISE_TAG, SOLUTION_TAG = "exercise", "solution"
#: The metadata of a solution cell: tagged, source and output collapsed in JupyterLab.
SOLUTION_METADATA = {"tags": [SOLUTION_TAG], "jupyter": {"source_hidden": True, "outputs_hidden": True}}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one exercise: ``right`` or not, and a message that says why (or gives a hint)."""

    exercise: str
    right: bool
    message: str
    answered: bool = True

    def __str__(self) -> str:
        mark = "right" if self.right else ("to do" if not self.answered else "not yet")
        return f"[{self.exercise}] {mark}: {self.message}"

    def __repr__(self) -> str:
        return str(self)

    def __bool__(self) -> bool:
        return self.right


def blank(exercise: str, task: str, hint: str) -> Verdict:
    """The verdict for an unanswered exercise: what to do and a hint."""
    return Verdict(exercise, False, f"{task} Replace the ... with your answer and run the cell again. "
                                    f"Hint: {hint}", answered=False)


def number(exercise: str, answer: Any, expected: float, *, task: str, hint: str, why: str,
           relative: float = 0.0, absolute: float = 0.0, unit: str = "") -> Verdict:
    """Check a numeric ``answer`` against ``expected`` (within ``relative`` of it, or ``absolute``): ``why``
    explains the real answer either way; a wrong answer also gets the ``hint``."""
    if answer is BLANK:
        return blank(exercise, task, hint)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return Verdict(exercise, False, f"{answer!r} is not a number: write your answer as one (e.g. 1024 or 2.5e6)")
    close = math.isclose(answer, expected, rel_tol=relative, abs_tol=absolute)
    shown = f"{expected:,.6g}{unit}"
    if close:
        return Verdict(exercise, True, f"{shown}. {why}")
    allowed = f"within {relative:.0%} of" if relative else (f"within {absolute:g} of" if absolute else "equal to")
    return Verdict(exercise, False, f"{answer:,.6g}{unit} is not {allowed} the real answer. Hint: {hint}")


def choice(exercise: str, answer: Any, expected: Any, *, task: str, hint: str, why: str,
           choices: tuple = ()) -> Verdict:
    """Check an ``answer`` that must equal ``expected`` (a name, a stage, a knob), one of ``choices`` if given."""
    if answer is BLANK:
        return blank(exercise, task, hint)
    if choices and answer not in choices:
        return Verdict(exercise, False, f"{answer!r} is not one of the choices: {', '.join(map(repr, choices))}")
    if answer == expected:
        return Verdict(exercise, True, f"{expected!r}. {why}")
    return Verdict(exercise, False, f"{answer!r} is not it. Hint: {hint}")


def satisfies(exercise: str, answer: Any, test: Callable[[Any], tuple[bool, str]], *, task: str,
              hint: str) -> Verdict:
    """Check an ``answer`` (a config, a setting) with ``test``, which returns (right, what it found)."""
    if answer is BLANK:
        return blank(exercise, task, hint)
    try:
        right, found = test(answer)
    except (ValueError, TypeError, KeyError) as error:
        return Verdict(exercise, False, f"{type(error).__name__}: {error}. Hint: {hint}")
    return Verdict(exercise, right, found if right else f"{found} Hint: {hint}")
