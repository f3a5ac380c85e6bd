"""The latency-bandwidth (alpha-beta) model of communication, fitted to measured collectives (chapter 09).

One call of a collective that makes each rank send ``w`` bytes takes

    t(w) = alpha + beta * w

``alpha`` (seconds) is what every call costs whatever its size (software, synchronisation, the
network's latency); ``1 / beta`` (bytes/s) is the bandwidth the bytes flow at. ``w`` is the ring's
wire bytes per rank (:func:`helpers.theory.wire_bytes`): 2(n-1)/n S for all_reduce, (n-1)/n S for
all_gather and reduce_scatter, S for broadcast, so ``1 / beta`` is nccl-tests' bus bandwidth of large
messages, and a link of B bytes/s per direction has ``beta = 1 / B``.

:func:`fit` recovers alpha and beta from (bytes, seconds) points; :class:`CommModel` holds one fit per
collective (from :mod:`helpers.collectives`' benchmark) and predicts the communication seconds of a
training step from the collectives DeepSpeed's comms logger recorded for it. :func:`profile` and
:func:`extrapolate` split a measured step into computation and communication, phase by phase
(the ``micro_steps`` probe), so :func:`what_if` can predict step time on other links and at other
accumulation settings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from helpers import records, theory

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
GBIT = 1e9 / 8  # bytes/s in one gigabit per second

#: What-if links: bytes/s per direction. Network cards at their nominal line rate; NVLink 4 (H100/H200):
#: 18 links of 25 GB/s each way, 450 GB/s per direction.
LINKS = {"10 Gb/s": 10 * GBIT, "25 Gb/s": 25 * GBIT, "100 Gb/s": 100 * GBIT, "400 Gb/s": 400 * GBIT,
         "NVLink 4": 450e9}


def collective_of(op: str) -> str:
    """The collective an op name of DeepSpeed's comms logger is: ``all_gather_into_tensor`` -> ``all_gather``."""
    if op.startswith(("all_reduce", "inference_all_reduce")):
        return "all_reduce"
    for name in ("all_gather", "reduce_scatter", "broadcast"):
        if op.startswith(name):
            return name
    raise KeyError(f"op {op!r}: the model knows {', '.join(COLLECTIVES)} (and their DeepSpeed variants)")


#: The model itself lives in :mod:`helpers.theory`, beside every other formula that turns bytes into seconds.
AlphaBeta = theory.AlphaBeta


