"""The search's answer, run as the command runs it before it is given (task.verify_steps).

A probe is short: a run's memory can keep growing after its first steps (the allocator's
history, wandb's buffers on rank 0, a checkpoint save, an evaluation). So the size the
probes found is run once more as `train.batch_size=<size>` would run it, with the run's own
data, sinks and checkpoints (`<run>/verify/<n>_b<size>/`): by default until its peak has
settled (no new high over VERIFY_WINDOW steps, at most VERIFY_CAP steps, whatever
train.steps is), or for task.verify_steps steps when given. If that run runs out of memory,
the answer steps down and is run again: `max batch` is then a size at which a run of the
command completed. What the run that completed held beyond its probe is counted against
every probe; where that brings the probes' boundary down, they go on below it, and the run
covers their answer (a run of a smaller size holds less). One run of the command, most
often, verifies the answer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_exp.tasks.max_batch.answer import MB, SETTLE_FLOOR, run_words
from fsdp_exp.tasks.max_batch.policy import fit_memory
from fsdp_exp.tasks.max_batch.probe import Probe, run_probe
from fsdp_exp.tasks.max_batch.settings import VerifyLength

log = logging.getLogger("fsdp_exp")

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
    """The runs that verified an answer, in the order they ran: each of at most `steps` steps,
    and with `until_settled` only until its peak settled (VerifyLength)."""

    steps: int
    runs: list[Probe] = field(default_factory=list)
    until_settled: bool = False

    @classmethod
    def of(cls, length: VerifyLength) -> Verification:
        return cls(length.steps, until_settled=length.until_settled)

    def length(self) -> VerifyLength:
        return VerifyLength(self.steps, self.until_settled)

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
        """The seconds of its own runs: a probe run as the command counts as probing."""
        return sum(r.wall_s for r in self.runs if not r.as_command)

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


@dataclass
class LengthCheck:
    """What a run of the command held beyond a probe at the same size: measured on the run
    that verified the answer (the largest whose run completed), against the probe at its size,
    or where no probe ran there (a size the verification stepped down to), the probes' line
    (`probe_peaks_gb_per_rank` None). A run's memory creeps on after a probe has settled
    (about 1 MB over 50 steps on each rank of docs/max_batch.md's example: the allocator's
    history, the loader, wandb's buffers), by more at small batches than near the limit, so
    it is measured where the answer is. The search counts it against every probe: the room a
    probe has is the limit less it, so a size the probes found with the noise band to spare
    holds it too, and the run above that size verifies it (a run at a smaller size holds less)."""

    batch_size: int
    probe_peak_gb: float | None  # the probe's, as the search judges it (Probe.judged_peak_gb), or the line's
    run: Probe | None = None
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

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "probe_peak_gb": self.probe_peak_gb, "run_peak_gb":
                self.run.judged_peak_gb() if self.run else None, "beyond_probe_gb": self.beyond_gb(),
                "counted_gb": self.counted_gb(), "run": self.run.to_json() if self.run else None,
                "probe_peaks_gb_per_rank": self.probe_peaks_gb_per_rank}


def settle_within_gb(length: VerifyLength, limit_gb: float | None) -> float | None:
    """How far a run of the command's peak may still rise over VERIFY_WINDOW steps and count
    as settled: SETTLE_FLOOR of the limit (None where the runs train their steps)."""
    if not length.until_settled or limit_gb is None:
        return None
    return SETTLE_FLOOR * limit_gb


class Verifying:
    """The runs of the command a search makes (fsdp_exp.tasks.max_batch.search.MaxBatchSearch,
    whose probes, settings and launcher they read), one at a time once the probes have found
    their boundary (`verify_step`), and the answer they leave (`verify`)."""

    def settle_within_gb(self) -> float | None:
        return settle_within_gb(self.verification.length(), self.limit_gb)

    def held_beyond(self) -> LengthCheck | None:
        """What the run that verified held beyond a probe at its size (LengthCheck); None
        until a run of the command completed."""
        done = [r for r in self.verification.runs if r.status == "ok"]
        if not done:
            return None
        run = max(done, key=lambda r: r.batch_size)
        if run.as_command:  # the search's own probe there was the run of the command: nothing beyond it to count
            return None
        probe = next((p for p in reversed(self.probes) if p.batch_size == run.batch_size and p.status == "ok"
                      and not p.killed and p.judged_peak_gb() is not None), None)
        if probe is not None:
            return LengthCheck(run.batch_size, probe.judged_peak_gb(), run, probe.judged_peak_gb_per_rank() or None)
        model = fit_memory(self.outcomes())
        return LengthCheck(run.batch_size, model.peak_gb(run.batch_size) if model else None, run)

    def counted_beyond_gb(self) -> float:
        """What a run of the command holds beyond a probe, as counted against every probe
        (LengthCheck); nothing until a run of the command completed."""
        length = self.held_beyond()
        return length.counted_gb() if length else 0.0

    def commands_wall_s(self) -> float:
        return self.verification.wall_s()

    def size_to_verify(self, boundary: int) -> int | None:
        """Where the command runs next: the probes' boundary, or below the last size whose run
        ran out of memory (`step_down`); None when a run that completed covers the answer (at
        it or above it), when none is left to try, or after a run failed for another reason."""
        check = self.verification
        if not boundary or not check.steps or any(r.status not in ("ok", "oom") for r in check.runs):
            return None
        done = max((r.batch_size for r in check.runs if r.status == "ok"), default=0)
        ran_out = check.ran_out()
        size: int | None = boundary
        if ran_out:
            size = step_down(min(ran_out), len(ran_out), self.cfg.task.resolution, self.searched_from())
        if size is None or size <= done or boundary <= done:
            return None
        return min(size, boundary)

    def verify_step(self) -> bool:
        """Once the probes have found their boundary: run the command there as it runs, until
        its peak settles (or for task.verify_steps), and count what it held beyond its probe
        against every probe, which may bring the boundary down (the probes then go on below
        it; that run covers their answer). Where the run ran out of memory, the next one
        steps down. False when there is nothing to run."""
        size = self.size_to_verify(self.boundary())
        if size is None:
            return False
        check = self.verification
        if check.ran_out():
            log.info("%s of the command ran out of memory at batch %d; stepping down to %d",
                     check.run_words(), min(check.ran_out()), size)
        run = self.verify_run(size)
        if run.status not in ("ok", "oom"):
            log.warning("the run at batch %d failed, not for lack of memory, so the answer is not verified: %s",
                        size, run.reason)
        length = self.held_beyond()
        if run.status == "ok" and length is not None and length.beyond_gb() is not None:
            log.info("%s at batch %d held %.1f MB more than its probe, counted against every probe",
                     check.run_words(), size, length.beyond_gb() / MB)
        return True

    def verify(self, boundary: int) -> int:
        """The answer the runs of the command leave: the boundary where a run at it or above
        it completed, else the largest size whose run completed, 0 where none did. The
        boundary, unverified, without verification (task.verify_steps=0) or where a run
        failed for another reason."""
        runs = self.verification.runs
        if not boundary or not self.verification.steps or not runs \
                or any(r.status not in ("ok", "oom") for r in runs):
            return boundary
        return min(boundary, max((r.batch_size for r in runs if r.status == "ok"), default=0))

    def command_run(self, size: int, run_dir: Path) -> Probe:
        """The command at `size`, run as it runs, for the verification's steps, in `run_dir`."""
        check = self.verification
        if self.probes_before_verifying is None:  # the first run of the command
            self.probes_before_verifying = len(self.probes)
        timeout_s = self.timeout_s * max(1.0, check.steps / self.steps)
        return run_probe(self.cfg, size, run_dir, self.launcher, self.nproc, check.steps, timeout_s,
                         as_command="verify", until_settled=self.settle_within_gb())

    def answers_at(self, size: int) -> bool:
        """Whether the search expects `size` to be its answer, so that its probe runs as the
        command (`command_run`) and verifies the answer as it probes it, in place of a probe
        and then a run of the command at the same size: where a size that fits there closes
        the bracket, or where the estimate's curve puts the boundary of the room the probes aim
        at less than one step of task.resolution above it (as it does where a sample takes a
        large share of the limit: the estimate's first probe is then at the answer or next to
        it, and the probe past it is expected to fail). Only when the
        answer is verified until its peak settles (a run of task.verify_steps steps could be
        long, for a size that may not be the answer), and until a run of the command completed.
        Where the search goes on past it, the run cost a few steps more than a probe."""
        check = self.verification
        if not (check.steps and check.until_settled) or self.limit_gb is None or check.completed() is not None:
            return False
        search, r = self.search(), self.cfg.task.resolution
        _, hi = search.bracket(self.outcomes())
        if (hi if hi is not None else search.up_to + r) - size <= r:
            return True
        curve = self.estimate()
        return curve is not None and curve.crossing(self.room_gb() - self.noise_gb()) < size + 2 * r

    def failed_as_command(self, run: Probe, for_fastest: bool) -> None:
        """A probe run as the command failed, not for lack of memory: a failure of the command's
        own (its wandb, its checkpoints, its export), which leaves the answer not verified, as
        a run of the command that fails after the probes does; or of any run at this size (too
        small to train). A plain probe at the size tells which, and stands as the probe there."""
        log.warning("batch %d failed as the command, not for lack of memory (%s); probing it as the probes run",
                    run.batch_size, run.reason)
        plain = self.probe(run.batch_size, for_fastest=for_fastest)
        if plain.status != "failed":  # the command's own failure: a run of the command, not a probe
            self.probes.remove(run)
            self.verification.runs.append(run)
            self.save(None)

    def verify_run(self, size: int) -> Probe:
        """The command at `size`, run as it runs, for the verification's steps."""
        check = self.verification
        run_dir = self.run_dir / "verify" / f"{len(check.runs) + 1:02d}_b{size}"
        log.info("verifying batch %d: the command as it runs (its data, wandb and checkpoints), %s",
                 size, check.length().words())
        run = self.command_run(size, run_dir)
        log.info("verify %d: %s", len(check.runs) + 1, run.line())
        check.runs.append(run)
        self.save(None)
        return run
