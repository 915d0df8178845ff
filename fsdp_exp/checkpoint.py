"""conf/checkpoint/*: what is saved during and after training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from fsdp_exp.sharding import unwrap


def export_full_model(model: nn.Module, path: Path) -> None:
    """Gather the full, unsharded weights to rank 0's CPU memory and write one file.

    Every rank must call this (the gather is a collective); only rank 0 writes.
    """
    state = get_model_state_dict(
        unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))


@dataclass
class NoCheckpoint:
    """checkpoint=none: nothing saved during training."""

    export_full: bool = False

    def finish(self, model: nn.Module, run_dir: Path) -> None:
        if self.export_full:
            export_full_model(model, Path(run_dir) / "model.safetensors")
