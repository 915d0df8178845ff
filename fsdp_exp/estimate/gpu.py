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
    """A GPU by its datasheet: `task.gpu=<name>`."""

    name: str
    memory_gb: float  # GiB on the datasheet; the driver keeps a little of it back
    nvswitch: bool  # on HGX/DGX boards its NVLink goes through NVSwitches: NCCL uses NVLS
    compute_capability: float
    source: str


GPUS: tuple[Gpu, ...] = (
    Gpu("B200", 180, True, 10.0, "HGX B200 datasheet: 1.4 TB HBM3e over 8 GPUs"),
    Gpu("H200-SXM", 141, True, 9.0, "H200 datasheet: 141 GB HBM3e"),
    Gpu("H200-NVL", 141, False, 9.0, "H200 datasheet: 141 GB HBM3e"),
    Gpu("H100-SXM", 80, True, 9.0, "H100 datasheet: 80 GB HBM3"),
    Gpu("H100-PCIe", 80, False, 9.0, "H100 datasheet: 80 GB HBM2e"),
    Gpu("H100-NVL", 94, False, 9.0, "H100 datasheet: 94 GB HBM3"),
    Gpu("A100-80GB", 80, False, 8.0, "A100 datasheet: 80 GB HBM2e (HGX boards have NVSwitch, but no NVLS)"),
    Gpu("A100-40GB", 40, False, 8.0, "A100 datasheet: 40 GB HBM2"),
    Gpu("L40S", 48, False, 8.9, "L40S datasheet: 48 GB GDDR6"),
    Gpu("L40", 48, False, 8.9, "L40 datasheet: 48 GB GDDR6"),
    Gpu("A10", 24, False, 8.6, "A10 datasheet: 24 GB GDDR6"),
    Gpu("A10G", 24, False, 8.6, "AWS G5 instances: 24 GB"),
    Gpu("L4", 24, False, 8.9, "L4 datasheet: 24 GB GDDR6"),
    Gpu("RTX-4090", 24, False, 8.9, "GeForce RTX 4090 specifications: 24 GB GDDR6X"),
    Gpu("RTX-3090", 24, False, 8.6, "GeForce RTX 3090 specifications: 24 GB GDDR6X"),
    Gpu("V100-32GB", 32, False, 7.0, "V100 datasheet: 32 GB HBM2"),
    Gpu("V100-16GB", 16, False, 7.0, "V100 datasheet: 16 GB HBM2"),
    Gpu("T4", 16, False, 7.5, "T4 datasheet: 16 GB GDDR6"),
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


def cublas_workspaces(gpu: Gpu | None) -> tuple[int, ...]:
    """cuBLAS's workspaces on a rank, in bytes (32 MiB each where the GPU is not known)."""
    large = gpu is None or 9 <= int(gpu.compute_capability) <= 12
    return (32 * MIB if large else 4096 * 1024 * 2 + 16 * 1024 * 8,) * 2
