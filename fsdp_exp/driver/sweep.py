"""A sweep's runs side by side, on a launcher that hands its ranks to a cluster.

Hydra's sweep calls the run function once per combination, one after the other. For a
launcher whose `max_parallel` is above 1 (launcher=slurm, launcher=ray), the run function
starts the run's driver side in a thread and returns at once, so every combination is
submitted before any has finished; a new one waits while `max_parallel` are in flight.
Each run keeps its own run directory, summary.json and log file. `RunOutcomes` (Hydra's
callback) waits for them at the end of the sweep and lists the failed ones.

Launchers (fsdp_exp.launcher.core.watch) see the run's `Alongside` and print one line per
change of its job's state instead of echoing rank 0's lines, which would interleave.
A task=max_batch search is one run: its probes go one after another in the run's thread,
while the sweep's other searches run beside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from fsdp_exp.launcher.core import POLL_S, Alongside, alongside

log = logging.getLogger("fsdp_exp")

JOIN_S = 60  # after Ctrl-C, how long the runs have to stop their jobs


class RunName(logging.Filter):
    """Puts the run's name before the driver's lines of a run that runs beside others."""

    def filter(self, record: logging.LogRecord) -> bool:
        run = alongside.get()
        if run is not None and not getattr(record, "run_named", False):
            record.msg = f"{run.name}: {record.msg}"
            record.run_named = True
        return True


class OwnRun(logging.Filter):
    """Lets through only the lines of one run, for its own log file."""

    def __init__(self, run: Alongside):
        super().__init__()
        self.run = run

    def filter(self, record: logging.LogRecord) -> bool:
        return alongside.get() is self.run


class SideBySide:
    """The runs of this command that run beside each other, in flight or ended."""

    def __init__(self) -> None:
        self.runs: list[tuple[threading.Thread, Future]] = []
        self.stop = threading.Event()  # set by Ctrl-C: every run stops its job
        self.run_name = RunName()  # does nothing to the lines of a run on its own
        log.addFilter(self.run_name)

    def __reduce__(self) -> tuple:
        """A fresh one in another process: Hydra's launcher plugins pickle the run function."""
        return SideBySide, ()

    def in_flight(self) -> int:
        return sum(not future.done() for _, future in self.runs)

    def start(self, name: str, run_dir: Path, max_parallel: int, work: Callable[[], dict]) -> Future:
        """`work()` (the run's driver side, which returns its summary) in a thread of its own,
        once fewer than `max_parallel` runs are in flight; the future of its summary."""
        self.wait(lambda: self.in_flight() < max_parallel)
        run = Alongside(name, self.stop)
        future: Future = Future()

        def body() -> None:
            alongside.set(run)
            handler = own_log(run, run_dir)
            try:
                future.set_result(work())
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the run
                future.set_exception(err)
            finally:
                log.removeHandler(handler)
                handler.close()

        thread = threading.Thread(target=body, name=f"fsdp_exp-{name}", daemon=True)
        self.runs.append((thread, future))
        log.info("%s: started in %s", name, run_dir)
        thread.start()
        return future

    def wait(self, ready: Callable[[], bool]) -> None:
        """Until `ready()`; Ctrl-C stops every run in flight first."""
        try:
            while not ready():
                time.sleep(POLL_S)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the runs still in flight (Ctrl-C, or the command ending early) and wait for
        them to end their jobs; the driver's lines are no longer named by run."""
        if self.in_flight():
            self.stop.set()
        for thread, _ in self.runs:
            thread.join(JOIN_S)
        log.removeFilter(self.run_name)


def own_log(run: Alongside, run_dir: Path) -> logging.Handler:
    """The run's own driver lines into its own log file, as Hydra writes it for a run in
    turn (Hydra's file handler moves on to the next run of the sweep)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "fsdp_exp.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(OwnRun(run))
    log.addHandler(handler)
    return handler
