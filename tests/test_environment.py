"""helpers.core.environment: what this (CPU-only, 2-core) machine offers, and the ranks' environment."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers.core import environment
from helpers.core.environment import REPO_ROOT, WORLD_SIZE_VARIABLE


def _env(device="cpu", cores=2, gpus=0) -> environment.Environment:
    return environment.Environment(
        device=device, device_name="test", gpu_count=gpus, cpu_cores=cores,
        backend="gloo" if device == "cpu" else "nccl", default_world_size=2, world_size_source="test",
        precisions=("fp32", "bf16"), torch_version="0", deepspeed_version="0")


@pytest.fixture
def no_world_size_variable(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)


# --- detect -----------------------------------------------------------------------------------

def test_detect_on_this_cpu_machine(no_world_size_variable):
    env = environment.detect()
    assert env.device == "cpu"
    assert env.backend == "gloo"
    assert env.default_world_size == 2
    assert env.gpu_count == 0
    assert not env.is_gpu
    assert env.cpu_cores == len(os.sched_getaffinity(0))
    assert env.device_name == f"CPU ({env.cpu_cores} cores)"
    assert env.precisions[0] == "fp32" and set(env.precisions) <= {"fp32", "bf16", "fp16"}
    assert env.supports("fp32") and not env.supports("fp64")
    import deepspeed
    import torch
    assert (env.torch_version, env.deepspeed_version) == (torch.__version__, deepspeed.__version__)
    report = env.report()
    assert "gloo" in report and "ranks by default : 2" in report


def test_world_size_variable_overrides_the_default(monkeypatch):
    monkeypatch.setenv(WORLD_SIZE_VARIABLE, "3")
    env = environment.detect()
    assert env.default_world_size == 3
    assert WORLD_SIZE_VARIABLE in env.world_size_source


def test_explicit_world_size_beats_the_variable(monkeypatch):
    monkeypatch.setenv(WORLD_SIZE_VARIABLE, "3")
    env = environment.detect(4)
    assert env.default_world_size == 4
    assert env.world_size_source == "chosen by the caller"


@pytest.mark.parametrize("value", ["0", "-1", "two", "2.5", " "])
def test_bad_world_size_variable_raises(monkeypatch, value):
    monkeypatch.setenv(WORLD_SIZE_VARIABLE, value)
    with pytest.raises(ValueError, match=WORLD_SIZE_VARIABLE):
        environment.detect()


def test_empty_world_size_variable_is_ignored(monkeypatch):
    monkeypatch.setenv(WORLD_SIZE_VARIABLE, "")
    assert environment.detect().default_world_size == 2


def test_explicit_world_size_below_one_raises(no_world_size_variable):
    with pytest.raises(ValueError):
        environment.detect(0)


@pytest.fixture
def one_gpu(monkeypatch):
    """This CPU machine made to look like a machine with one GPU, no course variables set."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Test GPU")
    for name in (WORLD_SIZE_VARIABLE, environment.DEVICE_VARIABLE, environment.GPUS_VARIABLE, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, "")  # recorded, so what detect sets is undone after the test
        monkeypatch.delenv(name)


def test_one_gpu_trains_there_when_one_rank_is_enough(one_gpu):
    env = environment.detect()
    assert env.is_gpu and env.default_world_size == 1 and env.gpu_ids == (0,)
    assert environment.DEVICE_VARIABLE not in os.environ


def test_one_gpu_and_a_lesson_that_needs_two_ranks_runs_two_cpu_ranks(one_gpu, capsys):
    env = environment.detect(min_ranks=2)
    assert "Note: this chapter needs 2 ranks" in capsys.readouterr().err  # the chapter's first cell says so
    assert not env.is_gpu and env.backend == "gloo" and env.default_world_size == 2 and env.gpu_ids == ()
    assert "needs 2 ranks" in env.world_size_source and "1 GPU" in env.world_size_source
    # the chapter's later runs (launch calls detect again, with the world size) take the same CPU ranks
    assert os.environ[environment.DEVICE_VARIABLE] == "cpu"
    again = environment.detect(2)
    assert not again.is_gpu and again.default_world_size == 2
    child, changes = environment.child_env(again, 2)
    assert child["CUDA_VISIBLE_DEVICES"] == "" and child["DS_ACCELERATOR"] == "cpu"
    assert any(c.startswith("CUDA_VISIBLE_DEVICES=''") for c in changes)


