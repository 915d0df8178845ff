"""The estimate's curve for task=max_batch (task.estimate=true).

One task=estimate trace (`fsdp_exp.estimate.predict`, on fake tensors, nothing allocated) at
doubling sizes from task.resolution, up to the first predicted to peak above the
memory limit (from 2 when the traced step of 1 fails: a model that cannot train on one
sample). The search moves the curve through its probes, so its level need not be right,
only its shape; each probe shows the estimate beside its peak.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fsdp_exp.estimate.curve import PeakCurve
from fsdp_exp.estimate.predict import CannotTrace, estimate
from fsdp_exp.launcher.core import RunFailed

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

log = logging.getLogger("fsdp_exp")


def doubling(resolution: int, up_to: int) -> list[int]:
    """resolution, 2x, 4x, ... and up_to."""
    sizes = [resolution]
    while sizes[-1] * 2 < up_to:
        sizes.append(sizes[-1] * 2)
    return sorted({*sizes, max(resolution, up_to // resolution * resolution)})


def estimate_curve(cfg: Experiment, world_size: int, limit_gb: float) -> dict:
    """The record of the estimate: its peaks by batch size as the limit counts them (on a
    GPU, what the allocator would reserve), or why there are none."""
    settings = cfg.task
    start = time.perf_counter()
    on_gpu = cfg.device == "cuda"
    sizes = doubling(settings.resolution, settings.search_up_to)
    try:
        try:
            record = estimate(cfg, world_size, sizes, on_gpu, stop_above_gb=limit_gb)
        except CannotTrace as err:  # the traced step itself failed (not its time, nor its process)
            if sizes[0] != 1 or len(sizes) < 2:
                raise
            # as the search does: a model may not train on one sample (BatchNorm with one value per channel)
            log.info("%s; tracing again from batch %d, in case 1 is too small to train", err, sizes[1])
            record = estimate(cfg, world_size, sizes[1:], on_gpu, stop_above_gb=limit_gb)
    except RunFailed as err:
        log.warning("%s; the search places its probes without it (task.estimate=false skips it)", err)
        return {"error": str(err), "wall_s": time.perf_counter() - start}
    peaks = [[b["batch_size"], b["peak_under_limit_gb"]] for b in record.batches]
    wall = time.perf_counter() - start
    log.info("estimate: %s in %.0f s", ", ".join(f"batch {b} {p:.3f} GB" for b, p in peaks), wall)
    return {"device": record.device, "peaks_gb": peaks, "step_work": record.step_work, "wall_s": wall}


def prior(record: dict | None) -> PeakCurve | None:
    if not record or not record.get("peaks_gb"):
        return None
    return PeakCurve(tuple((int(b), float(p)) for b, p in record["peaks_gb"]))
