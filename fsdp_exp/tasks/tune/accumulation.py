"""task.global_batch: every setup keeps the same global batch, and the objective is the time
of one optimizer step. A setup reaches it with a per-rank micro-batch m and train.grad_accum
k, m * k * world = global batch; its own fastest split is the m under its largest batch where
its probes' samples/s is highest (larger wins a tie: fewer micro-steps), confirmed by a probe
of m at k."""

from __future__ import annotations

from fsdp_exp.errors import ConfigError


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
