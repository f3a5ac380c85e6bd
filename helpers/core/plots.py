"""The figures many chapters draw, from run records and the ZeRO formulas (a topic's own figures live
in its module).

Each function returns its figure already closed, so a notebook shows it exactly once: as the value
of the cell's last line (pyplot's own display of open figures would show it a second time).
"""

from __future__ import annotations

import io
from typing import Mapping, Sequence

from helpers.core import records, theory


def pyplot():
    """matplotlib's pyplot, imported on first use: the ranks import topic modules (for their probes) and
    never draw, and pyplot adds over a second to a process's start."""
    import matplotlib.pyplot as plt  # deferred: see the docstring

    return plt


STATE_COLOURS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "master": "#C44E52"}


def loss_curves(runs: Mapping[str, Sequence[float]], title: str = "Training loss", ylabel: str = "loss",
                steps: int | None = None):
    """One line per run: loss against optimizer step (``steps`` fixes the axis for a run still training)."""
    plt = pyplot()
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
    plt = pyplot()
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
    """Per run: bytes each rank sends per optimizer step (ring), by collective, beside the paper's volume per
    optimizer step (``theory.comm_wire_bytes_per_optimizer_step``: stage 3's once per micro-step)."""
    plt = pyplot()
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
        ax.bar(i + 0.2, run.theory.comm_wire_bytes_per_optimizer_step / 2**20, 0.38, color="lightgrey", hatch="//",
               label="paper x (n-1)/n" if i == 0 else None)
    ax.set_xticks(range(len(runs)), [f"{r.label}\nmeasured | paper" for r in runs], fontsize=8)
    ax.set_ylabel("MiB sent per rank per optimizer step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def paper_scaling(psi: float = 7.5e9, world_sizes: Sequence[int] = (1, 4, 8, 16, 64), k: int = theory.PAPER_K):
    """The paper's model-state GB per device against the number of ranks, one line per stage."""
    plt = pyplot()
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


# --- offload and mixed precision (chapters 06-07) ---------------------------------------------------


# --- interactive lab (issue 9) ---------------------------------------------------------------------


def png(fig, dpi: int = 80) -> bytes:
    """A figure as PNG bytes (for an ipywidgets Image that a live view updates)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


# --- beyond ZeRO (chapters 10-12) ----------------------------------------------------------------------


# --- chapters 13-15: ZeRO++, checkpoints, PyTorch beside DeepSpeed ----------------------------


# --- bandwidth chapters (08 gradient accumulation, 09 collective bandwidth) -------------------


