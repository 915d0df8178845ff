"""FLOPs per training step, counted once per config, and the device's peak for MFU."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fsdp_exp.models.gpt import GPT
from fsdp_exp.torch_private import CheckpointImpl, CheckpointWrapper, TorchDispatchMode


class DevicePeak(NamedTuple):
    """One GPU variant's dense peak TFLOP/s (without 2:4 sparsity), from NVIDIA's datasheet."""

    entry: str
    device_names: tuple[str, ...]  # as torch.cuda.get_device_name() gives them, whole
    bf16: float | None  # bf16 and fp16 on tensor cores
    tf32: float | None  # fp32 matmuls on tensor cores in TF32
    fp32: float | None  # strict fp32, without tensor cores
    source: str


# Where a datasheet gives only the sparse tensor-core figure, the dense one is half of it.
# A device is matched on its whole name, so "NVIDIA L4" is not "NVIDIA L40" and an H100
# PCIe card does not get the SXM figures. A MIG slice ("... MIG 1g.10gb") matches nothing.
PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak("B200", ("NVIDIA B200",), 2250, 1100, 75,
         "HGX B200 datasheet, per GPU: 4.5 PF bf16 and 2.2 PF tf32 sparse, 75 TF fp32"),
    DevicePeak("H200 NVL", ("NVIDIA H200 NVL",), 835.5, 417.5, 60,
         "H200 datasheet: 1,671 bf16 and 835 tf32 sparse, 60 fp32"),
    DevicePeak("H200 SXM", ("NVIDIA H200",), 989.5, 494.5, 67,
         "H200 datasheet: 1,979 bf16 and 989 tf32 sparse, 67 fp32"),
    DevicePeak("H100 NVL", ("NVIDIA H100 NVL",), 835.5, 417.5, 60,
         "H100 datasheet, per GPU: 1,671 bf16 and 835 tf32 sparse, 60 fp32"),
    DevicePeak("H100 PCIe", ("NVIDIA H100 PCIe",), 756.5, 378, 51,
         "H100 datasheet: 1,513 bf16 and 756 tf32 sparse, 51 fp32"),
    DevicePeak("H100 SXM", ("NVIDIA H100 80GB HBM3",), 989.5, 494.5, 67,
         "H100 datasheet: 1,979 bf16 and 989 tf32 sparse, 67 fp32"),
    DevicePeak("A100 SXM 80GB", ("NVIDIA A100-SXM4-80GB",), 312, 156, 19.5, "A100 datasheet"),
    DevicePeak("A100 SXM 40GB", ("NVIDIA A100-SXM4-40GB",), 312, 156, 19.5, "A100 datasheet"),
    DevicePeak("A100 PCIe 80GB", ("NVIDIA A100 80GB PCIe",), 312, 156, 19.5, "A100 datasheet"),
    DevicePeak("A100 PCIe 40GB", ("NVIDIA A100-PCIE-40GB",), 312, 156, 19.5, "A100 datasheet"),
    DevicePeak("L40S", ("NVIDIA L40S",), 362.05, 183, 91.6, "L40S datasheet"),
    DevicePeak("L40", ("NVIDIA L40",), 181.05, 90.5, 90.5, "L40 datasheet"),
    DevicePeak("L4", ("NVIDIA L4",), 121, 60, 30.3, "L4 datasheet: 242 bf16 and 120 tf32 sparse, 30.3 fp32"),
    DevicePeak("A10G", ("NVIDIA A10G",), None, None, None,
         "none: NVIDIA publishes no datasheet for AWS's A10G, a variant of the A10 but not the same part"),
    DevicePeak("A10", ("NVIDIA A10",), 125, 62.5, 31.2, "A10 datasheet"),
)

CONFIGURED = "metrics.peak_tflops"


@dataclass
class PeakChoice:
    """The peak a run's MFU is measured against, and where it came from."""

    tflops: float | None
    source: str | None  # "<table entry>, <column>", "metrics.peak_tflops", or None
    warning: str | None = None  # for rank 0 to log: why there is no MFU


def peak_column(param_dtype: str, tf32: bool) -> str:
    """The column of the table the run's matmuls are measured against."""
    if param_dtype in ("bfloat16", "float16"):
        return "bf16"
    return "tf32" if tf32 else "fp32"


def find_peak(device_name: str) -> DevicePeak | None:
    name = " ".join(device_name.split()).lower()
    return next((p for p in PEAKS if name in (n.lower() for n in p.device_names)), None)


