"""The base class of each config group's options. `Experiment` (fsdp_exp.config) types each
group by its base, as Hydra's structured configs do, so a group's node holds one of the
group's options and nothing else; every option's schema subclasses it. What an option does
is said in its group's home: fsdp_exp.sharding, fsdp_exp.checkpoint, fsdp_exp.launcher
(`Launcher`), fsdp_exp.tasks (`Task`), fsdp_exp.profile and fsdp_exp.loss.

The model, data and optimizer groups are open (a user's own `_target_` and its keys) and
have no base.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class GroupOption:
    group: ClassVar[str] = ""  # the config group whose options subclass this base


@dataclass
class ShardingOption(GroupOption):
    group = "sharding"


@dataclass
class CheckpointOption(GroupOption):
    group = "checkpoint"


@dataclass
class LauncherOption(GroupOption):
    group = "launcher"


@dataclass
class TaskOption(GroupOption):
    group = "task"


@dataclass
class ProfileOption(GroupOption):
    group = "profile"
    records_history: ClassVar[bool] = False  # the GPU allocator's history from the run's start (fsdp_exp.profile)


@dataclass
class LossOption(GroupOption):
    """How the model's output and the batch become the loss (fsdp_exp.loss)."""

    group = "loss"
    name: ClassVar[str] = ""  # as loss= names it
    classifies: ClassVar[bool] = False  # its output's argmax is a prediction (task=eval's accuracy)
    reads_targets: ClassVar[bool] = True  # it reads the batch's targets, which the model is not given

    def items(self, batch: Any) -> Any:
        """How many items (a tensor on the batch's device) the loss of this micro-batch is
        the mean over, where that may differ between micro-batches (the tokens that are not
        padding): the trainer weighs each rank's by it. None: each weighs alike."""
        return None
