"""A chapter a learner follows: its prose before the closing "How this was measured" stays short, so what is
there for the expert (source walkthroughs, platform quirks, run histories) goes to that section or docs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_readme import words

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
#: Words of markdown before "## How this was measured" (counted as the README's words are).
MAX_WORDS = 1600
CLOSING = "## How this was measured"


def prose_before_closing(notebook: Path) -> str:
    """The chapter's markdown up to its closing section (all of it where there is none)."""
    text = "\n".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                     if c["cell_type"] == "markdown")
    return text.split(CLOSING)[0]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_chapters_main_text_is_at_most_1600_words(notebook):
    count = words(prose_before_closing(notebook))
    assert count <= MAX_WORDS, (f"{notebook.name}: {count} words before {CLOSING!r}; move expert detail into that "
                                f"section or docs/ (at most {MAX_WORDS})")


def test_the_count_stops_at_the_closing_section(tmp_path):
    notebook = tmp_path / "99_x.ipynb"
    cells = [{"cell_type": "markdown", "source": ["one two three"]},
             {"cell_type": "code", "source": ["x = 1 2 3 4"]},
             {"cell_type": "markdown", "source": [f"{CLOSING}\n\nfour five six seven"]}]
    notebook.write_text(json.dumps({"cells": cells}))
    assert words(prose_before_closing(notebook)) == 3
