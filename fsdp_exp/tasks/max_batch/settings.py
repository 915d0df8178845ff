"""task.*: how task=max_batch searches. Apart from the search, so that task=tune's settings
(fsdp_exp.tasks.tune.settings) can take them without importing the search."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_exp.errors import ConfigError

VERIFY_AT_LEAST = 50  # steps: a run's memory keeps growing after a probe's first few


@dataclass(kw_only=True)
class SearchSettings:
    """task.* of task=max_batch: how the search searches."""

    steps_per_probe: int = 3  # optimizer steps per probe; at least 2, so optimizer state counts
    settle_steps: int = 20  # a probe trains on past steps_per_probe, up to this many steps, until its peak settles
    probe_timeout: float = 600  # seconds; a probe past it is killed and recorded as failed
    resolution: int = 1  # the answer is exact to this; every probed size is a multiple of it
    margin: float = 0.1  # the recommended size keeps this share of the memory limit free
    search_up_to: int = 4096  # the largest batch size tried (at most each rank's share of a fixed data set)
    estimate: bool = True  # place the probes by task=estimate's curve (one trace on fake tensors) as well
    # The answer run as the command runs it, before it is given: None, train.steps and at least
    # 50; 0, not verified (the answer line says so).
    verify_steps: int | None = None

    def __post_init__(self) -> None:
        if self.steps_per_probe < 2:
            raise ConfigError(f"task.steps_per_probe={self.steps_per_probe}: must be at least 2 "
                              "(the second step holds the optimizer state the first one made)")
        if self.settle_steps < self.steps_per_probe:
            raise ConfigError(f"task.settle_steps={self.settle_steps}: must be at least "
                              f"task.steps_per_probe={self.steps_per_probe}")
        if self.probe_timeout <= 0:
            raise ConfigError(f"task.probe_timeout={self.probe_timeout}: must be greater than 0 (seconds)")
        if self.resolution < 1:
            raise ConfigError(f"task.resolution={self.resolution}: must be at least 1")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"task.margin={self.margin}: must be at least 0 and below 1")
        if self.verify_steps is not None and self.verify_steps < 0:
            raise ConfigError(f"task.verify_steps={self.verify_steps}: must be 0 (no verification) or more")
        if self.search_up_to < self.resolution:
            raise ConfigError(f"task.search_up_to={self.search_up_to}: must be at least "
                              f"task.resolution={self.resolution}")

    def steps_to_verify(self, train_steps: int) -> int:
        """The verification's steps: task.verify_steps, or the run's train.steps and at least
        VERIFY_AT_LEAST (0: none)."""
        return max(train_steps, VERIFY_AT_LEAST) if self.verify_steps is None else self.verify_steps
