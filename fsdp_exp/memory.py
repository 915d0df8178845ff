"""`memory.limit_gb`: a real per-rank memory ceiling, so a small machine can be stood in for.

GPU: the caching allocator is capped with `set_per_process_memory_fraction`. CPU: the rank
gets an allocation limit (RLIMIT_DATA) of its current data size plus the headroom left
under the limit, so an allocation past it fails for real. Either failure is an OutOfMemory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from fsdp_exp.errors import ConfigError
from fsdp_exp import linux
from fsdp_exp.linux import cap_data_segment, map_large_blocks, proc_status

GB = 2**30

# CPU under a limit: (anonymous resident, data segment) bytes when the limit was set.
_cpu_baseline: tuple[int, int] | None = None


# What fsdp_exp changes in a CPU rank's environment so that what the rank holds is what a CPU
# memory.limit_gb counts and an estimate predicts, each only where the user has not set it, and
# only for a run a limit or an estimate measures (`set_for_measuring`; docs/measurements.md):
MEASURING_ENVIRONMENT = {
    # wandb's error reporting starts two OpenTelemetry export threads at the first log, mid-run,
    # whose stacks add 16 MB to rank 0's data segment, which no other rank and no estimate has
    "WANDB_ERROR_REPORTING": "false",
    # torch's flight recorder keeps the last 2,000 collectives of every group, for debugging a
    # hang: on CPU its ring grows what a rank holds by about 2 MB over them, which no estimate counts
    "TORCH_FR_BUFFER_SIZE": "0",
}


def set_for_measuring(device_type: str, limit_gb: float | None, estimated: bool) -> bool:
    """MEASURING_ENVIRONMENT, where unset, in this process (before its process group and its
    wandb run start), when a CPU rank's memory is measured: under a limit, against an
    estimate (`estimated`: the run's own, a probe's search, the trace itself). Whether it was."""
    if device_type != "cpu" or (limit_gb is None and not estimated):
        return False
    for key, value in MEASURING_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    return True


class OutOfMemory(RuntimeError):
    """A rank ran out of memory (a real allocation failure, on GPU or CPU)."""


# Under the CPU limit, memory also runs out outside torch's allocator: a new thread's stack
# cannot be mapped (EAGAIN, e.g. when autograd starts its worker thread), or C++ new fails.
_CPU_LIMIT_FAILURES = ("Resource temporarily unavailable", "Cannot allocate memory", "std::bad_alloc")


# A GPU runs out of memory outside the caching allocator too, and then torch raises a plain
# RuntimeError: a library's own allocation (cuBLAS, cuDNN workspaces), the CUDA runtime,
# or NCCL's buffers (torch appends NCCL's last error; newer NCCL put the error code first).
_OUT_OF_MEMORY = re.compile(
    "DefaultCPUAllocator: can't allocate memory"
    "|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"
    "|CUDA error: out of memory"
    r"|Cuda failure (?:\d+ )?'out of memory'"
)


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError) or _OUT_OF_MEMORY.search(str(err)):
        return True
    return _cpu_baseline is not None and any(text in str(err) for text in _CPU_LIMIT_FAILURES)


def allocation_failure(err: BaseException) -> str:
    """The allocator's own sentence, without its source location (NCCL's, after "NCCL:")."""
    text = " ".join(str(err).split())
    found = _OUT_OF_MEMORY.search(text)
    if found and found.group().startswith("Cuda failure"):
        text = f"NCCL: {text[found.start():]}"
    elif found:
        text = text[found.start():]
    return text.split(". Error code")[0][:300]


def device_memory_gb(device: str | torch.device) -> float:
    """What one device holds: a GPU's memory (`cuda` alone: the current GPU), or this
    machine's RAM on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


@dataclass
class MemorySettings:
    limit_gb: float | None = None  # per rank: caps the GPU allocator, or a real allocation limit on CPU
    estimate: bool = True  # task=train: trace task=estimate beside the run, and record it beside the peak measured
    host_limit_gb: float | None = None  # per node: the host's RAM the estimate must fit in (task=estimate, max_batch)

    def __post_init__(self) -> None:
        for key, value in (("limit_gb", self.limit_gb), ("host_limit_gb", self.host_limit_gb)):
            if value is not None and value <= 0:
                raise ConfigError(f"memory.{key}={value}: must be greater than 0")


