"""A sweep's runs side by side, on a launcher that hands its ranks to a cluster.

Hydra's sweep calls the run function once per combination, one after the other. For a
launcher whose `max_parallel` is above 1 (launcher=slurm, launcher=ray), the run function
starts the run's driver side in a thread and returns at once, so every combination is
submitted before any has finished; a new one waits while `max_parallel` are in flight.
Each run keeps its own run directory, summary.json and log file. The command waits for
them at the end of the sweep and lists the failed ones (fsdp_exp.driver.outcomes).

Launchers (fsdp_exp.launcher.core.watch) see the run's `Alongside` and print one line per
change of its job's state instead of echoing rank 0's lines, which would interleave.
A task=max_batch search is one run: its probes go one after another in the run's thread,
while the sweep's other searches run beside it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path

from fsdp_exp.launcher.core import Alongside, alongside

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
    """The runs of this command that run beside each other, in flight or ended: each in a
    thread of its own, at most `max_parallel` at once (a semaphore's slots), its summary a
    `concurrent.futures.Future`. The threads are daemons, so that a run whose job does not
    stop cannot hold the command's exit: after Ctrl-C each has JOIN_S to stop its job
    (`close`). (A ThreadPoolExecutor's workers are joined at exit without a limit.)"""

    def __init__(self) -> None:
        self.runs: list[tuple[threading.Thread, Future]] = []
        self.slots: threading.BoundedSemaphore | None = None  # made by the first run, with its max_parallel
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
        once a slot is free (fewer than `max_parallel` runs in flight); the future of its summary."""
        slots = self.take_slot(max_parallel)
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
                slots.release()

        thread = threading.Thread(target=body, name=f"fsdp_exp-{name}", daemon=True)
        self.runs.append((thread, future))
        log.info("%s: started in %s", name, run_dir)
        thread.start()
        return future

    def take_slot(self, max_parallel: int) -> threading.BoundedSemaphore:
        """A slot for one more run, waited for; Ctrl-C meanwhile stops every run in flight first."""
        if self.slots is None:
            self.slots = threading.BoundedSemaphore(max_parallel)
        self.until(self.slots.acquire)
        return self.slots

    def wait_for_slot(self, max_parallel: int) -> None:
        """Until a run could start (the one thread that starts runs then takes it in `start`)."""
        self.take_slot(max_parallel).release()

    def wait_all(self) -> None:
        """Until every run started has ended; Ctrl-C meanwhile stops them first."""
        self.until(lambda: wait([future for _, future in self.runs]))

    def until(self, waiting: Callable[[], object]) -> None:
        try:
            waiting()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the runs still in flight (Ctrl-C, or the command ending early) and wait for
        them to end their jobs; the driver's lines are no longer named by run."""
        if self.in_flight():
            self.stop.set()
        wait([future for _, future in self.runs], timeout=JOIN_S)
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
