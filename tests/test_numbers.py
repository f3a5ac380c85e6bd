"""helpers.tools.numbers: a number in a notebook's prose is traced to an output, a reference or a citation."""

from __future__ import annotations

import json

from helpers.tools import numbers


def _notebook(tmp_path, markdown: str, printed: str = "", code: str = "print('x')"):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": [markdown]},
             {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": [code],
              "outputs": [{"output_type": "stream", "name": "stdout", "text": [printed]}]}]
    path = tmp_path / "99_planted.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_a_planted_number_is_found_and_a_printed_one_is_not(tmp_path):
    path = _notebook(tmp_path, "ZeRO-2 with accumulation 4 was 35% faster, and 1.15x per the table.",
                     printed="accumulation 4 / 1: 1.15x tokens/s\n")
    found = numbers.untraced(path, folder=tmp_path)
    assert [(u.cell, u.number) for u in found] == [(0, "35%")]


def test_the_number_must_be_whole_and_carry_its_unit(tmp_path):
    path = _notebook(tmp_path, "It reached 50% MFU, used 12 GiB and took 3.5 s.", printed="50.2% MFU, 12 GB, 3.5 ms\n")
    assert [u.number for u in numbers.untraced(path, folder=tmp_path)] == ["50%", "12 GiB", "3.5 s"]
    path = _notebook(tmp_path, "It sends 792 bytes and 2 MiB.", printed="792 B, 2 MiB\n")
    assert numbers.untraced(path, folder=tmp_path) == []


def test_a_cited_sentence_code_and_formulas_need_no_output(tmp_path):
    text = ("The paper counts 12 bytes of optimizer state per parameter [source: ZeRO paper, section 5].\n\n"
            "NVLink 4 moves 450 GB/s each way ([datasheet](https://www.nvidia.com/h100)).\n\n"
            "Code, `sleep(3 s)`, and formulas, $2\\Psi$ at $50\\%$, are no prose.")
    assert numbers.untraced(_notebook(tmp_path, text), folder=tmp_path) == []


def test_a_reference_the_notebook_names_traces_its_precise_numbers_only(tmp_path):
    (tmp_path / "claim-2xNVIDIA-H200.json").write_text(json.dumps({"runs": {"a": {"ratio": 1.153, "steps": 35}}}))
    path = _notebook(tmp_path, "On GPUs the ratio was 1.153x, over 35% of steps.",
                     code="references.references_report('claim')")
    assert [u.number for u in numbers.untraced(path, folder=tmp_path)] == ["35%"]
    other = _notebook(tmp_path, "On GPUs the ratio was 1.153x.", code="print(1)")
    assert [u.number for u in numbers.untraced(other, folder=tmp_path)] == ["1.153x"]
