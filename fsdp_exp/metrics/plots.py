"""Figures for people: runs side by side (compare, task=tune), and task=estimate's tokens by
sequence length. A batch-size search's own figure is fsdp_exp.tasks.max_batch.plot.

matplotlib is imported inside each function, with the Agg backend, so importing this module
costs nothing and a machine without a display can still draw.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from fsdp_exp.metrics.summary import PEAK_GB

DPI = 120


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def none_fits(row: Any) -> str:
    """A max-batch row (a Summary, or compare's row of one) where not even the smallest size
    fits, in a few words."""
    size = row.get("searched_from") or row.get("resolution") or 1  # past sizes too small to train
    return none_fits_at(size, row.get("smallest_batch_needs_gb"))


def none_fits_at(size: int, need_gb: float | None) -> str:
    return f"none fits (batch {size} needs {need_gb:.2f} GB)" if need_gb is not None else \
        f"none fits (batch {size} does not)"


# Past this many runs the bar chart shows the fastest; the table and the CSV keep every run.
MAX_BARS = 20
# Inches: the largest figure drawn, whatever the number of runs.
MAX_FIGURE = (14, 11)
LABEL_WIDTH = 40
LABEL_LINES = 2
# Past this many points, only the Pareto front is labelled: more names than that overlap.
LABEL_ALL_POINTS_UP_TO = 12


def peak_of(row: dict) -> float | None:
    """A row's peak memory: as the limit counts it where there was one, else measured, else
    estimated."""
    for key in ("peak_under_limit_gb", PEAK_GB, "estimated_peak_mem_gb"):
        if row.get(key) is not None:
            return row[key]
    return None


def plot_comparison(rows: list[dict], path: Path, max_bars: int = MAX_BARS) -> list[str]:
    """One bar per run: its max batch size when any run searched for one, else samples/s;
    samples/s beside it when both exist; where no run measured samples/s (a sweep of
    task=estimate), each run's peak memory instead. Runs that did not finish ok are hatched
    grey. Past `max_bars` runs, the fastest (by samples/s, else max batch) are drawn, fastest
    first, with a note of how many were left out. Returns the texts drawn on the bars, then
    that note."""
    plt = pyplot()
    panels = []
    if any(r.get("max_batch_size") is not None for r in rows):
        panels.append(("max_batch_size", "max batch size (per rank)", "{:,.0f}"))
    if any(r.get("samples_per_s") is not None for r in rows):
        panels.append(("samples_per_s", "samples/s", "{:,.1f}"))
    elif any(peak_of(r) is not None for r in rows):
        rows = [r | {"peak_gb": peak_of(r)} for r in rows]
        estimated = all(r.get("task") == "estimate" for r in rows)
        panels.append(("peak_gb", "peak memory per rank (GB" + (", estimated)" if estimated else ")"), "{:.3f}"))
    if not panels:  # every run failed: still show which ones, by status
        panels.append(("samples_per_s", "samples/s", "{:,.1f}"))
    total = len(rows)
    rows = [r | {"row": n} for n, r in enumerate(rows, 1)]
    ranked_by = next((key for key, *_ in reversed(panels) if key != "peak_gb"), panels[-1][0])  # not by memory
    rows, left_out = _fastest(rows, ranked_by, max_bars)

    labels = bar_labels(rows)
    height = 1.5 + 0.35 * sum(label.count("\n") + 1.5 for label in labels)
    figsize = (min(5 + 4 * len(panels), MAX_FIGURE[0]), min(height, MAX_FIGURE[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=figsize, sharey=True, squeeze=False)
    y = list(range(len(rows)))
    for ax, (key, title, spec) in zip(axes[0], panels):
        values = [r.get(key) for r in rows]
        top = max((v for v in values if v is not None), default=1) or 1
        for i, (row, value) in enumerate(zip(rows, values)):
            if row.get("status") != "ok":
                ax.barh(i, top, color="whitesmoke", edgecolor="grey", hatch="//")
                ax.text(top / 2, i, row.get("status") or "?", ha="center", va="center", color="dimgrey")
            elif key == "max_batch_size" and value == 0:
                ax.text(0, i, "  " + none_fits(row), va="center", color="dimgrey", fontsize="small")
            elif value is None:
                task = row.get("task") or "train"
                no_value = "  -" if key != "max_batch_size" or task == "max_batch" else f"  - ({task} run)"
                ax.text(0, i, no_value, va="center", color="dimgrey")
            else:
                ax.barh(i, value, color="tab:blue")
                ax.text(value, i, " " + spec.format(value), va="center", fontsize="small")
        ax.set_title(title)
        ax.set_xlim(0, top * 1.2)
    axes[0][0].set_yticks(y, labels, fontsize="small")
    axes[0][0].set_ylim(len(rows) - 0.5, -0.5)  # first run on top, as in the table; the panels share the axis
    texts = [t.get_text().strip() for ax in axes[0] for t in ax.texts]
    if left_out:
        by = "samples/s" if panels[-1][0] == "samples_per_s" else "max batch size"
        note = (f"the {len(rows)} highest by {by} of {total} runs; {left_out} left out "
                f"(every run is in comparison.md and comparison.csv)")
        fig.suptitle(note, fontsize="medium", color="dimgrey")
        texts.append(note)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return texts


def _fastest(rows: list[dict], key: str, limit: int) -> tuple[list[dict], int]:
    """All rows in their order when they fit, else the `limit` best by `key`, best first
    (runs without a value last), and how many were left out."""
    if len(rows) <= limit:
        return rows, 0
    ranked = sorted(rows, key=lambda r: (r.get("status") != "ok" or r.get(key) is None, -(r.get(key) or 0)))
    return ranked[:limit], len(rows) - limit


def bar_labels(rows: list[dict]) -> list[str]:
    """Each run's setup, cut to LABEL_LINES lines; where runs' setups are cut to the same
    text (runs that differ in many settings), each is numbered as its row of the table."""
    names = [r.get("setup") or "(defaults)" for r in rows]
    labels = [_short_label(name) for name in names]
    if len(set(labels)) < len(labels):
        labels = [_short_label(f"{r['row']}. {name}") for r, name in zip(rows, names)]
    return labels


def _short_label(text: str, width: int = LABEL_WIDTH, lines: int = LABEL_LINES) -> str:
    return textwrap.fill(text, width, max_lines=lines, placeholder=" …")


def pareto_front(points: list[tuple[str, float, float]]) -> list[int]:
    """The indexes of the points no other point beats: none has at least their samples/s at
    no more peak memory, and more of one or less of the other. Sorted by peak memory."""
    front = [i for i, (_, speed, peak) in enumerate(points)
             if not any(s >= speed and p <= peak and (s > speed or p < peak) for _, s, p in points)]
    return sorted(front, key=lambda i: (points[i][2], -points[i][1]))


def plot_throughput_vs_memory(points: list[tuple[str, float, float]], path: Path, title: str | None = None,
                              memory_label: str = "peak memory per rank (GB)", winner: int | None = None,
                              limit_gb: float | None = None) -> list[str]:
    """Each (label, samples_per_s, peak_gb) a point; the Pareto front (the most samples/s for
    its memory) joined in red; `winner` (an index into `points`, task=tune's) starred, and
    `limit_gb` a dashed line. Points carry their number in `points` (from 1), and a key
    beside the axes names them: every point while few enough to read, else the front.
    Returns the texts drawn: the key's entries, then any note, then the legend's."""
    plt = pyplot()
    front = pareto_front(points)
    fig, (ax, key_ax) = plt.subplots(1, 2, figsize=(13, 6.5), width_ratios=[3, 2])
    others = [p for i, p in enumerate(points) if i not in front]
    if others:
        ax.scatter([p[2] for p in others], [p[1] for p in others], color="tab:blue", alpha=0.6,
                   label="run" if len(others) == 1 else "runs")
    ax.plot([points[i][2] for i in front], [points[i][1] for i in front], "o-", color="tab:red", zorder=3,
            label="Pareto front: no run is faster at this memory or less")
    if winner is not None:
        ax.scatter([points[winner][2]], [points[winner][1]], marker="*", s=320, color="gold", edgecolor="black",
                   zorder=4, label=f"fastest: {winner + 1}")
    if limit_gb is not None:
        ax.axvline(limit_gb, color="grey", linestyle="--", label=f"memory.limit_gb={limit_gb:g}")
    named = list(range(len(points))) if len(points) <= LABEL_ALL_POINTS_UP_TO else front
    for i in named:
        ax.annotate(str(i + 1), (points[i][2], points[i][1]), xytext=(4, 3), textcoords="offset points",
                    fontsize="small", color="tab:red" if i in front else "black")
    ax.set_xlabel(memory_label)
    ax.set_ylabel("samples/s")
    ax.set_xlim(0, max([p[2] for p in points] + [limit_gb or 0.0]) * 1.1)
    ax.set_ylim(0, max(p[1] for p in points) * 1.1)
    ax.grid(alpha=0.3)
    texts = _key(key_ax, points, sorted(named)[:KEY_ENTRIES], front)
    if len(named) < len(points) or len(named) > KEY_ENTRIES:
        which = "the Pareto front" if len(named) < len(points) else "all"
        note = (f"{len(points)} runs; the key names {min(len(named), KEY_ENTRIES)} of {which} "
                f"(every run is in comparison.md)")
        key_ax.text(0, 0.16, textwrap.fill(note, 60), transform=key_ax.transAxes, va="top", fontsize="small",
                    color="dimgrey")
        texts.append(note)
    legend = key_ax.legend(*ax.get_legend_handles_labels(), loc="lower left", fontsize="small")
    fig.suptitle(_short_label(title or "samples/s against peak memory", 140), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    texts += [t.get_text() for t in legend.get_texts()]
    plt.close(fig)
    return texts


# Entries in the throughput chart's key: past this, the lines get too small to read.
KEY_ENTRIES = 12


def _key(ax: Any, points: list[tuple[str, float, float]], named: list[int], front: list[int]) -> list[str]:
    """Number, figures and label of each named point, top down, in the key's axes."""
    ax.axis("off")
    entries = [f"{i + 1}   {points[i][1]:,.1f} samples/s at {points[i][2]:.2f} GB\n"
               + textwrap.indent(_short_label(points[i][0], 56), "     ") for i in named]
    step = min(0.04, 0.78 / max(1, sum(e.count("\n") + 1.3 for e in entries)))
    top = 1.0
    for i, entry in zip(named, entries):
        ax.text(0, top, entry, transform=ax.transAxes, va="top", fontsize="small",
                color="tab:red" if i in front else "black")
        top -= step * (entry.count("\n") + 1.3)
    return entries


def plot_tokens(by_seq_len: list[dict], room: str | None, path: Path) -> None:
    """task=estimate with task.seq_lens drawn: tokens per micro-batch of the largest batch
    that fits in `room` (the limits, in words; None: of the batch estimated) at each sequence
    length, the batch beside each point: estimate.json's `by_seq_len` rows."""
    rows = [r for r in by_seq_len if "error" not in r]
    if not rows:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = [r["seq_len"] for r in rows]
    fitted = room is not None
    ax.plot(lengths, [r["tokens_per_micro_batch"] for r in rows], "o-", color="tab:blue",
            label="largest of task.batch_sizes that fits" if fitted else "the batch estimated")
    curve = [r for r in rows if r.get("predicted_max_tokens") is not None]
    if fitted and curve:
        ax.plot([r["seq_len"] for r in curve], [r["predicted_max_tokens"] for r in curve], "s--", color="tab:orange",
                label="where the estimate's curve reaches the memory")
        ax.legend(fontsize=8)
    for r in rows:
        batch = r["largest_batch_fitting"] if fitted else r["batch_size"]
        ax.annotate(f"batch {batch}", (r["seq_len"], r["tokens_per_micro_batch"]), textcoords="offset points",
                    xytext=(4, 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("data.seq_len")
    ax.set_ylabel("tokens per micro-batch")
    ax.set_title(f"largest micro-batch that fits ({room}), by sequence length" if fitted
                 else "tokens per micro-batch, by sequence length", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
