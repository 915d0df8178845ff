"""Where the batch size meets the memory limit, in few probes.

This module only decides which batch size to try next; it runs nothing. Every size is a
multiple of `resolution`, and the answer is exact to it: the boundary trained and the
boundary plus `resolution` did not.

Why it is so, and how many probes it takes on each shape of peak: docs/max_batch.md, "How
the search picks its probes". The rules, with the constants below:

1. With the estimate's curve (step 6), the first probe is where the curve leaves LEVEL_ERROR of the limit free. Without it, or when the curve puts nothing there, the first probe
   is `resolution`; when it runs out of memory, nothing fits. When it fails
   for another reason (BatchNorm needs more than one value per channel to train), the size
   may be too small to train: the search doubles it, up to START_TRIES times, and starts
   from the first size that trains; the sizes below it are too small, not out of memory.
2. The probes that fit split into a flat start (peaks within FLAT of the first one's) and the
   probes past it, where the peak grows. The activation line is fit to the growing ones only:
   - two or more: least squares over the top run of them that lie on one line (within
     ON_LINE of their peaks). When only the top one is off a line of three or more, and
     above it, that is a step: the line keeps its slope and passes through the top probe.
   - one: the line from the last flat probe to it. The knee lies between the two, so past
     the growing probe the curve is at least as steep and the line's crossing is an upper
     bound of the boundary. The search probes halfway to that bound in log scale, where a
     size that fits gives a second point past the knee.
   - none: no line.
3. While no size has failed, the scale is unknown: the search probes halfway in log scale
   between the largest size that fit and `up_to`, or the line's prediction when that is
   nearer. The line's prediction is taken beyond that halfway point only once the line has
   risen by at least 1/REACH of what is left up to the limit.
4. Once a size has failed, the search probes the line's prediction: just below it, where a
   size that fits adds a point, or just above it when a size below would gain nothing. It
   bisects instead (in log scale while the bracket spans more than a factor of 4): without
   a line, when the line says that the size that failed fits, after two probes in a row that
   went against the line, and when four probes did not halve the bracket. After a probe
   went against the line, the prediction is widened by the error that MISS_NOISE of
   measurement noise would give, doubled for each further one.
5. Near the end, where the bracket spans at most NEAR_THE_END times what the peaks' noise
   lets the line place (a line of three or more points; the noise is the widest of the
   residuals' scatter, half the noise band and SPLIT_NOISE of the peak), the boundary is
   taken to lie around the line's crossing with that spread (normal, truncated to the
   bracket, widened when the crossing lies outside it) and the search probes where it is as
   likely above as below. A prediction that noise made a few samples too high then costs
   a split, not a walk down one size at a time. When the size that failed lies below the
   crossing by more than that spread, the line is off, not noisy (on GPU, where the line is
   the allocated peak's, fragmentation runs out before it meets the limit): the search bisects.
6. With the estimate's curve (`PeakCurve`, task=max_batch's task.estimate, traced before
   the first probe when `memory.limit_gb` is set, else once the first probe has told the
   device's memory): the first probe lands near the boundary, below it by what the
   estimate's level may be off (under the limit, the 34 rows of bench/estimate_accuracy.py
   are within 5%). It sets the curve's level where the curve's growth has
   little way to err. When that first size does not train, the search starts again at
   `resolution`. The curve, moved through the largest probe that fit, then places the next
   probe at its crossing; from the first probe alone, GROWTH_ERROR short of it, since
   the trace's growth is a few percent below a run's (1% to 8% on bench/estimate_accuracy.py's
   rows, never above). Its growth is scaled to the probes' once they span PRIOR_SPAN times their noise. It places probes until a size has failed and that span is there,
   or, before any size fails, for as long as the probes' growth stays within a factor 2 of
   its own. This replaces step 3 and the one-probe line of step 2. After a miss the next
   probe is PRIOR_ERROR of the way back; after two misses the curve is left.
   On the simulated families it ends in 3 probes or fewer when the curve is off by a
   constant within LEVEL_ERROR (2 when the first size is the boundary), in 5 or fewer when
   it is off by twice that or its growth is 10% off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from fsdp_exp.estimate.curve import FLAT, PeakCurve, Point

ON_LINE = 0.005  # probes within this share of their peak from a line lie on it
REACH = 64  # a line is followed at most this many times its rise so far
MISS_NOISE = 0.003  # after a miss, the prediction is widened by what this noise in peaks gives
SPLIT_NOISE = 0.0005  # near the end, peaks scatter by at least this share, when the probes show less
PRIOR_ERROR = 0.1  # the estimate's growth from a probe to the limit may be off by this share (docs/BENCHMARKS.md)
# The estimate's level may be low by this share of the limit (under memory.limit_gb, bench/estimate_accuracy.py's
# 34 rows are 0.951 to 1.011 of the runs): its first probe aims this far below the limit.
LEVEL_ERROR = 0.05
GROWTH_ERROR = 0.05  # the trace's growth per sample is within this share of a run's (bench/estimate_accuracy.py)
PRIOR_SPAN = 10  # probes whose peaks span less than this many times their noise leave the estimate's growth standing
START_TRIES = 3  # doublings of the first size tried when it fails for a reason other than memory
NEAR_THE_END = 16  # a bracket within this many times the line's noise, in samples, is split where the boundary is as likely above as below


@dataclass(frozen=True)
class Outcome:
    """What one probe showed: whether the batch fit, and for one that did, its memory."""

    batch_size: int
    fits: bool
    peak_gb: float | None = None  # the largest peak over the ranks, as the search judges it
    held_gb: float | None = None  # held between steps: parameters and optimizer state
    failed_otherwise: bool = False  # did not train, for a reason other than memory or a timeout


def too_small(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The probes below the smallest size that trained which failed for a reason other than
    memory: sizes too small to train (BatchNorm at batch 1), which the search starts above.
    Before any size has trained, every such failure."""
    first = min((o.batch_size for o in outcomes if o.fits), default=math.inf)
    return [o for o in outcomes if o.failed_otherwise and o.batch_size < first]


