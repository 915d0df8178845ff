"""launcher=local: all ranks on this machine, started by torch's elastic launcher."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdp_exp.launch import RunFailed
from fsdp_exp.launch.worker import rank_log_path, run_rank

CPU_RANKS = 2  # what `auto` means on a machine without GPUs


@dataclass
class LocalLauncher:
    nproc_per_node: Any = "auto"

    def ranks(self, on_gpu: bool) -> int:
        """The world size: `nproc_per_node`, or for `auto` one rank per GPU (2 on CPU)."""
        if self.nproc_per_node != "auto":
            return int(self.nproc_per_node)
        return torch.cuda.device_count() if on_gpu else CPU_RANKS

    def launch(self, task: Callable[[dict, Path], Any], cfg: dict, run_dir: Path, nproc: int) -> Any:
        """Run `task(cfg, run_dir)` on `nproc` fresh ranks; rank 0's return value.

        When any rank fails, the agent stops the others within about a second, and
        RunFailed names the first failed rank, its error and its log file.
        """
        options: dict[str, Any] = dict(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            monitor_interval=0.1,
            start_method="spawn",
        )
        if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:  # torch >= 2.12
            options["shutdown_timeout"] = 5
        quiet_elastic()
        try:
            with threads_per_rank(nproc):
                results = elastic_launch(LaunchConfig(**options), run_rank)(task, cfg, str(run_dir))
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            raise RunFailed(
                f"rank {rank} failed: {failure_line(failure.message)} "
                f"(log: {rank_log_path(run_dir, rank)})"
            ) from None
        return results[0]


@contextlib.contextmanager
def threads_per_rank(nproc: int) -> Iterator[None]:
    """Split the cores between the ranks through OMP_NUM_THREADS, as torchrun does, but
    in the environment the ranks start with (the elastic launcher leaves it unset)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


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
