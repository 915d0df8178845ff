"""Peak memory of this rank over a window of steps.

`peak_mem_gb`, the figure shown first everywhere, is the memory the run itself took on the
rank: on GPU the caching allocator's allocated peak (the tensors); on CPU the process's peak
resident memory (VmHWM) less what the rank held before it built its model (`runtime_gb`:
torch, the process group, and whatever the launcher loaded into the process). That runtime
differs by launcher (a rank forked from a process that imported torch once holds less than a
fresh torchrun or Ray worker), so the whole process's peak, `peak_resident_gb`, does too,
while `peak_mem_gb` is the same whatever started the ranks. Resident memory also holds
what glibc keeps of freed blocks for reuse: on a CPU run that is as much again as the
step's tensors, and it grows with the heap's fragments from step to step. So a CPU rank
also reads what its allocations hold (`heap_in_use_bytes`, the runtime's left out) where
each phase of a step starts and ends: `peak_in_use_gb`, the most it held there, the figure
task=estimate's own trace predicts at the same places (on gloo once its worker threads have
freed what the collectives that returned held: `GlooWorkers`). On GPU the other peaks are
`peak_active_gb` and `peak_reserved_gb`, and the window's counts of cache flushes to retry an
allocation and of out-of-memory errors. CPU peaks are reset at each window where the kernel
allows it (/proc/self/clear_refs), else they are the peaks since the process started.

Where peaks can be reset, each phase of a step (forward and backward, the optimizer step)
also has its own peak, `peak_<phase>_gb`: at small batches the optimizer step sets the
step's peak, while the forward and backward peak already grows with every sample. On CPU
under memory.limit_gb a phase's peak is counted as the limit counts memory: what it counted
when the phase began, plus the growth of resident memory during the phase.
`metrics.phase_peaks=false` leaves them out: on GPU each phase boundary reads the
allocator's whole dict of stats (torch.cuda.memory_stats; max_memory_allocated reads it too)
and resets its peaks, which a small, launch-bound model feels, and on CPU over gloo each read
waits for gloo's threads (GlooWorkers). With them, a step that reads phases (the trainer's
warm-up steps: fsdp_exp.rank.trainer.PHASE_STEPS) reads the stats where each phase starts
and after the optimizer step (4 reads at grad_accum=1); without, none, and a window once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_exp.linux import (
    file_bytes,
    heap_in_use_bytes,
    proc_status,
    reset_resident_peak,
    resident_peak_bytes,
    thread_cpu_ns,
    thread_file,
    thread_ids,
    thread_runnable,
    trim_heap,
)
from fsdp_exp.memory import peak_under_limit_gb
from fsdp_exp.metrics.summary import PEAK_GB

GB = 2**30



@dataclass(frozen=True)
class Runtime:
    """What a CPU rank held before it built its model (`mark_runtime`), which peak_mem_gb
    leaves out; none on a GPU, where the runtime is outside the allocator."""

    resident_bytes: int = 0
    file_bytes: int = 0  # of which library code and other files mapped in
    in_use_bytes: int = 0  # of which its allocations held (heap_in_use_bytes)

    @property
    def gb(self) -> float:
        return self.resident_bytes / GB


GLOO_WORKER = "pt_gloo_runloop"  # the name of gloo's worker threads (ProcessGroupGloo's runLoop)
SETTLE_STEP_S, SETTLE_S = 0.0002, 0.01


class GlooWorkers:
    """gloo's worker threads in this process. A gloo collective returns to the rank before
    the worker thread that ran it drops its hold on the buffers (a reduce-scatter's copy of
    its whole input, an all-gather's of FSDP's own buffers): on a busy CPU the rank's
    thread, just woken, runs on while the worker waits for a core, and what the rank's
    allocations hold then counts them. A worker that waits for its next collective
    (sleeping) holds nothing; one that waits for a core to let go is runnable and has not
    run. Threads a worker starts carry its name too (OpenMP's, for a large copy), and spin
    after their work, runnable and running: they hold nothing of it."""

    def __init__(self) -> None:
        self.tasks: set[str] = set()
        self.workers: list[str] = []
        self.spinning: set[str] = set()  # of the last read: runnable and running all along
        self.settled = True  # whether the last read ended with its workers settled, not at its deadline

    def runnable(self) -> dict[str, int]:
        """The workers that are running or waiting to run, and the CPU time each has had
        (ns; Linux's /proc, as every figure here)."""
        tasks = thread_ids()
        if tasks != self.tasks:  # threads started or ended: find the workers again
            self.tasks = tasks
            self.workers = [t for t in tasks if thread_file(t, "comm").strip() == GLOO_WORKER]
        return {t: thread_cpu_ns(t) for t in self.workers if thread_runnable(t)}

    def settled_heap_in_use_bytes(self) -> int | None:
        """`heap_in_use_bytes` once the workers let go: the rank sleeps in steps of
        SETTLE_STEP_S, which lets them run, until a step frees nothing and no worker waits
        for a core (SETTLE_S at most). A worker that was freeing can sleep on malloc's lock
        while this read holds it; a thread that ran for half a step and is still runnable
        spins, and is not waited for."""
        now, waiting = heap_in_use_bytes(), self.runnable()
        self.spinning, self.settled = set(), True
        if now is None or not self.workers:
            return now
        deadline, freed = time.perf_counter() + SETTLE_S, True
        while (freed or waiting.keys() - self.spinning) and time.perf_counter() < deadline:
            time.sleep(SETTLE_STEP_S)
            later = heap_in_use_bytes() or 0
            freed, now = later < now, min(now, later)
            runnable = self.runnable()
            ran_on = {t for t, ns in runnable.items() if t in waiting and ns - waiting[t] > SETTLE_STEP_S * 1e9 / 2}
            self.spinning |= ran_on
            waiting = runnable
        self.settled = not (freed or waiting.keys() - self.spinning)
        return now


def mark_runtime(device: torch.device) -> Runtime:
    """What this CPU rank holds now, before it builds its model: its runtime, which its
    MemoryMonitor leaves out of peak_mem_gb (none on GPU, where the runtime is outside
    the allocator and peak_mem_gb counts tensors only)."""
    if device.type != "cpu":
        return Runtime()
    trim_heap()  # as start_run will: what was freed is no part of the runtime
    status = proc_status()
    return Runtime(status["VmRSS:"] * 1024, file_bytes(status), heap_in_use_bytes() or 0)


def device_used_gb(device: torch.device, peak_reserved_gb: float) -> float | None:
    """GPU: what the device held at the allocator's reserved peak: what every process holds
    on it now (torch.cuda.mem_get_info), with the CUDA context, NCCL and cuBLAS outside the
    allocator, plus how far the allocator's reserved memory is now below `peak_reserved_gb`,
    this rank's own. It assumes what sits outside the allocator did not grow after the peak
    (NCCL's communicators are made at the first collective), and counts any other process
    on the same GPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    below = max(peak_reserved_gb - torch.cuda.memory_reserved(device) / GB, 0.0)
    return (total - free) / GB + below


def over_windows(key: str, run: list[float] | None, window: list[float]) -> list[float]:
    """A run's figure per rank from its windows': the sum of the allocator's counts
    (retries, out-of-memory errors), the largest of the peaks."""
    if run is None:
        return list(window)
    if key in MemoryMonitor.COUNTS:
        return [a + b for a, b in zip(run, window)]
    return [max(a, b) for a, b in zip(run, window)]


class MemoryMonitor:
    COUNTS = ("alloc_retries", "ooms")  # events within a window: a run's figure is their sum, not the largest

    def __init__(self, device: torch.device, phase_peaks: bool = True, runtime: Runtime = Runtime()):
        """`phase_peaks`: also each phase's peak (metrics.phase_peaks). `runtime`: what the
        rank held before it built its model (`mark_runtime`), left out of peak_mem_gb."""
        self.device = device
        self.runtime = runtime
        self.cpu_resets = device.type == "cpu" and reset_resident_peak()
        self.phase_peaks = phase_peaks and (device.type == "cuda" or self.cpu_resets)
        # CPU ranks that talk over gloo: its worker threads free a collective's buffers late
        self.gloo = GlooWorkers() if device.type == "cpu" and dist.is_initialized() and dist.get_world_size() > 1 \
            else None
        self.window: dict[str, float] = {}  # the window's peaks over the phases that ended
        self.phase: tuple[str, float | None, float] | None = None  # name; GB under the limit and resident at its start

    def start_run(self) -> None:
        """The first window. What was freed before training, such as the whole model a rank
        built before sharding it, first goes back: on CPU the heap's free pages to the kernel
        (glibc's malloc_trim), on GPU the caching allocator's free blocks to the driver
        (empty_cache). Otherwise it stays resident, or reserved, and counts in every peak.
        Once only: a trim every window would cost about a sixth of the step time on CPU, and
        on GPU the allocator would have to ask the driver again for what it gave back."""
        if self.device.type == "cpu":
            trim_heap()
        else:
            torch.cuda.empty_cache()
        self.start_window()

    def start_window(self) -> None:
        self.window, self.phase = {}, None
        self._reset_peaks()
        if self.device.type == "cuda":  # the retry and OOM counts start again from 0
            torch.cuda.reset_accumulated_memory_stats(self.device)

    def start_phase(self, name: str) -> None:
        """Begin a phase of the step, ending the one before; its peak is `peak_<name>_gb` in
        the window's peaks."""
        if not self.phase_peaks:
            return
        status = self._boundary()
        if self.device.type == "cuda":
            self.phase = (name, None, 0.0)
        else:
            self.phase = (name, _counted_now_gb(status), status["VmRSS:"] * 1024 / GB)

    def end_phase(self) -> None:
        if self.phase is not None:
            self._boundary()

    def window_peaks(self) -> dict[str, float]:
        """`peak_mem_gb` (allocated on GPU, resident on CPU), on GPU the other peaks and the
        window's counts, and each phase's peak."""
        self._boundary()
        return dict(self.window)

    def _boundary(self) -> dict[str, int]:
        """Fold what the peaks hold since their last reset (the phase that ends, or what ran
        between phases) into the window, then reset them: one read of the allocator's stats
        (of /proc/self/status on CPU, which it returns)."""
        peaks, status = self._peaks()
        if self.phase is not None:
            name, counted, resident = self.phase
            # The peaks were reset where the phase began. CPU under a limit: what the limit
            # counted then plus the growth of resident memory since.
            peaks[f"peak_{name}_gb"] = peaks[PEAK_GB] if counted is None \
                else peaks["peak_resident_gb"] + counted - resident
            self.phase = None
        self._fold(peaks)
        self._reset_peaks()
        return status

    def _fold(self, peaks: dict[str, float]) -> None:
        for key, value in peaks.items():
            self.window[key] = max(value, self.window.get(key, value))

    def _reset_peaks(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.cpu_resets:
            reset_resident_peak()

    def _peaks(self) -> tuple[dict[str, float], dict[str, int]]:
        """The peaks since the last reset; on GPU the window's counts too (they only grow
        within a window, so the largest read is the last)."""
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            return {
                PEAK_GB: stats.get("allocated_bytes.all.peak", 0) / GB,
                "peak_active_gb": stats.get("active_bytes.all.peak", 0) / GB,
                "peak_reserved_gb": stats.get("reserved_bytes.all.peak", 0) / GB,
                "alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "ooms": float(stats.get("num_ooms", 0)),
            }, {}
        status = proc_status()
        resident = resident_peak_bytes(status)
        # Library code paged in since the mark is the runtime's too: how much of it a rank
        # already had depends on what started it.
        runtime = self.runtime.resident_bytes + max(file_bytes(status) - self.runtime.file_bytes, 0)
        peaks = {PEAK_GB: (resident - runtime) / GB, "peak_resident_gb": resident / GB}
        in_use = None
        if self.phase_peaks:
            in_use = self.gloo.settled_heap_in_use_bytes() if self.gloo is not None else heap_in_use_bytes()
        if in_use is not None:  # read where each phase starts and ends: what the step holds there
            peaks["peak_in_use_gb"] = (in_use - self.runtime.in_use_bytes) / GB
        return peaks, status

    def held_gb(self) -> float:
        """Memory in use now; between steps that is parameters and optimizer state (on CPU
        with the runtime, as the peak task=max_batch judges by counts it)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / GB
        return proc_status()["VmRSS:"] * 1024 / GB


def _counted_now_gb(status: dict[str, int]) -> float | None:
    """CPU under memory.limit_gb: what the limit counts now, its peak count less how far
    the address space now is below its peak (see fsdp_exp.memory.peak_under_limit_gb)."""
    peak = peak_under_limit_gb()
    if peak is None:
        return None
    return peak - (status["VmPeak:"] - status["VmSize:"]) * 1024 / GB
