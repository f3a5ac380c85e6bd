"""PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2 under torchrun, recorded like DeepSpeed's runs: one launch
for the module, plus the profiler parsing on made-up events."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from helpers.core import launch, models, profiler_comm, records
from helpers.topics import frameworks
from helpers.core.environment import WORLD_SIZE_VARIABLE

STEPS = 3
PROBES = ("timing", "model_states", profiler_comm.TorchComm)


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torchrun")
    specs = {s: launch.RunSpec("zero0", model="mlp", steps=STEPS, probes=PROBES, out=folder / s,
                               task=frameworks.TASK, options={"strategy": s})
             for s in ("ddp", "ddp-zero1", "fsdp2", "fsdp2-no-sync")}
    return launch.sweep(specs, name=f"test-torchrun-{folder.name}", world_size=2, launcher="torchrun", progress=False)


def test_torchrun_runs_come_back_as_records_of_their_strategy(torch_runs):
    for strategy, record in torch_runs.items():
        assert isinstance(record, records.Record)
        assert record.summary["launcher"] == "torchrun" and record.summary["backend"] == "gloo"
        assert record.label == f"{frameworks.STRATEGIES[strategy].label} fp32"
    command = Path(torch_runs["ddp"]["launch"]["plan"]).parent / "command.txt"
    assert "torch.distributed.run" in command.read_text()


def test_ddp_trains_the_plain_loops_losses(torch_runs):
    plain = models.plain_training("mlp", STEPS, batch_size=16, micro_batch=4)
    for strategy in ("ddp", "ddp-zero1", "fsdp2", "fsdp2-no-sync"):
        assert records.loss_agreement(plain, torch_runs[strategy].losses) == "within 1e-06", strategy


def test_model_states_ddp_whole_fsdp2_halved(torch_runs):
    psi = models.count_parameters(models.build("mlp"))
    ddp, fsdp = torch_runs["ddp"].states(0), torch_runs["fsdp2"].states(0)
    assert ddp["params"] == ddp["grads"] == 4 * psi
    assert ddp["buffers"] == 4 * psi  # DDP's gradient buckets, from its logging data
    assert fsdp["params"] == fsdp["grads"] == 4 * psi // 2  # DTensor shards, counted locally
    assert fsdp["optimizer"] < ddp["optimizer"] / 2 + 1024  # Adam's moments sharded (plus step counters)


def test_zero_redundancy_optimizer_shards_adam_and_broadcasts_each_parameter_from_its_owner(torch_runs):
    psi = models.count_parameters(models.build("mlp"))
    n_tensors = len(list(models.build("mlp").parameters()))
    ddp, zero1 = torch_runs["ddp"].states(0), torch_runs["ddp-zero1"].states(0)
    assert zero1["params"] == zero1["grads"] == ddp["params"]  # weights and gradients whole, as DDP's
    # Adam's two moments of half the elements (the mlp's tensors split evenly), plus one step counter a tensor
    assert 8 * psi // 2 <= zero1["optimizer"] <= 8 * psi // 2 + 4 * n_tensors
    assert zero1["master"] == 0  # fp32: the parameter is what AdamW updates
    ops = torch_runs["ddp-zero1"].summary["comm"]["by_caller"]
    assert torch_runs["ddp-zero1"].comm_ops()["all_reduce"] == torch_runs["ddp"].comm_ops()["all_reduce"]
    step = {caller: row for caller, row in ops["broadcast"].items() if "step" in caller}
    assert sum(r["count"] for r in step.values()) == n_tensors  # every parameter once, from its owner
    assert sum(r["bytes"] for r in step.values()) == 4 * psi


def test_fsdp2_no_sync_reduce_scatters_once_a_step_and_holds_whole_gradients_meanwhile(torch_runs):
    psi = models.count_parameters(models.build("mlp"))
    synced, held = torch_runs["fsdp2"], torch_runs["fsdp2-no-sync"]
    assert held.comm_ops()["reduce_scatter_tensor"]["bytes"] == synced.comm_ops()["reduce_scatter_tensor"]["bytes"] / 2
    assert held.comm_ops()["reduce_scatter_tensor"]["bytes"] == 4 * psi  # the whole gradients, once a step
    assert held.comm_ops()["all_gather_into_tensor"] == synced.comm_ops()["all_gather_into_tensor"]
    assert held.states(0)["grads"] == 4 * psi  # after micro-step 1: whole, not yet reduce-scattered
    assert synced.states(0)["grads"] == 4 * psi // 2
    assert held["memory.model_states_at_boundary_bytes_per_rank"][0]["grads"] == 4 * psi // 2


def test_profiler_counts_the_collectives_each_strategy_must_make(torch_runs):
    psi = models.count_parameters(models.build("mlp"))
    ddp = torch_runs["ddp"].comm_ops()
    assert ddp["all_reduce"]["bytes"] == 4 * psi  # once per step (no_sync on the first micro-step)
    fsdp = torch_runs["fsdp2"].comm_ops()
    # 2 micro-steps x (forward + backward gather of every shard), and a reduce-scatter of every gradient
    assert fsdp["all_gather_into_tensor"]["bytes"] == 2 * 2 * 4 * psi // 2
    assert fsdp["reduce_scatter_tensor"]["bytes"] == 2 * 4 * psi
    assert torch_runs["fsdp2"].summary["comm"]["source"].startswith("PyTorch profiler")


class FakeEvent:
    """What collectives_from_profile reads of a profiler event."""

    def __init__(self, name, start, duration, shapes, dtypes, thread=1):
        self._name, self._start, self._duration = name, start, duration
        self._shapes, self._dtypes, self._thread = shapes, dtypes, thread

    def name(self): return self._name
    def start_ns(self): return self._start
    def duration_ns(self): return self._duration
    def start_thread_id(self): return self._thread
    def structured_input_shapes(self): return self._shapes
    def dtypes(self): return self._dtypes


def test_collectives_from_profile_counts_nested_ops_once_and_sizes_them_like_the_comms_logger():
    events = [
        FakeEvent("FSDP::all_gather (3)", 0, 100, [], []),
        FakeEvent("c10d::_allgather_base_", 10, 50, [[200], [100], [], [], []], ["c10::BFloat16", "c10::BFloat16"]),
        FakeEvent("aten::linalg_vector_norm", 200, 100, [], []),
        FakeEvent("_c10d_functional::all_reduce", 210, 50, [[4], [], []], ["float", "", ""]),
        FakeEvent("c10d::allreduce_", 220, 10, [[[4]], []], ["TensorList", ""]),  # inside the functional op
        FakeEvent("c10d::allreduce_", 400, 10, [[[1000], [24]], []], ["TensorList", ""]),  # a bucket: no dtype
        FakeEvent("c10d::_reduce_scatter_base_", 500, 10, [[50], [100]], ["float", "float"]),
    ]
    found = profiler_comm.collectives_from_profile(events, fallback_dtype_bytes=4)
    assert found["all_gather_into_tensor | [Caller Func: FSDP::all_gather]"] == {200: {"count": 1}}  # shard, bf16
    assert found["all_reduce | [Caller Func: aten::linalg_vector_norm]"] == {16: {"count": 1}}
    assert found["all_reduce"] == {4096: {"count": 1}}  # 1024 elements at the fallback width
    assert found["reduce_scatter_tensor"] == {400: {"count": 1}}  # the whole input


class OldTorchEvent(FakeEvent):
    """An event of a torch without ``structured_input_shapes`` (2.11): a list of tensors has no shape."""

    structured_input_shapes = property()  # hasattr() is False
    def shapes(self): return self._shapes


def test_a_list_op_takes_its_size_and_dtype_from_its_backends_event_in_issue_order():
    events = [  # torch 2.11 on NCCL: no shapes on the list op; the backend's event inside it
        OldTorchEvent("c10d::allreduce_", 100, 20, [[], [], []], ["TensorList", "", ""]),
        OldTorchEvent("nccl:all_reduce", 110, 500, [[3000]], ["c10::BFloat16"]),  # ends after the op returned
        # gloo: its events on a worker thread, after the op returned, a reduce-scatter run as an all-reduce;
        # the i-th c10d op is paired with the i-th backend event
        OldTorchEvent("c10d::_reduce_scatter_base_", 300, 10, [[50], [100]], ["float", "float"]),
        OldTorchEvent("gloo:all_reduce", 650, 5, [[100]], ["float"], thread=7),
        OldTorchEvent("c10d::allreduce_", 700, 20, [[], [], []], ["TensorList", "", ""]),
        OldTorchEvent("gloo:all_reduce", 900, 5, [[1]], ["double"], thread=7),
    ]
    found = profiler_comm.collectives_from_profile(events, fallback_dtype_bytes=4)
    assert found["all_reduce"] == {6000: {"count": 1}, 8: {"count": 1}}
    assert found["reduce_scatter_tensor"] == {400: {"count": 1}}
    # an op whose backend event fell outside the profile: nothing paired, the fallback width
    cut = profiler_comm.collectives_from_profile(events + [FakeEvent("c10d::allreduce_", 950, 5, [[[10]]], ["TensorList"])], 4)
    assert cut["all_reduce"] == {0: {"count": 2}, 40: {"count": 1}}


@pytest.mark.parametrize("bad", [None, "zero9"])
def test_an_unknown_strategy_is_refused_before_any_process_starts(bad, monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=r"options\['strategy'\]"):
        launch.sweep({"x": launch.RunSpec("zero0", task=frameworks.TASK,
                                          options={"strategy": bad} if bad else None)},
                     world_size=2, launcher="torchrun")


def test_a_collective_counted_without_sizes_is_not_shown_as_zero_bytes():
    from helpers.core import records
    from helpers.topics import frameworks
    from test_records import minimal_summary

    summary = minimal_summary()
    summary["comm"] = {"by_op": {"all_reduce": {"count": 13.0, "bytes": 0.0}}, "bytes_per_step": 0.0,
                       "wire_bytes_per_step": 0.0}
    assert frameworks.bytes_per_step(records.Record(summary)) == "? (13 collectives a step, no sizes recorded)"
    assert frameworks.bytes_per_step(records.Record(minimal_summary())) == "5.86 KiB"


def test_a_profile_of_many_steps_is_read_in_one_pass():
    import time

    # 2,000 collectives among 60,000 other events on one thread: a comparison of every pair would take minutes
    events = []
    for i in range(2_000):
        base = i * 1_000
        events.append(FakeEvent("autograd::engine::evaluate_function: X", base, 900, [], []))
        events += [FakeEvent("aten::mm", base + 10 + j * 20, 10, [], []) for j in range(30)]
        events.append(FakeEvent("c10d::_allgather_base_", base + 700, 50, [[8], [4]], ["float", "float"]))
    started = time.monotonic()
    found = profiler_comm.collectives_from_profile(events, fallback_dtype_bytes=4)
    assert time.monotonic() - started < 5
    assert found == {"all_gather_into_tensor | [Caller Func: backward: X]": {16: {"count": 2_000}}}


# --- the chapter's exercises ----------------------------------------------------------------------

class _Held:
    """A stand-in for a DeepSpeed run of the chapter: its model states on rank 0, config and losses."""

    def __init__(self, states: dict, config: dict | None = None, losses: list | None = None):
        self._states, self.summary, self.losses = states, {"config": config or {}}, losses or []

    def states(self, rank: int = 0) -> dict:
        return self._states


def _labelled(torch_runs, **deepspeed) -> dict:
    return {"DDP": torch_runs["ddp"], "DDP + ZeroRedundancyOptimizer": torch_runs["ddp-zero1"],
            "FSDP2 full": torch_runs["fsdp2"], **deepspeed}


def test_exercise_no_sync_states_is_sharded_weights_and_adam_with_whole_gradients(torch_runs):
    runs = {"FSDP2 full": torch_runs["fsdp2"], "FSDP2 full, no-sync": torch_runs["fsdp2-no-sync"]}
    psi = models.count_parameters(models.build("mlp"))
    assert frameworks.exercise_no_sync_states(4 * psi / 2 + 4 * psi + 8 * psi / 2, runs)
    assert not frameworks.exercise_no_sync_states(runs["FSDP2 full"].model_state_bytes(0), runs)  # sharded gradients
    assert not frameworks.exercise_no_sync_states(16 * psi, runs)  # DDP's: nothing sharded
    assert "to do:" in str(frameworks.exercise_no_sync_states(..., runs))


def test_page_tasks_name_the_chapter_modules_two_tasks(tmp_path, monkeypatch):
    from helpers.core import environment

    monkeypatch.setattr(environment, "REPO_ROOT", tmp_path)
    (tmp_path / "runs" / "15").mkdir(parents=True)
    path = tmp_path / "runs" / "15" / "frameworks_rank.py"
    assert frameworks.page_tasks(path) == ("runs.15.frameworks_rank:train_pytorch",
                                           "runs.15.frameworks_rank:train_deepspeed")
    with pytest.raises(ValueError):
        frameworks.page_tasks(tmp_path.parent / "elsewhere.py")


def test_timing_verdict_is_withheld_without_a_recorded_load(torch_runs):
    from helpers.core import load_guard

    runs = {"FSDP2 full": torch_runs["fsdp2"], "ZeRO-3": torch_runs["fsdp2-no-sync"]}
    text = frameworks.timing_verdict(runs, None)
    assert "not recorded" in text and "Verdict withheld" in text
    busy = load_guard.Load("cpu", other_processes=3, other_share=0.5, cores=2, seconds=10.0, samples=20, source="test")
    assert "Verdict withheld" in frameworks.timing_verdict(runs, busy)


def test_exercise_zero_redundancy_bytes_is_twice_the_gradients_as_measured(torch_runs):
    runs = _labelled(torch_runs)
    grads = torch_runs["ddp-zero1"].states()["grads"]
    assert frameworks.exercise_zero_redundancy_bytes(2 * grads, runs)
    assert not frameworks.exercise_zero_redundancy_bytes(grads, runs)
    assert "to do:" in str(frameworks.exercise_zero_redundancy_bytes(..., runs))


def test_exercise_zero1_config_needs_stage_1_and_the_pytorch_runs_hyperparameters(torch_runs):
    from helpers.core import configs

    zero1 = configs.load("zero1")
    runs = _labelled(torch_runs, **{"ZeRO-1": _Held({}, zero1, torch_runs["ddp-zero1"].losses)})
    assert frameworks.exercise_zero1_config(zero1, runs)
    assert not frameworks.exercise_zero1_config(configs.load("zero2"), runs)
    wrong_lr = configs.merged(zero1, {"optimizer": {"params": {"lr": 1e-2}}})
    assert "optimizer.lr" in str(frameworks.exercise_zero1_config(wrong_lr, runs))
    assert "to do:" in str(frameworks.exercise_zero1_config(..., runs))


PAGE_MODULE = '''
from helpers.topics import frameworks


def setup(model, config):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def step(engine, batches, loss_of, after_backward):
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_of(engine, batch)
        engine.backward(loss)
        after_backward(i)
        engine.step()
        losses.append(loss.item())
    return losses


def train_pytorch(run, position, count, born):
    frameworks.run_pytorch(run, position, count, born, frameworks.setup_pytorch, frameworks.step_pytorch)


def train_deepspeed(run, position, count, born):
    frameworks.run_deepspeed(run, position, count, born, setup, step)
'''


def test_a_page_modules_deepspeed_task_trains_the_plain_loops_losses_and_is_recorded(tmp_path):
    """A chapter's own module (``frameworks.page_tasks``) trains DeepSpeed's side with its own
    ``deepspeed.initialize`` and step; the record reads like the course loop's."""
    from helpers.core import environment

    folder = environment.REPO_ROOT / "runs" / f"test-page-{tmp_path.name}"
    folder.mkdir(parents=True)
    try:
        (folder / "page.py").write_text(PAGE_MODULE)
        _, deepspeed_task = frameworks.page_tasks(folder / "page.py")
        found = launch.sweep({"zero2": launch.RunSpec("zero2", model="mlp", steps=STEPS, probes=("model_states",),
                                                      out=tmp_path / "zero2", task=deepspeed_task)},
                             name=f"test-page-{tmp_path.name}", world_size=2, progress=False)
        record = found["zero2"]
        assert record.stage == 2 and record.summary["basic_optimizer"] == "AdamW"
        plain = models.plain_training("mlp", STEPS, batch_size=16, micro_batch=4)
        assert records.loss_agreement(plain, record.losses) == "within 1e-06"
        psi = models.count_parameters(models.build("mlp"))
        assert record.states(0)["grads"] == 4 * psi // 2  # ZeRO-2: this rank's shard, measured mid-accumulation
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_states_and_wire_formulas_spell_each_part():
    assert frameworks.states_formula("FSDP2 full, no-sync", 100, 2) == ("4Ψ/n + 4Ψ + 8Ψ/n", 1000)
    assert frameworks.states_formula("ZeRO-1", 100, 4) == ("4Ψ + 4Ψ + 8Ψ/n + 4Ψ/n", 1100)
    assert frameworks.states_formula("DDP", 100, 4) == ("4Ψ + 4Ψ + 8Ψ", 1600)
    text, sent = frameworks.wire_formula("ZeRO-2", 100, 2, 2)  # 2 all-reduces of 2Ψ and a gather of Ψ, x 1/2 x 4 B
    assert text == "A x all-reduce 2Ψ + all-gather Ψ" and sent == 1000
    assert frameworks.wire_formula("DDP + ZeroRedundancyOptimizer", 100, 4, 2)[1] == 3 * 100 * 3 / 4 * 4
    assert set(frameworks.STATE_FORMULAS) == set(frameworks.WIRE_FORMULAS)


