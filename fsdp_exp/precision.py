"""conf/precision/*: the dtypes of params, gradient reduction and model output."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fsdp_exp.errors import Choice, ConfigError


class DType(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, DType(name).value)


@dataclass
class Precision:
    param_dtype: DType = DType.float32  # the dtype forward and backward compute in
    reduce_dtype: DType = DType.float32  # the dtype gradients are reduced in
    output_dtype: DType = DType.float32  # the dtype of the model's output (logits)
    loss_scaling: bool = False  # dynamic loss scaling, agreed across ranks (fp16 needs it)
    initial_scale: float = 2.0**16

    def __post_init__(self) -> None:
        if self.initial_scale <= 0:
            raise ConfigError(f"precision.initial_scale={self.initial_scale}: must be greater than 0")

    def fsdp_policy(self, root: bool) -> MixedPrecisionPolicy:
        """Every dtype explicit: `reduce_dtype=None` changed meaning between torch releases.
        The output cast belongs on the root alone; on inner units it breaks training."""
        return MixedPrecisionPolicy(
            param_dtype=_dtype(self.param_dtype),
            reduce_dtype=_dtype(self.reduce_dtype),
            output_dtype=_dtype(self.output_dtype) if root else None,
            cast_forward_inputs=True,
        )

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """For an unsharded model: run forward in `param_dtype`, keep fp32 weights."""
        dtype = _dtype(self.param_dtype)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=dtype)

    def grad_scaler(self, device_type: str) -> ShardedGradScaler | None:
        """Dynamic loss scaling for fp16. The sharded scaler agrees on inf/nan across
        ranks, so every rank skips the same steps and the shards stay consistent."""
        if not self.loss_scaling:
            return None
        return ShardedGradScaler(device=device_type, init_scale=self.initial_scale)
