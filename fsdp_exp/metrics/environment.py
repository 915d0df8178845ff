"""The environment record of a run, for summary.json and the wandb config.

Two halves: what the driver knows (the project's version and commit, the overrides, the
world size) and what rank 0 of the run sees (its device, the versions it runs, its host).
On a cluster the driver is not a compute node, so the second half comes from rank 0 itself,
which writes it to `device.json` in the run directory as soon as it has its device.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from fsdp_exp.memory import device_memory_gb
from fsdp_exp.files import read_json, write_json

PROJECT_DIR = Path(__file__).resolve().parents[2]
DEVICE_RECORD = "device.json"


def environment(world_size: int, overrides: list[str]) -> dict:
    """The driver's half."""
    return {
        "fsdp_exp": package_version(),
        "world_size": world_size,
        "git_commit": git_commit(),
        "overrides": overrides,
        "driver_host": platform.node(),
    }


def rank_environment(device: torch.device) -> dict:
    """What this rank sees: its device and how much memory it holds (a GPU's, or the
    machine's RAM on CPU), the versions it runs, its host."""
    cuda = device.type == "cuda"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "device": torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine()),
        "device_count": torch.cuda.device_count() if cuda else os.cpu_count(),
        "device_memory_gb": device_memory_gb(device),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "python": platform.python_version(),
        "host": platform.node(),
    }


def write_device_record(run_dir: Path, record: dict) -> None:
    write_json(Path(run_dir) / DEVICE_RECORD, record)


def read_device_record(run_dir: Path) -> dict:
    """What rank 0 of the run in `run_dir` saw, or {} when it never got that far."""
    return read_json(Path(run_dir) / DEVICE_RECORD) or {}


def package_version() -> str | None:
    try:
        return metadata.version("fsdp_exp")
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """fsdp_exp's commit, with "-dirty" when the work tree has uncommitted changes; None
    for an installed package (whatever repository holds the venv is not fsdp_exp's)."""
    if not (PROJECT_DIR / ".git").exists() or not (PROJECT_DIR / "pyproject.toml").is_file():
        return None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_DIR, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_DIR,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")
