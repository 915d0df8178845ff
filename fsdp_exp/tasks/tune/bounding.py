"""How far a setup of task=tune could still get (`Bounding`, a part of
fsdp_exp.tasks.tune.tuner.Tuner), and where its speed is taken.

- With its estimate, a setup's speed is taken where the estimate puts its largest batch: its
  first probe, placed where the estimate leaves 5% of the limit free
  (fsdp_exp.tasks.max_batch.policy), measures it once its peak is within NEAR_LIMIT of the
  limit (`near_largest`). Its boundary is not searched (task.search_boundary=true searches
  it): a few percent of batch below it moves samples/s by less than runs move, and the
  winner's command line is run as printed before it is given.
- Without the estimate (or with task.global_batch, whose splits need the largest batch), a
  setup is searched to its fastest batch, as task=max_batch searches it.
- A setup not measured yet is bounded: by its probes, or with none by the speed model
  widened by its own error; one whose bound cannot reach the best measured, less the noise
  between runs measured on this machine, is not measured (`bounded`, `predicted`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from fsdp_exp.tasks.max_batch.policy import LEVEL_ERROR, PRIOR_ERROR
from fsdp_exp.tasks.max_batch.prior import prior
from fsdp_exp.tasks.max_batch.probe import Probe
from fsdp_exp.tasks.tune.ranking import SPEED_NOISE, between_runs, can_win, speed_bound

log = logging.getLogger("fsdp_exp")

# A probe whose peak is within this share of the limit was placed near its setup's largest
# batch (the estimate's first probe aims 5% below it, and is within about 2% of a run's peak)...
NEAR_LIMIT = 0.1
# ... where its batch is at least this share of the largest the setup could reach: where what
# every batch holds fills the limit nearly alone, a probe within NEAR_LIMIT of it may be far
# below the largest batch (batch 1 at 0.574 GB of 0.6, where batch 40 fits).
NEAR_LARGEST = 0.5


class Bounding:
    """What a tune knows of how fast each setup could get; its attributes are the Tuner's."""

    entries: list
    settings: Any

    # fsdp_exp.tasks.tune.predicting.Predicting's, after this part in the Tuner's order
    predicted_bound: Callable[[Any, float], tuple[float, float, float] | None]

    def trained(self, entry: Any) -> list[Probe]:
        raise NotImplementedError

    def best_speed(self) -> float | None:
        raise NotImplementedError

    def budget_spent(self) -> bool:
        raise NotImplementedError

    def conclude(self, entry: Any, status: str, how: str) -> None:
        raise NotImplementedError

    def extra_probe(self, entry: Any, kind: str, micro: int, accum: int) -> Probe:
        raise NotImplementedError

    def at_estimate(self, entry: Any) -> bool:
        """Whether the setup's speed is taken near the largest batch its estimate puts under
        the limit, without searching its boundary: with a curve, unless task.search_boundary
        or task.global_batch asks for the boundary."""
        search = entry.search
        return (search is not None and not self.settings.search_boundary and self.settings.global_batch is None
                and search.limit_gb is not None and prior(search.estimated) is not None)

    def near_largest(self, entry: Any) -> Probe | None:
        """The probe that measures a setup taken at its estimate (`at_estimate`): the one that
        trained nearest its largest batch, when one is near it: at the largest size the search
        tries, or its peak within NEAR_LIMIT of the limit and its batch at least NEAR_LARGEST
        of the largest the setup could reach (`largest`). None otherwise."""
        search = entry.search
        trained = self.trained(entry)
        if not trained or not self.at_estimate(entry):
            return None
        largest = self.largest(entry)
        near = [p for p in trained if p.batch_size >= search.up_to()
                or ((p.limited_peak_gb() or 0.0) >= search.limit_gb * (1 - NEAR_LIMIT)
                    and p.batch_size >= NEAR_LARGEST * largest)]
        return max(near, key=lambda p: p.batch_size, default=None)

    def reach(self, entry: Any) -> tuple[float, str]:
        """The batch at which a setup not yet probed would be measured, in words too: where its
        first probe goes (at the estimate), or the largest it could reach (searched)."""
        if self.at_estimate(entry) and not entry.search.probes:
            first = entry.search.next_size()
            if first:
                return first, f"where its estimate leaves {LEVEL_ERROR:.0%} of the limit free"
        return self.largest(entry), "the largest the estimate lets it reach"

    def largest(self, entry: Any) -> float:
        """The largest batch this setup could reach: below its smallest size that ran out of
        memory, within the search's range, and, with the estimate moved through its largest
        probe that trained, within that curve's crossing widened by the error of its growth."""
        search = entry.search
        assert search is not None
        r = self.settings.resolution
        largest: float = search.up_to()
        failed = [p.batch_size for p in search.probes if p.status == "oom" and not p.killed]
        if failed:
            largest = min(largest, min(failed) - r)
        curve, fit = prior(search.estimated), self.trained(entry)
        if not fit and entry.row.estimated_max_batch:
            largest = min(largest, entry.row.estimated_max_batch * (1 + PRIOR_ERROR))
        if curve is not None and fit and search.limit_gb is not None:
            top = max(fit, key=lambda p: p.batch_size)
            peak = top.limited_peak_gb()
            if peak is not None:
                crossing = curve.through((top.batch_size, peak), (top.batch_size, peak)).crossing(search.limit_gb)
                largest = min(largest, top.batch_size + max(crossing - top.batch_size, 0.0) * (1 + PRIOR_ERROR))
        return largest

    def bound(self, entry: Any) -> float | None:
        """The most samples/s the setup could reach under the limit: by its probes, or with
        none, by the speed model (None: neither can say)."""
        fit = self.trained(entry)
        if not fit:
            predicted = self.predicted_bound(entry, self.reach(entry)[0])
            return None if predicted is None else predicted[2]
        largest = self.largest(entry)
        return max(speed_bound(p.samples_per_s or 0.0, p.batch_size, largest) for p in fit)

    def can_still_win(self, entry: Any) -> bool:
        """Whether the setup's bound reaches the best measured speed, less the noise between
        runs measured on this machine (`speed_band`). A setup is never bounded out by a speed
        whose noise is unknown: the first time one would be, its fastest probe is run again
        (`run_again`), which measures it."""
        bound, best = self.bound(entry), self.best_speed()
        if bound is None or best is None:
            return True
        if not self.trained(entry):  # the model's bound, widened by its own measured error
            return can_win(bound, best, self.speed_band() or SPEED_NOISE)
        if self.speed_band() is None and not can_win(bound, best):
            self.run_again(entry)
        band = self.speed_band()
        return band is None or can_win(self.bound(entry) or math.inf, best, band)

    def run_again(self, entry: Any) -> None:
        """The setup's fastest probe, run again at its batch beside its search (`repeat/`)."""
        plan = entry.plan
        if plan is None or self.budget_spent():
            return
        accum = plan.exp.train.grad_accum
        fastest = max(self.trained(entry), key=lambda p: p.samples_per_s or 0.0)
        log.info("%s: its speed's noise on this machine is not known yet; running its probe at batch %d again",
                 entry.setup.name, fastest.batch_size)
        self.extra_probe(entry, "repeat", fastest.batch_size // accum, accum)

    def speed_band(self) -> float | None:
        """How far samples/s moves between runs of one setup at one batch on this machine,
        SPEED_NOISE at least: the widest spread of the runs at a batch any setup ran twice
        (probes, and runs beside a search but the confirmation); None until one has."""
        readings = {(entry.setup.name, *key): speeds for entry in self.entries
                    for key, speeds in self.runs_of(entry).items()}
        band = between_runs(readings)
        return None if band is None else max(band, SPEED_NOISE)

    def runs_of(self, entry: Any) -> dict[tuple[int, int], list[float]]:
        """A setup's samples/s readings by (a step's batch on each rank, train.grad_accum): its
        probes that trained, and its runs beside the search but the confirmation."""
        readings: dict[tuple[int, int], list[float]] = {}
        accum = entry.plan.exp.train.grad_accum if entry.plan is not None else 1
        for p in self.trained(entry):
            readings.setdefault((p.batch_size, accum), []).append(p.samples_per_s or 0.0)
        for key, speed in entry.readings:
            readings.setdefault(key, []).append(speed)
        return readings

    def bounded_words(self, entry: Any) -> str:
        fit = max(self.trained(entry), key=lambda p: p.samples_per_s or 0.0)
        return (f"{fit.samples_per_s:,.1f} samples/s at batch {fit.batch_size}: at most {self.bound(entry):,.1f} "
                f"up to batch {self.largest(entry):.0f}, below the best's {self.best_speed():,.1f} by more than "
                f"runs here move ({self.speed_band() or SPEED_NOISE:.0%})")

    def conclude_predicted(self, entry: Any) -> None:
        """A setup left out without a probe: the model's figures on its row, and why."""
        largest, where = self.reach(entry)
        predicted = self.predicted_bound(entry, largest)
        assert predicted is not None
        speed, error, bound = predicted
        entry.row.predicted_samples_per_s, entry.row.bound_samples_per_s = speed, bound
        self.conclude(entry, "predicted", f"the speed model puts it at {speed:,.1f} samples/s at batch {largest:.0f}, "
                      f"{where}; at most {bound:,.1f} within the model's error "
                      f"({max(error, self.speed_band() or SPEED_NOISE):.0%}), below the best's "
                      f"{self.best_speed():,.1f}; not probed")

