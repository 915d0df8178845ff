"""The environment record of a run, for summary.json and the wandb config."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

PROJECT_DIR = Path(__file__).resolve().parents[2]


def environment(device_type: str, world_size: int, overrides: list[str]) -> dict:
    cuda = device_type == "cuda" and torch.cuda.is_available()
    return {
        "fsdp_exp": package_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine()),
        "device_count": torch.cuda.device_count() if cuda else os.cpu_count(),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "world_size": world_size,
        "git_commit": git_commit(),
        "overrides": overrides,
        "python": platform.python_version(),
        "host": platform.node(),
    }


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
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")
