"""What task=tune concludes from its measurements, as pure functions: how fast a setup could
still get, whether it can still win, and the ranked table. Nothing here runs.

A setup's speed is samples/s at its fastest batch under the limit. Its bound: a step at a
larger batch takes at least as long as one at a smaller, so at batch B a setup measured at
batch b trains at most samples_per_s(b) * B / b. With B the largest batch the setup can
reach under the limit (the estimate's, widened by its error), a setup whose bound is below
the best measured speed, less the noise between runs, cannot win and is not searched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# samples/s of one setup at one batch moves by about this between runs (docs/BENCHMARKS.md):
# a bound this far below the best still searches, a measured speed this close to the best ties.
SPEED_NOISE = 0.05
MEAN = "; samples/s the mean of "  # a row's `how`, where its speed is the mean of its runs at its batch

STATUSES = ("measured", "bounded", "predicted", "pruned", "does not fit", "refused", "failed", "not reached")


@dataclass
class Row:
    """One setup's line of tune.json."""

    setup: str  # its overrides
    overrides: list[str]
    status: str = "not reached"  # one of STATUSES
    how: str = ""  # how it was settled, in words
    batch_size: int | None = None  # per rank: the fastest measured under the limit (bounded: the one probe's)
    grad_accum: int = 1
    max_batch_size: int | None = None  # the largest that fits (measured rows)
    samples_per_s: float | None = None
    predicted_samples_per_s: float | None = None  # the speed model's, by the other setups' probes (tune.json's speed_model)
    step_s: float | None = None  # with task.global_batch: the time of one optimizer step
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gb: float | None = None  # at batch_size, as the limit counts it
    headroom_gb: float | None = None  # the limit less peak_gb
    estimated_max_batch: int | None = None  # where the estimate puts the largest batch
    bound_samples_per_s: float | None = None  # the most it could reach under the limit (predicted: by the model)
    probes: int = 0
    dir: str = ""
    winner: bool = False
    confirmed: bool | None = None  # its printed command line, run for the run's length: completed, or not; None: not run
    confirmed_samples_per_s: float | None = None  # that run's: what the command line as printed trains at

    def to_json(self) -> dict:
        return asdict(self)


def speed_bound(samples_per_s: float, batch_size: int, largest: float) -> float:
    """The most samples/s a setup measured at `batch_size` can reach at any batch up to `largest`."""
    return samples_per_s * max(largest, batch_size) / batch_size


def can_win(bound: float, best: float | None, noise: float = SPEED_NOISE) -> bool:
    """Whether a setup that can reach `bound` samples/s can still beat `best`, measured within `noise`."""
    return best is None or bound >= best * (1 - noise)


def between_runs(readings: dict[tuple[str, int], list[float]]) -> float | None:
    """How far samples/s moved between runs of one setup at one batch (keyed so), the largest
    spread over their mean; None where no setup ran twice at one batch."""
    spreads = [(max(r) - min(r)) / (sum(r) / len(r)) for r in readings.values() if len(r) > 1]
    return max(spreads, default=None)


def mean_of_runs(row: Row, speeds: list[float], words: str = "") -> None:
    """A measured row's speed (tokens/s, MFU and step time alike) as the mean of `speeds`, its
    runs at its batch, where it has more than one; its `how` says how many (once)."""
    if len(speeds) < 2 or not row.samples_per_s:
        return
    mean = sum(speeds) / len(speeds)
    scale, row.samples_per_s = mean / row.samples_per_s, mean
    row.tokens_per_s = None if row.tokens_per_s is None else row.tokens_per_s * scale
    row.mfu = None if row.mfu is None else row.mfu * scale
    row.step_s = None if row.step_s is None else row.step_s / scale
    row.how = row.how.split(MEAN)[0] + f"{MEAN}{len(speeds)} runs{words}"


def ranked(rows: list[Row]) -> list[Row]:
    """Measured rows by samples/s, fastest first; then bounded by their bound; then the rest
    in the order of STATUSES."""
    def key(row: Row) -> tuple:
        speed = row.samples_per_s if row.status == "measured" else row.bound_samples_per_s
        return STATUSES.index(row.status), -(speed or 0.0)
    return sorted(rows, key=key)


def winner(rows: list[Row]) -> Row | None:
    """The fastest measured setup whose command line, when it was run, completed."""
    measured = [r for r in rows if r.status == "measured" and r.samples_per_s and r.confirmed is not False]
    return max(measured, key=lambda r: r.samples_per_s or 0.0, default=None)


def ties(rows: list[Row], best: Row, noise: float = SPEED_NOISE) -> list[Row]:
    """The measured setups within `noise` of the winner: as fast, as far as runs can tell."""
    return [r for r in rows if r is not best and r.status == "measured" and r.samples_per_s
            and best.samples_per_s and r.samples_per_s >= best.samples_per_s * (1 - noise)]


def table(rows: list[Row], tokens: bool, confirmed: bool = True) -> str:
    """The ranked rows as a markdown table; the winner's row says so, and says when its
    command line was not confirmed by a run of it (`confirmed`)."""
    marker = " (winner)" if confirmed else " (winner, NOT CONFIRMED)"
    mfu = any(r.mfu is not None for r in rows)  # where the device's peak FLOP/s is known
    step = any(r.step_s is not None for r in rows)  # task.global_batch
    predicted = any(r.predicted_samples_per_s is not None for r in rows)  # the speed model's, held out
    again = any(r.confirmed_samples_per_s is not None for r in rows)  # the winner's command line, run
    head = ["#", "setup", "batch", *(["step s"] if step else []), "samples/s", *(["confirmed"] if again else []),
            *(["predicted"] if predicted else []),
            *(["tokens/s"] if tokens else []),
            *(["MFU"] if mfu else []), "peak GB", "headroom GB", "probes", "how"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(ranked(rows), 1):
        batch = "" if r.batch_size is None else f"{r.batch_size}" + (f" x {r.grad_accum}" if r.grad_accum > 1 else "")
        cells = [str(i) + (marker if r.winner else ""), r.setup, batch, *([fmt(r.step_s, ".3f")] if step else []),
                 fmt(r.samples_per_s, ",.1f"), *([fmt(r.confirmed_samples_per_s, ",.1f")] if again else []),
                 *([fmt(r.predicted_samples_per_s, ",.1f")] if predicted else []),
                 *([fmt(r.tokens_per_s, ",.0f")] if tokens else []), *([fmt(r.mfu, ".1%")] if mfu else []),
                 fmt(r.peak_gb, ".3f"),
                 fmt(r.headroom_gb, ".3f"), str(r.probes), f"{r.status}: {r.how}" if r.how else r.status]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)
