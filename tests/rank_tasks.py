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


def train_then_rank1_dies_once(cfg: dict, run_dir: Path, context: object) -> dict:
    """The real training rank; on the first attempt rank 1 then dies before it returns, as a
    rank killed after the final checkpoint (or a job preempted there) does."""
    from fsdp_exp.rank.train import train_rank

    summary = train_rank(cfg, run_dir, context)
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


class BufferedNet:
    """A classifier with BatchNorm (persistent running stats) and a buffer in no state dict
    (`persistent=False`, as masks and position tables are), whose values matter."""

    def __new__(cls, width: int = 8, num_classes: int = 10):
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv2d(1, width, 3, stride=4)
                self.norm = nn.BatchNorm2d(width)
                self.head = nn.Linear(width, num_classes)
                self.register_buffer("scale", torch.arange(1.0, width + 1), persistent=False)
                self.norm.running_mean.fill_(0.5)  # not the default, so a lost value shows

            def forward(self, images: torch.Tensor) -> torch.Tensor:
                x = self.norm(self.conv(images)).mean((2, 3)) * self.scale
                return self.head(x)

        return Net()


def state_after_build(cfg, run_dir: Path) -> None:
    """Build the run's model as training does; each rank saves where its buffers are, their
    values, and the model's full weights."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp_exp import distributed
    from fsdp_exp.rank.build import build_model_for_training
    from fsdp_exp.sharding import unwrap

    ranks = distributed.init(str(cfg.device))
    model, _ = build_model_for_training(cfg, ranks)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {n.replace("_checkpoint_wrapped_module.", ""): b for n, b in unwrap(model).named_buffers()}
    torch.save({"buffers": {n: b.detach().cpu() for n, b in buffers.items()},
                "buffer_devices": {n: str(b.device) for n, b in buffers.items()},
                "param_devices": {n: str(p.to_local().device if hasattr(p, "to_local") else p.device)
                                  for n, p in unwrap(model).named_parameters()},
                "weights": weights}, run_dir / f"rank{ranks.rank}.pt")
    distributed.close()


def rank1_aborts(cfg: dict, run_dir: Path) -> str:
    """Rank 1 ends by SIGABRT, as a C++ abort inside torch or gloo would end it."""
    if os.environ["RANK"] == "1":
        os.abort()
    return "rank 0 done"
