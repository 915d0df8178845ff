"""The estimate's peak as a curve over the batch size: where it reaches a limit, and moved
through measured points (task=max_batch's probes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

Point = tuple[int, float]  # (batch size, peak GB)
FLAT = 0.002  # peaks within this share of the first one's are the flat start


@dataclass(frozen=True)
class PeakCurve:
    """The peak by batch size as task=estimate predicts it (`points`: batch size, GB):
    straight between the traced sizes, flat below the first, and past the last along the
    line through the last two. task=max_batch moves it through its probes (`through`), so a
    constant the trace does not see costs nothing there, and only its shape (the flat
    start, the knee, the growth) places the probes."""

    points: tuple[Point, ...]
    scaled: bool = False  # its growth was set by two probes

    def peak_gb(self, batch_size: float) -> float:
        (b0, p0), (b1, p1) = self._segment(batch_size)
        if batch_size <= self.points[0][0] or b1 == b0:
            return self.points[0][1]
        return p0 + (p1 - p0) * (batch_size - b0) / (b1 - b0)

    def slope_at(self, batch_size: float) -> float:
        (b0, p0), (b1, p1) = self._segment(batch_size)
        return 0.0 if batch_size < self.points[0][0] or b1 == b0 else (p1 - p0) / (b1 - b0)

    def _segment(self, batch_size: float) -> tuple[Point, Point]:
        pts = self.points
        if len(pts) == 1:
            return pts[0], pts[0]
        k = next((i for i in range(1, len(pts)) if batch_size <= pts[i][0]), len(pts) - 1)
        return pts[k - 1], pts[k]

    def through(self, first: Point, anchor: Point) -> PeakCurve:
        """The curve moved to pass through `anchor`, the largest probe that fit, and, when
        the curve grows between them, its growth scaled to pass through `first` too."""
        grown = self.peak_gb(anchor[0]) - self.peak_gb(first[0])
        measured = anchor[1] - first[1]
        scale = measured / grown if grown > FLAT * self.peak_gb(first[0]) and measured > 0 else None
        if scale is not None and not 0.5 <= scale <= 2:  # not the same curve: the trace's growth stands
            scale = None
        at = self.peak_gb(anchor[0])
        moved = tuple((b, anchor[1] + (scale or 1.0) * (p - at)) for b, p in self.points)
        return PeakCurve(moved, scale is not None)

    def crossing(self, target_gb: float) -> float:
        """The largest batch under `target_gb` (infinite when the curve never reaches it)."""
        pts = self.points
        if pts[0][1] > target_gb:
            return 0.0
        for (b0, p0), (b1, p1) in zip(pts, pts[1:]):
            if p1 > target_gb:
                return b0 + (target_gb - p0) * (b1 - b0) / (p1 - p0)
        if len(pts) < 2 or pts[-1][1] <= pts[-2][1]:
            return math.inf
        (b0, p0), (b1, p1) = pts[-2], pts[-1]
        return b1 + (target_gb - p1) * (b1 - b0) / (p1 - p0)
