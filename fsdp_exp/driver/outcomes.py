"""How the command ends: the exit code, and after a sweep the runs that failed."""

from __future__ import annotations

import re
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fsdp_exp.errors import one_line
from fsdp_exp.metrics.summary import ANSWERED, NONE_FITS, Summary

EXIT_RUN_FAILED = 1
EXIT_NONE_FITS = 3  # every run answered, and a search's answer is that not even its smallest batch fits


def exit_code(summaries: list[Summary]) -> int:
    """The command's exit code for the runs it ran: 1 when one failed, else 3 when a search
    found that nothing fits, else 0."""
    if any(s.status not in ANSWERED for s in summaries):
        return EXIT_RUN_FAILED
    return EXIT_NONE_FITS if any(s.status == NONE_FITS for s in summaries) else 0


class RunOutcomes(Callback):
    """The outcome of the command (conf/config.yaml sets this callback): it exits with
    EXIT_RUN_FAILED when a run failed, and after a sweep lists the runs that failed; with
    EXIT_NONE_FITS when none failed and a search found that nothing fits.

    The runs Hydra ran in this process report their summaries as they end (`on_job_end`),
    or, for runs side by side (fsdp_exp.driver.sweep), the futures of their summaries, which
    the end of the sweep waits for.
    A sweep that Hydra's launcher plugin ran in other processes (hydra/launcher=
    submitit_local, submitit_slurm) is read from the summary.json each of its runs wrote."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, Summary | Future]] = []  # (run directory, summary) of the runs that ran here
        self.start = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.start = time.time() - 1  # file times may be whole seconds

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if job_return.status == JobStatus.COMPLETED:
            self.ended.append((config.hydra.runtime.output_dir, job_return.return_value))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        code = exit_code([summary for _, summary in self.ended])
        if code:  # the run has said why
            sys.exit(code)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        ended = [(run_dir, outcome(summary)) for run_dir, summary in self.ended] or \
            self.ended_elsewhere(Path(config.hydra.sweep.dir).absolute())
        failed = [f"{run_dir}: {summary.error or summary.status}"
                  for run_dir, summary in ended if summary.status not in (*ANSWERED, "refused")]
        none_fits = [run_dir for run_dir, summary in ended if summary.status == NONE_FITS]
        refused = [run_dir for run_dir, summary in ended if summary.status == "refused"]
        if refused:  # each was named, with its reason, before the sweep started
            print(f"fsdp_exp: {len(refused)} of {len(ended)} runs refused by their check (status refused): "
                  f"{', '.join(refused)}", file=sys.stderr)
        if failed and (len(ended) > 1 or not self.ended):  # a single run here has already said why
            print(f"fsdp_exp: {len(failed)} of {len(ended)} runs failed:", file=sys.stderr)
            for line in failed:
                print(f"  {line}", file=sys.stderr)
        if failed:
            sys.exit(EXIT_RUN_FAILED)
        if none_fits:
            print(f"fsdp_exp: {len(none_fits)} of {len(ended)} searches found that nothing fits (status none_fits): "
                  f"{', '.join(none_fits)}", file=sys.stderr)
            sys.exit(EXIT_NONE_FITS)

    def ended_elsewhere(self, sweep: Path) -> list[tuple[str, Summary]]:
        made = [p.parent for p in [*sweep.glob("*/.hydra"), *sweep.glob("*/*/.hydra")] if p.stat().st_mtime >= self.start]
        ended = []
        for run_dir in sorted(made, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]):
            summary = Summary.read(run_dir)
            if summary is not None:
                ended.append((str(run_dir), summary))
            else:
                ended.append((str(run_dir), Summary(status="failed", error="no summary.json: the run did not "
                                                    "finish (see the launcher's logs)")))
        return ended


def outcome(summary: Summary | Future) -> Summary:
    """A run's summary; for a run side by side, once it has ended."""
    if not isinstance(summary, Future):
        return summary
    try:
        return summary.result()
    except Exception as err:  # noqa: BLE001 - a run that failed outside its launch is a failed run
        return Summary(status="failed", error=one_line(err, named=True, whole=True))
