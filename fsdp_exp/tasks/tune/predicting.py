"""The speed model in task=tune (`Predicting`, a part of fsdp_exp.tasks.tune.tuner.Tuner):
every probe that trained is a measured run of the speed model (fsdp_exp.estimate.speed),
priced by what its setup's trace counts of a step.

- Calibration: the fewest setups that pin the rates are probed first (`calibration`): the
  one the estimate lets reach the largest batch, at two sizes (near its largest, and half
  that), and the most promising of those whose step sends other bytes.
- Measure only what can win: a setup not yet probed is bounded by the model's samples/s at
  the largest batch it can reach, widened by the model's error (`predicted_bound`); one
  whose bound cannot reach the best measured is a `predicted` row, without a probe.
- The model's error is measured, never assumed: each measured setup's row has the model's
  samples/s at its batch calibrated on the other setups' probes alone (what the model
  would have said before it ran), and the error is the largest of those misses. Until two
  setups have run there is none, and nothing is left out by prediction.

tune.json has the rates fitted to every probe and that error (`speed_model`)."""

from __future__ import annotations

from typing import Any

from fsdp_exp.estimate.speed import Measured, Rates, StepWork, calibrate, model_error
from fsdp_exp.tasks.tune.ranking import SPEED_NOISE

WIRE_APART = 0.1  # a setup whose step sends this share more or less than another's calibrates the wire


class Predicting:
    """What a tune knows of its setups' speed before it measures them; its attributes are
    the Tuner's."""

    entries: list

    def speed_band(self) -> float | None:
        raise NotImplementedError

    def step_work(self, entry: Any) -> StepWork | None:
        """What a step of the setup does, from its estimate's trace (None: not traced)."""
        search = entry.search
        return None if search is None else StepWork.from_json((search.estimated or {}).get("step_work"))

    def measured_runs(self) -> list[Measured]:
        """Every probe that trained, of each setup whose step was traced: its search's, and
        those beside it at the traced accumulation (a size for the model, a probe run again)."""
        runs = []
        for entry in self.entries:
            work = self.step_work(entry)
            if work is not None:
                runs += [Measured(entry.setup.name, work, p.batch_size, p.samples_per_s)
                         for p in self.trained(entry)]  # type: ignore[attr-defined]
                runs += [Measured(entry.setup.name, work, batch, speed)
                         for (batch, accum), speed in entry.readings if accum == entry.plan.exp.train.grad_accum]
        return runs

    def predict_rows(self) -> None:
        """Each measured row's predicted samples/s at its batch, by the rates of the other
        setups' probes (None until another setup has one). A row split into micro-batches
        (task.global_batch) has none: its step gathers the shards once a micro-batch, which
        the trace, at the search's accumulation, did not count."""
        runs = self.measured_runs()
        for entry in self.entries:
            row, work = entry.row, self.step_work(entry)
            if row.status == "predicted":  # what it was left out by
                continue
            rates = calibrate([m for m in runs if m.setup != entry.setup.name])
            row.predicted_samples_per_s = None
            if row.samples_per_s and row.batch_size and row.grad_accum == 1 and work and rates:
                row.predicted_samples_per_s = rates.samples_per_s(work, row.batch_size)

    def speed_model(self) -> dict | None:
        """tune.json's `speed_model`: this machine's rates fitted to every probe, and the
        model's error (None: no probe of a traced setup has trained)."""
        runs = self.measured_runs()
        rates: Rates | None = calibrate(runs)
        if rates is None:
            return None
        return {**rates.to_json(), "error": model_error(runs)}

    def calibration(self, entries: list) -> list:
        """The setups to probe first: the most promising, the one the estimate lets reach the
        largest batch (the fewest FLOPs a sample among equals), and the most promising of those
        whose step sends other bytes (WIRE_APART), so that the two pin the wire's rate apart
        from the step's. All of `entries` when fewer than two were traced: no model can be made."""
        traced = [e for e in entries if self.step_work(e) is not None]
        if len(traced) < 2:
            return entries

        def per_sample(entry: Any) -> float:
            work = self.step_work(entry)
            return work.flops / work.batch_size if work else 0.0

        def promise(entry: Any) -> tuple:
            return entry.row.estimated_max_batch or 0, -per_sample(entry)

        first = max(traced, key=promise)
        sent = self.step_work(first).wire_bytes  # type: ignore[union-attr]
        rest = [e for e in traced if e is not first]
        differing = [e for e in rest if abs(self.step_work(e).wire_bytes - sent) > WIRE_APART * max(sent, 1.0)]  # type: ignore[union-attr]
        return [first, max(differing or rest, key=promise)]

    def predicted_bound(self, entry: Any, largest: float) -> tuple[float, float, float] | None:
        """The model's samples/s for the setup at batch `largest`, its error, and that speed
        widened by the error (at least the noise between runs); None until the error is measured."""
        work, runs = self.step_work(entry), self.measured_runs()
        rates, error = calibrate(runs), model_error(runs)
        speed = rates.samples_per_s(work, largest) if work and rates and error is not None else None
        if speed is None or error is None:
            return None
        return speed, error, speed * (1 + max(error, self.speed_band() or SPEED_NOISE))
