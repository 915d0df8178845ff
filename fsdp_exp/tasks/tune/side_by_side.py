"""A tune's setups side by side, where the launcher runs more than one at a time
(launcher.max_parallel: slurm, ray): the Tuner's (fsdp_exp.tasks.tune.tuner) threads, each
running one setup's work, up to a number at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_exp.driver.sweep import SideBySide

TunedSetup = Any  # fsdp_exp.tasks.tune.tuner.TunedSetup: a setup on its way (its setup's name, its row's directory)


class SetupsSideBySide:
    """The Tuner's side-by-side part: it reads the Tuner's `parallel`, `in_flight`,
    `run_dir` and `spent()`."""

    parallel: int
    in_flight: SideBySide | None
    run_dir: Path

    def budget_spent(self) -> bool:
        raise NotImplementedError

    def runs(self) -> SideBySide | None:
        """The setups in flight, when the launcher runs more than one at a time."""
        if self.parallel <= 1:
            return None
        if self.in_flight is None:
            self.in_flight = SideBySide()
        return self.in_flight

    def side_by_side(self, entries: list[TunedSetup], work: Callable[[TunedSetup], None], at_once: int,
                     runs: SideBySide | None) -> None:
        """`work(entry)` for each entry until the budget is spent: one after another, or up to
        `at_once` at a time in `runs`."""
        for entry in entries:
            if runs is not None:
                runs.wait_for_slot(at_once)
            if self.budget_spent():
                break
            if runs is None:
                work(entry)
            else:
                runs.start(entry.setup.name, self.run_dir / entry.row.dir, at_once, lambda entry=entry: work(entry))
        if runs is not None:
            self.wait(runs)

    def wait(self, runs: SideBySide) -> None:
        """Until every setup in flight has ended; an error in one is raised here, after the others ended."""
        runs.wait_all()
        for _, future in runs.runs:
            future.result()
        runs.runs.clear()
