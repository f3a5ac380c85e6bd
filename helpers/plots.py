"""The figures every chapter draws, from run records and the theory module.

Each function returns its figure already closed, so a notebook shows it exactly once: as the value
of the cell's last line (pyplot's own display of open figures would show it a second time).
"""

from __future__ import annotations

import io
import textwrap
from typing import Mapping, Sequence

import matplotlib.pyplot as plt

from helpers import records, theory

STATE_COLOURS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "master": "#C44E52"}


def loss_curves(runs: Mapping[str, Sequence[float]], title: str = "Training loss", ylabel: str = "loss",
                steps: int | None = None):
    """One line per run: loss against optimizer step (``steps`` fixes the axis for a run still training)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    styles = ["-", "--", ":", "-."]
    for i, (name, losses) in enumerate(runs.items()):
        ax.plot(range(1, len(losses) + 1), losses, styles[i % len(styles)], marker="o", markersize=3, label=name)
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    if steps:
        ax.set_xlim(0.5, steps + 0.5)
    if runs:
        ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def measured_vs_theory(runs: Sequence[records.Record], rank: int = 0, title: str | None = None):
    """Stacked bars of model-state bytes on one rank: measured (plain) beside the paper (hatched), per run.

    Communication buffers are left out (they can dwarf a small model's states; the tables show them).
    """
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(runs), 3.8))
    width = 0.38
    labelled: set[str] = set()
    for i, run in enumerate(runs):
        for offset, states, hatch in ((-width / 2, run.states(rank), ""), (width / 2, run.theory_states, "//")):
            bottom = 0.0
            for key in records.MODEL_STATE_KEYS:
                value = states.get(key, 0) / 2**20
                if value:
                    ax.bar(i + offset, value, width, bottom=bottom, color=STATE_COLOURS[key], hatch=hatch,
                           edgecolor="white", label=None if key in labelled else key)
                    labelled.add(key)
                    bottom += value
    ax.set_xticks(range(len(runs)), [f"{r.label}\nmeasured | paper" for r in runs], fontsize=8)
    ax.set_ylabel(f"MiB on rank {rank}")
    ax.set_title(title or f"Model states per rank ({runs[0].summary['world_size']} ranks)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def comm_per_step(runs: Sequence[records.Record], title: str = "Communication per optimizer step"):
    """Per run: bytes each rank sends per step (ring), by collective, beside the paper's volume."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(runs), 3.8))
    ops = sorted({op for r in runs for op in r.comm_ops()})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        n = run.summary["world_size"]
        bottom = 0.0
        for j, op in enumerate(ops):
            row = run.comm_ops().get(op)
            if row:
                value = theory.wire_bytes(op, row["bytes"], n) / 2**20
                ax.bar(i - 0.2, value, 0.38, bottom=bottom, color=colours[j % len(colours)],
                       label=op if op not in ax.get_legend_handles_labels()[1] else None)
                bottom += value
        ax.bar(i + 0.2, run["theory.comm_wire_bytes_per_step"] / 2**20, 0.38, color="lightgrey", hatch="//",
               label="paper x (n-1)/n" if i == 0 else None)
    ax.set_xticks(range(len(runs)), [f"{r.label}\nmeasured | paper" for r in runs], fontsize=8)
    ax.set_ylabel("MiB sent per rank per step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def paper_scaling(psi: float = 7.5e9, world_sizes: Sequence[int] = (1, 4, 8, 16, 64), k: int = theory.PAPER_K):
    """The paper's model-state GB per device against the number of ranks, one line per stage."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for stage in theory.STAGES:
        ax.plot(world_sizes, [theory.paper_bytes_per_device(psi, stage, n, k) / 1e9 for n in world_sizes],
                marker="o", label=f"stage {stage}")
    ax.set(xscale="log", yscale="log", xlabel="data-parallel ranks N_d", ylabel="GB per device",
           title=f"Model states of {psi / 1e9:g}B parameters (paper, K={k})")
    ax.set_xticks(list(world_sizes), [str(n) for n in world_sizes])
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- capstone (issue 10) ----------------------------------------------------------------------------

def ladder(ladder: dict, title: str | None = None):
    """One bar per candidate of a capstone ladder (``Ladder.to_dict()``): its model TFLOP/s per GPU (or
    tokens/s), coloured by verdict, with the baseline's mean as a line and, where the device has a known
    peak, the MFU target as a second line."""
    rows = [c for c in ladder["candidates"] if "metric" in c]
    colours = {"baseline": "#8C8C8C", "kept": "#55A868", "dropped": "#C44E52", "not eligible": "#DD8452"}
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * max(1, len(rows)), 3.8))
    values = [c["metric"] for c in rows]
    ax.bar(range(len(rows)), values, color=[next((v for k, v in colours.items() if c["verdict"].startswith(k)),
                                                  "#4C72B0") for c in rows])
    ax.set_xticks(range(len(rows)), [f"{c['rung']}: {c['label']}" for c in rows], rotation=45, ha="right",
                  fontsize=7)
    uses_flops = bool(rows) and rows[0].get("tflops_per_gpu") is not None
    per = "rank" if ladder["device"].startswith("CPU") else "GPU"
    ax.set_ylabel(f"model TFLOP/s per {per}" if uses_flops else "tokens/s")
    base = [c["metric"] for c in rows if c["verdict"] == "baseline"]
    if base:
        ax.axhline(sum(base) / len(base), color="#8C8C8C", linestyle="--", linewidth=1, label="baseline (mean)")
    peak_rows = [c for c in rows if c.get("mfu")]
    if uses_flops and peak_rows:
        peak = peak_rows[0]["tflops_per_gpu"] / peak_rows[0]["mfu"]
        ax.axhline(ladder["target_mfu"] * peak, color="#4C72B0", linestyle=":", linewidth=1,
                   label=f"{ladder['target_mfu']:.0%} MFU target")
    if base:
        ax.legend(fontsize=8)
    ax.set_title(title or f"Capstone ladder: {ladder['device']}, {ladder['world_size']} rank(s)", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- offload and mixed precision (chapters 06-07) ---------------------------------------------------

def placement_bars(runs: Mapping[str, records.Record], rank: int = 0, title: str | None = None):
    """Per run, two stacked bars of model-state MiB on ``rank``: the accelerator side and the host side,
    by kind of state (buffers left out: the tables show them)."""
    fig, ax = plt.subplots(figsize=(1.8 + 1.4 * len(runs), 4.0))
    width, labelled = 0.38, set()
    for i, (name, run) in enumerate(runs.items()):
        placement = run["memory.placement_bytes_per_rank"][rank]
        for offset, side, hatch in ((-width / 2, "accelerator", ""), (width / 2, "host", "..")):
            bottom = 0.0
            for key in records.MODEL_STATE_KEYS:
                value = placement[side][key] / 2**20
                if value:
                    ax.bar(i + offset, value, width, bottom=bottom, color=STATE_COLOURS[key], hatch=hatch,
                           edgecolor="white", label=None if key in labelled else key)
                    labelled.add(key)
                    bottom += value
    ax.set_xticks(range(len(runs)), [textwrap.fill(name, 16) + "\nA | H" for name in runs], fontsize=7)
    ax.set_ylabel(f"MiB on rank {rank}")
    ax.set_title(title or "Model states: accelerator side (A) | host side (H, dotted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- interactive lab (issue 9) ---------------------------------------------------------------------

def calculator_bars(rows: Sequence[tuple[str, Mapping[str, float]]], gpu_memory_bytes: float,
                   title: str = "Model states per GPU"):
    """Stacked horizontal bars of the model states one GPU keeps, one bar per (label, states) row (states as
    :func:`helpers.theory.placement` gives them), with the GPU's memory as a dashed line."""
    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.32 * len(rows)))
    labelled: set[str] = set()
    for i, (label, states) in enumerate(rows):
        left = 0.0
        for key in records.MODEL_STATE_KEYS:
            value = states.get(key, 0) / 2**30
            if value:
                ax.barh(i, value, left=left, color=STATE_COLOURS[key], label=None if key in labelled else key)
                labelled.add(key)
                left += value
    ax.axvline(gpu_memory_bytes / 2**30, color="black", linestyle="--", label="GPU memory")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GiB on one GPU")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    plt.close(fig)
    return fig