class _Comm:
    """A record stand-in with what :func:`frameworks.sent_bytes_per_step` reads."""

    def __init__(self, world_size: int, by_caller: dict):
        self.world_size, self.summary = world_size, {"comm": {"by_caller": by_caller}}


def test_a_broadcast_is_sent_once_per_other_rank_averaged_over_the_ranks():
    broadcasts = {"broadcast": {"step": {"count": 16, "bytes": 1000.0}}}
    assert frameworks.sent_bytes_per_step(_Comm(2, broadcasts)) == 500  # each rank sends its own half
    assert frameworks.sent_bytes_per_step(_Comm(4, broadcasts)) == 750
    gather = {"all_gather_into_tensor": {"x": {"count": 1, "bytes": 250.0}}}  # each rank's shard
    assert frameworks.sent_bytes_per_step(_Comm(4, gather)) == 750  # the same as the broadcasts of the shards
    reduce = {"all_reduce": {"x": {"count": 2, "bytes": 1000.0}}}
    assert frameworks.sent_bytes_per_step(_Comm(2, reduce)) == 1000  # 2 x 2(n-1)/n x 500


def test_the_formulas_match_what_the_torchrun_runs_sent_and_hold(torch_runs):
    runs = _labelled(torch_runs, **{"FSDP2 full, no-sync": torch_runs["fsdp2-no-sync"]})
    for name, r in runs.items():
        text, sent = frameworks.wire_formula(name, r.params, r.world_size, r.grad_accum)
        assert frameworks.sent_bytes_per_step(r) == pytest.approx(sent, rel=1e-3), (name, text)
        assert r.model_state_bytes(0) == pytest.approx(frameworks.states_formula(name, r.params, 2)[1], rel=1e-3)
    ddp, zero1 = runs["DDP"], runs["DDP + ZeroRedundancyOptimizer"]
    assert frameworks.sent_bytes_per_step(zero1) == pytest.approx(1.5 * frameworks.sent_bytes_per_step(ddp), rel=1e-3)


