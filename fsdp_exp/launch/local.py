"""launcher=local: all ranks on this machine, started by torch's elastic launcher."""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdp_exp.errors import ConfigError, at_least
from fsdp_exp.launch.core import (
    RankOutcome,
    check_nproc,
    explain,
    failure_line,
    ranks_per_node,
    scoped_env,
    threads_per_rank,
)
from fsdp_exp.launch.worker import run_rank


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
        if self.nproc_per_node != "auto" and gpus and self.nproc_per_node > gpus:
            raise ConfigError(f"launcher.nproc_per_node={self.nproc_per_node}: only {gpus} GPU(s) here, "
                              "one rank per GPU")
        return ranks_per_node(self.nproc_per_node, gpus)

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
        raise explain(outcomes(err.failures), run_dir, time_limit_s) from None


def outcomes(failures: dict[int, ProcessFailure]) -> list[RankOutcome]:
    """torch elastic's failures as rank outcomes: an error the rank raised (@record keeps
    it), or the signal that ended it."""
    def outcome(rank: int, failure: ProcessFailure) -> RankOutcome:
        line = failure_line(failure.message)
        if failure.exitcode < 0:
            return RankOutcome(rank, signal=failure.signal_name(), ended=failure.timestamp, how=f"failed: {line}")
        return RankOutcome(rank, error=line, ended=failure.timestamp)
    return [outcome(rank, failure) for rank, failure in failures.items()]


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


def quiet_elastic() -> None:
    """The elastic agent logs every start and stop; the run reports failures itself."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
