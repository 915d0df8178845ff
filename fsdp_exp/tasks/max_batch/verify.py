"""The search's answer, run as the command runs it before it is given (task.verify_steps).

A probe is short: a run's memory can keep growing after its first steps (the allocator's
history, wandb's buffers on rank 0, a checkpoint save, an evaluation). So the size the
probes found is run once more as `train.batch_size=<size>` would run it, with the run's own
data, sinks, checkpoints and evaluation, for the run's length (`<run>/verify/<n>_b<size>/`).
If that run runs out of memory, the answer steps down and is run again: `max batch` is then
a size at which a run of the command completed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fsdp_exp.tasks.max_batch.probe import Probe

STEP_DOWN = 0.05  # the first step down, as a share of the size that ran out of memory; doubled each time


def step_down(size: int, failures: int, resolution: int, smallest: int) -> int | None:
    """The next size to verify after `failures` runs ran out of memory, the last at `size`:
    STEP_DOWN of it less, twice as much each time, on the resolution's grid; None below
    `smallest` (the smallest size the search read)."""
    share = min(STEP_DOWN * 2 ** (failures - 1), 1.0)
    smaller = min(math.floor(size * (1 - share) / resolution + 1e-9) * resolution, size - resolution)
    return smaller if smaller >= smallest else None


@dataclass
class Verification:
    """The runs that verified an answer, in the order they ran."""

    steps: int
    runs: list[Probe] = field(default_factory=list)

    def completed(self) -> Probe | None:
        return next((r for r in self.runs if r.status == "ok"), None)

    def status(self) -> str:
        """completed: at the size the probes found; stepped down: at a smaller one; none
        completed: every size down to the smallest ran out of memory; failed: a run failed
        for a reason other than memory, so the size could not be verified; not run."""
        if not self.runs:
            return "not run"
        done = self.completed()
        if done is not None:
            return "completed" if done is self.runs[0] else "stepped down"
        return "failed" if self.runs[-1].status != "oom" else "none completed"

    def ran_out(self) -> list[int]:
        return [r.batch_size for r in self.runs if r.status == "oom"]

    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.runs)

    def to_json(self) -> dict:
        return {"steps": self.steps, "status": self.status(), "wall_s": self.wall_s(),
                "ran_out_of_memory_at": self.ran_out(), "runs": [r.to_json() for r in self.runs]}

    @classmethod
    def from_json(cls, record: dict | None, steps: int) -> Verification:
        """The runs recorded for `steps` steps (none for another length)."""
        if not record or record.get("steps") != steps:
            return cls(steps)
        return cls(steps, [Probe.from_json(r) for r in record.get("runs", [])])


@dataclass
class LengthCheck:
    """What a run of the command holds over its whole length beyond a probe at the same size,
    measured once per search: the first size that trained is run as the command runs it, for
    the verification's steps (`<run>/verify/length_b<size>/`). A run's memory creeps on after
    a probe has settled (here about 2 MB over 50 steps, on every rank: the allocator's
    history, the loader, wandb's buffers), and the search counts that much against every
    probe: the room a probe has is the limit less it. What grows with the batch on top of that
    the verification catches."""

    batch_size: int
    probe_peak_gb: float | None  # the probe's, as the search judges it (Probe.judged_peak_gb)
    run: Probe | None = None

    def beyond_gb(self) -> float | None:
        """The run's peak less the probe's; None where the run did not complete."""
        if self.run is None or self.run.status != "ok" or self.probe_peak_gb is None:
            return None
        peak = self.run.judged_peak_gb()
        return None if peak is None else peak - self.probe_peak_gb

    def counted_gb(self) -> float:
        """What the search counts against each probe: never less than nothing."""
        return max(0.0, self.beyond_gb() or 0.0)

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "probe_peak_gb": self.probe_peak_gb, "run_peak_gb":
                self.run.judged_peak_gb() if self.run else None, "beyond_probe_gb": self.beyond_gb(),
                "counted_gb": self.counted_gb(), "run": self.run.to_json() if self.run else None}

    @classmethod
    def from_json(cls, record: dict | None) -> LengthCheck | None:
        if not record or not record.get("run"):
            return None
        return cls(record["batch_size"], record["probe_peak_gb"], Probe.from_json(record["run"]))