def peak_for(device_name: str, column: str) -> PeakChoice:
    """The table's peak for a GPU named `device_name` in `column` (bf16, tf32 or fp32)."""
    peak = find_peak(device_name)
    tflops = getattr(peak, column) if peak else None
    if tflops is None:
        why = f"{device_name!r} is not in the table of known GPUs" if peak is None else peak.source
        return PeakChoice(None, None, f"no peak TFLOP/s for {device_name} ({why}), so no MFU; "
                                      f"set {CONFIGURED} to its dense {column} peak")
    return PeakChoice(tflops, f"{peak.entry}, {column}")


def device_peak(device: torch.device, column: str, configured: float | None) -> PeakChoice:
    """The peak this run's MFU is measured against: `metrics.peak_tflops` when set, else
    the table's for this GPU; none on CPU."""
    if configured:
        return PeakChoice(configured, CONFIGURED)
    if device.type != "cuda":
        return PeakChoice(None, None)
    return peak_for(torch.cuda.get_device_name(device), column)


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
# CPU one (torch 2.14), which would leave attention out of every CPU figure. The GPU
# kernels get ours too: torch's own formula (sdpa_flop_count) asserted equal head counts
# for query, key and value until torch 2.13, so a grouped-query model (Llama, Qwen, with
# transformers' `enable_gqa`) in bf16 failed its first step inside the counter on 2.11.
# Each kernel takes query, key, value first (grad_out before them in backward).
ATTENTION_FORMULAS = {
    getattr(torch.ops.aten, name + suffix): formula
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    for suffix, formula in (("", _attention_flops), ("_backward", _attention_backward_flops))
    if hasattr(torch.ops.aten, name + suffix)
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
        # flash-attn's own ops are `flash_attn::_flash_attn_forward` / `_backward`.
        if ("attention" in packet.__name__ or "flash_attn" in str(packet)) and packet not in self.formulas:
            self.ops.add(str(packet))
        return func(*args, **(kwargs or {}))


class _GlobalOnly:
    """In FlopCounterMode's module tracker's place: every FLOP counts under "Global", the one
    figure read here. torch's ModuleTracker hooks every module's forward and its outputs'
    gradients, and with activation checkpointing those hooks keep each checkpointed block's
    activations alive until a garbage collection (pytorch#139214): the counted micro-batch
    then held what checkpointing saves (the default ViT at batch 256: 0.22 GB against 0.09)."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def flop_counter(formulas: dict) -> FlopCounterMode:
    """A FlopCounterMode that counts the whole and nothing per module."""
    counter = FlopCounterMode(display=False, custom_mapping=formulas)
    counter.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
    return counter


@contextlib.contextmanager
def _count_recompute(model: nn.Module, formulas: dict) -> Iterator[list[FlopCounterMode]]:
    """While open, each activation-checkpointed block counts the forward it recomputes in
    backward with its own counter (torch.utils.checkpoint's `context_fn`: the second
    context wraps the recomputation). The counters are yielded; the blocks are restored."""
    counters: list[FlopCounterMode] = []

    def contexts() -> tuple[contextlib.AbstractContextManager, FlopCounterMode]:
        counters.append(flop_counter(formulas))
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


class FlopCount:
    """What `counting_flops` counted, once its block has ended."""

    step: StepFlops | None = None


@contextlib.contextmanager
def counting_flops(model: nn.Module, formulas: dict = ATTENTION_FORMULAS) -> Iterator[FlopCount]:
    """Counts the FLOPs of the forward and backward run inside the block on this rank, by
    FlopCounterMode: the model's own and, with activation checkpointing, the hardware's
    (with the recompute). The count is in the yielded `FlopCount` once the block ends.

    Every rank must run the block together (the sharded forward gathers parameters).
    Under torch.compile the block runs eagerly: Dynamo skips frames while a dispatch mode
    is active."""
    counter = flop_counter(formulas)
    uncounted = _UncountedAttention(counter.flop_registry)
    count = FlopCount()
    with _count_recompute(model, formulas) as recomputed, uncounted, counter:
        yield count
    hardware = counter.get_total_flops()
    model_flops = hardware - sum(c.get_total_flops() for c in recomputed)
    count.step = StepFlops(model=model_flops, hardware=hardware, uncounted=sorted(uncounted.ops))


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
