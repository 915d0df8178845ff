"""From the resolved config to the trainer's object graph, on one rank.

This is where Hydra stops: each config group becomes an object here (`instantiate` on its
`_target_`), and the trainer receives only those objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from fsdp_exp.distributed import Ranks
from fsdp_exp.metrics import Console, JsonLines, Wandb
from fsdp_exp.models import build_model
from fsdp_exp.trainer import Trainer

T = TypeVar("T")


@dataclass
class Experiment:
    trainer: Trainer
    checkpoint: Any
    wandb: Wandb | None
    jsonl: JsonLines | None


def rank0_first(ranks: Ranks, make: Callable[[], T]) -> T:
    """Rank 0 makes it first (a download, a cache), then the others."""
    if not ranks.is_main and dist.is_initialized():
        dist.barrier()
    made = make()
    if ranks.is_main and dist.is_initialized():
        dist.barrier()
    return made


def build_experiment(cfg: dict, ranks: Ranks, run_dir: Path) -> Experiment:
    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank
    model, blocks = build_model(cfg["model"])
    model.to(ranks.device)
    precision = instantiate(cfg["precision"])
    sharding = instantiate(cfg["sharding"])
    model = sharding.apply(model, blocks, ranks.mesh, precision, offload=cfg["offload"])
    optimizer = instantiate(cfg["optimizer"])(model.parameters())

    train = cfg["train"]
    data = instantiate(cfg["data"])
    batches = rank0_first(
        ranks,
        lambda: data.batches(
            train["batch_size"], ranks.rank, ranks.world_size, cfg["seed"],
            pin_memory=ranks.device.type == "cuda",
        ),
    )

    sinks: list = []
    jsonl = wandb = None
    if ranks.is_main:
        jsonl = JsonLines(run_dir / "metrics.jsonl")
        w = cfg["wandb"]
        wandb = Wandb(
            mode=w["mode"], project=w["project"], entity=w["entity"], group=w["group"],
            tags=w["tags"], config=cfg, run_dir=run_dir, job_type="train",
        )
        sinks = [jsonl, Console(train["steps"]), wandb]
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        batches=batches,
        ranks=ranks,
        steps=train["steps"],
        batch_size=train["batch_size"],
        log_every=train["log_every"],
        warmup_steps=cfg["metrics"]["warmup_steps"],
        sinks=sinks,
    )
    return Experiment(trainer, instantiate(cfg["checkpoint"]), wandb, jsonl)
