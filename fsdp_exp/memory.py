"""`memory.limit_gb`: a real per-rank memory ceiling, so a small machine can be stood in for.

GPU: the caching allocator is capped with `set_per_process_memory_fraction`. CPU: the rank
gets an allocation limit (RLIMIT_DATA) of its current data size plus the headroom left
under the limit, so an allocation past it fails for real. Either failure is an OutOfMemory.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from fsdp_exp.config import ConfigError

GB = 2**30


class OutOfMemory(RuntimeError):
    """A rank ran out of memory (a real allocation failure, on GPU or CPU)."""


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(err)


def allocation_failure(err: BaseException) -> str:
    """The allocator's own sentence, without its source location."""
    text = " ".join(str(err).split())
    start = text.find("DefaultCPUAllocator")
    text = text[start:] if start >= 0 else text
    return text.split(". Error code")[0][:300]


def device_memory_gb(device_type: str) -> float:
    """What one device holds: a GPU's memory, or this machine's RAM on CPU."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory / GB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def check_limit(limit_gb: float | None, device_type: str, ranks_per_device: int) -> None:
    """Refuse a limit the device cannot give each of its ranks."""
    if limit_gb is None:
        return
    if limit_gb <= 0:
        raise ConfigError(f"memory.limit_gb={limit_gb}: must be greater than 0")
    total = device_memory_gb(device_type)
    if limit_gb * ranks_per_device > total:
        where = "this GPU has" if device_type == "cuda" else f"{ranks_per_device} ranks share this machine's"
        raise ConfigError(f"memory.limit_gb={limit_gb}: above the device's memory ({where} {total:.1f} GB)")


def apply_limit(limit_gb: float | None, device: torch.device) -> None:
    """Cap this rank's memory at `limit_gb` (call once, before building the model)."""
    if limit_gb is None:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * GB / total), device)
        return
    data, resident = _status_bytes("VmData:"), _status_bytes("VmRSS:")
    headroom = int(limit_gb * GB) - resident
    if headroom <= 0:
        raise OutOfMemory(
            f"memory.limit_gb={limit_gb}: this rank already holds {resident / GB:.2f} GB "
            "(torch and the process group) before building the model"
        )
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data + headroom, hard))


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")
