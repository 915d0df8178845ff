"""conf/checkpoint/*: what is saved during and after training, and how a run resumes.

`none` saves nothing during training; `dcp`, `dcp_async` and `dcp_async_pinned` save
Distributed Checkpoints every `checkpoint.every` steps (fsdp_exp.checkpoint.dcp). Any of
them can write the full model at the end (`checkpoint.export_full`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_exp.checkpoint.dcp import DCPCheckpoint
from fsdp_exp.checkpoint.files import CheckpointError
from fsdp_exp.checkpoint.state import TrainState
from fsdp_exp.groups import CheckpointOption


@dataclass
class NoCheckpoint(CheckpointOption):
    """checkpoint=none: nothing saved during training."""

    export_full: bool = False  # at the end, write the full unsharded weights to model.safetensors
    saves = False  # nothing during training, so no checkpoint.dir
    stages_a_copy = False
    threads_started = 0
    dir = None

    def check(self) -> None:
        pass

    def dir_for(self, run_dir: Path) -> None:
        return None

    def start(self, state: TrainState, root: Path | None) -> NoSaver:
        return NoSaver()


class NoSaver:
    """checkpoint=none's saver: it saves nothing."""

    def __init__(self) -> None:
        self.blocked_s: list[float] = []

    def before_update(self) -> None:
        pass

    def after_step(self, step: int, last: bool, loss: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["CheckpointError", "DCPCheckpoint", "NoCheckpoint", "TrainState"]
