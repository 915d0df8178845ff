"""What one rank's peak is made of, from a trace: on the CPU as traced, on a GPU with what
only a GPU has.

On a GPU (`device=cuda`), added to the trace:
- the caching allocator's rounding: every block a multiple of 512 bytes (the peak counts
  blocks); `peak_reserved_gb` is what the allocator holds, from a replay of the traced
  allocations and frees through its rules (`fsdp_exp.estimate.allocator`: 2 and 20 MiB
  segments, splitting, merging, freed blocks cached per stream, each allocation on the
  stream it was made on);
- with `offload=true`, the sharded parameters, their gradients and the optimizer state
  (its step too) in host memory, off the device;
- flash and memory-efficient attention's backward: an fp32 accumulator the size of the
  query and a row sum per query, for the largest attention call (the CPU's kernel keeps
  these inside itself, so the trace does not see them);
- cuBLAS's workspace, through the allocator (`fsdp_exp.estimate.gpu`);
- the CUDA context and NCCL's communicators, which sit outside the allocator: `task.baseline_gb`,
  by default modelled for the setup (`fsdp_exp.estimate.gpu`). `peak_reserved_gb` leaves them
  out, as `memory.limit_gb`'s cap does; `device_used_gb` adds them, as the device counts.
None of the GPU side has been checked against a GPU here (docs/BENCHMARKS.md says what has).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fsdp_exp.estimate.allocator import cuda_block, segment_size
from fsdp_exp.estimate.traced import CATEGORIES, OFFLOADED, StepTrace, Trace, TracedPeak

GB = 2**30
PARTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "unsharded_and_buffers")


@dataclass
class BatchEstimate:
    batch_size: int
    peak_with_runtime_gb: float  # the largest of the step's peak, the build's and the data load's, with the baseline
    step_peak_gb: float  # a training step's peak, with the baseline
    phase: str  # where the peak falls: forward | backward | optimizer_step, or a phase of phases_gb
    breakdown_gb: dict[str, float]  # the step's peak by what holds it; the parts sum to step_peak_gb
    # each phase's peak, with the baseline: step, model build (rank 0's model build), data load, checkpoint save
    phases_gb: dict[str, float]
    peak_reserved_gb: float | None = None  # GPU: what the caching allocator would hold at the peak
    offloaded_gb: float | None = None  # GPU with offload=true: in host memory at the peak
    peak_under_limit_gb: float = 0.0  # what memory.limit_gb caps: the peak, or on a GPU what the allocator reserves
    device_used_gb: float | None = None  # GPU: what the device holds, the reserved memory and what sits outside it

    peak_in_use_gb: float | None = None  # CPU: what the allocations hold where the step's phases end, as peak_in_use_gb
    eval_gb: float | None = None  # task=eval of these weights at this batch (`evaluation_gb`): not a phase of the run
    host: dict = field(default_factory=dict)  # the host's memory per node (`fsdp_exp.estimate.host`)

    def __post_init__(self) -> None:
        self.peak_under_limit_gb = self.peak_with_runtime_gb if self.peak_reserved_gb is None else self.peak_reserved_gb
        if self.peak_reserved_gb is not None:
            # the device's largest phase: a step's reserved memory, or the whole model and its shards while it is built
            building = self.phases_gb.get("model build", 0.0) - self.breakdown_gb["baseline"]
            self.peak_under_limit_gb = max(self.peak_reserved_gb, building)
            self.device_used_gb = self.peak_under_limit_gb + self.breakdown_gb["baseline"]

    def training_gb(self) -> float:
        """The peak while it trains: a step, or a checkpoint save beside one."""
        return max(self.phases_gb.get("checkpoint save", 0.0), self.step_peak_gb)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "host"} | self.host


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


def untraced_segments(step: StepTrace) -> int:
    """The segments of what a GPU allocates that the trace does not see (DDP's buckets, the
    attention kernel's workspace), each in a segment of its own. cuBLAS's workspaces are in the
    replay's (`segments`)."""
    return sum(segment_size(cuda_block(n)) for n in (step.ddp_buckets_bytes, attention_workspace(step.attention)) if n)


def estimate_batch(step: StepTrace, trace: Trace | None, on_gpu: bool, offload: bool, baseline_gb: float,
                   builds_whole_model: bool, workspace_bytes: int = 0, stages_checkpoint: bool = False,
                   checkpoint_threads: int = 0, pretrained: bool = False) -> BatchEstimate:
    """One batch size's estimate. `builds_whole_model`: every rank first builds the whole
    model (model.init_device=cpu), which can outgrow a step when the shards are small; that
    needs the `trace` of the build. On a GPU, `baseline_gb` is what sits outside the
    allocator (the CUDA context, NCCL) and `workspace_bytes` cuBLAS's workspaces.
    `stages_checkpoint`: checkpoint saves copy the rank's state to CPU memory (dcp_async,
    dcp_async_pinned), which on a CPU rank sits beside the steps that run while it is
    written (dcp_async_pinned keeps it for the next save); on CPU the stacks of the
    `checkpoint_threads` its saves start are held from then on, as runtime. `pretrained`: the
    build loads pretrained weights (model.pretrained=true), and a build that outgrows the step
    is named `pretrained load`."""
    baseline = baseline_gb * GB
    # CPU: the threads a run starts after its model is built, whose stacks memory.limit_gb
    # counts: the first step's (in the measured baseline already) and the checkpointer's.
    started = 0
    if trace is not None and not on_gpu:
        # and what MKL and oneDNN keep outside malloc from the first step on (their generated code)
        library = step.library.data_bytes if step.library is not None else 0
        baseline += checkpoint_threads * trace.thread_stack_bytes + library
        started = trace.stack_bytes + checkpoint_threads * trace.thread_stack_bytes + library
    peak = step.peaks["blocks" if on_gpu else "cpu"]
    found = parts(peak, step.optimizer_state_bytes)
    reserved = offloaded = None
    if on_gpu:
        found["unsharded_and_buffers"] += cuda_block(step.ddp_buckets_bytes) + cuda_block(workspace_bytes)
        found["temporaries"] += attention_workspace(step.attention)
        reserved = (step.peaks["segments"].bytes + untraced_segments(step)) / GB
        if offload:
            offloaded = sum(v for c, v in step.peaks["cpu"].categories.items() if c in OFFLOADED) / GB
    else:
        found["unsharded_and_buffers"] += step.ddp_buckets_bytes
    step_bytes = sum(found.values()) + baseline
    breakdown = {part: found[part] / GB for part in PARTS} | {"baseline": baseline / GB}
    before_steps = baseline - started  # the threads are not there yet
    phases = {"step": step_bytes}
    if trace is not None and (builds_whole_model or not on_gpu):
        # model.init_device=meta: rank 0 still builds the whole model, to send each rank its
        # shards; on a GPU in host memory, on CPU beside its own shards
        phases["model build" if builds_whole_model else "rank 0's model build"] = trace.build_bytes + before_steps
    if not on_gpu and trace is not None:
        # A rank makes its data set after sharding its model: what making it takes above
        # what the data set keeps (generated data's temporaries), with the shards held.
        phases["data load"] = before_steps - trace.data_bytes + trace.data_load_bytes + found["parameters"]
    if stages_checkpoint and not on_gpu:
        # the model's state (its parameters and buffers) and the optimizer's, as each rank holds them
        phases["checkpoint save"] = step_bytes + found["parameters"] + step.optimizer_state_bytes
    largest = max(phases, key=lambda name: phases[name])
    total, phase = phases[largest], peak.phase if largest == "step" else largest
    if phase == "model build" and pretrained:  # model.pretrained=true: the build loads the weights
        phase = "pretrained load"
    return BatchEstimate(step.batch_size, total / GB, step_bytes / GB, phase, breakdown,
                         {name: n / GB for name, n in phases.items()}, reserved, offloaded)


def evaluation_gb(step: StepTrace, trace: Trace, on_gpu: bool, runtime_gb: float) -> float | None:
    """What task=eval of these weights holds at this batch, in one process (the command's
    own `runtime_gb`; on a GPU what sits outside the allocator): the whole model, and beside
    it a weights file read whole before it is copied in (model.safetensors, model.pt; a DCP
    checkpoint loads in place, and on a GPU the file is read into host memory), or the
    forward's peak without gradients."""
    if not step.eval_forward_bytes:
        return None
    beside = step.eval_forward_bytes if on_gpu else max(trace.model_bytes, step.eval_forward_bytes)
    return runtime_gb + (trace.model_bytes + beside) / GB
