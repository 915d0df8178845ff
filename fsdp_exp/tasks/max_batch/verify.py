"""The search's answer, run as the command runs it before it is given (task.verify_steps).

A probe is short: a run's memory can keep growing after its first steps (the allocator's
history, wandb's buffers on rank 0, a checkpoint save, an evaluation). So the size the
probes found is run once more as `train.batch_size=<size>` would run it, with the run's own
data, sinks and checkpoints (`<run>/verify/<n>_b<size>/`): by default until its peak has
settled (no new high over VERIFY_WINDOW steps, at most VERIFY_CAP steps, whatever
train.steps is), or for task.verify_steps steps when given. If that run runs out of memory,
the answer steps down and is run again: `max batch` is then a size at which a run of the
command completed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from fsdp_exp.tasks.max_batch.answer import MB, SETTLE_FLOOR, run_words
from fsdp_exp.tasks.max_batch.probe import Probe, run_probe
from fsdp_exp.tasks.max_batch.settings import VerifyLength

log = logging.getLogger("fsdp_exp")

STEP_DOWN = 0.05  # the first step down, as a share of the size that ran out of memory; doubled each time
NEAR_LIMIT = 0.05  # a probe that left at most this share of the limit measures what a run holds beyond it


def step_down(size: int, failures: int, resolution: int, smallest: int) -> int | None:
    """The next size to verify after `failures` runs ran out of memory, the last at `size`:
    STEP_DOWN of it less, twice as much each time, on the resolution's grid; None below
    `smallest` (the smallest size the search read)."""
    share = min(STEP_DOWN * 2 ** (failures - 1), 1.0)
    smaller = min(math.floor(size * (1 - share) / resolution + 1e-9) * resolution, size - resolution)
    return smaller if smaller >= smallest else None


@dataclass
class Verification:
    """The runs that verified an answer, in the order they ran: each of at most `steps` steps,
    and with `until_settled` only until its peak settled (VerifyLength)."""

    steps: int
    runs: list[Probe] = field(default_factory=list)
    until_settled: bool = False

    @classmethod
    def of(cls, length: VerifyLength) -> Verification:
        return cls(length.steps, until_settled=length.until_settled)

    def run_words(self) -> str:
        """Its runs, in words: "a 10-step run", or "a run of up to 100 steps"."""
        return run_words({"steps": self.steps, "until_settled": self.until_settled})

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
        return {"steps": self.steps, "until_settled": self.until_settled, "status": self.status(),
                "wall_s": self.wall_s(), "ran_out_of_memory_at": self.ran_out(),
                "runs": [r.to_json() for r in self.runs]}

    @classmethod
    def from_json(cls, record: dict | None, length: VerifyLength) -> Verification:
        """The runs recorded for this length (none for another)."""
        if not record or record.get("steps") != length.steps \
                or bool(record.get("until_settled")) != length.until_settled:
            return cls.of(length)
        return cls(length.steps, [Probe.from_json(r) for r in record.get("runs", [])], length.until_settled)

    def same_length(self, record: dict | None) -> bool:
        """Whether `record` (a recorded verification) ran runs of this length."""
        return bool(record) and record.get("steps") == self.steps \
            and bool(record.get("until_settled")) == self.until_settled


@dataclass
class LengthCheck:
    """What a run of the command holds over its whole length beyond a probe at the same size,
    measured once per search: the first size that trained within NEAR_LIMIT of the limit is
    run as the command runs it, for the verification's steps (`<run>/verify/length_b<size>/`).
    A run's memory creeps on after a probe has settled (about 1 MB over 50 steps on each rank
    of docs/max_batch.md's example: the allocator's history, the loader, wandb's buffers), by
    more at small batches than near the limit (2.3 MB at batch 4, 1.1 at 420), so it is
    measured near the limit, where the answer is. Where that run does not complete (a model
    whose memory grows with every step at every batch), it is measured at the smallest size
    that trained. The search counts it against every probe from then on: the room a probe has
    is the limit less it. What grows with the batch on top of that the verification catches."""

    batch_size: int
    probe_peak_gb: float | None  # the probe's, as the search judges it (Probe.judged_peak_gb)
    run: Probe | None = None
    near_limit: Probe | None = None  # the run near the limit, where it did not complete and a smaller one measured
    probe_peaks_gb_per_rank: list[float] | None = None  # the probe's, each rank's

    def beyond_gb(self) -> float | None:
        """The run's peak less the probe's, on the rank that crept most (ranks creep alike, bar
        the noise: each may creep as far as any did); None where the run did not complete."""
        if self.run is None or self.run.status != "ok" or self.probe_peak_gb is None:
            return None
        peak = self.run.judged_peak_gb()
        ranks, probed = self.run.judged_peak_gb_per_rank(), self.probe_peaks_gb_per_rank or []
        if len(ranks) == len(probed) > 0:
            return max(r - p for r, p in zip(ranks, probed))
        return None if peak is None else peak - self.probe_peak_gb

    def counted_gb(self) -> float:
        """What the search counts against each probe: never less than nothing."""
        return max(0.0, self.beyond_gb() or 0.0)

    def runs(self) -> list[Probe]:
        return [r for r in (self.near_limit, self.run) if r is not None]

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "probe_peak_gb": self.probe_peak_gb, "run_peak_gb":
                self.run.judged_peak_gb() if self.run else None, "beyond_probe_gb": self.beyond_gb(),
                "counted_gb": self.counted_gb(), "run": self.run.to_json() if self.run else None,
                "near_limit": self.near_limit.to_json() if self.near_limit else None,
                "probe_peaks_gb_per_rank": self.probe_peaks_gb_per_rank}

    @classmethod
    def from_json(cls, record: dict | None) -> LengthCheck | None:
        if not record or not record.get("run"):
            return None
        near = record.get("near_limit")
        return cls(record["batch_size"], record["probe_peak_gb"], Probe.from_json(record["run"]),
                   Probe.from_json(near) if near else None, record.get("probe_peaks_gb_per_rank"))


def settle_within_gb(length: VerifyLength, limit_gb: float | None) -> float | None:
    """How far a run of the command's peak may still rise over VERIFY_WINDOW steps and count
    as settled: SETTLE_FLOOR of the limit (None where the runs train their steps)."""
    if not length.until_settled or limit_gb is None:
        return None
    return SETTLE_FLOOR * limit_gb


class Verifying:
    """The runs of the command a search makes (fsdp_exp.tasks.max_batch.search.MaxBatchSearch,
    whose probes, settings and launcher they read): once, what a run holds beyond a probe; at
    the end, its answer."""

    def settle_within_gb(self) -> float | None:
        length = VerifyLength(self.verification.steps, self.verification.until_settled)
        return settle_within_gb(length, self.limit_gb)

    def counted_beyond_gb(self) -> float:
        """What a run of the command holds beyond a probe, as counted against every probe
        (LengthCheck); nothing until it is measured."""
        return self.length.counted_gb() if self.length else 0.0

    def commands_wall_s(self) -> float:
        """The time the runs of the command took: the verification's, and the length check's
        unless they are among them (`length_run_at`)."""
        verified = {r.dir for r in self.verification.runs}
        others = [r for r in (self.length.runs() if self.length else []) if r.dir not in verified]
        return self.verification.wall_s() + sum(r.wall_s for r in others)

    def check_length(self) -> bool:
        """Once per search, at the first size that trained with at most NEAR_LIMIT of the
        limit left: run the command there for the verification's steps, and count what that
        run held beyond the probe against every probe (LengthCheck); where that run does not
        complete, run it at the smallest size that trained instead. False when there is
        nothing to run: measured already, no probe has trained that near the limit (the
        verification then runs at the answer all the same), or task.verify_steps=0."""
        steps = self.verification.steps
        trained = [p for p in self.probes if p.status == "ok" and not p.killed]
        near = next((p for p in trained if self.near_limit(p)), None)
        if self.length is not None or near is None or not steps:
            return False
        run = self.length_run(near, steps)
        self.length = LengthCheck(near.batch_size, near.judged_peak_gb(), run,
                                  probe_peaks_gb_per_rank=near.judged_peak_gb_per_rank())
        smallest = min(trained, key=lambda p: p.batch_size)
        if run.status == "oom" and smallest.batch_size < near.batch_size:
            log.info("%s at batch %d ran out of memory; measuring at the smallest size that trained, %d",
                     self.verification.run_words(), near.batch_size, smallest.batch_size)
            self.length = LengthCheck(smallest.batch_size, smallest.judged_peak_gb(), self.length_run(smallest, steps),
                                      near_limit=run, probe_peaks_gb_per_rank=smallest.judged_peak_gb_per_rank())
        beyond = self.length.beyond_gb()
        if beyond is None:
            log.warning("%s at batch %d did not complete, so what a run holds beyond a probe is not "
                        "counted: %s", self.verification.run_words(), self.length.batch_size, self.length.run.reason)
        else:
            log.info("%s: %s; %.1f MB more than its probe, counted against every probe",
                     self.verification.run_words(), self.length.run.line(), beyond / MB)
        self.save(None)
        return True

    def length_run(self, probe: Probe, steps: int) -> Probe:
        size = probe.batch_size
        log.info("measuring what %s of the command holds beyond a probe: the command at batch %d",
                 self.verification.run_words(), size)
        timeout_s = self.timeout_s * max(1.0, steps / self.steps)
        return run_probe(self.cfg, size, self.run_dir / "verify" / f"length_b{size}", self.launcher, self.nproc,
                         steps, timeout_s, as_command="verify", until_settled=self.settle_within_gb())

    def near_limit(self, probe: Probe) -> bool:
        peak = probe.judged_peak_gb()
        return self.limit_gb is not None and peak is not None and self.limit_gb - peak <= NEAR_LIMIT * self.limit_gb

    def verify(self, boundary: int) -> int:
        """The size at which a run of the command completed `verification.steps` steps: the
        boundary, or, where that run ran out of memory, the next size down that completed
        (fsdp_exp.tasks.max_batch.verify). The boundary, unverified, without verification
        (task.verify_steps=0) or where a run failed for another reason; 0 where none completed."""
        check = self.verification
        if not boundary or not check.steps:
            return boundary
        size: int | None = boundary
        while size is not None:
            run = next((r for r in check.runs if r.batch_size == size), None) or self.length_run_at(size) \
                or self.verify_run(size)
            if run.status == "ok":
                return size
            if run.status != "oom":
                log.warning("the run at batch %d failed, not for lack of memory, so the answer is not verified: %s",
                            size, run.reason)
                return boundary
            size = step_down(size, len(check.ran_out()), self.cfg.task.resolution, self.searched_from())
            if size is not None:
                log.info("%s of the command ran out of memory at batch %d; stepping down to %d",
                         check.run_words(), run.batch_size, size)
        return 0

    def length_run_at(self, size: int) -> Probe | None:
        """A run the length check made of the command at `size` for the same steps: it
        verifies that size as a run of its own would (or ran out of memory there), so it
        counts as one."""
        run = next((r for r in (self.length.runs() if self.length else []) if r.batch_size == size), None)
        if run is None:
            return None
        self.verification.runs.append(run)
        log.info("verify %d: the run that measured what a run holds beyond a probe: %s",
                 len(self.verification.runs), run.line())
        self.save(None)
        return run

    def verify_run(self, size: int) -> Probe:
        """The command at `size`, run as it runs, for the verification's steps."""
        check = self.verification
        run_dir = self.run_dir / "verify" / f"{len(check.runs) + 1:02d}_b{size}"
        log.info("verifying batch %d: the command as it runs (its data, wandb and checkpoints), %s",
                 size, VerifyLength(check.steps, check.until_settled).words())
        timeout_s = self.timeout_s * max(1.0, check.steps / self.steps)
        run = run_probe(self.cfg, size, run_dir, self.launcher, self.nproc, check.steps, timeout_s,
                        as_command="verify", until_settled=self.settle_within_gb())
        log.info("verify %d: %s", len(check.runs) + 1, run.line())
        check.runs.append(run)
        self.save(None)
        return run

