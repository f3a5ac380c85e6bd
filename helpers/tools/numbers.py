"""Trace every number a notebook's prose states to where it comes from.

A number in a markdown cell that carries a unit (``%``, a ratio such as ``1.15x``, bytes in any unit,
seconds, a rate) must be one of:

- **measured or computed in the notebook**: the same number appears in a stored output of the notebook
  (a cell printed it, so a re-measured reference or a changed run changes it there too);
- **in a committed reference the notebook reads**: the same number appears in a file of
  ``notebooks/reference/`` whose experiment name the notebook mentions;
- **cited**: its sentence names its source with a link, an arXiv number, or ``[source: ...]``
  (a paper's table, a datasheet, DeepSpeed's docs).

"The same number" is the literal as written (``1,244,227,584``, ``35``, ``1.15``), bounded so that ``50``
is not found inside ``50.2``. Code spans and formulas (``$...$``) are not prose and are not checked.

    python -m helpers.tools.numbers [NOTEBOOK ...]     # every untraced number, with its sentence
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from helpers.core.environment import REPO_ROOT

#: A unit after a number: per cent, a ratio (``1.5x``, no space), bytes, seconds, rates.
UNIT = (r"(?:%|[x×](?![A-Za-z0-9])|\s?(?:GB/s|Gb/s|TB/s|TFLOP/s|tokens/s|samples/s|GiB|MiB|KiB|TiB|GB|MB|KB|TB|"
        r"bytes|ms|µs|us|s)(?![A-Za-z0-9/]))")
NUMBER = re.compile(r"(?<![\w.,/^])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(" + UNIT + ")")
#: What marks a sentence as citing its source.
CITATION = re.compile(r"\]\((?:https?://|\.\./|#)|arXiv[: ]\s?\d{4}\.\d{4,5}|[\[(]source:", re.IGNORECASE)
REFERENCE_DIR = REPO_ROOT / "notebooks" / "reference"


@dataclasses.dataclass(frozen=True)
class Untraced:
    notebook: str
    cell: int  # index among all cells, as Jupyter numbers them from 0
    number: str  # as written, with its unit
    sentence: str

    def __str__(self) -> str:
        return f"{self.notebook} cell {self.cell}: {self.number!r} in \"{self.sentence[:160]}\""


def prose(markdown: str) -> str:
    """A markdown cell without code blocks, code spans and formulas."""
    markdown = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    markdown = re.sub(r"`[^`]*`", " ", markdown)
    markdown = re.sub(r"\$\$.*?\$\$", " ", markdown, flags=re.S)
    return re.sub(r"\$[^$\n]*\$", " ", markdown)


def sentences(text: str) -> list[str]:
    """Paragraphs split into sentences (a citation covers the sentence it is in)."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        found += re.split(r"(?<=[.!?:;])\s+(?=[A-Z*(\[-])", " ".join(paragraph.split()))
    return found


def outputs_text(cells: list[dict]) -> str:
    """Everything the notebook's code cells printed or displayed as text."""
    parts = []
    for cell in cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                parts.append("".join(output["text"]))
            for kind in ("text/plain", "text/html", "text/markdown"):
                if kind in output.get("data", {}):
                    parts.append("".join(output["data"][kind]))
    return "\n".join(parts)


def references_read(cells: list[dict], folder: Path = REFERENCE_DIR) -> str:
    """The text of every committed reference whose experiment name the notebook mentions."""
    source = "\n".join("".join(c["source"]) for c in cells)
    texts = []
    for path in sorted(folder.glob("*.json")):
        experiment = re.sub(r"-\d+x[^/]*$", "", path.stem)  # "pipeline-2xNVIDIA-H200" -> "pipeline"
        if re.search(rf"(?<![\w-]){re.escape(experiment)}(?![\w-])", source):
            texts.append(path.read_text())
    return "\n".join(texts)


#: Units that mean the same thing written two ways.
SAME_UNIT = {"bytes": r"(?:bytes|B)", "x": "[x×]", "×": "[x×]", "us": "(?:us|µs)", "µs": "(?:us|µs)"}


def appears(number: str, unit: str, text: str) -> bool:
    """Whether ``number`` followed by ``unit`` is written in ``text``, the number whole (``50%`` is not in
    ``50.2%`` or ``150%``). Without a unit (a reference file keeps bare values) only a number of three or
    more digits, or with a decimal point, counts: a bare ``35`` is found anywhere."""
    whole = rf"(?<![\d.,]){re.escape(number)}(?![,.]?\d)"
    if not unit:
        significant = len(re.sub(r"\D", "", number)) >= 3 or "." in number
        return significant and re.search(whole, text) is not None
    after = SAME_UNIT.get(unit, re.escape(unit))
    return re.search(rf"{whole}\s?{after}(?![A-Za-z0-9])", text) is not None


def untraced(path: Path, folder: Path = REFERENCE_DIR) -> list[Untraced]:
    """Every number of the notebook's prose that neither its outputs, the references it reads nor a citation
    in its sentence account for."""
    cells = json.loads(Path(path).read_text())["cells"]
    printed, referenced = outputs_text(cells), references_read(cells, folder)
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        for sentence in sentences(prose("".join(cell["source"]))):
            if CITATION.search(sentence):
                continue
            for match in NUMBER.finditer(sentence):
                number, unit = match.group(1), match.group(2).strip()
                if not (appears(number, unit, printed) or appears(number, "", referenced)):
                    found.append(Untraced(Path(path).name, index, match.group(0).strip(), sentence))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    found = [u for path in paths for u in untraced(path)]
    for u in found:
        print(u)
    print(f"{len(found)} untraced number(s) in {len(paths)} notebook(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
