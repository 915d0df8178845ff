"""One run on the driver: resolve the config, start the task's ranks, write summary.json.

The driver is the only writer of summary.json, so a run whose ranks died still gets one,
with status "failed" and the error; rank 0 streams metrics.jsonl as it trains.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from fsdp_exp.errors import ConfigError
from fsdp_exp.launch import RunFailed
from fsdp_exp.metrics.environment import environment
from fsdp_exp.metrics.sinks import summary_table, write_summary
from fsdp_exp.plan import prepare

log = logging.getLogger("fsdp_exp")


def run_experiment(
    cfg: DictConfig,
    run_dir: Path,
    overrides: list[str],
    choices: dict[str, str],
    group: str | None = None,
) -> dict:
    plan = prepare(cfg, torch.cuda.device_count(), overrides, group, job_type=choices.get("task", "train"))
    exp, nproc = plan.exp, plan.nproc
    exp.environment = environment(str(exp.device), nproc, overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"overrides": overrides, "choices": choices, "device": str(exp.device),
              "environment": exp.environment}
    start = time.perf_counter()
    try:
        figures = exp.task.run(exp, run_dir, exp.launcher, nproc)
        summary = {"status": "ok", **figures}
    except RunFailed as err:
        log.error("%s", err)
        status = "oom" if err.out_of_memory else "failed"
        summary = {"status": status, "error": str(err), "world_size": nproc}
    except ConfigError as err:  # found only once the run directory exists (resume=auto)
        log.error("%s", err)
        summary = {"status": "failed", "error": str(err), "world_size": nproc}
    except KeyboardInterrupt:
        write_summary(run_dir, {"status": "interrupted", "world_size": nproc, **record})
        raise
    summary.update(record, wall_s=time.perf_counter() - start)
    write_summary(run_dir, summary)
    if summary["status"] == "ok":
        log.info("%s\n%s", run_dir / "summary.json", summary_table(summary))
    return summary