def _stepped(step_ms: list[float]) -> records.Record:
    """A record whose steps took ``step_ms`` milliseconds (the first warms up); its median is of all of them."""
    from test_records import minimal_summary

    summary = minimal_summary()
    summary["step_time_s"] = {"median": statistics.median(step_ms) / 1e3, "all": [t / 1e3 for t in step_ms]}
    summary["memory"]["peak_source"] = "resident set"
    return records.Record(summary)


def test_the_step_time_table_gives_the_medians_the_verdict_judges():
    from helpers.core import load_guard

    runs = {"DDP": _stepped([900, 15, 16, 14]), "ZeRO-0": _stepped([950, 20, 21, 19])}  # all steps: 15.5, 20.5
    assert frameworks.median_step_ms(runs["DDP"]) == 15.0  # the warm-up step left out, as the verdict leaves it
    rows = frameworks.timing_table(runs).splitlines()
    assert frameworks.STEP_COLUMN in rows[0] and rows[2].split()[1] == "15.0" and rows[3].split()[1] == "20.0"
    alone = load_guard.Load("cpu", 0, 0.0, 2, 10.0, 20, "test")
    assert "(medians: DDP 15 ms, ZeRO-0 20 ms)" in frameworks.timing_verdict(runs, alone)
    assert frameworks.gpu_table(runs, runs).splitlines()[2].split()[-2] == "15.0"


def test_a_committed_reference_is_judged_under_its_written_conditions(monkeypatch):
    timed = {"time: DDP": _stepped([900, 15, 16, 15, 14]), "time: ZeRO-0": _stepped([950, 20, 21, 20, 19])}
    found = [("2 x GPU", "2026-11-28", "note", timed)]
    monkeypatch.setattr(frameworks.references, "reference_runs", lambda name: found)
    monkeypatch.setattr(frameworks.references, "reference_conditions", lambda name: ["executed by check-gpu, alone"])
    assert "DDP against ZeRO-0: DDP is faster: ZeRO-0 takes 1.33x its time" in frameworks.gpu_time_reading()
    monkeypatch.setattr(frameworks.references, "reference_conditions",
                        lambda name: ["executed by check-gpu beside 2 other notebook(s)"])
    assert ("Verdict withheld: not measured alone (executed by check-gpu beside 2 other notebook(s))"
            in frameworks.gpu_time_reading())
