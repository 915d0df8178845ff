"""task=tune: the fastest setup of task.space for this model within the memory limit
(the tune: fsdp_exp.tasks.tune.tuner)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.metrics.figures import TuneAnswer
from fsdp_exp.tasks import Task
from fsdp_exp.tasks.max_batch.task import check_searchable
from fsdp_exp.tasks.tune.accumulation import check_divides
from fsdp_exp.tasks.tune.settings import TuneSettings
from fsdp_exp.tasks.tune.tuner import Tuner

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.launcher.core import Launcher
    from fsdp_exp.run_context import RunContext


@dataclass
class Tune(TuneSettings, Task):
    """task=tune; its settings (task.*) are TuneSettings."""

    def check(self, exp: Experiment) -> None:
        """What every setup's search needs (task=max_batch's checks), before any starts."""
        check_searchable(exp, "task=tune")

    def check_world(self, world_size: int) -> None:
        if self.global_batch is not None:
            check_divides(self.global_batch, world_size)

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher, nproc: int) -> TuneAnswer:
        return Tuner(exp, context, run_dir, launcher, nproc).run()
