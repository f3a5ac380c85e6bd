"""helpers.core.launch: real 2-rank DeepSpeed runs on CPU (three launches, ~6-30 s each) and the checks before them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.core import configs, launch, models, records, theory
from helpers.core.environment import WORLD_SIZE_VARIABLE


@pytest.fixture(autouse=True)
def _two_ranks(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)


def processes_of(out) -> list[str]:
    """Command lines of live processes that mention the run's output folder."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if any(str(out) in part for part in cmdline):
            found.append(f"{proc.info['pid']}: {' '.join(cmdline)}")
    return found


# --- a real run -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero2-mlp")
    record = launch.run("zero2", model="mlp", steps=3, world_size=2, out=out, progress=False, timeout=300)
    return record, out


def test_zero2_run_writes_a_complete_summary(zero2_run):
    record, out = zero2_run
    assert isinstance(record, records.Record)
    assert record.out == out
    assert record.wall_s is not None and record.wall_s > 0
    summary = records.load(out).summary
    records.validate(summary)
    assert summary == record.summary
    assert summary["world_size"] == 2
    assert summary["backend"] == "gloo" and summary["device"] == "cpu"
    assert summary["zero_stage"] == 2 and summary["precision"] == "fp32"
    assert summary["model"] == {"name": "mlp", "params": models.count_parameters(models.build("mlp"))}
    assert summary["steps"] == 3 and len(summary["losses"]) == 3
    assert all(loss > 0 for loss in summary["losses"])
    config = configs.load("zero2")
    assert summary["micro_batch"] == config["train_micro_batch_size_per_gpu"]
    assert summary["grad_accum"] == config.get("gradient_accumulation_steps", 1)
    assert summary["train_batch"] == summary["micro_batch"] * summary["grad_accum"] * 2
    assert "all_reduce" in summary["comm"]["by_op"]
    assert summary["comm"]["bytes_per_step"] > 0
    assert len(summary["memory"]["model_states_bytes_per_rank"]) == 2
    assert len(summary["memory"]["peak_bytes_per_rank"]) == 2
    for name in ("ds_config.json", "plan.json", "command.txt", "launch.log", "rank0.json", "rank1.json"):
        assert (out / name).exists(), name


def test_zero2_partitions_gradients_not_parameters(zero2_run):
    record, _ = zero2_run
    psi = record.params
    for rank in (0, 1):
        states = record.states(rank)
        assert states["params"] == 4 * psi  # fp32, every rank holds all parameters at stage 2
        assert states["grads"] == pytest.approx(states["params"] / 2, rel=0.02)
        assert states["optimizer"] == pytest.approx(8 * psi / 2, rel=0.02)


def test_zero2_theory_is_the_papers(zero2_run):
    record, _ = zero2_run
    psi = record.params
    assert record.theory_states == pytest.approx(theory.model_state_bytes(psi, 2, 2, "fp32"))
    assert record["theory.comm_bytes_per_step"] == theory.comm_bytes_per_step(psi, 2, "fp32")


def test_zero2_run_leaves_no_process(zero2_run):
    _, out = zero2_run
    assert processes_of(out) == []


# --- failures ---------------------------------------------------------------------------------

def test_failing_rank_ends_the_run_with_its_error(tmp_path):
    out = tmp_path / "fail"
    started = time.perf_counter()
    with pytest.raises(launch.RunFailed) as caught:
        launch.run("zero2", model="linear", steps=2, world_size=2, out=out, progress=False, timeout=120,
                   faults={"fail_on_rank": 1})
    seconds = time.perf_counter() - started
    failure = caught.value
    assert seconds < 30
    assert failure.rank == 1
    assert failure.error_type == "RuntimeError"
    assert "deliberate failure" in str(failure)
    assert "deliberate failure" in failure.message
    assert "Traceback" in failure.traceback
    assert failure.out == out
    assert processes_of(out) == []


# A hanging rank ended at the run's timeout: tests/test_faults.py.


# --- checks before any process starts ---------------------------------------------------------