def fit(wire_bytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares alpha and beta (both >= 0) on *relative* error, so a 1 KiB point counts as much as a 1 GiB one:
    minimise sum(((alpha + beta x_i) - t_i) / t_i)^2. Needs two or more points of different sizes."""
    x, t = [float(v) for v in wire_bytes], [float(v) for v in seconds]
    if len(x) != len(t):
        raise ValueError(f"{len(x)} sizes but {len(t)} times")
    if len(set(x)) < 2:
        raise ValueError("fitting alpha and beta needs measurements at two or more different sizes")
    if any(v <= 0 for v in t) or any(v < 0 for v in x):
        raise ValueError("times must be positive and sizes non-negative")
    # Weighted normal equations of rows (1/t_i, x_i/t_i) against 1.
    s11 = sum(1 / v**2 for v in t)
    s12 = sum(a / v**2 for a, v in zip(x, t))
    s22 = sum(a * a / v**2 for a, v in zip(x, t))
    r1 = sum(1 / v for v in t)
    r2 = sum(a / v for a, v in zip(x, t))
    det = s11 * s22 - s12 * s12
    alpha = (r1 * s22 - r2 * s12) / det
    beta = (s11 * r2 - s12 * r1) / det
    if alpha < 0:  # bandwidth only: the line through the origin
        alpha, beta = 0.0, r2 / s22
    if beta < 0:  # latency only
        alpha, beta = r1 / s11, 0.0
    return AlphaBeta(alpha, beta)


def relative_errors(model: AlphaBeta, wire_bytes: Sequence[float], seconds: Sequence[float]) -> list[float]:
    """(predicted - measured) / measured at each point."""
    return [(model.seconds(x) - t) / t for x, t in zip(wire_bytes, seconds)]


@dataclasses.dataclass
class CommModel:
    """One :class:`AlphaBeta` per collective, for ``world_size`` ranks; ``source`` says where it came from."""

    fits: dict[str, AlphaBeta]
    world_size: int
    source: str = ""

    def fit_for(self, op: str) -> AlphaBeta:
        name = collective_of(op)
        if name not in self.fits:
            raise KeyError(f"no fit for {name} (fitted: {', '.join(self.fits)}); benchmark it too")
        return self.fits[name]

    def seconds(self, op: str, logged_bytes: float, calls: float = 1.0) -> float:
        """Predicted seconds of ``calls`` calls of ``op`` whose sizes, as DeepSpeed's comms logger records them,
        add up to ``logged_bytes``."""
        return self.fit_for(op).seconds(theory.wire_bytes(op, logged_bytes, self.world_size), calls)

    def predict(self, by_op: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """op -> predicted seconds, for a table of op -> {count, bytes} (a record's ``comm.by_op``)."""
        return {op: self.seconds(op, row["bytes"], row["count"]) for op, row in by_op.items()}

    def predict_total(self, by_op: Mapping[str, Mapping[str, float]]) -> float:
        return sum(self.predict(by_op).values())

    @classmethod
    def from_benchmark(cls, result: dict, implementation: str = "deepspeed.comm",
                       ops: Sequence[str] | None = None) -> "CommModel":
        """Fit every collective ``implementation`` was measured with in a :mod:`helpers.collectives` summary."""
        from helpers import collectives

        fits = {}
        for op in ops or COLLECTIVES:
            points = collectives.rows(result, implementation, op)
            if len({p["wire_bytes"] for p in points}) >= 2:
                fits[op] = fit([p["wire_bytes"] for p in points], [p["seconds"] for p in points])
        if not fits:
            raise ValueError(f"no collective measured at two sizes with {implementation}")
        where = f"{result['world_size']} x {result['device_name']}" + (" in course namespaces"
                                                                       if result.get("namespace") else "")
        return cls(fits, result["world_size"], f"{implementation} benchmark, {where}")

    @classmethod
    def for_link(cls, bandwidth: float, alpha: float, world_size: int, name: str = "") -> "CommModel":
        """Every collective on a link of ``bandwidth`` bytes/s per direction and ``alpha`` seconds per call."""
        fits = {op: AlphaBeta(alpha, 1.0 / bandwidth) for op in COLLECTIVES}
        return cls(fits, world_size, name or f"{bandwidth / 1e9:.3g} GB/s link, alpha {alpha * 1e6:.0f} us")


def fit_table(model: CommModel, result: dict | None = None, implementation: str = "deepspeed.comm") -> str:
    """alpha, 1/beta and the half-bandwidth message of each fitted collective, with the fit's worst relative
    error over the benchmark's points when ``result`` is given."""
    from helpers import collectives

    table = []
    for op, ab in model.fits.items():
        row = [op, f"{ab.alpha * 1e6:,.1f}", f"{ab.bandwidth / 1e9:.3g}", records.format_bytes(ab.half_bandwidth_bytes)]
        if result is not None:
            points = collectives.rows(result, implementation, op)
            errors = relative_errors(ab, [p["wire_bytes"] for p in points], [p["seconds"] for p in points])
            row.append(f"{max(abs(e) for e in errors):.0%}")
        table.append(row)
    headers = ["collective", "alpha us", "1/beta GB/s", "alpha/beta"] + (["worst fit error"] if result else [])
    return records.format_table(table, headers)


# --- a training step, split into computation and communication ---------------------------------

@dataclasses.dataclass
class StepProfile:
    """One optimizer step: collectives (op -> count, logged bytes) and the seconds spent outside them."""

    name: str
    stage: int
    accum: int
    micro_batch: int
    world_size: int
    compute_s: float  # measured step time minus measured collective time
    by_op: dict[str, dict[str, float]]
    measured_step_s: float | None = None
    measured_comm_s: float | None = None

    @property
    def samples(self) -> int:
        return self.micro_batch * self.accum * self.world_size


def _phase_ops(record: records.Record, phase: str) -> dict[str, dict[str, float]]:
    return {op: {"count": row["count"], "bytes": row["bytes"]}
            for op, row in record["micro_steps"]["by_phase"].get(phase, {}).items()}


def _phase_comm(record: records.Record, phase: str) -> float:
    return sum(row["seconds"] for row in record["micro_steps"]["by_phase"].get(phase, {}).values())


def _add(total: dict, ops: Mapping[str, Mapping[str, float]], times: float = 1.0) -> dict:
    for op, row in ops.items():
        target = total.setdefault(op, {"count": 0.0, "bytes": 0.0})
        target["count"] += row["count"] * times
        target["bytes"] += row["bytes"] * times
    return total


def profile(record: records.Record) -> StepProfile:
    """A measured run (probes ``timing`` and ``micro_steps``) as computation + collectives of one step.

    Computation is the sum over phases of wall time minus collective time (rank 0), so the two add up
    to the step as the probe timed it."""
    s = record.summary
    ms = record["micro_steps"]
    by_op: dict = {}
    for phase in ms["phases"]:
        _add(by_op, _phase_ops(record, phase))
    comm = sum(_phase_comm(record, p) for p in ms["phases"])
    compute = sum(ms["wall_s_by_phase"].values()) - comm
    return StepProfile(s["name"], s["zero_stage"], s["grad_accum"], s["micro_batch"], s["world_size"],
                       max(compute, 0.0), by_op, sum(ms["wall_s_by_phase"].values()), comm)


def extrapolate(record: records.Record, accum: int) -> StepProfile:
    """The step of ``record``'s configuration at another accumulation ``accum``, same micro batch (so the
    global batch grows with it), built from its measured phases: the first micro-step stands for every
    micro-step off the accumulation boundary, the last for the one on it, the optimizer step as it was.
    Needs a run with accumulation 2 or more (one micro-step off the boundary)."""
    ms = record["micro_steps"]
    if record["grad_accum"] < 2:
        raise ValueError(f"{record.summary['name']}: accumulation {record['grad_accum']} has no micro-step off "
                         "the boundary to extrapolate from; measure with accumulation 2 or more")
    if not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum={accum!r}: a whole number of micro-steps, 1 or more")
    off, last, step = "micro-step 1", ms["phases"][-2], ms["phases"][-1]
    wall = ms["wall_s_by_phase"]
    by_op = _add(_add(_add({}, _phase_ops(record, off), accum - 1), _phase_ops(record, last)), _phase_ops(record, step))
    compute = ((accum - 1) * (wall[off] - _phase_comm(record, off)) + wall[last] - _phase_comm(record, last)
               + wall[step] - _phase_comm(record, step))
    s = record.summary
    return StepProfile(f"{s['name']} at accumulation {accum}", s["zero_stage"], accum, s["micro_batch"],
                       s["world_size"], max(compute, 0.0), by_op)


def predict_step(profile_: StepProfile, model: CommModel, overlap: bool = False) -> dict[str, float]:
    """Predicted ``comm_s``, ``step_s`` (computation + communication, or the larger of the two when the
    communication ``overlap``\\ s computation perfectly), ``comm_share`` and ``samples_per_s``."""
    comm = model.predict_total(profile_.by_op)
    step = max(profile_.compute_s, comm) if overlap else profile_.compute_s + comm
    return {"comm_s": comm, "step_s": step, "comm_share": comm / (profile_.compute_s + comm),
            "samples_per_s": profile_.samples / step}


def what_if(profiles: Sequence[StepProfile], alpha: float, links: Mapping[str, float] = LINKS) -> list[dict]:
    """For every profile and link (bytes/s per direction): the predicted step on that link, serial."""
    found = []
    for p in profiles:
        for link, bandwidth in links.items():
            model = CommModel.for_link(bandwidth, alpha, p.world_size, link)
            found.append({"profile": p, "link": link, "bandwidth": bandwidth, **predict_step(p, model)})
    return found


def what_if_table(rows: Sequence[dict]) -> str:
    """Step time (ms), communication share and samples/s per stage, accumulation and link."""
    links = list(dict.fromkeys(r["link"] for r in rows))
    profiles = list(dict.fromkeys(id(r["profile"]) for r in rows))
    by = {(id(r["profile"]), r["link"]): r for r in rows}
    table = []
    for pid in profiles:
        p = next(r["profile"] for r in rows if id(r["profile"]) == pid)
        cells = [f"ZeRO-{p.stage}", f"{p.accum}", f"{p.samples}"]
        for link in links:
            r = by[(pid, link)]
            cells.append(f"{r['step_s'] * 1e3:,.1f} ms ({r['comm_share']:.0%})")
        table.append(cells)
    return records.format_table(table, ["stage", "accum", "batch"] + [f"{link}: step (comm)" for link in links])


def comparison_rows(runs: Mapping[str, records.Record], model: CommModel) -> list[dict]:
    """Per run: collectives per step, measured collective seconds (``micro_steps``) and the model's prediction
    from the bytes the comms logger recorded (``comm.by_op``)."""
    found = []
    for name, r in runs.items():
        measured = r["micro_steps.comm_s_per_step"]
        predicted = model.predict_total(r.comm_ops())
        found.append({"name": name, "stage": r.stage, "accum": r["grad_accum"],
                      "calls": sum(row["count"] for row in r.comm_ops().values()),
                      "bytes": r["comm.bytes_per_step"], "measured_s": measured, "predicted_s": predicted,
                      "error": (predicted - measured) / measured if measured else math.nan})
    return found


def comparison_table(rows: Sequence[dict], tolerance: float | None = None) -> str:
    """Measured against predicted communication seconds per step, with the relative error (and, with a
    ``tolerance``, whether the prediction is within it)."""
    table = [[r["name"], f"{r['calls']:g}", f"{r['bytes']:,.0f}", f"{r['measured_s'] * 1e3:.2f}",
              f"{r['predicted_s'] * 1e3:.2f}", f"{r['error']:+.0%}"]
             + ([("yes" if abs(r["error"]) <= tolerance else "no")] if tolerance is not None else []) for r in rows]
    return records.format_table(table, ["run", "calls/step", "logged bytes/step", "measured ms", "predicted ms",
                                        "error"] + ([f"within {tolerance:.0%}"] if tolerance is not None else []))


# --- chapter 09's runs: the model against measurements, on a fast and a slow link ----------------

#: The slow link of chapter 09 on CPU ranks, per rank and direction: slow enough that a 2 MB gradient
#: all-reduce (42 ms) outweighs the small model's computation, fast enough to keep the notebook short.
SLOW_RATE_MBIT = 400


def stage_specs(prefix: str = "", model: str = "mlp", precision: str = "fp32", micro_batch: int = 4, steps: int = 3,
                stages: Sequence[int] = (0, 1, 2, 3), extra: Sequence[tuple[int, int]] = ((1, 1), (2, 1)),
                overlap_stage: int | None = 2, accum: int = 4) -> dict:
    """RunSpecs of one link's training runs (micro batch fixed): every stage at accumulation ``accum``, the
    ``extra`` (stage, accumulation) pairs, all with the ``comm`` and ``micro_steps`` probes; and
    ``overlap_stage`` at ``accum`` with ``overlap_comm`` off and on, timed without the comms logger."""
    from helpers import accumulation, launch

    logged = ("timing", "comm", "micro_steps")
    specs = {}
    for stage, a in [(s, accum) for s in stages] + list(extra):
        specs[f"{prefix}zero{stage}-acc{a}"] = launch.RunSpec(
            f"zero{stage}", model=model, steps=steps, probes=logged,
            overrides=accumulation.overrides(micro_batch, a, precision))
    if overlap_stage is not None:
        for flag in (False, True):
            o = accumulation.overrides(micro_batch, accum, precision)
            o["zero_optimization"] = {"overlap_comm": flag}
            specs[f"{prefix}zero{overlap_stage}-acc{accum}-overlap-{'on' if flag else 'off'}"] = launch.RunSpec(
                f"zero{overlap_stage}", model=model, steps=steps, probes=("timing",), overrides=o)
    return specs


SLOW = "slow-"  # name prefix of the runs on the slow link


def logged_runs(runs: Mapping[str, object], slow: bool = False) -> dict[str, records.Record]:
    """The training runs of a sweep that carry the ``micro_steps`` probe, on the fast link (or the slow one),
    by name (without the slow prefix)."""
    return {name.removeprefix(SLOW): r for name, r in runs.items() if name.startswith(SLOW) == slow
            and isinstance(r, records.Record) and "micro_steps" in r.summary.get("probes", [])}


def run_chapter(model: str = "mlp", precision: str = "fp32", micro_batch: int = 4, steps: int = 3,
                rate_mbit: float = SLOW_RATE_MBIT, env=None, timeout: float = 600) -> tuple[dict, str]:
    """Chapter 09's measurements in ONE launch: the collective benchmark and the training runs of
    :func:`stage_specs`; where the machine allows it (CPU ranks, :func:`helpers.network.link_support`), with
    every rank in its own network namespace, then, after the link is cut to ``rate_mbit``, a smaller
    benchmark (``slow-collectives``) and the same runs of stages 1 and 2 named ``slow-...``.
    Returns {name: record or benchmark summary} and a sentence saying which links were used. The launch's
    own files go to ``runs/bandwidth-<model>/``; it is stopped after ``timeout`` seconds."""
    from helpers import collectives, environment, launch, network

    env = env or environment.detect()
    world = env.default_world_size
    specs = {"collectives": collectives.spec(is_gpu=env.is_gpu, out=launch.RUNS_DIR / f"collectives-{model}")}
    specs.update(stage_specs(model=model, precision=precision, micro_batch=micro_batch, steps=steps))
    ok, why = (False, "GPU ranks use NCCL: see network.nccl_over_sockets") if env.is_gpu else network.link_support()
    if not ok or world < 2:
        runs = launch.sweep(specs, name=f"bandwidth-{model}", timeout=timeout)
        return runs, f"one link only (the ranks' loopback): no slow link here, because {why if world > 1 else 'one rank'}"
    specs[f"{SLOW}rate"] = network.set_rate_spec(f"{SLOW}rate", rate_mbit)
    specs[f"{SLOW}collectives"] = collectives.spec(f"{SLOW}collectives", sizes=(2**14, 2**18, 2**21),
                                                  ops=("all_reduce", "all_gather"), implementations=("deepspeed.comm",),
                                                  iters=3, warmup=1, is_gpu=False,
                                                  out=launch.RUNS_DIR / f"{SLOW}collectives-{model}")
    specs.update(stage_specs(SLOW, model=model, precision=precision, micro_batch=micro_batch, steps=steps,
                             stages=(1, 2)))
    with network.rate_limited_link(world, None) as link:
        runs = launch.sweep(specs, name=f"bandwidth-{model}", timeout=timeout, rank_prefix=link.rank_prefix,
                            master_addr=link.master_addr)
    return runs, (f"{link.describe()}; then cut to {rate_mbit:g} Mbit/s per rank and direction for the "
                  f"'{SLOW}' runs")


def slow_link_rows(fast: Mapping[str, object], slow: Mapping[str, object], link_model: CommModel,
                   nominal: CommModel | None = None, prefix: str = SLOW) -> list[dict]:
    """Per configuration run on both links: measured step time on each, and the slow link's step predicted from
    the fast run (its computation, measured) plus the slow link's communication (``link_model``, fitted on
    the slow link; ``nominal``: from the link's set rate alone). Timed-only runs (``overlap_comm`` off/on)
    borrow computation and collectives from the logged run of the same stage and accumulation; for them
    the prediction is a range, from no overlap to perfect overlap."""
    found = []
    for name, s_run in slow.items():
        if not name.startswith(prefix) or not isinstance(s_run, records.Record):
            continue
        key = name[len(prefix):]
        f_run = fast.get(key)
        if not isinstance(f_run, records.Record):
            continue
        timed_only = "micro_steps" not in s_run.summary.get("probes", [])
        base = f_run if not timed_only else fast.get(key.split("-overlap")[0])
        if not isinstance(base, records.Record) or "micro_steps" not in base.summary.get("probes", []):
            continue
        p = profile(base)
        serial = predict_step(p, link_model)
        row = {"name": key, "stage": s_run.stage, "accum": s_run["grad_accum"], "batch": s_run["train_batch"],
               "fast_s": f_run["step_time_s.median"], "slow_s": s_run["step_time_s.median"],
               "predicted_s": serial["step_s"], "comm_s": serial["comm_s"], "compute_s": p.compute_s,
               "overlap_bound_s": predict_step(p, link_model, overlap=True)["step_s"] if timed_only else None,
               "nominal_s": predict_step(p, nominal)["step_s"] if nominal else None}
        found.append(row)
    return found


def slow_link_table(rows: Sequence[dict]) -> str:
    """Measured step times on both links beside the model's prediction for the slow one (ms), and samples/s."""
    table = []
    for r in rows:
        predicted = f"{r['predicted_s'] * 1e3:,.0f}"
        if r["overlap_bound_s"] is not None:
            predicted = f"{r['overlap_bound_s'] * 1e3:,.0f} .. {predicted}"
        table.append([r["name"], f"{r['batch']}", f"{r['fast_s'] * 1e3:,.1f}", f"{r['slow_s'] * 1e3:,.0f}", predicted,
                      "-" if r["nominal_s"] is None else f"{r['nominal_s'] * 1e3:,.0f}",
                      f"{r['batch'] / r['fast_s']:,.0f}", f"{r['batch'] / r['slow_s']:,.0f}"])
    return records.format_table(table, ["run", "batch", "fast link ms", "slow link ms", "predicted ms",
                                        "from set rate ms", "samples/s fast", "samples/s slow"])


#: The GPU-scale runs of chapter 09 (``python -m helpers reference bandwidth-nvlink|bandwidth-sockets``).
GPU_MODEL = {"model": "llama-265m", "precision": "bf16", "micro_batch": 4, "steps": 3}


def measure_gpu(transport: str = "nvlink") -> tuple[dict, object]:
    """GPU machines only: chapter 09 at GPU scale, saved with :func:`helpers.experiments.save_reference`.

    ``"nvlink"``: :func:`run_chapter` with :data:`GPU_MODEL` over NCCL's default transports (the
    benchmark from 1 KiB to 1 GiB, ``deepspeed.comm`` beside ``torch.distributed``), saved as
    ``bandwidth-nvlink``. ``"sockets"``: with NCCL kept off NVLink, peer-to-peer and shared memory
    (:func:`helpers.network.nccl_over_sockets`, restored after), a benchmark up to 256 MiB and the runs of
    stages 1 and 2 named ``slow-...``, saved as ``bandwidth-sockets`` with the transports NCCL's log names.
    Returns the runs and the file written."""
    from helpers import collectives, environment, experiments, network

    if transport not in ("nvlink", "sockets"):
        raise ValueError(f"transport={transport!r}: choose 'nvlink' or 'sockets'")
    if not environment.detect().is_gpu:
        raise RuntimeError("chapter 09's GPU-scale runs need GPUs")
    m = GPU_MODEL
    if transport == "nvlink":
        runs, _ = run_chapter(model=m["model"], precision=m["precision"], micro_batch=m["micro_batch"], steps=m["steps"],
                              timeout=3600)
        note = (f"benchmark 1 KiB-1 GiB and {m['model']} {m['precision']} runs (micro batch {m['micro_batch']}), "
                "NCCL's default transports")
        return runs, experiments.save_reference("bandwidth-nvlink", runs, note=note)
    from helpers import launch

    name = "bandwidth-sockets"
    with network.nccl_over_sockets() as settings:
        specs = {f"{SLOW}collectives": collectives.spec(f"{SLOW}collectives", sizes=collectives.GPU_SIZES[:-1], iters=5,
                                                       out=launch.RUNS_DIR / f"{SLOW}collectives-{m['model']}")}
        specs.update(stage_specs(SLOW, model=m["model"], precision=m["precision"], micro_batch=m["micro_batch"],
                                 steps=m["steps"], stages=(1, 2)))
        runs = launch.sweep(specs, name=name, timeout=3600)
    transports = network.nccl_transports(launch.RUNS_DIR / name / "launch.log")
    note = (f"NCCL over sockets ({', '.join(f'{k}={v}' for k, v in settings.items())}); channels by transport in "
            f"NCCL's log: {transports or 'none logged'}")
    return runs, experiments.save_reference(name, runs, note=note)


def extrapolation_check(runs: Mapping[str, records.Record], source_accum: int = 4, target_accum: int = 1) -> str:
    """For each stage measured at both accumulations: do the collectives :func:`extrapolate` predicts from the
    ``source_accum`` run equal, call for call and byte for byte, those measured at ``target_accum``?"""
    table = []
    by_key = {(r.stage, r["grad_accum"]): r for r in runs.values()}
    for (stage, accum), source in sorted(by_key.items()):
        target = by_key.get((stage, target_accum))
        if accum != source_accum or target is None:
            continue
        predicted = extrapolate(source, target_accum).by_op
        measured = {op: {"count": row["count"], "bytes": row["bytes"]} for op, row in target.comm_ops().items()}
        same = {op: (round(v["count"], 6), round(v["bytes"])) for op, v in predicted.items()} == \
               {op: (round(v["count"], 6), round(v["bytes"])) for op, v in measured.items()}
        table.append([f"ZeRO-{stage}", f"{source_accum} -> {target_accum}",
                      " ".join(f"{op.split('_into')[0]}:{v['count']:g}" for op, v in sorted(predicted.items())),
                      "yes" if same else "no"])
    return records.format_table(table, ["stage", "extrapolated", "collectives per step", "equal to the measured run"])


def reference_report(name: str = "bandwidth-nvlink", sockets: str = "bandwidth-sockets",
                     prediction_tolerance: float = 0.25) -> str:
    """Committed GPU results of chapter 09, each labelled with its device: the all_reduce target against raw
    torch.distributed, the fitted model, measured against predicted collective time per stage, the what-if
    from the GPU runs, and the runs over NCCL sockets; or a plain statement that none are committed yet."""
    from helpers import collectives, experiments

    found = experiments.reference_runs(name)
    if not found:
        return experiments.no_references(name, "run this notebook on a GPU machine to measure them.")
    over_sockets = {device: runs for device, _, _, runs in experiments.reference_runs(sockets)}
    parts = []
    for device, date, note, runs in found:
        bench = runs["collectives"]
        model = CommModel.from_benchmark(bench)
        fast = logged_runs(runs)
        parts += [f"Measured on {device}, {date} ({note}):",
                  "all_reduce bus bandwidth, deepspeed.comm against torch.distributed:", collectives.target_table(bench),
                  "alpha-beta fits (deepspeed.comm):", fit_table(model, bench),
                  "collective time per optimizer step, measured and predicted:",
                  comparison_table(comparison_rows(fast, model), prediction_tolerance)]
        accum4 = [r for r in fast.values() if r["grad_accum"] >= 2 and r.stage in (0, 1, 2, 3)]
        profiles = [extrapolate(r, a) for r in sorted(accum4, key=lambda r: r.stage) for a in (1, 4)]
        if profiles:
            parts += ["what-if from these runs (serial, alpha as fitted for all_reduce):",
                      what_if_table(what_if(profiles, model.fits["all_reduce"].alpha))]
        socket_runs = over_sockets.get(device)
        if socket_runs and f"{SLOW}collectives" in socket_runs:
            slow_model = CommModel.from_benchmark(socket_runs[f"{SLOW}collectives"])
            parts += ["NCCL over sockets instead of NVLink:", fit_table(slow_model, socket_runs[f"{SLOW}collectives"]),
                      slow_link_table(slow_link_rows(runs, socket_runs, slow_model))]
        parts.append("")
    return "\n".join(parts)
