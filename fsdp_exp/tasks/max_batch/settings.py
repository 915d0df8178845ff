"""max_batch.*: how task=max_batch searches. Apart from the search, so that the experiment's
schema (fsdp_exp.config) can hold these settings without importing the search."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_exp.errors import ConfigError


@dataclass
class MaxBatchSettings:
    """max_batch.*: how task=max_batch searches."""

    steps_per_probe: int = 3  # optimizer steps per probe; at least 2, so optimizer state counts
    probe_timeout: float = 600  # seconds; a probe past it is killed and recorded as failed
    resolution: int = 1  # the answer is exact to this; every probed size is a multiple of it
    margin: float = 0.1  # the recommended size keeps this share of the memory limit free
    search_up_to: int = 4096  # the largest batch size tried (at most each rank's share of a fixed data set)
    estimate: bool = True  # place the probes by task=estimate's curve (one trace on fake tensors) as well

    def __post_init__(self) -> None:
        if self.steps_per_probe < 2:
            raise ConfigError(f"max_batch.steps_per_probe={self.steps_per_probe}: must be at least 2 "
                              "(the second step holds the optimizer state the first one made)")
        if self.probe_timeout <= 0:
            raise ConfigError(f"max_batch.probe_timeout={self.probe_timeout}: must be greater than 0 (seconds)")
        if self.resolution < 1:
            raise ConfigError(f"max_batch.resolution={self.resolution}: must be at least 1")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"max_batch.margin={self.margin}: must be at least 0 and below 1")
        if self.search_up_to < self.resolution:
            raise ConfigError(f"max_batch.search_up_to={self.search_up_to}: must be at least "
                              f"max_batch.resolution={self.resolution}")