def test_one_gpu_keeps_the_learners_own_world_size(one_gpu, monkeypatch):
    monkeypatch.setenv(WORLD_SIZE_VARIABLE, "1")
    env = environment.detect(min_ranks=2)
    assert env.is_gpu and env.default_world_size == 1
    assert environment.DEVICE_VARIABLE not in os.environ


def test_device_variable_cpu_puts_the_ranks_on_the_cpu(one_gpu, monkeypatch):
    monkeypatch.setenv(environment.DEVICE_VARIABLE, "cpu")
    env = environment.detect()
    assert not env.is_gpu and env.default_world_size == 2 and environment.DEVICE_VARIABLE in env.world_size_source


def test_bad_device_variable_names_the_variable_and_the_fix(monkeypatch):
    monkeypatch.setenv(environment.DEVICE_VARIABLE, "gpu")
    with pytest.raises(ValueError, match=r"\$COURSE_DEVICE='gpu': set it to 'cpu'"):
        environment.detect()


def test_cpu_ranks_beside_gpus_keep_their_ops_apart():
    base = {environment.DEVICE_VARIABLE: "cpu", "TORCH_EXTENSIONS_DIR": "/x/ext", "CUDA_VISIBLE_DEVICES": "0"}
    child, _ = environment.child_env(_env(), 2, base=base)
    assert child["CUDA_VISIBLE_DEVICES"] == "" and child["TORCH_EXTENSIONS_DIR"] == "/x/ext/cpu-ranks"
    plain, _ = environment.child_env(_env(), 2, base={"TORCH_EXTENSIONS_DIR": "/x/ext"})
    assert plain["TORCH_EXTENSIONS_DIR"] == "/x/ext" and "CUDA_VISIBLE_DEVICES" not in plain
    from torch.utils.cpp_extension import get_default_build_root
    unset, _ = environment.child_env(_env(), 2, base={environment.DEVICE_VARIABLE: "cpu"})
    assert unset["TORCH_EXTENSIONS_DIR"] == str(Path(get_default_build_root()) / "cpu-ranks")


def test_supports_reads_precisions():
    env = _env()
    assert env.supports("bf16") and not env.supports("fp16")
    assert "fp16: DeepSpeed refuses it" in env.report()


# --- child_env --------------------------------------------------------------------------------

@pytest.mark.parametrize("before, after", [
    ("9.0a", "9.0"),
    ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
    ("9.0a;10.0a;12.0a", "9.0;10.0;12.0"),
])
def test_child_env_fixes_arch_suffixes_and_reports_it(before, after):
    child, changes = environment.child_env(_env(), 2, base={"TORCH_CUDA_ARCH_LIST": before})
    assert child["TORCH_CUDA_ARCH_LIST"] == after
    arch_changes = [c for c in changes if c.startswith("TORCH_CUDA_ARCH_LIST")]
    assert len(arch_changes) == 1
    assert f"{before!r} -> {after!r}" in arch_changes[0]


@pytest.mark.parametrize("value", ["9.0", "8.0;9.0+PTX", "7.5;8.0;8.6"])
def test_child_env_leaves_valid_arch_lists_alone(value):
    child, changes = environment.child_env(_env(), 2, base={"TORCH_CUDA_ARCH_LIST": value})
    assert child["TORCH_CUDA_ARCH_LIST"] == value
    assert not any("TORCH_CUDA_ARCH_LIST" in c for c in changes)


