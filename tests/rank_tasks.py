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
