"""train.lr_schedule: the learning rate at each step, as a factor of train.lr."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from fsdp_exp.errors import Choice


class LrSchedule(Choice):
    constant = "constant"
    cosine = "cosine"


def lr_schedule(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int) -> LambdaLR:
    """Linear warm-up over `warmup_steps`, then constant or a cosine decay to 0 at `total_steps`.

    Its state (the step it is at) is saved in checkpoints, so a resumed run continues
    the same curve.
    """
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return LambdaLR(optimizer, factor)
