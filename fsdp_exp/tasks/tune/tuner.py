"""The driver of task=tune: every setup of task.space composed and checked as its command
line would be, then measured only where the measurement can change the answer.

1. The estimate (one trace on fake tensors a setup, seconds; as many at once as the machine
   has cores) prunes the setups whose smallest batch cannot fit, and says where each one's
   largest batch lies.
2. The speed model's calibration (fsdp_exp.tasks.tune.predicting): the fewest setups that
   pin its rates are probed, each first near its largest batch (task=max_batch's own first
   probe). Without a model (fewer than two setups traced) every setup is probed once.
3. The setups are measured in the order of the most they could reach: by their probes
   (fsdp_exp.tasks.tune.ranking), or with none, by the speed model widened by its error;
   each near the largest batch its estimate puts under the limit, or without the estimate,
   searched to its fastest batch (fsdp_exp.tasks.tune.bounding). One whose bound falls below
   the best measured is not measured on: `bounded` after its probe, `predicted` without one.

Each setup's search is task=max_batch's, in `<run>/setups/<setup>/`, recorded after every
probe: a tune run again into the same directory goes on from its recorded probes. On a
launcher that runs more than one job at a time (launcher.max_parallel: slurm, ray), steps 2
and 3 run that many setups side by side (fsdp_exp.driver.sweep), each probe in fresh ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.config import Device, as_dict
from fsdp_exp.driver.check import check_run
from fsdp_exp.driver.compose import compose_config
from fsdp_exp.driver.sweep import SideBySide
from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.launcher.core import RunFailed
from fsdp_exp.files import write_json
from fsdp_exp.metrics.figures import TuneAnswer
from fsdp_exp.run_context import RunContext
from fsdp_exp.tasks.tune.report import RECORD, command_words, report, tune_record
from fsdp_exp.tasks.max_batch.search import MaxBatchSearch
from fsdp_exp.tasks.max_batch.probe import Probe, run_probe
from fsdp_exp.tasks.max_batch.verify import settle_within_gb
from fsdp_exp.tasks.tune.accumulation import Accumulating
from fsdp_exp.tasks.tune.bounding import Bounding
from fsdp_exp.tasks.tune.command import base_overrides, search_command, search_path_overrides
from fsdp_exp.tasks.tune.confirm import Confirming
from fsdp_exp.tasks.tune.predicting import Predicting
from fsdp_exp.tasks.tune.side_by_side import SetupsSideBySide
from fsdp_exp.tasks.tune.ranking import SPEED_NOISE, Row, can_win
from fsdp_exp.tasks.tune.space import Setup, fold_on_cpu, setups

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.driver.plan import RunPlan
    from fsdp_exp.launcher.core import Launcher

log = logging.getLogger("fsdp_exp")

EXTRA_PROBES = "extra_probes.json"
# A setup within the noise of the winner run again (in turns) runs as many steps as its first
# run at its batch did (the first a warm-up), so that the runs its mean takes are alike; at most:
REMATCH_STEPS = 10
# The estimate is at most about 1% above a run's peak (bench/estimate_accuracy.py): a setup
# whose smallest batch it puts this far over the limit is pruned without a probe.
PRUNE_OVER = 0.02
TRACES_AT_ONCE = 8  # estimates traced side by side, one process and one core each


@dataclass
class TunedSetup:
    """One setup on its way: its row, and its plan and search once it composed."""

    setup: Setup
    row: Row
    plan: RunPlan | None = None
    search: MaxBatchSearch | None = None
    done: bool = False  # settled: its row says how
    extra_probes: int = 0  # beside its search: task.global_batch's splits, the winner's confirmation
    # the speeds of the runs beside its search, by (a rank's batch, train.grad_accum), but the confirmation's
    readings: list[tuple[tuple[int, int], float]] = field(default_factory=list)
    # the steps of its first run beside its search at each (a rank's batch, train.grad_accum)
    lengths: dict[tuple[int, int], int] = field(default_factory=dict)


class Tuner(Bounding, Accumulating, Confirming, Predicting, SetupsSideBySide):
    def __init__(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher, nproc: int):
        self.exp, self.context, self.run_dir, self.launcher, self.nproc = exp, context, Path(run_dir), launcher, nproc
        self.settings = exp.task
        self.budget = self.settings.stop_after()
        self.command = base_overrides(context.overrides())
        self.start = time.perf_counter()
        self.probes_run = 0
        self.probes_under_way = 0  # side by side: probes started and not yet counted in probes_run
        self.stopped = False  # the budget ran out
        self.entries: list[TunedSetup] = []
        self.speaking: TunedSetup | None = None  # the setup whose search logged last
        self.parallel = max(1, launcher.max_parallel)  # setups in flight at once (launcher=slurm, ray)
        self.in_flight: SideBySide | None = None
        self.confirmed: dict | None = None  # the winner's command line, run (confirm)
        self.confirming = False  # the confirmation the budget kept room for has started
        self.folded: list[str] = []  # the options that change nothing on this device, folded into one (space)
        self.lock = threading.RLock()  # side by side, the setups' threads share the counts and tune.json

    # --- the three steps ---

    def run(self) -> TuneAnswer:
        nodes = max(1, self.nproc // max(1, self.launcher.ranks_per_node(self.nproc)))
        made = setups(self.space_to_try(), self.command, self.nproc, nodes, as_dict(self.exp))
        log.info("task=tune: %d setup(s) of %s on %d rank(s), budget %s", len(made),
                 ", ".join(dict.fromkeys(o.split("=")[0].lstrip("+") for s in made for o in s.overrides)) or "nothing",
                 self.nproc,
                 self.budget)
        self.entries = [self.prepare(setup) for setup in made]
        self.save()
        self.estimate_all(self.unsettled())
        if self.parallel > 1:
            self.launcher.connect(self.nproc, self.parallel)
        calibration = self.calibration(self.unsettled())
        self.side_by_side(calibration, self.first_speed, self.parallel, self.runs())
        first = calibration[0] if calibration else None
        if first is not None and len(calibration) < len(self.unsettled()) and not first.done and not self.stopped \
                and len({p.batch_size for p in self.trained(first)}) == 1:
            self.second_size(first)
        self.search_those_that_can_win()
        self.stop_unfinished()
        self.rematch()
        self.confirm()
        return self.finish()

    def space_to_try(self) -> dict:
        """task.space, less the options that change nothing on this device (said, and kept in `folded`)."""
        if self.exp.device != Device.cpu:
            return self.settings.space
        space, self.folded = fold_on_cpu(self.settings.space)
        for note in self.folded:
            log.info("task=tune: %s", note)
        return space

    def prepare(self, setup: Setup) -> TunedSetup:
        """The setup composed and checked as its command line would be; refused, a row that says why."""
        entry = TunedSetup(setup, Row(setup.name, list(setup.overrides), dir=f"setups/{setup.dir_name}"))
        try:
            entry.plan = check_run(compose_config(self.setup_overrides(setup)))
        except ConfigError as err:
            entry.row.status, entry.row.how, entry.done = "refused", str(err), True
            log.info("%s: refused: %s", setup.name, err)
            return entry
        plan = entry.plan
        entry.search = MaxBatchSearch(plan.exp, self.run_dir / entry.row.dir, plan.launcher, plan.nproc,
                                      RunContext(environment={"overrides": [*self.command, *setup.overrides]}),
                                      own_wandb_run=False)
        entry.search.start_or_resume()
        return entry

    def estimate_all(self, entries: list[TunedSetup]) -> None:
        """Each setup's estimate. A trace is a process of its own that keeps one core busy, so
        as many run at once as this machine has cores (TRACES_AT_ONCE at most)."""
        at_once = min(len(entries), TRACES_AT_ONCE, len(os.sched_getaffinity(0)))
        traces = SideBySide() if at_once > 1 else None
        try:
            self.side_by_side(entries, self.estimate, at_once, traces)
        finally:
            if traces is not None:
                traces.close()

    def estimate(self, entry: TunedSetup) -> None:
        """Prune a setup whose smallest batch the estimate puts over the limit; note where it
        puts the largest."""
        search = entry.search
        assert search is not None
        curve = search.estimate()  # a trace that fails is said, and the probes place the search alone
        if curve is None or search.limit_gb is None:
            return
        smallest = self.settings.resolution
        need = curve.peak_gb(smallest)
        if need > search.limit_gb * (1 + PRUNE_OVER) and not self.trained(entry):
            self.conclude(entry, "pruned", f"the estimate puts batch {smallest} at {need:.3f} GB, over the "
                        f"{search.limit_gb:g} GB limit")
            return
        crossing = min(curve.crossing(search.limit_gb - search.noise_gb()), search.up_to())
        entry.row.estimated_max_batch = math.floor(crossing) if math.isfinite(crossing) else None

    def first_speed(self, entry: TunedSetup) -> None:
        """Probe until the setup has a speed (its search's first probe, placed by the estimate
        near its largest batch), or its search ends."""
        while not self.trained(entry) and not self.stopped:
            if not self.step(entry):
                if not self.stopped:
                    self.settle_searched(entry)
                return

    def second_size(self, entry: TunedSetup) -> None:
        """The setup again at half its batch, beside its search (`half/` in its folder): the
        speed model's cost of the FLOPs apart from its cost of a step, told apart over a
        range (two batches a sample apart, where a search's next probe lands, leave the split
        to chance). A setup measured at its smallest batch: its search's next probe."""
        accum = entry.plan.exp.train.grad_accum
        r = math.lcm(self.settings.resolution, accum)  # a rank's batch: `accum` micro-batches, as the search's
        half = self.trained(entry)[0].batch_size // 2 // r * r
        if half >= r and not self.budget_spent():
            self.extra_probe(entry, "half", half // accum, accum)
        elif not self.step(entry) and not self.stopped:
            self.settle_searched(entry)

    def search_those_that_can_win(self) -> None:
        """Search to the fastest batch each setup whose bound can still beat the best, most
        promising first; bound the others. Side by side, a setup is judged when a place is free."""
        runs = self.runs()
        for entry in sorted(self.unsettled(), key=lambda e: -(self.bound(e) or 0.0)):
            if runs is not None:
                runs.wait_for_slot(self.parallel)
            if self.stopped:
                break
            if self.near_largest(entry):
                self.conclude_near_largest(entry)
            elif not self.can_still_win(entry):
                if self.trained(entry):
                    self.conclude(entry, "bounded", self.bounded_words(entry))
                else:
                    self.conclude_predicted(entry)
            elif runs is None:
                self.measure(entry)
            else:
                runs.start(entry.setup.name, self.run_dir / entry.row.dir, self.parallel,
                           lambda entry=entry: self.measure(entry))
        if runs is not None:
            self.wait(runs)

    def measure(self, entry: TunedSetup) -> None:
        """The setup's speed: near the largest batch its estimate puts under the limit (its
        first probe that lands there), or, searched, at its fastest batch (`at_estimate`)."""
        while not self.near_largest(entry) and self.step(entry):
            pass
        if self.stopped:
            return
        if self.near_largest(entry):
            self.conclude_near_largest(entry)
        else:
            self.settle_searched(entry)

    def conclude_near_largest(self, entry: TunedSetup) -> None:
        """A setup measured near the largest batch its estimate puts under the limit: its
        fastest probe that trained, and how near the limit its largest probe came."""
        search, near = entry.search, self.near_largest(entry)
        assert search is not None and near is not None and search.limit_gb is not None
        self.update(entry)
        peak = near.limited_peak_gb() or 0.0
        counted = f"fastest of {entry.row.probes} probes, the largest" if entry.row.probes > 1 else "1 probe"
        self.conclude(entry, "measured", f"{counted} at batch {near.batch_size} with {peak:.3f} GB, "
                      f"{1 - peak / search.limit_gb:.1%} of the limit free, near the largest batch "
                      "(task.search_boundary=true searches for it)")

    # --- one setup ---

    def step(self, entry: TunedSetup) -> bool:
        """The setup's next probe; False when its search is done or the budget is spent."""
        search = entry.search
        assert search is not None
        with self.lock:  # side by side, a probe under way counts against the budget from its start
            if self.budget_spent():
                return False
            self.probes_under_way += 1
        before = len(search.probes)
        self.announce(entry)
        try:
            ran = search.step()
        finally:
            with self.lock:
                self.probes_under_way -= 1
                self.probes_run += len(search.probes) - before
        with self.lock:
            self.update(entry)
            self.save()
        return ran

    def budget_spent(self) -> bool:
        """Whether the budget is spent (said once), keeping room for the winner's confirmation
        until it starts."""
        with self.lock:
            probes, seconds = (0, 0.0) if self.confirming else self.confirmation_needs()
            if not self.stopped and self.budget.spent(self.probes_run + self.probes_under_way + probes,
                                                      time.perf_counter() - self.start + seconds):
                log.info("task=tune: the budget (task.budget=%s) is spent, less what confirming the winner needs; "
                         "the answer is the best so far", self.budget)
                self.stopped = True
            return self.stopped

    def announce(self, entry: TunedSetup) -> None:
        """One at a time, the setup whose probes the next lines are (side by side, each line says it)."""
        if self.parallel <= 1 and self.speaking is not entry:
            log.info("setup %d of %d: %s", self.entries.index(entry) + 1, len(self.entries), entry.setup.name)
            self.speaking = entry

    def trained(self, entry: TunedSetup) -> list[Probe]:
        search = entry.search
        return [] if search is None else [p for p in search.probes if p.status == "ok" and p.samples_per_s
                                          and not p.killed]

    def update(self, entry: TunedSetup) -> None:
        """The row's figures from the setup's probes so far: its fastest that trained."""
        row, search = entry.row, entry.search
        assert search is not None
        row.probes = len([p for p in search.probes if not p.killed]) + entry.extra_probes
        fit = self.trained(entry)
        if not fit:
            return
        best = max(fit, key=lambda p: p.samples_per_s or 0.0)
        self.fill_row(row, best, search.limit_gb)
        row.bound_samples_per_s = self.bound(entry)

    def fill_row(self, row: Row, probe: Probe, limit_gb: float | None) -> None:
        row.batch_size, row.samples_per_s, row.mfu = probe.batch_size, probe.samples_per_s, probe.mfu
        row.tokens_per_s = probe.tokens_per_s
        row.peak_gb = probe.limited_peak_gb()
        row.headroom_gb = None if limit_gb is None or row.peak_gb is None else limit_gb - row.peak_gb

    def settle_searched(self, entry: TunedSetup) -> None:
        """A setup whose search ended: its answer, or the one line of why it has none."""
        search = entry.search
        assert search is not None
        try:
            answer = search.finish()
        except (RunFailed, ConfigError) as err:
            self.conclude(entry, "failed", one_line(err))
            return
        largest = entry.row.max_batch_size = answer.max_batch_size
        if not largest:
            need = answer.smallest_batch_needs_gb
            self.conclude(entry, "does not fit", f"batch {answer.searched_from} "
                        + (f"needs {need:.3f} GB" if need else "runs out of memory") + " under the limit")
            return
        fastest = answer.fastest_batch_size
        probe = max((p for p in self.trained(entry) if p.batch_size == fastest), key=lambda p: p.samples_per_s or 0.0)
        self.fill_row(entry.row, probe, search.limit_gb)
        how = f"fastest of {entry.row.probes} probes; max batch {largest}"
        above = largest + self.settings.resolution
        failed = next((p for p in search.probes if p.batch_size == above and p.status == "failed"), None)
        if answer.bounded_by == "failed" and failed is not None:
            how += f" ({above} did not train, not for lack of memory: {failed.reason})"
        if self.settings.global_batch is None:
            self.conclude(entry, "measured", how)
        else:
            self.split(entry, largest, how)

    def extra_probe(self, entry: TunedSetup, kind: str, micro: int, accum: int) -> Probe:
        """A probe of `micro` at train.grad_accum=`accum` beside the setup's search (`kind`:
        "split", task.global_batch's; "repeat", a probe run again; "half", the first setup at half its
        batch, for the speed model; "rematch<n>", a near-tie's runs in turns; "confirm", the
        winner's command line), in `<setup>/<kind>/`,
        recorded in the setup's folder (extra_probes.json) and reused from there by a tune run
        again."""
        search, plan = entry.search, entry.plan
        assert search is not None and plan is not None
        path = search.run_dir / EXTRA_PROBES
        recorded = json.loads(path.read_text()) if path.is_file() else []
        length = self.settings.verify_length()
        steps = length.steps if kind == "confirm" else self.turn_steps(entry, micro * accum, accum) \
            if kind.startswith("rematch") else search.steps
        key = {"kind": kind, "batch_size": micro, "grad_accum": accum, "steps": steps,
               "until_settled": kind == "confirm" and length.until_settled, "fingerprint": search.fingerprint}
        earlier = next((r for r in recorded if {k: r.get(k) for k in key} == key), None)
        if earlier is not None:
            probe = Probe.from_json(earlier["probe"])
        else:
            self.announce(entry)
            where = search.run_dir / kind / f"b{micro}x{accum}"
            timeout_s = search.timeout_s * max(1.0, steps / search.steps)
            if kind == "confirm":  # the command line as printed, as task=max_batch verifies its answer
                printed = check_run(compose_config(command_words(self.prefix(), entry.row)))
                probe = run_probe(printed.exp, printed.exp.train.batch_size, where, printed.launcher, printed.nproc,
                                  steps, timeout_s, as_command="confirm",
                                  until_settled=settle_within_gb(length, search.limit_gb))
            else:
                # train.batch_size is a step's batch on each rank: `accum` micro-batches of `micro`
                exp = replace(plan.exp, train=replace(plan.exp.train, grad_accum=accum))
                probe = run_probe(exp, micro * accum, where, plan.launcher, plan.nproc, steps, timeout_s,
                                  settle_gb=None if kind.startswith("rematch") else search.noise_gb())
            log.info("%s, train.grad_accum=%d: %s", kind, accum, probe.line())
            write_json(path, [*recorded, {**key, "probe": probe.to_json()}])
        if kind != "confirm" and probe.status == "ok" and probe.samples_per_s:
            entry.readings.append(((micro * accum, accum), probe.samples_per_s))
            entry.lengths.setdefault((micro * accum, accum), probe.steps or steps)
        with self.lock:
            self.probes_run += earlier is None
            entry.extra_probes += 1
            entry.row.probes += 1
            self.save()
        return probe

    def turn_steps(self, entry: TunedSetup, batch: int, accum: int) -> int:
        """The steps of a run in turns at `batch` (a step's, on each rank): as many as the setup's
        first run there trained (a probe trains on until its peak settles), REMATCH_STEPS at most."""
        assert entry.search is not None and entry.plan is not None
        first = next((p.steps for p in self.trained(entry) if p.batch_size == batch and p.steps
                      and accum == entry.plan.exp.train.grad_accum), None) or entry.lengths.get((batch, accum))
        return min(max(first or REMATCH_STEPS, entry.search.steps), REMATCH_STEPS)

    def conclude(self, entry: TunedSetup, status: str, how: str) -> None:
        with self.lock:
            entry.row.status, entry.row.how, entry.done = status, how, True
            self.save()
        log.info("%s: %s: %s", entry.setup.name, status, how)

    # --- the tune as a whole ---

    def unsettled(self) -> list[TunedSetup]:
        return [e for e in self.entries if not e.done]

    def best_speed(self) -> float | None:
        """The best measured speed of a setup still in the running (not one whose command line failed)."""
        return max((e.row.samples_per_s for e in self.entries if e.row.status == "measured" and e.row.samples_per_s
                    and e.row.confirmed is not False), default=None)

    def reopen_bounded(self) -> None:
        """After the winner's command line failed (and its setup dropped out or stepped down),
        search the setups spared by a bound that can now beat the best."""
        best = self.best_speed()
        again = [e for e in self.entries if e.row.status in ("bounded", "predicted")
                 and can_win(self.bound(e) or math.inf, best, self.speed_band() or SPEED_NOISE)]
        for entry in again:
            entry.done, entry.row.status = False, "not reached"
            log.info("%s: its bound can beat the best now; searching it", entry.setup.name)
        if again:
            self.search_those_that_can_win()

    def setup_overrides(self, setup: Setup) -> list[str]:
        return search_command(self.command, setup.overrides, self.settings)

    def prefix(self) -> list[str]:
        """The printed command line's words before the setup's own."""
        return [*self.command, *search_path_overrides()]

    def stop_unfinished(self) -> None:
        """Once the budget is spent, the setups not settled: measured as far as their probes
        went (the best so far, which can win and is confirmed), or not reached."""
        for entry in self.entries:
            if not entry.done and self.stopped:
                entry.row.how = f"the budget (task.budget={self.budget}) ran out first"
                entry.done = True
                if self.trained(entry):  # the best so far: what its probes measured under the limit
                    self.update(entry)
                    entry.row.status = "measured"
                    entry.row.how = (f"fastest of {entry.row.probes} probe(s) so far; {entry.row.how}, "
                                     "before its search ended")

    def finish(self) -> TuneAnswer:
        self.stop_unfinished()
        return report(self.exp, self.context, self.run_dir, self.save())

    def save(self) -> dict:
        """tune.json, rewritten whole after every probe, so no probe is ever lost."""
        limits = {e.search.limit_gb for e in self.entries if e.search is not None and e.search.limit_gb is not None}
        self.predict_rows()
        record = tune_record(
            [e.row for e in self.entries], prefix=self.prefix(), world_size=self.nproc,
            limit_gb=self.exp.memory.limit_gb or (max(limits) if limits else None), budget=str(self.budget),
            stopped=self.stopped, probes_run=self.probes_run,
            probes_reused=sum(e.search.reused for e in self.entries if e.search is not None),
            tokens_per_sample=self.exp.data.tokens_per_sample, wall_s=time.perf_counter() - self.start,
            confirmed=self.confirmed, speed_model=self.speed_model(), folded=self.folded, band=self.speed_band())
        write_json(self.run_dir / RECORD, record)
        return record
