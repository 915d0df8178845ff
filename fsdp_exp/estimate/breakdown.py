"""What one rank's peak is made of, from a trace: on the CPU as traced, on a GPU with what
only a GPU has.

On a GPU (`device=cuda`), added to the trace:
- the caching allocator's rounding: every block a multiple of 512 bytes (the peak counts
  blocks); `reserved_gb` also rounds every block over 1 MiB up to whole 2 MiB segments,
  which is what the allocator holds when its cache keeps no other free blocks;
- with `offload=true`, the sharded parameters, their gradients and the optimizer state
  (its step too) in host memory, off the device;
- flash and memory-efficient attention's backward: an fp32 accumulator the size of the
  query and a row sum per query, for the largest attention call (the CPU's kernel keeps
  these inside itself, so the trace does not see them);
- the CUDA context and NCCL's buffers, which sit outside the allocator: `task.baseline_gb`,
  by default `CUDA_CONTEXT_GB`.
None of the GPU side has been checked against a GPU here (docs/BENCHMARKS.md says what has).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_exp.estimate.allocator import CUDA_SEGMENT, cuda_block
from fsdp_exp.estimate.traced import CATEGORIES, OFFLOADED, StepTrace, Trace, TracedPeak

GB = 2**30
# The CUDA context with torch's kernels loaded lazily (CUDA_MODULE_LOADING=LAZY, the default
# since CUDA 11.7) plus NCCL's buffers for a few peers: about 0.5 GB on recent GPUs.
CUDA_CONTEXT_GB = 0.5
PARTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "unsharded_and_buffers")


@dataclass
class BatchEstimate:
    batch_size: int
    predicted_peak_gb: float  # the step's peak or the build's, whichever is larger, with the baseline
    step_peak_gb: float  # a training step's peak, with the baseline
    phase: str  # where the peak falls: forward | backward | optimizer_step | model build
    breakdown_gb: dict[str, float]  # the step's peak by what holds it; the parts sum to step_peak_gb
    reserved_gb: float | None = None  # GPU: what the caching allocator would hold at the peak
    offloaded_gb: float | None = None  # GPU with offload=true: in host memory at the peak
    limited_gb: float = 0.0  # what memory.limit_gb caps: the peak, or on a GPU what the allocator reserves

    def __post_init__(self) -> None:
        self.limited_gb = max(self.predicted_peak_gb, self.reserved_gb or 0.0)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def parts(peak: TracedPeak, optimizer_state_bytes: int) -> dict[str, int]:
    """The tracker's categories at a peak as the estimate's parts. The optimizer's category
    holds its step's temporaries too: beyond the state it keeps, they are temporaries."""
    found = {part: sum(peak.categories.get(c, 0) for c in names) for part, names in CATEGORIES.items()}
    state = min(found["optimizer_state"], optimizer_state_bytes)
    found["temporaries"] += found["optimizer_state"] - state
    found["optimizer_state"] = state
    return found


def attention_workspace(shapes: list[tuple[int, ...]]) -> int:
    """Flash or memory-efficient attention's backward on a GPU: an fp32 query-sized
    accumulator and an fp32 row sum per query, for the largest call."""
    largest = max(shapes, key=math.prod, default=None)
    if largest is None:
        return 0
    rows = math.prod(largest[:-1])
    return 4 * (math.prod(largest) + rows)


def estimate_batch(step: StepTrace, trace: Trace | None, on_gpu: bool, offload: bool, baseline_gb: float,
                   builds_whole_model: bool) -> BatchEstimate:
    """One batch size's estimate. `builds_whole_model`: every rank first builds the whole
    model (model.init_device=cpu), which can outgrow a step when the shards are small; that
    needs the `trace` of the build."""
    baseline = baseline_gb * GB
    peak = step.peaks["blocks" if on_gpu else "cpu"]
    found = parts(peak, step.optimizer_state_bytes)
    reserved = offloaded = None
    if on_gpu:
        found["unsharded_and_buffers"] += cuda_block(step.ddp_buckets_bytes)
        found["temporaries"] += attention_workspace(step.attention)
        extra = cuda_block(step.ddp_buckets_bytes) + attention_workspace(step.attention)
        segments = math.ceil(step.peaks["segments"].bytes / CUDA_SEGMENT) * CUDA_SEGMENT
        reserved = (segments + extra + baseline) / GB
        if offload:
            offloaded = sum(v for c, v in step.peaks["cpu"].categories.items() if c in OFFLOADED) / GB
    else:
        found["unsharded_and_buffers"] += step.ddp_buckets_bytes
    step_bytes = sum(found.values()) + baseline
    breakdown = {part: found[part] / GB for part in PARTS} | {"baseline": baseline / GB}
    total, phase = step_bytes, peak.phase
    build_bytes = trace.build_bytes + baseline if builds_whole_model and trace is not None else 0
    if build_bytes > step_bytes:
        total, phase = build_bytes, "model build"
    return BatchEstimate(step.batch_size, total / GB, step_bytes / GB, phase, breakdown, reserved, offloaded)
