"""conf/sharding/*: how the model's parameters, gradients and optimizer state are spread.

Each option is a plan: a dataclass whose fields are its settings (checked as it is
built), `check(world_size, ...)` for what depends on the other groups, run before any
rank starts, and `apply(model, units, device, precision, offload, mesh)`, run on every
rank (`mesh`: one made beforehand, as task=estimate does outside its fake tensors).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from fsdp_exp.errors import ConfigError, choice
from fsdp_exp.groups import ShardingOption
from fsdp_exp.precision import Precision
from fsdp_exp.sharding.wrap import WRAP_POLICIES, select_units

WrapPolicy = choice("WrapPolicy", WRAP_POLICIES, __name__)


@dataclass
class FullyShard(ShardingOption):
    """FSDP2 on a 1-D mesh: `fully_shard` each unit (see `sharding.wrap`), then the root.

    reshard_after_forward: True is ZeRO-3 (`full`), False is ZeRO-2 (`grad_op`), an int
    reshards to groups of that many ranks after forward.
    """

    reshard_after_forward: bool | int = True  # or an int: reshard to groups of that many ranks
    wrap: WrapPolicy = WrapPolicy["blocks"]  # blocks | size | blocks+size | root: which modules become FSDP units
    min_params: int = 100_000  # for wrap=size: the fewest parameters a unit holds
    shards_params = True
    distributed = True

    def __post_init__(self) -> None:
        if self.min_params < 1:
            raise ConfigError(f"sharding.min_params={self.min_params}: must be at least 1")

    def groups(self, world_size: int) -> tuple[int, ...]:
        """The sizes of the process groups the plan makes beside the world's: its mesh is
        the world; reshard_after_forward=<int> adds FSDP2's post-forward mesh of that size."""
        raf = self.reshard_after_forward
        return (raf,) if not isinstance(raf, bool) and 1 < raf < world_size else ()

    def shard_size(self, world_size: int) -> int:
        return world_size

    def check(self, world_size: int, has_blocks: bool, offload: bool) -> None:
        """What depends on the other groups: the world size, the model's blocks."""
        if "blocks" in self.wrap and not has_blocks:
            raise ConfigError(
                f"sharding.wrap={self.wrap}: this model names no block classes (model.blocks is "
                "empty); use sharding.wrap=size or root"
            )
        raf, shards = self.reshard_after_forward, self.shard_size(world_size)
        if not isinstance(raf, bool) and (raf < 1 or shards % raf):
            raise ConfigError(
                f"sharding.reshard_after_forward={raf}: true, false, or a group size that divides "
                f"the {shards} ranks each parameter is sharded over"
            )

    def mesh(self, device: torch.device, world_size: int) -> DeviceMesh:
        return init_device_mesh(device.type, (world_size,))

    def select_units(self, model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list[str]:
        return select_units(model, blocks, self.wrap, self.min_params)

    def apply(self, model: nn.Module, units: list[str], device: torch.device,
              precision: Precision, offload: bool, mesh: DeviceMesh | None = None) -> nn.Module:
        mesh = mesh or self.mesh(device, dist.get_world_size())
        # pin_memory needs a GPU; on a CPU-only mesh it fails inside fully_shard.
        offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
        for name in units:
            fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                        mp_policy=precision.fsdp_policy(root=False), offload_policy=offload_policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                    mp_policy=precision.fsdp_policy(root=True), offload_policy=offload_policy)
        if device.type == "cpu":
            # gloo's AVG reduce-scatter can mis-average gradients (pytorch#162338): reduce
            # with SUM and let FSDP divide by the world size itself.
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        return model


@dataclass
class HybridShard(FullyShard):
    """HSDP: replicate over `replicate` groups, shard within each (a 2-D mesh)."""

    replicate: int = 2  # replica groups; parameters are sharded within each of world_size / replicate ranks

    def shard_size(self, world_size: int) -> int:
        return world_size // self.replicate

    def groups(self, world_size: int) -> tuple[int, ...]:
        """The sizes of the process groups the mesh makes beside the world's: each rank is
        in one replica group and one shard group."""
        return (self.replicate, world_size // self.replicate, *super().groups(world_size // self.replicate))

    def check(self, world_size: int, has_blocks: bool, offload: bool) -> None:
        if self.replicate < 1 or world_size % self.replicate:
            raise ConfigError(
                f"sharding.replicate={self.replicate}: must divide the world size ({world_size} ranks)"
            )
        super().check(world_size, has_blocks, offload)

    def mesh(self, device: torch.device, world_size: int) -> DeviceMesh:
        return init_device_mesh(
            device.type, (self.replicate, world_size // self.replicate),
            mesh_dim_names=("replicate", "shard"),
        )


@dataclass
class DDP(ShardingOption):
    """PyTorch DistributedDataParallel: a full replica per rank, gradients all-reduced."""

    shards_params = False
    distributed = True

    def groups(self, world_size: int) -> tuple[int, ...]:
        """The sizes of the process groups beside the world's: none."""
        return ()

    def check(self, world_size: int, has_blocks: bool, offload: bool) -> None:
        if offload:
            raise ConfigError(
                "offload=true: sharding=ddp keeps a full replica on every rank; "
                "use sharding=full, grad_op or hybrid"
            )

    def select_units(self, model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list[str]:
        return []

    def apply(self, model: nn.Module, units: list[str], device: torch.device,
              precision: Precision, offload: bool, mesh: DeviceMesh | None = None) -> nn.Module:
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return Autocast(ddp, precision, device.type) if precision.param_dtype != "float32" else ddp


@dataclass
class NoSharding(DDP):
    """One process with the whole model: the reference the others must match. It trains
    the same global batch as the ranks it stands in for (see `train.batch_size`)."""

    distributed = False

    def check(self, world_size: int, has_blocks: bool, offload: bool) -> None:
        if offload:
            raise ConfigError("offload=true: needs a sharded model (sharding=full, grad_op or hybrid), not sharding=none")

    def apply(self, model: nn.Module, units: list[str], device: torch.device,
              precision: Precision, offload: bool, mesh: DeviceMesh | None = None) -> nn.Module:
        return Autocast(model, precision, device.type) if precision.param_dtype != "float32" else model


class Autocast(nn.Module):
    """Runs the wrapped model's forward in the precision's compute dtype (DDP and none)."""

    def __init__(self, model: nn.Module, precision: Precision, device_type: str):
        super().__init__()
        self.module = model
        self.precision = precision
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast(self.device_type):
            return in_float32(self.module(*args, **kwargs))


def in_float32(output: Any) -> Any:
    """A forward's output with its floating tensors in fp32: a tensor, or a dict's values (a
    Hugging Face model's output is one); anything else as it is."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() else output
    if isinstance(output, Mapping):
        return {k: in_float32(v) for k, v in output.items()}
    return output


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model without autocast or DDP wrappers, so state-dict keys match."""
    while isinstance(model, (Autocast, DistributedDataParallel)):
        model = model.module
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: reduce gradients across ranks only
    when `enabled` (the last micro-batch of an accumulated step)."""
    inner = model.module if isinstance(model, Autocast) else model
    if isinstance(inner, FSDPModule):
        inner.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(inner, DistributedDataParallel) and not enabled:
        with inner.no_sync():
            yield
    else:
        yield
