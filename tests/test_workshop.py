"""The workshop: GPUs chosen per learner, DeepSpeed's multi-node runner, the instructor's notebook check,
the offline set-up, the reference script and the device runner's wheels. No launch here but the notebook
check's two tiny kernels (the multi-node launch is tests/test_multinode.py)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers.core import environment, launch, references
from helpers.tools import notebooks
from helpers import course
from helpers.core.environment import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import device_run  # noqa: E402
import reference  # noqa: E402
import wheels  # noqa: E402


def _env(gpus: int = 0, ids: tuple[int, ...] = ()) -> environment.Environment:
    return environment.Environment(
        device="cuda" if gpus else "cpu", device_name="test", gpu_count=gpus, cpu_cores=2,
        backend="nccl" if gpus else "gloo", default_world_size=max(gpus, 2), world_size_source="test",
        precisions=("fp32", "bf16"), torch_version="0", deepspeed_version="0", gpu_ids=ids)


# --- choosing GPUs on a shared box ---------------------------------------------------------------

@pytest.mark.parametrize("visible, course_gpus, cuda_visible, ids, indices", [
    (4, None, None, (0, 1, 2, 3), (0, 1, 2, 3)),
    (4, "2,3", None, (2, 3), (2, 3)),
    (2, None, "2,3", (2, 3), (0, 1)),  # torch sees 2 GPUs; DeepSpeed's launcher is told 2 and 3
    (2, "3", "2,3", (3,), (1,)),
    (0, None, None, (), ()),
])
def test_select_gpus(visible, course_gpus, cuda_visible, ids, indices):
    chosen, torch_indices, _ = environment.select_gpus(visible, course_gpus, cuda_visible)
    assert (chosen, torch_indices) == (ids, indices)


@pytest.mark.parametrize("course_gpus, cuda_visible, words", [
    ("0,x", None, "COURSE_GPUS"), ("1,1", None, "twice"), ("5", None, "not among"),
    ("0", "2,3", "not among"), (None, "GPU-5d2c", "CUDA_VISIBLE_DEVICES"),
])
def test_select_gpus_names_the_bad_variable(course_gpus, cuda_visible, words):
    with pytest.raises(ValueError, match=words):
        environment.select_gpus(4, course_gpus, cuda_visible)


def test_child_env_hands_cuda_visible_devices_to_deepspeeds_launcher():
    child, changes = environment.child_env(_env(2, (2, 3)), 2, base={"CUDA_VISIBLE_DEVICES": "2,3", "NCCL_X": "1"})
    assert "CUDA_VISIBLE_DEVICES" not in child and child["NCCL_X"] == "1"
    assert any("CUDA_VISIBLE_DEVICES=2,3" in c for c in changes)


def test_launch_passes_the_chosen_gpus_to_deepspeed_as_it_expects(tmp_path):
    argv = launch.command(tmp_path / "plan.json", 2, 29500, "launch", gpu_ids=(2, 3))
    info = next(a for a in argv if a.startswith("--world_info="))
    assert json.loads(base64.urlsafe_b64decode(info.split("=", 1)[1])) == {"localhost": [2, 3]}
    argv = launch.command(tmp_path / "plan.json", 2, 29500, "deepspeed", gpu_ids=(2, 3))
    assert argv[argv.index("--include") + 1] == "localhost:2,3" and "--num_gpus" not in argv
    argv = launch.command(tmp_path / "plan.json", 2, 29500, "deepspeed")  # CPU ranks
    assert argv[argv.index("--num_gpus") + 1] == "2"


# --- several machines: DeepSpeed's hostfile, --include/--exclude ---------------------------------

@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# two machines\nnode-a slots=2\nnode-b slots=2\n")
    return path


def test_hosts_read_by_deepspeeds_own_parser(hostfile):
    assert launch.Hosts(hostfile).resources() == {"node-a": [0, 1], "node-b": [0, 1]}
    assert launch.Hosts(hostfile, include="node-a:1@node-b").resources() == {"node-a": [1], "node-b": [0, 1]}
    assert launch.Hosts(hostfile, exclude="node-b:0").world_size() == 3


def test_hosts_errors_name_the_problem(hostfile, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        launch.Hosts(tmp_path / "missing").resources()
    with pytest.raises(ValueError, match="not both"):
        launch.Hosts(hostfile, include="node-a", exclude="node-b").resources()
    with pytest.raises(ValueError, match="node-c"):
        launch.Hosts(hostfile, include="node-c").resources()
    bad = tmp_path / "bad"
    bad.write_text("node-a slots=two\n")
    with pytest.raises(ValueError, match="bad entry"):
        launch.Hosts(bad).resources()


def test_multi_node_command_is_deepspeeds_runner(hostfile, tmp_path):
    hosts = launch.Hosts(hostfile, include="node-a@node-b:0", master_addr="10.0.0.1", ssh_port=2222)
    argv = launch.command(tmp_path / "plan.json", 3, 29500, "deepspeed", hosts=hosts)
    assert argv[1:4] == ["-u", "-m", "deepspeed.launcher.runner"]
    for flag, value in (("--hostfile", str(hostfile.resolve())), ("--launcher", "pdsh"), ("--include", "node-a@node-b:0"),
                        ("--master_addr", "10.0.0.1"), ("--ssh_port", "2222"), ("--master_port", "29500")):
        assert argv[argv.index(flag) + 1] == value
    with pytest.raises(ValueError, match="launcher='deepspeed'"):
        launch.command(tmp_path / "plan.json", 3, 29500, "launch", hosts=hosts)


def test_variables_the_runner_would_not_forward_go_through_its_env_file(tmp_path):
    path = launch.write_host_env({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HOME": "/root"}, tmp_path / "env")
    assert path.read_text().splitlines() == ["DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1"]


def test_pdsh_host_prefix_is_stripped_before_events_are_read():
    line = launch._HOST_PREFIX.sub("", 'node-a: @@course {"event": "step", "run": 0}\n', count=1)
    text, events = launch.parse_events(line)
    assert events == [{"event": "step", "run": 0}] and not text.strip()


def test_multi_node_needs_pdsh(hostfile, monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="pdsh"):
        launch.run("zero0", hosts=launch.Hosts(hostfile), progress=False)


# --- the instructor's check of a box, and the offline set-up --------------------------------------

def test_check_notebooks_names_the_failing_cell(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    good, bad = tmp_path / "01_good.ipynb", tmp_path / "02_bad.ipynb"
    verdicts = ("from helpers.core import load_guard\n"  # one verdict given, one withheld: the report counts them
                "load_guard.compare({'a': [1.0, 1.01, 1.0], 'b': [2.0, 2.02, 2.01]}, load_guard.Load('cpu', 0, 0.0, 2, 1.0, 2, 't'))\n"
                "load_guard.compare({'a': [1.0], 'b': [2.0]}, load_guard.Load.unknown())")
    nbformat.write(new_notebook(cells=[new_code_cell("print('fine')"), new_code_cell(verdicts)]), good)
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("1 / 0"), new_code_cell("x")]), bad)
    # a float timeout, as benchmarks/reference.py gives what is left of its budget (nbclient takes whole seconds)
    results = course.check_notebooks(sys.executable, [good, bad], jobs=2, timeout=60.5, out=tmp_path / "out")
    assert [r["ok"] for r in results] == [True, False]
    assert results[1]["cell"] == 1 and "ZeroDivisionError" in results[1]["error"]
    assert results[0]["verdicts"] == {"given": 1, "withheld": 1} and results[1]["verdicts"] == {"given": 0, "withheld": 0}
    executed = nbformat.read(tmp_path / "out" / "01_good" / "01_good.ipynb", as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "fine\n"


def test_a_notebook_stopped_from_outside_is_reported_as_stopped_not_failed(tmp_path):
    import signal
    import subprocess
    import time

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    slow = tmp_path / "03_slow.ipynb"
    stored = new_code_cell("print('stored on another machine')", execution_count=3,
                           outputs=[nbformat.v4.new_output("stream", text="stored on another machine\n")])
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("import time; time.sleep(120)"), stored]),
                   slow)
    process = subprocess.Popen([sys.executable, "-m", "helpers.tools.notebooks", str(slow), "--out", str(tmp_path / "out")],
                               cwd=REPO_ROOT)
    time.sleep(8)  # the kernel is up and in the second cell (a job's deadline comes as SIGTERM)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 1
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    # the cell that was running, not the last one with a stored execution count; the cell never reached is empty
    assert result["stopped"] is True and result["ok"] is False and result["cell"] == 1
    assert "no verdict" in result["error"]
    executed = nbformat.read(tmp_path / "out" / slow.name, as_version=4)
    assert executed.cells[2].outputs == [] and executed.cells[2].execution_count is None
    assert course._verdict(result) == "STOPPED"


def test_a_check_stopped_by_its_deadline_still_writes_its_report(tmp_path):
    """device_run.py ends a check at its deadline with SIGTERM to the process group: the report must say
    which notebook was stopped and which never started, rather than not exist."""
    import os
    import signal
    import subprocess
    import time

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    slow, later = tmp_path / "01_slow.ipynb", tmp_path / "02_later.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("import time; time.sleep(120)")]), slow)
    nbformat.write(new_notebook(cells=[new_code_cell("print('never')")]), later)
    out = tmp_path / "check"
    process = subprocess.Popen([sys.executable, "-m", "helpers.course", "check-gpu", "--no-setup", "--jobs", "1",
                                "--out", str(out), str(slow), str(later)], cwd=REPO_ROOT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (out / "01_slow.log").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(8)  # the kernel is up and in the sleeping cell
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(30) == 1
    report = json.loads((out / "report.json").read_text())
    verdicts = {r["notebook"]: (course._verdict(r), r["error"]) for r in report["notebooks"]}
    assert verdicts["01_slow.ipynb"][0] == "STOPPED" and "no verdict" in verdicts["01_slow.ipynb"][1]
    assert verdicts["02_later.ipynb"] == ("STOPPED", "not started: the check was stopped (SIGTERM) first")


def test_the_capstone_runs_alone_in_the_check():
    assert notebooks.is_exclusive(REPO_ROOT / "notebooks" / "16_capstone.ipynb")
    assert not any(notebooks.is_exclusive(p) for p in notebooks.course_notebooks() if not p.name.startswith("16"))


def test_setup_from_a_wheelhouse_never_reaches_the_index(tmp_path, monkeypatch):
    (tmp_path / "wheelhouse").mkdir()
    (tmp_path / "wheelhouse" / "x-1-py3-none-any.whl").write_bytes(b"")
    calls = []
    monkeypatch.setattr(course, "_run", calls.append)
    monkeypatch.setattr(course, "STAMP", tmp_path / "stamp")
    course.set_up("python", tmp_path / "wheelhouse")
    pip_calls = [c for c in calls if "pip" in c]
    assert len(pip_calls) == 2
    for argv in pip_calls:
        assert argv[argv.index("--find-links") + 1] == str(tmp_path / "wheelhouse") and "--no-index" in argv
    ops = [c for c in calls if "pip" not in c]  # the ops and the report of what the course uses: one Python
    assert len(ops) == 1 and "main(['build-ops'])" in ops[0][-1] and "main(['env'])" in ops[0][-1]


def test_empty_wheelhouse_says_how_to_fill_it(tmp_path):
    with pytest.raises(SystemExit, match="pip download -r requirements.txt"):
        course.pip_source(tmp_path)


# --- reference results and the device runner's wheels ---------------------------------------------

def test_reference_script_runs_the_chapters_that_keep_gpu_results():
    names = [p.name[:2] for p in reference.reference_notebooks()]
    assert {"03", "04", "05"} <= set(names) and "16" not in names


def test_references_carry_hardware_and_conditions(tmp_path, monkeypatch):
    monkeypatch.setattr(references, "NEW_REFERENCE_DIR", tmp_path)
    monkeypatch.setattr(environment, "hardware", lambda env=None: {"interconnect": "GPU0 X NV18"})
    monkeypatch.setenv(references.CONDITIONS_VARIABLE, "alone")
    path = references.save_reference("demo", {"a": {"device": "cuda", "world_size": 2, "device_name": "NVIDIA H100"}})
    payload = json.loads(path.read_text())
    assert path.name == "demo-2xNVIDIA-H100.json"
    assert payload["hardware"]["interconnect"] == "GPU0 X NV18" and payload["conditions"] == "alone"
    assert {"torch", "deepspeed"} <= set(payload["software"])


def _fake_wheel(folder: Path, name: str, requires: list[str]) -> None:
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", "Name: x\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_wheels_check_finds_requirements_neither_carried_nor_in_the_image(tmp_path):
    _fake_wheel(tmp_path, "nbval", ["pytest>=7", "ipykernel", "colorama; sys_platform == 'win32'", "sphinx; extra == 'doc'"])
    _fake_wheel(tmp_path, "ipykernel", ["tornado>=6", "packaging"])
    assert wheels.unmet(tmp_path) == {"ipykernel-1.0-py3-none-any.whl": ["tornado"]}


@pytest.mark.parametrize("argv", [["lab", "--help"], ["setup", "-h"], ["check-gpu", "--help"], ["test", "-h"]])
def test_help_comes_before_any_set_up(argv, monkeypatch, capsys):
    monkeypatch.setattr(course, "set_up", lambda *a: pytest.fail("set up before showing help"))
    assert course.main(argv) == 0 and "check-gpu [--jobs N]" in capsys.readouterr().out


@pytest.mark.parametrize("task", ["check", "capstone"])
def test_device_runner_shows_help_before_installing_anything(task, monkeypatch, capsys):
    monkeypatch.setattr(device_run, "install_wheels", lambda: pytest.fail("installed before showing help"))
    assert device_run.main([task, "--help"]) == 0
    assert device_run.TASK_HELP[task] in capsys.readouterr().out


def _deepspeed_wheel(folder: Path, ops: dict, torch_version: str = "2.11", cuda: str = "13.0", arch: str = "9.0",
                     name: str = "deepspeed-0.19.8-cp312-cp312-linux_x86_64.whl") -> Path:
    """A DeepSpeed wheel as DeepSpeed's setup.py records its compiled ops, and the record device_run leaves."""
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / name, "w") as z:
        z.writestr("deepspeed/git_version_info_installed.py",
                   f"version='0.19.8'\ninstalled_ops={ops!r}\naccelerator_name='cuda'\n"
                   f"torch_info={{'version': '{torch_version}', 'cuda_version': '{cuda}', 'hip_version': '0.0'}}\n")
    (folder / f"{name[:-4]}-{device_run.OPS_RECORD}").write_text(json.dumps({"wheel": name, "arch": arch}))
    return folder / name


