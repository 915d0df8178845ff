"""task.global_batch: every setup keeps the same global batch, and the objective is the time
of one optimizer step. A setup reaches it with a per-rank micro-batch m and train.grad_accum
k, m * k * world = global batch; its own fastest split is the m under its largest batch where
its probes' samples/s is highest (larger wins a tie: fewer micro-steps), confirmed by a probe
of m at k (`Accumulating`, a part of fsdp_exp.tasks.tune.tuner.Tuner)."""

from __future__ import annotations

from typing import Any

from fsdp_exp.errors import ConfigError
from fsdp_exp.tasks.max_batch.answer import speeds
from fsdp_exp.tasks.max_batch.probe import Probe

SPLITS_TRIED = 3  # splits of task.global_batch probed before a setup is said not to reach it


def check_divides(global_batch: int, world_size: int) -> None:
    if global_batch % world_size:
        raise ConfigError(f"task.global_batch={global_batch}: must be a multiple of the {world_size} ranks "
                          "(each rank's micro-batch times train.grad_accum times the ranks)")


def splits(global_batch: int, world_size: int, largest: int) -> list[tuple[int, int]]:
    """Every (micro-batch, accumulation) that reaches the global batch with a micro-batch of
    at most `largest`, the largest micro-batch first."""
    per_rank = global_batch // world_size
    return [(m, per_rank // m) for m in range(min(largest, per_rank), 0, -1) if per_rank % m == 0]


def speed_at(speeds: dict[int, float], size: int) -> float:
    """samples/s at `size`: straight between the sizes probed, flat past the ends."""
    sizes = sorted(speeds)
    if size <= sizes[0]:
        return speeds[sizes[0]]
    if size >= sizes[-1]:
        return speeds[sizes[-1]]
    below = max(b for b in sizes if b <= size)
    above = min(b for b in sizes if b >= size)
    if above == below:
        return speeds[below]
    return speeds[below] + (speeds[above] - speeds[below]) * (size - below) / (above - below)


def fastest_splits(global_batch: int, world_size: int, largest: int, speeds: dict[int, float]) -> list[tuple[int, int]]:
    """The splits, the one the probes' speeds predict fastest first (larger micro-batches first
    among equals). Without speeds, the largest micro-batch first."""
    candidates = splits(global_batch, world_size, largest)
    if not speeds:
        return candidates
    return sorted(candidates, key=lambda s: (-speed_at(speeds, s[0]), -s[0]))


class Accumulating:
    """A setup's split of task.global_batch; its attributes are the Tuner's."""

    settings: Any

    def budget_spent(self) -> bool:
        raise NotImplementedError

    def extra_probe(self, entry: Any, kind: str, micro: int, accum: int) -> Probe:
        raise NotImplementedError

    def fill_row(self, row: Any, probe: Probe, limit_gb: float | None) -> None:
        raise NotImplementedError

    def conclude(self, entry: Any, status: str, how: str) -> None:
        raise NotImplementedError

    def split(self, entry: Any, largest: int, how: str) -> None:
        """task.global_batch: the setup's fastest micro-batch and accumulation under its largest
        batch, by its probes' speeds, confirmed by a probe of that split (the next one, should it
        run out of memory)."""
        search, plan, global_batch = entry.search, entry.plan, self.settings.global_batch
        assert search is not None and plan is not None and global_batch is not None
        tried = []
        for micro, accum in fastest_splits(global_batch, plan.nproc, largest, speeds(search.probes, largest)):
            if self.budget_spent():
                return
            probe = self.extra_probe(entry, "split", micro, accum)
            if probe.status == "ok" and probe.samples_per_s:
                self.fill_row(entry.row, probe, search.limit_gb)
                entry.row.batch_size, entry.row.grad_accum = micro, accum
                entry.row.step_s = global_batch / probe.samples_per_s
                self.conclude(entry, "measured", f"{how}; task.global_batch={global_batch} as {micro} x {accum} "
                            f"on {plan.nproc} rank(s)")
                return
            if probe.status == "failed":
                self.conclude(entry, "failed", f"{micro} x {accum}: {probe.reason}")
                return
            tried.append(f"{micro} x {accum}")
            if len(tried) >= SPLITS_TRIED:
                break
        self.conclude(entry, "does not fit", f"no split of task.global_batch={global_batch} into micro-batches "
                    f"under {largest} trained" + (f" (tried {', '.join(tried)})" if tried else ""))
