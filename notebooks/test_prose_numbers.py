"""Part of the README's test command: every number a chapter's prose states is printed by the chapter,
held by a GPU reference it reads, or cited in its sentence (``python -m helpers.tools.numbers`` lists any
that is not, with its sentence)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.tools import numbers

NOTEBOOKS = sorted(Path(__file__).parent.glob("[0-9][0-9]*_*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_number_in_the_prose_is_traced(notebook):
    assert [str(u) for u in numbers.untraced(notebook)] == []
