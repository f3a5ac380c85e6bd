"""A new topic is one module: its own probe and summary key, a run that names the probe, and its record read
back, without touching any file of ``helpers/`` (the README's "Adding a chapter" walks the same steps).

The topic module is written into a temporary folder on ``PYTHONPATH``; one launch of 2 CPU ranks trains two
runs in it: one with the topic's probe, one with a probe that declares a key it never writes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.core import launch, records
from helpers.core.environment import REPO_ROOT, WORLD_SIZE_VARIABLE

TOPIC = textwrap.dedent('''
    """A toy topic: how many micro-steps each rank saw, and the largest gradient norm."""

    import torch

    from helpers.core import launch
    from helpers.core.probes import Probe, RunContext


    class GradNorms(Probe):
        """The gradient norm after every backward, on every rank. Section ``grad_norms``."""

        name = "grad_norms"
        keys = ("grad_norms.per_rank", "grad_norms.micro_steps")

        def start(self, ctx: RunContext) -> None:
            self.norms = []

        def after_backward(self, ctx: RunContext, step: int, micro_step: int) -> None:
            grads = [p.grad for p in ctx.engine.module.parameters() if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0)

        def finish(self, ctx: RunContext) -> dict:
            return {"norms": self.norms}

        def combine(self, ranks: list, ctx: RunContext) -> dict:
            return {"grad_norms": {"per_rank": [r["norms"] for r in ranks], "micro_steps": len(ranks[0]["norms"])}}


    class Forgetful(Probe):
        """Declares a key it never writes."""

        name = "forgetful"
        keys = ("forgetful.value",)


    def runs(folder) -> dict:
        spec = lambda name, probe: launch.RunSpec("zero0", model="linear", steps=3, name=name, out=folder / name,
                                                  probes=("timing", probe), on_error="record",
                                                  overrides={"gradient_accumulation_steps": 2,
                                                             "train_micro_batch_size_per_gpu": 2})
        return launch.sweep({"norms": spec("norms", GradNorms), "forgetful": spec("forgetful", Forgetful)},
                            name=f"toy-topic-{folder.name}", world_size=2, progress=False)
''')


@pytest.fixture(scope="module")
def topic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy_topic")
    (folder / "toy_topic.py").write_text(TOPIC)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(WORLD_SIZE_VARIABLE, raising=False)
        mp.setenv("PYTHONPATH", str(folder))  # the ranks import the topic by its path, as the course's own
        mp.syspath_prepend(str(folder))
        import toy_topic

        yield toy_topic, toy_topic.runs(folder), folder


def test_a_topic_probe_writes_its_own_section_and_the_record_names_it(topic):
    toy, found, _ = topic
    record = found["norms"]
    assert isinstance(record, records.Record), record
    assert record.probes == ["timing", "grad_norms"]
    assert record.summary["probe_keys"]["grad_norms"] == ["grad_norms.per_rank", "grad_norms.micro_steps"]
    section = record.section("grad_norms")
    assert section["micro_steps"] == 3 * 2  # every backward of 3 steps x 2 micro-steps
    assert len(section["per_rank"]) == 2 and all(n > 0 for n in section["per_rank"][0])
    # the plan names the topic's probe by its import path: the core never imported the topic
    plan = Path(record.summary["launch"]["plan"]).read_text()
    assert '"toy_topic:GradNorms"' in plan


def test_a_probe_that_forgets_a_key_it_declared_fails_its_run_naming_it(topic):
    _, found, _ = topic
    failure = found["forgetful"]
    assert isinstance(failure, launch.RunFailed)
    assert "declares keys ['forgetful.value'] but did not write them" in str(failure)


def test_a_probe_that_is_not_a_probe_is_refused_before_any_process_starts(topic, monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="'toy_topic:runs': .* is not a Probe class"):
        launch.run("zero2", probes=("toy_topic:runs",), world_size=2)
    with pytest.raises(ValueError, match="not a core probe"):
        launch.run("zero2", probes=("grad_norms",), world_size=2)


def test_the_import_graph_report_runs_as_a_command():
    shown = subprocess.run([sys.executable, "tests/test_architecture.py"], capture_output=True, text=True,
                           cwd=REPO_ROOT, check=True).stdout
    assert "cycles                    []" in shown and "upward imports            0" in shown
