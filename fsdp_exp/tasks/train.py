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
from fsdp_exp.estimate.beside import EstimateBeside, checked, longest_wait_s, tracing, wait_for_estimate
from fsdp_exp.metrics.figures import TrainAnswer
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

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher,
            nproc: int) -> TrainAnswer:
        self.find_resume(exp, context, run_dir)
        beside = EstimateBeside(exp, nproc, run_dir, launcher.ranks_per_node(nproc)) if exp.memory.estimate else None
        if beside is not None and launcher.runs_here:  # rank 0 sees the file and holds the trace; else the driver adds it
            context.estimate_file = str(beside.path)
            context.estimate_pid = beside.process.pid if beside.process is not None else None
        context.startup["launched"] = launched = time.time()
        try:
            rank = partial(train_rank, context=context,
                           against_estimate=partial(estimate_checked, tracer=context.estimate_pid))
            figures = launcher.launch(rank, exp, run_dir, nproc)
        except BaseException:
            if beside is not None:
                beside.stop()  # the run failed or was stopped: so is its trace
            raise
        if beside is not None:
            beside.go_on()  # should rank 0 have ended while it held the trace
            figures = beside.add_to(figures, time.time() - launched)
        return TrainAnswer(**figures)


def estimate_checked(summary: Summary, path: Path, tracer: int | None = None) -> dict:
    """Rank 0: the driver's estimate of this run beside what it measured: at once if it is
    written; else, while its trace (process `tracer`) still goes, once it is, waiting at
    most as long as the run took or FIRST_TRACE_S (fsdp_exp.estimate.beside); if it does not
    come, how long it waited (the driver stops the trace)."""
    launched = (summary.startup or {}).get("launched")
    longest = longest_wait_s(time.time() - launched if launched else 0.0)
    if tracing(tracer) and not path.exists():
        log.info("this setup's own estimate is still tracing (once a setup: its later runs have it at once); "
                 "waiting for it, at most %.0f s (memory.estimate=false runs none)", longest)
    record, waited = wait_for_estimate(path, tracer, longest)
    if record is None:
        log.info("the estimate of this run is not ready: %s", ESTIMATE_LATER)
        return {"estimate_wait_s": waited}
    found = checked(summary, record) | {"estimate_wait_s": waited}
    log.info("task=estimate against this run: %s", estimate_line(Summary.of({**summary.as_dict(), **found})))
    return found