def check_limit(limit_gb: float | None, device_type: str, ranks_per_device: int, gpus: int = 1) -> None:
    """Refuse a limit the device cannot give each of its ranks: on GPUs, the smallest of the
    `gpus` this node's ranks take (cuda:0 up, as LOCAL_RANK picks them), which on a node of
    mixed GPUs need not be the current one."""
    if limit_gb is None:
        return
    if device_type == "cuda":
        sizes = [device_memory_gb(torch.device("cuda", i)) for i in range(max(1, gpus))]
        total, index = min((size, i) for i, size in enumerate(sizes))
        where = "this GPU has" if len(sizes) == 1 else f"cuda:{index}, the smallest of the {len(sizes)} its ranks take, has"
    else:
        if not linux.PROC:
            raise ConfigError(f"memory.limit_gb={limit_gb}: a CPU limit needs Linux (it counts by /proc/self/status); "
                              "here leave it unset, or set it on a GPU")
        total = device_memory_gb(device_type)
        where = f"{ranks_per_device} ranks share this machine's"
    if limit_gb * ranks_per_device > total:
        raise ConfigError(f"memory.limit_gb={limit_gb}: above the device's memory ({where} {total:.1f} GB)")


def apply_limit(limit_gb: float | None, device: torch.device) -> None:
    """Cap this rank's memory at `limit_gb` (call once, before building the model)."""
    if limit_gb is None:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * GB / total), device)
        return
    map_large_blocks()
    # Anonymous memory only: resident library code depends on what the page cache holds,
    # so counting it would move the limit from one run to the next.
    status = proc_status()
    data, resident = status["VmData:"] * 1024, status["RssAnon:"] * 1024
    headroom = int(limit_gb * GB) - resident
    if headroom <= 0:
        raise OutOfMemory(
            f"memory.limit_gb={limit_gb}: this rank already holds {resident / GB:.2f} GB "
            "(torch and the process group) before building the model"
        )
    cap_data_segment(data + headroom)
    global _cpu_baseline
    _cpu_baseline = (resident, data)


def peak_under_limit_gb() -> float | None:
    """CPU under memory.limit_gb: this rank's peak as the limit counts it, so that it
    crosses limit_gb exactly where an allocation starts to fail.

    That is the anonymous resident memory when the limit was set plus the peak growth of the data
    segment since. The peak data segment is the peak address space (VmPeak) less what is
    not data (code, libraries, stacks), which stays put during training. Resident memory
    would not do: it also counts library code paged in while training (tens of MB), which
    the limit does not.
    """
    if _cpu_baseline is None:
        return None
    resident, data = _cpu_baseline
    status = proc_status()
    peak_data = (status["VmPeak:"] - (status["VmSize:"] - status["VmData:"])) * 1024
    return (resident + peak_data - data) / GB


def under_limit_figures(limit_gb: float | None, device_type: str, reserved_gb_per_rank: list[float] | None,
                        counted_gb_per_rank: list[float] | None = None,
                        held_gb_per_rank: list[float] | None = None) -> dict:
    """The summary's figures under memory.limit_gb: the limit, and the peak it caps per rank
    and the largest (`peak_under_limit_gb`), the figure to hold against it.

    GPU: set_per_process_memory_fraction caps what the caching allocator reserves (it
    refuses a new segment that would take its reserved bytes past the fraction, in
    c10/cuda/CUDACachingAllocator.cpp), so the peak is the run's reserved peak per rank
    (`reserved_gb_per_rank`, the trainer's). CPU: the limit's own count on each rank
    (`peak_under_limit_gb()`, gathered), with what each rank held when its limit was set.
    """
    if limit_gb is None:
        return {}
    if device_type == "cuda":
        per_rank, held = reserved_gb_per_rank, None
    else:
        per_rank, held = counted_gb_per_rank, held_gb_per_rank
    if not per_rank:
        return {}
    figures = {"limit_gb": limit_gb, "peak_under_limit_gb": max(per_rank), "peak_under_limit_gb_per_rank": per_rank}
    if held:
        figures["held_before_limit_gb_per_rank"] = held
    return figures


def held_before_limit_gb() -> float | None:
    """CPU under memory.limit_gb: what this rank held when its limit was set (torch, the
    process group, the data). It varies a little from run to run, and the room left for
    training, so the boundary, moves with it."""
    return None if _cpu_baseline is None else _cpu_baseline[0] / GB
