"""One run on the driver: resolve the config, start the task's ranks, write summary.json.

The driver is the only writer of summary.json, so a run whose ranks died still gets one,
with status "failed" and the error; rank 0 streams metrics.jsonl as it trains.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fsdp_exp import config
from fsdp_exp.blocks import check_compile
from fsdp_exp.config import ConfigError
from fsdp_exp.launch import RunFailed
from fsdp_exp.memory import check_limit
from fsdp_exp.metrics.environment import environment
from fsdp_exp.metrics.sinks import resolve_wandb_mode, summary_table, write_summary
from fsdp_exp.models import block_classes

log = logging.getLogger("fsdp_exp")


def resolve_device(device: str, gpu_count: int) -> str:
    if device == "auto":
        return "cuda" if gpu_count > 0 else "cpu"
    return device


def ranks_run_here(launcher: DictConfig) -> bool:
    """Whether the ranks run on this machine (local, torchrun, slurm's local executor, a
    Ray started here) or on a cluster's (slurm, ray)."""
    if launcher.get("cluster") == "local" or ("address" in launcher and launcher.address is None):
        return True
    return "gpus_per_node" not in launcher and "use_gpu" not in launcher


def gpus_for_ranks(launcher: DictConfig, local_gpus: int) -> int:
    """The GPUs the ranks will have: this machine's, or on a cluster what the launcher asks for."""
    if "gpus_per_node" in launcher:
        return launcher.gpus_per_node
    if "use_gpu" in launcher:
        return launcher.num_workers if launcher.use_gpu else 0
    return local_gpus


def build(node: DictConfig) -> Any:
    """`instantiate`, but a ConfigError from the object's own checks stays a ConfigError."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        raise


@dataclass
class RunPlan:
    """What the driver starts: how many ranks, and the resolved config they receive."""

    cfg: dict
    nproc: int
    launcher: Any
    task: Any


def prepare(cfg: DictConfig, gpu_count: int, overrides: list[str], group: str | None = None,
            world_size: int | None = None, job_type: str = "train") -> RunPlan:
    """Check everything that can be checked before a rank starts, and resolve the config.

    `sharding=none` runs one process on the global batch of the ranks it stands in for,
    so its losses are the reference the sharded runs must match. `world_size`: given
    by an external torchrun; otherwise the launcher decides.
    """
    gpu_count = gpus_for_ranks(cfg.launcher, gpu_count)
    config.check(cfg, gpu_count)
    # The hydra node, when present, only resolves inside Hydra's own runtime.
    experiment = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    resolved = OmegaConf.to_container(experiment, resolve=True, enum_to_str=True)
    assert isinstance(resolved, dict)
    resolved["device"] = resolve_device(resolved["device"], gpu_count)
    wandb = resolved["wandb"]
    # The id is fixed here, once: ranks restarted or requeued from this config log to the same run.
    wandb.update(mode=resolve_wandb_mode(wandb["mode"]), tags=list(wandb["tags"]) + overrides,
                 group=wandb["group"] or group, job_type=job_type, id=wandb["id"] or uuid.uuid4().hex[:16])

    launcher = build(cfg.launcher)
    sharding = build(cfg.sharding)
    world = world_size or launcher.ranks(on_gpu=resolved["device"] == "cuda")
    # model.blocks, or else the classes the model names itself (model=hf), built on meta
    has_blocks = bool(cfg.model.blocks) or bool(block_classes(resolved["model"]))
    sharding.check(world, has_blocks=has_blocks, offload=cfg.offload)
    if resolved["model"]["init_device"] == "meta" and not sharding.shards_params:
        raise ConfigError("model.init_device=meta: needs sharding=full, grad_op or hybrid to shard the model")
    if cfg.train.compile:
        check_compile(resolved["device"])
    nproc = world if sharding.distributed else 1
    if ranks_run_here(cfg.launcher):
        check_limit(cfg.memory.limit_gb, resolved["device"], 1 if resolved["device"] == "cuda" else nproc)
    task = build(cfg.task)
    task.check(resolved)
    if not sharding.distributed:
        resolved["train"]["batch_size"] *= world
    return RunPlan(resolved, nproc, launcher, task)


def run_experiment(
    cfg: DictConfig,
    run_dir: Path,
    overrides: list[str],
    choices: dict[str, str],
    group: str | None = None,
) -> dict:
    plan = prepare(cfg, torch.cuda.device_count(), overrides, group, job_type=choices.get("task", "train"))
    nproc = plan.nproc
    plan.cfg["environment"] = environment(plan.cfg["device"], nproc, overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"overrides": overrides, "choices": choices, "device": plan.cfg["device"],
              "environment": plan.cfg["environment"]}
    start = time.perf_counter()
    try:
        figures = plan.task.run(plan.cfg, run_dir, plan.launcher, nproc)
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
