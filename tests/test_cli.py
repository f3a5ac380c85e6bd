"""The command line instructors use: `python -m helpers run` writes a record and prints a summary."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from helpers.core import records
from helpers.core.environment import REPO_ROOT


def test_run_command_writes_summary_and_prints_it(tmp_path):
    out = tmp_path / "zero2-cli"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "helpers", "run", "zero2", "--model", "mlp", "--steps", "2",
                             "--world-size", "2", "--out", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    records.validate(summary)
    assert summary["zero_stage"] == 2 and summary["world_size"] == 2 and summary["steps"] == 2
    assert "ZeRO-2 fp32, mlp (526,336 params), 2 x cpu (gloo)" in result.stdout
    assert "losses (mean over ranks" in result.stdout
    assert "sent per rank per step (ring):" in result.stdout and "paper" in result.stdout
    # a ZeRO-2 run on 2 CPU ranks writes its record in under 20 s once ops are built
    assert seconds < 20, f"took {seconds:.1f} s"


def test_an_offloading_config_records_which_bytes_live_on_the_host(tmp_path):
    """No probe named: the config decides them, and a config that offloads gets the placement probe."""
    config = tmp_path / "offload.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    out = tmp_path / "offload-cli"
    result = subprocess.run([sys.executable, "-m", "helpers", "run", str(config), "--model", "mlp", "--steps", "2",
                             "--world-size", "2", "--out", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    record = records.load(out)
    assert "placement" in record.probes
    where = record.memory.placement(0)
    # ZeRO-Offload: Adam's states, the fp32 master and the gradient partition on the host; the weights stay
    assert where.host.optimizer == record.memory.model_states(0).optimizer > 0 and where.accelerator.optimizer == 0
    assert where.host.master > 0 and where.host.grads > 0 and where.accelerator.params > 0 and where.host.params == 0
    assert "on the accelerator side:" in result.stdout and "on the host side:" in result.stdout


def test_run_command_reports_a_bad_config_without_launching(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 1}))
    out = tmp_path / "never"
    result = subprocess.run([sys.executable, "-m", "helpers", "run", str(bad), "--world-size", "2", "--out", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "train_batch_size" in result.stderr and "fix:" in result.stderr
    assert not out.exists()


def test_the_course_package_is_importable_from_any_folder(tmp_path):
    # helpers is installed into the course's environment (pip install -e .): no sys.path edits needed
    result = subprocess.run([sys.executable, "-m", "helpers", "env"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "backend" in result.stdout
