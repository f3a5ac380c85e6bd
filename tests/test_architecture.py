"""The package's structure, read from its imports with ``ast`` (nothing is imported or run).

``helpers/`` has three layers, each a folder: ``core`` (environment, configs, launch, the ranks' loop,
probes, records, models, theory), ``topics`` (one module per chapter topic) and ``tools`` (the course's
own tooling), with the two commands (``helpers/__main__.py``, ``helpers/course.py``) and the public API for a learner's
own script (``helpers/measure.py``) on top. A layer
imports only the layers below it; the core and ``helpers/measure.py`` name no topic, not even in a deferred import
or as a string a run would import; there is no cycle; an import inside a function is there on purpose, saying why;
and DeepSpeed is imported in one module only, :mod:`helpers.core.ds`, after the course has chosen its accelerator.

``python tests/test_architecture.py`` prints the figures (modules per layer, cycles, upward imports,
imports inside functions) for any checkout: ``--root DIR``.
"""

from __future__ import annotations

import argparse
import ast
import json
import dataclasses
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Layers from the bottom up: a module may import its own layer and the ones before it.
LAYERS = ("core", "topics", "tools", "entry")
#: Modules that run in a learner's own script or on every rank: they import the core alone, never a chapter's topic.
CORE_ONLY = ("helpers.measure",)
#: The one module that imports DeepSpeed (:func:`helpers.core.ds.load`); every other goes through it.
DEEPSPEED_IMPORTER = "helpers.core.ds"

#: The chapter each topic module belongs to (its notebook's number): a topic imports the core and the topics of
#: its own and earlier chapters only, and so does a chapter's notebook. ``widgets`` serves the lab (17) and is
#: first used in chapter 03.
TOPIC_CHAPTERS = {"first_run": "02", "own_script": "02b", "zero": "03", "widgets": "03", "offload": "06",
                  "precision": "07", "accumulation": "08", "bandwidth": "09", "activations": "10", "pipeline": "11",
                  "tensor_parallel": "12", "sequence_parallel": "12b", "compression": "13", "checkpoints": "14",
                  "frameworks": "15", "capstone": "16"}


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module, "helpers.topics.offload"
    target: str  # the imported module, "helpers.core.launch" (or "torch" for a third-party one)
    line: int
    in_function: bool
    commented: bool  # a comment on the import's line, or above the block of imports it belongs to


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """``helpers.core.x`` -> "core"; the package itself and its two commands are the "entry" layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "entry"


def _blocks(tree: ast.AST) -> dict[int, list[ast.stmt]]:
    """id of each import statement -> the run of consecutive import statements it belongs to."""
    found: dict[int, list[ast.stmt]] = {}
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            run: list[ast.stmt] = []
            statements = getattr(node, field, [])
            for stmt in [*(statements if isinstance(statements, list) else []), None]:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run.append(stmt)
                    continue
                for member in run:
                    found[id(member)] = run
                run = []
    return found


def _commented(lines: list[str], block: list[ast.stmt]) -> bool:
    """A comment on any line of the block of imports, or on the line just above it."""
    first, last = block[0].lineno - 1, block[-1].end_lineno - 1
    return any("#" in lines[i] for i in range(first, last + 1)) or (first > 0 and lines[first - 1].lstrip().startswith("#"))


def read_imports(root: Path = REPO_ROOT) -> tuple[list[str], list[Import]]:
    """Every module of ``root/helpers`` and every import statement in them."""
    files = sorted((root / "helpers").rglob("*.py"))
    modules = [module_name(f, root) for f in files]
    known = set(modules)
    found: list[Import] = []
    for path, module in zip(files, modules):
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        blocks = _blocks(tree)
        inside: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside.update(id(n) for n in ast.walk(node) if n is not node)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            assert not getattr(node, "level", 0), f"{module}:{node.lineno}: a relative import"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in dict.fromkeys(targets):
                commented = _commented(lines, blocks.get(id(node), [node]))
                found.append(Import(module, target, node.lineno, id(node) in inside, commented))
    return modules, found


def internal(imports: list[Import]) -> list[Import]:
    return [i for i in imports if i.target == "helpers" or i.target.startswith("helpers.")]


def cycles(modules: list[str], imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), imports in functions included."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in internal(imports):
        if i.target in graph and i.target != i.source:
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def upward(imports: list[Import]) -> list[Import]:
    """Imports of a higher layer than the importer's (the core importing a topic, say)."""
    return [i for i in internal(imports) if i.target != "helpers"
            and LAYERS.index(layer_of(i.target)) > LAYERS.index(layer_of(i.source))]


def core_only(module: str) -> bool:
    """The core's modules and :data:`CORE_ONLY`: they may import the core alone."""
    return layer_of(module) == "core" or module in CORE_ONLY


