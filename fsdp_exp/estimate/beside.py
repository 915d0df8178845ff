"""Every training run checks task=estimate against itself (memory.estimate, on by default).

When task=train launches its ranks, the driver starts the estimate of the same setup (its
model, batch, world size and device) in a thread whose tracing process runs at idle
priority (Linux's SCHED_IDLE): it gets only the CPU time the ranks leave, so what the run
measures is the run's own. The record goes to estimate.json in the run directory. Rank 0,
once the last step is measured, waits for it (at most WAIT_S) and records the estimate
beside what it measured (`checked`): in summary.json, its log line and wandb. When rank 0
cannot see the driver's files (a launcher on other machines) or the trace comes later, the
driver adds it to summary.json itself.

What it costs: the trace's CPU time (a few seconds for the ViT or GPT-2 small, traced
alone; the record's `trace_s` also counts the time it waited for the CPU) and, where the
ranks leave no CPU idle (a CPU run), about that long a wait at the end of the run
(`estimate_wait_s`). memory.estimate=false starts no trace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.errors import one_line
from fsdp_exp.estimate.predict import estimate
from fsdp_exp.metrics.sinks import ESTIMATED, read_json, write_json

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

ESTIMATE_FILE = "estimate.json"
WAIT_S = 300.0  # rank 0's wait at the end of the run; the driver waits as long as the trace may run
POLL_S = 0.2


class EstimateBeside:
    """The estimate of the run being launched, traced in the background (see the module)."""

    def __init__(self, exp: Experiment, nproc: int, run_dir: Path, ranks_per_node: int | None = None):
        self.path = Path(run_dir) / ESTIMATE_FILE
        self.path.unlink(missing_ok=True)  # an earlier attempt's, in a reused run directory
        self.record: dict | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._trace, args=(exp, nproc, ranks_per_node), name="estimate",
                                       daemon=True)
        self.thread.start()

    def _trace(self, exp: Experiment, nproc: int, ranks_per_node: int | None) -> None:
        at_idle_priority()  # this thread's; the tracing process it starts inherits it
        # Ctrl-C goes to the whole process group: the tracing process (it inherits this
        # thread's signal mask) leaves it to the driver, which stops it on its way out.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            record = estimate(exp, nproc, [exp.train.batch_size], exp.device == "cuda", ranks_per_node=ranks_per_node)
        except Exception as err:  # noqa: BLE001 - recorded in one line; the run goes on
            record = {"error": one_line(err, limit=300)}
        with contextlib.suppress(OSError):
            write_json(self.path, record)
        self.record = record
        self.done.set()

    def add_to(self, summary: dict) -> dict:
        """`summary` with the estimate checked against it, unless rank 0 did so: waits for
        the trace as long as it may run."""
        if "estimated_peak_gb" in summary or "estimate_failed" in summary:
            return summary
        start = time.perf_counter()
        self.done.wait()
        assert self.record is not None
        return summary | checked(summary, self.record) | {"estimate_wait_s": time.perf_counter() - start}


def at_idle_priority() -> None:
    """The calling thread, and what it starts, at idle priority, where the system has it."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def awaited(path: Path, wait_s: float = WAIT_S) -> tuple[dict | None, float]:
    """Rank 0: the driver's estimate record once it is written, and how long it waited;
    None if it did not come within `wait_s`."""
    start = time.perf_counter()
    while True:
        record = read_json(path)
        waited = time.perf_counter() - start
        if record is not None or waited >= wait_s:
            return record, waited
        time.sleep(POLL_S)


def checked(summary: dict, record: dict) -> dict:
    """The estimate beside what the run measured: `estimated_peak_gb` beside `peak_mem_gb`
    (a training step's peak, the runtime left out) and `estimate_ratio`, estimated over
    measured; under a CPU memory.limit_gb, the peak as the limit counts it; on a GPU the
    allocator's reserved peak and the device's whole use. Or why there is none."""
    if "error" in record:
        return {"estimate_failed": record["error"]}
    step = record["batches"][0]
    found = {"estimated_peak_gb": record["step_mem_gb"]}
    if summary.get("peak_under_limit_gb") is not None:
        found["estimated_under_limit_gb"] = step["predicted_peak_gb"]  # the limit counts every phase since it was set
    if "reserved_gb" in step:
        found["estimated_reserved_gb"] = step["reserved_gb"]
        found["estimated_device_gb"] = step["device_gb"]
    for _, measured, estimated, ratio in ESTIMATED:
        if estimated in found and summary.get(measured):
            found[ratio] = found[estimated] / summary[measured]
    return found
