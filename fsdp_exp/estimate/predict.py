"""The estimate of a setup: each rank's peak memory by batch size at any world size, from a
trace of its training steps on fake tensors (`trace`) in a process of its own, and what the
peaks are made of (`breakdown`). task=estimate prints it; task=max_batch places its probes
by it."""

from __future__ import annotations

import math
import multiprocessing
import time
import warnings
from typing import TYPE_CHECKING, Any

from fsdp_exp.errors import one_line
from fsdp_exp.estimate.breakdown import CUDA_CONTEXT_GB, GB, estimate_batch
from fsdp_exp.estimate.curve import PeakCurve
from fsdp_exp.launch.core import RunFailed

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

TIME_LIMIT_S = 900  # a trace past this is stopped: something in it does not run on fake tensors


def estimate(exp: Experiment, world_size: int, batch_sizes: list[int], on_gpu: bool,
             baseline_gb: float | None = None, stop_above_gb: float | None = None) -> dict:
    """The estimate record, traced in a fresh process (see `trace_in_child`). With
    `stop_above_gb`, the sizes are traced in order up to the first whose step is predicted
    to peak above it."""
    start = time.perf_counter()
    traced = trace_in_child(exp, world_size, batch_sizes, on_gpu, baseline_gb, stop_above_gb)
    baseline_gb = baseline_or_measured(baseline_gb, on_gpu, traced.baseline_bytes)
    builds_whole = exp.model.init_device != "meta"
    batches = [estimate_batch(step, traced, on_gpu, exp.offload, baseline_gb, builds_whole) for step in traced.steps]
    limit = exp.memory.limit_gb
    fitting = [b for b in batches if limit is not None and b.limited_gb <= limit]
    chosen = fitting[-1] if fitting else batches[0]
    return {
        "device": "cuda" if on_gpu else "cpu",
        "world_size": world_size,
        "shards": traced.shard_count,
        "params": traced.params,
        "batch_size": chosen.batch_size,
        # as a run's peak_mem_gb: the runtime left out, the data set (loaded after it) in
        "peak_mem_gb": chosen.predicted_peak_gb - baseline_gb + (0 if on_gpu else traced.data_bytes / GB),
        "predicted_peak_gb": chosen.predicted_peak_gb,
        "step_peak_gb": chosen.step_peak_gb,
        "phase": chosen.phase,
        "breakdown_gb": chosen.breakdown_gb,
        **({"reserved_gb": chosen.reserved_gb} if chosen.reserved_gb is not None else {}),
        **({"offloaded_gb": chosen.offloaded_gb} if chosen.offloaded_gb is not None else {}),
        "build_peak_gb": (traced.build_bytes / GB + baseline_gb) if builds_whole else None,
        "limit_gb": limit,
        "largest_batch_fitting": fitting[-1].batch_size if fitting else (None if limit is None else 0),
        "predicted_max_batch": crossing(batches, limit),
        "batches": [b.to_json() for b in batches],
        "trace_s": traced.seconds,
        "wall_s": time.perf_counter() - start,
    }


def crossing(batches: list, limit_gb: float | None) -> int | None:
    """Where the estimate's curve (straight between the sizes traced, on past the largest
    along the last two) reaches the limit: the boundary it predicts, also between or
    beyond the sizes asked for."""
    if limit_gb is None or len(batches) < 2:
        return None
    size = PeakCurve(tuple((b.batch_size, b.limited_gb) for b in batches)).crossing(limit_gb)
    return None if math.isinf(size) else max(0, math.floor(size))


def baseline_or_measured(baseline_gb: float | None, on_gpu: bool, measured_bytes: int) -> float:
    """task.baseline_gb, or by default the CUDA context on a GPU and what the tracing process
    held before building the model on CPU."""
    if baseline_gb is not None:
        return baseline_gb
    return CUDA_CONTEXT_GB if on_gpu else measured_bytes / GB


def trace_in_child(exp: Experiment, world_size: int, batch_sizes: list[int], on_gpu: bool,
                   baseline_gb: float | None = None, stop_above_gb: float | None = None) -> Any:
    """The trace, in a fresh process: the fake process group is this process's own, nothing
    of the driver's (threads, a sweep's other runs) is in the way, and what the process
    holds before tracing is what a rank holds before building its model (the baseline)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_traced, args=(child, exp, world_size, batch_sizes, on_gpu, baseline_gb,
                                                    stop_above_gb), daemon=True)
    process.start()
    child.close()
    try:
        if parent.poll(TIME_LIMIT_S):
            ok, result = parent.recv()
        else:
            ok, result = False, f"it ran past {TIME_LIMIT_S} s"
    except EOFError:
        process.join(5)
        ok, result = False, f"the tracing process ended with exit code {process.exitcode}"
    finally:
        if process.is_alive():
            process.kill()
        process.join()
    if not ok:
        raise RunFailed(f"task=estimate could not trace this setup: {result}")
    return result


def _traced(pipe: Any, exp: Experiment, world_size: int, batch_sizes: list[int], on_gpu: bool,
            baseline_gb: float | None, stop_above_gb: float | None) -> None:
    warnings.filterwarnings("ignore")
    try:
        from fsdp_exp.estimate.trace import trace  # here, in the child: tracing's imports cost the driver 0.5 s

        def enough(step: Any, baseline_bytes: int) -> bool:
            base = baseline_or_measured(baseline_gb, on_gpu, baseline_bytes)
            return estimate_batch(step, None, on_gpu, exp.offload, base, False).limited_gb > stop_above_gb

        pipe.send((True, trace(exp, world_size, batch_sizes, on_gpu, enough if stop_above_gb is not None else None)))
    except Exception as err:  # noqa: BLE001 - sent back as one line
        pipe.send((False, one_line(err, named=True, whole=True, limit=500)))
