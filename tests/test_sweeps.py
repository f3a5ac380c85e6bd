"""helpers.core.launch.sweep: several runs in the ranks of one launch give the records their own launches give."""

from __future__ import annotations

import pytest

from helpers.core import launch, records
from helpers.core.environment import WORLD_SIZE_VARIABLE


@pytest.fixture(autouse=True)
def _two_ranks(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)


def _comparable(record: records.Record) -> dict:
    """What must not depend on how the run was launched: losses, model states, collectives."""
    s = record.summary
    return {"losses": s["losses"], "losses_per_rank": s["losses_per_rank"],
            "model_states": s["memory"]["model_states_bytes_per_rank"],
            "at_boundary": s["memory"]["model_states_at_boundary_bytes_per_rank"],
            "comm_by_op": s["comm"]["by_op"], "comm_by_caller": s["comm"]["by_caller"],
            "wire": s["comm"]["wire_bytes_per_step"], "optimizer": (s["optimizer"], s["basic_optimizer"]),
            "theory": s["theory"]}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    # stage 3 and stage 1 come after other runs in the same processes, where leftovers would show
    specs = {f"zero{s}": launch.RunSpec(f"zero{s}", model="mlp", steps=3, out=folder / f"zero{s}")
             for s in (0, 2, 3, 1)}
    # and a run that asks for one probe only: it records only that (no comms logger in its config either)
    specs["timing-only"] = launch.RunSpec("zero1", model="linear", steps=2, probes=("timing",),
                                          out=folder / "timing-only")
    return launch.sweep(specs, name=f"test-sweep-{folder.name}", world_size=2, progress=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_swept_run_has_the_record_of_its_own_launch(swept, stage, tmp_path):
    alone = launch.run(f"zero{stage}", model="mlp", steps=3, world_size=2, out=tmp_path / "alone", progress=False)
    assert _comparable(swept[f"zero{stage}"]) == _comparable(alone)


def test_every_run_of_a_sweep_has_its_own_folder_and_record(swept):
    assert list(swept) == ["zero0", "zero2", "zero3", "zero1", "timing-only"]
    for position, (name, record) in enumerate(swept.items(), start=1):
        assert isinstance(record, records.Record)
        assert record.stage == (1 if name == "timing-only" else int(name[-1]))
        assert record.out.name == name and (record.out / "ds_config.json").exists()
        assert record["launch"]["position"] == position and record["launch"]["of"] == 5
        assert record.wall_s is not None and record.wall_s > 0


def test_a_run_records_only_what_its_probes_measure(swept):
    record = swept["timing-only"]
    assert record.summary["probes"] == ["timing"]
    assert "memory" not in record.summary and "comm" not in record.summary
    assert len(record["step_time_s.all"]) == 2
    assert "comms_logger" not in record.summary["config"]  # the comm probe was not asked for


def test_a_sweep_refuses_two_runs_of_one_name(tmp_path, monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="more than once"):
        launch.sweep([launch.RunSpec("zero0", name="a"), launch.RunSpec("zero1", name="a")], world_size=2)


def test_a_bad_config_anywhere_in_a_sweep_stops_it_before_any_process_starts(tmp_path, monkeypatch):
    from helpers.core import configs

    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(configs.ConfigError, match="second"):
        launch.sweep({"first": launch.RunSpec("zero0"),
                      "second": launch.RunSpec("zero0", overrides={"train_batch_size": 7})}, world_size=2)