def largest_model(accelerator_gb: Sequence[float], world_size: int, reserve_gb: float = 0.0,
                  modes: Sequence[tuple[int, str]] = ((0, "none"), (2, "none"), (2, "optimizer"), (3, "none"),
                                                      (3, "optimizer")), precision: str = "fp16"):
    """Largest model (billions of parameters) whose model states fit per device, against the device's
    memory, one line per stage and offload mode (:func:`helpers.theory.largest_model`)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    accelerator_gb = [gb for gb in accelerator_gb if gb > reserve_gb]  # a device smaller than the reserve fits nothing
    for i, (stage, mode) in enumerate(modes):
        sizes = [theory.largest_model(gb * 1e9, stage, world_size, mode, None, reserve_gb * 1e9, precision)["params"] / 1e9
                 for gb in accelerator_gb]
        ax.plot(accelerator_gb, sizes, marker="os^vD"[i % 5], linestyle=["-", "--", ":", "-."][i % 4],
                label=f"stage {stage}" + ("" if mode == "none" else f" + {mode} offload"))
    ax.set(xlabel="accelerator memory per device (GB)", ylabel="largest model (B parameters)", yscale="log",
           title=f"Model states that fit {world_size} device(s) ({precision} mixed precision, K=12)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def png(fig, dpi: int = 80) -> bytes:
    """A figure as PNG bytes (for an ipywidgets Image that a live view updates)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def loss_scale_trajectories(trajectories: Mapping[str, dict], title: str = "fp16 loss scale, step by step"):
    """One panel per scenario: log2 of the loss scale each optimizer step used (a step line), skipped steps
    marked with a red x, injected spikes with a dashed line, and where DeepSpeed's scaler ended the run."""
    import math

    count = len(trajectories)
    columns = min(3, count)
    rows = (count + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.7 * rows), squeeze=False, sharey=True)
    for ax, (name, t) in zip(axes.flat, trajectories.items()):
        steps = range(1, len(t["scales"]) + 1)
        powers = [math.log2(s) for s in t["scales"]]
        ax.step(steps, powers, where="mid", color="#4C72B0")
        skipped = [(s, p) for s, p, o in zip(steps, powers, t["overflow"]) if o]
        if skipped:
            ax.scatter(*zip(*skipped), marker="x", color="#C44E52", zorder=3, label="skipped step")
        for spike in t["spikes"]:
            ax.axvline(spike, color="grey", linestyle="--", linewidth=0.8)
        if t["stopped"]:
            ax.annotate("run ended", (len(powers), powers[-1]), textcoords="offset points", xytext=(-40, 12), fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("log2(loss scale)", fontsize=8)
    for ax in list(axes.flat)[count:]:
        ax.axis("off")
    marked = next((ax for ax in axes.flat if ax.get_legend_handles_labels()[0]), None)
    if marked is not None:
        marked.legend(fontsize=7, loc="lower right")
    fig.suptitle(title + " (dashed: injected spike)", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- beyond ZeRO (chapters 10-12) ----------------------------------------------------------------------

def activations_vs_sequence(curves: Mapping[str, tuple[Sequence[int], Sequence[float], float]],
                            measured: Mapping[str, tuple[int, float]] | None = None,
                            title: str = "Activations of one micro-batch against model states"):
    """Per model: activation bytes (formula) against sequence length, and its model states as a flat line.

    ``curves``: label -> (sequence lengths, activation bytes, model-state bytes); ``measured``: label ->
    (sequence length, measured activation bytes), drawn as points.
    """
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, (seqs, values, states)) in enumerate(curves.items()):
        colour = colours[i % len(colours)]
        ax.plot(seqs, [v / 2**30 for v in values], color=colour, label=f"{label}: activations (formula)")
        ax.axhline(states / 2**30, color=colour, linestyle="--", linewidth=1, label=f"{label}: model states")
    for label, (seq, value) in (measured or {}).items():
        ax.plot([seq], [value / 2**30], "ko", markersize=5)
        ax.annotate(label, (seq, value / 2**30), textcoords="offset points", xytext=(5, -10), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="GiB", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


def pipeline_timeline(record, title: str | None = None):
    """One optimizer step of a pipeline run as a Gantt chart: per stage, what each instruction took (from the
    ``pipeline`` probe). Forward and backward passes are labelled with their micro-batch."""
    section = record.summary["pipeline"]
    steps = section["last_step"]
    start = min(i[1] for rank in steps for i in rank)
    colours = {"ForwardPass": "#4C72B0", "BackwardPass": "#DD8452", "SendActivation": "#bbbbbb",
               "RecvActivation": "#dddddd", "SendGrad": "#bbbbbb", "RecvGrad": "#dddddd", "OptimizerStep": "#55A868",
               "ReduceGrads": "#C44E52"}
    fig, ax = plt.subplots(figsize=(7.5, 0.6 + 0.7 * len(steps)))
    for rank, instructions in enumerate(steps):
        counters = {"ForwardPass": 0, "BackwardPass": 0}
        for kind, begin, end in instructions:
            ax.barh(rank, (end - begin) * 1000, left=(begin - start) * 1000, color=colours.get(kind, "#eeeeee"),
                    edgecolor="white", linewidth=0.3)
            if kind in counters:
                ax.text((begin + end) / 2 * 1000 - start * 1000, rank, f"{kind[0]}{counters[kind]}", ha="center",
                        va="center", fontsize=6, color="white")
                counters[kind] += 1
    ax.set_yticks(range(len(steps)), [f"stage {s}" for s in range(len(steps))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first instruction")
    ax.set_title(title or f"One step, {section['stages']} stages x {section['micro_batches']} micro-batches: forward "
                          "(blue), backward (orange), send/recv (grey), gradient reduction (red), optimizer (green)",
                 fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def bubble_vs_micro_batches(measured: Mapping[int, Sequence[float]], stages: int, title: str | None = None):
    """Measured idle share of each stage against the number of micro-batches M, beside (S-1)/(M+S-1)."""
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    counts = sorted(measured)
    dense = list(range(1, max(counts) + 1))
    ax.plot(dense, [theory.bubble_fraction(stages, m) for m in dense], "k--", label="(S-1)/(M+S-1)")
    for stage in range(len(measured[counts[0]])):
        ax.plot(counts, [measured[m][stage] for m in counts], marker="o", label=f"stage {stage}, measured")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="micro-batches per step M", ylabel="share of the step idle", ylim=(0, 1),
           title=title or f"Pipeline bubble, {stages} stages")
    ax.minorticks_off()
    ax.set_xticks(counts, [str(m) for m in counts])
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def traffic_vs_tokens(tokens: Sequence[int], lines: Mapping[str, Sequence[float]],
                      measured: Mapping[str, tuple[int, float]] | None = None,
                      title: str = "Bytes each rank sends per micro-step"):
    """Per way of splitting the model: wire bytes per micro-step (formula) against tokens per micro-step, with
    measured points."""
    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    for label, values in lines.items():
        ax.plot(tokens, [v / 2**20 for v in values], label=label)
    for label, (x, y) in (measured or {}).items():
        ax.plot([x], [y / 2**20], "ko", markersize=5)
        ax.annotate(label, (x, y / 2**20), textcoords="offset points", xytext=(5, 5), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="tokens per micro-step (b·s)", ylabel="MiB per rank", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- chapters 13-15: ZeRO++, checkpoints, PyTorch beside DeepSpeed ----------------------------

def zeropp_volumes(psi: float, title: str = "What crosses nodes per GPU and step (paper's accounting)"):
    """Stacked bars, one per setting: cross-node bytes of each ZeRO-3 phase in units of M = 2Ψ
    (:func:`helpers.theory.zeropp_volume` on two or more nodes)."""
    settings = {"ZeRO-3": (False, False, False), "qwZ": (True, False, False), "hpZ": (False, True, False),
                "qgZ": (False, False, True), "ZeRO++": (True, True, True)}
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, flags in enumerate(settings.values()):
        volume = theory.zeropp_volume(psi, *flags, nodes=2)
        bottom = 0.0
        for j, phase in enumerate(theory.ZEROPP_PHASES):
            value = volume[phase]["inter"] / (2 * psi)
            ax.bar(i, value, 0.6, bottom=bottom, color=colours[j], label=phase if i == 0 else None)
            bottom += value
        ax.text(i, bottom + 0.05, f"{bottom:g}M", ha="center", fontsize=8)
    ax.set_xticks(range(len(settings)), list(settings))
    ax.set(ylabel="model sizes M (2Ψ bytes)", title=title, ylim=(0, 3.5))
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def zeropp_speedup(psi: float, layers: int, tokens_per_gpu: int, flops_per_s: float,
                   gbits: Sequence[float] = (25, 50, 100, 200, 400, 800, 1600, 3200)):
    """Predicted ZeRO++ speed-up over ZeRO-3 on two or more nodes against the network bandwidth per GPU
    (:func:`helpers.theory.zeropp_step_prediction`, the default links' latencies)."""
    speedups = [theory.zeropp_step_prediction(psi, layers, tokens_per_gpu, 2, flops_per_s,
                                              inter=theory.AlphaBeta.link(g * 1e9 / 8, theory.DEFAULT_INTER_NODE.alpha))
                ["speedup"] for g in gbits]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(gbits, speedups, marker="o")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xscale="log", xlabel="network bandwidth between nodes, Gbit/s per GPU", ylabel="ZeRO++ / ZeRO-3 speed",
           title="Predicted gain of ZeRO++ across nodes")
    ax.set_xticks(list(gbits), [f"{g:g}" for g in gbits])
    fig.tight_layout()
    plt.close(fig)
    return fig


def resumed_losses(uninterrupted: Mapping[str, Sequence[float]], resumed: Mapping[str, Sequence[float]],
                   first_step: int, title: str = "Uninterrupted and resumed runs"):
    """Each uninterrupted run's losses (lines) with its resumed run's (markers, from step first_step + 1)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (name, losses) in enumerate(uninterrupted.items()):
        line, = ax.plot(range(1, len(losses) + 1), losses, "-", alpha=0.6, label=f"{name} uninterrupted")
        again = resumed[name]
        ax.plot(range(first_step + 1, first_step + len(again) + 1), again, "o", color=line.get_color(),
                markersize=9 - 2 * i, markerfacecolor="none", label=f"{name} resumed")
    ax.axvline(first_step + 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="optimizer step", ylabel="loss", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    plt.close(fig)
    return fig


def states_per_rank(runs: Sequence[records.Record], rank: int = 0, title: str = "Model states on one rank"):
    """Stacked bars of measured params / grads / optimizer / master / buffers on ``rank``, one bar per run
    (buffers hatched: communication buckets, not model states)."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(runs), 3.8))
    colours = {**STATE_COLOURS, "buffers": "#8172B3"}
    for i, run in enumerate(runs):
        bottom = 0.0
        for key in records.STATE_KEYS:
            value = run.states(rank).get(key, 0) / 2**20
            if value:
                ax.bar(i, value, 0.6, bottom=bottom, color=colours[key], hatch="//" if key == "buffers" else "",
                       edgecolor="white", label=key if key not in ax.get_legend_handles_labels()[1] else None)
                bottom += value
    ax.set_xticks(range(len(runs)), [r.label.replace(" ", "\n", 1) for r in runs], fontsize=8)
    ax.set_ylabel(f"MiB on rank {rank}")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def bytes_per_step(runs: Sequence[records.Record], title: str = "Bytes per optimizer step, by collective"):
    """Stacked bars of each run's logged bytes per step, by collective (message sizes, as the comms logger
    and the torch_comm probe record them)."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(runs), 3.8))
    ops = sorted({op for r in runs for op in r.comm_ops()})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        bottom = 0.0
        for j, op in enumerate(ops):
            row = run.comm_ops().get(op)
            if row and row["bytes"]:
                ax.bar(i, row["bytes"] / 2**20, 0.6, bottom=bottom, color=colours[j % len(colours)],
                       label=op if op not in ax.get_legend_handles_labels()[1] else None)
                bottom += row["bytes"] / 2**20
    ax.set_xticks(range(len(runs)), [r.label.replace(" ", "\n", 1) for r in runs], fontsize=8)
    ax.set_ylabel("MiB per step (logged message sizes)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- bandwidth chapters (08 gradient accumulation, 09 collective bandwidth) -------------------

def comm_per_sample(runs: Mapping[tuple[int, int], records.Record], title: str = "Bytes per sample"):
    """Logged collective bytes per training sample against accumulation, one line per ZeRO stage."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for stage in sorted({s for s, _ in runs}):
        points = sorted((a, r["comm.bytes_per_step"] / r["train_batch"]) for (s, a), r in runs.items() if s == stage)
        ax.plot([a for a, _ in points], [b / 2**10 for _, b in points], marker="o", label=f"ZeRO-{stage}")
    accums = sorted({a for _, a in runs})
    ax.set(xscale="log", xlabel="gradient accumulation steps", ylabel="KiB per sample", title=title)
    ax.set_xticks(accums, [str(a) for a in accums])
    ax.set_xticks([], minor=True)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def loss_vs_samples(curves: Mapping[str, tuple[int, Sequence[float]]], title: str = "Loss by samples seen"):
    """Two panels: loss per optimizer step, and the same losses against samples seen; ``curves`` maps a
    name to (samples per step, losses)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.4))
    for name, (batch, losses) in curves.items():
        steps = range(1, len(losses) + 1)
        left.plot(steps, losses, label=name)
        right.plot([s * batch for s in steps], losses, label=name)
    left.set(xlabel="optimizer step", ylabel="loss", title="per optimizer step")
    right.set(xlabel="samples seen", ylabel="loss", title="per sample seen")
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


def bus_bandwidth(result: dict, title: str | None = None):
    """Bus bandwidth against message size, one panel per collective, one line per implementation
    (a :mod:`helpers.collectives` summary)."""
    from helpers import collectives

    ops = list(dict.fromkeys(r["op"] for r in result["results"]))
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3.2), sharey=True, squeeze=False)
    for ax, op in zip(axes[0], ops):
        for impl in collectives.IMPLEMENTATIONS:
            points = sorted((p["bytes"], p["busbw"]) for p in collectives.rows(result, impl, op))
            if points:
                ax.plot([b for b, _ in points], [w / 1e9 for _, w in points], marker="o", markersize=3, label=impl)
        ax.set(xscale="log", yscale="log", xlabel="message bytes", title=op)
    axes[0][0].set_ylabel("bus bandwidth GB/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title or f"Collectives on {result['world_size']} ranks ({result['device_name']}, {result['backend']})")
    fig.tight_layout()
    plt.close(fig)
    return fig


def alpha_beta(result: dict, model, implementation: str = "deepspeed.comm", title: str | None = None):
    """Measured seconds per call against wire bytes per rank (points) and the fitted t = alpha + beta w (lines)."""
    from helpers import collectives

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (op, fit) in enumerate(model.fits.items()):
        points = sorted((p["wire_bytes"], p["seconds"]) for p in collectives.rows(result, implementation, op))
        xs = [x for x, _ in points]
        ax.plot(xs, [t * 1e6 for _, t in points], "o", color=colours[i % len(colours)], markersize=4, label=f"{op} measured")
        ax.plot(xs, [fit.seconds(x) * 1e6 for x in xs], "-", color=colours[i % len(colours)], linewidth=1,
                label=f"{op} fit: {fit.describe()}")
    ax.set(xscale="log", yscale="log", xlabel="wire bytes per rank", ylabel="microseconds per call",
           title=title or f"alpha-beta fits ({model.source})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


def measured_vs_predicted(rows: Sequence[dict], title: str = "Collective time per optimizer step"):
    """Bars: measured and predicted collective seconds per step, run by run (:func:`helpers.bandwidth.comparison_rows`)."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(rows), 3.6))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_s"] * 1e3 for r in rows], 0.38, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted_s"] * 1e3 for r in rows], 0.38, label="alpha-beta model", hatch="//")
    ax.set_xticks(list(xs), [r["name"] for r in rows], fontsize=8, rotation=20)
    ax.set(ylabel="ms per optimizer step", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def what_if(rows: Sequence[dict], title: str = "Predicted step time by link"):
    """Two panels against link bandwidth (log): predicted time per sample, and communication's share of the step;
    one line per (stage, accumulation) profile (:func:`helpers.bandwidth.what_if`)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    profiles = list(dict.fromkeys(id(r["profile"]) for r in rows))
    for pid in profiles:
        mine = [r for r in rows if id(r["profile"]) == pid]
        p = mine[0]["profile"]
        style = "-" if p.accum == 1 else "--"
        label = f"ZeRO-{p.stage}, accum {p.accum}"
        gbits = [r["bandwidth"] * 8 / 1e9 for r in mine]
        left.plot(gbits, [r["step_s"] / p.samples * 1e3 for r in mine], style, marker="o", markersize=3, label=label)
        right.plot(gbits, [r["comm_share"] * 100 for r in mine], style, marker="o", markersize=3, label=label)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("link Gbit/s per direction")
    left.set(ylabel="ms per sample", yscale="log", title="time per sample")
    right.set(ylabel="% of the step", ylim=(0, 100), title="communication share")
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


def slow_link(rows: Sequence[dict], title: str = "Step time on a fast and a slow link"):
    """Bars per run: measured step time on the fast link and on the slow one, and the model's prediction for
    the slow one (:func:`helpers.bandwidth.slow_link_rows`); a range for the timed-only overlap runs."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(rows), 3.8))
    xs = list(range(len(rows)))
    ax.bar([x - 0.27 for x in xs], [r["fast_s"] * 1e3 for r in rows], 0.26, label="fast link, measured")
    ax.bar(xs, [r["slow_s"] * 1e3 for r in rows], 0.26, label="slow link, measured")
    ax.bar([x + 0.27 for x in xs], [r["predicted_s"] * 1e3 for r in rows], 0.26, hatch="//",
           label="slow link, predicted (no overlap)")
    lows = [(x, r["overlap_bound_s"]) for x, r in zip(xs, rows) if r["overlap_bound_s"] is not None]
    if lows:
        ax.plot([x + 0.27 for x, _ in lows], [v * 1e3 for _, v in lows], "kv", label="predicted, perfect overlap")
    ax.set_xticks(xs, [r["name"] for r in rows], fontsize=7, rotation=20)
    ax.set(ylabel="ms per optimizer step", title=title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    plt.close(fig)
    return fig