def reaches_above_core(imports: list[Import]) -> list[Import]:
    """Imports of a topic, a tool or a command by a core-only module, at the top or inside a function."""
    return [i for i in internal(imports) if core_only(i.source) and i.target != "helpers" and layer_of(i.target) != "core"]


def is_deepspeed(target: str) -> bool:
    return target == "deepspeed" or target.startswith("deepspeed.")


def deepspeed_imports(imports: list[Import]) -> list[Import]:
    """``import deepspeed...`` and ``from deepspeed... import`` statements outside :data:`DEEPSPEED_IMPORTER`."""
    return [i for i in imports if is_deepspeed(i.target) and i.source != DEEPSPEED_IMPORTER]


def dynamic_deepspeed_imports(tree: ast.AST) -> list[int]:
    """Lines that import DeepSpeed by name at run time (``importlib.import_module("deepspeed...")``,
    ``__import__("deepspeed...")``), which :func:`read_imports` cannot see."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and is_deepspeed(node.args[0].value):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if function in ("import_module", "__import__"):
                found.append(node.lineno)
    return found


def topic_of(module: str) -> str | None:
    """``helpers.topics.zero`` (or ``helpers.topics.zero.x``) -> "zero"; None for a module outside the topics."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["helpers", "topics"] else None


def later_chapters(imports: list[Import], chapters: dict[str, str] = TOPIC_CHAPTERS) -> list[Import]:
    """Imports of a topic by a topic of an earlier chapter (chapter labels compare as text: 02 < 02b < 03)."""
    return [i for i in imports if topic_of(i.source) and topic_of(i.target) and topic_of(i.source) != topic_of(i.target)
            and chapters[topic_of(i.target)] > chapters[topic_of(i.source)]]


def notebook_topics(notebook: Path) -> set[str]:
    """The topic modules a notebook's code cells import (``from helpers.topics import a, b``)."""
    found: set[str] = set()
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).splitlines():
            words = line.split("#")[0].split()
            if words[:2] == ["from", "helpers.topics"] and len(words) > 3 and words[2] == "import":
                found.update(w.strip(",()") for w in words[3:] if w.strip(",()"))
            elif words[:1] == ["from"] and len(words) > 1 and topic_of(words[1]):
                found.add(topic_of(words[1]))
    return found


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants that are not docstrings."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def report(root: Path = REPO_ROOT) -> dict:
    modules, imports = read_imports(root)
    per_layer: dict[str, int] = {}
    for m in modules:
        per_layer[layer_of(m)] = per_layer.get(layer_of(m), 0) + 1
    in_functions = [i for i in imports if i.in_function]
    return {"modules": len(modules), "modules per layer": per_layer,
            "cycles": [len(c) for c in cycles(modules, imports)],
            "upward imports": len(upward(imports)),
            "imports inside functions": len(in_functions),
            "of helpers modules": len(internal(in_functions))}


# --- the rules ------------------------------------------------------------------------------------

def test_the_layers_are_folders_and_every_module_has_one():
    modules, _ = read_imports()
    assert {layer_of(m) for m in modules} == set(LAYERS)
    assert [m for m in modules if layer_of(m) == "entry"] == ["helpers", "helpers.__main__", "helpers.course", "helpers.measure"]


def test_no_import_cycle():
    modules, imports = read_imports()
    assert cycles(modules, imports) == []


def test_no_layer_imports_a_layer_above_it():
    """The core never imports a topic or a tool; a topic never imports a tool or a command."""
    assert [f"{i.source}:{i.line} imports {i.target}" for i in upward(read_imports()[1])] == []


def test_the_core_and_measure_import_no_topic():
    """The core, and the probes a learner's own script imports (``helpers/measure.py``), use the core alone:
    not a topic, not even in an import deferred into a function (chapter 11's pipeline hooks live in the core)."""
    assert [f"{i.source}:{i.line} imports {i.target}" for i in reaches_above_core(read_imports()[1])] == []


def test_deepspeed_is_imported_in_one_place():
    """Every DeepSpeed module the helpers use comes from :func:`helpers.core.ds.load`, which chooses the
    accelerator first; no other module imports DeepSpeed, by statement or by name."""
    _, imports = read_imports()
    assert [f"{i.source}:{i.line} imports {i.target}" for i in deepspeed_imports(imports)] == []
    dynamic = [f"{path.relative_to(REPO_ROOT)}:{line}" for path in sorted((REPO_ROOT / "helpers").rglob("*.py"))
               if module_name(path, REPO_ROOT) != DEEPSPEED_IMPORTER
               for line in dynamic_deepspeed_imports(ast.parse(path.read_text()))]
    assert dynamic == []
    assert DEEPSPEED_IMPORTER in read_imports()[0]


