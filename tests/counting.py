"""Counts the tests make of fsdp_exp's parts outside a run."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fsdp_exp.estimate.allocator import ROUND_LARGE, Event, PastTheCap, replay
from fsdp_exp.metrics.flops import ATTENTION_FORMULAS, StepFlops, counting_flops


def count_step_flops(model: nn.Module, loss_of: Callable[[], torch.Tensor],
                     formulas: dict = ATTENTION_FORMULAS) -> StepFlops:
    """`counting_flops` of one forward and backward, `loss_of().backward()`, outside
    training: the gradients it leaves are cleared; the weights are not touched."""
    with counting_flops(model, formulas) as count:
        loss_of().backward()
    for p in model.parameters():
        p.grad = None
    assert count.step is not None
    return count.step


def least_cap(events: list[Event]) -> int:
    """The smallest cap, to 2 MiB, under which the events run without running out of memory:
    what the segments need when the allocator releases its cache as torch's does."""
    high = replay(events).peak_reserved
    low = 0
    while high - low > ROUND_LARGE:
        mid = (low + high) // 2
        try:
            replay(events, mid)
        except PastTheCap:
            low = mid
        else:
            high = mid
    return high
