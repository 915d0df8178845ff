"""task=export: a DCP checkpoint's model as one file of full, unsharded weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_exp.checkpoint.export import FORMATS, load_weights, save_weights
from fsdp_exp.checkpoint.resume import open_checked
from fsdp_exp.config import ConfigError
from fsdp_exp.models import build_model

log = logging.getLogger("fsdp_exp")


def plain_model(model_cfg: dict) -> torch.nn.Module:
    """The model without sharding, on CPU, with storage but no initialisation (the
    weights come from a file next)."""
    with torch.device("meta"):
        model, _ = build_model(model_cfg)
    return model.to_empty(device="cpu")


@dataclass
class Export:
    checkpoint: str | None = None
    format: str = "safetensors"

    def check(self, cfg: dict) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"task.format={self.format}: choose one of: {', '.join(FORMATS)}")
        if self.checkpoint is None:
            raise ConfigError("task.checkpoint: task=export needs a checkpoint (a step_* directory or a checkpoint.dir)")
        open_checked(self.checkpoint, cfg["model"], "task.checkpoint")

    def run(self, cfg: dict, run_dir: Path, launcher: Any, nproc: int) -> dict:
        """In this process on CPU: the weights are read shard by shard from the files, so
        no GPU ever holds the whole model."""
        checkpoint = open_checked(self.checkpoint, cfg["model"], "task.checkpoint")
        model = plain_model(cfg["model"])
        load_weights(model, checkpoint.path, "task.checkpoint")
        out = Path(run_dir) / FORMATS[self.format]
        save_weights(model.state_dict(), out)
        params = sum(p.numel() for p in model.parameters())
        log.info("exported %s (step %d, %s parameters) to %s", checkpoint.path, checkpoint.step, f"{params:,}", out)
        return {"exported": str(out), "checkpoint": str(checkpoint.path), "step": checkpoint.step, "params": params}
