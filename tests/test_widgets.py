"""helpers.topics.widgets's widgets driven through their callbacks, as a learner's clicks drive them: set a control, read
the config, the checker's findings and the calculator's figures; one real launch for the live view,
the launch hook and "my runs"."""

from __future__ import annotations

import dataclasses
import html
import json

import pytest

from helpers.core import configs, environment, launch, models, records, theory
from helpers.topics import widgets
from helpers.core.environment import WORLD_SIZE_VARIABLE


@pytest.fixture(autouse=True)
def _two_ranks(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VARIABLE, raising=False)


@pytest.fixture(scope="module")
def cpu_env():
    """This machine as a CPU without fp16, whatever the processor: findings then read the same everywhere."""
    env = environment.detect()
    return dataclasses.replace(env, device="cpu", device_name="CPU (test)", gpu_count=0, backend="gloo",
                               default_world_size=2, precisions=("fp32", "bf16"))


@pytest.fixture
def builder(cpu_env, tmp_path, monkeypatch):
    monkeypatch.setattr(widgets, "MY_CONFIGS", tmp_path / "my_configs")
    return widgets.ConfigBuilder(env=cpu_env)


def keys(findings) -> list[tuple[str, str]]:
    return [(f.severity, f.key) for f in findings]


# --- the builder ------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_at_its_defaults_the_builder_makes_the_chapters_config(builder, stage):
    builder.set(stage=stage)
    assert builder.config == configs.load(f"zero{stage}")
    assert builder.findings == []
    assert not builder.launch_button.disabled
    shown = html.unescape(builder.config_view.value.split(">", 1)[1].rsplit("<", 1)[0])
    assert json.loads(shown) == builder.config


def test_builder_defaults_are_deepspeeds():
    defaults = widgets.zero_defaults()
    s = widgets.BuilderSettings()
    assert (s.reduce_bucket_size, s.allgather_bucket_size, s.prefetch_bucket_size, s.overlap_comm) == (
        defaults["reduce_bucket_size"], defaults["allgather_bucket_size"], defaults["stage3_prefetch_bucket_size"],
        defaults["overlap_comm"])


def test_precision_batch_and_knobs_reach_the_config(builder):
    builder.set(precision="bf16", micro_batch=8, grad_accum=4, reduce_bucket_size=100_000, overlap_comm=True,
                allgather_bucket_size=1_000_000)
    c = builder.config
    assert c["bf16"] == {"enabled": True} and "fp16" not in c
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (8, 4)
    assert c["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 100_000, "allgather_bucket_size": 1_000_000,
                                      "overlap_comm": True}
    assert builder.findings == []


