"""task.*: how task=max_batch searches. Apart from the search, so that task=tune's settings
(fsdp_exp.tasks.tune.settings) can take them without importing the search."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_exp.errors import ConfigError

# A run's memory can grow after a probe's first steps (the allocator's history, caches made late,
# a checkpoint's staging), and settles within a few steps. So by default the answer runs until
# its peak makes no new high over VERIFY_WINDOW steps, and never more than VERIFY_CAP steps,
# whatever train.steps is: what a user waits for scales with what memory does. Over 25 to 40
# steps of four models, a peak settled over 5 steps rose at most 0.4 MB more (docs/max_batch.md).
VERIFY_WINDOW = 5  # steps: the peak has settled when it rose no further over this many
VERIFY_CAP = 100  # steps: the most a verification runs unless task.verify_steps asks for more


@dataclass(frozen=True)
class VerifyLength:
    """How long a run of the command verifies an answer: at most `steps` steps, and with
    `until_settled` only until its peak has settled (fsdp_exp.rank.peak_settled.PeakSettled,
    checked every VERIFY_WINDOW steps). `steps` 0: not verified."""

    steps: int
    until_settled: bool

    def words(self) -> str:
        return f"up to {self.steps} steps, until its peak settles" if self.until_settled else f"{self.steps} steps"


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
    # The answer run as the command runs it, before it is given: None, until its peak settles
    # (at most VERIFY_CAP steps, whatever train.steps is); N, exactly N steps (train.steps for
    # the whole run's length); 0, not verified (the answer line says so).
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

    def verify_length(self) -> VerifyLength:
        """The verification's length: task.verify_steps steps when given (0: none), else until
        the peak settles, at most VERIFY_CAP steps. Never train.steps unless asked for."""
        if self.verify_steps is None:
            return VerifyLength(VERIFY_CAP, until_settled=True)
        return VerifyLength(self.verify_steps, until_settled=False)
