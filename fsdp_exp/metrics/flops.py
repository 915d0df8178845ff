"""FLOPs per training step, counted once per config, and the device's peak for MFU."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# Dense peak TFLOP/s by device-name fragment: (bf16/fp16 tensor cores, fp32 with TF32).
# From the vendors' data sheets (SXM parts). An unknown device gets no MFU rather than
# a wrong one; `metrics.peak_tflops` names the peak for any device.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.4, 494.7),
    "H100": (989.4, 494.7),
    "A100": (312.0, 156.0),
    "L40S": (362.1, 183.0),
    "A10G": (125.0, 62.5),
    "L4": (121.0, 60.0),
}


def device_peak_tflops(device: torch.device, param_dtype: str, configured: float | None) -> float | None:
    """The peak this run's MFU is measured against, or None (CPU, unknown GPU)."""
    if configured:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (half, tf32) in PEAK_TFLOPS.items():
        if fragment in name:
            return tf32 if param_dtype == "float32" else half
    return None


def count_step_flops(model: nn.Module, loss_of: Callable[[], torch.Tensor]) -> int:
    """FLOPs of one forward and backward on this rank, counted by FlopCounterMode.

    Every rank must call this together (the sharded forward gathers parameters). The
    gradients it leaves are cleared; the weights are not touched.
    """
    counter = FlopCounterMode(display=False)
    with counter:
        loss_of().backward()
    for p in model.parameters():
        p.grad = None
    return counter.get_total_flops()


def gpt_flops_per_token(n_layer: int, n_embd: int, vocab_size: int, seq_len: int) -> int:
    """The analytic 6N count: 6 x matmul weights (the blocks' and the output head's) per
    token, plus 12 x layers x width x seq_len for attention scores and values, counted as
    full attention as FlopCounterMode counts causal SDPA."""
    block_weights = 12 * n_embd * n_embd  # qkv 3d^2, out d^2, MLP 8d^2
    return 6 * (n_layer * block_weights + n_embd * vocab_size) + 12 * n_layer * n_embd * seq_len


def lm_flops_per_token(model: nn.Module, seq_len: int) -> int | None:
    """The analytic count for a language model whose shape is known, else None."""
    from fsdp_exp.models.gpt import GPT

    if isinstance(model, GPT):
        return gpt_flops_per_token(len(model.blocks), model.wte.embedding_dim, model.vocab_size, seq_len)
    return None
