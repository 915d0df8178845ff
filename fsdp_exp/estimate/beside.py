"""Every training run checks task=estimate against itself (memory.estimate, on by default).

When task=train launches its ranks, the driver starts the estimate of the same setup (its
model, batch, world size and device) in a process of its own at idle priority (Linux's
SCHED_IDLE): it gets only the CPU time the ranks leave. Idle priority does not keep it off
the caches and memory bandwidth the ranks use, so where the ranks run on this machine, rank 0
stops it through the timed steps (fsdp_exp.rank.trace_held): what the run measures is the
run's own, and the trace has the ranks' start-up, the warm-up steps and the run's end. It
writes estimate.json in the run directory. Rank 0, once the last step is
measured, looks for it for at most WAIT_S and records the estimate beside what it measured
(`checked`): in summary.json, its log line and wandb. When the trace is not done by then
(a CPU run leaves it little idle CPU) or rank 0 cannot see the driver's files, the driver
adds it if it is there, else the summary says `estimate: pending` and the command ends
without waiting: the tracing process, when it ends, writes estimate.json and adds the
estimate to summary.json itself (not to wandb, whose run has ended).

What it costs: nothing of the timed steps; the trace's CPU time (the record's `trace_s` also
counts the time it was held or waited for the CPU), taken from what the start-up and the
warm-up leave idle, and at most WAIT_S at the run's end. memory.estimate=false starts
no trace. Ctrl-C stops it with the run.
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
from fsdp_exp.estimate.predict import estimate
from fsdp_exp.estimate.record import ESTIMATE_FILE, EstimateRecord
from fsdp_exp.estimate.settle import RECORD_FILE, checked
from fsdp_exp.metrics.summary import PENDING, Summary

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

SETUP_FILE = ".estimate_setup.pickle"  # the setup, from the driver to the tracing process
WAIT_S = 0.8  # rank 0's look for the record at the run's end: under a second
POLL_S = 0.2


class EstimateBeside:
    """The estimate of the run being launched, traced in a process of its own (see the module)."""

    def __init__(self, exp: Experiment, nproc: int, run_dir: Path, ranks_per_node: int | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ESTIMATE_FILE
        self.path.unlink(missing_ok=True)  # an earlier attempt's, in a reused run directory
        self.process = start_tracing(self.run_dir, (exp, nproc, ranks_per_node))

    def add_to(self, summary: dict) -> dict:
        """`summary` (the ranks' figures) with the estimate checked against it, unless rank 0
        did so; if it is still tracing, `estimate: pending` (the tracing process adds it when
        it ends)."""
        if "estimate_ratio" in summary or "estimate_failed" in summary:
            return summary
        record = EstimateRecord.read_from(self.path)
        return summary | ({"estimate": PENDING} if record is None else checked(Summary.of(summary), record))

    def go_on(self) -> None:
        """The trace goes on, should rank 0 have held it (fsdp_exp.rank.trace_held) and ended
        without letting it go."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """The run was stopped: so is its trace (the process and the one tracing)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        (self.run_dir / SETUP_FILE).unlink(missing_ok=True)  # if it was stopped before it read it


def start_tracing(run_dir: Path, work: tuple) -> subprocess.Popen:
    """`python -m fsdp_exp.estimate.beside <run_dir> <driver pid> <start time>`, which reads
    the setup from SETUP_FILE (and removes it), in a session of its own (a terminal's Ctrl-C
    goes to the run; the run stops it), with this process's import path (a user's model and
    data)."""
    (run_dir / SETUP_FILE).write_bytes(pickle.dumps(work))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    with open(run_dir / "estimate.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "fsdp_exp.estimate.beside", str(run_dir), str(os.getpid()),
                                 repr(time.time())],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)


def at_idle_priority() -> None:
    """The calling thread, and what it starts, at idle priority, where the system has it."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def wait_for_estimate(path: Path, wait_s: float = WAIT_S) -> tuple[EstimateRecord | None, float]:
    """Rank 0: the driver's estimate record if it is written within `wait_s`, and how long
    it looked."""
    start = time.perf_counter()
    while True:
        record = EstimateRecord.read_from(path)
        waited = time.perf_counter() - start
        if record is not None or waited >= wait_s:
            return record, waited
        time.sleep(min(POLL_S, wait_s - waited))


def main() -> None:
    """The tracing process: the estimate, then (fsdp_exp.estimate.settle) the run's summary
    once the driver wrote it."""
    run_dir = Path(sys.argv[1])
    at_idle_priority()
    setup = run_dir / SETUP_FILE
    exp, nproc, ranks_per_node = pickle.loads(setup.read_bytes())
    setup.unlink()
    try:
        record = estimate(exp, nproc, [exp.train.batch_size], exp.device == "cuda", ranks_per_node=ranks_per_node)
    except Exception as err:  # noqa: BLE001 - recorded in one line; the run goes on
        record = EstimateRecord(error=one_line(err, limit=300))
    # What is left is to wait for the run's summary: done by a light process in this one's
    # place, which puts the record in place as it starts, once this one's memory is gone.
    record.write_to(run_dir / RECORD_FILE)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "fsdp_exp.estimate.settle", *sys.argv[1:4]])


if __name__ == "__main__":
    main()
