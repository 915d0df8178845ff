"""The end of task=tune (`Confirming`, a part of fsdp_exp.tasks.tune.tuner.Tuner): before a
setup is called the winner, the setups as fast as it are run again in turns (`rematch`; with
no noise measured yet, it and the next fastest run the first round alone, which measures it), and
then its command line, exactly as printed, runs as task=max_batch verifies an answer (`confirm`). A command
line that does not complete steps its batch down, as task=max_batch's verification does, or
hands over to the next setup. The budget keeps room for the first confirmation from the
start (`confirmation_needs`)."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from fsdp_exp.metrics.sinks import METRICS, JsonLines
from fsdp_exp.tasks.max_batch.answer import speeds
from fsdp_exp.tasks.max_batch.verify import step_down
from fsdp_exp.tasks.tune.accumulation import speed_at
from fsdp_exp.tasks.tune.ranking import SPEED_NOISE, mean_of_runs, ties, winner

log = logging.getLogger("fsdp_exp")


class Confirming:
    """What a tune does once its searches are done; its attributes are the Tuner's."""

    entries: list
    settings: Any
    exp: Any
    confirming: bool
    confirmed: dict | None

    def confirmation_needs(self) -> tuple[int, float]:
        """What the winner's confirmation will take from the budget: one probe, and the time of
        the slowest probe so far at the winner's batch, its steps scaled to the confirmation's most."""
        best = winner([e.row for e in self.entries])
        entry = next((e for e in self.entries if e.row is best), None)
        probes = [p for p in self.trained(entry) if p.batch_size == best.batch_size] if entry and best else []
        steps = self.settings.verify_length().steps
        seconds = [(p.startup_s or 0.0) + (p.wall_s - (p.startup_s or 0.0)) * steps / self.settings.steps_per_probe
                   for p in probes]
        return 1, max(seconds, default=0.0)

    def speed_band(self) -> float | None:
        raise NotImplementedError

    def runs_of(self, entry: Any) -> dict[tuple[int, int], list[float]]:
        raise NotImplementedError

    def rematch(self) -> None:
        """The setups within the speed noise of the winner, run again in turns (two rounds, the
        second in the opposite order, so that no setup always runs first), before
        one of them is called the winner: each one's speed is then the mean of its runs. The
        noise is the one measured on this machine: where no setup has run twice at one batch
        yet, the winner and the next fastest run the first round alone, which measures it. Every
        measured setup is ranked by the mean of its runs at its batch, not the fastest of them."""
        for entry in self.entries:
            if entry.row.status == "measured":
                self.average(entry)
        best = winner([e.row for e in self.entries])
        if best is None:
            return
        first: list = []  # the pair whose first round measured the noise
        if self.speed_band() is None:
            runner_up = winner([e.row for e in self.entries if e.row is not best])
            if runner_up is None or not best.batch_size or not runner_up.batch_size:
                return
            log.info("task=tune: the noise between runs is not known yet; running %s and %s again, in turns",
                     best.setup, runner_up.setup)
            first = [next(e for e in self.entries if e.row is row) for row in (best, runner_up)]
            if not self.rematch_round(first, 1):
                return
            for entry in first:  # both, or neither: one mean against a fastest is no fairer
                self.average(entry)
            best = winner([e.row for e in self.entries])
            assert best is not None
        band = self.speed_band() or SPEED_NOISE
        close = [best, *ties([e.row for e in self.entries], best, band)]
        ran = {id(e) for e in first}
        entries = [e for e in first if any(e.row is r for r in close)] + [
            e for e in self.entries if any(e.row is r for r in close) and e.row.batch_size and id(e) not in ran]
        if len(entries) < 2:
            self.save()
            return
        log.info("task=tune: %s within %.0f%% of each other; running each again, in turns",
                 " and ".join(e.setup.name for e in entries), band * 100)
        if self.rematch_round([e for e in entries if id(e) not in ran], 1):
            self.rematch_round(entries[::-1], 2)
        for entry in entries:
            self.average(entry, ", in turns with the setups as fast")
        self.save()

    def rematch_round(self, entries: list, round_: int) -> bool:
        """Each setup run again at its batch (`rematch<round_>/`), in this order; False where
        the budget ended before all had."""
        for entry in entries:
            if self.budget_spent():
                return False
            self.extra_probe(entry, f"rematch{round_}", entry.row.batch_size, entry.row.grad_accum)
        return True

    def average(self, entry: Any, words: str = "") -> None:
        """A measured row's speed as the mean of its runs at its batch (`mean_of_runs`)."""
        row = entry.row
        if row.batch_size:
            mean_of_runs(row, self.runs_of(entry).get((row.batch_size * row.grad_accum, row.grad_accum), []), words)

    def confirm(self) -> None:
        """The winner's command line, exactly as printed, run as task=max_batch verifies an
        answer (task.verify_steps: by default until its peak settles), in fresh ranks: that it trains as
        printed, and how far its speed is from the search's short probes (the noise band its
        answer carries). Should it run out of memory, its batch steps down (`smaller`) and the
        winner is chosen again; should it fail otherwise, or have nowhere to step down to, the
        next setup is the winner. Either way a setup spared by a bound that can now win is
        searched first. While the budget lasts: the first confirmation has the room the budget
        kept for it."""
        failures: dict[str, int] = {}
        steps = self.settings.verify_length().steps
        while (best := winner([e.row for e in self.entries])) is not None and best.batch_size is not None:
            if self.confirming and self.budget_spent():
                return
            self.confirming = True
            entry = next(e for e in self.entries if e.row is best)
            assert entry.search is not None
            probe = self.extra_probe(entry, "confirm", best.batch_size, best.grad_accum)
            self.confirmed = {"status": probe.status, "samples_per_s": probe.samples_per_s,
                              "peak_gb": probe.limited_peak_gb(), "reason": probe.reason, "steps": probe.steps or steps,
                              "step_spread": step_spread(entry.search.run_dir / probe.dir / METRICS)
                              if probe.status == "ok" else None}
            if probe.status == "ok":
                best.confirmed, best.confirmed_samples_per_s = True, probe.samples_per_s
                if failures.get(best.setup):  # at a size no probe timed: the run's own figures
                    self.fill_row(best, probe, entry.search.limit_gb)
                self.save()
                return
            failures[best.setup] = failures.get(best.setup, 0) + 1
            said = f"; its command line at batch {best.batch_size} did not complete {steps} steps ({probe.status}: " \
                   f"{probe.reason})"
            down = smaller(entry, failures[best.setup], self.settings.resolution) if probe.status == "oom" else None
            if down is None:
                best.confirmed, best.how = False, best.how + said
                log.warning("task=tune: the winner's command line did not complete (%s: %s); confirming the next setup",
                            probe.status, probe.reason)
            else:
                best.how += f"{said}; stepped down to {down[0]}"
                best.batch_size, best.samples_per_s, best.peak_gb, best.headroom_gb = down[0], down[1], None, None
                log.warning("task=tune: the winner's command line ran out of memory at batch %d within %d steps; "
                            "stepping down to %d", probe.batch_size, steps, down[0])
            self.confirmed = None
            self.save()
            self.reopen_bounded()


def smaller(entry: Any, failures: int, resolution: int) -> tuple[int, float] | None:
    """The batch a setup's command line steps down to after `failures` runs of it ran out of
    memory (fsdp_exp.tasks.max_batch.verify.step_down), and its speed as the setup's probes
    put it there; None with accumulation (task.global_batch fixes the step's batch), or
    below the smallest size its search read."""
    row, search = entry.row, entry.search
    assert search is not None and row.batch_size is not None
    if row.grad_accum > 1:
        return None
    size = step_down(row.batch_size, failures, resolution, search.searched_from())
    timed = speeds(search.probes, row.batch_size)  # speed, not memory: the probes above the new size count
    return None if size is None or not timed else (size, speed_at(timed, size))


def step_spread(metrics: Path) -> float | None:
    """How far a run's timed steps' samples/s stray from their median (half their range over
    it), from its metrics.jsonl with a record each step; None with fewer than 3 timed steps."""
    records = JsonLines.read(metrics)
    speeds = [r["samples_per_s"] for r in records if not r.get("warmup") and r.get("samples_per_s")]
    if len(speeds) < 3:
        return None
    return (max(speeds) - min(speeds)) / 2 / statistics.median(speeds)
