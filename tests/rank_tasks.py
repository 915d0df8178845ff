"""Tasks the launcher tests start on real ranks (importable by spawned processes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist


def rank1_raises_while_rank0_waits(cfg: dict, run_dir: Path) -> str:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(1)
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 blocks here: only the launcher can end it
    return "unreachable"


def report_rank(cfg: dict, run_dir: Path) -> dict:
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]), **cfg}


def train_then_rank1_dies_once(cfg: dict, run_dir: Path) -> dict:
    """The real training rank; on the first attempt rank 1 then dies before it returns, as a
    rank killed after the final checkpoint (or a job preempted there) does."""
    from fsdp_exp.tasks.train import train_rank

    summary = train_rank(cfg, run_dir)
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os._exit(1)
    return summary


def anon_mb() -> float:
    """This process's anonymous resident memory (what memory.limit_gb counts), in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def report_process(cfg: dict, run_dir: Path) -> dict:
    """Where this rank came from and what it holds as it starts; with cfg["hold_mb"], it
    then fills that much memory before it returns."""
    import torch

    start = {"parent": os.getppid(), "anon_mb": anon_mb(), "threads": torch.get_num_threads()}
    if cfg.get("hold_mb"):
        held = torch.ones(cfg["hold_mb"] * 2**18)  # 4-byte floats
        start["anon_mb_holding"] = anon_mb()
        del held
    return start