def test_the_core_names_no_topic_for_the_ranks_to_import():
    """Runs name topic code by import path; the core (and ``helpers/measure.py``) must never carry such a path
    (a string the ranks would import is an import all the same)."""
    named = []
    paths = [*sorted((REPO_ROOT / "helpers" / "core").rglob("*.py")), REPO_ROOT / "helpers" / "measure.py"]
    for path in paths:
        for node in _strings(ast.parse(path.read_text())):
            if "helpers.topics" in node.value or "helpers.tools" in node.value:
                named.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert named == []


def test_imports_inside_functions_are_deferred_on_purpose():
    """An import inside a function says why it is there (a comment on it or above its block); the course's
    own modules are imported at the top, except by the commands, which import only what a command needs."""
    _, imports = read_imports()
    silent = [f"{i.source}:{i.line} {i.target}" for i in imports if i.in_function and not i.commented]
    assert silent == []
    hidden = [f"{i.source}:{i.line} {i.target}" for i in internal(imports) if i.in_function
              and layer_of(i.source) != "entry"]
    assert hidden == []


def test_every_topic_has_a_chapter():
    modules, _ = read_imports()
    assert sorted({topic_of(m) for m in modules if topic_of(m)}) == sorted(TOPIC_CHAPTERS)


def test_a_topic_imports_only_its_own_and_earlier_chapters():
    assert [f"{i.source}:{i.line} imports {i.target} (chapter {TOPIC_CHAPTERS[topic_of(i.target)]})"
            for i in later_chapters(read_imports()[1])] == []


def test_a_chapter_imports_only_its_own_and_earlier_chapters_topics():
    found = []
    for notebook in sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        chapter = notebook.name.split("_")[0]
        found += [f"{notebook.name} imports {t} (chapter {TOPIC_CHAPTERS.get(t, '?')})"
                  for t in sorted(notebook_topics(notebook)) if TOPIC_CHAPTERS.get(t, "99") > chapter]
    assert found == []


def test_the_rules_catch_what_they_are_about(tmp_path):
    """A planted cycle, an upward import, a topic named by string and an unexplained deferred import are found."""
    (tmp_path / "helpers" / "core").mkdir(parents=True)
    (tmp_path / "helpers" / "topics").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "helpers" / "core" / "a.py").write_text("from helpers.topics import t\nX = 'helpers.topics.t:f'\n")
    (tmp_path / "helpers" / "topics" / "t.py").write_text("from helpers.core import a\n\ndef f():\n    import json\n")
    modules, imports = read_imports(tmp_path)
    assert cycles(modules, imports) == [["helpers.core.a", "helpers.topics.t"]]
    assert [(i.source, i.target) for i in upward(imports)] == [("helpers.core.a", "helpers.topics.t")]
    assert [i.target for i in imports if i.in_function and not i.commented] == ["json"]
    assert [n.value for n in _strings(ast.parse((tmp_path / "helpers/core/a.py").read_text()))] == ["helpers.topics.t:f"]
    (tmp_path / "helpers" / "topics" / "early.py").write_text("from helpers.topics import late\n")
    (tmp_path / "helpers" / "topics" / "late.py").write_text("from helpers.topics import early\n")
    _, imports = read_imports(tmp_path)
    assert [(i.source, i.target) for i in later_chapters(imports, {"t": "01", "early": "03", "late": "12b"})] == \
        [("helpers.topics.early", "helpers.topics.late")]
    (tmp_path / "helpers" / "measure.py").write_text(
        "import deepspeed.comm as dist\n\ndef f():\n    from helpers.topics import t  # deferred\n")
    (tmp_path / "helpers" / "core" / "b.py").write_text(
        "import importlib\n\ndef g():\n    from deepspeed.pipe import PipelineModule  # deferred\n"
        "    return importlib.import_module('deepspeed.comm')\n")
    (tmp_path / "helpers" / "core" / "ds.py").write_text("import importlib\nimport deepspeed\n")
    _, imports = read_imports(tmp_path)
    assert sorted((i.source, i.target) for i in reaches_above_core(imports)) == \
        [("helpers.core.a", "helpers.topics.t"), ("helpers.measure", "helpers.topics.t")]
    assert sorted((i.source, i.target) for i in deepspeed_imports(imports)) == \
        [("helpers.core.b", "deepspeed.pipe"), ("helpers.measure", "deepspeed.comm")]
    assert dynamic_deepspeed_imports(ast.parse((tmp_path / "helpers/core/b.py").read_text())) == [5]
    notebook = tmp_path / "09_x.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [
        "from helpers.topics import zero, bandwidth  # two\n", "from helpers.topics.capstone import BUILDER\n"]}]}))
    assert notebook_topics(notebook) == {"zero", "bandwidth", "capstone"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The import structure of helpers/: modules, cycles, imports.")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="a checkout (default: this one)")
    for key, value in report(parser.parse_args().root).items():
        print(f"{key:25} {value}")
    sys.exit(0)