def test_a_prebuilt_deepspeed_wheel_is_used_only_on_a_machine_it_was_built_for(tmp_path):
    machine = {"torch": "2.11", "cuda": "13.0", "arch": "9.0", "ops": ["quantizer", "fused_adam"]}
    wheel = _deepspeed_wheel(tmp_path, {"quantizer": 1, "fused_adam": 1, "cpu_adam": False})
    assert device_run.wheel_ops(wheel) == ({"quantizer", "fused_adam"}, {
        "version": "2.11", "cuda_version": "13.0", "hip_version": "0.0"})
    assert device_run.usable_prebuilt(tmp_path, machine) == wheel
    assert device_run.usable_prebuilt(tmp_path, {**machine, "ops": ["quantizer", "cpu_adam"]}) is None  # not compiled
    assert device_run.usable_prebuilt(tmp_path, {**machine, "torch": "2.12"}) is None  # DeepSpeed would refuse it
    assert device_run.usable_prebuilt(tmp_path, {**machine, "cuda": "12.8"}) is None
    assert device_run.usable_prebuilt(tmp_path, {**machine, "arch": "8.0"}) is None  # no kernels for that GPU


def test_the_ops_wheel_is_built_with_exactly_the_named_ops_for_the_ranks_architectures():
    machine = {"arch": "9.0", "build_vars": ["DS_BUILD_QUANTIZER", "DS_BUILD_FUSED_ADAM"]}
    env = device_run.build_env(machine, {"TORCH_CUDA_ARCH_LIST": "9.0a", "NCCL_NVLS_ENABLE": "0", "DS_BUILD_OPS": "1"})
    assert env == {"TORCH_CUDA_ARCH_LIST": "9.0", "NCCL_NVLS_ENABLE": "0", "DS_BUILD_OPS": "0",
                   "DS_BUILD_QUANTIZER": "1", "DS_BUILD_FUSED_ADAM": "1"}
    assert "TORCH_CUDA_ARCH_LIST" not in device_run.build_env({**machine, "arch": ""}, {})  # DeepSpeed's default