def test_bad_config_raises_before_any_process_starts(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("launched"))
    name = f"badbatch-{tmp_path.name}"
    out = tmp_path / "bad"
    with pytest.raises(configs.ConfigError) as caught:
        launch.run("zero2", model="linear", steps=2, world_size=2, name=name, out=out, progress=False,
                   overrides={"train_batch_size": 7})
    assert started == []
    assert any(f.key == "train_batch_size" for f in caught.value.findings)
    assert str(caught.value).startswith(f"{name}: ")
    assert not out.exists()
    assert not (launch.RUNS_DIR / name / "launch.log").exists()
    assert not list(launch.RUNS_DIR.glob(f"{name}*"))


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "resnet"}, "resnet"),
    ({"steps": 0}, "steps=0"),
    ({"launcher": "mpirun"}, "mpirun"),
    ({"faults": {"fail_on_rank": 2}}, r"ranks 0-1; choose one of them"),  # a fault on no rank would pass silently
])
def test_bad_arguments_raise_before_any_process_starts(tmp_path, monkeypatch, kwargs, match):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=match):
        launch.run("zero2", world_size=2, out=tmp_path / "x", progress=False, **kwargs)
    assert not (tmp_path / "x" / "launch.log").exists()


def test_command_starts_helpers_train_on_every_rank(tmp_path):
    argv = launch.command(tmp_path / "plan.json", 2, 12345)
    assert argv[1:4] == ["-u", "-m", "deepspeed.launcher.launch"]
    assert "--master_port=12345" in argv
    assert argv[argv.index("--module") + 1] == "helpers.core.train"
    assert argv[argv.index("--plan") + 1] == str(tmp_path / "plan.json")
    cli = launch.command(tmp_path / "plan.json", 2, 12345, launcher="deepspeed")
    assert cli[cli.index("--num_gpus") + 1] == "2"


def test_unknown_probe_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="flops"):
        launch.run("zero2", world_size=2, out=tmp_path / "x", progress=False, probes=("timing", "flops"))


def test_runs_leave_no_shared_memory_segments(zero2_run):
    # DeepSpeed's CPU all-reduce never unlinks its /dev/shm segments; launch.run must.
    record, out = zero2_run
    port = (out / "command.txt").read_text().split("--master_port=")[1].split()[0]
    leftovers = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert leftovers == []


def test_events_are_parsed_from_interleaved_output():
    line = ('log text @@course {"event": "error", "rank": 1, "type": "X", "message": "m", "traceback": "t"}'
            '@@course {"event": "step", "step": 1, "steps": 2, "loss": 0.5, "seconds": 0.1}\n')
    text, events = launch.parse_events(line)
    assert [e["event"] for e in events] == ["error", "step"]
    assert text.strip() == "log text"


def test_sweep_retrying_keeps_what_finished_before_a_rank_died_and_retries_what_came_after(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "RUNS_DIR", tmp_path)
    specs = [launch.RunSpec("zero2", model="linear", steps=1, name=n, on_error="record") for n in ("a", "b", "c")]
    trained = records.Record.__new__(records.Record)
    launches = []

    def fake_sweep(batch, name, world_size, timeout, progress):
        launches.append((name, [s.name for s in batch], timeout))
        if len(batch) == 1:
            return {batch[0].name: trained}
        raise launch.RunFailed("rank 1 failed: RuntimeError: died in b")  # the launch ended inside b

    def fake_load(out):
        if Path(out) == launch.run_folder(specs[0], 2):  # only a finished before the rank died
            return trained
        raise OSError("no summary.json")

    monkeypatch.setattr(launch, "sweep", fake_sweep)
    monkeypatch.setattr(launch.records, "load", fake_load)
    found, again = launch.sweep_retrying(specs, name="s", world_size=2, timeout_each=30, progress=False)
    assert launches == [("s", ["a", "b", "c"], 90), ("s-again-0", ["c"], 30)] and again == ["c"]
    assert found["a"] is trained and found["c"] is trained and str(found["b"]) == "rank 1 failed: RuntimeError: died in b"
    # together: the runs after the first failure share one more launch, given the first launch's time
    launches.clear()
    launch.sweep_retrying(specs, name="s", world_size=2, timeout_each=30, progress=False, together=True)
    assert launches[1] == ("s-again", ["c"], 90)


