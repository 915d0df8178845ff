"""What every benchmark prints first, for docs/BENCHMARKS.md: the date, the host, the
device and torch."""

from __future__ import annotations

import platform
from datetime import date

import torch


def default_ranks() -> int:
    """One rank per GPU, or 2 gloo ranks without one (as launcher.nproc_per_node=auto)."""
    return torch.cuda.device_count() or 2


def header(nproc: int, on_gpu: bool) -> str:
    device = torch.cuda.get_device_name(0) if on_gpu else f"CPU, {nproc} gloo rank{'s' if nproc != 1 else ''}"
    return f"{date.today()}  {platform.node()}  {device}  torch {torch.__version__}"
