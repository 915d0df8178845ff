"""How fast a setup trains: what one step of a rank does (`StepWork`, from its trace: the
FLOPs it runs, recomputed ones too; the bytes its collectives send, by the sharding plan as
it ran; the bytes offload moves; the elements its optimizer updates) priced at this
machine's rates (`Rates`), calibrated from measured runs by least squares.

A step's time is the sum of its parts, each a count times seconds per unit, plus a cost
per step. What a sample costs beyond its matmuls (data, elementwise ops) grows with the
batch as the FLOPs do, so the FLOPs' rate takes it in: a rate is what this machine does,
not its peak. The rates are not negative, so a part no measured run varied costs nothing:
a prediction leans fast, never slow, until a run shows the cost. Light: no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy

# The parts of a step's time, in the order of `StepWork.parts`
PARTS = ("flops", "wire_bytes", "offload_bytes", "optimizer_params", "step")


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step of one rank does, traced at `batch_size` (a rank's batch)."""

    batch_size: int
    flops: float  # the FLOPs it ran, recomputed ones too
    wire_bytes: float  # what its collectives sent
    offload_bytes: float  # offload=true: shards in, gradients out
    optimizer_params: float  # the elements its optimizer updates
    world_size: int = 1  # the ranks that each train a batch

    def parts(self, batch_size: float) -> list[float]:
        """The step's counts at `batch_size`: the FLOPs grow with the batch, the rest of a
        step's traffic does not."""
        return [self.flops * batch_size / self.batch_size, self.wire_bytes, self.offload_bytes,
                self.optimizer_params, 1.0]

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "flops": self.flops, "wire_bytes": self.wire_bytes,
                "offload_bytes": self.offload_bytes, "optimizer_params": self.optimizer_params,
                "world_size": self.world_size}

    @classmethod
    def from_json(cls, record: dict | None) -> StepWork | None:
        if not record or not record.get("flops"):
            return None
        return cls(int(record["batch_size"]), float(record["flops"]), float(record["wire_bytes"]),
                   float(record["offload_bytes"]), float(record["optimizer_params"]), int(record["world_size"]))


