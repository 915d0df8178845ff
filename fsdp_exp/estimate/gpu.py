"""A GPU's memory beside the traced tensors, and the GPUs by name.

Outside the caching allocator (torch.cuda.memory_reserved does not count it, the device
does, and `memory.limit_gb`'s cap, `set_per_process_memory_fraction`, leaves it out):
- the CUDA context: 0.3-0.6 GB by GPU and CUDA version, with CUDA's lazy loading of kernels
  (on by default on Linux since CUDA 12.2, NVIDIA's developer forum, "Lazy Loading"):
  `CONTEXT_GB`;
- each NCCL communicator the run creates, one per process group it talks over: 544 MB for a
  group of 2 GPUs and 688 MB for a larger one, measured with an all-reduce on 4 A100s with
  NVLink (NVIDIA/nccl#964); NCCL's maintainers say it grows with the channels NCCL uses,
  more on faster links, so these are a floor. Where the GPUs hang off an NVSwitch (HGX and
  DGX H100, H200, B200) NCCL's NVLink SHARP (NVLS) adds buffers to each communicator of more
  than 2 GPUs: `NVLS_GB`, about 1 GiB as users report it, not measured here (JAX-Toolbox#383
  turned NVLS off for the memory its communicators took; `NCCL_NVLS_ENABLE=0` does the same).
Through the allocator but outside the trace (fake tensors call no cuBLAS): cuBLAS's
workspace, one per handle and stream: the forward's, and backward's (autograd runs it on a
thread of its own, with its own handle; inferred from torch's handle pool, to be checked on
a GPU). Each is 32 MiB on compute capability 9.x to 12.x and 4096 KiB x 2 + 16 KiB x 8 on
earlier GPUs (torch 2.14's aten/src/ATen/cuda/CublasHandlePool.cpp, CUBLAS_WORKSPACE_CONFIG
unset; earlier torch gave 32 MiB to 9.0 only); cuBLASLt shares it (torch 2.14's default).

Not counted: cuDNN's convolution workspaces. Each convolution takes its plan's workspace
from the caching allocator for the call only, and frees it after; torch tries the plans
cuDNN ranks first and, where a workspace does not fit, the next, with a smaller one
(aten/src/ATen/native/cudnn/Conv_v8.cpp: `try_plans` goes on past an out-of-memory, and with
`torch.backends.cudnn.benchmark`, which fsdp_exp leaves off, the workspace is halved until it
fits). So they do not move where a run runs out of memory, but a conv model's allocated and
reserved peaks can be above the estimate by the largest workspace a plan took (none measured
here: `make gpu-session`'s ResNet row shows it).

These figures stand until a GPU says otherwise: `python -m fsdp_exp.check_gpu` prints the
estimate beside a real run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdp_exp.errors import ConfigError

GB = 2**30
MIB = 2**20
CONTEXT_GB = 0.5
NCCL_PAIR_GB = 0.544
NCCL_GROUP_GB = 0.688
NVLS_GB = 1.0


@dataclass(frozen=True)
class Gpu:
    """A GPU by name: `task.gpu=<name>`."""

    name: str
    memory_gb: float  # GiB torch reports (total_memory), less than the datasheet's: the driver keeps some back
    nvswitch: bool  # on HGX/DGX boards its NVLink goes through NVSwitches: NCCL uses NVLS
    compute_capability: float
    source: str


def mib(reported: int) -> float:
    """GiB, from the MiB torch prints (`_CudaDeviceProperties(... total_memory=<N>MB ...)`)."""
    return round(reported / 1024, 2)


# memory_gb is what torch reports as total_memory (printed in MiB by torch's own repr, or
# CUDA's deviceQuery, which reads the same totalGlobalMem), from users' printouts; the same
# GPU reports a few tens of MiB apart under other drivers (a T4: 14918 to 15110), so the
# smallest seen is taken. Where none was found, the datasheet's figure, said in the source.
GPUS: tuple[Gpu, ...] = (
    Gpu("B200", mib(182631), True, 10.0, "torch: total_memory=182631MB (datasheet: 180 GB HBM3e)"),
    Gpu("H200-SXM", mib(143156), True, 9.0, "torch: total_memory=143156MB (datasheet: 141 GB HBM3e)"),
    Gpu("H200-NVL", mib(143156), False, 9.0, "the H200-SXM's torch figure, the same 141 GB HBM3e (not seen for "
        "the NVL itself)"),
    Gpu("H100-SXM", mib(81089), True, 9.0, "torch: total_memory=81089MB (datasheet: 80 GB HBM3)"),
    Gpu("H100-PCIe", mib(81008), False, 9.0, "torch: total_memory=81008MB (datasheet: 80 GB HBM2e)"),
    Gpu("H100-NVL", mib(95235), False, 9.0, "deviceQuery: 95235 MBytes (datasheet: 94 GB HBM3)"),
    Gpu("A100-80GB", mib(81049), False, 8.0, "PCIe: 81049 MB, SXM4: 81158 MBytes (deviceQuery); datasheet 80 GB "
        "HBM2e (HGX boards have NVSwitch, but no NVLS)"),
    Gpu("A100-40GB", mib(40339), False, 8.0, "deviceQuery: 40339 MBytes (datasheet: 40 GB HBM2)"),
    Gpu("L40S", mib(45589), False, 8.9, "torch: total_memory=45589MB (datasheet: 48 GB GDDR6)"),
    Gpu("L40", mib(45589), False, 8.9, "the L40S's torch figure, the same 48 GB GDDR6 (not seen for the L40 itself)"),
    Gpu("A10", 24, False, 8.6, "A10 datasheet: 24 GB GDDR6 (torch's figure not seen: expect about 22 GiB)"),
    Gpu("A10G", mib(22587), False, 8.6, "torch: total_memory=22587MB (a user's printout; AWS G5: 24 GB)"),
    Gpu("L4", mib(22478), False, 8.9, "deviceQuery: 22478 MBytes (datasheet: 24 GB GDDR6)"),
    Gpu("RTX-4090", mib(24210), False, 8.9, "deviceQuery: 24210 MBytes; torch 24563MB elsewhere (24 GB GDDR6X)"),
    Gpu("RTX-3090", mib(24154), False, 8.6, "deviceQuery: 24154 MBytes; torch 24268MB elsewhere (24 GB GDDR6X)"),
    Gpu("V100-32GB", mib(32510), False, 7.0, "torch: total_memory=32510MB (datasheet: 32 GB HBM2)"),
    Gpu("V100-16GB", mib(16160), False, 7.0, "torch: total_memory=16160MB (datasheet: 16 GB HBM2)"),
    Gpu("T4", mib(14918), False, 7.5, "deviceQuery: 14918 to 15110 MBytes by driver (datasheet: 16 GB GDDR6)"),
)


def gpu_named(text: str) -> Gpu:
    """`task.gpu`: a name of the table (any case, `-` or a space), or a memory size in GB
    ("24", "24GB"), taken as a GPU without NVSwitch of compute capability 9.0."""
    wanted = re.sub(r"[\s_]+", "-", text.strip()).lower()
    for gpu in GPUS:
        if gpu.name.lower() == wanted:
            return gpu
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gb|gib)?", text.strip().lower())
    if size and float(size.group(1)) > 0:
        return Gpu(f"{float(size.group(1)):g} GB", float(size.group(1)), False, 9.0, "task.gpu")
    names = ", ".join(g.name for g in GPUS)
    raise ConfigError(f"task.gpu={text}: name a GPU ({names}) or its memory in GB, e.g. task.gpu=24")


def communicator_sizes(world_size: int, groups: tuple[int, ...]) -> list[int]:
    """The NCCL communicators a run's rank creates: the world's (the collectives of DDP or
    a 1-D mesh, and the run's metrics), and one per other process group of more than one."""
    return [size for size in (world_size, *groups) if size > 1]


def outside_allocator_gb(world_size: int, groups: tuple[int, ...], gpu: Gpu | None) -> dict[str, float]:
    """What a rank holds on its GPU outside the caching allocator, by part."""
    nvls = gpu is not None and gpu.nvswitch
    nccl = sum((NCCL_PAIR_GB if size == 2 else NCCL_GROUP_GB) + (NVLS_GB if nvls and size > 2 else 0.0)
               for size in communicator_sizes(world_size, groups))
    return {"cuda_context": CONTEXT_GB, "nccl": nccl}


def allocator_cap_gb(limit_gb: float | None, gpu: Gpu | None, outside_gb: float) -> float | None:
    """What the caching allocator may reserve on a rank: memory.limit_gb's cap
    (`set_per_process_memory_fraction`), and on a named GPU what the device leaves it beside
    what sits outside it (`outside_gb`); None where neither is known."""
    caps = [cap for cap in (limit_gb, gpu.memory_gb - outside_gb if gpu is not None else None) if cap is not None]
    return min(caps) if caps else None


def cublas_workspaces(gpu: Gpu | None) -> tuple[int, ...]:
    """cuBLAS's workspaces on a rank, in bytes (32 MiB each where the GPU is not known)."""
    large = gpu is None or 9 <= int(gpu.compute_capability) <= 12
    return (32 * MIB if large else 4096 * 1024 * 2 + 16 * 1024 * 8,) * 2
