"""When a probe of task=max_batch has trained long enough: its peak has settled."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsdp_exp import distributed
from fsdp_exp.memory import peak_under_limit_gb

log = logging.getLogger("fsdp_exp")


def judged_peak_gb(device: torch.device, window_peak_gb: Callable[[], float | None]) -> float | None:
    """This rank's peak as task=max_batch judges it: on CPU as the limit counts it since the
    limit was set (None without a limit); on GPU the allocated peak of the trainer's window so
    far (`window_peak_gb`: the trainer resets the allocator's peaks at each window and phase,
    fsdp_exp.metrics.peaks), see Probe.judged_peak_gb."""
    if device.type == "cuda":
        return window_peak_gb()
    return peak_under_limit_gb()


@dataclass
class PeakSettled:
    """Whether a probe's peak has settled: checked every `window` steps from `first_check`,
    it has when the largest peak over the ranks (judged_peak_gb) grew by at most `tolerance_gb`
    over the last window. A run's memory can keep growing after its first steps (the
    allocator's history, wandb's buffers, a checkpoint's staging), so a probe trains on
    until two successive windows agree. Collective: every rank calls it at every step. After
    training it adds to the summary the step at which it found the peak settled (None where
    the run ended first), as an AfterFit hook (fsdp_exp.rank.trainer)."""

    tolerance_gb: float
    first_check: int
    window: int
    device: torch.device
    is_main: bool = False  # rank 0, which says when it settled
    measure: Callable[[torch.device, Callable[[], float | None]], float | None] = judged_peak_gb
    last_gb: float | None = None
    seen_gb: float = 0.0  # this rank's largest peak so far
    settled_at: int | None = None  # the step at which it settled

    def __call__(self, step: int, window_peak_gb: Callable[[], float | None]) -> bool:
        """`window_peak_gb`: the peak of the trainer's current window so far (GPU)."""
        if step < self.first_check or (step - self.first_check) % self.window:
            return False
        mine = self.measure(self.device, window_peak_gb)
        if mine is None:
            return False
        self.seen_gb = max(self.seen_gb, mine)
        peak = max(distributed.gather(self.seen_gb, self.device))
        settled = self.last_gb is not None and peak - self.last_gb <= self.tolerance_gb
        if settled and self.is_main:
            log.info("the peak settled at step %d: %.4f GB, within %.4f GB of its %.4f GB %d step(s) before",
                     step, peak, self.tolerance_gb, self.last_gb, self.window)
        self.last_gb = peak
        if settled:
            self.settled_at = step
        return settled

    def figures(self, summary: object) -> dict:
        return {"peak_settled_at_step": self.settled_at}