def _searched(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The probes the search reads: all but those too small to train."""
    small = {id(o) for o in too_small(outcomes)}
    return [o for o in outcomes if id(o) not in small]


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

    def largest_batch_under(self, limit_gb: float) -> float:
        if self.slope_gb_per_sample <= 0:
            return math.inf
        return (limit_gb - self.intercept_gb) / self.slope_gb_per_sample

    def uncertainty(self, batch_size: float, noise_gb: float) -> float:
        """How far, in samples, the line's crossing at `batch_size` may be off when the
        measured peaks scatter by `noise_gb`: grown by how far it reaches past its points."""
        if self.slope_gb_per_sample <= 0 or self.points < 2:
            return math.inf
        leverage = math.sqrt(1 / self.points + (batch_size - self.mean_batch) ** 2 / self.spread)
        return noise_gb * leverage / self.slope_gb_per_sample




def _line(points: Sequence[Point]) -> MemoryModel:
    """Least squares through at least two points of different batch sizes."""
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / spread
    intercept = mean_p - slope * mean_b
    residuals = sum((p - intercept - slope * b) ** 2 for b, p in points)
    scatter = math.sqrt(residuals / (n - 2)) if n > 2 else 0.0
    return MemoryModel(intercept, slope, n, scatter, mean_b, spread)


def _peaks(outcomes: Sequence[Outcome], below: int | None = None) -> list[Point]:
    """The probes that trained below `below` (default: below the smallest that did not),
    one point per batch size (repeats averaged). A probe that trained above the search's
    limit (inside the noise band under the memory limit) does not fit, but its peak is as
    good a point of the curve as any."""
    if below is None:
        below = min((o.batch_size for o in outcomes if not o.fits), default=None)
    seen: dict[int, list[float]] = {}
    for o in outcomes:
        if o.fits and o.peak_gb is not None and (below is None or o.batch_size < below):
            seen.setdefault(o.batch_size, []).append(o.peak_gb)
    return sorted((b, sum(p) / len(p)) for b, p in seen.items())


def _on_one_line(points: Sequence[Point]) -> list[Point]:
    """The longest run of the top points (at least two) that lie on one line."""
    run = list(points[-2:])
    for k in range(3, len(points) + 1):
        line = _line(points[-k:])
        if any(abs(p - line.peak_gb(b)) > ON_LINE * p for b, p in points[-k:]):
            break
        run = list(points[-k:])
    return run


def _activation_line(points: Sequence[Point]) -> tuple[MemoryModel | None, int]:
    """The line the peak follows where it grows with the batch, and how many probes grow
    (see the module's docstring); (None, 0) while the peak is flat."""
    flat = 1
    while flat < len(points) and points[flat][1] <= points[0][1] * (1 + FLAT):
        flat += 1
    growing = points[flat:]
    if not growing:
        return None, 0
    if len(growing) == 1:
        return _line([points[flat - 1], growing[0]]), 1
    run = _on_one_line(growing)
    if len(run) == 2 and len(growing) >= 3:
        below = _on_one_line(growing[:-1])
        b, p = growing[-1]
        if len(below) >= 3:
            line = _line(below)
            if line.slope_gb_per_sample > 0 and p > line.peak_gb(b) * (1 + ON_LINE):
                return MemoryModel(p - line.slope_gb_per_sample * b, line.slope_gb_per_sample, line.points,
                                   line.scatter_gb, line.mean_batch, line.spread), len(growing)
    return _line(run), len(growing)


def fit_memory(outcomes: Sequence[Outcome]) -> MemoryModel | None:
    """The activation line through the probes that fit below the smallest that did not;
    while the peak is still flat, least squares through them all. From a single probe, the
    slope is estimated as its peak minus its held memory per sample."""
    outcomes = _searched(outcomes)
    points = _peaks(outcomes)
    line, _ = _activation_line(points)
    if line is not None:
        return line
    if len(points) >= 2:
        return _line(points)
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
    # A probe that trained with less room than this under the limit does not fit (runs of
    # one setup vary by that much), and the line aims at the limit less it.
    noise_gb: float = 0.0
    prior: PeakCurve | None = None  # the estimate's curve, which places probes until two of them show the growth

    def __post_init__(self) -> None:
        self.up_to = max(self.resolution, self.up_to // self.resolution * self.resolution)

    def bracket(self, outcomes: Sequence[Outcome]) -> tuple[int, int | None]:
        """(largest size that fit below the smallest that did not, smallest that did not)."""
        outcomes = _searched(outcomes)
        failed = [o.batch_size for o in outcomes if not self._fits(o)]
        hi = min(failed) if failed else None
        fit = [o.batch_size for o in outcomes if self._fits(o) and (hi is None or o.batch_size < hi)]
        return max(fit, default=0), hi

    def next_size(self, outcomes: Sequence[Outcome]) -> int | None:
        """The batch size to probe next, or None when the boundary is known (or the
        smallest size does not fit at all)."""
        small = too_small(outcomes)
        if self._from_the_smallest(outcomes):  # the estimate's first size did not train: start again at the smallest
            return self.resolution
        if small and len(small) == len(outcomes):  # nothing has trained, nor run out of memory
            larger = 2 * max(o.batch_size for o in small)
            return larger if len(small) <= START_TRIES and larger <= self.up_to else None
        outcomes = _searched(outcomes)
        # The safeguards count how earlier predictions fared, so replay the decisions that led here.
        expected: list[tuple[str, bool]] = []
        for k in range(len(outcomes)):
            by_prior = self._prior_places(outcomes[:k], expected)
            size, expect = self._decide(outcomes[:k], expected, by_prior)
            expected.append((expect, by_prior) if size == outcomes[k].batch_size else ("", False))
        return self._decide(outcomes, expected, self._prior_places(outcomes, expected))[0]

    def first_size(self) -> tuple[int, str]:
        """The first probe: with the estimate's curve, where it crosses the limit less
        LEVEL_ERROR of it (the size predicted to fit with that to spare: the probe sets the
        curve's level near the boundary, where an error in its growth moves the next
        prediction least); without it, or when it puts nothing under that, `resolution`."""
        r = self.resolution
        if self.prior is None:
            return r, ""
        target = self.limit_gb - self.noise_gb - LEVEL_ERROR * self.limit_gb
        crossing = min(self.prior.crossing(target), self.up_to)  # a curve that never reaches it: up_to
        if crossing < 2 * r:
            return r, ""
        return math.floor(crossing / r) * r, "fit"

    def _from_the_smallest(self, outcomes: Sequence[Outcome]) -> bool:
        """Whether the estimate's first size failed (out of memory, or otherwise) before
        any size trained, and the smallest size is yet to be tried."""
        r = self.resolution
        return (bool(outcomes) and not any(o.fits for o in outcomes) and outcomes[0].batch_size > r
                and all(o.batch_size != r for o in outcomes) and self.first_size()[0] == outcomes[0].batch_size)

    def _prior_places(self, outcomes: Sequence[Outcome], expected: list[tuple[str, bool]]) -> bool:
        """Whether the estimate's curve places the next probe: until two probes past the
        flat start show the growth, and until it has missed twice."""
        if self.prior is None or not outcomes:
            return False
        lo, hi = self.bracket(outcomes)
        points = _peaks(outcomes)
        _, growing = _activation_line(points)
        misses = sum(by and self._missed(e, o) for (e, by), o in zip(expected, outcomes))
        if misses >= 2 or not any(b <= lo for b, _ in points):
            return False
        if growing < 2 or not self._rise_shown(points):
            return True
        # Until a size fails the probes, placed by it near the boundary, are too close for a line
        # of their own: it goes on, scaled to their growth, while that is within a factor 2 of its own.
        anchor = next(p for p in reversed(points) if p[0] <= lo)
        grown = self.prior.peak_gb(anchor[0]) - self.prior.peak_gb(points[0][0])
        return hi is None and grown > 0 and 0.5 <= (anchor[1] - points[0][1]) / grown <= 2

    def _rise_shown(self, points: Sequence[Point]) -> bool:
        """Whether the probes span enough of the growth to measure it better than the
        estimate: PRIOR_SPAN times the noise of their peaks. Probes a few samples apart near
        the boundary (the estimate's first size and the next) do not: a line through them
        is mostly noise."""
        if len(points) < 2:
            return False
        noise = max(self.noise_gb, SPLIT_NOISE * points[-1][1])
        return points[-1][1] - points[0][1] >= PRIOR_SPAN * noise

    def _missed(self, expect: str, outcome: Outcome) -> bool:
        return (expect == "fit" and not self._fits(outcome)) or (expect == "fail" and self._fits(outcome))

    def _decide(self, outcomes: Sequence[Outcome], expected: list[tuple[str, bool]],
                by_prior: bool) -> tuple[int | None, str]:
        """The next size, and what the line (or with `by_prior` the estimate's curve) expects
        of it: "fit", "fail", or "" (a bisection)."""
        r = self.resolution
        if not outcomes:
            return self.first_size()
        if self._from_the_smallest(outcomes):
            return r, ""
        lo, hi = self.bracket(outcomes)
        top = hi if hi is not None else self.up_to + r  # the first size known not to fit
        if lo == 0 or lo >= self.up_to or top - lo <= r:
            return None, ""
        halfway = math.sqrt(lo * top) if top > 4 * lo else (lo + top) / 2
        bisect = self._on_grid(halfway, lo, top, round), ""
        points = _peaks(outcomes)
        line, growing = _activation_line(points)
        target_gb = self.limit_gb - self.noise_gb
        if by_prior and self.prior is not None:
            anchor = next(p for p in reversed(points) if p[0] <= lo)
            # The estimate's curve, through the largest size that fit: it knows the scale,
            # the flat start and the knee, which the probes would spend their first sizes on.
            curve = self.prior.through(points[0] if self._rise_shown(points) else anchor, anchor)
            crossing = min(curve.crossing(target_gb), top)
            below = above = crossing
            if len(points) == 1:  # from the first probe, the growth is the trace's: aim short by what that may be off
                below = crossing - GROWTH_ERROR * max(crossing - anchor[0], 0.0)
            slope = curve.slope_at(crossing)
            # Moved through one probe, the curve's growth is the trace's, which may be off by PRIOR_ERROR.
            miss_error = (MISS_NOISE * anchor[1] / slope if slope > 0 else 0.0) if curve.scaled else \
                PRIOR_ERROR * max(crossing - anchor[0], 0.0)
            line = None
        else:
            if line is None or line.slope_gb_per_sample <= 0:
                return bisect
            crossing = line.largest_batch_under(target_gb)
            last_b, last_peak = points[-1]
            if growing == 1:  # halfway, in log scale, to the bound the line from the knee gives
                bound = min(crossing, top)
                below = above = bound if bound - last_b <= 4 * r else math.sqrt(last_b * bound)
                miss_error = 0.0
            else:
                error = line.uncertainty(crossing, line.scatter_gb) if line.points >= 3 else 0.0
                below, above = crossing - error, crossing + error
                miss_error = line.uncertainty(crossing, max(line.scatter_gb, MISS_NOISE * last_peak))
            if hi is None:
                risen = last_peak - points[0][1] >= (target_gb - last_peak) / REACH
                if not risen:
                    return self._on_grid(min(below, math.sqrt(lo * top)), lo, top, round), ""
        misses = 0
        for (expect, _), o in zip(reversed(expected), reversed(outcomes)):
            if not self._missed(expect, o):
                break
            misses += 1
        widen = max(r, miss_error) * 2 ** (misses - 1) if misses else 0.0
        below, above = below - widen, above + widen
        if hi is not None and line is not None and line.points >= 3:  # near the end, where the peaks' noise blurs the line
            # The residuals of a few points understate their scatter, by 1 + 1/(degrees of freedom) here.
            scatter = max(line.scatter_gb * (1 + 1 / (line.points - 2)), self.noise_gb / 2, SPLIT_NOISE * points[-1][1])
            noise = line.uncertainty(crossing, scatter)
            # A size that failed though the line puts it under the limit by more than its noise
            # says something other than the line runs out first (on GPU, fragmentation: the
            # line is the allocated peak's): bisect, rather than split by a line that is off.
            if top - lo <= NEAR_THE_END * max(noise, r) and crossing - top <= max(noise, r):
                spread = max(noise, r / 2, 2 * (crossing - top), 2 * (lo - crossing))
                return self._splitting(lo, top, crossing, spread * 2 ** misses) or bisect
        if hi is not None and below >= top:  # the line says the size that failed fits
            return bisect
        if math.floor(below / r) * r >= lo + r + (above - below) / 2:
            choice = self._on_grid(below, lo, top), "fit"
        elif math.floor(above / r) * r + r < top:
            choice = self._on_grid(math.floor(above / r) * r + r, lo, top), "fail"
        else:
            return self._on_grid((lo + top) / 2, lo, top, round), ""
        if hi is None or choice == (lo + r, "fail"):  # the size that ends the search, or shows the line low
            return choice
        if misses >= 2 or not self._halved(outcomes, 4):
            return bisect
        return choice

    def _splitting(self, lo: int, top: int, crossing: float, spread: float) -> tuple[int, str] | None:
        """The size that splits in half where the boundary may be, between lo (fit) and top
        (did not), when the line puts it at `crossing` give or take `spread` samples (a normal
        distribution), and what the line expects of that size. None when the bracket lies so
        far out in the line's tail that the line says nothing about it."""
        low, high = (lo - crossing) / spread, (top - crossing) / spread
        flip = low > 0  # work in the tail the bracket is in, where its probabilities do not round off
        if flip:
            low, high = -high, -low
        normal = NormalDist()
        a, b = normal.cdf(low), normal.cdf(high)
        if b - a <= 0 or (a + b) / 2 <= 0:
            return None
        middle = normal.inv_cdf((a + b) / 2)
        size = crossing + spread * (-middle if flip else middle)
        choice = self._on_grid(size, lo, top, round)
        at = normal.cdf(-(choice - crossing) / spread if flip else (choice - crossing) / spread)
        fits = (at - a) / (b - a) if flip else (b - at) / (b - a)  # the chance it fits
        return choice, "fit" if fits >= 0.75 else "fail" if fits <= 0.25 else ""

    def _fits(self, outcome: Outcome) -> bool:
        """Trained, with the noise band to spare under the limit."""
        if not outcome.fits or not self.noise_gb or outcome.peak_gb is None:
            return outcome.fits
        return outcome.peak_gb <= self.limit_gb - self.noise_gb

    def _halved(self, outcomes: Sequence[Outcome], probes: int) -> bool:
        """Whether the last `probes` probes at least halved the bracket (True until there are that many)."""
        if len(outcomes) <= probes:
            return True

        def width(some: Sequence[Outcome]) -> int:
            lo, hi = self.bracket(some)
            return (hi if hi is not None else self.up_to + self.resolution) - lo
        return width(outcomes) <= width(outcomes[:-probes]) / 2

    def _on_grid(self, size: float, lo: int, top: int, rounding=math.floor) -> int:
        """`size` on the grid of `resolution`, strictly between lo and top."""
        r = self.resolution
        return min(max(rounding(size / r) * r, lo + r), top - r)


def recommended_size(model: MemoryModel | None, under_gb: float, margin: float, boundary: int, resolution: int) -> int:
    """The largest size at most `boundary` whose peak the memory model keeps under `under_gb`
    (the limit less its margin); without a model, `margin` of the boundary."""
    if model is not None and model.slope_gb_per_sample > 0:
        size = model.largest_batch_under(under_gb)
    else:
        size = boundary * (1 - margin)
    size = math.floor(size / resolution) * resolution
    return max(resolution, min(boundary, size)) if boundary >= resolution else boundary
