"""Chapter 13's GPU runs: the page script (``runs/13/train_zeropp.py``, written by the notebook) reads the
arguments of every GPU pass into the GPU configs, and the passes' records come back labelled for the tables and the
reference file. This CPU cannot run the GPU branch: these tests check what it hands the script and reads back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import measure
from helpers.core import configs, ds, environment, launch, probes, records, references
from helpers.topics import compression

NOTEBOOK = environment.REPO_ROOT / "notebooks" / "13_zeropp_compression.ipynb"
WRITEFILE = "%%writefile ../runs/13/train_zeropp.py"


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    """The chapter's script as its %%writefile cell writes it, imported as a module (its launch code does not run)."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith(WRITEFILE))
    path = tmp_path_factory.mktemp("page") / "train_zeropp.py"
    path.write_text(source.split("\n", 1)[1])
    ds.choose_accelerator()  # the page script imports deepspeed itself
    spec = importlib.util.spec_from_file_location("train_zeropp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_launch_trains_every_setting_with_the_default_probes(script):
    args = script.parse_args(["--out", "runs/13"])
    planned = script.planned_runs(args, ranks_per_node=2)
    assert [name for name, _ in planned] == list(compression.LABELS)  # the labels the tables give them
    assert (args.model, args.steps, args.probes) == ("mlp", 4, list(measure.PROBES))
    plain = dict(planned)["zero3"]
    assert plain == script.ZERO3 and "bf16" not in plain
    assert dict(planned)["hpz"]["zero_optimization"]["zero_hpz_partition_size"] == 2


def test_every_gpu_pass_parses_into_the_gpu_configs_deepspeed_reads(script, tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(compression.gpu_config()))
    passes = compression.gpu_passes()
    assert [p.name for p in passes] == ["time", "bytes", "logger"]
    for one in passes:
        args = script.parse_args(one.args(config=config_file, out=tmp_path / one.name))
        assert (args.model, args.steps, args.out) == (compression.GPU_MODEL, one.steps, str(tmp_path / one.name))
        planned = script.planned_runs(args, ranks_per_node=4)
        assert [name for name, _ in planned] == list(one.settings)
        for name, config in planned:
            assert config["bf16"] == {"enabled": True} and config["train_micro_batch_size_per_gpu"] == 16
            zero = configs.zero_section(config["zero_optimization"])  # DeepSpeed's own config class
            assert zero.stage == 3 and zero.max_live_parameters == 0 and zero.param_persistence_threshold == 0
            assert zero.zero_quantized_weights == (name in ("qwz", "zeropp"))
            assert zero.zero_hpz_partition_size == (4 if name in ("hpz", "zeropp") else 1)
            assert zero.zero_quantized_gradients == (name in ("qgz", "zeropp"))
            merged = measure.configure(config, args.probes)  # what the script hands deepspeed.initialize
            assert merged.get("comms_logger", {}).get("enabled", False) == ("comm" in args.probes)
        assert all(probes.resolve_probe(p) for p in args.probes)
    time, counted, logged = passes
    assert time.settings[-1] == "zero3-again" and "comm" not in time.probes  # nothing that synchronizes the device
    assert compression.TORCH_COMM in counted.probes and counted.steps < time.steps
    assert logged.settings == compression.LOGGER_CHECKS and logged.steps == compression.LOGGER_STEPS


def test_deepspeeds_default_knobs_reach_every_gpu_run(script, tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(compression.gpu_config(zero_knobs=compression.DEEPSPEED_DEFAULTS)))
    args = script.parse_args(compression.gpu_passes()[0].args(config=config_file, out=tmp_path))
    for _, config in script.planned_runs(args, ranks_per_node=2):
        assert config["zero_optimization"]["stage3_max_live_parameters"] == 1_000_000_000


def _record(folder: Path, name: str, **changes) -> None:
    from test_records import minimal_summary

    (folder / name).mkdir(parents=True)
    (folder / name / "summary.json").write_text(json.dumps({**minimal_summary(), "device": "cuda",
                                                            "device_name": "GPU", "name": name, **changes}))


def test_gpu_results_label_every_pass_and_keep_what_did_not_train(tmp_path):
    for name in ("zero3", "hpz", "zero3-again"):
        _record(tmp_path / "time", name)
    (tmp_path / "time" / "qwz").mkdir()
    (tmp_path / "time" / "qwz" / "refused.json").write_text(json.dumps(
        {"type": "ValueError", "message": "no kernel", "traceback": "Traceback\n  line\nValueError: no kernel"}))
    _record(tmp_path / "bytes", "zero3")
    stopped = launch.RunFailed("train_zeropp.py ran past its timeout of 600 s: stopped", log_tail="a\nb\n")
    by_bytes, by_time = compression.gpu_results(tmp_path, failed={"bytes": stopped, "logger": stopped})
    assert list(by_time) == ["ZeRO-3", "qwZ (quantized weights)", "hpZ (node-local partition)", compression.AGAIN]
    assert by_time["qwZ (quantized weights)"]["error_type"] == "ValueError"
    assert by_time["qwZ (quantized weights)"]["where"][-1] == "ValueError: no kernel"
    assert isinstance(by_bytes["ZeRO-3"], records.Record)
    assert by_bytes["ZeRO++ (all three)"]["message"] == str(stopped) and by_bytes["ZeRO++ (all three)"]["where"] == ["a", "b"]
    assert "ZeRO-3, comms logger" in by_bytes  # the logger pass's launch failed before its run
    table = compression.both_tables(by_bytes, by_time)
    assert "failed: ValueError: no kernel" in table and "failed: RunFailed: train_zeropp.py ran past" in table
    assert compression.gpu_results(tmp_path / "nothing") == ({}, {})


def test_a_saved_gpu_reference_reads_back_as_the_committed_ones_do(tmp_path, monkeypatch):
    _record(tmp_path / "run" / "time", "zero3", config={"zero_optimization": {"stage3_max_live_parameters": 0}})
    _record(tmp_path / "run" / "bytes", "zero3")
    by_bytes, by_time = compression.gpu_results(tmp_path / "run", failed={"time": RuntimeError("rank 1 died")})
    monkeypatch.setattr(references, "NEW_REFERENCE_DIR", tmp_path / "new")
    monkeypatch.setattr(references, "REFERENCE_DIR", tmp_path / "new")
    saved = compression.save_gpu_reference(by_bytes, by_time, note="test", load=None)
    assert saved is not None and saved.name == "zeropp-2xGPU.json"
    kept = json.loads(saved.read_text())["runs"]
    assert "bytes: ZeRO-3" in kept and kept["time: qwZ (quantized weights)"]["error_type"] == "RuntimeError"
    report = compression.reference_report()
    assert report.startswith("Measured on 2 x GPU") and "failed: RuntimeError: rank 1 died" in report
    nothing_trained = {"ZeRO-3": {"error_type": "RunFailed", "message": "stopped", "device": "cuda"}}
    assert compression.save_gpu_reference(nothing_trained, nothing_trained, note="test") is None
