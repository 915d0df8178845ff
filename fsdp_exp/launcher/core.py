"""What every launcher shares, on the driver: the launcher's questions, the rank count, the
rank outcome and the one explanation of a failed launch, the console echo and the watchdog,
and how a stop signal (Ctrl-C, kill, SLURM) reaches the run.

A launcher only starts ranks its own way and turns its native results (torch elastic's
ProcessFailure, submitit's result pickles, Ray Train's worker errors) into `RankOutcome`s;
`explain` then names the rank whose failure explains the run, the same way for each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fsdp_exp.errors import ConfigError
from fsdp_exp.launcher.tail import NewLines
from fsdp_exp.rank.worker import TORCH_WARNED, rank_log_path

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

log = logging.getLogger("fsdp_exp")

CPU_RANKS = 2  # what `auto` ranks per node means on a machine without GPUs
POLL_S = 0.2  # how often the driver echoes rank 0's lines and looks at the ranks
STOP_GRACE_S = 30  # after the time limit, how long the ranks' own alarm has before the driver stops them
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # a rank left in a collective


class Launcher(Protocol):
    """conf/launcher/*: how the ranks of one run are started; the driver asks it:

    - `world_size(gpus) -> int`: the world size it will start (and its own checks);
    - `gpus(local_gpus) -> int`: the GPUs its ranks will have;
    - `ranks_per_node(world) -> int`: how many of `world` ranks it starts on one node;
    - `runs_here`: whether its ranks run on this machine;
    - `restarts`: how often it restarts failed ranks (set by `restarts_key`);
    - `starts_all_ranks`: whether this one command starts every rank of the run;
    - `max_parallel`: how many runs of a sweep it runs side by side (1: one after another);
    - `connect(nproc, at_once)`: on the command's main thread, before a sweep's run starts
      beside others: get ready for `at_once` runs of `nproc` ranks (Ray starts or joins
      its cluster here, since a local Ray cannot start from another thread);
    - `launch(task, cfg, run_dir, nproc, time_limit_s=None)`: start `nproc` fresh ranks,
      each running `fsdp_exp.rank.worker.run_rank(task, cfg, run_dir, time_limit_s)` with
      the variables of `fsdp_exp.rank.worker.rank_variables` set, and return rank 0's
      result (the tasks return the same figures on every rank). When a rank fails it raises
      `explain`'s RunFailed, so task=max_batch can use any launcher: every probe is one launch.
    """

    restarts: int
    restarts_key: str
    runs_here: bool
    starts_all_ranks: bool
    max_parallel: int

    def world_size(self, gpus: int) -> int: ...
    def gpus(self, local_gpus: int) -> int: ...
    def ranks_per_node(self, world: int) -> int: ...
    def connect(self, nproc: int, at_once: int) -> None: ...
    def launch(self, task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any: ...


@dataclass(frozen=True)
class Alongside:
    """A run of a sweep that runs beside others (fsdp_exp.driver.sweep): its name on the
    console, and the event that stops it (Ctrl-C on the command)."""

    name: str
    stop: threading.Event


# Set in the thread of a run that runs beside others; None for a run on its own.
alongside: ContextVar[Alongside | None] = ContextVar("alongside", default=None)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; kill, scancel and SLURM's time limit
stopped_by: list[signal.Signals] = []  # the stop signals this process has received


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the driver. Raised wherever its main thread is, so the run in
    flight stops its ranks and writes its summary on the way out. A KeyboardInterrupt, so
    that Hydra, which reports any Exception of a run as a failure, lets it through."""

    def __init__(self, signum: int):
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)


def raise_interrupted(signum: int, frame: Any) -> None:
    stopped_by.append(signal.Signals(signum))
    raise Interrupted(signum)


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise Interrupted on the main thread (SIGTERM's default would end
    the driver at once, without a summary and without stopping its ranks)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, raise_interrupted)


def stop_signal(err: KeyboardInterrupt) -> signal.Signals:
    """The signal that stopped the command: Interrupted's own; for a plain KeyboardInterrupt
    (a run beside others, stopped with its sweep) the last one received, else SIGINT."""
    if isinstance(err, Interrupted):
        return err.signum
    return stopped_by[-1] if stopped_by else signal.SIGINT


class RunFailed(Exception):
    """A rank of the run failed; the message names the rank, its error and its log.

    `out_of_memory`: some rank ran out of memory (the others then fail or are stopped).
    `timed_out`: the ranks ran past the launch's time limit.
    `killed_by`: the signal that ended the rank, when a signal did (e.g. "SIGKILL"; "signal"
    when the launcher cannot tell which).
    `rank` and `log`: the rank whose failure explains the launch, and its log, where known.
    """

    def __init__(self, message: str, out_of_memory: bool = False, timed_out: bool = False,
                 killed_by: str | None = None, rank: int | None = None, log: Path | None = None):
        super().__init__(message)
        self.out_of_memory = out_of_memory
        self.timed_out = timed_out
        self.killed_by = killed_by
        self.rank, self.log = rank, log


def check_nproc(nproc_per_node: Any) -> None:
    """`launcher.nproc_per_node`: "auto" or a whole number of ranks."""
    nproc = nproc_per_node
    if nproc != "auto" and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise ConfigError(f"launcher.nproc_per_node={nproc}: must be auto or an integer >= 1")


def ranks_per_node(nproc_per_node: Any, gpus: int) -> int:
    """`nproc_per_node`, where `auto` is one rank per GPU, or CPU_RANKS without GPUs."""
    return int(nproc_per_node) if nproc_per_node != "auto" else gpus or CPU_RANKS


def missing_extra(launcher: str, what: str, extra: str) -> ConfigError:
    return ConfigError(f"launcher={launcher}: needs {what}, which is not installed; "
                       f"install the extra: pip install -e .[{extra}]")


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of a launch ended, whichever launcher started it. A rank that neither
    raised nor was ended by a signal succeeded."""

    rank: int
    error: str | None = None  # the exception it raised, as one line "Type: message"
    signal: str | None = None  # what ended it without an error: "SIGKILL", or "signal" when the launcher cannot tell
    ended: float | None = None  # when it failed (time.time()), when the launcher knows
    started: float | None = None  # when it started, when the launcher knows
    how: str = ""  # for a rank ended by a signal, what the launcher saw, in words

    @property
    def failed(self) -> bool:
        return self.error is not None or self.signal is not None


def explain(outcomes: Sequence[RankOutcome], run_dir: Path, time_limit_s: float | None = None,
            now: float | None = None, stopped_for_time: bool = False) -> RunFailed:
    """The failure that explains the launch, from its ranks' outcomes. Its cause comes first:

    1. an out-of-memory on any rank (the others then fail too, or are stopped);
    2. the earliest error a rank raised itself, before any rank ran past the time limit;
    3. a rank that ran past the time limit: ended by its own SIGALRM, or ended without an
       error after running that long (or `stopped_for_time`: the driver stopped it);
    4. a rank ended by a signal (killed from outside, or its node lost);
    5. an error a rank got because a peer was gone (it was left in a collective with it):
       that peer ended without an error of its own, so by a signal, which torch elastic,
       reporting one failure, may not have seen before this one (`killed_by` "signal").
    """
    failed = [o for o in outcomes if o.failed]
    assert failed, "explain() needs a failed rank"
    now = time.time() if now is None else now

    def earliest(some: list[RankOutcome]) -> RankOutcome:
        return min(some, key=lambda o: (o.ended if o.ended is not None else now, o.rank))

    def failure(o: RankOutcome, what: str, after: str = "", **kind: Any) -> RunFailed:
        path = rank_log_path(run_dir, o.rank)
        return RunFailed(f"rank {o.rank} {what} (log: {path}){after}", rank=o.rank, log=path, **kind)

    oom = [o for o in failed if o.error and "OutOfMemory:" in o.error]
    if oom:
        o = earliest(oom)
        return failure(o, f"failed: {o.error}", out_of_memory=True)
    errors = [o for o in failed if o.error is not None]
    own = [o for o in errors if not any(text in o.error for text in PEER_GONE)]
    died = [o for o in failed if o.error is None]
    late = [o for o in died if time_limit_s and (
        o.signal == "SIGALRM" or stopped_for_time
        or (o.started is not None and (o.ended or now) - o.started >= time_limit_s))]
    deadline = min((o.started + time_limit_s for o in late if o.started is not None), default=now) if late else now
    early = [o for o in own if (o.ended if o.ended is not None else now) < deadline] if late else own
    if early:
        o = earliest(early)
        return failure(o, f"failed: {o.error}")
    if late:
        o = earliest(late)
        stopped = " and did not end; the driver stopped it" if stopped_for_time else ""
        killed_by = o.signal if o.signal not in (None, "signal") else "SIGALRM"
        return failure(o, f"ran past the time limit of {time_limit_s:g} s{stopped}", timed_out=True,
                       killed_by=killed_by)
    if died:
        o = earliest(died)
        return failure(o, o.how or f"was ended by {o.signal}", killed_by=o.signal)
    o = earliest(errors)
    return failure(o, f"failed: {o.error}", "; a rank it ran with ended without an error of its own (killed, or "
                   "its process crashed)", killed_by="signal")


def failure_line(message: Any) -> str:
    """The error of a failed rank as one line. torch elastic's @record stores
    {"message": "Type: text", ...}; other launchers give the text itself."""
    if isinstance(message, dict):
        message = message.get("message", message)
    return " ".join(str(message).split())


class Echo:
    """Rank 0's console lines onto the driver's stdout, as launcher=local shows them, from a
    file rank 0 writes (its task's stdout, or its log): without submitit's own lines, and
    without the records that go only to the rank's log (its pid line, its traceback)."""

    HEADER = re.compile(rb"^\[[^\]]*\]\[rank\d+\]\[[A-Z]+\] ")
    FILE_ONLY = (b"rank 0 is pid ", b"this rank failed", TORCH_WARNED.encode())

    def __init__(self, path: Path, offset: int = 0):
        self.new_lines = NewLines(path, offset)
        self.showing = True  # whether the record the next continuation line belongs to is shown

    def poll(self, final: bool = False) -> None:
        shown = []
        for line in self.new_lines.read(final):
            if line.startswith(b"submitit "):
                continue
            header = self.HEADER.match(line)
            if header:
                self.showing = not line[header.end():].startswith(self.FILE_ONLY)
            if self.showing:
                shown.append(line.decode(errors="replace"))
        if shown:
            sys.stdout.write("\n".join(shown) + "\n")
            sys.stdout.flush()


def watch(done: Callable[[], bool], echo: Echo, first_start: Callable[[], float | None],
          stop: Callable[[], None], time_limit_s: float | None, state: Callable[[], str]) -> bool:
    """Echo rank 0's lines until `done()`. The ranks' own alarm ends them at the time limit
    (worker.run_rank); should it not, `stop()` ends them STOP_GRACE_S later, and watch
    returns True. Ctrl-C on the driver stops them too: no rank outlives the driver.

    A run beside others (`alongside`) echoes no rank lines: it logs its job's `state()`
    each time it changes, and stops when the sweep is stopped."""
    run = alongside.get()
    shown = None
    try:
        while not done():
            start = first_start()
            if run is None:
                echo.poll()
            else:
                now = state()
                if now != shown:
                    log.info("%s", now)
                    shown = now
                if run.stop.is_set():
                    raise KeyboardInterrupt
            if time_limit_s and start is not None and time.time() - start > time_limit_s + STOP_GRACE_S:
                stop()
                return True
            time.sleep(POLL_S)
    except BaseException:
        stop()
        raise
    finally:
        if run is None:
            echo.poll(final=True)
    return False


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment (and the ranks') for the block, unless
    the user set it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        del os.environ[name]


def rank_threads(nproc: int) -> int:
    """The threads of each of `nproc` ranks on this machine: OMP_NUM_THREADS when the user
    set it, else the cores split between the ranks, as torchrun does."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // nproc))


@contextlib.contextmanager
def threads_per_rank(nproc: int) -> Iterator[None]:
    """`rank_threads` through OMP_NUM_THREADS, for ranks that start with this process's
    environment (submitit's local executor)."""
    with scoped_env("OMP_NUM_THREADS", str(rank_threads(nproc))):
        yield
