"""conf/launcher/*: how the ranks of one run are started. The trainer is the same under each.

A launcher is a dataclass whose fields are its settings; the driver asks it (`Launcher`):

- `world_size(on_gpu) -> int`: the world size it will start (and its own checks);
- `gpus(local_gpus) -> int`: the GPUs its ranks will have;
- `runs_here`: whether its ranks run on this machine;
- `restarts`: how often it restarts failed ranks (set by `restarts_key`);
- `starts_all_ranks`: whether this one command starts every rank of the run;
- `launch(task, cfg, run_dir, nproc, time_limit_s=None)`: start `nproc` fresh ranks, each
  running `fsdp_exp.launch.worker.run_rank(task, cfg, run_dir, time_limit_s)` with RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (and FSDP_EXP_DEVICE where the
  launcher knows each rank's GPU; see `fsdp_exp.distributed.gpu_index`), and return rank 0's result
  (the tasks return the same figures on every rank). When a rank fails it raises
  RunFailed, with `out_of_memory` when any rank ran out of memory, so task=max_batch can
  use any launcher: every probe is one `launch`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fsdp_exp.errors import ConfigError


class Launcher(Protocol):
    restarts: int
    restarts_key: str  # the key that sets `restarts`
    runs_here: bool
    starts_all_ranks: bool

    def world_size(self, on_gpu: bool) -> int: ...
    def gpus(self, local_gpus: int) -> int: ...
    def launch(self, task: Callable[[Any, Path], Any], cfg: Any, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any: ...


def check_nproc(nproc_per_node: Any) -> None:
    """`launcher.nproc_per_node`: "auto" or a whole number of ranks."""
    nproc = nproc_per_node
    if nproc != "auto" and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise ConfigError(f"launcher.nproc_per_node={nproc}: must be auto or an integer >= 1")


class RunFailed(Exception):
    """A rank of the run failed; the message names the rank, its error and its log.

    `out_of_memory`: some rank ran out of memory (the others then fail or are stopped).
    `timed_out`: the ranks ran past the launch's time limit.
    `killed_by`: the signal that ended the rank, when a signal did (e.g. "SIGKILL").
    """

    def __init__(self, message: str, out_of_memory: bool = False, timed_out: bool = False,
                 killed_by: str | None = None):
        super().__init__(message)
        self.out_of_memory = out_of_memory
        self.timed_out = timed_out
        self.killed_by = killed_by
