"""launcher=local: all ranks on this machine, started by torch's elastic launcher."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdp_exp.errors import ConfigError, at_least
from fsdp_exp.launch import RunFailed, check_nproc
from fsdp_exp.launch.worker import rank_log_path, run_rank

CPU_RANKS = 2  # what `auto` means on a machine without GPUs


@dataclass
class LocalLauncher:
    nproc_per_node: Any = "auto"  # auto: one rank per GPU, or 2 on a CPU-only machine
    max_restarts: int = 0  # restarts of all ranks after one fails (they resume from the latest checkpoint)
    runs_here = True
    starts_all_ranks = True
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
        if self.nproc_per_node == "auto":
            return gpus or CPU_RANKS
        if gpus and self.nproc_per_node > gpus:
            raise ConfigError(f"launcher.nproc_per_node={self.nproc_per_node}: only {gpus} GPU(s) here, "
                              "one rank per GPU")
        return int(self.nproc_per_node)

    def gpus(self, local_gpus: int) -> int:
        return local_gpus

    def launch(self, task: Callable[[dict, Path], Any], cfg: dict, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any:
        """Run `task(cfg, run_dir)` on `nproc` fresh ranks; rank 0's return value.

        When any rank fails, the agent stops the others within about a second, and
        RunFailed names the rank whose failure explains the run, its error and its log.
        Ranks still running after `time_limit_s` are killed (the kernel's SIGALRM).
        """
        options = dict(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                       rdzv_endpoint="localhost:0", max_restarts=self.max_restarts)
        with threads_per_rank(nproc):
            results = elastic_run(task, cfg, run_dir, options, time_limit_s)
        return results[0]


def elastic_run(task: Callable[[dict, Path], Any], cfg: dict, run_dir: Path, options: dict,
                time_limit_s: float | None) -> dict[int, Any]:
    """torch's elastic launcher (torchrun's machinery) with c10d rendezvous: each local
    rank's return value, by global rank; RunFailed when a rank failed."""
    options = dict(rdzv_backend="c10d", monitor_interval=0.1, start_method="spawn", **options)
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:  # torch >= 2.12
        options["shutdown_timeout"] = 5
    quiet_elastic()
    alarm_s = math.ceil(time_limit_s) if time_limit_s else None
    try:
        with fresh_store_per_restart(options["max_restarts"]):
            return elastic_launch(LaunchConfig(**options), run_rank)(task, cfg, str(run_dir), alarm_s)
    except ChildFailedError as err:
        raise run_failed(err.failures, run_dir, time_limit_s) from None


def run_failed(failures: dict[int, ProcessFailure], run_dir: Path, time_limit_s: float | None) -> RunFailed:
    """The failure that explains the run. Its cause comes first: an out-of-memory on any
    rank, then the earliest error, and only then a rank stopped by a signal, which is
    usually the agent stopping the ranks that were left waiting in a collective."""
    def line(failure: ProcessFailure) -> str:
        return failure_line(failure.message)

    def order(item: tuple[int, ProcessFailure]) -> tuple:
        rank, failure = item
        return ("OutOfMemory:" not in line(failure), failure.exitcode < 0, failure.timestamp, rank)

    rank, failure = min(failures.items(), key=order)
    log_file = rank_log_path(run_dir, rank)
    killed_by = failure.signal_name() if failure.exitcode < 0 else None
    if failure.exitcode == -signal.SIGALRM and time_limit_s:
        return RunFailed(f"rank {rank} ran past the time limit of {time_limit_s:g} s (log: {log_file})",
                         timed_out=True, killed_by=killed_by)
    return RunFailed(f"rank {rank} failed: {line(failure)} (log: {log_file})",
                     out_of_memory="OutOfMemory:" in line(failure), killed_by=killed_by)


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


@contextlib.contextmanager
def threads_per_rank(nproc: int) -> Iterator[None]:
    """Split the cores between the ranks through OMP_NUM_THREADS, as torchrun does, but
    in the environment the ranks start with (the elastic launcher leaves it unset)."""
    with scoped_env("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))):
        yield


def failure_line(message: Any) -> str:
    """The error of a failed rank as one line. @record stores {"message": "Type: text", ...};
    a rank killed by a signal has a plain message."""
    if isinstance(message, dict):
        message = message.get("message", message)
    return " ".join(str(message).split())


def quiet_elastic() -> None:
    """The elastic agent logs every start and stop; the run reports failures itself."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
