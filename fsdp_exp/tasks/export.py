"""task=export: a DCP checkpoint's model as one file of full, unsharded weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from fsdp_exp.checkpoint.export import FORMATS, load_weights, save_weights
from fsdp_exp.checkpoint.resume import open_checked
from fsdp_exp.errors import ConfigError, choice
from fsdp_exp.metrics.figures import ExportAnswer
from fsdp_exp.models import ModelSpec
from fsdp_exp.tasks import Task

Format = choice("Format", FORMATS, __name__)

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.launcher.core import Launcher
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


def plain_model(spec: ModelSpec) -> torch.nn.Module:
    """The model without sharding, on CPU, with storage but no initialisation (the
    weights come from a file next). A model with a buffer in no state dict (a mask, a
    position table), which only its build computes, is built for real."""
    with torch.device("meta"):
        model, _ = spec.build()
    if any(module._buffers[name] is not None and module._buffers[name].device.type == "meta"
           for module in model.modules() for name in module._non_persistent_buffers_set):
        return spec.build()[0]
    return model.to_empty(device="cpu")


@dataclass
class Export(Task):
    runs_in_driver: ClassVar[bool] = True

    checkpoint: str | None = None  # a step_* directory, or a checkpoint.dir (its latest)
    format: Format = Format["safetensors"]  # safetensors -> model.safetensors | pt -> model.pt

    def check(self, exp: Experiment) -> None:
        if self.checkpoint is None:
            raise ConfigError("task.checkpoint: task=export needs a checkpoint (a step_* directory or a checkpoint.dir)")
        open_checked(self.checkpoint, exp.model, "task.checkpoint")

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher, nproc: int) -> ExportAnswer:
        """In this process on CPU: the weights are read shard by shard from the files, so
        no GPU ever holds the whole model."""
        checkpoint = open_checked(self.checkpoint, exp.model, "task.checkpoint")
        model = plain_model(exp.model)
        load_weights(model, checkpoint.path, "task.checkpoint")
        out = Path(run_dir) / FORMATS[self.format]
        save_weights(model.state_dict(), out)
        params = sum(p.numel() for p in model.parameters())
        log.info("exported %s (step %d, %s parameters) to %s", checkpoint.path, checkpoint.step, f"{params:,}", out)
        return ExportAnswer(exported=str(out), checkpoint=str(checkpoint.path), step=checkpoint.step, params=params)
