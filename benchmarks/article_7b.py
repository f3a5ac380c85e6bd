"""The source article's own case: LLaMA-7B (bf16, sequences of 2048 tokens) on this machine's GPUs, without Jupyter.

    python3 benchmarks/article_7b.py                                  # every experiment, 7B on GPUs (tiny on CPU)
    python3 benchmarks/article_7b.py --experiments article --budget 480
    python3 benchmarks/article_7b.py --size tiny --world-size 2       # the same code path on 2 CPU ranks (the test)
    python3 benchmarks/article_7b.py --fresh                          # forget the stored results and start again

The article: "when training a LLaMA 7B model using 8 GPUs, without DeepSpeed, the batch size had to be set to 16 to
train without OOM. By applying ZeRO-2 and setting Gradient Accumulation to 4 ... the training speed improved by
approximately 30%". Its experiments here (``--experiments``, in this order):

- ``article``: data parallelism without ZeRO (stage 0) at the largest micro-batch that fits, trying
  :data:`STAGE0_MICRO_BATCHES` from the largest down in ONE launch (an out-of-memory run is recorded with its
  error text, and is not tried again); then ZeRO-2 with gradient accumulation 4 at the same effective batch per
  GPU (:func:`same_batch`), so both train the same tokens per optimizer step and the same steps;
- ``stages``: ZeRO-3 at that batch;
- ``offload``: ZeRO-2 with its optimizer offloaded to the host, and ZeRO-3 with parameters and optimizer offloaded.

Before each launch the course calculator's prediction of every run in it (:func:`predict`: model states per GPU,
host memory, bytes per step) is written to the reference; after it, what each run measured (:func:`measured`: GPU
peak and model states per rank, host memory, step time, tokens/s, model TFLOP/s per GPU and MFU against the
course's dense bf16 peak, the collectives of one logged step). The reference,
``runs/reference/article-<size>-<N>x<device>.json``, holds the device, the date and the load guard's conditions of
every launch. Each launch gets the time left of ``--budget`` (a run that does not fit is left for the next call);
run the same command again to go on where it stopped: finished and out-of-memory runs are not trained again.

The runs reuse the capstone's model, step and setting (:mod:`helpers.topics.capstone`: ``Setting``, ``train_step``,
``build_model``); ZeRO-3 builds the model under ``deepspeed.zero.Init`` (:func:`build_model`), so no GPU ever holds
all 7B parameters, and the weights are random: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's helpers, from any folder

from helpers.core import environment, launch, load_guard, performance, records, references, theory  # noqa: E402
from helpers.core.probes import Probe, RunContext, logger_off  # noqa: E402
from helpers.topics import capstone  # noqa: E402

#: How the ranks import this module's builder and probe (by the module's name, also when it runs as a script).
MODULE = "benchmarks.article_7b"
EXPERIMENTS = ("article", "stages", "offload")
#: The article's accumulation with ZeRO-2.
ACCUMULATION = 4
#: Micro-batches per GPU tried for data parallelism without ZeRO, largest first (GPU 7B; CPU tiny).
STAGE0_MICRO_BATCHES = {"gpu": (4, 2, 1), "cpu": (8, 4)}
#: Optimizer steps per run: the throughput probe leaves out the first two and the profiled last one
#: (:data:`helpers.core.probes.WARMUP_STEPS`); :class:`LoggedStep` logs the second's collectives.
STEPS = {"gpu": 6, "cpu": 5}
#: Seconds a launch costs before its first run, and each run (model build, ``deepspeed.initialize``, steps), where
#: no launch of this reference has been timed yet; offloading runs count :data:`OFFLOAD_FACTOR` times.
FIRST_GUESS_S = {"gpu": (60.0, 90.0), "cpu": (25.0, 10.0)}
OFFLOAD_FACTOR = 2.0
#: Failures other than running out of memory (or a timeout) are tried this many times before they count as final.
ATTEMPTS = 2
#: What the ranks run: the capstone's step, this module's builder, the capstone's probes plus the ones the
#: experiments read (model states, host memory and placement, one step's collectives).
PROBES = (*capstone.PROBES, "model_states", "placement", f"{MODULE}:LoggedStep")
CLAIM = ("when training a LLaMA 7B model using 8 GPUs, without DeepSpeed, the batch size had to be set to 16 to train "
         "without OOM. By applying ZeRO-2 and setting Gradient Accumulation to 4 ... the training speed improved by "
         "approximately 30%")
#: Out-of-memory wording of CUDA, DeepSpeed and the host.
OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemory|Cannot allocate memory", re.IGNORECASE)
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
#: How the launcher reports a run that never started (one before it hung or killed the ranks).
NOT_RUN = re.compile(r"not run|did not run")


# --- what the ranks run -----------------------------------------------------------------------------

def build_model(name: str, seed: int = 0, config: dict | None = None, **options) -> torch.nn.Module:
    """The capstone model (:func:`helpers.topics.capstone.build_model`); at ZeRO-3 built under
    ``deepspeed.zero.Init`` with the run's config, so each rank allocates only its shard of the random weights
    (on the host where the config offloads parameters)."""
    if (config or {}).get("zero_optimization", {}).get("stage") != 3:
        return capstone.build_model(name, seed, config, **options)
    import deepspeed  # deferred: DeepSpeed is imported on the ranks, after their accelerator is chosen
    from transformers import LlamaForCausalLM  # deferred: slow, as in the capstone

    capstone.check_options(name, options)
    full = capstone.full_options(options)
    if full["checkpointing"] or full["compile"]:
        raise ValueError("the article's ZeRO-3 runs use neither activation checkpointing nor engine.compile()")
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path=config):
        return LlamaForCausalLM(capstone.model_config(full["size"], full["seq_len"], full["attention"]))


build_model.check_options = capstone.check_options  # the launcher checks a run's model options with it
build_model.data = capstone.DATA


class LoggedStep(Probe):
    """The collectives of one optimizer step, the second (a warm-up step no timing figure uses), from DeepSpeed's
    comms logger switched on for that step alone: it waits for every collective, which would slow the measured
    steps. Section ``logged_step``: count and bytes per op (:func:`helpers.core.communication.record_section`)."""

    name = "logged_step"
    keys = ("logged_step.by_op", "logged_step.bytes_per_step")

    def start(self, ctx: RunContext) -> None:
        self.step = ctx.first_step + 1 if ctx.steps - ctx.first_step > 1 else ctx.first_step

    def before_step(self, ctx: RunContext, step: int) -> None:
        if step == self.step:
            import deepspeed.comm as dist  # deferred: imported on the ranks only

            ctx.synchronize()
            dist.reset_log()
            dist.configure(enabled=True, prof_all=True, verbose=False, debug=True)

    def after_step(self, ctx: RunContext, step: int) -> None:
        if step == self.step:
            ctx.synchronize()
            logger_off()

    def finish(self, ctx: RunContext) -> dict:
        import deepspeed.comm as dist  # deferred: as above

        summary = dist.log_summary(return_dict=True) or {"summary": {}}  # every rank must call it
        return {"summary": summary.get("summary", {})}

    def combine(self, ranks: list[dict], ctx: RunContext) -> dict:
        from helpers.core import communication  # deferred: rank 0 only

        section = communication.record_section(ranks[0]["summary"], ctx.world_size, 1)
        return {"logged_step": {**section, "step": self.step + 1}}


BUILDER = f"{MODULE}:{build_model.__name__}"


# --- the plan -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Trial:
    """One run of an experiment: a capstone :class:`~helpers.topics.capstone.Setting` and what it offloads
    (:data:`helpers.core.theory.OFFLOAD_MODES`)."""

    name: str
    experiment: str
    label: str
    setting: capstone.Setting
    offload: str = "none"

    def config(self, world_size: int) -> dict:
        """The run's DeepSpeed config: the setting's, with the offload sections (pinned host memory)."""
        config = self.setting.config(world_size)
        zero = config["zero_optimization"]
        if self.offload != "none":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload == "optimizer+params":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        return config

    def spec(self, size: str, steps: int, world_size: int, folder: Path) -> launch.RunSpec:
        return launch.RunSpec(self.config(world_size), model=capstone.MODEL, steps=steps, name=self.name,
                              out=folder / self.name, probes=PROBES, on_error="record",
                              model_options=self.setting.model_options(size), builder=BUILDER, trainer=capstone.TRAINER)


def base_setting(gpu: bool) -> capstone.Setting:
    """bf16 and sequences of 2048 on GPUs with DeepSpeed's FusedAdam; on CPU ranks the capstone's CPU baseline
    (fp32, sequences of 64, torch's AdamW: bf16 is emulated, slowly, on most CPUs)."""
    return capstone.Setting(stage=0, micro_batch=1, grad_accum=1) if gpu else \
        dataclasses.replace(capstone.CPU_BASELINE, stage=0, micro_batch=1, grad_accum=1)


def same_batch(stage0_micro: int | None) -> dict:
    """The effective batch per GPU both sides of the article's comparison train, from the largest micro-batch
    data parallelism fitted (None: none fitted): that micro-batch when :data:`ACCUMULATION` divides it, else the
    least multiple of both (then data parallelism trains it again with accumulation). Returns ``effective``,
    ``zero2_micro`` (micro-batch of ZeRO-2 with :data:`ACCUMULATION`) and ``stage0_accum`` (None where data
    parallelism fitted nothing)."""
    if stage0_micro is None:
        return {"effective": ACCUMULATION, "zero2_micro": 1, "stage0_accum": None}
    effective = math.lcm(stage0_micro, ACCUMULATION)
    return {"effective": effective, "zero2_micro": effective // ACCUMULATION,
            "stage0_accum": effective // stage0_micro}


def stage0_trials(gpu: bool) -> list[Trial]:
    """Data parallelism without ZeRO at each of :data:`STAGE0_MICRO_BATCHES`, largest first, no accumulation."""
    base = base_setting(gpu)
    return [Trial(f"stage0-micro{m}", "article", f"stage 0, micro-batch {m}", dataclasses.replace(base, micro_batch=m))
            for m in STAGE0_MICRO_BATCHES["gpu" if gpu else "cpu"]]


def largest_fitting(results: dict) -> int | None:
    """The largest micro-batch of the stage-0 ladder that trained (``results``: trial name -> its entry)."""
    fitted = [e["setting"]["micro_batch"] for n, e in results.items()
              if n.startswith("stage0-micro") and e.get("status") == "measured"]
    return max(fitted) if fitted else None


def later_trials(gpu: bool, experiments: tuple[str, ...], stage0_micro: int | None) -> list[Trial]:
    """The runs after the stage-0 ladder, at :func:`same_batch`: ZeRO-2 with accumulation 4 (and data parallelism
    again where its best micro-batch needed accumulation to reach that batch), ZeRO-3, the two offloads."""
    batch = same_batch(stage0_micro)
    at = dataclasses.replace(base_setting(gpu), micro_batch=batch["zero2_micro"], grad_accum=ACCUMULATION)
    found = []
    if "article" in experiments:
        found.append(Trial("zero2-accum4", "article", f"ZeRO-2, micro-batch {at.micro_batch} x accumulation "
                           f"{ACCUMULATION}", dataclasses.replace(at, stage=2)))
        if batch["stage0_accum"] not in (None, 1):
            found.append(Trial("stage0-same-batch", "article",
                               f"stage 0, micro-batch {stage0_micro} x accumulation {batch['stage0_accum']}",
                               dataclasses.replace(at, stage=0, micro_batch=stage0_micro,
                                                   grad_accum=batch["stage0_accum"])))
    if "stages" in experiments:
        found.append(Trial("zero3", "stages", "ZeRO-3", dataclasses.replace(at, stage=3)))
    if "offload" in experiments:
        # offload steps with DeepSpeed's CPU Adam, which the optimizer "fused" leaves DeepSpeed to choose
        off = dataclasses.replace(at, optimizer="fused")
        found.append(Trial("zero2-offload-optimizer", "offload", "ZeRO-2, optimizer offloaded",
                           dataclasses.replace(off, stage=2), "optimizer"))
        found.append(Trial("zero3-offload-params", "offload", "ZeRO-3, parameters and optimizer offloaded",
                           dataclasses.replace(off, stage=3), "optimizer+params"))
    return found


# --- predictions and measurements ---------------------------------------------------------------------

def predict(trial: Trial, params: int, world_size: int) -> dict:
    """The course calculator's figures for one run (:mod:`helpers.core.theory`): model-state bytes per GPU and per
    rank on the host by kind (:func:`~helpers.core.theory.placement`), the host's total over the ranks, and the
    paper's collectives of one optimizer step with the bytes each rank sends on a ring. Activations, buffers and the
    framework are not model states: the measured GPU peak adds them."""
    s = trial.setting
    where = theory.placement(params, s.stage, world_size, s.precision, offload_optimizer=trial.offload != "none",
                             offload_param=trial.offload == "optimizer+params")
    collectives = theory.step_collectives(params, s.stage, s.precision)
    return {"model_states_gpu_bytes": where["gpu"], "model_states_host_bytes_per_rank": where["offloaded"],
            "host_bytes_all_ranks": where["offloaded"]["total"] * world_size,
            "collectives_per_step": [{"op": op, "message_bytes": size,
                                      "ring_bytes_per_rank": theory.ring_bytes(op, size, world_size)}
                                     for op, size in collectives],
            "ring_bytes_per_rank_per_step": sum(theory.ring_bytes(op, size, world_size) for op, size in collectives),
            "note": ("paper's collectives for one optimizer step; DeepSpeed's ZeRO-2 and ZeRO-3 reduce gradients on "
                     "every micro-step, so with accumulation they may send more")}


def measured(record: records.Record) -> dict:
    """What one run's record measured: throughput (tokens/s, model TFLOP/s per GPU, MFU, median step and the
    measured steps), GPU peak and model states per rank, host peak and placement, one step's collectives."""
    t, memory = record["throughput"], record.summary["memory"]
    steps = [t["all_step_times_s"][i - 1] for i in t["measured_steps"]]
    placement = memory.get("placement_bytes_per_rank") or []
    return {"tokens_per_s": t["tokens_per_s"], "tflops_per_gpu": t["tflops_per_gpu"], "mfu": t["mfu"],
            "step_time_s": t["step_time_s"], "measured_step_times_s": steps,
            "peak_bytes_per_rank": memory["peak_bytes_per_rank"], "peak_source": memory.get("peak_source"),
            "model_states_bytes_per_rank": memory.get("model_states_at_boundary_bytes_per_rank"),
            "host_peak_bytes_per_rank": memory.get("host_peak_bytes_per_rank"),
            "placement_bytes_per_rank": placement,
            "collectives_logged_step": record.summary.get("logged_step"),
            "comm_exposed_share": (record.summary.get("comm_share") or {}).get("exposed_share"),
            "optimizer": record.summary.get("basic_optimizer"), "losses": record.losses}


def is_final(entry: dict) -> bool:
    """Whether a run needs no more tries: it was measured, it ran out of memory, or it failed :data:`ATTEMPTS`
    times otherwise (a timeout, or never starting after another run hung, does not count: the run did not fail)."""
    return entry.get("status") in ("measured", "out of memory") or entry.get("attempts", 0) >= ATTEMPTS


# --- the reference file ---------------------------------------------------------------------------

def device_tag(env: environment.Environment, world_size: int) -> str:
    """``2xNVIDIA-H200`` (or ``2xCPU``): how the course's references name a machine."""
    name = env.device_name.split(" x ", 1)[-1] if env.is_gpu else "CPU"
    return f"{world_size}x{name}".replace(" ", "-")


def reference_path(size: str, env: environment.Environment, world_size: int) -> Path:
    return references.NEW_REFERENCE_DIR / f"article-{size}-{device_tag(env, world_size)}.json"


def new_reference(size: str, params: int, env: environment.Environment, world_size: int, steps: int) -> dict:
    """An empty reference: the machine (software, hardware), the model, and the MFU peak the course uses."""
    peak, source = performance.peak_tflops(env.device_name)
    return {"experiment": f"article-{size}", "device": f"{world_size} x {env.device_name.split(' x ', 1)[-1]}",
            "date": datetime.date.today().isoformat(), "note": "benchmarks/article_7b.py",
            "software": environment.software(), "hardware": environment.hardware(env),
            "stated_conditions": os.environ.get(references.CONDITIONS_VARIABLE, ""), "conditions": "", "claim": CLAIM,
            "size": size, "params": params, "world_size": world_size, "steps": steps,
            "peak_tflops": peak, "peak_source": source, "trials": {}, "launches": []}


def save(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def estimate(data: dict, trials: list[Trial], gpu: bool) -> float:
    """Seconds a launch of ``trials`` should take: a launch's start and each run's share (offloading runs count
    :data:`OFFLOAD_FACTOR` times), the share from this reference's timed launches (their median, less the start:
    one launch that waited for something else does not set every later estimate) where there are any, else
    :data:`FIRST_GUESS_S`."""
    weight = sum(OFFLOAD_FACTOR if t.offload != "none" else 1.0 for t in trials)
    timed = [(l["seconds"], l["weight"]) for l in data["launches"] if l.get("weight")]
    start, each = FIRST_GUESS_S["gpu" if gpu else "cpu"]
    if timed:
        each = statistics.median(max(seconds - start, 0.0) / w for seconds, w in timed)
    return start + each * weight


def fitting(data: dict, trials: list[Trial], left: float, gpu: bool) -> list[Trial]:
    """The longest head of ``trials`` whose launch should end within ``left`` seconds."""
    for n in range(len(trials), 0, -1):
        if estimate(data, trials[:n], gpu) <= left:
            return trials[:n]
    return []


def run_launch(data: dict, path: Path, name: str, trials: list[Trial], size: str, steps: int, world: int,
               timeout: float) -> None:
    """Store the predictions, train ``trials`` in ONE launch inside the load guard, store what each measured or
    the error that ended it (its whole first line: DeepSpeed's or torch's own words)."""
    folder = launch.RUNS_DIR / "article" / size
    for t in trials:
        entry = data["trials"].setdefault(t.name, {"attempts": 0})
        entry.update({"experiment": t.experiment, "label": t.label, "setting": dataclasses.asdict(t.setting),
                      "offload": t.offload, "config": t.config(world), "status": "launched", "launch": name,
                      "prediction": predict(t, data["params"], world)})
    save(data, path)  # the predictions, before anything trains
    specs = [t.spec(size, steps, world, folder) for t in trials]
    started = time.monotonic()
    with load_guard.watch(ranks=world) as watched:
        try:
            results = launch.sweep(specs, name=f"article/{size}/{name}", world_size=world, timeout=timeout)
        except launch.RunFailed as failure:  # a rank died or the launch timed out: keep the runs that finished
            results = {}
            for spec in specs:
                try:
                    results[spec.name] = records.load(launch.run_folder(spec, world))
                except (OSError, ValueError):
                    results[spec.name] = None  # did not run, unless it is the run that failed (below)
            unfinished = [spec for spec in specs if results[spec.name] is None]
            failed = next((spec for spec in unfinished if failure.out is not None
                           and Path(failure.out).resolve() == launch.run_folder(spec, world).resolve()),
                          unfinished[0] if unfinished else None)
            if failed is not None:  # the runs after it never started: "not run", tried again next call
                results[failed.name] = failure
    seconds = time.monotonic() - started
    for t in trials:
        entry, result = data["trials"][t.name], results.get(t.name)
        if isinstance(result, records.Record):
            entry.update(status="measured", measured=measured(result), failure=None, summary=result.summary)
            continue
        text = str(result) if result is not None else "did not run"
        status = ("out of memory" if OUT_OF_MEMORY.search(text) else "timed out" if TIMED_OUT.search(text)
                  else "not run" if NOT_RUN.match(text) else "failed")
        entry.update(status=status, failure=text[:2000])
        if status == "failed":
            entry["attempts"] += 1
    data["launches"].append({"name": name, "trials": [t.name for t in trials], "seconds": seconds,
                             "weight": sum(OFFLOAD_FACTOR if t.offload != "none" else 1.0 for t in trials),
                             "timeout_s": timeout, "load": dataclasses.asdict(watched.load),
                             "load_described": watched.load.describe(), "alone": watched.load.alone})
    save(data, path)


# --- the article's verdict ------------------------------------------------------------------------

def article_comparison(data: dict) -> dict | None:
    """Data parallelism at the shared effective batch against ZeRO-2 with accumulation 4, from the reference:
    tokens/s of each, their ratio, and the load guard's verdict on their measured steps (given only where both
    launches had their devices to themselves). None until ZeRO-2 was measured."""
    trials = data["trials"]
    zero2 = trials.get("zero2-accum4", {})
    if zero2.get("status") != "measured":
        return None
    stage0_micro = largest_fitting(trials)
    dp_name = "stage0-same-batch" if "stage0-same-batch" in trials else (
        f"stage0-micro{stage0_micro}" if stage0_micro else None)
    dp = trials.get(dp_name, {}) if dp_name else {}
    if dp.get("status") != "measured":
        tried = sorted(e["setting"]["micro_batch"] for n, e in trials.items() if n.startswith("stage0-micro"))
        return {"data_parallel": None, "zero2": zero2["label"],
                "sentence": (f"Data parallelism without ZeRO trained at no micro-batch tried ({tried}); ZeRO-2 with "
                             f"accumulation {ACCUMULATION} trained {zero2['measured']['tokens_per_s']:,.0f} tokens/s: "
                             "the article's speed comparison has no baseline here, only its memory claim.")}
    loads = [load_guard.Load.from_dict(l["load"]) for l in data["launches"]
             if {dp_name, "zero2-accum4"} & set(l["trials"])]
    load = next((l for l in loads if not l.alone), loads[-1]) if loads else load_guard.Load.unknown()
    verdict = load_guard.compare({dp["label"]: dp["measured"]["measured_step_times_s"],
                                  zero2["label"]: zero2["measured"]["measured_step_times_s"]}, load)
    ratio = zero2["measured"]["tokens_per_s"] / dp["measured"]["tokens_per_s"]
    return {"data_parallel": dp["label"], "zero2": zero2["label"], "tokens_per_s_ratio": ratio,
            "verdict_given": verdict.given,
            "sentence": (f"ZeRO-2 with accumulation {ACCUMULATION} trained {ratio:.2f}x the tokens/s of {dp['label']} "
                         f"(the article: about 1.3x). " + load_guard.sentence(verdict))}


def table(data: dict) -> str:
    """One row per run: status, predicted and measured GPU model states, GPU and host peak, step time, tokens/s,
    MFU."""
    gib = 2 ** 30
    rows = []
    for name, e in data["trials"].items():
        p, m = e.get("prediction", {}), e.get("measured") or {}
        states = (m.get("model_states_bytes_per_rank") or [None])[0]  # DeepSpeed's buffers are not model states
        states = {k: v for k, v in states.items() if k != "buffers"} if states else None
        rows.append([name, e.get("status", "-"), f"{p['model_states_gpu_bytes']['total'] / gib:.1f}" if p else "-",
                     f"{sum(states.values()) / gib:.1f}" if states else "-",
                     f"{max(m['peak_bytes_per_rank']) / gib:.1f}" if m else "-",
                     f"{max(m['host_peak_bytes_per_rank'] or [0]) / gib:.1f}" if m else "-",
                     f"{m['step_time_s']:.3g}" if m else "-", f"{m['tokens_per_s']:,.0f}" if m else "-",
                     "-" if not m or m["mfu"] is None else f"{m['mfu']:.1%}"])
    return records.format_table(rows, ["run", "status", "states GiB (calc)", "states GiB", "peak GiB",
                                       "host peak GiB", "step s", "tokens/s", "MFU"])


def plan_table(size: str, experiments: tuple[str, ...], world_size: int) -> str:
    """The runs of ``experiments`` on ``world_size`` GPUs (the later ones at the batch data parallelism would
    fit at its smallest micro-batch) with the calculator's model states per GPU, host bytes of all ranks and ring
    bytes each rank sends per optimizer step (:func:`predict`)."""
    gib, params = 2 ** 30, capstone.model_parameters(size)
    smallest = min(STAGE0_MICRO_BATCHES["gpu"])
    trials = (stage0_trials(True) if "article" in experiments else []) + later_trials(True, experiments, smallest)
    rows = []
    for t in trials:
        p = predict(t, params, world_size)
        rows.append([t.name, t.label, f"{p['model_states_gpu_bytes']['total'] / gib:.1f}",
                     f"{p['host_bytes_all_ranks'] / gib:.1f}", f"{p['ring_bytes_per_rank_per_step'] / gib:.1f}"])
    return (f"{size}: {params:,} parameters, {world_size} GPUs, bf16, sequences of 2048\n"
            + records.format_table(rows, ["run", "what", "states GiB/GPU", "host GiB (all ranks)",
                                          "ring GiB/rank/step"]))


# --- the command ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("7b", "tiny"), help="default: 7b on GPUs, tiny on CPU")
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS),
                        help=f"comma-separated, among {', '.join(EXPERIMENTS)} (default: all)")
    parser.add_argument("--budget", type=float, default=480, help="seconds for this call (default 480)")
    parser.add_argument("--world-size", type=int, help="ranks (default: every GPU chosen, 2 on CPU)")
    parser.add_argument("--fresh", action="store_true", help="start again: ignore the stored reference")
    parser.add_argument("--plan", action="store_true", help="print the runs and the calculator's predictions for "
                        "--world-size GPUs (default 2), and train nothing")
    args = parser.parse_args(argv)
    experiments = tuple(e for e in args.experiments.split(",") if e)
    unknown = sorted(set(experiments) - set(EXPERIMENTS))
    if unknown or not experiments:
        parser.error(f"--experiments {unknown or args.experiments!r}: choose among {', '.join(EXPERIMENTS)}")
    if args.plan:
        print(plan_table(args.size or "7b", experiments, args.world_size or 2))
        return 0
    started = time.monotonic()
    for key, value in capstone.RANK_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    env = environment.detect(args.world_size)
    world, gpu = env.default_world_size, env.is_gpu
    size = args.size or ("7b" if gpu else "tiny")
    steps = STEPS["gpu" if gpu else "cpu"]
    params = capstone.model_parameters(size)
    path = reference_path(size, env, world)
    data = json.loads(path.read_text()) if path.exists() and not args.fresh else \
        new_reference(size, params, env, world, steps)
    print(env.report(), flush=True)
    print(f"article: {size} model ({params:,} parameters), {', '.join(experiments)}, budget {args.budget:.0f} s, "
          f"reference {path}" + (" (resumed)" if data["trials"] else ""), flush=True)

    def pending(trials: list[Trial]) -> list[Trial]:
        return [t for t in trials if not is_final(data["trials"].get(t.name, {}))]

    waves = []
    if "article" in experiments:
        waves.append(("stage0", lambda: stage0_trials(gpu)))
    waves.append(("rest", lambda: later_trials(gpu, experiments, largest_fitting(data["trials"]))))
    skipped: list[str] = []
    for wave, make in waves:
        todo = pending(make())
        while todo:
            left = args.budget - (time.monotonic() - started)
            batch = fitting(data, todo, left, gpu)
            if not batch:
                skipped += [t.name for t in todo]
                break
            name = f"{wave}-{len(data['launches']) + 1}"
            print(f"launch {name}: {', '.join(t.name for t in batch)} (about {estimate(data, batch, gpu):.0f} s, "
                  f"{left:.0f} s left)", flush=True)
            run_launch(data, path, name, batch, size, steps, world, timeout=max(60.0, left))
            for t in batch:
                entry = data["trials"][t.name]
                print(f"  {t.name}: {entry['status']}" + (f": {entry['failure'].splitlines()[0][:300]}"
                                                          if entry.get("failure") else ""), flush=True)
            progressed = [t for t in batch if is_final(data["trials"][t.name])]
            todo = pending(make())
            if not progressed and any(data["trials"][t.name]["status"] == "timed out" for t in batch):
                skipped += [t.name for t in todo]
                todo = []
        if skipped:
            break  # a later wave may depend on this one: the next call goes on from here
    comparison = article_comparison(data)
    if comparison is not None:
        data["article_comparison"] = comparison
    data["conditions"] = "; ".join(filter(None, [data["stated_conditions"]] + [
        f"launch {l['name']}: {l['load_described']}" for l in data["launches"]]))
    save(data, path)
    print(table(data))
    if comparison is not None:
        print(comparison["sentence"])
    if skipped:
        print(f"left for the next call (same command): {', '.join(skipped)}")
    print(f"reference: {path}  ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
