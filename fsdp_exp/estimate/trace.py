"""Training steps of one rank on fake tensors, at any world size, with every byte counted.

The fake process group (`torch.testing._internal.distributed.fake_pg`) stands in for the
other ranks: collectives return at once and move no data. Under `FakeTensorMode` every
tensor has its shape, dtype and storage size but no memory. The model is built, sharded
and trained by the same code training uses (`build_model_for_training`,
`Trainer.train_step`), and torch's memory trackers (`torch.distributed._tools`) count the
live storages by what they hold: FSDP's sharded and unsharded parameters and gradients,
its all-gather and reduce-scatter buffers, activations, temporaries, optimizer state.

By symmetry one rank stands for all: FSDP2 pads every shard to the same size, and every
rank trains a batch of the same shape.

Three things differ from the run itself, and none changes what a step holds:
- the model is built on the meta device and given fake storage, without its
  initialisation (`model.init_device` only changes the build, counted apart from the
  steps), and `train.compile` is left out;
- `sharding=ddp` traces the model DDP wraps; DDP's reducer (C++, it checks real values
  across ranks) is added as what it holds: its buckets, one flat copy of every gradient;
- dynamic loss scaling is left out: its scale is one number.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf
from torch.nn import functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

from fsdp_exp.batch import Batches, BatchKeys, forward_keys, iter_tensors, stacked
from fsdp_exp.distributed import Ranks
from fsdp_exp.estimate.allocator import reserved_under
from fsdp_exp.estimate.breakdown import untraced_segments
from fsdp_exp.estimate.counting import LiveBytes, PlainTracker, ShardedTracker, tracker
from fsdp_exp.estimate.library import kept_by_step
from fsdp_exp.estimate.traced import OFFLOADED, StepTrace, Trace
from fsdp_exp.groups import LossOption
from fsdp_exp.metrics.flops import counting_flops
from fsdp_exp.linux import (
    anonymous_bytes,
    file_bytes,
    heap_in_use_bytes,
    private_dirty_bytes,
    proc_status,
    reset_resident_peak,
    thread_count,
    thread_stack_bytes,
)
from fsdp_exp.launcher.core import rank_threads
from fsdp_exp.rank.build import build_model_for_training
from fsdp_exp.rank.trainer import OptimizerStep, Trainer, TrainerSettings
from fsdp_exp.sharding import NoSharding
from fsdp_exp.torch_private import FakeStore, FakeTensorMode, flash_attention_for_cpu

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A process group of `world_size` ranks in which this process is rank 0, and nothing moves."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def for_tracing(exp: Experiment, on_gpu: bool) -> Experiment:
    """The run's experiment as the trace builds it (see the module's docstring)."""
    return replace(
        exp,
        model=Uninitialised(replace(exp.model, init_device="cpu")),
        train=replace(exp.train, compile=False),
        precision=replace(exp.precision, loss_scaling=False),
        sharding=NoSharding() if replicates(exp.sharding) else exp.sharding,
        optimizer=foreach(exp.optimizer) if on_gpu else exp.optimizer,
    )


@dataclass
class Uninitialised:
    """The model without its initialisation: built on the meta device, then given fake
    storage. Fake tensors hold no values, and some initialisers read them
    (`trunc_normal_`); a builder that cannot run on the meta device runs on fake tensors."""

    spec: Any  # fsdp_exp.models.ModelSpec
    init_device: str = "cpu"

    def build(self) -> tuple[torch.nn.Module, tuple[type[torch.nn.Module], ...]]:
        try:
            with torch.device("meta"):
                model, blocks = self.spec.build()
        except Exception:  # noqa: BLE001 - the builder needs real tensors: build it on fake ones
            return self.spec.build()
        return with_storage(model), blocks


def with_storage(model: torch.nn.Module) -> torch.nn.Module:
    """`model.to_empty(device="cpu")` for fake tensors, which `to_empty` cannot swap in for
    meta ones: every parameter and buffer replaced, tied ones by one tensor."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad)
            setattr(module, name, made[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None:
                module.register_buffer(name, torch.empty_like(buffer, device="cpu"),
                                       persistent=name not in module._non_persistent_buffers_set)
    return model


def foreach(optimizer: Any) -> Any:
    """On a GPU torch's optimizers default to their foreach kernels, which hold a list of
    temporaries the size of the parameters during the step; on the CPU to the per-tensor
    loop. The trace runs on the CPU, so it asks for foreach when the user did not choose."""
    node = OmegaConf.create(optimizer) if isinstance(optimizer, dict) else optimizer.copy()
    if "foreach" in node or "fused" in node:
        return node
    if "foreach" in inspect.signature(get_class(node["_target_"]).__init__).parameters:
        node["foreach"] = True
    return node


def trace(exp: Experiment, world_size: int, batch_sizes: list[int], on_gpu: bool,
          enough: Callable[[StepTrace, int], bool] | None = None, workspaces: tuple[int, ...] = (),
          cap_bytes: int | None = None) -> Trace:
    """Build, shard and train one rank of `world_size` on fake tensors: one step to make
    the optimizer state, then one counted step at each batch size, in order, until
    `enough(step, baseline_bytes)` says no larger size is needed. On a GPU, `cap_bytes` is what
    the caching allocator may reserve (see `LiveBytes`)."""
    start = time.perf_counter()
    before_data, in_use = anonymous_bytes(), InUse()
    loading = PeakGrowth()
    dataset = exp.data.dataset()  # held by every rank, as the runtime is: both in the baseline
    item = dataset[0]  # real: its shapes and dtypes
    data_load = loading.bytes()  # making it can take more than it keeps (generated data's temporaries)
    data_in_use = in_use.growth()
    sample_bytes = sum(tensor_bytes(t) for t in iter_tensors(stacked(item, 1)))
    baseline = anonymous_bytes()
    threads = thread_count()
    workers = data_worker_bytes(dataset, batch_sizes[0] // exp.train.grad_accum) if exp.data.num_workers else 0
    traced = for_tracing(exp, on_gpu)
    ranks = Ranks(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"))
    offloaded = OFFLOADED if exp.offload else ()  # off a GPU; the CPU peak counts them all the same
    with fake_world(world_size):
        sharding = traced.sharding
        mesh = sharding.mesh(ranks.device, world_size) if sharding.shards_params else None
        with FakeTensorMode(allow_non_fake_inputs=True), (AttentionAsOnGpu() if on_gpu else contextlib.nullcontext()), \
                contextlib.ExitStack() as as_in_a_run:
            before_build, in_use = anonymous_bytes(), InUse()
            model, _ = build_model_for_training(traced, ranks, mesh)
            build_in_use = in_use.growth()
            # Fake tensors take no memory: what the build grew this process by is what a rank's
            # build keeps besides its tensors, the builder's imports above all (transformers:
            # about 40 MB), imported after a rank marks its runtime and held from then on.
            build_held = max(anonymous_bytes() - before_build, 0)
            as_in_a_run.enter_context(unpacked_sequences())  # the build imported the model's library
            optimizer = instantiate(traced.optimizer)(model.parameters())
            phases = Phases()
            settings = TrainerSettings(steps=1, batch_size=batch_sizes[0], grad_accum=traced.train.grad_accum)
            trainer = Trainer(settings, ranks, model, OptimizerStep(optimizer), traced.loss,
                              Batches([], traced.data.batch_keys), memory=phases)
            # A step before counting: it makes the optimizer state, which every later step
            # holds, and warms DTensor's sharding-propagation cache, whose fake tensors the
            # trackers would otherwise count as the first step's memory.
            trainer.train_step(fake_batches(item, batch_sizes[0] // traced.train.grad_accum))
            data_bytes = max(baseline - before_data, 0)
            # A run starts threads the trace does not count as tensors, each with its stack in the
            # data segment memory.limit_gb counts: a backward through tensor subclasses starts
            # autograd's device threads (8 on a machine without a GPU): a run's through FSDP2's
            # DTensor parameters, not DDP's plain ones, and the trace's through its fake tensors
            # whatever the sharding. An async checkpoint save starts threads too
            # (`checkpoint.threads_started`).
            stack = thread_stack_bytes()
            stacks = max(thread_count() - threads, 0) * stack if sharding.shards_params else 0
            baseline += stacks + build_held  # held from the first step (the build) on, as the runtime is
            buckets = ddp_buckets(model) if replicates(exp.sharding) else 0
            steps, library = [], []
            # DDP's reducer all-reduces its buckets, which the trace adds as what they hold
            reduced = 2 * buckets * (world_size - 1) // world_size
            for batch_size in batch_sizes:
                counts = phases.counts = LiveBytes(offloaded, workspaces, keep_events=cap_bytes is not None)
                batches = fake_batches(item, batch_size // traced.train.grad_accum)
                mem = phases.tracker = tracker(model, optimizer, counts)
                # the first size's FLOPs, as a run counts its first step's (the others scale with the batch)
                with mem, counting_flops(model) if not steps else contextlib.nullcontext() as flops:
                    trainer.train_step(batches)
                steps.append(StepTrace(batch_size, counts.peaks, state_bytes(optimizer), buckets,
                                       mem.attention, len(counts.streams),  # type: ignore[attr-defined]
                                       at_phase_ends_bytes=counts.at_phase_ends,
                                       flops=flops.step.hardware if flops is not None and flops.step else 0,
                                       wire_bytes=counts.wire_bytes + reduced))
                if cap_bytes is not None:
                    cap_the_replay(steps[-1], counts, cap_bytes)
                library.append(counts.library)
                if enough is not None and enough(steps[-1], baseline):
                    break
            if enough is None:  # task=estimate, and a run's own: what task=eval of these weights holds
                evaluated = Uninitialised(replace(exp.model, init_device="cpu")).build()[0].eval()
                for found in steps:
                    found.eval_forward_bytes = eval_forward_bytes(evaluated, item, found.batch_size, traced.loss,
                                                                  traced.data.batch_keys)
        if not on_gpu:  # what MKL and oneDNN keep of their own after a step (fsdp_exp.estimate.library)
            for step, kept in zip(steps, kept_by_step([s.batch_size for s in steps], library, rank_threads(world_size))):
                step.library = kept
        params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole parameter's
        shard_count = sharding.shard_size(world_size) if sharding.shards_params else 1
        # Each rank builds the whole model, then sharding copies its shards out of it.
        whole = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        build = whole + local_bytes(model) if shard_count > 1 else whole
        shards = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return Trace(world_size, steps, build, params, shard_count, baseline, data_bytes, stacks, stack, data_load,
                 time.perf_counter() - start, whole, sample_bytes, workers, build_held, pinned_bytes(model),
                 data_in_use + build_in_use, optimizer_params=shards)


def cap_the_replay(step: StepTrace, counts: LiveBytes, cap_bytes: int) -> None:
    """The step's reserved peak where the allocator may reserve `cap_bytes`: near the cap it
    releases its cached segments before it grows, so the peak can be lower than uncapped; past
    it, `past_the_cap` (a run runs out of memory there) and the uncapped peak, to say by how
    much. What the trace does not see is in segments of its own, beside the replay."""
    assert counts.events is not None, "made with keep_events"
    under = reserved_under(counts.events, cap_bytes - untraced_segments(step))
    step.past_the_cap = under is None
    if under is not None:
        step.peaks["segments"] = replace(step.peaks["segments"], bytes=under)


def eval_forward_bytes(model: torch.nn.Module, item: Any, batch_size: int, loss: LossOption,
                       keys: BatchKeys) -> int:
    """The peak of task=eval's forward (`fsdp_exp.tasks.eval`) of the whole, unsharded
    model at `batch_size`, without gradients: its inputs, activations while they are
    needed, the output in fp32 and the `loss`, above the model itself."""
    counts = LiveBytes(())
    mem = PlainTracker(counts)
    with mem, torch.no_grad():
        batch = keys.read(stacked(item, batch_size), forward_keys(model), loss.reads_targets)
        loss(batch.forward(model), batch, reduction="sum")
    peak = counts.peaks["cpu"]
    # the tracker counts the model's parameters and buffers once its modules run: they are not the forward's
    return peak.bytes - sum(peak.categories.get(c, 0) for c in ("Parameter", "Buffer"))


class AttentionAsOnGpu(TorchFunctionMode):
    """`scaled_dot_product_attention` as a GPU runs it. There, flash and memory-efficient
    attention keep no tokens x tokens matrix, with dropout too (its mask is regenerated in
    the backward, not stored). On the CPU a call with dropout falls back to the math
    kernel, which keeps several of them: GPT-2's attention dropout at 1024 tokens made a
    GPU estimate of GPT-2 XL 24 GB a sample. So for a GPU every call runs as the CPU's flash
    kernel, which keeps the output and a row sum; `breakdown.attention_workspace` adds what
    a GPU kernel's backward holds besides."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = dict(zip(names, args)) | kwargs
        query, key, value = call["query"], call["key"], call["value"]
        if call.get("enable_gqa") or not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
            return func(*args, **kwargs)  # grouped heads: as called
        output, _ = flash_attention_for_cpu(
            query, key, value, 0.0, bool(call.get("is_causal", False)), attn_mask=call.get("attn_mask"),
            scale=call.get("scale"))
        return output


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Hugging Face's causal masks as a run makes them. Given no position ids, a model makes
    0..n-1 in every row, and looks whether a row packs several sequences
    (masking_utils.find_packed_sequence_indices): a run reads the values, finds none, and
    has SDPA mask causally by itself. On fake tensors it cannot read them and takes every
    batch for packed: each layer would then keep a batch x tokens x tokens mask (0.5 GB a
    layer for a batch of 8 at 4,096 tokens) that the run never makes."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    found = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


class Phases:
    """In the trainer's memory monitor's place: names the phase of the step (forward,
    backward, optimizer_step) the counts are in."""

    counts: LiveBytes | None = None
    tracker: PlainTracker | ShardedTracker | None = None  # the step's, while it counts

    def start_phase(self, name: str) -> None:
        if self.counts is not None:
            self.counts.phase_end()  # where a run's rank reads peak_in_use_gb
            self.counts.phase = name
        if name == "forward" and self.tracker is not None:
            # each micro-batch of train.grad_accum runs the modules' forward again, which
            # FSDPMemTracker refuses unless its per-module stats (not read here) start anew
            self.tracker.reset_mod_stats()

    def end_phase(self) -> None:
        self.start_phase("")


def fake_batches(item: Any, micro: int) -> Iterator[Any]:
    """Endless micro-batches shaped like the data's `item` (their values are never read)."""
    while True:
        yield stacked(item, micro)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def data_worker_bytes(dataset: Any, micro_batch: int) -> int:
    """What one DataLoader worker holds of its own once it has made a batch: its private
    dirty pages (what it copied of the rank on write, and what it made). Measured in a
    process forked from this one, as Linux's DataLoader forks its workers, that makes one
    batch as a worker does; a rank's `data.num_workers` workers each hold about this, and
    the batches they have made wait in shared memory (counted apart)."""
    if not hasattr(os, "fork") or private_dirty_bytes() is None:
        return 0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: one batch, then what it holds of its own
        held = 0
        try:
            from torch.utils.data import default_collate

            default_collate([dataset[i % len(dataset)] for i in range(micro_batch)])
            held = private_dirty_bytes() or 0
        finally:
            os.write(write, str(held).encode())
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read) as reply:
            return int(reply.read() or 0)
    finally:
        os.waitpid(pid, 0)


def local_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of the model's parameters and buffers (its shards, under FSDP)."""
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def pinned_bytes(model: torch.nn.Module) -> int:
    """This rank's parameter shards as pinned host memory holds them: ATen's
    CachingHostAllocator rounds each block up to a power of two."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        n = local.numel() * local.element_size()
        total += 1 << (n - 1).bit_length() if n else 0
    return total


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.untyped_storage().nbytes()
    return total


def replicates(sharding: Any) -> bool:
    """sharding=ddp: a whole replica on every rank, with DDP's reducer."""
    return sharding.distributed and not sharding.shards_params


def ddp_buckets(model: torch.nn.Module) -> int:
    """DDP's reducer keeps one flat bucket per ~25 MB of gradients: a copy of them all,
    in the parameters' dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class InUse:
    """How much more this process's allocations hold (`heap_in_use_bytes`) at `growth()`
    than when made: what a rank's peak_in_use_gb counts of what was built meanwhile."""

    def __init__(self) -> None:
        self.start = heap_in_use_bytes() or 0

    def growth(self) -> int:
        return max((heap_in_use_bytes() or 0) - self.start, 0)


class PeakGrowth:
    """How far this process's memory rises above what it holds now, at its peak, until
    `bytes()` (Linux: the resident peak is reset here; library code paged in meanwhile is
    left out, as memory.limit_gb leaves it out)."""

    def __init__(self) -> None:
        self.resets = reset_resident_peak()
        status = proc_status()
        self.resident, self.files = status["VmRSS:"] * 1024, file_bytes(status)

    def bytes(self) -> int:
        if not self.resets:
            return 0
        status = proc_status()
        return max(status["VmHWM:"] * 1024 - self.resident - max(file_bytes(status) - self.files, 0), 0)
