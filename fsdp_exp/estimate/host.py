"""The host's memory per node: what each rank holds in the machine's RAM, times the ranks
on a node, and the launching command and its rank server once (each about a runtime, as
this command holds it).

Each rank is counted as a fresh process, as under torchrun's spawn, SLURM or Ray. The local
launcher's default forks its ranks from the rank server, with whose pages they share the
runtime until they write to them, so there the node holds less, by up to a runtime a rank
(docs/will_it_fit.md has the figures).

On CPU a rank's memory is host memory: its peak, every phase's (`breakdown`), is what it
holds. On a GPU the host holds, beside each rank's runtime and data set:
- with `offload=true`, the sharded parameters and gradients in pinned memory (FSDP2's
  CPUOffloadPolicy pins them; the pinned allocator rounds each block up to a power of two),
  and the optimizer's state in plain memory;
- with `checkpoint=dcp_async` or `dcp_async_pinned`, the staged copy of the rank's state
  that a save writes from (pinned, and kept for the next save, with `_pinned`);
- the batches the DataLoader pins for the copy to the device: one, and with
  `data.num_workers` the ones its workers have ready (two each, PyTorch's prefetch_factor;
  on CPU these wait in shared memory instead, counted with the workers);
- while the model is built, the whole model: every rank builds it on the host before moving
  it to its GPU, and with `model.init_device=meta` rank 0 alone, to send each rank its shards.
On both, each of `data.num_workers` DataLoader workers per rank holds what it copied of the
rank and made (measured on one worker of the real data set), with its ready batches.

What the runtime holds is this machine's measure of torch and the data set. A GPU rank's
CUDA libraries hold host memory too, which no CPU machine can measure: the figure is low by
that (docs/will_it_fit.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_exp.estimate.breakdown import GB, BatchEstimate
from fsdp_exp.estimate.traced import Trace

PREFETCH = 2  # batches each DataLoader worker makes ahead (torch's default prefetch_factor)


@dataclass(frozen=True)
class HostSetup:
    """What of the setup puts memory on the host, beside the trace."""

    ranks_per_node: int
    num_workers: int = 0  # data.num_workers
    stages_checkpoint: bool = False  # checkpoint=dcp_async, dcp_async_pinned
    builds_on_every_rank: bool = True  # model.init_device=cpu; meta: rank 0 alone builds the whole model
    grad_accum: int = 1
    launcher_gb: float = 0.0  # the launching command and its rank server, once per node
    offload: bool = False  # offload=true


def host_memory(batch: BatchEstimate, trace: Trace, setup: HostSetup, on_gpu: bool) -> dict:
    """Each rank's host memory by part (GB), and the node's: the larger of the model build
    and training, over its ranks, with the launching command and the data workers."""
    micro = batch.batch_size // setup.grad_accum * trace.sample_bytes / GB
    # each worker's ready batches wait in shared memory; on a GPU they are pinned (and the shared copies dropped)
    workers = setup.num_workers * (trace.data_worker_bytes / GB + (0.0 if on_gpu else PREFETCH * micro))
    n = setup.ranks_per_node
    if on_gpu:
        runtime = (trace.baseline_bytes - trace.stack_bytes) / GB
        offloaded = offloaded_gb(batch, trace) if setup.offload else 0.0
        parts = {"runtime and data": runtime,
                 "offloaded state": offloaded,
                 "checkpoint staging": state_gb(batch, trace) if setup.stages_checkpoint else 0.0,
                 "pinned batches": micro * (1 + PREFETCH * setup.num_workers),
                 "data workers": workers}
        whole = trace.model_bytes / GB
        # meta: rank 0 builds it while every rank holds its shards (pinned, under offload)
        building = n * (runtime + whole) if setup.builds_on_every_rank else \
            n * (runtime + (trace.pinned_shard_bytes / GB if setup.offload else 0.0)) + whole
        training = n * sum(parts.values())
        phase = "model build" if building > training else "training"
        node = max(building, training)
    else:
        # the rank's peak as resident memory: its threads' stacks, which memory.limit_gb counts whole, are mostly unused
        parts = {"rank's peak": batch.peak_with_runtime_gb - trace.stack_bytes / GB, "data workers": workers}
        phase, node = batch.phase or "step", n * sum(parts.values())
    parts = {name: gb for name, gb in parts.items() if gb}
    return {"host_gb": node + setup.launcher_gb, "host_phase": phase, "host_per_rank_gb": parts,
            "host_launcher_gb": setup.launcher_gb}


def offloaded_gb(batch: BatchEstimate, trace: Trace) -> float:
    """offload=true on a GPU: the parameter shards and their gradients in pinned memory, whose
    caching allocator rounds each block up to a power of two (ATen's CachingHostAllocator),
    and the optimizer's state, in plain host memory."""
    step = next(s for s in trace.steps if s.batch_size == batch.batch_size)
    return (2 * trace.pinned_shard_bytes + step.optimizer_state_bytes) / GB


def state_gb(batch: BatchEstimate, trace: Trace) -> float:
    """What a checkpoint save copies of one rank: its parameters (shards) and buffers, and
    the optimizer's state, wherever they live (on the device, or offloaded)."""
    own = trace.build_bytes - trace.model_bytes if trace.shard_count > 1 else trace.model_bytes
    step = next(s for s in trace.steps if s.batch_size == batch.batch_size)
    return (own + step.optimizer_state_bytes) / GB
