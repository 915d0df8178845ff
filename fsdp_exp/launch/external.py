"""Under an external `torchrun --nproc_per_node=N -m fsdp_exp ...`: this process is one rank.

Every rank composes the same config and goes through the driver's own code
(`fsdp_exp.driver.run.run_experiment`), with `ExternalLauncher` in place of the configured
launcher: torchrun has already started the ranks, so a launch runs the task in this
process. Rank 0 picks the run directory and shares it, so the ranks of one run write into
one directory, and rank 0 writes its summary.json, with the same records as any run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from hydra.core.utils import setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from fsdp_exp.driver.plan import prepare
from fsdp_exp.driver.run import run_experiment
from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.launch.core import RunFailed
from fsdp_exp.rank import distributed
from fsdp_exp.rank.worker import rank_log_path, run_rank
from fsdp_exp.tasks.train import Train

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment


@dataclass
class ExternalLauncher:
    """The ranks a torchrun the user started; this process is `rank` of them."""

    rank: int
    world: int
    restarts = 0  # torchrun's own --max-restarts restart the ranks; they resume as after any restart
    restarts_key = "torchrun --max-restarts"
    runs_here = True
    starts_all_ranks = False  # each process is one rank; torchrun started the others
    max_parallel = 1

    def world_size(self, gpus: int) -> int:
        return self.world

    def gpus(self, local_gpus: int) -> int:
        return local_gpus

    def connect(self, nproc: int, at_once: int) -> None:
        """torchrun has started the ranks."""

    def launch(self, task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any:
        """This rank's task, here; a failure as RunFailed naming this rank."""
        try:
            return run_rank(task, cfg, str(run_dir), None)
        except Exception as err:  # noqa: BLE001 - the run's summary records it, the exit code says it
            line = one_line(err, named=True, whole=True)
            raise RunFailed(f"rank {self.rank} failed: {line} (log: {rank_log_path(run_dir, self.rank)})",
                            out_of_memory=line.startswith("OutOfMemory:")) from err


def refuse(rank: int, reason: str) -> int:
    """Rank 0 says why, once; the others wait a moment before exiting, since torchrun
    stops every rank as soon as one exits, and could stop rank 0 before it has said it."""
    if rank == 0:
        print(f"fsdp_exp: {reason}", file=sys.stderr, flush=True)
    else:
        time.sleep(2)
    return 2


def run_as_worker(argv: list[str], compose: Callable[[list[str]], DictConfig]) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if any(arg in ("-m", "--multirun") for arg in argv):
        return refuse(rank, "-m (--multirun) does not run under torchrun; sweep without torchrun")
    setup_globals()  # Hydra's ${now:...} resolver, used by hydra.run.dir
    try:
        cfg = compose(argv)
        run_dir_text = str(OmegaConf.select(cfg, "hydra.run.dir"))  # resolves ${now:...}
        choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
        with open_dict(cfg):
            del cfg["hydra"]  # the rest of it only resolves inside Hydra's own runtime
        plan = prepare(cfg, torch.cuda.device_count(), world_size=world_size)
        if plan.nproc == 1 and world_size > 1:
            raise ConfigError("sharding=none: runs one process; start it without torchrun")
        if not isinstance(plan.task, Train):
            raise ConfigError("task=max_batch: starts fresh ranks for every probe, so it cannot run under "
                              "torchrun; run it as python -m fsdp_exp task=max_batch ...")
    except ConfigError as err:
        return refuse(rank, str(err))
    plan = replace(plan, exp=replace(plan.exp, launcher=ExternalLauncher(rank, world_size)))

    distributed.init(plan.exp.device, plan.exp.offload)
    run_dir = Path(distributed.from_main(run_dir_text))
    if rank == 0:
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
        OmegaConf.save(OmegaConf.create(argv), run_dir / ".hydra" / "overrides.yaml")
    dist.barrier()
    summary = run_experiment(plan, run_dir, argv, choices, writes_files=rank == 0)
    return 0 if summary["status"] == "ok" else 1
