"""A run's own estimate beside what the run measured (fsdp_exp.estimate.beside), and the
summary the driver wrote, completed once the estimate is there.

Light on purpose: the tracing process, once it has written the record (RECORD_FILE), becomes
`python -m fsdp_exp.estimate.settle <run_dir> <driver pid> <start time>` (exec, the same
process), which puts it in place as estimate.json and waits for the run's summary without
torch or the traced model in memory.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fsdp_exp.estimate.record import ESTIMATE_FILE, EstimateRecord
from fsdp_exp.metrics.summary import ESTIMATED, PENDING, SUMMARY, Summary, estimate_ratio, estimated

RECORD_FILE = ".estimate_record.json"  # the record, written by the tracing process before it becomes this one
POLL_S = 0.2


def checked(summary: Summary, record: EstimateRecord) -> dict:
    """The estimate beside what the run measured: each figure of the record that the run
    measured too (`ESTIMATED`: the record names them as the run does) as
    `estimated_<figure>`, and estimated over measured as `estimate_ratio_<figure>`; the
    first of those is `estimate_ratio`: on CPU what the allocations held where the step's
    phases end (the resident peak also holds what glibc keeps of freed blocks), on a GPU
    the allocator's peak. Or why there is none."""
    if record.error is not None:
        return {"estimate_failed": record.error}
    found: dict = {}
    for _, measured in ESTIMATED:
        if record.get(measured) is None or summary.get(measured) is None:
            continue
        found[estimated(measured)] = record.get(measured)
        if summary.get(measured):
            found[estimate_ratio(measured)] = record.get(measured) / summary.get(measured)
            found.setdefault("estimate_ratio", found[estimate_ratio(measured)])
    return found


def settle(run_dir: Path) -> bool:
    """A summary that says `estimate: pending`, with the estimate checked against it, once
    the record is there; True if it was."""
    summary, record = Summary.read(run_dir), EstimateRecord.read(run_dir)
    if summary is None or record is None or summary.estimate != PENDING:
        return False
    summary.estimate = None
    summary.with_figures(checked(summary, record)).write(run_dir)  # the driver wrote it once, before
    return True


def settled_summary(run_dir: Path, timeout_s: float = 300) -> Summary | None:
    """A run's summary.json once its own estimate is in it (or `timeout_s` has passed): a
    run does not wait for its trace (`estimate: pending`), which adds it when it ends. None
    when the run wrote no summary."""
    deadline = time.monotonic() + timeout_s
    while True:
        summary = Summary.read(run_dir)
        if summary is None or summary.estimate != PENDING or time.monotonic() > deadline:
            return summary
        time.sleep(POLL_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def main() -> None:
    """Put the tracing process's record in place, wait for the summary the driver writes once the ranks end (until then, or until the
    driver is gone, a summary older than the tracing process is an earlier attempt's), and
    complete it."""
    run_dir, driver, started = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    (run_dir / RECORD_FILE).replace(run_dir / ESTIMATE_FILE)
    summary = run_dir / SUMMARY
    while _alive(driver) and not (summary.exists() and summary.stat().st_mtime >= started - 1.0):
        time.sleep(0.5)
    settle(run_dir)
    log = run_dir / "estimate.log"
    if log.exists() and not log.stat().st_size:
        log.unlink()


if __name__ == "__main__":
    main()
