"""What the trace counts of a step: the live storages by what they hold (torch's memory
trackers, `MemTracker` and `FSDPMemTracker`, subclassed to keep the peaks of each category
and the storages on a GPU's device replayed through the caching allocator), the library
ops the step ran (fsdp_exp.estimate.library), and the bytes its collectives send."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule

from fsdp_exp.estimate.allocator import CachingAllocator, Event, cuda_block
from fsdp_exp.estimate.library import LibraryOps
from fsdp_exp.estimate.traced import TracedPeak
from fsdp_exp.torch_private import FSDPMemTracker, MemTracker, UpdateType


class LiveBytes:
    """Live bytes by tracker category, two ways: as stored (the CPU) and in the CUDA
    allocator's 512-byte blocks, and the peaks of each; and the storages on a GPU's device
    replayed through the caching allocator (`device`), whose reserved memory is the
    `segments` peak. The CPU peak counts every category, the GPU's all but the `offloaded`
    ones (in host memory there).

    The caching allocator caches freed blocks per stream, so each allocation goes to the
    replay on the stream it was made on: FSDP2 runs its all-gather copy-in and its
    reduce-scatter on streams of its own (`torch.cpu.Stream`s in the trace, as
    `torch.cuda.Stream`s on a GPU), and the tracker sees the current one. cuBLAS's
    workspaces (`workspaces`, bytes each) are held from the first matmul on, on the compute
    stream. With `keep_events`, `events` keeps what went to the replay, in order, to replay
    again under a cap (`allocator.reserved_under`)."""

    def __init__(self, offloaded: tuple[str, ...], workspaces: tuple[int, ...] = (), keep_events: bool = False):
        self.offloaded = offloaded
        self.now: dict[str, dict[str, int]] = {"stored": {}, "blocks": {}}
        self.peaks = {"cpu": TracedPeak(), "blocks": TracedPeak(), "segments": TracedPeak()}
        self.device = CachingAllocator()
        self.streams: dict[object, int] = {torch.cpu.current_stream(): 0}
        self.events: list[Event] | None = [] if keep_events else None
        for n, nbytes in enumerate(workspaces):
            self._on_device(("cuBLAS workspace", n), nbytes, 0)
        self.phase = ""
        self.at_phase_ends = 0  # the most the storages held where a phase started or ended
        self.library = LibraryOps()  # the ops MKL and oneDNN ran (fsdp_exp.estimate.library)
        self.wire_bytes = 0  # what this rank's collectives sent (`wire_bytes`)

    def phase_end(self) -> None:
        self.at_phase_ends = max(self.at_phase_ends, sum(self.now["stored"].values()))

    def allocate(self, key: object, category: str, nbytes: int) -> None:
        self.change(category, nbytes, +1)
        if category not in self.offloaded and nbytes:  # a request of 0 bytes takes no block
            stream = self.streams.setdefault(torch.cpu.current_stream(), len(self.streams))
            self._on_device(key, nbytes, stream)

    def _on_device(self, key: object, nbytes: int, stream: int) -> None:
        self.device.malloc(key, nbytes, stream)
        if self.events is not None:
            self.events.append((key, nbytes, stream))

    def release(self, key: object, category: str, nbytes: int) -> None:
        self.change(category, nbytes, -1)
        if key in self.device.live:
            self.device.free(key)
            if self.events is not None:
                self.events.append((key, -1, 0))

    def change(self, category: str, nbytes: int, sign: int) -> None:
        for kind, size in (("stored", nbytes), ("blocks", cuda_block(nbytes))):
            bucket = self.now[kind]
            bucket[category] = bucket.get(category, 0) + sign * size

    def see(self) -> None:
        stored = self.now["stored"]
        self.peaks["cpu"].see(sum(stored.values()), stored, self.phase)
        on_device = {k: v for k, v in self.now["blocks"].items() if k not in self.offloaded}
        self.peaks["blocks"].see(sum(on_device.values()), on_device, self.phase)
        self.peaks["segments"].see(self.device.reserved, on_device, self.phase)


def wire_bytes(func, args: tuple) -> int:  # noqa: ANN001
    """What one rank sends in a collective, as a ring runs it among n ranks: an all-gather
    or a reduce-scatter of a whole of S bytes, S (n - 1) / n; an all-reduce, twice that.
    (The fake process group moves nothing; the ops come through the dispatcher all the same.)"""
    name = func.__name__
    if name.startswith("_allgather_base"):  # (output, input, group, ...)
        whole, part = args[0], args[1]
    elif name.startswith("_reduce_scatter_base"):  # (output, input, group, ...)
        whole, part = args[1], args[0]
    elif name.startswith("allreduce_") and "c10d" in str(func):  # ([tensors], group, ...)
        group = args[1]
        n = (ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group).size()
        return sum(2 * t.numel() * t.element_size() * (n - 1) // n for t in args[0])
    else:
        return 0
    if not part.numel():
        return 0
    n = whole.numel() // part.numel()
    return whole.numel() * whole.element_size() * (n - 1) // n


class CountingTracker:
    """Mixed into torch's trackers: every change of the live storages goes to `counts`,
    and every op's result is seen against the peaks (the trackers keep one peak, of all
    categories together)."""

    counts: LiveBytes
    attention: list[tuple[int, ...]]  # the query shape of every attention call

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:  # noqa: ANN001
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)  # type: ignore[misc]
        category = str(winfo.reftype.value)
        if u_type == UpdateType.ADD:
            self.counts.allocate(winfo, category, winfo.mem_consumed)
        elif u_type == UpdateType.DEL:
            self.counts.release(winfo, category, winfo.mem_consumed)
        elif u_type == UpdateType.REF:  # the same storage, counted under another category
            self.counts.change(str(old_reftype.value), winfo.mem_consumed, -1)
            self.counts.change(category, winfo.mem_consumed, +1)
        elif u_type == UpdateType.SIZE:
            self.counts.release(winfo, category, old_mem_consumed)
            self.counts.allocate(winfo, category, winfo.mem_consumed)

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ANN001
        super()._update_peak_stats(peak_state)  # type: ignore[misc]
        self.counts.see()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        result = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]
        self.counts.library.see(func, args)
        self.counts.wire_bytes += wire_bytes(func, args)
        if result is not NotImplemented and "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            self.attention.append(tuple(args[0].shape))
        return result


class ShardedTracker(CountingTracker, FSDPMemTracker):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, counts: LiveBytes):
        FSDPMemTracker.__init__(self, model, optimizer)
        self.counts, self.attention = counts, []


class PlainTracker(CountingTracker, MemTracker):
    def __init__(self, counts: LiveBytes):
        MemTracker.__init__(self)
        self.counts, self.attention = counts, []


def tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer, counts: LiveBytes) -> MemTracker:
    if isinstance(model, FSDPModule):
        return ShardedTracker(model, optimizer, counts)
    made = PlainTracker(counts)
    made.track_external(model, optimizer)
    return made
