"""The driver's plan for one run: the experiment built from the composed config, and every
check that spans groups, made before any rank starts.

Each component checks its own values as it is built (`__post_init__`); what needs two
groups at once is here: the world size and the GPUs (launcher, device, sharding), the
model against its blocks and the data, offload and meta-device init against the
sharding, the memory limit against the machine, and what the task needs.

The plan's experiment is the config as checked and resolved (device=auto made cpu or
cuda, sharding=none's global batch, the wandb run's id), and nothing changes it
afterwards: what a run learns on its way is its RunContext (fsdp_exp.run_context).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig

from fsdp_exp import config
from fsdp_exp.blocks import check_compile
from fsdp_exp.config import Device, Experiment
from fsdp_exp.errors import ConfigError
from fsdp_exp.memory import check_limit
from fsdp_exp.launcher.rank_server import in_a_fork
from fsdp_exp.models.contract import DataShare, check_model, check_model_and_data, check_model_reads_data
from fsdp_exp.models.hf import needs_gpu


@dataclass
class RunPlan:
    """What the driver starts: the built experiment the ranks receive, and how many ranks."""

    exp: Experiment
    nproc: int

    @property
    def launcher(self) -> Any:
        return self.exp.launcher

    @property
    def task(self) -> Any:
        return self.exp.task


def prepare(cfg: DictConfig, local_gpus: int, world_size: int | None = None) -> RunPlan:
    """Build the experiment and check everything that can be checked before a rank starts.

    `sharding=none` runs one process on the global batch of the ranks it stands in for,
    so its losses are the reference the sharded runs must match. `world_size`: given by
    an external torchrun; otherwise the launcher decides.
    """
    exp = config.build(cfg)
    in_driver = exp.task.runs_in_driver
    # task=eval and export run here, whatever the launcher: on a login node, on its CPU.
    gpus = local_gpus if in_driver else exp.launcher.gpus(local_gpus)
    if exp.device == Device.cuda and gpus == 0:
        hint = ("; task=estimate estimates for a GPU from any machine with task.device=cuda" if not exp.task.uses_the_device
                else f"; task={type(exp.task).__name__.lower()} runs on this machine, not on the launcher's"
                if in_driver else "")
        raise ConfigError(f"device=cuda: this machine has no GPU; use device=auto or device=cpu{hint}")
    on_gpu = exp.device == Device.cuda or (exp.device == Device.auto and gpus > 0)
    exp = replace(exp, device=Device.cuda if on_gpu else Device.cpu)
    if in_driver:
        return prepare_in_driver(exp)
    world = world_size or exp.launcher.world_size(gpus if on_gpu else 0)
    if not exp.task.uses_the_device:  # task=estimate: for any world size, on another machine
        world = exp.task.world(world)

    nproc = world if exp.sharding.distributed else 1
    # each process's micro-batch against its share of the data (sharding=none: of the global batch)
    micro = exp.train.batch_size * (1 if exp.sharding.distributed else world) // exp.train.grad_accum
    share = DataShare(exp.train.batch_size, micro, nproc) if exp.task.trains_at_the_batch else None
    # on a cluster, the data's files are the cluster's; here, the model reads them, checked
    # where the model's modules are imported already (the rank server's fork)
    reads_files = exp.launcher.runs_here or exp.data.generated
    has_blocks = in_a_fork(check_model_and_data, exp.model, exp.data if reads_files else None, share, exp.loss,
                           exp.sharding.shards_params)
    exp.sharding.check(world, has_blocks=has_blocks, offload=exp.offload)
    if exp.model.init_device == "meta" and not exp.sharding.shards_params:
        raise ConfigError("model.init_device=meta: needs sharding=full, grad_op or hybrid to shard the model")
    if exp.train.compile:
        check_compile(exp.device)
    check_attention(exp)
    exp.profile.check(exp.train.steps)
    if exp.launcher.runs_here and exp.task.uses_the_device:  # on a cluster, the memory is the cluster's
        check_limit(exp.memory.limit_gb, exp.device, 1 if on_gpu else nproc, gpus=min(nproc, gpus) if on_gpu else 1)
    exp.checkpoint.check()
    exp.task.check(exp)
    exp.task.check_world(world)
    global_batch = exp.train.batch_size * (1 if exp.sharding.distributed else world)
    return RunPlan(replace(exp, train=replace(exp.train, batch_size=global_batch), wandb=exp.wandb.resolved()), nproc)


def prepare_in_driver(exp: Experiment) -> RunPlan:
    """A task that runs in this process (eval, export) starts no ranks: the launcher and the
    sharding are not used, so only the model, the data and the task are checked."""
    model = check_model(exp.model)
    check_model_reads_data(exp.model, model.module, exp.data, exp.loss)
    exp.checkpoint.check()
    exp.task.check(exp)
    return RunPlan(replace(exp, wandb=exp.wandb.resolved()), 1)


def check_attention(exp: Experiment) -> None:
    """flash-attn runs on a GPU in fp16 or bf16 only: refused before the ranks start, not
    at their first forward."""
    attention = exp.model.kwargs.get("attn_implementation")
    if not needs_gpu(attention):
        return
    key = f"model.attn_implementation={attention}"
    if exp.device != Device.cuda and exp.task.uses_the_device:
        raise ConfigError(f"{key}: flash-attn runs on CUDA GPUs only; this run's device is {exp.device.value} "
                          "(use model.attn_implementation=sdpa)")
    if exp.precision.param_dtype == "float32":
        raise ConfigError(f"{key}: flash-attn computes in fp16 or bf16 only; use precision=bf16 "
                          "(or model.attn_implementation=sdpa for fp32)")
