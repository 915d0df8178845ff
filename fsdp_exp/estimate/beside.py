"""Every training run checks task=estimate against itself (memory.estimate, on by default).

When task=train launches its ranks, the driver starts the estimate of the same setup (its
model, batch, world size and device) in a process of its own at idle priority (Linux's
SCHED_IDLE): it gets only the CPU time the ranks leave. Idle priority does not keep it off
the caches and memory bandwidth the ranks use, so where the ranks run on this machine, rank 0
stops it through the timed steps (fsdp_exp.rank.trace_held): what the run measures is the
run's own, and the trace has the ranks' start-up, the warm-up steps and the run's end. It
writes estimate.json in the run directory and keeps it for the setup's later runs
(fsdp_exp.estimate.earlier): a setup traced before, by a run or by task=estimate, starts no
trace, and its estimate.json is there from the start.

Rank 0, once the last step is measured, records the estimate beside what it measured
(`checked`): in summary.json, its log line and wandb. A trace still going then (on a busy CPU
the start-up and the warm-up leave it little) is waited for: once a setup, since the setup's
later runs have it at once, and at most as long as the run took or FIRST_TRACE_S, whichever
is longer. Where rank 0 cannot see the driver's files, the driver adds it and waits the same
way. A trace that needs longer still is stopped with the run: the summary says `estimate: not
ready`, and nothing it started goes on writing.

What it costs: nothing of the timed steps; the trace's CPU time (the record's `trace_s` also
counts the time it was held or waited for the CPU), taken from what the start-up and the
warm-up leave idle, and on a setup's first run what remains of it after the last step.
memory.estimate=false starts no trace. Ctrl-C stops it with the run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.errors import one_line
from fsdp_exp.estimate.earlier import earlier, keep, setup_key
from fsdp_exp.estimate.predict import CannotTrace, estimate
from fsdp_exp.estimate.record import ESTIMATE_FILE, EstimateRecord
from fsdp_exp.linux import process_running
from fsdp_exp.metrics.summary import ESTIMATED, NOT_READY, Summary, estimate_ratio, estimated

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

SETUP_FILE = ".estimate_setup.pickle"  # the setup, from the driver to the tracing process
FIRST_TRACE_S = 30.0  # the least a run waits at its end for its setup's trace (longer runs: as long as they took)
POLL_S = 0.1


class EstimateBeside:
    """The estimate of the run being launched: one made earlier for this setup, or traced in
    a process of its own (see the module)."""

    def __init__(self, exp: Experiment, nproc: int, run_dir: Path, ranks_per_node: int | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ESTIMATE_FILE
        self.path.unlink(missing_ok=True)  # an earlier attempt's, in a reused run directory
        key = setup_key(exp, nproc, ranks_per_node, exp.device == "cuda")
        kept = earlier(key)
        self.process: subprocess.Popen | None = None
        if kept is not None:
            kept.write_to(self.path)
        else:
            self.process = start_tracing(self.run_dir, (exp, nproc, ranks_per_node, key))

    def add_to(self, summary: dict, run_s: float) -> dict:
        """`summary` (the ranks' figures, after `run_s` seconds) with the estimate checked
        against it, unless rank 0 did so. Where rank 0 did not look (its ranks elsewhere), a
        trace still going is waited for as rank 0 would (`wait_for_estimate`); then it is
        stopped, and without a record the figures say `estimate: not ready`."""
        if "estimate_wait_s" not in summary and self.process is not None:
            wait_for_estimate(self.path, self.process.pid, longest_wait_s(run_s))
        self.stop()
        if "estimate_ratio" in summary or "estimate_failed" in summary:
            return summary
        record = EstimateRecord.read_from(self.path)
        return summary | ({"estimate": NOT_READY} if record is None else checked(Summary.of(summary), record))

    def go_on(self) -> None:
        """The trace goes on, should rank 0 have held it (fsdp_exp.rank.trace_held) and ended
        without letting it go."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """The trace stopped, if it still runs (the process, and what it started), and what it
        left half-written removed: nothing it started outlives the command."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        (self.run_dir / SETUP_FILE).unlink(missing_ok=True)  # if it was stopped before it read it
        for left in self.run_dir.glob(f".{ESTIMATE_FILE}*.tmp"):
            left.unlink(missing_ok=True)
        trace_log = self.run_dir / "estimate.log"
        if trace_log.exists() and not trace_log.stat().st_size:
            trace_log.unlink()


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
    if found and record.reused_from:
        found["estimate_reused_from"] = record.reused_from
    return found


def start_tracing(run_dir: Path, work: tuple) -> subprocess.Popen:
    """`python -m fsdp_exp.estimate.beside <run_dir>`, which reads the setup from SETUP_FILE
    (and removes it), in a session of its own (a terminal's Ctrl-C goes to the run; the run
    stops it), with this process's import path (a user's model and data)."""
    (run_dir / SETUP_FILE).write_bytes(pickle.dumps(work))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    with open(run_dir / "estimate.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "fsdp_exp.estimate.beside", str(run_dir)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)


def at_idle_priority() -> None:
    """The calling thread, and what it starts, at idle priority, where the system has it."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def longest_wait_s(run_s: float) -> float:
    """How long a run that took `run_s` waits at its end for its trace."""
    return max(FIRST_TRACE_S, run_s)


def tracing(pid: int | None) -> bool:
    """Whether the tracing process `pid` still runs (one ended but not yet waited for by the
    driver has ended)."""
    return pid is not None and process_running(pid)


def wait_for_estimate(path: Path, pid: int | None, longest_s: float) -> tuple[EstimateRecord | None, float]:
    """The run's estimate record, and how long it was waited for: at once when it is written
    (kept from an earlier trace, or traced during the run); else while its tracing process
    (`pid`) runs, at most `longest_s`. None when the trace ended without one or needs longer."""
    start = time.perf_counter()
    while True:
        going = tracing(pid)
        record = EstimateRecord.read_from(path)  # read after the look: a trace that ended has written it
        waited = time.perf_counter() - start
        if record is not None or not going or waited >= longest_s:
            return record, waited
        time.sleep(min(POLL_S, longest_s - waited))


def main() -> None:
    """The tracing process: the estimate, written beside the run and kept for its setup."""
    run_dir = Path(sys.argv[1])
    at_idle_priority()
    setup = run_dir / SETUP_FILE
    exp, nproc, ranks_per_node, key = pickle.loads(setup.read_bytes())
    setup.unlink()
    failed: Exception | None = None
    try:
        record = estimate(exp, nproc, [exp.train.batch_size], exp.device == "cuda", ranks_per_node=ranks_per_node)
    except Exception as err:  # noqa: BLE001 - recorded in one line; the run goes on
        record, failed = EstimateRecord(error=one_line(err, limit=300)), err
    if failed is None or isinstance(failed, CannotTrace):  # the setup's own failure is kept too, not its process's
        keep(key, record)
    record.write_to(run_dir / ESTIMATE_FILE)


if __name__ == "__main__":
    main()