#: One rank in this test's own process group: trains a run of each ZeRO stage through the ranks' own
#: ``train_run`` and says, per stage, whether its engine was still alive when ``train_run`` returned.
ENGINE_LIFETIME = """
import json, os, sys, time, weakref
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")
import deepspeed
from helpers.core import configs, plan, train
from helpers.topics import capstone
deepspeed.init_distributed(dist_backend="gloo")
engines, alive = [], {}
initialize = deepspeed.initialize
def remembered(*args, **kwargs):
    made = initialize(*args, **kwargs)
    engines.append(weakref.ref(made[0]))
    return made
deepspeed.initialize = remembered
# each ZeRO stage on the MLP, then ZeRO-3 on the capstone's tiny model through engine.compile()
cases = [(str(stage), stage, "mlp", {}, {}) for stage in range(4)]
cases.append(("3 compiled", 3, capstone.MODEL, {"size": "tiny", "compile": True},
              {"builder": capstone.BUILDER, "initialize": capstone.INITIALIZE, "trainer": capstone.TRAINER}))
for name, stage, model, options, named in cases:
    out = os.path.join(sys.argv[1], name.replace(" ", "-"))
    os.makedirs(out)
    with open(os.path.join(out, "ds_config.json"), "w") as f:
        json.dump(configs.load(f"zero{stage}"), f)
    run = plan.PlannedRun(name=name, out=out, config=os.path.join(out, "ds_config.json"), model=model, steps=2,
                          seed=0, probes=["peak_memory"], model_options=options, plan=os.path.join(out, "plan.json"),
                          **named)
    train.train_run(run, 0, 1, time.time())
    alive[name] = engines[-1]() is not None
# PyTorch's own engines (chapter 15, the capstone's FSDP2 runs), trained by the same kind of task
from helpers.core import models
from helpers.topics import frameworks
built = []
build = models.build
def remembered_model(*args, **kwargs):
    model = build(*args, **kwargs)
    built.append(weakref.ref(model))
    return model
models.build = remembered_model
for strategy in ("ddp", "fsdp2"):
    out = os.path.join(sys.argv[1], strategy)
    os.makedirs(out)
    with open(os.path.join(out, "ds_config.json"), "w") as f:
        json.dump(configs.load("zero0"), f)
    run = plan.PlannedRun(name=strategy, out=out, config=os.path.join(out, "ds_config.json"), model="mlp", steps=2,
                          seed=0, probes=["peak_memory"], options={"strategy": strategy},
                          plan=os.path.join(out, "plan.json"))
    with open(run.plan, "w") as f:
        json.dump({"launcher": "torchrun"}, f)
    frameworks.train_run(run, 0, 1, time.time())
    alive[strategy] = built[-1]() is not None  # the model its engine wrapped
print("ALIVE " + json.dumps(alive))
"""


def test_no_engine_outlives_its_run(tmp_path):
    """A sweep trains its runs one after another in the same processes: each engine (and on a GPU its
    memory) must be gone when the next run starts, or that run's peak memory counts it. DeepSpeed's
    ZeRO-3 keeps engines in module globals, torch.compile's caches keep a compiled ZeRO-3 engine's
    modules, and every engine sits in reference cycles."""
    done = subprocess.run([sys.executable, "-c", ENGINE_LIFETIME, str(tmp_path), str(launch.free_port())],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    line = next((l for l in done.stdout.splitlines() if l.startswith("ALIVE ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads(line[len("ALIVE "):]) == {"0": False, "1": False, "2": False, "3": False, "3 compiled": False,
                                                 "ddp": False, "fsdp2": False}



def test_a_chapters_own_module_under_runs_is_found_without_the_repository_on_the_path(monkeypatch):
    """A notebook's kernel starts in notebooks/, so the repository root is not on sys.path; the ranks have it on
    their PYTHONPATH. The launcher's check imports ``runs.<chapter>.<module>`` as the ranks will."""
    import shutil
    import sys

    root = launch.environment.REPO_ROOT
    folder = root / "runs" / "test_own_module"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank_code.py").write_text("def task(run, position, count, born):\n    return None\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(root))])
    for name in [m for m in sys.modules if m == "runs" or m.startswith("runs.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        found = launch._function("task", "runs.test_own_module.rank_code:task")
        assert found.__module__ == "runs.test_own_module.rank_code" and found.__name__ == "task"
    finally:
        shutil.rmtree(folder)


def test_a_process_group_of_zombies_only_counts_as_ended():
    # a group whose only process is a zombie (killed, not yet waited for): a signal still reaches the group,
    # but nothing in it runs, so ending a launch need not wait for its zombies' reaper
    process = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert launch._runs_in_group(process.pid)
        process.kill()
        deadline = time.monotonic() + 10
        while psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        launch.os.killpg(process.pid, 0)  # the zombie is still in its group
        assert not launch._runs_in_group(process.pid)
    finally:
        process.kill()
        process.wait()