@dataclass(frozen=True)
class Measured:
    """One run's speed: `setup` at a rank's `batch_size` trained `samples_per_s` (all ranks)."""

    setup: str
    work: StepWork
    batch_size: int
    samples_per_s: float

    @property
    def step_s(self) -> float:
        return self.batch_size * self.work.world_size / self.samples_per_s


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of each of PARTS on this machine, fitted to `runs` runs of
    `setups` setups."""

    seconds: tuple[float, ...]
    runs: int
    setups: int
    batches: tuple[int, int] | None = None  # the smallest and largest batch of the runs: the range it was fitted in

    def step_s(self, work: StepWork, batch_size: float) -> float:
        return sum(r * x for r, x in zip(self.seconds, work.parts(batch_size)))

    def samples_per_s(self, work: StepWork, batch_size: float) -> float | None:
        step = self.step_s(work, batch_size)
        return batch_size * work.world_size / step if step > 0 else None

    def to_json(self) -> dict:
        """The rates as a person reads them: TFLOP/s, GB/s on the wire, and so on."""
        flops, wire, offload, optimizer, step = self.seconds
        return {"tflops": per(flops, 1e12), "wire_gb_per_s": per(wire, 1e9),
                "offload_gb_per_s": per(offload, 1e9), "optimizer_gparams_per_s": per(optimizer, 1e9),
                "ms_per_step": step * 1e3, "seconds_per_unit": dict(zip(PARTS, self.seconds)), "runs": self.runs,
                "setups": self.setups, "batches": list(self.batches) if self.batches else None}

    @classmethod
    def from_json(cls, record: dict | None) -> Rates | None:
        if not record or "seconds_per_unit" not in record:
            return None
        batches = record.get("batches")
        return cls(tuple(float(record["seconds_per_unit"][p]) for p in PARTS), int(record["runs"]),
                   int(record["setups"]), (int(batches[0]), int(batches[1])) if batches else None)

    def fitted_at(self, batch_size: float) -> bool:
        """Whether `batch_size` is within the batches the rates were fitted at: outside them a
        machine's cost of a sample can differ (on a CPU, caches: small batches train faster a
        sample than the rates say)."""
        return self.batches is None or self.batches[0] <= batch_size <= self.batches[1]


def per(seconds_per_unit: float, unit: float) -> float | None:
    """Units a second, in `unit`s (None: the part cost nothing the runs could see)."""
    return None if seconds_per_unit <= 0 else 1 / seconds_per_unit / unit


def calibrate(runs: Sequence[Measured]) -> Rates | None:
    """The rates that best predict the runs' step times, each run's error relative to its
    own time; None without a run."""
    if not runs:
        return None
    rows = [[x / m.step_s for x in m.work.parts(m.batch_size)] for m in runs]
    scale = [max((abs(row[j]) for row in rows), default=0.0) or 1.0 for j in range(len(PARTS))]
    solved = nonnegative_least_squares([[x / s for x, s in zip(row, scale)] for row in rows], [1.0] * len(rows))
    sizes = [m.batch_size for m in runs]
    return Rates(tuple(w / s for w, s in zip(solved, scale)), len(runs), len({m.setup for m in runs}),
                 (min(sizes), max(sizes)))


def held_out(runs: Sequence[Measured], setup: str) -> float | None:
    """The model's samples/s for `setup`'s fastest run, calibrated on the other setups' runs
    alone: what it would have said before that setup ran (None: no other setup ran)."""
    own = [m for m in runs if m.setup == setup]
    rates = calibrate([m for m in runs if m.setup != setup])
    if not own or rates is None:
        return None
    best = max(own, key=lambda m: m.samples_per_s)
    return rates.samples_per_s(best.work, best.batch_size)


def model_error(runs: Sequence[Measured]) -> float | None:
    """The largest relative error of a held-out prediction over the setups run (None:
    fewer than two setups, so none can be held out)."""
    errors = []
    for setup in dict.fromkeys(m.setup for m in runs):
        predicted = held_out(runs, setup)
        measured = max(m.samples_per_s for m in runs if m.setup == setup)
        if predicted is not None:
            errors.append(abs(predicted - measured) / measured)
    return max(errors) if errors else None


def nonnegative_least_squares(a: list[list[float]], b: list[float], iterations: int = 100) -> list[float]:
    """x >= 0 minimising |a x - b| (Lawson and Hanson's active set), for the few columns
    here; among equally good answers, one of least norm."""
    n = len(a[0])
    x, free = [0.0] * n, [False] * n
    for _ in range(iterations):
        residual = [bi - sum(aij * xj for aij, xj in zip(row, x)) for row, bi in zip(a, b)]
        gradient = [sum(row[j] * r for row, r in zip(a, residual)) for j in range(n)]
        candidates = [j for j in range(n) if not free[j] and gradient[j] > 1e-12]
        if not candidates:
            break
        free[max(candidates, key=lambda j: gradient[j])] = True
        while True:
            z = least_squares_on(a, b, free)
            if all(z[j] > 0 for j in range(n) if free[j]):
                x = z
                break
            step = min(x[j] / (x[j] - z[j]) for j in range(n) if free[j] and z[j] <= 0)
            x = [xj + step * (zj - xj) for xj, zj in zip(x, z)]
            for j in range(n):
                if free[j] and x[j] <= 1e-15:
                    free[j], x[j] = False, 0.0
    return x


def least_squares_on(a: list[list[float]], b: list[float], free: list[bool]) -> list[float]:
    """The least-norm least-squares answer on the `free` columns, the others 0."""
    cols = [j for j, f in enumerate(free) if f]
    solved = numpy.linalg.lstsq(numpy.asarray(a)[:, cols], numpy.asarray(b), rcond=None)[0]
    x = [0.0] * len(free)
    for k, j in enumerate(cols):
        x[j] = float(solved[k])
    return x
