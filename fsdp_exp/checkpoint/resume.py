"""Which checkpoint a run resumes from. On the driver, before any rank starts: whether
it can (complete, the same model, not already past train.steps), and whether the run
may write into checkpoint.dir. On the ranks: where a restarted run starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fsdp_exp.checkpoint.files import (
    Checkpoint,
    CheckpointError,
    latest,
    model_differences,
    open_checkpoint,
)
from fsdp_exp import distributed
from fsdp_exp.errors import ConfigError
from fsdp_exp.models import ModelSpec

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment


def model_shapes(model: ModelSpec) -> dict[str, list[int]]:
    """The plain model's state-dict shapes, built on the meta device (no memory)."""
    with torch.device("meta"):
        built, _ = model.build()
    return {name: list(t.shape) for name, t in built.state_dict().items()}


def check_same_model(checkpoint: Checkpoint, model: ModelSpec, key: str) -> None:
    differences = model_differences(checkpoint, model_shapes(model), model.as_dict())
    if differences:
        more = f"; and {len(differences) - 4} more" if len(differences) > 4 else ""
        raise ConfigError(f"{key}={checkpoint.path}: saved from a different model: "
                          f"{'; '.join(differences[:4])}{more}")


def open_checked(path: str | Path, model: ModelSpec, key: str) -> Checkpoint:
    """The checkpoint at `path`, complete and of this model, or a ConfigError saying why."""
    try:
        checkpoint = open_checkpoint(Path(path), key)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    check_same_model(checkpoint, model, key)
    return checkpoint


def resolve_resume(cfg: Experiment, root: Path | None) -> str | None:
    """The checkpoint to resume from, as an absolute path, or None for a fresh start.

    `root`: where the run keeps its checkpoints (None: it saves none, or the run directory
    is not made yet). `resume=auto`: the latest in it, if it has one. `resume=<path>`: that
    checkpoint (or that directory's latest). A fresh run refuses a checkpoint.dir that
    holds another run's checkpoints unless checkpoint.overwrite=true.
    """
    resume, ckpt = cfg.resume, cfg.checkpoint
    if resume is None:
        if root is not None and latest(root) is not None and not ckpt.overwrite:
            raise ConfigError(
                f"checkpoint.dir={root}: holds another run's checkpoints (latest {latest(root).name}); "
                "set resume=auto to continue it, or checkpoint.overwrite=true to write over it")
        return None
    if resume == "auto":
        if root is None or latest(root) is None:
            return None
        resume = str(root)
    checkpoint = open_checked(resume, cfg.model, "resume")
    if checkpoint.step >= cfg.train.steps:
        raise ConfigError(f"resume={checkpoint.path}: already at step {checkpoint.step} of "
                          f"train.steps={cfg.train.steps}; raise train.steps to train further")
    return str(checkpoint.path)


def restart_count(device: torch.device, mine: int) -> int:
    """On a rank: how many times the launcher has restarted the ranks, from this rank's
    count (`fsdp_exp.rank.worker.restarts`). The largest count over the ranks: under a
    multi-node torchrun only the agent whose rank failed counts a restart, and the other
    nodes' ranks just join its new round."""
    return int(max(distributed.gather(float(mine), device)))


def resume_point(root: Path | None, settled: str | None, restarts: int,
                 restored: str | None = None) -> Path | None:
    """On a rank: the checkpoint to start from. After the launcher restarted the ranks, the
    checkpoint it `restored` (a launcher that keeps its own copies: Ray), or else the latest
    in `root` (checkpoint.dir); otherwise the one the driver `settled` on."""
    if restarts and restored:
        return Path(restored)
    if restarts and root and latest(Path(root)) is not None:
        return latest(Path(root))
    return Path(settled) if settled else None
