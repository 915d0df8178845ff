"""Figures for people: where a batch-size search met the memory limit, and runs side by side.

matplotlib is imported inside each function, with the Agg backend, so importing this module
costs nothing and a machine without a display can still draw.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

DPI = 120
# Past this spread of probed sizes, a linear axis crushes the small probes into one spot.
LOG_X_ABOVE_RATIO = 16


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_max_batch(record: dict, path: Path) -> None:
    """Peak memory per probed batch size, the fitted line, the limit and the answer (max_batch.json)."""
    plt = _pyplot()
    probes = sorted(record.get("probes", []), key=lambda p: p["batch_size"])
    model = record.get("memory_model")
    # The peak the line was fit to: the one the limit caps (see Probe.limited_peak_gb).
    measure = (model or {}).get("measure", "peak_mem_gb")
    fits = [p for p in probes if p["status"] == "ok" and p.get(measure) is not None]
    limit_gb = record.get("limit_gb")
    # oom and failed probes have no peak; they are drawn where they hit: the limit, or just
    # above the highest peak when no limit was set.
    top = max((p[measure] for p in fits), default=1.0)
    no_fit_height = limit_gb if limit_gb is not None else top * 1.05

    fig, memory_ax = plt.subplots(figsize=(8, 5))
    if fits:
        memory_ax.plot([p["batch_size"] for p in fits], [p[measure] for p in fits], "o",
                       color="tab:blue", label=f"{measure} (max over ranks)")
    sizes = [p["batch_size"] for p in probes]
    log_x = bool(sizes) and min(sizes) > 0 and max(sizes) / min(sizes) > LOG_X_ABOVE_RATIO
    if model is not None and sizes:
        import numpy as np

        lo, hi = min(sizes), max(sizes)
        batch = np.geomspace(lo, hi, 100) if log_x else np.linspace(lo, hi, 100)
        memory_ax.plot(batch, model["intercept_gb"] + model["slope_gb_per_sample"] * batch, "-",
                       color="tab:blue", alpha=0.5,
                       label=f"fit: {model['intercept_gb']:.2f} GB + {model['slope_gb_per_sample']:.4f} GB/sample")
    if limit_gb is not None:
        memory_ax.axhline(limit_gb, color="black", linestyle="--", linewidth=1, label="memory.limit_gb")
    for status, style in (("oom", {"marker": "x", "color": "red", "s": 60}),
                          ("failed", {"marker": "s", "color": "grey", "s": 40})):
        hit = [p["batch_size"] for p in probes if p["status"] == status]
        if hit:
            memory_ax.scatter(hit, [no_fit_height] * len(hit), zorder=3, label=f"{status} probe", **style)
    if record.get("max_batch_size") is not None:
        memory_ax.axvline(record["max_batch_size"], color="tab:green", linewidth=1.5,
                          label=f"max batch size = {record['max_batch_size']}")
    if record.get("recommended_batch_size") is not None:
        memory_ax.axvline(record["recommended_batch_size"], color="tab:green", linestyle=":", linewidth=1,
                          label=f"recommended = {record['recommended_batch_size']}")
    if log_x:
        memory_ax.set_xscale("log")
    memory_ax.set_xlabel("batch size (per rank)")
    memory_ax.set_ylabel("peak memory (GB)")
    memory_ax.set_ylim(0, max(no_fit_height, top) * 1.15)  # room above the limit for the oom marks
    if not fits:
        memory_ax.text(0.5, 0.5, "no probe fit in memory", transform=memory_ax.transAxes, ha="center",
                       color="dimgrey")

    speed = [p for p in fits if p.get("samples_per_s") is not None]
    handles, labels = memory_ax.get_legend_handles_labels()
    if speed:
        speed_ax = memory_ax.twinx()
        speed_ax.plot([p["batch_size"] for p in speed], [p["samples_per_s"] for p in speed], "^:",
                      color="tab:orange", label="samples/s")
        speed_ax.set_ylabel("samples/s")
        speed_ax.set_ylim(bottom=0)
        more_handles, more_labels = speed_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:  # below the plot: inside, it would hide the probes near the limit
        memory_ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3,
                         fontsize="small", frameon=False)
    memory_ax.set_title(textwrap.fill(record.get("setup") or "(defaults)", 80), fontsize="medium")
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def plot_comparison(rows: list[dict], path: Path) -> None:
    """One bar per run: its max batch size when any run searched for one, else samples/s;
    samples/s beside it when both exist. Runs that did not finish ok are hatched grey."""
    plt = _pyplot()
    panels = []
    if any(r.get("max_batch_size") is not None for r in rows):
        panels.append(("max_batch_size", "max batch size (per rank)", "{:,.0f}"))
    if any(r.get("samples_per_s") is not None for r in rows):
        panels.append(("samples_per_s", "samples/s", "{:,.1f}"))
    if not panels:  # every run failed: still show which ones, by status
        panels.append(("samples_per_s", "samples/s", "{:,.1f}"))

    labels = [textwrap.fill(r.get("setup") or "(defaults)", 40) for r in rows]
    height = 1.5 + 0.35 * sum(label.count("\n") + 1.5 for label in labels)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 + 4 * len(panels), height), sharey=True, squeeze=False)
    y = list(range(len(rows)))
    for ax, (key, title, spec) in zip(axes[0], panels):
        values = [r.get(key) for r in rows]
        top = max((v for v in values if v is not None), default=1) or 1
        for i, (row, value) in enumerate(zip(rows, values)):
            if row.get("status") != "ok":
                ax.barh(i, top, color="whitesmoke", edgecolor="grey", hatch="//")
                ax.text(top / 2, i, row.get("status") or "?", ha="center", va="center", color="dimgrey")
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
    axes[0][0].invert_yaxis()  # first run on top, as in the table; the panels share the axis
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
