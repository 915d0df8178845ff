"""One run on the driver: its planned experiment's task, which starts the ranks; summary.json.

The driver is the only writer of summary.json, so a run whose ranks died still gets one,
with status "failed" and the error, and a run stopped by Ctrl-C or SIGTERM one with status
"interrupted"; rank 0 streams metrics.jsonl as it trains. Its
`environment` holds the driver's half and what rank 0 saw (fsdp_exp.metrics.environment).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from fsdp_exp.config import Experiment
from fsdp_exp.driver.plan import RunPlan
from fsdp_exp.errors import ConfigError
from fsdp_exp.launcher.core import RunFailed, stop_signal
from fsdp_exp.metrics.environment import (
    DEVICE_RECORD,
    environment,
    rank_environment,
    read_device_record,
)
from fsdp_exp.metrics.sinks import METRICS, JsonLines, figures_so_far
from fsdp_exp.metrics.summary import SUMMARY, Summary, summary_table
from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


def run_experiment(
    plan: RunPlan,
    run_dir: Path,
    overrides: list[str],
    choices: dict[str, str],
    group: str | None = None,
    writes_files: bool = True,
    startup: dict[str, float] | None = None,
) -> Summary:
    """Run the planned experiment: its task's driver side, which launches the ranks; the
    run's summary (written to summary.json unless `writes_files` is off: under an external
    torchrun only rank 0 writes). `startup`: the command's start-up marks so far."""
    nproc = plan.nproc
    exp = replace(plan.exp, wandb=plan.exp.wandb.for_run(overrides, group, job_type=choices.get("task", "train")))
    context = RunContext(environment=environment(nproc, overrides), startup=dict(startup or {}))
    if writes_files:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / DEVICE_RECORD).unlink(missing_ok=True)  # an earlier run's, in a reused directory

    def record() -> dict:
        return {"overrides": overrides, "choices": choices, "device": str(exp.device),
                "environment": {**context.environment, **device_seen(exp, run_dir)}}

    start = time.perf_counter()
    try:
        figures = exp.task.run(exp, context, run_dir, exp.launcher, nproc)
        summary = Summary(status="ok").with_figures(figures.figures())
    except RunFailed as err:
        log.error("%s", err)
        summary = Summary(status="oom" if err.out_of_memory else "failed", error=str(err), world_size=nproc)
    except ConfigError as err:  # found only once the run directory exists (resume=auto)
        log.error("%s", err)
        summary = Summary(status="failed", error=str(err), world_size=nproc)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM (fsdp_exp.launcher.core.Interrupted)
        signal_name = stop_signal(err).name
        step = last_logged_step(run_dir)
        at = "" if choices.get("task", "train") != "train" else \
            f" after step {step} of {exp.train.steps}" if step is not None else " before its first logged step"
        if writes_files:
            Summary(status="interrupted", signal=signal_name, steps_done=step, world_size=nproc,
                    wall_s=time.perf_counter() - start).with_figures(record()).with_figures(
                figures_so_far(JsonLines.read(run_dir / METRICS), exp.metrics.warmup_steps)).write(run_dir)
            log.warning("interrupted (%s)%s; summary in %s", signal_name, at, run_dir / SUMMARY)
        err.run_reported = True  # the command adds no line of its own (fsdp_exp.commands.experiment)
        raise
    summary.with_figures(record())
    summary.wall_s = time.perf_counter() - start
    if writes_files:
        summary.write(run_dir)
        if summary.answered:
            log.info("%s\n%s", run_dir / SUMMARY, summary_table(summary))
    return summary


def last_logged_step(run_dir: Path) -> int | None:
    """The last step rank 0 wrote to metrics.jsonl (a line cut short by the stop is skipped)."""
    steps = [r["step"] for r in JsonLines.read(Path(run_dir) / METRICS) if "step" in r]
    return int(steps[-1]) if steps else None


def device_seen(exp: Experiment, run_dir: Path) -> dict:
    """Rank 0's half of the environment record: as rank 0 of the run reported it, or, when
    it never got that far and the ranks run on this machine, this machine's view of it."""
    seen = read_device_record(run_dir)
    if seen:
        return {**seen, "device_seen_by": "rank 0"}
    if exp.launcher.runs_here:
        return {**rank_environment(torch.device(str(exp.device))), "device_seen_by": "driver"}
    return {"device_seen_by": None}
