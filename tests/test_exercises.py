"""The exercises: the verdicts of helpers.core.exercises, and the form every chapter 02-16 gives them (two to
four exercise cells that ship unanswered, each followed by a collapsed solution cell whose stored output is
right; nbval re-executes those, so the solutions are known to work)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.core import exercises

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = [p for p in sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")) if "02" <= p.name[:2] <= "16"]


def test_a_blank_answer_gets_the_task_and_a_hint_whatever_the_check():
    verdict = exercises.number("bytes", ..., 1024, task="Predict the bytes.", hint="count them", why="because")
    assert not verdict and not verdict.answered
    assert str(verdict) == ("[bytes] to do: Predict the bytes. Replace the ... with your answer and run the cell "
                            "again. Hint: count them")


def test_a_number_is_right_within_its_tolerance_only_and_a_non_number_is_named():
    check = lambda answer: exercises.number("x", answer, 100.0, task="t", hint="h", why="w", relative=0.05)
    assert check(104) and not check(106) and not check(True) and not check("100")
    assert str(check(104)) == "[x] right: 100. w"
    assert str(check(106)) == "[x] not yet: 106 is not within 5% of the real answer. Hint: h"


def test_a_choice_must_be_one_of_the_choices_and_the_expected_one():
    check = lambda answer: exercises.choice("stage", answer, 2, task="t", hint="h", why="w", choices=(0, 1, 2, 3))
    assert check(2) and not check(3)
    assert "is not one of the choices" in str(check(7))


def test_satisfies_reports_what_the_test_found_and_turns_bad_input_into_a_hint():
    def test(config):
        return config["stage"] == 3, f"stage {config['stage']}"
    check = lambda answer: exercises.satisfies("config", answer, test, task="t", hint="h")
    assert check({"stage": 3}) and str(check({"stage": 1})) == "[config] not yet: stage 1 Hint: h"
    assert str(check({})) == "[config] not yet: KeyError: 'stage'. Hint: h"


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text())["cells"]


def _text(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def _tags(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def test_chapters_02_to_16_are_found():
    assert len(CHAPTERS) >= 15 and CHAPTERS[0].name.startswith("02") and CHAPTERS[-1].name.startswith("16")


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_two_to_four_exercises_shipped_blank_each_with_a_collapsed_solution_that_is_right(notebook):
    cells = _cells(notebook)
    found = [i for i, c in enumerate(cells) if exercises.EXERCISE_TAG in _tags(c)]
    assert 2 <= len(found) <= 4, f"{notebook.name}: {len(found)} exercise cells"
    for number, i in enumerate(found, 1):
        cell, solution = cells[i], cells[i + 1]
        source = "".join(cell["source"])
        assert "= ..." in source, f"{notebook.name} exercise {number}: no '= ...' for the learner to fill in"
        assert "to do:" in _text(cell), f"{notebook.name} exercise {number}: the stored check does not answer the blank"
        assert "NBVAL" not in source and "NBVAL" not in "".join(solution["source"])
        assert exercises.SOLUTION_TAG in _tags(solution), f"{notebook.name} exercise {number}: no solution cell after it"
        assert solution["metadata"].get("jupyter", {}) == exercises.SOLUTION_METADATA["jupyter"]
        assert "] right:" in _text(solution), f"{notebook.name} exercise {number}: the stored solution is not right"
        opening = "".join(cells[i - 1]["source"]) if cells[i - 1]["cell_type"] == "markdown" else ""
        assert f"**Exercise {number}" in opening, f"{notebook.name}: the markdown before exercise {number} does not open it"
