"""Where each run's figures go: metrics.jsonl, the console, wandb; and peak memory."""

from __future__ import annotations

import json
import logging
import resource
import warnings
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fsdp_exp")


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: max allocated on a GPU, peak resident memory (VmHWM) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class JsonLines:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


class Console:
    def __init__(self, total_steps: int):
        self.width = len(str(total_steps))
        self.total_steps = total_steps

    def log(self, record: dict) -> None:
        log.info(
            "step %*d/%d  loss %.4f  %.1f samples/s  %.3f s/step  peak %.2f GB",
            self.width, record["step"], self.total_steps, record["loss"],
            record["samples_per_s"], record["step_time_s"], record["peak_mem_gb"],
        )


class Wandb:
    """Mirrors the records to a wandb run. A wandb failure is one warning; training goes on."""

    def __init__(self, mode: str, project: str, entity: str | None, group: str | None,
                 tags: list[str], config: dict, run_dir: Path, job_type: str):
        self.run: Any = None
        if mode == "disabled":
            return
        try:
            import wandb

            self.run = wandb.init(
                mode=mode, project=project, entity=entity, group=group, tags=tags or None,
                config=config, dir=str(run_dir), job_type=job_type, name=run_dir.name,
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as err:  # noqa: BLE001 - any wandb failure must not stop training
            warnings.warn(f"wandb: {type(err).__name__}: {err}; training goes on without it")

    def log(self, record: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self, summary: dict) -> None:
        if self.run is None:
            return
        self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, list)})
        self.run.finish()


def write_summary(run_dir: Path, summary: dict) -> None:
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
