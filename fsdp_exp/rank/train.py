"""One rank of a training run (task=train, and each probe of task=max_batch), as four steps:
join (its process group, its figures of the machine), build (its memory limit and the
experiment on it), fit (train, and the figures added after it, fsdp_exp.rank.report) and
report (the figures to the trackers, the files closed, the model exported)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.checkpoint.export import export_full_model
from fsdp_exp.checkpoint.resume import restart_count, resume_point
from fsdp_exp import distributed
from fsdp_exp.distributed import Ranks
from fsdp_exp.memory import OutOfMemory, allocation_failure, apply_limit, is_out_of_memory, set_for_measuring
from fsdp_exp.metrics.environment import rank_environment, write_device_record
from fsdp_exp.metrics.peaks import mark_runtime
from fsdp_exp import linux
from fsdp_exp.metrics.summary import Summary
from fsdp_exp.profile import dump_cuda_snapshot, record_allocation_history
from fsdp_exp.rank import worker
from fsdp_exp.rank.build import Built, build_experiment, start_trackers
from fsdp_exp.rank.report import after_fit

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


def train_rank(cfg: Experiment, run_dir: Path, context: RunContext, probe: bool = False,
               against_estimate: Callable[[Summary, Path], dict] | None = None) -> dict:
    """One rank's whole training run; returns the run's figures (the same on every rank).
    `context`: this rank's copy of the run's (it adds its start-up marks). `probe`: it is a
    probe of task=max_batch. `against_estimate(summary, estimate_file)`: rank 0's figures of
    the run's own estimate beside what it measured, when the run has one (memory.estimate)."""
    ranks = join(cfg, run_dir, context, probe)
    try:
        with out_of_memory_explained(cfg.memory.limit_gb, ranks, run_dir):
            exp = build(cfg, ranks, run_dir, context, probe, against_estimate)
            context.startup["ready"] = time.time()
            try:
                summary = exp.trainer.fit()
            finally:
                if exp.progress is not None:
                    exp.progress.close()
            return report(cfg, exp, summary, run_dir)
    finally:
        distributed.close()


def join(cfg: Experiment, run_dir: Path, context: RunContext, probe: bool) -> Ranks:
    """The rank's process group; rank 0 records the device the run is on."""
    context.startup.update(rank_started=linux.process_started(), rank_ready=time.time())
    if probe:
        worker.console_warnings_only()
    set_for_measuring(cfg.device, cfg.memory.limit_gb, probe or cfg.memory.estimate)
    ranks = distributed.init(cfg.device, cfg.offload)
    context.startup["process_group"] = time.time()
    if cfg.profile.records_history:
        record_allocation_history(ranks.device)
    if ranks.is_main:  # the run's device is rank 0's, not the driver's
        seen = rank_environment(ranks.device)
        write_device_record(run_dir, seen)
        context.environment.update(seen)
    return ranks


def build(cfg: Experiment, ranks: Ranks, run_dir: Path, context: RunContext, probe: bool,
          against_estimate: Callable[[Summary, Path], dict] | None) -> Built:
    """The rank's runtime marked, its memory limit set, and every object of the run built on
    it, restored from the checkpoint a restart resumes from."""
    # Under a multi-node launch every node's command chose its own run directory:
    # the checkpoints are rank 0's, so every rank saves into and resumes from those.
    ckpt_dir, settled = distributed.from_main((cfg.checkpoint.dir_for(run_dir), context.resume))
    # The model's module is imported before the runtime is marked, whatever started the
    # rank (forked from the rank server, which imported it already, or fresh): its import
    # is runtime under every launcher, not part of the run's own peak.
    cfg.model.builder()
    trackers = start_trackers(cfg, ranks, run_dir, context)
    runtime = mark_runtime(ranks.device)
    apply_limit(cfg.memory.limit_gb, ranks.device)
    if ranks.is_main:
        log.info("%d rank(s) on %s, run directory %s", ranks.world_size, ranks.device.type, run_dir)
        if ranks.device.type == "cpu" and (lacking := linux.missing()) is not None:
            log.info(lacking)
    mine, restored = worker.restarts()
    restarts = restart_count(ranks.device, mine)
    resume = resume_point(ckpt_dir, settled, restarts, restored)
    if restarts and ranks.is_main:
        log.warning("restart %d of the ranks, from %s", restarts, resume or "step 0 (no checkpoint yet)")
    reports = after_fit(ranks, runtime, cfg.memory.limit_gb, context.estimate_file, against_estimate)
    return build_experiment(cfg, ranks, run_dir, context, ckpt_dir, resume, probe, trackers, runtime, reports)


def report(cfg: Experiment, exp: Built, summary: Summary, run_dir: Path) -> dict:
    """The run's figures, to its trackers (wandb, ...); its files closed, and the whole model exported when asked.
    The figures go back to the driver as summary.json names them (fsdp_exp.metrics.summary)."""
    figures = summary.as_dict()
    if cfg.checkpoint.export_full:
        export_full_model(exp.trainer.model, run_dir / "model.safetensors")
    for tracker in exp.trackers:
        tracker.finish(figures)
    if exp.jsonl is not None:
        exp.jsonl.close()
    return figures


@contextlib.contextmanager
def out_of_memory_explained(limit_gb: float | None, ranks: Ranks, run_dir: Path) -> Iterator[None]:
    """Running out of memory as one line (fsdp_exp.memory.OutOfMemory), with the GPU's
    allocation snapshot saved beside the run."""
    try:
        yield
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        dump_cuda_snapshot(run_dir / f"oom_snapshot_rank{ranks.rank}.pickle", ranks.device)
        limit = f" under memory.limit_gb={limit_gb}" if limit_gb else ""
        raise OutOfMemory(f"ran out of memory{limit}: {allocation_failure(err)}") from err
