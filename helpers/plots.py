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
