"""The training loop. It takes built objects and knows nothing of Hydra or config files."""

from __future__ import annotations

import time
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_exp import distributed
from fsdp_exp.distributed import Ranks
from fsdp_exp.metrics import peak_memory_gb


class Sink(Protocol):
    def log(self, record: dict) -> None: ...


class Trainer:
    """Trains `model` for `steps` optimizer steps; every rank measures, `sinks` (rank 0) write.

    Every `log_every` steps (and at the last) the loss is averaged over ranks and a
    record goes to each sink. Nothing else synchronises the ranks in the hot loop.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        ranks: Ranks,
        steps: int,
        batch_size: int,
        log_every: int,
        warmup_steps: int = 0,
        sinks: Iterable[Sink] = (),
    ):
        self.model = model
        self.optimizer = optimizer
        self.batches = batches
        self.ranks = ranks
        self.steps = steps
        self.global_batch = batch_size * ranks.world_size
        self.log_every = log_every
        self.warmup_steps = warmup_steps
        self.sinks = list(sinks)

    def _sync(self) -> None:
        if self.ranks.device.type == "cuda":
            torch.cuda.synchronize(self.ranks.device)

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        images = images.to(self.ranks.device, non_blocking=True)
        labels = labels.to(self.ranks.device, non_blocking=True)
        loss = F.cross_entropy(self.model(images).float(), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def fit(self) -> dict:
        """Train; return the run's figures (steady-state means leave out warm-up steps)."""
        self.model.train()
        batches = iter(self.batches)
        loss = torch.zeros(())
        start = window_start = time.perf_counter()
        steady_start = start if self.warmup_steps == 0 else None
        window_first_step, losses = 1, []
        for step in range(1, self.steps + 1):
            loss = self.train_step(*next(batches))
            if step == self.warmup_steps:
                self._sync()
                steady_start = time.perf_counter()
            if step % self.log_every == 0 or step == self.steps:
                mean_loss = distributed.mean(loss)
                self._sync()
                now = time.perf_counter()
                window_steps = step - window_first_step + 1
                record = {
                    "step": step,
                    "loss": mean_loss,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "samples_per_s": self.global_batch * window_steps / (now - window_start),
                    "step_time_s": (now - window_start) / window_steps,
                    "peak_mem_gb": max(distributed.gather(peak_memory_gb(self.ranks.device), self.ranks.device)),
                }
                losses.append(mean_loss)
                for sink in self.sinks:
                    sink.log(record)
                window_start, window_first_step = now, step + 1
        self._sync()
        end = time.perf_counter()
        if steady_start is None or end <= steady_start:  # all steps were warm-up
            steady_start, steady_steps = start, self.steps
        else:
            steady_steps = self.steps - self.warmup_steps
        per_rank_peak = distributed.gather(peak_memory_gb(self.ranks.device), self.ranks.device)
        return {
            "steps": self.steps,
            "final_loss": losses[-1],
            "samples_per_s": self.global_batch * steady_steps / (end - steady_start),
            "steps_per_s": steady_steps / (end - steady_start),
            "world_size": self.ranks.world_size,
            "global_batch_size": self.global_batch,
            "peak_mem_gb": max(per_rank_peak),
            "peak_mem_gb_per_rank": per_rank_peak,
            "train_time_s": end - start,
        }
