"""The process group, the device mesh, and the few collectives the loop needs."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_exp.errors import ConfigError

DEVICE_VARIABLE = "FSDP_EXP_DEVICE"  # set by a launcher that knows each rank's GPU (launcher=ray)


@dataclass
class Ranks:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device_type: str, offload: bool) -> str:
    """The process group's backend: gloo on CPU; on GPU nccl, one rank per GPU.

    With `offload` a GPU run's group also has gloo for CPU tensors, as torchtitan's does:
    the sharded parameters, gradients and optimizer state live on the CPU, and a
    collective that meets one of them in an NCCL-only group fails on every rank with "No
    backend type associated with device type cpu" (pytorch#148532, through
    clip_grad_norm_). The code paths of torch 2.14.1 that fsdp_exp runs move such tensors
    to the GPU first (docs/gpu.md, "What the GPU paths rest on"); the gloo half keeps the
    next one from crashing an 8-GPU run that a 1-GPU check passed, where torch skips
    the collective."""
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if offload else "nccl"


def init(device_type: str, offload: bool = False, timeout_s: float = 600, store: dist.Store | None = None) -> Ranks:
    """Join the process group that torchrun or the elastic launcher described in the env,
    with `backend_for(device_type, offload)`; `store`: the env's rendezvous store, when the
    caller has met the other ranks through it already. The sharding plan makes its own
    device mesh from `device.type`, never from the accelerator's default.
    """
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        device = torch.device("cuda", gpu_index(os.environ, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        device_id = device if device_type == "cuda" else None
        met = {"store": store, "rank": rank, "world_size": world_size} if store is not None else {}
        dist.init_process_group(backend_for(device_type, offload), timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device_id, **met)
    return Ranks(rank, local_rank, world_size, device)


def gpu_index(env: Mapping[str, str], visible_gpus: int) -> int:
    """Which of the GPUs this rank sees is its own.

    A launcher that knows names it in FSDP_EXP_DEVICE (launcher=ray: Ray Train's own
    choice, since its local ranks need not follow the order of CUDA_VISIBLE_DEVICES).
    Otherwise, where each rank sees only its own GPU (SLURM's --gpus-per-task or
    --gpu-bind, per-task cgroups), that one; where every rank sees all of its node's GPUs
    (launcher=local, torchrun, SLURM without binding), the one at LOCAL_RANK.
    """
    named = env.get(DEVICE_VARIABLE, "")
    if named.startswith("cuda"):
        return torch.device(named).index or 0
    local_rank = int(env.get("LOCAL_RANK", 0))
    seen = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else "no CUDA_VISIBLE_DEVICES"
    if visible_gpus == 0:
        raise ConfigError(f"device=cuda: local rank {local_rank} sees no GPU ({seen})")
    if visible_gpus == 1:
        return 0
    if local_rank >= visible_gpus:
        raise ConfigError(f"device=cuda: local rank {local_rank} sees only {visible_gpus} GPUs ({seen}); "
                          "give each rank either one GPU of its own or all of its node's GPUs")
    return local_rank


def check_gpus_for_local_ranks(local_ranks: int, visible_gpus: int, env: Mapping[str, str]) -> None:
    """Refuse more ranks on a node than the GPUs they all see. Ranks that torchrun starts
    inherit one CUDA_VISIBLE_DEVICES, so where a node's ranks outnumber its GPUs two of them
    would take the same one (`gpu_index`), and NCCL refuses a second rank on a device. A
    launcher that names each rank's GPU (FSDP_EXP_DEVICE) is trusted."""
    if env.get(DEVICE_VARIABLE, "").startswith("cuda") or local_ranks <= visible_gpus:
        return
    seen = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else "no CUDA_VISIBLE_DEVICES"
    raise ConfigError(f"torchrun --nproc_per_node={local_ranks}: this node shows {visible_gpus} GPU(s) ({seen}), "
                      f"and each rank needs one of its own; start at most {visible_gpus} rank(s) a node")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on this rank's GPU, so that a timer reads the time it took."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def mean(value: torch.Tensor) -> float:
    """The mean of a scalar over ranks (gloo has no AVG all-reduce: SUM, then divide)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    total = value.detach().clone().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total) / dist.get_world_size()


def summed_later(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Starts summing a scalar on this rank's device over the ranks; returns what waits for
    the sum, left on the device (on a GPU the wait holds back the device's stream, not the
    host)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda: value
    total = value.detach().clone().float()
    work = dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return total

    return wait


def total(values: list[torch.Tensor | float], device: torch.device) -> list[float]:
    """Each of `values` (numbers, or scalars on this rank's device) summed over ranks."""
    summed = torch.stack([torch.as_tensor(v, device=device).double() for v in values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed.tolist()


def gather(value: float, device: torch.device) -> list[float]:
    """One number from every rank, in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(t) for t in every]


def from_main(value: object) -> object:
    """Rank 0's `value` on every rank (small objects: paths, settings)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
