"""The figures every chapter draws, from run records and the theory module.

Each function returns its figure already closed, so a notebook shows it exactly once: as the value
of the cell's last line (pyplot's own display of open figures would show it a second time).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt

from helpers import records, theory

STATE_COLOURS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "master": "#C44E52"}


def loss_curves(runs: Mapping[str, Sequence[float]], title: str = "Training loss", ylabel: str = "loss"):
    """One line per run: loss against optimizer step."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    styles = ["-", "--", ":", "-."]
    for i, (name, losses) in enumerate(runs.items()):
        ax.plot(range(1, len(losses) + 1), losses, styles[i % len(styles)], marker="o", markersize=3, label=name)
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
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
                                              inter=theory.Link(g * 1e9 / 8, theory.DEFAULT_INTER_NODE.latency))
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