def test_child_env_keeps_nccl_variables_untouched():
    base = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1",
            "SOME_OTHER": "x"}
    for env in (_env(), _env(device="cuda", gpus=2)):
        child, changes = environment.child_env(env, 2, base=dict(base))
        assert {k: child[k] for k in base} == base
        assert {k for k in child if k.startswith("NCCL_")} == {k for k in base if k.startswith("NCCL_")}
        assert not any("NCCL" in c for c in changes)


def test_child_env_does_not_modify_its_base_or_os_environ():
    base = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    before = dict(os.environ)
    environment.child_env(_env(), 2, base=base)
    assert base == {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    assert dict(os.environ) == before


def test_child_env_puts_the_repo_root_on_pythonpath():
    child, _ = environment.child_env(_env(), 2, base={})
    assert child["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT)]
    child, _ = environment.child_env(_env(), 2, base={"PYTHONPATH": "/somewhere" + os.pathsep + "/else"})
    assert child["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/somewhere", "/else"]
    already = os.pathsep.join(["/a", str(REPO_ROOT)])
    child, _ = environment.child_env(_env(), 2, base={"PYTHONPATH": already})
    assert child["PYTHONPATH"] == already


def test_child_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    child, changes = environment.child_env(_env(), 2)
    assert child["NCCL_DEBUG"] == "WARN"
    assert child["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert str(REPO_ROOT) in child["PYTHONPATH"].split(os.pathsep)


@pytest.mark.parametrize("cores, ranks, threads", [(2, 2, "1"), (8, 2, "4"), (2, 4, "1"), (16, 1, "16")])
def test_child_env_shares_cpu_cores_between_ranks(cores, ranks, threads):
    child, changes = environment.child_env(_env(cores=cores), ranks, base={})
    assert child["OMP_NUM_THREADS"] == threads
    assert any(c.startswith(f"OMP_NUM_THREADS={threads}") for c in changes)
    # already right: nothing to report
    child, changes = environment.child_env(_env(cores=cores), ranks, base={"OMP_NUM_THREADS": threads})
    assert not any(c.startswith("OMP_NUM_THREADS") for c in changes)


def test_child_env_sets_ds_accelerator_cpu_without_gpus(monkeypatch):
    monkeypatch.setattr(environment, "_ORIGINAL_DS_ACCELERATOR", None)
    child, changes = environment.child_env(_env(), 2, base={})
    assert child["DS_ACCELERATOR"] == "cpu"
    assert any(c.startswith("DS_ACCELERATOR=cpu") for c in changes)
    assert child["PYTHONUNBUFFERED"] == "1"


def test_child_env_on_gpus_changes_no_cpu_settings():
    base = {"OMP_NUM_THREADS": "7"}
    child, changes = environment.child_env(_env(device="cuda", gpus=4), 4, base=base)
    assert child["OMP_NUM_THREADS"] == "7"
    assert "DS_ACCELERATOR" not in child
    assert changes == []


def test_the_ranks_find_the_environments_own_ninja_first():
    own = Path(sys.executable).parent
    if not (own / "ninja").exists():
        pytest.skip(f"no ninja in {own}: nothing to put first")
    child, _ = environment.child_env(_env(), 2, base={"PATH": os.pathsep.join(["/usr/bin", str(own), "/bin"])})
    assert child["PATH"].split(os.pathsep) == [str(own), "/usr/bin", "/bin"]
    assert os.environ["PATH"].split(os.pathsep)[0] == str(own)  # the kernel itself, from importing helpers
    found = shutil.which("ninja", path=child["PATH"])
    assert Path(found).parent == own


def test_ops_are_built_inside_the_courses_environment():
    where = environment.extensions_dir()
    if where is None:
        pytest.skip("not in a virtual environment: torch's default folder")
    assert where == Path(sys.prefix) / "torch_extensions"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(where)  # set when helpers is imported (unless set before)
    child, _ = environment.child_env(_env(), 2)
    assert child["TORCH_EXTENSIONS_DIR"] == os.environ["TORCH_EXTENSIONS_DIR"]  # the ranks load the same ops
