"""The training loop. It takes built objects and knows nothing of Hydra or config files."""

from __future__ import annotations

import time
from typing import Iterable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_exp import distributed
from fsdp_exp.distributed import Ranks
from fsdp_exp.metrics import peak_memory_gb
from fsdp_exp.sharding import gradient_sync


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
        grad_accum: int = 1,
        grad_scaler: torch.amp.GradScaler | None = None,
        tokens_per_sample: int = 0,
    ):
        """`batches` yields micro-batches of `batch_size // grad_accum` samples; one step
        takes `grad_accum` of them. `tokens_per_sample` > 0 (language models) adds tokens/s."""
        self.model = model
        self.optimizer = optimizer
        self.batches = batches
        self.ranks = ranks
        self.steps = steps
        self.global_batch = batch_size * ranks.world_size
        self.log_every = log_every
        self.warmup_steps = warmup_steps
        self.sinks = list(sinks)
        self.grad_accum = grad_accum
        self.grad_scaler = grad_scaler
        self.tokens_per_sample = tokens_per_sample

    def _sync(self) -> None:
        if self.ranks.device.type == "cuda":
            torch.cuda.synchronize(self.ranks.device)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over classes (images) or over every position's next token (LMs)."""
        inputs = inputs.to(self.ranks.device, non_blocking=True)
        targets = targets.to(self.ranks.device, non_blocking=True)
        logits = self.model(inputs).float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches; gradients are reduced across
        ranks only after the last. Returns the step's mean loss on this rank."""
        total = torch.zeros((), device=self.ranks.device)
        for micro in range(self.grad_accum):
            with gradient_sync(self.model, enabled=micro == self.grad_accum - 1):
                loss = self.loss(*next(batches)) / self.grad_accum
                (self.grad_scaler.scale(loss) if self.grad_scaler else loss).backward()
            total += loss.detach()
        if self.grad_scaler:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def fit(self) -> dict:
        """Train; return the run's figures (steady-state means leave out warm-up steps)."""
        self.model.train()
        batches = iter(self.batches)
        loss = torch.zeros(())
        start = window_start = time.perf_counter()
        steady_start = start if self.warmup_steps == 0 else None
        window_first_step, losses = 1, []
        for step in range(1, self.steps + 1):
            loss = self.train_step(batches)
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
                if self.tokens_per_sample:
                    record["tokens_per_s"] = record["samples_per_s"] * self.tokens_per_sample
                if self.grad_scaler:
                    record["loss_scale"] = self.grad_scaler.get_scale()
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
        samples_per_s = self.global_batch * steady_steps / (end - steady_start)
        summary = {
            "steps": self.steps,
            "final_loss": losses[-1],
            "samples_per_s": samples_per_s,
            "steps_per_s": steady_steps / (end - steady_start),
            "world_size": self.ranks.world_size,
            "global_batch_size": self.global_batch,
            "peak_mem_gb": max(per_rank_peak),
            "peak_mem_gb_per_rank": per_rank_peak,
            "train_time_s": end - start,
        }
        if self.tokens_per_sample:
            summary["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        return summary
