"""How the command ends: the exit code, and after a sweep the runs that failed."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import Future

from hydra.core.utils import JobReturn

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


class RunOutcomes:
    """The runs of the command as they end, and the exit code they make: EXIT_RUN_FAILED
    when a run failed (after a sweep, with the list of the failed ones), else EXIT_NONE_FITS
    when a search found that nothing fits.

    The task function (fsdp_exp.commands.experiment's `RunTask`) records each run it ran in
    this process as it ends (`ran`): its summary, or for runs side by side
    (fsdp_exp.driver.sweep) the future of it, which `exit_code` waits for. After a -m sweep,
    fsdp_exp's sweeper hands over what Hydra's launcher returned for every run (`launched`),
    which holds the summaries of runs a launcher plugin ran in other processes too
    (hydra/launcher=submitit_local, submitit_slurm)."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, Summary | Future]] = []  # (run directory, summary) of each run
        self.ran_here: set[str] = set()  # the runs this process ran, which have said why they failed
        self.swept = False  # a -m sweep

    def ran(self, run_dir: str, summary: Summary | Future, in_sweep: bool) -> None:
        self.ended.append((run_dir, summary))
        self.ran_here.add(run_dir)
        self.swept |= in_sweep

    def launched(self, results: Sequence[JobReturn]) -> None:
        """A sweep's runs, as Hydra's launcher returned them (each a completed job), in the
        order it launched them."""
        self.swept = True
        self.ended = [(str(r.hydra_cfg.hydra.runtime.output_dir), r.return_value) for r in results]

    def exit_code(self) -> int:
        """The command's exit code; after a sweep, its refused, failed and none-fits runs
        said first."""
        ended = [(run_dir, outcome(summary)) for run_dir, summary in self.ended]
        if not self.swept:  # the run has said why
            return exit_code([summary for _, summary in ended])
        failed = [f"{run_dir}: {summary.error or summary.status}"
                  for run_dir, summary in ended if summary.status not in (*ANSWERED, "refused")]
        none_fits = [run_dir for run_dir, summary in ended if summary.status == NONE_FITS]
        refused = [run_dir for run_dir, summary in ended if summary.status == "refused"]
        if refused:  # each was named, with its reason, before the sweep started
            print(f"fsdp_exp: {len(refused)} of {len(ended)} runs refused by their check (status refused): "
                  f"{', '.join(refused)}", file=sys.stderr)
        if failed:
            if len(ended) > 1 or ended[0][0] not in self.ran_here:  # a single run here has said why
                print(f"fsdp_exp: {len(failed)} of {len(ended)} runs failed:", file=sys.stderr)
                for line in failed:
                    print(f"  {line}", file=sys.stderr)
        elif none_fits:
            print(f"fsdp_exp: {len(none_fits)} of {len(ended)} searches found that nothing fits (status none_fits): "
                  f"{', '.join(none_fits)}", file=sys.stderr)
        return exit_code([summary for _, summary in ended if summary.status != "refused"])


def outcome(summary: Summary | Future) -> Summary:
    """A run's summary; for a run side by side, once it has ended."""
    if not isinstance(summary, Future):
        return summary
    try:
        return summary.result()
    except Exception as err:  # noqa: BLE001 - a run that failed outside its launch is a failed run
        return Summary(status="failed", error=one_line(err, named=True, whole=True))
