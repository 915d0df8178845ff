"""FLOPs per training step, counted once per config, and the device's peak for MFU."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode
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


def _attention_flops(query: tuple, key: tuple, value: tuple, *args: object, **kwargs: object) -> int:
    """Scores (q @ k^T) and output (p @ v), full attention; grouped-query attention
    computes with as many heads as the query."""
    batch, heads, q_len, dim = query
    return 2 * batch * heads * q_len * key[2] * (dim + value[3])


def _attention_backward_flops(grad_out: tuple, query: tuple, key: tuple, value: tuple,
                              *args: object, **kwargs: object) -> int:
    """Scores recomputed, then the gradients of the scores, v, q and k."""
    batch, heads, q_len, dim = query
    return 2 * batch * heads * q_len * key[2] * (3 * dim + 2 * value[3])


# FlopCounterMode counts the GPU kernels of scaled_dot_product_attention but not the
# CPU one (torch 2.11 to 2.14), which would leave attention out of every CPU figure.
# These are the formulas torch uses for the GPU kernels (sdpa_flop, sdpa_backward_flop).
ATTENTION_FORMULAS = {
    getattr(torch.ops.aten, name): formula
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _attention_flops),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward_flops))
    if hasattr(torch.ops.aten, name)
}


@dataclass
class StepFlops:
    """One forward and backward on this rank."""

    model: int  # the model's own FLOPs: what MFU counts
    hardware: int  # what ran: with the forward that activation checkpointing recomputes
    uncounted: list[str] = field(default_factory=list)  # attention kernels that ran with no formula


class _UncountedAttention(TorchDispatchMode):
    """Notes the attention kernels the counter has no formula for. Entered below the
    counter, it sees the ops the counter ran, after its decompositions."""

    def __init__(self, formulas: dict) -> None:
        super().__init__()
        self.formulas = formulas
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if "attention" in packet.__name__ and packet not in self.formulas:
            self.ops.add(str(packet))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_recompute(model: nn.Module, formulas: dict) -> Iterator[list[FlopCounterMode]]:
    """While open, each activation-checkpointed block counts the forward it recomputes in
    backward with its own counter (torch.utils.checkpoint's `context_fn`: the second
    context wraps the recomputation). The counters are yielded; the blocks are restored."""
    counters: list[FlopCounterMode] = []

    def contexts() -> tuple[contextlib.AbstractContextManager, FlopCounterMode]:
        counters.append(FlopCounterMode(display=False, custom_mapping=formulas))
        return contextlib.nullcontext(), counters[-1]

    wrappers = [m for m in model.modules()
                if isinstance(m, CheckpointWrapper) and m.checkpoint_impl == CheckpointImpl.NO_REENTRANT]
    plain = [w.checkpoint_fn for w in wrappers]
    for wrapper in wrappers:  # the wrapper's own partial keeps its other arguments
        wrapper.checkpoint_fn = functools.partial(wrapper.checkpoint_fn, context_fn=contexts)
    try:
        yield counters
    finally:
        for wrapper, checkpoint_fn in zip(wrappers, plain):
            wrapper.checkpoint_fn = checkpoint_fn


def count_step_flops(model: nn.Module, loss_of: Callable[[], torch.Tensor],
                     formulas: dict = ATTENTION_FORMULAS) -> StepFlops:
    """FLOPs of one forward and backward on this rank, counted by FlopCounterMode: the
    model's own and, with activation checkpointing, the hardware's (with the recompute).

    Every rank must call this together (the sharded forward gathers parameters). The
    gradients it leaves are cleared; the weights are not touched. Under torch.compile
    the count runs eagerly: Dynamo skips frames while a dispatch mode is active.
    """
    counter = FlopCounterMode(display=False, custom_mapping=formulas)
    uncounted = _UncountedAttention(counter.flop_registry)
    with _count_recompute(model, formulas) as recomputed, uncounted, counter:
        loss_of().backward()
    for p in model.parameters():
        p.grad = None
    hardware = counter.get_total_flops()
    model_flops = hardware - sum(c.get_total_flops() for c in recomputed)
    return StepFlops(model=model_flops, hardware=hardware, uncounted=sorted(uncounted.ops))


def step_flops_figures(counted: StepFlops, analytic: int | None, micro_batches: int = 1) -> dict:
    """The FLOP figures of one optimizer step of `micro_batches` micro-batches, each
    counted as `counted` and, for a language model, `analytic` (6N). MFU uses the counted
    model FLOPs, unless the count missed an attention kernel and the analytic count is
    known; `flops_source` says which."""
    model, hardware = counted.model * micro_batches, counted.hardware * micro_batches
    figures: dict = {"flops_per_step": model, "hardware_flops_per_step": hardware, "flops_source": "counted"}
    if analytic is not None:
        figures["flops_per_step_analytic"] = analytic * micro_batches
    if counted.uncounted:
        figures["flops_uncounted_ops"] = counted.uncounted
        if analytic is not None:
            figures.update(flops_per_step=analytic * micro_batches, flops_per_step_counted=model,
                           hardware_flops_per_step=analytic * micro_batches + hardware - model,
                           flops_source="analytic")
    return figures


def gpt_flops_per_token(n_layer: int, n_embd: int, vocab_size: int, seq_len: int) -> int:
    """The analytic 6N count: 6 x matmul weights (the blocks' and the output head's) per
    token, plus 12 x layers x width x seq_len for attention scores and values, counted as
    full attention as FlopCounterMode counts causal SDPA."""
    block_weights = 12 * n_embd * n_embd  # qkv 3d^2, out d^2, MLP 8d^2
    return 6 * (n_layer * block_weights + n_embd * vocab_size) + 12 * n_layer * n_embd * seq_len


def flops_per_token(model: nn.Module, seq_len: int) -> int | None:
    """The analytic 6N count of a built transformer LM, sharded or not; None when its
    shape is unknown. The 6N term counts every weight a token meets in a matmul: each
    module's own parameters except the embedding tables (a lookup, not a matmul), so a
    head tied to the embedding counts once, as the matmul it is. The attention term is
    `gpt_flops_per_token`'s."""
    shape = _layers_and_width(model)
    if shape is None:
        return None
    layers, width = shape
    matmul_weights = sum(p.numel() for m in model.modules() if not isinstance(m, nn.Embedding)
                         for p in m.parameters(recurse=False))
    return 6 * matmul_weights + 12 * layers * width * seq_len


def _layers_and_width(model: nn.Module) -> tuple[int, int] | None:
    """(layers, attention width): fsdp_exp's GPT from its modules, a Hugging Face model
    from its config (GPT-2's `n_layer`/`n_embd` or the usual `num_hidden_layers`/`hidden_size`)."""
    from fsdp_exp.models.gpt import GPT

    for module in model.modules():
        if isinstance(module, GPT):
            return len(module.blocks), module.wte.embedding_dim
        config = getattr(module, "config", None)
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        if isinstance(layers, int) and isinstance(hidden, int):
            heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
            both = isinstance(heads, int) and isinstance(head_dim, int)
            return layers, heads * head_dim if both else hidden
    return None
