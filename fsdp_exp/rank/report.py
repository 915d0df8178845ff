"""What a rank adds to its run's figures once training ended (`Trainer`'s `after_fit` hooks):
what the build knew and the first micro-batch counted, the start-up marks, its runtime, the
peak as memory.limit_gb counts it, what the GPU held, and the run's own estimate beside what
it measured. Every rank calls each one, in this order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fsdp_exp import distributed
from fsdp_exp.distributed import Ranks
from fsdp_exp.memory import held_before_limit_gb, peak_under_limit_gb, under_limit_figures
from fsdp_exp.metrics.peaks import Runtime, device_used_gb
from fsdp_exp.metrics.startup import in_order
from fsdp_exp.metrics.summary import Summary
from fsdp_exp.rank.trainer import AfterFit


@dataclass
class Known:
    """What the build knew and the first micro-batch counted (FSDP units, FLOPs per step, the
    device's peak FLOP/s: fsdp_exp.rank.build), as they are once training ended."""

    known: dict

    def figures(self, summary: Summary) -> dict:
        return dict(self.known)


@dataclass
class StartupMarks:
    """The run's start-up marks, in order (fsdp_exp.metrics.startup)."""

    startup: dict

    def figures(self, summary: Summary) -> dict:
        return {"startup": in_order(self.startup)}


@dataclass
class RuntimeHeld:
    """CPU: what each rank held before it built its model, which peak_mem_gb leaves out
    (fsdp_exp.metrics.peaks); the largest over the ranks."""

    ranks: Ranks
    runtime: Runtime

    def figures(self, summary: Summary) -> dict:
        if self.ranks.device.type != "cpu":
            return {}
        return {"runtime_gb": max(distributed.gather(self.runtime.gb, self.ranks.device))}


@dataclass
class UnderLimit:
    """Under memory.limit_gb: the limit, and the peak it caps, per rank and the largest
    (fsdp_exp.memory.under_limit_figures)."""

    ranks: Ranks
    limit_gb: float | None

    def figures(self, summary: Summary) -> dict:
        counted = held = None
        mine = peak_under_limit_gb()
        if mine is not None:  # CPU under a limit, on every rank alike
            counted = distributed.gather(mine, self.ranks.device)
            held = distributed.gather(held_before_limit_gb(), self.ranks.device)
        return under_limit_figures(self.limit_gb, self.ranks.device.type, summary.peak_reserved_gb_per_rank,
                                   counted, held)


@dataclass
class DeviceUsed:
    """GPU: what the device held at each rank's reserved peak, with the CUDA context, NCCL and
    cuBLAS outside the allocator (fsdp_exp.metrics.peaks.device_used_gb)."""

    ranks: Ranks

    def figures(self, summary: Summary) -> dict:
        reserved = summary.peak_reserved_gb_per_rank
        if self.ranks.device.type != "cuda" or not reserved:  # none: nothing trained
            return {}
        used = distributed.gather(device_used_gb(self.ranks.device, reserved[self.ranks.rank]), self.ranks.device)
        return {"device_used_gb_per_rank": used, "device_used_gb": max(used)}


@dataclass
class AgainstEstimate:
    """Rank 0: the run's own estimate (memory.estimate, traced beside it by the driver) beside
    what it measured: `checked(summary, estimate_file)` (fsdp_exp.tasks.train.estimate_checked)."""

    ranks: Ranks
    estimate_file: Path
    checked: Callable[[Summary, Path], dict]

    def figures(self, summary: Summary) -> dict:
        return self.checked(summary, self.estimate_file) if self.ranks.is_main else {}


def after_fit(ranks: Ranks, runtime: Runtime, limit_gb: float | None, estimate_file: str | None,
              against_estimate: Callable[[Summary, Path], dict] | None) -> list[AfterFit]:
    """The hooks a training run reports with after what it knew (`Known`) and its start-up
    (`StartupMarks`), in order: each sees the figures of the ones before."""
    hooks: list[AfterFit] = [RuntimeHeld(ranks, runtime), UnderLimit(ranks, limit_gb), DeviceUsed(ranks)]
    if estimate_file and against_estimate is not None:
        hooks.append(AgainstEstimate(ranks, Path(estimate_file), against_estimate))
    return hooks
