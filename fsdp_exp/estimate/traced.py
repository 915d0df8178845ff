"""What a trace records: the peaks of a rank's training steps by the tracker's categories,
for each batch size traced (`fsdp_exp.estimate.trace` makes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_exp.estimate.library import Kept

# The tracker's categories (FSDPMemTracker's, then MemTracker's), by the estimate's.
CATEGORIES = {
    "parameters": ("Sharded Param", "Parameter"),
    "gradients": ("Sharded Grad", "Gradient"),
    "optimizer_state": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp",),
    "unsharded_and_buffers": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter", "Buffer"),
}
# With offload=true these live in host memory: on a GPU they leave the device.
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


@dataclass
class TracedPeak:
    """The largest total of one count over a traced stretch, and its categories then."""

    bytes: int = 0
    categories: dict[str, int] = field(default_factory=dict)
    phase: str = ""

    def see(self, total: int, categories: dict[str, int], phase: str) -> None:
        if total > self.bytes:
            self.bytes, self.categories, self.phase = total, dict(categories), phase


@dataclass
class StepTrace:
    """One batch size's trace: the peaks of its training steps, and what it ran."""

    batch_size: int
    peaks: dict[str, TracedPeak]
    optimizer_state_bytes: int  # what the optimizer keeps between steps
    ddp_buckets_bytes: int  # sharding=ddp: the reducer's flat copy of the gradients
    attention: list[tuple[int, ...]]  # query shapes, (batch, heads, tokens, head dim)
    streams: int = 1  # the streams its allocations were made on (FSDP2: compute, all-gather copy-in, reduce-scatter)
    eval_forward_bytes: int = 0  # task=eval's forward of the whole model at this batch, without gradients: its peak
    at_phase_ends_bytes: int = 0  # the most the storages held where a phase of the step started or ended
    library: Kept | None = None  # CPU: what MKL and oneDNN keep after the step's ops (None: not replayed)
    flops: int = 0  # the FLOPs the step ran, recomputed ones too (counted at the first size traced; else 0)
    wire_bytes: int = 0  # what this rank's collectives sent, as a ring sends them
    past_the_cap: bool = False  # GPU: the replay of the allocator passed the cap it was given: out of memory in a run


@dataclass
class Trace:
    world_size: int
    steps: list[StepTrace]
    build_bytes: int  # building and sharding the model, when each rank builds the whole model first
    params: int  # the model's parameter count
    shard_count: int  # how many ranks share each parameter
    baseline_bytes: int  # what this process held before tracing (torch, the data), as a rank before its model,
    # and the stacks of the threads its first step started (memory.limit_gb counts them on CPU)
    data_bytes: int  # of which the data set: a rank loads it after its runtime is marked, so it is the run's own
    stack_bytes: int  # of which the stacks of the threads the first step started: not held before it
    thread_stack_bytes: int  # one thread's stack, as memory.limit_gb counts it on CPU
    data_load_bytes: int  # the peak rise while the data set was made (generated data's temporaries): its phase
    seconds: float
    model_bytes: int = 0  # the whole model's parameters and buffers, as a plain build holds them
    sample_bytes: int = 0  # one sample and its target, as a batch holds them
    data_worker_bytes: int = 0  # data.num_workers > 0: what one DataLoader worker holds of its own (measured)
    # of baseline_bytes, what building the model kept besides its tensors (the builder's imports):
    # a rank builds after it marks its runtime, so it is the run's own, as the data set is
    build_held_bytes: int = 0
    pinned_shard_bytes: int = 0  # this rank's parameter shards, each rounded up to a power of two (pinned on a GPU)
    # what making the data set and building the model left this process's allocations holding
    # (`heap_in_use_bytes`): with a step's storages where its phases end, a rank's peak_in_use_gb
    built_in_use_bytes: int = 0
    optimizer_params: int = 0  # the elements this rank's optimizer updates: its shards
