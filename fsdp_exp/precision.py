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
    tf32: bool = True  # on a GPU, fp32 matmuls and convolutions on TF32 tensor cores; false: strict fp32

    def __post_init__(self) -> None:
        if self.initial_scale <= 0:
            raise ConfigError(f"precision.initial_scale={self.initial_scale}: must be greater than 0")

    def apply_tf32(self, device_type: str) -> bool:
        """Set this process's TF32 flags on a GPU; whether fp32 matmuls now run in TF32.

        The CUDA flags alone: `torch.set_float32_matmul_precision` would also switch the
        CPU's oneDNN matmuls, and on torch 2.14, setting the newer `fp32_precision` makes
        every later read of `allow_tf32` or `get_float32_matmul_precision()` raise (mixed
        APIs), which torch.compile and other libraries do. cuDNN's convolutions default to
        TF32, so `tf32=false` turns them off as well.
        """
        if device_type != "cuda":
            return False
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        return self.tf32

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
        ranks, so every rank skips the same steps and the shards stay consistent.

        `device_type` must be the rank's own: with offload the gradients are on the CPU,
        and a scaler made for "cuda" moves their inf/nan flag to the GPU before that
        all-reduce (ShardedGradScaler.unscale_), which an NCCL-only group needs. A scaler
        made for "cpu" would all-reduce the CPU flag, which NCCL cannot."""
        if not self.loss_scaling:
            return None
        return ShardedGradScaler(device=device_type, init_scale=self.initial_scale)