def test_the_ops_wheel_made_for_the_machine_is_installed_and_nothing_is_compiled(tmp_path, monkeypatch):
    machine = {"torch": "2.11", "cuda": "13.0", "arch": "9.0", "ops": ["quantizer"], "build_vars": ["DS_BUILD_QUANTIZER"]}
    wheel = _deepspeed_wheel(tmp_path / "prebuilt", {"quantizer": 1})
    monkeypatch.setattr(device_run, "PREBUILT", tmp_path / "prebuilt")
    monkeypatch.setattr(device_run, "BUILT", tmp_path / "built")
    monkeypatch.setattr(device_run, "SITE", tmp_path / "site")
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(machine) + "\n", stderr="")

    monkeypatch.setattr(device_run.subprocess, "run", fake_run)
    device_run.install_ops_wheel("QuantizerBuilder", {}, tmp_path / "out")
    assert calls[0][-1] == "QuantizerBuilder"  # the machine is asked which ops those builders make
    assert calls[1][-1] == str(wheel) and "--target" in calls[1] and len(calls) == 2  # installed; no pip wheel
    assert not (tmp_path / "out").exists()  # nothing new to bring back

    machine["ops"] = ["fused_adam"]  # not in that wheel, and no source to compile it from
    monkeypatch.setattr(device_run, "SOURCES", tmp_path / "no-source")
    calls.clear()
    device_run.install_ops_wheel("FusedAdamBuilder", {}, tmp_path / "out")
    assert len(calls) == 1  # only the question: the op is left to the just-in-time build, as before


def test_the_archive_brings_back_the_checkpoint_chapters_reports_but_no_tensors(tmp_path, monkeypatch):
    import tarfile

    monkeypatch.setattr(device_run, "ROOT", tmp_path)
    runs = tmp_path / "runs"
    kept = ["runs/check-four/10_activation_checkpointing/result.json",
            "runs/check-four/14_checkpoints/14_checkpoints.ipynb",
            "runs/checkpoints-resume/summary.json",
            "runs/checkpoints/mine/latest"]
    skipped = ["runs/checkpoints/mine/step3/mp_rank_00_model_states.pt",
               "runs/checkpoints/mine/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for name in kept + skipped:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    log = runs / "device_run.log"
    log.write_text("log")
    device_run.pack(tmp_path / "out", "check", 0, 1.0, log)
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        packed = set(tar.getnames())
    assert set(kept) <= packed
    assert not set(skipped) & packed
    assert "left out of the archive (size): 0 file(s)" in (tmp_path / "out" / "summary.txt").read_text()
