"""conf/task/*: what a run does (train, max_batch, estimate, eval, export)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from fsdp_exp.groups import TaskOption

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.launcher.core import Launcher
    from fsdp_exp.metrics.figures import Figures
    from fsdp_exp.run_context import RunContext


class Task(TaskOption):
    """What every conf/task option is: its settings (a dataclass of its own keys, task.*),
    `check`, run by the driver before anything starts, and `run`.

    `uses_the_device`: the task runs on the run's device, so this machine's device and
    memory checks apply (task=estimate only traces, for any device and world size).
    `runs_in_driver`: it runs in the command's own process, on this machine's device, with
    no launcher (eval, export). `trains_at_the_batch`: its ranks train at train.batch_size
    (task=train), so each rank's share of the data must hold a batch. `runs_as_torchruns_ranks`:
    it can run in the ranks an external torchrun started (fsdp_exp.driver.external_torchrun)."""

    uses_the_device: ClassVar[bool] = True
    runs_in_driver: ClassVar[bool] = False
    trains_at_the_batch: ClassVar[bool] = False
    runs_as_torchruns_ranks: ClassVar[bool] = False

    def check(self, exp: Experiment) -> None:
        """Refuse what the task cannot do with these settings, in one ConfigError line."""

    def check_world(self, world_size: int) -> None:
        """Refuse what the task cannot do on this many ranks, in one ConfigError line."""

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher,
            nproc: int) -> Figures:
        """Do the task; returns its answer's record for summary.json (fsdp_exp.metrics.figures)."""
        raise NotImplementedError


def setup_line(context: RunContext) -> str:
    """What a task's record calls the setup it ran: the command line's overrides, but the
    task's own and Hydra's."""
    overrides = [o for o in context.overrides() if not o.startswith(("task=", "hydra."))]
    return " ".join(overrides) or "defaults"
