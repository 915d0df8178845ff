"""task=max_batch: the largest per-rank batch that trains within the memory limit, and the
fastest below it (the search: fsdp_exp.tasks.max_batch.search)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.errors import ConfigError
from fsdp_exp.metrics.figures import MaxBatchAnswer
from fsdp_exp.tasks import Task
from fsdp_exp.tasks.max_batch.search import MaxBatchSearch
from fsdp_exp.tasks.max_batch.settings import SearchSettings

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.launcher.core import Launcher
    from fsdp_exp.run_context import RunContext


@dataclass
class MaxBatch(SearchSettings, Task):
    """task=max_batch; its settings (task.*) are SearchSettings."""

    def check(self, exp: Experiment) -> None:
        check_searchable(exp)

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher, nproc: int) -> MaxBatchAnswer:
        return MaxBatchSearch(exp, run_dir, launcher, nproc, context).run()


def check_searchable(exp: Experiment, task: str = "task=max_batch") -> None:
    """Refuse what a search of the batch cannot do, before any probe starts (task=max_batch,
    and task=tune's searches)."""
    if exp.device == "cpu" and exp.memory.limit_gb is None:
        raise ConfigError(
            f"memory.limit_gb: {task} on CPU needs a per-rank limit to fit in "
            "(without one the boundary is the machine's RAM and the kernel's OOM killer)"
        )
    if exp.train.grad_accum != 1:
        raise ConfigError(
            f"train.grad_accum={exp.train.grad_accum}: {task} searches the batch "
            "of one forward and backward; set train.grad_accum=1"
        )
    if not exp.launcher.starts_all_ranks:
        raise ConfigError(
            f"launcher.nnodes={exp.launcher.nnodes}: with launcher=torchrun each node's command would search "
            "on its own; search on one node, or with launcher=slurm or ray, whose one command starts every probe")
    if exp.launcher.restarts:
        key = exp.launcher.restarts_key
        raise ConfigError(
            f"{key}={exp.launcher.restarts}: {task} needs every probe "
            f"to fail when it runs out of memory, not to restart; set {key}=0")
    if exp.resume:
        raise ConfigError(f"resume={exp.resume}: {task} starts every probe fresh; "
                          "resume is for task=train")
