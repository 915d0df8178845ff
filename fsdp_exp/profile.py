"""conf/profile/*: optional profiling of a window of training steps.

profile=memory writes, per rank, a torch profiler memory timeline (HTML) over steps
[start_step, start_step + steps), and on a GPU a CUDA memory snapshot (pickle) that
pytorch.org/memory_viz reads. A GPU run that runs out of memory dumps a snapshot anyway;
it holds the allocations that led there when the allocator recorded its history from the
start of the run (`record_allocation_history`), which profile=memory asks for: the history
costs host time at every allocation, so a run that did not ask for it (a max_batch probe
above all, whose samples/s the tune ranks by) does not record it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from fsdp_exp import torch_private
from fsdp_exp.errors import ConfigError, at_least, one_line
from fsdp_exp.groups import ProfileOption

log = logging.getLogger("fsdp_exp")

HISTORY_ENTRIES = 200_000  # the allocator's last allocations and frees a snapshot holds
_recording_history = False  # this process's allocator records its history


def record_allocation_history(device: torch.device) -> bool:
    """On a GPU rank, the caching allocator records every allocation and free from now on
    (with Python stacks, about 2 us each), for the snapshots memory_viz reads. Decided by
    the rank's device, not by whether a GPU exists: a CPU rank on a GPU host must not
    initialise CUDA. True when this call started the recording."""
    global _recording_history
    if device.type != "cuda" or _recording_history:
        return False
    torch_private.record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    _recording_history = True
    return True


def stop_allocation_history(device: torch.device) -> None:
    global _recording_history
    if device.type == "cuda" and _recording_history:
        torch_private.record_memory_history(enabled=None)
        _recording_history = False


@dataclass
class NoProfile(ProfileOption):
    def check(self, train_steps: int) -> None:
        pass

    def start(self, run_dir: Path, rank: int, device: torch.device) -> NoProfiler:
        """This rank's step hooks for the run."""
        return NoProfiler()


class NoProfiler:
    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass


@dataclass
class MemoryProfile(NoProfile):
    records_history: ClassVar[bool] = True  # so that an out-of-memory snapshot shows what led there too

    start_step: int = 3  # the first profiled step
    steps: int = 2  # how many steps the window holds

    def __post_init__(self) -> None:
        at_least("profile.start_step", self.start_step, 1)
        at_least("profile.steps", self.steps, 1)

    def check(self, train_steps: int) -> None:
        if self.start_step + self.steps - 1 > train_steps:
            raise ConfigError(
                f"profile.start_step={self.start_step}: the window of {self.steps} "
                f"step(s) must end by train.steps={train_steps}"
            )

    def start(self, run_dir: Path, rank: int, device: torch.device) -> MemoryProfiler:
        return MemoryProfiler(self.start_step, self.steps, Path(run_dir), rank, device)


class MemoryProfiler:
    """profile=memory on one rank: torch's profiler over the window of steps, then the
    memory timeline and the allocator's snapshot."""

    def __init__(self, start_step: int, steps: int, run_dir: Path, rank: int, device: torch.device) -> None:
        self.start_step, self.steps = start_step, steps
        self.run_dir, self.rank, self.device = run_dir, rank, device
        self.profiler: Any = None
        self.stops_history = False

    def before_step(self, step: int) -> None:
        if step != self.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # Unless the run records its history from the start already: then it goes on after.
        self.stops_history = record_allocation_history(self.device)
        self.profiler = torch.profiler.profile(
            activities=activities, profile_memory=True, record_shapes=True, with_stack=True
        )
        self.profiler.__enter__()

    def after_step(self, step: int) -> None:
        if self.profiler is None or step != self.start_step + self.steps - 1:
            return
        self.profiler.__exit__(None, None, None)
        device = str(self.device) if self.device.type == "cuda" else "cpu"
        timeline = self.run_dir / f"memory_timeline_rank{self.rank}.html"
        try:
            self.profiler.export_memory_timeline(str(timeline), device=device)
        except AssertionError as err:  # torch's categorising pass can trip on in-place ops
            trace = self.run_dir / f"trace_rank{self.rank}.json"
            self.profiler.export_chrome_trace(str(trace))
            write_allocation_timeline(trace, timeline, self.rank, reason=one_line(err, limit=120),
                                      device=self.device)
        dump_cuda_snapshot(self.run_dir / f"memory_snapshot_rank{self.rank}.pickle", self.device)
        if self.stops_history:
            stop_allocation_history(self.device)
        log.info("memory profile of steps %d-%d: %s", self.start_step, step, timeline)
        self.profiler = None


def dump_cuda_snapshot(path: Path, device: torch.device) -> None:
    """On a GPU rank, the caching allocator's state (and its history, when recorded) for
    memory_viz. Never raises: it is written while a failure is being reported."""
    if device.type != "cuda":
        return
    try:
        torch_private.dump_snapshot(str(path))
    except Exception as err:  # noqa: BLE001 - e.g. a CUDA error left the device unusable
        log.warning("no memory snapshot at %s: %s", path, one_line(err, named=True, limit=200))


def write_allocation_timeline(trace: Path, html: Path, rank: int, reason: str,
                              device: torch.device = torch.device("cpu")) -> None:
    """An HTML plot of total allocated memory over time, from the trace's [memory] events
    of `device` alone: each event carries the running total of its own device (the host's
    and each GPU's), so a GPU rank's trace mixes two curves."""
    import base64
    import io
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device_type = 1 if device.type == "cuda" else 0  # the trace's "Device Type": 0 the CPU, 1 CUDA
    device_id = (device.index or 0) if device.type == "cuda" else -1
    events = [e for e in json.loads(trace.read_text()).get("traceEvents", [])
              if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})
              and e["args"].get("Device Type", 0) == device_type and e["args"].get("Device Id", device_id) == device_id]
    events.sort(key=lambda e: e["ts"])
    start = events[0]["ts"] if events else 0
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([(e["ts"] - start) / 1e3 for e in events], [e["args"]["Total Allocated"] / 2**20 for e in events])
    ax.set(xlabel="time (ms)", ylabel="allocated (MiB)", title=f"rank {rank}: allocated memory")
    image = io.BytesIO()
    fig.savefig(image, format="png", bbox_inches="tight")
    plt.close(fig)
    encoded = base64.b64encode(image.getvalue()).decode()
    html.write_text(
        f"<html><head><title>memory timeline, rank {rank}</title></head><body>"
        f"<p>Total allocated memory from {len(events)} allocator events ({trace.name}). torch's "
        f"categorised timeline was not available: {reason}</p>"
        f'<img src="data:image/png;base64,{encoded}"></body></html>'
    )
