"""task=train: one launch of all ranks, training for train.steps steps; each rank runs
fsdp_exp.rank.train.train_rank."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.checkpoint.resume import resolve_resume
from fsdp_exp.estimate.beside import EstimateBeside, wait_for_estimate
from fsdp_exp.estimate.settle import checked
from fsdp_exp.metrics.summary import ESTIMATE_LATER, Summary, estimate_line
from fsdp_exp.rank.train import train_rank
from fsdp_exp.tasks import Task

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.launcher.core import Launcher
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


@dataclass
class Train(Task):
    trains_at_the_batch = True
    runs_as_torchruns_ranks = True

    def check(self, exp: Experiment) -> None:
        """The checkpoint to resume from, when one is named, must be usable."""
        named = exp.checkpoint.dir
        resolve_resume(exp, Path(named).expanduser().resolve() if named else None)

    def find_resume(self, exp: Experiment, context: RunContext, run_dir: Path) -> None:
        """The checkpoint the run starts from, as an absolute path (or None), so every rank
        reads the same one."""
        context.resume = resolve_resume(exp, exp.checkpoint.dir_for(run_dir))
        if context.resume:
            log.info("resuming from %s", context.resume)

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher, nproc: int) -> dict:
        self.find_resume(exp, context, run_dir)
        beside = EstimateBeside(exp, nproc, run_dir, launcher.ranks_per_node(nproc)) if exp.memory.estimate else None
        if beside is not None and launcher.runs_here:  # rank 0 sees the file and holds the trace; else the driver adds it
            context.estimate_file, context.estimate_pid = str(beside.path), beside.process.pid
        context.startup["launched"] = time.time()
        try:
            rank = partial(train_rank, context=context, against_estimate=estimate_checked)
            figures = launcher.launch(rank, exp, run_dir, nproc)
        except KeyboardInterrupt:
            if beside is not None:
                beside.stop()
            raise
        except BaseException:
            if beside is not None:
                beside.go_on()  # rank 0 may have failed while it held the trace
            raise
        if beside is None:
            return figures
        beside.go_on()
        return beside.add_to(figures)


def estimate_checked(summary: Summary, path: Path) -> dict:
    """Rank 0: the driver's estimate of this run beside what it measured, if it is traced
    by now (fsdp_exp.estimate.beside); nothing if not (it is added to summary.json later)."""
    record, waited = wait_for_estimate(path)
    if record is None:
        log.info("the estimate of this run is still tracing: %s", ESTIMATE_LATER)
        return {"estimate_wait_s": waited}
    found = checked(summary, record) | {"estimate_wait_s": waited}
    log.info("task=estimate against this run: %s", estimate_line(Summary.of({**summary.as_dict(), **found})))
    return found
