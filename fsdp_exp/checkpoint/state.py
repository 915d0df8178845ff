"""What a checkpoint holds for one run, and how each rank saves and restores it.

Tensors (the sharded model and optimizer state) go through DCP, so each rank writes and
reads only its shards, at any world size. The rest is small and goes in JSON, never a
pickle: the step, the mean loss at it, the data position, the LR schedule, the loss scale,
the model config (rank 0's train_state.json) and each rank's RNG state (rng_rank<N>.json).
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_exp.checkpoint.files import TRAIN_STATE, SafeReader
from fsdp_exp.distributed import Ranks
from fsdp_exp.files import write_atomically
from fsdp_exp.sharding import unwrap

log = logging.getLogger("fsdp_exp")


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ranks: Ranks
    model_cfg: dict
    batches: Any = None  # fsdp_exp.data.Batches
    lr_schedule: Any = None
    grad_scaler: torch.amp.GradScaler | None = None

    def tensors(self) -> dict:
        """The model and optimizer state, as DTensor shards under FSDP."""
        model_state, optim_state = get_state_dict(unwrap(self.model), self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def write_small_state(self, path: Path, step: int, loss: float | None = None) -> None:
        """train_state.json (rank 0) and this rank's RNG state, before the tensors."""
        path.mkdir(parents=True, exist_ok=True)
        if self.ranks.is_main:
            state = {
                "step": step,
                "loss": loss,
                "world_size": self.ranks.world_size,
                "data": self.batches.state_dict() if self.batches is not None else None,
                "lr_schedule": _plain(self.lr_schedule.state_dict()) if self.lr_schedule else None,
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
                "model": self.model_cfg,
            }
            write_atomically(path / TRAIN_STATE, json.dumps(state, indent=1))
        write_atomically(path / f"rng_rank{self.ranks.rank}.json", json.dumps(_rng_state(self.ranks.device)))

    def load(self, path: Path) -> tuple[int, float | None]:
        """Restore everything from the checkpoint at `path`; the step it was saved at, and
        the loss at that step (None in a checkpoint that did not save it)."""
        state = self.tensors()
        dcp.load(state, storage_reader=SafeReader(path))
        set_state_dict(unwrap(self.model), self.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
        saved = json.loads((path / TRAIN_STATE).read_text())
        if self.batches is not None and saved["data"] is not None:
            self.batches.load_state_dict(saved["data"])
        if self.lr_schedule is not None and saved["lr_schedule"] is not None:
            self.lr_schedule.load_state_dict(saved["lr_schedule"])
        if self.grad_scaler is not None and saved["grad_scaler"]:
            self.grad_scaler.load_state_dict(saved["grad_scaler"])
        rng = path / f"rng_rank{self.ranks.rank}.json"
        if rng.is_file():
            _set_rng_state(json.loads(rng.read_text()), self.ranks.device)
        elif self.ranks.is_main:
            log.info("saved by %d rank(s): ranks beyond them start new random streams", saved["world_size"])
        return int(saved["step"]), saved.get("loss")


def _plain(state: dict) -> dict:
    """A scheduler's state_dict as JSON: LambdaLR keeps None for a plain function."""
    return json.loads(json.dumps(state, default=lambda _: None))


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(tensor(state["cuda"]), device)
