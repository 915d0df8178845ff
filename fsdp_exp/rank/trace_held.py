"""The run's own estimate held still while the run is timed.

The driver traces the run's estimate in a process of its own at idle priority
(fsdp_exp.estimate.beside). Idle priority yields the CPU, not the caches and memory bandwidth
a trace shares with the ranks of the same machine, and beside the timed steps it slowed them.
So rank 0 stops the tracing process's group when the timed steps start (the first step after
metrics.warmup_steps) and lets it go on once they end: the trace has the start-up, the
warm-up and the end of the run, and the run's samples/s are its own. The driver lets it go
on too whatever way the ranks ended (fsdp_exp.estimate.beside.EstimateBeside.go_on).
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass


def signal_group(pid: int, sig: int) -> None:
    """`sig` to the process group that `pid` leads; nothing if it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@dataclass
class TraceHeld:
    """Step hooks and an after-fit hook (fsdp_exp.rank.trainer) on rank 0: the tracing process
    (`pid`, the leader of its group) stopped from step `first_timed` to the end of training."""

    pid: int
    first_timed: int
    held: bool = False

    def before_step(self, step: int) -> None:
        if step == self.first_timed and not self.held:
            signal_group(self.pid, signal.SIGSTOP)
            self.held = True

    def after_step(self, step: int) -> None:
        pass

    def go_on(self) -> None:
        if self.held:
            signal_group(self.pid, signal.SIGCONT)
            self.held = False

    def figures(self, summary: object) -> dict:
        """Training has ended (at its last step, or earlier): the trace goes on; the summary
        says whether it was held."""
        held = self.held
        self.go_on()
        return {"estimate_trace_held": held}
