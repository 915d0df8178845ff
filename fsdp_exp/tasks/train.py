"""task=train: one launch of all ranks, training for train.steps steps."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.checkpoint.export import export_full_model
from fsdp_exp.checkpoint.resume import resolve_resume, restart_count, resume_point
from fsdp_exp.estimate.beside import EstimateBeside, wait_for_estimate
from fsdp_exp.estimate.settle import checked
from fsdp_exp.memory import (
    OutOfMemory,
    allocation_failure,
    apply_limit,
    held_before_limit_gb,
    is_out_of_memory,
    peak_under_limit_gb,
    records_history,
    under_limit_figures,
)
from fsdp_exp.metrics.environment import rank_environment, write_device_record
from fsdp_exp.metrics.peaks import device_used_gb, mark_runtime
from fsdp_exp.metrics.sinks import ESTIMATE_LATER, estimate_line
from fsdp_exp.metrics.startup import in_order, process_started
from fsdp_exp.profile import dump_cuda_snapshot, record_allocation_history
from fsdp_exp.rank import distributed, worker
from fsdp_exp.rank.build import build_experiment, start_wandb
from fsdp_exp.tasks import Task

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.launch.core import Launcher
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


@dataclass
class Train(Task):
    trains_at_the_batch = True
    runs_as_torchruns_ranks = True

    def check(self, exp: Experiment) -> None:
        """The checkpoint to resume from, when one is named, must be usable."""
        named = exp.checkpoint.dir
        resolve_resume(exp, Path(named).expanduser().resolve() if named else None)

    def settle(self, exp: Experiment, context: RunContext, run_dir: Path) -> None:
        """The checkpoint the run starts from, as an absolute path (or None), so every rank
        reads the same one."""
        context.resume = resolve_resume(exp, exp.checkpoint.dir_for(run_dir))
        if context.resume:
            log.info("resuming from %s", context.resume)

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher, nproc: int) -> dict:
        self.settle(exp, context, run_dir)
        beside = EstimateBeside(exp, nproc, run_dir, launcher.ranks_per_node(nproc)) if exp.memory.estimate else None
        if beside is not None and launcher.runs_here:  # rank 0 sees the file; else the driver adds it
            context.estimate_file = str(beside.path)
        context.startup["launched"] = time.time()
        try:
            figures = launcher.launch(partial(train_rank, context=context), exp, run_dir, nproc)
        except KeyboardInterrupt:
            if beside is not None:
                beside.stop()
            raise
        return beside.add_to(figures) if beside is not None else figures


def estimate_checked(summary: dict, path: Path) -> dict:
    """Rank 0: the driver's estimate of this run beside what it measured, if it is traced
    by now (fsdp_exp.estimate.beside); nothing if not (it is added to summary.json later)."""
    record, waited = wait_for_estimate(path)
    if record is None:
        log.info("the estimate of this run is still tracing: %s", ESTIMATE_LATER)
        return {"estimate_wait_s": waited}
    found = checked(summary, record) | {"estimate_wait_s": waited}
    log.info("task=estimate against this run: %s", estimate_line(summary | found))
    return found


def train_rank(cfg: Experiment, run_dir: Path, context: RunContext, probe: bool = False) -> dict:
    """One rank's whole training run; returns the run's figures (the same on every rank).
    `context`: this rank's copy of the run's (it adds its start-up marks). `probe`: it is a
    probe of task=max_batch (fsdp_exp.tasks.max_batch.probe.probe_rank)."""
    context.startup.update(rank_started=process_started(), rank_ready=time.time())
    if probe:
        worker.console_warnings_only()
    ranks = distributed.init(cfg.device, cfg.offload)
    context.startup["process_group"] = time.time()
    if records_history(cfg.memory.limit_gb, probe):
        record_allocation_history(ranks.device)
    if ranks.is_main:  # the run's device is rank 0's, not the driver's
        seen = rank_environment(ranks.device)
        write_device_record(run_dir, seen)
        context.environment.update(seen)
    # Under a multi-node launch every node's command chose its own run directory:
    # the checkpoints are rank 0's, so every rank saves into and resumes from those.
    ckpt_dir, settled = distributed.from_main((cfg.checkpoint.dir_for(run_dir), context.resume))
    limit_gb = cfg.memory.limit_gb
    # The model's module is imported before the runtime is marked, whatever started the
    # rank (forked from the rank server, which imported it already, or fresh): its import
    # is runtime under every launcher, not part of the run's own peak.
    cfg.model.builder()
    wandb = start_wandb(cfg, ranks, run_dir, context)
    runtime = mark_runtime(ranks.device)
    try:
        apply_limit(limit_gb, ranks.device)
        if ranks.is_main:
            log.info("%d rank(s) on %s, run directory %s", ranks.world_size, ranks.device.type, run_dir)
        mine, restored = worker.restarts()
        restarts = restart_count(ranks.device, mine)
        resume = resume_point(ckpt_dir, settled, restarts, restored)
        if restarts and ranks.is_main:
            log.warning("restart %d of the ranks, from %s", restarts, resume or "step 0 (no checkpoint yet)")
        exp = build_experiment(cfg, ranks, run_dir, context, ckpt_dir, resume, probe, wandb, runtime)
        context.startup["ready"] = time.time()
        try:
            summary = exp.trainer.fit() | exp.figures | {"startup": in_order(context.startup)}
            if ranks.device.type == "cpu":  # left out of peak_mem_gb (fsdp_exp.metrics.peaks)
                summary["runtime_gb"] = max(distributed.gather(runtime.gb, ranks.device))
            counted = held = None
            mine = peak_under_limit_gb()
            if mine is not None:  # CPU under a limit, on every rank alike
                counted = distributed.gather(mine, ranks.device)
                held = distributed.gather(held_before_limit_gb(), ranks.device)
            summary |= under_limit_figures(limit_gb, ranks.device.type, summary, counted, held)
            if ranks.device.type == "cuda" and summary.get("peak_reserved_gb_per_rank"):  # none: nothing trained
                used = device_used_gb(ranks.device, summary["peak_reserved_gb_per_rank"][ranks.rank])
                summary["device_used_gb_per_rank"] = distributed.gather(used, ranks.device)
                summary["device_used_gb"] = max(summary["device_used_gb_per_rank"])
            if ranks.is_main and context.estimate_file:
                summary |= estimate_checked(summary, Path(context.estimate_file))
        finally:
            if exp.progress is not None:
                exp.progress.close()
        if cfg.checkpoint.export_full:
            export_full_model(exp.trainer.model, run_dir / "model.safetensors")
        if exp.wandb is not None:
            exp.wandb.finish(summary)
        if exp.jsonl is not None:
            exp.jsonl.close()
        return summary
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        dump_cuda_snapshot(run_dir / f"oom_snapshot_rank{ranks.rank}.pickle", ranks.device)
        limit = f" under memory.limit_gb={limit_gb}" if limit_gb else ""
        raise OutOfMemory(f"ran out of memory{limit}: {allocation_failure(err)}") from err
    finally:
        distributed.close()