def test_knobs_a_stage_does_not_use_are_hidden_and_left_out(builder):
    builder.set(reduce_bucket_size=100_000, allgather_bucket_size=100_000, prefetch_bucket_size=10_000)
    assert "stage3_prefetch_bucket_size" not in builder.config["zero_optimization"]
    assert builder.controls["prefetch_bucket_size"].layout.display == "none"
    builder.set(stage=3)
    zero = builder.config["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 10_000 and "allgather_bucket_size" not in zero
    assert builder.controls["allgather_bucket_size"].layout.display == "none"
    assert builder.controls["prefetch_bucket_size"].layout.display is None
    builder.set(stage=0)
    assert builder.config["zero_optimization"] == {"stage": 0}


def test_a_batch_that_does_not_add_up_is_named_with_its_fix_and_blocks_launch(builder):
    builder.set(train_batch=30)
    assert keys(builder.findings) == [("error", "train_batch_size")]
    assert "set train_batch_size to 16" in builder.findings[0].fix
    assert builder.launch_button.disabled
    assert "train_batch_size" in builder.findings_view.value and "fix:" in builder.findings_view.value
    builder.set(train_batch=16)
    assert builder.findings == [] and not builder.launch_button.disabled
    builder.set(world_size=4)  # the batch no longer adds up on 4 ranks
    assert keys(builder.findings) == [("error", "train_batch_size")]


def test_offload_findings_follow_the_stage(builder):
    builder.set(offload_param="cpu")
    assert keys(builder.findings) == [("warning", "zero_optimization.offload_param")]
    assert not builder.launch_button.disabled  # a warning does not block
    builder.set(stage=3, offload_optimizer="cpu")
    assert builder.findings == []
    assert "torch_adam" not in builder.config["optimizer"]["params"]  # DeepSpeed's CPU Adam
    builder.set(stage=0, offload_param="none")
    assert keys(builder.findings) == [("warning", "zero_optimization.offload_optimizer")]


def test_nvme_without_a_path_is_an_error_and_shows_the_path_control(builder):
    assert builder.controls["nvme_path"].layout.display == "none"
    builder.set(stage=3, offload_param="nvme")
    assert builder.controls["nvme_path"].layout.display is None
    assert ("error", "zero_optimization.offload_param.nvme_path") in keys(builder.findings)
    builder.set(nvme_path="runs/nvme")
    assert builder.config["zero_optimization"]["offload_param"] == {"device": "nvme", "nvme_path": "runs/nvme"}
    assert ("error", "zero_optimization.offload_param.nvme_path") not in keys(builder.findings)


def test_fp16_on_a_device_without_it_is_refused_with_the_alternative(builder):
    builder.set(precision="fp16")
    assert keys(builder.findings) == [("error", "fp16.enabled")]
    assert "bf16" in builder.findings[0].fix


def test_report_and_repr_are_the_config_and_findings(builder):
    builder.set(train_batch=30)
    assert builder.report().startswith(json.dumps(builder.config, indent=1))
    assert builder.report().endswith("1 error(s), 0 warning(s)")
    assert repr(builder) == ("ConfigBuilder: ZeRO-2 fp32, 2 rank(s), offload optimizer=none params=none: "
                             "1 error(s), 0 warning(s)")
    assert builder._repr_mimebundle_()["text/plain"] == repr(builder)


def test_prediction_uses_the_papers_formulas(builder):
    builder.set(stage=3, model="linear")
    psi = models.count_parameters(models.build("linear"))
    text = builder.prediction_view.value
    assert f"({psi:,} parameters)" in text
    assert records.format_bytes(theory.model_state_bytes(psi, 3, 2)["total"]) in text


def test_save_writes_the_config_into_my_configs_and_refuses_bad_names(builder):
    builder.set(stage=1, name="my-zero1")
    builder.save_button.click()
    path = widgets.MY_CONFIGS / "my-zero1.json"
    assert configs.load(path) == builder.config
    assert configs.check(configs.load(path), 2) == []  # what `python -m helpers check` reads
    builder.set(name="../escape")
    builder.save_button.click()
    assert "name '../escape'" in html.unescape(builder.status.value)
    assert not (widgets.MY_CONFIGS.parent / "escape.json").exists()


def test_launch_with_an_error_or_too_many_ranks_starts_nothing(builder, monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    builder.set(train_batch=30)
    with pytest.raises(configs.ConfigError, match="train_batch_size"):
        builder.launch()
    builder.set(train_batch=0, world_size=widgets.CPU_LAUNCH_LIMIT + 1)
    assert builder.findings == []
    builder.launch_button.click()  # the button shows the refusal instead of raising
    assert "at most 8" in builder.status.value


def test_unknown_settings_are_refused_by_name(cpu_env):
    with pytest.raises(ValueError, match="stagee"):
        widgets.ConfigBuilder(env=cpu_env, stagee=3)
    with pytest.raises(ValueError, match="precision"):
        widgets.build_config(widgets.BuilderSettings(precision="fp8"))
    builder = widgets.ConfigBuilder(env=cpu_env)
    with pytest.raises(ValueError, match="not a control"):
        builder.set(zero=3)


# --- the calculator ---------------------------------------------------------------------------

def test_calculator_preset_figures_come_from_theory():
    calc = widgets.Calculator(preset="7B", gpus_per_node=8, nodes=1, gpu_memory_gib=80)
    psi = models.LLAMA_PRESETS["7B"].parameters()
    assert calc.psi == psi and calc.cluster.world_size == 8
    rows = {(r.stage, r.offload): r for r in calc.rows()}
    assert len(rows) == 9
    for stage in theory.STAGES:
        assert rows[(stage, "none")].gpu == theory.model_state_bytes(psi, stage, 8, "bf16")
        assert rows[(stage, "none")].comm_seconds == theory.comm_seconds_per_step(psi, stage, calc.cluster, "bf16")
    assert rows[(2, "optimizer")].gpu["total"] == 2 * psi
    assert rows[(2, "optimizer")].offloaded_per_node == pytest.approx(8 * (12 + 2) * psi / 8)
    assert "Ψ = 6,738,415,616 parameters" in calc.table_view.value
    assert calc.plot.value[:8] == b"\x89PNG\r\n\x1a\n"


def test_calculator_reproduces_the_papers_table_with_a_free_number():
    calc = widgets.Calculator().set(preset=widgets.CUSTOM, params_b=7.5, gpus_per_node=8, nodes=8)
    assert calc.controls["params_b"].layout.display is None
    gb = {r.stage: r.gpu["total"] / 1e9 for r in calc.rows() if r.offload == "none"}
    assert gb == pytest.approx(theory.paper_table(7.5e9, 64))


def test_calculator_controls_change_the_figures():
    calc = widgets.Calculator(preset="7B")
    before = calc.table_view.value
    seconds = calc.rows()[0].comm_seconds
    calc.set(link_gb_per_s=50)
    assert calc.rows()[0].comm_seconds == pytest.approx(2 * seconds)
    assert "(stated default" not in calc.table_view.value and calc.table_view.value != before
    calc.set(preset="70B")
    assert calc.psi == models.LLAMA_PRESETS["70B"].parameters()
    calc.set(nodes=4)
    assert calc.cluster.world_size == 32
    stage3 = [r for r in calc.rows() if r.stage == 3 and r.offload == "none"][0]
    assert stage3.gpu["total"] == pytest.approx(16 * calc.psi / 32)
    assert repr(calc).startswith("Calculator: 70B preset (68,976,648,192 parameters, bf16) on 4 x 8 GPU(s)")


def test_calculator_table_marks_the_builders_row():
    text = widgets.calculator_table(1e9, theory.Cluster(), marked=(2, True, False))
    marked = [line for line in text.splitlines() if line.rstrip().endswith("◀")]
    assert len(marked) == 1 and marked[0].split()[:2] == ["2", "optimizer"]


def test_calculator_table_without_offload_keeps_one_row_per_stage_and_heads_the_volume_as_told():
    text = widgets.calculator_table(1e9, theory.Cluster(), stages=(0, 1, 2), offload=False,
                                    sent_label="paper's sent/GPU/step")
    header = text.splitlines()[3]
    assert "paper's sent/GPU/step" in header and "offload" not in header and "fits up to" not in header
    rows = text.splitlines()[5:]
    assert [row.split()[0] for row in rows] == ["0", "1", "2"]
    full = widgets.calculator_table(1e9, theory.Cluster(), stages=(0, 1, 2))
    assert len(full.splitlines()) > len(text.splitlines())  # the offload rows are gone


def test_lab_links_the_builders_setting_to_the_calculators_row(cpu_env, tmp_path, monkeypatch):
    monkeypatch.setattr(widgets, "MY_CONFIGS", tmp_path)
    the_lab = widgets.ConfigLab(widgets.ConfigBuilder(env=cpu_env), widgets.Calculator(), widgets.MyRuns(folder=tmp_path))
    assert the_lab.calculator.marked == (2, False, False)
    the_lab.builder.set(stage=3, offload_optimizer="cpu", offload_param="cpu")
    assert the_lab.calculator.marked == (3, True, True)
    the_lab.builder.set(stage=2)  # parameters are not offloaded below stage 3: the row says so
    assert the_lab.calculator.marked == (2, True, False)


def test_offload_calculator_for_the_offload_chapter():
    calc = widgets.offload_calculator(preset="13B", gpu_memory_gib=24)
    assert {r.stage for r in calc.rows()} == {1, 2, 3} and calc.cluster.world_size == 1
    assert calc.table() == widgets.calculator_table(calc.psi, calc.cluster, "bf16", (1, 2, 3),
                                                    models.LLAMA_PRESETS["13B"].largest_layer())


def test_formats():
    assert [widgets.format_count(x) for x in (950, 6.7e9, 1.37e12, 999.96e6)] == ["950", "6.7B", "1.37T", "1B"]
    assert [widgets.format_seconds(x) for x in (2.5, 0.236, 0.9999, 4e-5)] == ["2.5 s", "236 ms", "1 s", "40 µs"]


# --- one real launch: the hook, the live view, the builder's launch, my runs ------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("widget-runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(WORLD_SIZE_VARIABLE, raising=False)
        mp.setattr(launch, "RUNS_DIR", folder / "runs")
        mp.setattr(widgets, "MY_CONFIGS", folder / "my_configs")
        (folder / "runs").mkdir()
        (folder / "runs" / "not-a-record").mkdir()
        (folder / "runs" / "not-a-record" / "summary.json").write_text('{"result": 1}')
        events = []
        the_lab = widgets.ConfigLab(widgets.ConfigBuilder(name="widget-test", model="linear", steps=3),
                                widgets.Calculator(), widgets.MyRuns(folder=folder / "runs"))
        the_lab.builder.set(stage=2)
        the_lab.builder.live.on_event = lambda event, seen=the_lab.builder.live.on_event: (events.append(event), seen(event))
        the_lab.builder.launch_button.click()
        yield the_lab, events, folder


def test_the_launch_hook_reports_every_step_with_the_records_loss(launched):
    lab, events, _ = launched
    record = lab.builder.last_record
    assert isinstance(record, records.Record) and record.stage == 2
    assert [e["event"] for e in events] == ["run_start", "step", "step", "step", "done"]
    assert {e["name"] for e in events} == {"widget-test"} and events[0]["steps"] == 3
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]
    assert [e["loss"] for e in events if e["event"] == "step"] == pytest.approx(record.losses, abs=0)


def test_the_live_view_ends_with_the_record(launched):
    lab, _, folder = launched
    live = lab.builder.live
    assert (live.bar.value, live.bar.max, live.bar.bar_style) == (3, 3, "success")
    assert live.losses["widget-test"] == lab.builder.last_record.losses
    assert live.plot.value[:4] == b"\x89PNG"
    assert "widget-test-linear-2r" in live.record_view.value and "states/rank" in live.record_view.value
    assert configs.load(folder / "my_configs" / "widget-test.json") == lab.builder.config


def test_my_runs_lists_the_new_record_and_skips_what_is_not_one(launched):
    lab, _, folder = launched
    runs = lab.runs
    assert list(runs.runs) == ["widget-test-linear-2r"] and list(runs.skipped) == ["not-a-record"]
    assert runs.choice.value == ("widget-test-linear-2r",)
    assert "widget-test-linear-2r" in runs.table_view.value
    assert [bool(p.value) for p in runs.plots] == [True, True, True]
    found, skipped = records.load_all(folder / "runs", names=["widget-test-linear-2r"])
    table = records.runs_table(found, checked=True)
    record = found["widget-test-linear-2r"]
    assert records.format_bytes(record.model_state_bytes()) in table and "last loss" not in table
    assert "last loss" in records.runs_table(found)
    with pytest.raises(FileNotFoundError, match="nope"):
        records.load_all(folder / "runs", names=["nope"])


def test_the_record_notes_account_for_the_gaps_from_the_paper(launched):
    record = launched[0].builder.last_record
    notes = widgets.record_notes(record)
    assert "within 1% of the measured: True" in notes  # stage 2: an all-reduce per micro-step, one all-gather
    assert record.grad_accum > 1  # else stage 3's pattern would send the same bytes
    zero3 = records.Record({**record.summary, "zero_stage": 3})  # stage 3's collectives predict other bytes
    assert "within 1% of the measured: False" in widgets.sent_note(zero3)
    assert widgets.sent_note(records.Record({**record.summary, "zero_stage": 1})) is None
    one = {**record.summary, "world_size": 1, "train_batch": record.summary["micro_batch"] * record.grad_accum,
           "memory": {key: value[:1] if isinstance(value, list) else value
                      for key, value in record.summary["memory"].items()}}
    one.pop("data_parallel_size", None)
    alone = widgets.sent_note(records.Record(one))
    assert alone.startswith("ZeRO-2 on one rank") and "within 1%" not in alone
    assert f"master: DeepSpeed's ZeRO optimizer" in notes and f"{record.states()['master']:,} bytes" in notes


def test_the_straddling_parameter_is_found_where_the_partition_ends():
    sizes = [(name, p.numel()) for name, p in models.build("llama").named_parameters()]
    name, past = widgets._straddling("llama", 2)
    names = [n for n, _ in sizes]
    start = sum(size for _, size in sizes[:names.index(name)])
    half = sum(size for _, size in sizes) // 2
    assert start < half < start + dict(sizes)[name] and past == start + dict(sizes)[name] - half
    assert widgets._straddling("llama", 1) == ("", 0)


def test_the_lab_prints_the_ranks_deepspeed_calls_and_a_plain_command(tmp_path):
    calls = widgets.deepspeed_calls().splitlines()
    assert [line.split(": ", 1)[0] for line in calls] == [
        "helpers/core/train.py, initialize()", "helpers/core/train.py, data_parallel_step()",
        "helpers/core/train.py, data_parallel_step()"]
    assert "deepspeed.initialize(model=model" in calls[0] and calls[0].endswith("config=config)")
    assert calls[1].endswith("engine.backward(loss)") and calls[2].endswith("engine.step()")
    assert widgets.plain_command(tmp_path / "x.json", 4, "t.py") == f"deepspeed --num_gpus 4 t.py --deepspeed_config {tmp_path / 'x.json'}"


def test_the_calculators_notes_read_its_rows():
    calc = widgets.Calculator(preset="7B", gpus_per_node=8, nodes=1, gpu_memory_gib=80)
    assert "calculator precision: bf16" in widgets.precision_note("fp32", calc) and "builder's fp32" in widgets.precision_note("fp32", calc)
    # DeepSpeed's estimator: 2 bytes whole + 18 partitioned; the paper: 2 + (2 + 12)
    assert "the paper's 2Ψ + 14Ψ/8" in widgets.estimate_note(calc) and "estimator 2Ψ + 18Ψ/8" in widgets.estimate_note(calc)
    row = [r for r in calc.rows() if r.stage == 3 and r.offload == "none"][0]
    tokens = row.comm_seconds * 8 * 100e12 / (6 * calc.psi)
    assert f"compute {widgets.format_count(tokens)} tokens" in widgets.hiding_note(row, calc.psi, calc.cluster, 100)


def test_the_labs_exercise_is_the_smallest_stage_the_calculator_fits():
    assert not widgets.exercise_smallest_stage(...).answered
    # 70B on 16 GPUs of 40 GiB: even ZeRO-3's 16Ψ/16 (64 GiB) does not fit
    assert widgets.exercise_smallest_stage("none") and not widgets.exercise_smallest_stage(3)
    assert "is not one of the choices" in str(widgets.exercise_smallest_stage(5))
    assert widgets.exercise_smallest_stage(3, nodes=4)  # 32 GPUs: 32 GiB
    assert widgets.exercise_smallest_stage(1, preset="7B", nodes=1, gpu_gib=80)
    assert widgets.exercise_smallest_stage(0, preset="7B", nodes=1, gpu_gib=200)
