"""From the resolved config to the trainer's object graph, on one rank.

This is where Hydra stops: each config group becomes an object here (`instantiate` on its
`_target_`), and the trainer receives only those objects.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from fsdp_exp.blocks import block_names, checkpoint_blocks, compile_blocks
from fsdp_exp.distributed import Ranks
from fsdp_exp.metrics import Console, JsonLines, Wandb
from fsdp_exp.models import build_model
from fsdp_exp.sharding import unwrap
from fsdp_exp.sharding.wrap import unit_sizes
from fsdp_exp.trainer import Trainer

T = TypeVar("T")
log = logging.getLogger("fsdp_exp")


@dataclass
class Experiment:
    trainer: Trainer
    checkpoint: Any
    wandb: Wandb | None
    jsonl: JsonLines | None
    fsdp_units: list[dict]


def rank0_first(ranks: Ranks, make: Callable[[], T]) -> T:
    """Rank 0 makes it first (a download, a cache), then the others."""
    if not ranks.is_main and dist.is_initialized():
        dist.barrier()
    made = make()
    if ranks.is_main and dist.is_initialized():
        dist.barrier()
    return made


def build_model_for_training(cfg: dict, sharding: Any, precision: Any, ranks: Ranks) -> tuple[nn.Module, list[dict]]:
    """The model with its per-block transforms and sharding applied, and its FSDP units.

    With `model.init_device=meta` the model is built without memory, sharded, and only
    then given storage: each rank holds just its shards. The weights are those of a plain
    build with the same seed, made once on rank 0's CPU and sent out shard by shard
    (DTensor's own random init is wrong on a CPU mesh).
    """
    train, meta = cfg["train"], cfg["model"]["init_device"] == "meta"
    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank
    with torch.device("meta") if meta else contextlib.nullcontext():
        model, blocks = build_model(cfg["model"])
    units = sharding.select_units(model, blocks)
    fsdp_units = unit_sizes(model, units) if sharding.shards_params else []
    names = block_names(model, blocks)
    if train["activation_checkpointing"]:
        checkpoint_blocks(model, names)
    if train["compile"]:
        compile_blocks(model, names)
    if not meta:
        model.to(ranks.device)
    model = sharding.apply(model, units, ranks.device, precision, offload=cfg["offload"])
    if meta:
        model.to_empty(device="cpu" if cfg["offload"] else ranks.device)
        full_state: dict = {}
        if ranks.is_main:
            torch.manual_seed(cfg["seed"])
            full_state = build_model(cfg["model"])[0].state_dict()
        set_model_state_dict(
            unwrap(model), full_state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
    return model, fsdp_units


def build_experiment(cfg: dict, ranks: Ranks, run_dir: Path) -> Experiment:
    precision = instantiate(cfg["precision"])
    sharding = instantiate(cfg["sharding"])
    model, fsdp_units = build_model_for_training(cfg, sharding, precision, ranks)
    optimizer = instantiate(cfg["optimizer"])(model.parameters())

    train = cfg["train"]
    data = instantiate(cfg["data"])
    micro_batch = train["batch_size"] // train["grad_accum"]
    batches = rank0_first(
        ranks,
        lambda: data.batches(micro_batch, ranks.rank, ranks.world_size, cfg["seed"],
                             pin_memory=ranks.device.type == "cuda"),
    )

    sinks: list = []
    jsonl = wandb = None
    if ranks.is_main:
        if fsdp_units:
            log.info("FSDP units: %s", ", ".join(f"{u['module']} ({u['params']:,})" for u in fsdp_units))
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
        grad_accum=train["grad_accum"],
        grad_scaler=precision.grad_scaler(ranks.device.type),
        tokens_per_sample=data.tokens_per_sample,
    )
    return Experiment(trainer, instantiate(cfg["checkpoint"]), wandb, jsonl, fsdp_units)
