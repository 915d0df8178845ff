"""launcher=local: all ranks on this machine, started by torch's elastic launcher."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdp_exp.errors import ConfigError, at_least, choice
from fsdp_exp.groups import LauncherOption
from fsdp_exp.launcher.core import (
    Interrupted,
    RankOutcome,
    check_nproc,
    explain,
    failure_line,
    rank_threads,
    ranks_per_node,
    scoped_env,
)
from fsdp_exp.launcher.rank_server import start_rank_server
from fsdp_exp.rank.worker import rank_error, run_rank

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

StartMethod = choice("StartMethod", ("forkserver", "spawn"), __name__)


@dataclass
class LocalLauncher(LauncherOption):
    nproc_per_node: Any = "auto"  # auto: one rank per GPU, or 2 on a CPU-only machine
    max_restarts: int = 0  # restarts of all ranks after one fails (they resume from the latest checkpoint)
    # forkserver: the ranks are forked from a process that imported torch once (fsdp_exp.launcher.rank_server);
    # spawn: each rank starts a fresh interpreter and imports torch itself, as a bare torchrun does
    start_method: StartMethod = StartMethod["forkserver"]
    runs_here = True
    starts_all_ranks = True
    max_parallel = 1  # a sweep's runs share this machine: one after another, so none slows another's figures
    restarts_key = "launcher.max_restarts"

    def __post_init__(self) -> None:
        check_nproc(self.nproc_per_node)
        at_least("launcher.max_restarts", self.max_restarts, 0)

    @property
    def restarts(self) -> int:
        return self.max_restarts

    def world_size(self, gpus: int) -> int:
        """`nproc_per_node`, or for `auto` one rank per GPU (2 on CPU). `gpus`: the GPUs
        the ranks run on, 0 on CPU."""
        if self.nproc_per_node != "auto" and gpus and self.nproc_per_node > gpus:
            raise ConfigError(f"launcher.nproc_per_node={self.nproc_per_node}: only {gpus} GPU(s) here, "
                              "one rank per GPU")
        return ranks_per_node(self.nproc_per_node, gpus)

    def gpus(self, local_gpus: int) -> int:
        return local_gpus

    def ranks_per_node(self, world: int) -> int:
        """All on this machine."""
        return world

    def connect(self, nproc: int, at_once: int) -> None:
        """Nothing to connect to: the ranks start here."""

    def launch(self, task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any:
        """Run `task(cfg, run_dir)` on `nproc` fresh ranks; rank 0's return value.

        When any rank fails, the agent stops the others within about a second, and
        RunFailed names the rank whose failure explains the run, its error and its log.
        Ranks still running after `time_limit_s` are killed (the kernel's SIGALRM).
        """
        options = dict(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                       rdzv_endpoint="localhost:0", max_restarts=self.max_restarts, start_method=self.start_method)
        return elastic_run(task, cfg, run_dir, options, time_limit_s)[0]


# A rank that the stop signal (Ctrl-C's SIGINT, a failed rank's SIGTERM) does not end at once,
# one blocked in a collective whose peer has gone, is killed this long after: Ctrl-C ends a run
# within a second (tests/test_interrupt.py, 20 tries). The ranks keep nothing they could lose:
# metrics.jsonl is written a line at a time, and a checkpoint counts once it is whole.
RANKS_STOP_S = 0.8


def elastic_run(task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: Path, options: dict,
                time_limit_s: float | None) -> dict[int, Any]:
    """torch's elastic launcher (torchrun's machinery) with c10d rendezvous: each local
    rank's return value, by global rank; RunFailed when a rank failed. Forked ranks
    (`start_method` forkserver) come from `start_rank_server`'s process and do not see what
    this process sets in its environment, so each is told its share of the cores (`rank_threads`)."""
    if options["start_method"] == "forkserver":
        start_rank_server()
    options = dict(rdzv_backend="c10d", monitor_interval=0.1, **options)
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:  # torch >= 2.12
        options["shutdown_timeout"] = RANKS_STOP_S
    alarm_s = math.ceil(time_limit_s) if time_limit_s else None
    try:
        with fresh_store_per_restart(options["max_restarts"]), drivers_signal_handlers(), \
                elastic_lines_to(Path(run_dir) / LAUNCHER_LOG):
            return elastic_launch(LaunchConfig(**options), run_rank)(
                task, cfg, str(run_dir), alarm_s, rank_threads(options["nproc_per_node"]))
    except ChildFailedError as err:
        raise explain(outcomes(err.failures, run_dir, options["nproc_per_node"]), run_dir, time_limit_s) from None


def outcomes(failures: dict[int, ProcessFailure], run_dir: Path, nproc: int) -> list[RankOutcome]:
    """torch elastic's failures as rank outcomes: an error the rank raised (@record keeps
    it), or the signal that ended it. A rank the agent stopped once another had failed is
    not among them, but when it had raised an error of its own first, that error is its
    outcome (`worker.rank_error`)."""
    def outcome(rank: int, failure: ProcessFailure) -> RankOutcome:
        line = failure_line(failure.message)
        if failure.exitcode < 0:
            return RankOutcome(rank, signal=failure.signal_name(), ended=failure.timestamp, how=f"failed: {line}")
        return RankOutcome(rank, error=line, ended=failure.timestamp)

    ranks = {rank: outcome(rank, failure) for rank, failure in failures.items()}
    first = min(failures, default=0) // nproc * nproc  # this node's ranks
    for rank in range(first, first + nproc):
        raised = rank_error(run_dir, rank)
        if raised is not None and (rank not in ranks or ranks[rank].error is None):
            ranks[rank] = RankOutcome(rank, error=raised[0], ended=raised[1])
    return list(ranks.values())


@contextlib.contextmanager
def drivers_signal_handlers() -> Iterator[None]:
    """The agent's stop signals as the driver's Interrupted, and the driver's handlers back
    after the launch. The agent replaces the handlers of SIGINT, SIGTERM, SIGHUP and SIGQUIT
    with its own, which stops the ranks with that signal (SIGKILL after its shutdown
    timeout) and raises SignalException, and it leaves them in place after the launch."""
    agents = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    mine = {s: signal.getsignal(s) for s in agents} if threading.current_thread() is threading.main_thread() else {}
    try:
        yield
    except SignalException as err:
        raise Interrupted(err.sigval) from None
    finally:
        for signum, handler in mine.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def fresh_store_per_restart(max_restarts: int) -> Iterator[None]:
    """Restarted ranks meet in a new store, not in the one of the ranks before them.

    By default the c10d rendezvous lends its own store to the ranks, and it outlives a
    restart: the restarted ranks then find the old ranks' gloo addresses in it and hang
    or fail connecting to them (pytorch/pytorch#135712). With sharing off, every
    rendezvous round gives rank 0 a fresh store on a free port. Rank 0 then serves the
    store itself, so only runs that can restart do it: a run under memory.limit_gb
    keeps the same memory on every rank.
    """
    if not max_restarts:
        yield
        return
    with scoped_env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"):
        yield


# torch elastic's loggers; each of its modules' own sets its level (WARNING, or LOGLEVEL)
ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
LAUNCHER_LOG = "launcher.log"


@contextlib.contextmanager
def elastic_lines_to(path: Path) -> Iterator[None]:
    """torch elastic's own lines, while the ranks run, go to `path` (the run's launcher.log),
    not the console: its warnings ("Received 2 death signal" on Ctrl-C) and each failed
    rank's record (exit code, pid, the traceback the rank's log has too). The console gets the
    run's one line of why it failed, which names the rank's log. No line, no file."""
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s", "%H:%M:%S"))
    loggers = [logging.getLogger(name) for name in ELASTIC_LOGGERS]
    propagated = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, propagated):
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()
