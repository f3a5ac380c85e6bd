"""helpers.core.ds: the one place the helpers import DeepSpeed, and every module and name they ask it for.

Many ``ds.load`` calls sit in branches this CPU never runs (``if env.is_gpu``, a GPU-only optimizer, a rank of a
pipeline): :func:`load_sites` finds them all in the source, so a misspelt module or name fails here, not on a GPU.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import subprocess
import sys

import pytest

from helpers.core import ds
from helpers.core.environment import REPO_ROOT

#: The DeepSpeed the course pins (requirements.txt): the names below are checked against it.
PINNED = "0.19.8"


@dataclasses.dataclass(frozen=True)
class Site:
    where: str  # "helpers/core/probes.py:303"
    module: str | None  # None: not a string the source states
    names: tuple[str, ...]  # attributes the code reads from the loaded module


def _is_load(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "ds")


def load_sites(source: str, where: str) -> list[Site]:
    """Every ``ds.load(...)`` in ``source``: the module it names and the names read from it, either at once
    (``ds.load("m").Name``) or from the variable it is assigned to in the same function (``m = ds.load("m")``,
    then ``m.name``)."""
    tree = ast.parse(source)
    parent = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[tuple[int, int, Site]] = []
    for node in ast.walk(tree):
        if not _is_load(node):
            continue
        if not node.args:
            module = "deepspeed"
        elif isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            module = node.args[0].value
        else:
            module = None
        names: list[str] = []
        above = parent.get(id(node))
        if isinstance(above, ast.Attribute) and above.value is node:
            names.append(above.attr)
        elif isinstance(above, ast.Assign) and len(above.targets) == 1 and isinstance(above.targets[0], ast.Name):
            variable = above.targets[0].id
            scope = above
            while not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                scope = parent[id(scope)]
            names += [n.attr for n in ast.walk(scope) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == variable]
        found.append((node.lineno, node.col_offset, Site(f"{where}:{node.lineno}", module, tuple(dict.fromkeys(names)))))
    return [site for *_, site in sorted(found, key=lambda entry: entry[:2])]


def unresolved(sites: list[Site]) -> list[str]:
    """What of ``sites`` does not exist in the installed DeepSpeed: a module that does not import, a name it lacks."""
    problems = []
    for site in sites:
        if site.module is None:
            problems.append(f"{site.where}: ds.load of a module the source does not name")
            continue
        try:
            module = importlib.import_module(site.module)
        except ImportError as error:
            problems.append(f"{site.where}: {site.module} does not import ({error})")
            continue
        problems += [f"{site.where}: {site.module} has no {name!r}" for name in site.names if not hasattr(module, name)]
    return problems


def all_sites() -> list[Site]:
    return [site for path in sorted((REPO_ROOT / "helpers").rglob("*.py"))
            for site in load_sites(path.read_text(), str(path.relative_to(REPO_ROOT)))]


def test_every_module_and_name_the_helpers_load_exists_in_the_pinned_deepspeed():
    assert ds.load().__version__ == PINNED
    sites = all_sites()
    assert len(sites) > 50  # the finder sees the helpers' calls (about a hundred)
    assert sum(len(site.names) for site in sites) > len(sites)  # and the names read from them
    assert unresolved(sites) == []


def test_the_finder_reports_a_misspelt_module_or_name():
    source = '''
from helpers.core import ds

def f(name):
    dist = ds.load("deepspeed.comm")
    dist.get_rank()
    dist.get_rnak()
    ds.load("deepspeed.runtime.zero.config").DeepSpeedZeroConfig
    ds.load("deepspeed.pipe").PipelineModul
    ds.load("deepspeed.no_such_module")
    ds.load(name)
    return ds.load().__version__
'''
    sites = load_sites(source, "x.py")
    assert [(s.module, s.names) for s in sites] == [
        ("deepspeed.comm", ("get_rank", "get_rnak")), ("deepspeed.runtime.zero.config", ("DeepSpeedZeroConfig",)),
        ("deepspeed.pipe", ("PipelineModul",)), ("deepspeed.no_such_module", ()), (None, ()), ("deepspeed", ("__version__",))]
    problems = unresolved(sites)
    assert [p.split(":")[1].split(" ")[0] for p in problems] == ["5", "9", "10", "11"]
    assert "'get_rnak'" in problems[0] and "'PipelineModul'" in problems[1]


def test_load_names_deepspeed_modules_only():
    with pytest.raises(ValueError, match="name a DeepSpeed module"):
        ds.load("torch")
    with pytest.raises(ValueError):
        ds.load("deepspeedx")
    assert ds.load("deepspeed.comm") is sys.modules["deepspeed.comm"]


def test_choose_accelerator_says_cpu_without_a_gpu_and_keeps_a_choice_made(monkeypatch):
    import torch

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ds.choose_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    ds.choose_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ds.choose_accelerator()
    assert "DS_ACCELERATOR" not in os.environ


def test_importing_every_helpers_module_imports_no_deepspeed():
    """DeepSpeed is imported when a function needs it, after the accelerator is chosen: never by an import."""
    script = ("import importlib, pkgutil, sys, helpers\n"
              "names = [m.name for m in pkgutil.walk_packages(helpers.__path__, 'helpers.') if m.name != 'helpers.__main__']\n"
              "for name in names: importlib.import_module(name)\n"
              "print(len(names), sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    count, modules = result.stdout.split(" ", 1)
    assert int(count) > 40 and modules.strip() == "[]"

