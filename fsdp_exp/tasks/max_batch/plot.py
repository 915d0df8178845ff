"""max_batch.png: a search's record (a `MaxBatchRecord`) drawn, for people."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.metrics.plots import DPI, none_fits_at, pyplot
from fsdp_exp.metrics.summary import PEAK_GB

if TYPE_CHECKING:
    from fsdp_exp.tasks.max_batch.record import MaxBatchRecord

# Past this spread of probed sizes, a linear axis crushes the small probes into one spot.
LOG_X_ABOVE_RATIO = 16

MEASURES = {"peak_under_limit_gb": "peak as memory.limit_gb counts it", "peak_reserved_gb": "peak reserved",
            PEAK_GB: "peak memory"}


def plot_max_batch(record: MaxBatchRecord, path: Path) -> list[str]:
    """The record drawn: above, the peak the limit counts per probed batch size, the
    fitted line, the limit with its noise band and the answer; below, samples/s per batch
    size with the fastest batch and the smallest within 5% of it. Returns the texts drawn
    (legend entries and notes)."""
    plt = pyplot()
    probes = sorted(record.probes, key=lambda p: p["batch_size"])
    model = record.memory_model
    measure = (model or {}).get("measure", "peak_under_limit_gb")
    fits = [p for p in probes if p["status"] == "ok" and p.get(measure) is not None]
    limit_gb = record.limit_gb
    # oom and failed probes have no peak; they are drawn where they hit: the limit, or just
    # above the highest peak when no limit was set.
    top = max((p[measure] for p in fits), default=1.0)
    no_fit_height = limit_gb if limit_gb is not None else top * 1.05

    fig, (memory_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, height_ratios=[3, 2])
    for within, style in ((False, {"color": "tab:blue"}), (True, {"color": "tab:orange"})):
        shown = [p for p in fits if bool(p.get("within_noise")) == within]
        if shown:
            label = f"{MEASURES.get(measure, measure)} (max over ranks)" if not within else "fit inside the noise band"
            memory_ax.plot([p["batch_size"] for p in shown], [p[measure] for p in shown], "o", label=label, **style)
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
        noise = record.noise_band_gb
        if noise:
            memory_ax.axhspan(limit_gb - noise, limit_gb, color="grey", alpha=0.25,
                              label=f"noise band ({noise * 1024:.1f} MB)")
    for status, style in (("oom", {"marker": "x", "color": "red", "s": 60}),
                          ("failed", {"marker": "s", "color": "grey", "s": 40})):
        hit = [p["batch_size"] for p in probes if p["status"] == status]
        if hit:
            memory_ax.scatter(hit, [no_fit_height] * len(hit), zorder=3, label=f"{status} probe", **style)
    answer = record.max_batch_size
    for ax in (memory_ax, speed_ax):
        if answer:
            ax.axvline(answer, color="tab:green", linewidth=1.5,
                       label=f"max batch size = {answer}" if ax is memory_ax else None)
        if record.recommended_batch_size:
            ax.axvline(record.recommended_batch_size, color="tab:green", linestyle=":", linewidth=1,
                       label=f"recommended = {record.recommended_batch_size}" if ax is memory_ax else None)
    if log_x:
        memory_ax.set_xscale("log")
    memory_ax.set_ylabel("peak memory per rank (GB)")
    memory_ax.set_ylim(0, max(no_fit_height, top) * 1.15)  # room above the limit for the oom marks
    if not answer:
        size = record.searched_from or record.resolution or 1  # past sizes too small to train
        memory_ax.text(0.5, 0.5, none_fits_at(size, record.smallest_batch_needs_gb), transform=memory_ax.transAxes,
                       ha="center", color="dimgrey")
    memory_ax.legend(loc="lower right", fontsize="small")
    memory_ax.set_title(textwrap.fill(record.setup or "(defaults)", 80), fontsize="medium")
    _plot_speed(speed_ax, record, fits)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    texts = [t.get_text() for ax in (memory_ax, speed_ax) for t in ax.texts]
    texts += [t.get_text() for ax in (memory_ax, speed_ax) if ax.get_legend() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    return texts


def _plot_speed(ax: Any, record: MaxBatchRecord, fits: list[dict]) -> None:
    speed = [p for p in fits if p.get("samples_per_s") is not None]
    ax.plot([p["batch_size"] for p in speed], [p["samples_per_s"] for p in speed], "^:", color="tab:purple",
            label="samples/s")
    retried = [p for p in speed if p.get("alloc_retries")]
    if retried:
        ax.scatter([p["batch_size"] for p in retried], [p["samples_per_s"] for p in retried], s=120,
                   facecolors="none", edgecolors="red", label="allocator retries")
    if record.fastest_batch_size:
        fastest = record.fastest_samples_per_s
        ax.scatter([record.fastest_batch_size], [fastest], marker="*", s=200, color="gold", edgecolors="black",
                   zorder=3, label=f"fastest = {record.fastest_batch_size}")
        ax.axhspan(0.95 * fastest, fastest, color="gold", alpha=0.2,
                   label=f"within 5% of the fastest, from {record.near_fastest_batch_size}")
    ax.set_xlabel("batch size (per rank)")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    if speed:
        ax.legend(loc="lower right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no probe trained", transform=ax.transAxes, ha="center", color="dimgrey")
