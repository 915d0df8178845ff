"""conf/sharding/*: how the model's parameters are spread over the ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from fsdp_exp.precision import Precision


@dataclass
class FullyShard:
    """FSDP2: `fully_shard` each block, then the root.

    reshard_after_forward=True is ZeRO-3 (`full`): params are gathered again for backward.
    False is ZeRO-2 (`grad_op`): gathered params stay from forward to backward.
    """

    reshard_after_forward: bool = True
    shards_params = True

    def apply(
        self,
        model: nn.Module,
        blocks: tuple[type[nn.Module], ...],
        mesh: DeviceMesh,
        precision: Precision,
        offload: bool,
    ) -> nn.Module:
        # pin_memory needs a GPU; on a CPU-only mesh it fails inside fully_shard.
        offload_policy = (
            CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
        )
        units = [m for m in model.modules() if blocks and isinstance(m, blocks)]
        for module in units:
            fully_shard(
                module,
                mesh=mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=precision.fsdp_policy(root=False),
                offload_policy=offload_policy,
            )
        fully_shard(
            model,
            mesh=mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=precision.fsdp_policy(root=True),
            offload_policy=offload_policy,
        )
        if mesh.device_type == "cpu":
            # gloo's AVG reduce-scatter mis-averages gradients (pytorch#162338): reduce
            # with SUM and let FSDP divide by the world size itself.
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        return model


class NoSharding:
    """One process, the whole model, plain PyTorch: the reference the others must match."""

    shards_params = False

    def apply(
        self,
        model: nn.Module,
        blocks: tuple[type[nn.Module], ...],
        mesh: DeviceMesh,
        precision: Precision,
        offload: bool,
    ) -> nn.Module:
        assert mesh.size() == 1, "sharding=none runs on one rank (checked in config)"
        if precision.param_dtype == "float32":
            return model
        return Autocast(model, precision, mesh.device_type)


class Autocast(nn.Module):
    """Runs the wrapped model's forward in the precision's compute dtype."""

    def __init__(self, model: nn.Module, precision: Precision, device_type: str):
        super().__init__()
        self.module = model
        self.precision = precision
        self.device_type = device_type

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast(self.device_type):
            return self.module(*args).float()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model, without the autocast wrapper, so state-dict keys match."""
    return model.module if isinstance(model, Autocast) else model
