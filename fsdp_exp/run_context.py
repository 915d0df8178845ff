"""What a run learns and does on its way, kept beside its settings.

The Experiment holds what the config says, checked, and nothing changes it afterwards.
A RunContext holds the rest: the environment the run found, when each part of its
start-up ended, and the checkpoint it starts from. The driver makes one per run; each
rank receives a copy with its task and adds its own start-up marks to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunContext:
    environment: dict = field(default_factory=dict)  # versions, host, overrides; rank 0 adds its device
    startup: dict[str, float] = field(default_factory=dict)  # when each part ended (fsdp_exp.metrics.startup)
    resume: str | None = None  # the checkpoint the run starts from, as the driver settled it
    estimate_file: str | None = None  # where the driver writes the run's estimate, for rank 0 (memory.estimate)
    estimate_pid: int | None = None  # the process tracing it, which rank 0 holds still while the run is timed
    # A probe of task=max_batch: it trains until its peak has settled (fsdp_exp.rank.peak_settled.PeakSettled's keys)
    settle: dict | None = None

    def overrides(self) -> list[str]:
        return list(self.environment.get("overrides", []))
