"""Where the batch size meets the memory limit, in few probes.

Peak memory is close to affine in the batch size: parameters, gradients and optimizer state
make the intercept; activations grow with every sample. So the search fits that line to the
probes that trained, predicts the batch at which it crosses the limit, probes there and one
step past it. Only when the prediction was off does it step further (doubling the step
while sizes keep fitting) or bisect what is left. Every size is a multiple of `resolution`, and the answer is exact to it:
the boundary trained and the boundary plus `resolution` did not.

This module only decides which batch size to try next; it runs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Outcome:
    """What one probe showed: whether the batch fit, and for one that did, its memory."""

    batch_size: int
    fits: bool
    peak_gb: float | None = None  # the largest peak over the ranks
    held_gb: float | None = None  # held between steps: parameters and optimizer state


@dataclass(frozen=True)
class MemoryModel:
    """peak_gb = intercept_gb + slope_gb_per_sample * batch_size."""

    intercept_gb: float
    slope_gb_per_sample: float
    points: int  # probes the line was fit to; 1: an estimate from one probe's held memory
    scatter_gb: float = 0.0  # the residuals' standard deviation (0 until 3 points)
    mean_batch: float = 0.0
    spread: float = 0.0  # sum of squared distances of the points' batch sizes from their mean

    def peak_gb(self, batch_size: float) -> float:
        return self.intercept_gb + self.slope_gb_per_sample * batch_size

    def uncertainty(self, batch_size: float, limit_gb: float) -> float:
        """How far, in samples, the predicted boundary may be off: the scatter of the
        measured peaks (0.5% of the memory range until there are 3 points to measure it),
        grown by how far the prediction reaches past the points (a line's leverage)."""
        if self.slope_gb_per_sample <= 0 or self.points < 2:
            return math.inf
        scatter = self.scatter_gb if self.points >= 3 else 0.005 * (limit_gb - self.intercept_gb)
        leverage = math.sqrt(1 / self.points + (batch_size - self.mean_batch) ** 2 / self.spread)
        return scatter * leverage / self.slope_gb_per_sample

    def largest_batch_under(self, limit_gb: float) -> float:
        if self.slope_gb_per_sample <= 0:
            return math.inf
        return (limit_gb - self.intercept_gb) / self.slope_gb_per_sample


def fit_memory(outcomes: Sequence[Outcome]) -> MemoryModel | None:
    """Least squares over the probes that fit. From a single probe, the slope is estimated
    as its peak minus its held memory per sample, which overstates it (the peak also holds
    gathered parameters and communication buffers), so the first prediction errs low and
    the second probe lands safely, far enough from the first to fit a real line."""
    points = [(o.batch_size, o.peak_gb) for o in outcomes if o.fits and o.peak_gb is not None]
    if len({b for b, _ in points}) >= 2:
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        var = sum((b - mean_b) ** 2 for b, _ in points)
        slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / var
        intercept = mean_p - slope * mean_b
        residuals = sum((p - intercept - slope * b) ** 2 for b, p in points)
        scatter = math.sqrt(residuals / (n - 2)) if n > 2 else 0.0
        return MemoryModel(intercept, slope, n, scatter, mean_b, var)
    first = next((o for o in outcomes if o.fits and o.peak_gb is not None and o.held_gb is not None), None)
    if first is None:
        return None
    slope = max(first.peak_gb - first.held_gb, 0.0) / first.batch_size
    return MemoryModel(first.peak_gb - slope * first.batch_size, slope, 1)


@dataclass
class BatchSearch:
    limit_gb: float
    resolution: int = 1
    up_to: int = 4096

    def __post_init__(self) -> None:
        self.up_to = max(self.resolution, self.up_to // self.resolution * self.resolution)

    def bracket(self, outcomes: Sequence[Outcome]) -> tuple[int, int | None]:
        """(largest size that fit below the smallest that did not, smallest that did not)."""
        failed = [o.batch_size for o in outcomes if not o.fits]
        hi = min(failed) if failed else None
        fit = [o.batch_size for o in outcomes if o.fits and (hi is None or o.batch_size < hi)]
        return max(fit, default=0), hi

    def next_size(self, outcomes: Sequence[Outcome]) -> int | None:
        """The batch size to probe next, or None when the boundary is known (or the
        smallest size does not fit at all)."""
        r = self.resolution
        if not outcomes:
            return r
        lo, hi = self.bracket(outcomes)
        top = hi if hi is not None else self.up_to + r  # the first size known not to fit
        if lo == 0 or lo >= self.up_to or top - lo <= r:
            return None
        model = fit_memory(outcomes)
        trusted = model is not None and model.slope_gb_per_sample > 0 and (model.points >= 2 or hi is None)
        if not trusted:
            return self._middle(lo, top, geometric=True)
        assert model is not None
        predicted = model.largest_batch_under(self.limit_gb)
        guess = min(self.up_to, math.floor(predicted / r) * r) if math.isfinite(predicted) else self.up_to
        # How far off the prediction may be, on the grid; a step of at least one size.
        error = model.uncertainty(predicted, self.limit_gb) if model.points >= 2 else 0.0
        step = max(r, math.floor(min(error, self.up_to) / r) * r)
        middle = self._middle(lo, top, geometric=model.points < 2)
        if lo < guess < top:
            if guess - lo > 4 * step:  # far out: aim short by the uncertainty, so the probe
                return guess - step + r  # likely fits and sharpens the fit near the boundary
            return guess
        if guess <= lo:  # more fits than predicted: step past the last size that fit, doubling
            above = sum(1 for o in outcomes if o.fits and o.batch_size > predicted)
            return min(lo + r * 2 ** max(0, above - 1), middle)
        # The prediction did not fit: step back from it, doubling, but never past the middle.
        below = sum(1 for o in outcomes if not o.fits and o.batch_size <= predicted)
        return max(top - step * 2 ** max(0, below - 1), middle)

    def _middle(self, lo: int, top: int, geometric: bool) -> int:
        """A size strictly between lo and top on the grid: halfway, or halfway in log scale
        while the scale is unknown."""
        r = self.resolution
        mid = math.sqrt(lo * top) if geometric else (lo + top) / 2
        return min(max(round(mid / r) * r, lo + r), top - r)


def recommended_size(model: MemoryModel | None, limit_gb: float, margin: float, boundary: int, resolution: int) -> int:
    """The largest size at most `boundary` that the memory model keeps `margin` of the limit
    below; without a model, `margin` of the boundary."""
    if model is not None and model.slope_gb_per_sample > 0:
        size = model.largest_batch_under((1 - margin) * limit_gb)
    else:
        size = boundary * (1 - margin)
    size = math.floor(size / resolution) * resolution
    return max(resolution, min(boundary, size)) if boundary >= resolution else boundary
