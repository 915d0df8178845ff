"""The batch-size search on memory curves with a known boundary.

The probes here are the memory curve itself (peak = intercept + slope * batch, with or without
measurement noise), so the search's answers and probe counts can be checked against the
exact boundary. The real probes, on real ranks, are in test_max_batch.py.
"""

from __future__ import annotations

import math
import random

import pytest

from fsdp_exp.tasks.batch_search import (
    BatchSearch,
    MemoryModel,
    Outcome,
    fit_memory,
    recommended_size,
)

LIMIT_GB = 3.0
INTERCEPT_GB = 1.0


def curve(boundary: float, held_share: float = 1.0, noise_samples: float = 0.0, seed: int = 0):
    """A memory curve that crosses LIMIT_GB just after `boundary`. `held_share`: held memory as
    a share of the peak's intercept (1.0: held equals the peak at batch 1, as on CPU)."""
    slope = (LIMIT_GB - INTERCEPT_GB) / (boundary + 0.5)
    rng = random.Random(seed)

    def probe(size: int) -> Outcome:
        peak = INTERCEPT_GB + slope * size
        if peak > LIMIT_GB:
            return Outcome(size, False)
        measured = peak + rng.gauss(0, noise_samples * slope)
        held = INTERCEPT_GB * held_share if held_share < 1 else measured
        return Outcome(size, True, measured, held)

    return probe


def search(probe, resolution: int = 1, up_to: int = 4096) -> tuple[int, list[Outcome]]:
    finder = BatchSearch(LIMIT_GB, resolution, up_to)
    outcomes: list[Outcome] = []
    while (size := finder.next_size(outcomes)) is not None:
        assert size % resolution == 0 or size == resolution
        assert size not in [o.batch_size for o in outcomes], "probed the same size twice"
        outcomes.append(probe(size))
        assert len(outcomes) < 40, "the search does not end"
    return finder.bracket(outcomes)[0], outcomes


def doubling_then_bisection(boundary: int) -> int:
    """Probes the usual finder needs: 1, 2, 4, ... until one fails, then bisection."""
    count, size = 0, 1
    while size <= boundary:
        count, size = count + 1, size * 2
    lo, hi = size // 2, size
    count += 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        count += 1
        lo, hi = (mid, hi) if mid <= boundary else (lo, mid)
    return count


BOUNDARIES = [1, 2, 3, 7, 8, 9, 31, 63, 64, 65, 100, 255, 256, 500, 1000, 1023, 2047, 3000, 4000, 4095]


@pytest.mark.parametrize("held_share", [1.0, 0.6])
def test_the_exact_boundary_in_six_probes_or_fewer(held_share):
    for boundary in BOUNDARIES:
        found, outcomes = search(curve(boundary, held_share))
        assert found == boundary
        assert len(outcomes) <= 6, (boundary, [(o.batch_size, o.fits) for o in outcomes])


def test_fewer_probes_than_doubling_and_bisection():
    ours = sum(len(search(curve(b))[1]) for b in BOUNDARIES)
    theirs = sum(doubling_then_bisection(b) for b in BOUNDARIES)
    assert ours < 0.5 * theirs, (ours, theirs)


@pytest.mark.parametrize("noise_samples", [1.0, 8.0])
def test_noisy_memory_still_gives_the_exact_boundary(noise_samples):
    """Measured peaks scatter (CPU resident memory by a few MB); the answer must not."""
    for seed, boundary in enumerate([5, 50, 443, 1200, 3000]):
        found, outcomes = search(curve(boundary, noise_samples=noise_samples, seed=seed))
        assert found == boundary
        assert len(outcomes) <= 12, (boundary, [(o.batch_size, o.fits) for o in outcomes])


def test_answers_are_multiples_of_the_resolution_and_exact_to_it():
    for boundary in [9, 100, 1000, 4000]:
        found, outcomes = search(curve(boundary), resolution=8)
        assert found == boundary // 8 * 8
        sizes = {o.batch_size: o.fits for o in outcomes}
        assert sizes[found] and not sizes[found + 8]


def test_the_search_stops_at_its_upper_end():
    found, outcomes = search(curve(100_000), up_to=4096)
    assert found == 4096
    assert max(o.batch_size for o in outcomes) == 4096
    assert len(outcomes) <= 3


def test_nothing_fits_stops_after_the_first_probe():
    finder = BatchSearch(LIMIT_GB, resolution=1)
    assert finder.next_size([]) == 1
    outcomes = [Outcome(1, False)]
    assert finder.next_size(outcomes) is None
    assert finder.bracket(outcomes) == (0, 1)


def test_a_failed_probe_bounds_the_search_like_an_oom():
    finder = BatchSearch(LIMIT_GB)
    outcomes = [Outcome(1, True, 1.0, 1.0), Outcome(64, True, 1.1, 1.1), Outcome(100, False)]
    assert finder.bracket(outcomes) == (64, 100)
    assert 64 < finder.next_size(outcomes) < 100


def test_the_fit_is_least_squares_and_one_probe_overstates_the_slope():
    model = fit_memory([Outcome(1, True, 1.002, 1.0), Outcome(101, True, 1.202, 1.1), Outcome(51, True, 1.102, 1.0)])
    assert model.points == 3
    assert model.slope_gb_per_sample == pytest.approx(0.002)
    assert model.intercept_gb == pytest.approx(1.0)
    one = fit_memory([Outcome(4, True, 1.2, 1.0)])
    assert one.points == 1 and one.slope_gb_per_sample == pytest.approx(0.05)


def test_the_recommended_size_keeps_the_margin_free():
    model = MemoryModel(intercept_gb=1.0, slope_gb_per_sample=0.01, points=3)
    size = recommended_size(model, limit_gb=3.0, margin=0.1, boundary=199, resolution=1)
    assert model.peak_gb(size) <= 0.9 * 3.0 < model.peak_gb(size + 1)
    assert recommended_size(model, 3.0, 0.0, boundary=150, resolution=1) == 150  # never above the boundary
    assert recommended_size(None, 3.0, 0.25, boundary=100, resolution=8) == 72
    assert math.isinf(MemoryModel(1.0, 0.0, 2).largest_batch_under(3.0))
