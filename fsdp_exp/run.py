"""One run on the driver: resolve the config, start the task's ranks, write summary.json.

The driver is the only writer of summary.json, so a run whose ranks died still gets one,
with status "failed" and the error; rank 0 streams metrics.jsonl as it trains.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fsdp_exp import config
from fsdp_exp.launch import RunFailed
from fsdp_exp.metrics import write_summary

log = logging.getLogger("fsdp_exp")


def resolve_device(device: str, gpu_count: int) -> str:
    if device == "auto":
        return "cuda" if gpu_count > 0 else "cpu"
    return device


def run_experiment(
    cfg: DictConfig,
    run_dir: Path,
    overrides: list[str],
    choices: dict[str, str],
    group: str | None = None,
) -> dict:
    gpu_count = torch.cuda.device_count()
    config.check(cfg, gpu_count)
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(resolved, dict)
    resolved.pop("hydra", None)
    resolved["device"] = resolve_device(resolved["device"], gpu_count)
    resolved["wandb"]["tags"] = list(resolved["wandb"]["tags"]) + overrides
    resolved["wandb"]["group"] = resolved["wandb"]["group"] or group

    launcher = instantiate(cfg.launcher)
    sharding = instantiate(cfg.sharding)
    nproc = launcher.ranks(on_gpu=resolved["device"] == "cuda", shards_params=sharding.shards_params)
    task = instantiate(cfg.task)

    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"overrides": overrides, "choices": choices, "device": resolved["device"]}
    start = time.perf_counter()
    try:
        figures = task.run(resolved, run_dir, launcher, nproc)
        summary = {"status": "ok", **figures}
    except RunFailed as err:
        log.error("%s", err)
        summary = {"status": "failed", "error": str(err), "world_size": nproc}
    except KeyboardInterrupt:
        write_summary(run_dir, {"status": "interrupted", "world_size": nproc, **record})
        raise
    summary.update(record, wall_s=time.perf_counter() - start)
    write_summary(run_dir, summary)
    if summary["status"] == "ok":
        log.info(
            "done: %d steps, final loss %.4f, %.1f samples/s, peak %.2f GB per rank -> %s",
            summary["steps"], summary["final_loss"], summary["samples_per_s"],
            summary["peak_mem_gb"], run_dir / "summary.json",
        )
    return summary
