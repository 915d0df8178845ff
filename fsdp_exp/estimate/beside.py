"""Every training run checks task=estimate against itself (memory.estimate, on by default).

When task=train launches its ranks, the driver starts the estimate of the same setup (its
model, batch, world size and device) in a process of its own at idle priority (Linux's
SCHED_IDLE): it gets only the CPU time the ranks leave, so what the run measures is the
run's own. It writes estimate.json in the run directory. Rank 0, once the last step is
measured, looks for it for at most WAIT_S and records the estimate beside what it measured
(`checked`): in summary.json, its log line and wandb. When the trace is not done by then
(a CPU run leaves it little idle CPU) or rank 0 cannot see the driver's files, the driver
adds it if it is there, else the summary says `estimate: pending` and the command ends
without waiting: the tracing process, when it ends, writes estimate.json and adds the
estimate to summary.json itself (not to wandb, whose run has ended).

What it costs: the trace's CPU time (a few seconds for the ViT or GPT-2 small, traced
alone; the record's `trace_s` also counts the time it waited for the CPU), taken from what
the ranks leave idle, and at most WAIT_S at the run's end. memory.estimate=false starts
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
from fsdp_exp.metrics.sinks import ESTIMATED, PENDING, estimate_ratio, estimated, read_json, write_json

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

ESTIMATE_FILE = "estimate.json"
SUMMARY_FILE = "summary.json"
SETUP_FILE = ".estimate_setup.pickle"  # the setup, from the driver to the tracing process
WAIT_S = 1.0  # rank 0's look for the record at the run's end
POLL_S = 0.2


class EstimateBeside:
    """The estimate of the run being launched, traced in a process of its own (see the module)."""

    def __init__(self, exp: Experiment, nproc: int, run_dir: Path, ranks_per_node: int | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ESTIMATE_FILE
        self.path.unlink(missing_ok=True)  # an earlier attempt's, in a reused run directory
        self.process = start_tracing(self.run_dir, (exp, nproc, ranks_per_node))

    def add_to(self, summary: dict) -> dict:
        """`summary` with the estimate checked against it, unless rank 0 did so; if it is
        still tracing, `estimate: pending` (the tracing process adds it when it ends)."""
        if "estimate_ratio" in summary or "estimate_failed" in summary:
            return summary
        record = read_json(self.path)
        return summary | ({"estimate": PENDING} if record is None else checked(summary, record))

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


def awaited(path: Path, wait_s: float = WAIT_S) -> tuple[dict | None, float]:
    """Rank 0: the driver's estimate record if it is written within `wait_s`, and how long
    it looked."""
    start = time.perf_counter()
    while True:
        record = read_json(path)
        waited = time.perf_counter() - start
        if record is not None or waited >= wait_s:
            return record, waited
        time.sleep(POLL_S)


def checked(summary: dict, record: dict) -> dict:
    """The estimate beside what the run measured: each figure of the record that the run
    measured too (`ESTIMATED`: the record names them as the run does) as
    `estimated_<figure>`, and estimated over measured as `estimate_ratio_<figure>`; the
    first of those is `estimate_ratio`: on CPU what the allocations held where the step's
    phases end (the resident peak also holds what glibc keeps of freed blocks), on a GPU
    the allocator's peak. Or why there is none."""
    if "error" in record:
        return {"estimate_failed": record["error"]}
    found: dict = {}
    for _, measured in ESTIMATED:
        if record.get(measured) is None or summary.get(measured) is None:
            continue
        found[estimated(measured)] = record[measured]
        if summary[measured]:
            found[estimate_ratio(measured)] = record[measured] / summary[measured]
            found.setdefault("estimate_ratio", found[estimate_ratio(measured)])
    return found


def settle(run_dir: Path) -> bool:
    """A summary that says `estimate: pending`, with the estimate checked against it, once
    the record is there; True if it was."""
    summary, record = read_json(run_dir / SUMMARY_FILE), read_json(run_dir / ESTIMATE_FILE)
    if summary is None or record is None or summary.get("estimate") != PENDING:
        return False
    summary.pop("estimate")
    write_json(run_dir / SUMMARY_FILE, summary | checked(summary, record))  # the driver wrote it once, before
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def main() -> None:
    """The tracing process: the estimate, then the run's summary once the driver wrote it."""
    run_dir, driver, started = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    at_idle_priority()
    setup = run_dir / SETUP_FILE
    exp, nproc, ranks_per_node = pickle.loads(setup.read_bytes())
    setup.unlink()
    try:
        record = estimate(exp, nproc, [exp.train.batch_size], exp.device == "cuda", ranks_per_node=ranks_per_node)
    except Exception as err:  # noqa: BLE001 - recorded in one line; the run goes on
        record = {"error": one_line(err, limit=300)}
    write_json(run_dir / ESTIMATE_FILE, record)
    # The driver writes the summary once the ranks end: until then (or until it is gone)
    # a summary older than this process is an earlier attempt's.
    summary = run_dir / SUMMARY_FILE
    while _alive(driver) and not (summary.exists() and summary.stat().st_mtime >= started - 1.0):
        time.sleep(0.5)
    settle(run_dir)
    log = run_dir / "estimate.log"
    if log.exists() and not log.stat().st_size:
        log.unlink()


if __name__ == "__main__":
    main()
