"""Under an external `torchrun --nproc_per_node=N -m fsdp_exp ...`: this process is one rank.

Every rank composes the same config; rank 0 picks the run directory and shares it, so the
ranks of one run write into one directory, as with the built-in launcher.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.core.utils import setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from fsdp_exp import distributed
from fsdp_exp.errors import ConfigError
from fsdp_exp.launch.worker import setup_rank
from fsdp_exp.metrics.environment import environment
from fsdp_exp.metrics.sinks import write_summary
from fsdp_exp.plan import prepare
from fsdp_exp.tasks.train import Train, train_rank


def refuse(rank: int, reason: str) -> int:
    """Rank 0 says why, once; the others wait a moment before exiting, since torchrun
    stops every rank as soon as one exits, and could stop rank 0 before it has said it."""
    if rank == 0:
        print(f"fsdp_exp: {reason}", file=sys.stderr, flush=True)
    else:
        time.sleep(2)
    return 2


def run_as_worker(argv: list[str], compose: Callable[[list[str]], DictConfig]) -> int:
    rank = int(os.environ["RANK"])
    if any(arg in ("-m", "--multirun") for arg in argv):
        return refuse(rank, "-m (--multirun) does not run under torchrun; sweep without torchrun")
    setup_globals()  # Hydra's ${now:...} resolver, used by hydra.run.dir
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        cfg = compose(argv)
        run_dir_text = str(OmegaConf.select(cfg, "hydra.run.dir"))  # resolves ${now:...}
        with open_dict(cfg):
            del cfg["hydra"]  # the rest of it only resolves inside Hydra's own runtime
        plan = prepare(cfg, torch.cuda.device_count(), argv, world_size=world_size)
        if plan.nproc == 1 and world_size > 1:
            raise ConfigError("sharding=none: runs one process; start it without torchrun")
        if not isinstance(plan.task, Train):
            raise ConfigError("task=max_batch: starts fresh ranks for every probe, so it cannot run under "
                              "torchrun; run it as python -m fsdp_exp task=max_batch ...")
    except ConfigError as err:
        return refuse(rank, str(err))
    exp = plan.exp
    exp.environment = environment(world_size, argv)

    distributed.init(exp.device)
    shared = [run_dir_text]
    dist.broadcast_object_list(shared, src=0)
    run_dir = Path(shared[0])
    if rank == 0:
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
        OmegaConf.save(OmegaConf.create(argv), run_dir / ".hydra" / "overrides.yaml")
    dist.barrier()
    setup_rank(run_dir, rank)
    try:
        plan.task.settle(exp, run_dir)
    except ConfigError as err:
        return refuse(rank, str(err))

    try:
        figures = train_rank(exp, run_dir)
    except Exception as err:
        if rank == 0:
            write_summary(run_dir, {"status": "failed", "error": f"{type(err).__name__}: {err}"})
        raise
    if rank == 0:
        write_summary(run_dir, {"status": "ok", **figures, "overrides": argv, "device": str(exp.device)})
    return 0
