"""Under an external `torchrun --nproc_per_node=N -m fsdp_exp ...`: this process is one rank.

Rank 0 composes and checks the config, once, and shares the plan it made (and the run
directory it picked) through torchrun's store before any process group exists; a refusal
is one line from rank 0, and every rank exits 2. Each rank then goes through the driver's
own code (`fsdp_exp.driver.run.run_experiment`) with `ExternalLauncher` in place of the
configured launcher: torchrun has already started the ranks, so a launch runs the task in
this process. The ranks of one run write into one directory, and rank 0 writes its
summary.json, with the same records as any run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.core.utils import setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from fsdp_exp import distributed
from fsdp_exp.config import Device, Experiment
from fsdp_exp.driver.outcomes import exit_code
from fsdp_exp.driver.plan import RunPlan, prepare
from fsdp_exp.driver.run import run_experiment
from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.launcher.core import RunFailed
from fsdp_exp.rank.worker import rank_log_path, run_rank


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

    def ranks_per_node(self, world: int) -> int:
        """torchrun's LOCAL_WORLD_SIZE: the ranks it started on this node."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))

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


STORE_TIMEOUT_S = 600  # the ranks wait this long for rank 0's plan, as long as for the process group
READ_WAIT_S = 30  # a refusing rank 0 waits at most this long for the others to read it
PLAN_KEY, COUNT_KEY, READ_KEY = "plan", "plans_read", "plan_read_by_all"


@dataclass
class SharedPlan:
    """What rank 0 made of the command line, for every rank: the plan, the run directory
    (Hydra's ${now:...} resolved once) and the config groups chosen; or why it refused."""

    plan: RunPlan | None = None
    run_dir: str = ""
    choices: dict | None = None
    refused: str | None = None


def run_as_worker(argv: list[str], compose: Callable[[list[str]], DictConfig]) -> int:
    store, rank, world_size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)))
    shared = dist.PrefixStore("fsdp_exp", store)
    if rank == 0:
        made, cfg = plan_here(argv, compose, world_size)
        if made.refused:
            print(f"fsdp_exp: {made.refused}", file=sys.stderr, flush=True)
        shared.set(PLAN_KEY, pickle.dumps(made))
        if made.refused:  # rank 0 may host the store: it stays until every rank has read why
            with contextlib.suppress(dist.DistError):
                shared.wait([READ_KEY], datetime.timedelta(seconds=READ_WAIT_S))
            return 2
    else:
        try:
            made, cfg = pickle.loads(shared.get(PLAN_KEY)), None
        except dist.DistError as err:
            print(f"fsdp_exp: rank {rank} got no plan from rank 0: {one_line(err)}", file=sys.stderr, flush=True)
            return 1
        if shared.add(COUNT_KEY, 1) == world_size - 1:
            shared.set(READ_KEY, "")
        if made.refused:
            return 2
    exp = made.plan.exp
    if rank != 0:  # rank 0 alone traces the run's estimate (memory.estimate) and writes the records
        exp = replace(exp, memory=replace(exp.memory, estimate=False))
    plan = replace(made.plan, exp=replace(exp, launcher=ExternalLauncher(rank, world_size)))

    distributed.init(plan.exp.device, plan.exp.offload, store=store)
    run_dir = Path(made.run_dir)
    if rank == 0:
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
        OmegaConf.save(OmegaConf.create(argv), run_dir / ".hydra" / "overrides.yaml")
    dist.barrier()
    summary = run_experiment(plan, run_dir, argv, made.choices, writes_files=rank == 0)
    return exit_code([summary])


def plan_here(argv: list[str], compose: Callable[[list[str]], DictConfig],
              world_size: int) -> tuple[SharedPlan, DictConfig | None]:
    """Rank 0's part: the config composed and checked, as the plan every rank runs."""
    if any(arg in ("-m", "--multirun") for arg in argv):
        return SharedPlan(refused="-m (--multirun) does not run under torchrun; sweep without torchrun"), None
    setup_globals()  # Hydra's ${now:...} resolver, used by hydra.run.dir
    try:
        cfg = compose(argv)
        run_dir = str(OmegaConf.select(cfg, "hydra.run.dir"))  # resolves ${now:...}
        choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
        with open_dict(cfg):
            del cfg["hydra"]  # the rest of it only resolves inside Hydra's own runtime
        gpus = torch.cuda.device_count()
        plan = prepare(cfg, gpus, world_size=world_size)
        if plan.exp.device == Device.cuda:
            distributed.check_gpus_for_local_ranks(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), gpus,
                                                   os.environ)
        if plan.nproc == 1 and world_size > 1:
            raise ConfigError("sharding=none: runs one process; start it without torchrun")
        if not plan.task.runs_as_torchruns_ranks:
            task = choices.get("task", "")
            why = "starts fresh ranks for every probe" if task == "max_batch" else "does not train as torchrun's ranks"
            raise ConfigError(f"task={task}: {why}, so it cannot run under torchrun; "
                              f"run it as python -m fsdp_exp task={task} ...")
    except ConfigError as err:
        return SharedPlan(refused=str(err)), None
    return SharedPlan(plan, run_dir, choices), cfg
