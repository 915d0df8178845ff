"""What task=max_batch writes once its answer is known: max_batch.png, the wandb run (the
probes as a table, the plot, the answer in its summary), the answer in one line, and the
summary's figures, each from the search's record (a `MaxBatchRecord`). max_batch.json itself
is the search's, rewritten after every probe."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.metrics.figures import MaxBatchAnswer
from fsdp_exp.metrics.summary import NONE_FITS, PEAK_GB
from fsdp_exp.tasks.wandb_record import log_record
from fsdp_exp.tasks.max_batch.answer import answer_line
from fsdp_exp.tasks.max_batch.plot import plot_max_batch
from fsdp_exp.tasks.max_batch.record import RECORD, MaxBatchRecord

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


def report(cfg: Experiment, context: RunContext, run_dir: Path, record: MaxBatchRecord,
           own_wandb_run: bool = True) -> None:
    """max_batch.png, wandb (unless the search is a tune's setup), and the answer in one line."""
    png = run_dir / "max_batch.png"
    plot_max_batch(record, png)
    if own_wandb_run:
        log_to_wandb(cfg, context, run_dir, record, png)
    log.info("%s", answer_line(record, cfg.memory.limit_gb) + f" -> {run_dir / RECORD}")


# The record's figures that go into the summary as they are (fsdp_exp.metrics.summary.Summary)
SUMMARY_FIGURES = ("max_batch_size", "recommended_batch_size", "bounded_by", "resolution", "limit_gb",
                   "peak_under_limit_gb", "noise_band_gb", "noise_band_samples", "smallest_batch_needs_gb",
                   "searched_from", "data_share_per_rank", "fastest_batch_size", "fastest_samples_per_s",
                   "near_fastest_batch_size", "samples_per_s", PEAK_GB, "peak_mem_gb_per_rank", "world_size",
                   "searched_max_batch_size", "run_beyond_probe_gb")


def summary_figures(record: MaxBatchRecord) -> MaxBatchAnswer:
    """The search's answer in its summary.json."""
    answer = MaxBatchAnswer(task="max_batch", **{name: getattr(record, name) for name in SUMMARY_FIGURES},
                            probes=record.probe_count, verification=record.verification["status"])
    if record.recommended_keeps_margin is False:  # as the answer's line says: none is recommended
        answer.recommended_batch_size = None
    if record.max_batch_size == 0:  # an answer, but not a success a script should read as one
        answer.status = NONE_FITS
    return answer


PROBE_COLUMNS = ("batch_size", "status", "peak_under_limit_gb", "margin_gb", "within_noise", "predicted_peak_gb",
                 "estimated_peak_under_limit_gb", "estimate_ratio", PEAK_GB, "samples_per_s", "alloc_retries",
                 "wall_s", "reason")


def log_to_wandb(cfg: Experiment, context: RunContext, run_dir: Path, record: MaxBatchRecord, png: Path) -> None:
    """The probes as a wandb table, the plot as an image, the answer in the run summary."""
    log_record(cfg, context, run_dir, "probes", PROBE_COLUMNS, record.probes, {"max_batch": png},
               summary_figures(record).figures())
