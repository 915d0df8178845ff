"""The training loop. It takes built objects and knows nothing of Hydra or config files."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from fsdp_exp import distributed
from fsdp_exp.distributed import Ranks
from fsdp_exp.batch import Batch, BatchKeys, forward_keys
from fsdp_exp.groups import LossOption
from fsdp_exp.loss import CrossEntropy
from fsdp_exp.metrics.peaks import MemoryMonitor
from fsdp_exp.sharding import gradient_sync, unwrap

log = logging.getLogger("fsdp_exp")


class Sink(Protocol):
    def log(self, record: dict) -> None: ...


class Checkpointer(Protocol):
    """Saves the training state (fsdp_exp.checkpoint); `blocked_s`: time lost per save."""

    blocked_s: list[float]

    def before_update(self) -> None: ...
    def after_step(self, step: int, last: bool, loss: torch.Tensor) -> None: ...
    def close(self) -> None: ...


class StepHooks(Protocol):
    """Called around every step (a profiler, a progress bar)."""

    def before_step(self, step: int) -> None: ...
    def after_step(self, step: int) -> None: ...


class FirstMicroBatch(Protocol):
    """What the first micro-batch of training also does, so that it costs no forward and
    backward of its own (fsdp_exp.rank.build: the FLOP count and the model contract)."""

    def running(self) -> contextlib.AbstractContextManager: ...  # around its forward and backward
    def check(self, logits: torch.Tensor, targets: torch.Tensor) -> None: ...
    def flops(self) -> tuple[int, int] | None: ...  # after it ran: model and hardware FLOPs per step


class PeakMemory(Protocol):
    """What the trainer asks of its memory figures (fsdp_exp.metrics.peaks.MemoryMonitor; the
    estimate's trace counts phases its own way)."""

    def start_run(self) -> None: ...
    def start_window(self) -> None: ...
    def start_phase(self, name: str) -> None: ...
    def end_phase(self) -> None: ...
    def window_peaks(self) -> dict[str, float]: ...
    def held_gb(self) -> float: ...


# A micro-batch's count of the items its loss averages over, and what waits for their sum over the ranks.
Counted = tuple[torch.Tensor, Callable[[], torch.Tensor]]


@dataclass(eq=False)
class Trainer:
    """Trains `model` for `steps` optimizer steps; every rank measures, `sinks` (rank 0) write.

    Every `log_every` steps (and at the last) the loss is averaged over ranks and one
    record goes to each sink. A record's window never mixes warm-up steps with later ones,
    and the summary's averages leave the warm-up steps out.

    `batches` yields micro-batches of `batch_size // grad_accum` samples; one step takes
    `grad_accum` of them. `tokens_per_sample` > 0 (language models) adds tokens/s.
    `flops_per_step`: this rank's model FLOPs per optimizer step; with `peak_tflops`, MFU.
    `hardware_flops_per_step`: what ran, with the forward activation checkpointing
    recomputes; with `peak_tflops`, HFU. `start_step`: the step a resumed run continues after
    (its first `warmup_steps` steps are warm-up again); `start_loss`: the loss the checkpoint
    saved at it. `phase_peaks`: each phase's peak memory as well as the window's
    (metrics.phase_peaks). `first_micro_batch`: what the first micro-batch also does (counts
    FLOPs, checks the logits). `memory`: the memory figures, by default this rank's
    MemoryMonitor. `stop_early(step, window_peak_gb)`: called by every rank after each step,
    with what reads the window's peak so far; True ends training there (a probe whose peak
    has settled, fsdp_exp.rank.settle.PeakSettled). `loss(output, batch)`: the run's loss
    option (fsdp_exp.loss), cross-entropy by default. `batch_keys`: what of a dict batch the
    model and the loss read (fsdp_exp.batch).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterable  # as the data gives them: (input, target) pairs or dicts
    ranks: Ranks
    steps: int
    batch_size: int
    log_every: int
    warmup_steps: int = 0
    sinks: Iterable[Sink] = ()
    grad_accum: int = 1
    grad_scaler: torch.amp.GradScaler | None = None
    tokens_per_sample: int = 0
    flops_per_step: int = 0
    hardware_flops_per_step: int = 0
    peak_tflops: float | None = None
    hooks: Iterable[StepHooks] = ()
    lr_schedule: torch.optim.lr_scheduler.LRScheduler | None = None
    checkpoint: Checkpointer | None = None
    start_step: int = 0
    start_loss: float | None = None
    phase_peaks: bool = True
    first_micro_batch: FirstMicroBatch | None = None
    memory: PeakMemory | None = None  # None: a MemoryMonitor of this rank's device, made in __post_init__
    stop_early: Callable[[int, Callable[[], float | None]], bool] | None = None
    loss: LossOption = field(default_factory=CrossEntropy)
    batch_keys: BatchKeys = field(default_factory=BatchKeys)
    host_data_wait_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.sinks, self.hooks = list(self.sinks), list(self.hooks)
        self.takes = forward_keys(unwrap(self.model))
        self.ignore_index = getattr(self.loss, "ignore_index", -100)  # padding's target, where the loss has one
        self._tokens: list = []  # this window's micro-batches: the tokens the loss saw (on the device)
        self._positions = 0  # and their token positions, padding included
        if self.memory is None:
            self.memory = MemoryMonitor(self.ranks.device, self.phase_peaks)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.ranks.world_size

    def _next(self, batches: Iterator) -> Batch:
        """The next batch, on this rank's device; the host's time waiting for it is counted
        (on a GPU, queued kernels may run meanwhile, so the GPU waits at most that long)."""
        start = time.perf_counter()
        raw = next(batches)
        self.host_data_wait_s += time.perf_counter() - start
        batch = self.batch_keys.read(raw, self.takes, self.loss.reads_targets, self.ranks.device)
        if self.tokens_per_sample:
            seen = batch.tokens(self.ignore_index)
            if seen is not None:
                self._tokens.append(seen)
                self._positions += batch.positions()
        return batch

    def items_over_ranks(self, batch: Batch) -> Counted | None:
        """This rank's count of the items (tokens) its micro-batch loss averages over, and what
        waits for their sum over the ranks, where the loss says it (`LossOption.items`) and
        there are ranks to weigh; None otherwise. The sum is started here, before the forward,
        so that it runs beside it."""
        items = self.loss.items(batch) if self.ranks.world_size > 1 else None
        return None if items is None else (items, distributed.summed_later(items))

    def weighed(self, loss: torch.Tensor, counted: Counted | None) -> torch.Tensor:
        """This rank's micro-batch loss, weighed by its share of the items that the ranks'
        micro-batches hold together (`items_over_ranks`): the ranks' gradients, averaged, are
        then those of the mean over every item of the global micro-batch, as one process on it
        computes, however the padding falls. A micro-batch with no item to count (its mean
        0/0) adds 0. Without a count, each rank's mean weighs alike."""
        if counted is None:
            return loss
        items, over_ranks = counted
        share = items * self.ranks.world_size / over_ranks().clamp_min(1)
        return torch.where(items > 0, loss, loss.new_zeros(())) * share

    def train_step(self, batches: Iterator) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches; gradients are reduced across
        ranks only after the last. Returns this rank's part of the step's loss: its mean over
        ranks is the step's loss."""
        total = torch.zeros((), device=self.ranks.device)
        for micro in range(self.grad_accum):
            first, self.first_micro_batch = self.first_micro_batch, None
            with gradient_sync(self.model, enabled=micro == self.grad_accum - 1), \
                    first.running() if first is not None else contextlib.nullcontext():
                self.memory.start_phase("forward")
                batch = self._next(batches)
                counted = self.items_over_ranks(batch)
                output = batch.forward(self.model)
                if first is not None:
                    first.check(output, batch)
                loss = self.weighed(self.loss(output, batch), counted) / self.grad_accum
                self.memory.start_phase("backward")
                (self.grad_scaler.scale(loss) if self.grad_scaler else loss).backward()
            counted = first.flops() if first is not None else None
            if counted is not None:
                self.flops_per_step, self.hardware_flops_per_step = counted
            total += loss.detach()
        # The backward ends where the optimizer step starts (one read of the allocator's stats,
        # not two): waiting for a save's staging, which runs in its own thread, allocates nothing.
        if self.checkpoint is not None:
            self.checkpoint.before_update()
        self.memory.start_phase("optimizer_step")
        if self.grad_scaler:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.memory.end_phase()
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        return total

    def fit(self) -> dict:
        """Train; return the run's figures: steady-state means and the run's peaks."""
        if self.start_step >= self.steps:
            return self._nothing_to_train()
        self.model.train()
        batches = iter(self.batches)
        first, warmup_end = self.start_step + 1, self.start_step + self.warmup_steps
        # Work still queued from before training (a checkpoint load) must
        # not fall into the first window's time.
        distributed.synchronize(self.ranks.device)
        self.memory.start_run()
        window = _Window(first_step=first, start=time.perf_counter(), host_data_wait_s=0.0)
        totals = {"steady": _Totals(), "all": _Totals()}
        run_peaks: dict[str, list[float]] = {}
        record: dict = {}
        for step in range(first, self.steps + 1):
            for hook in self.hooks:
                hook.before_step(step)
            loss = self.train_step(batches)
            for hook in self.hooks:
                hook.after_step(step)
            if self.checkpoint is not None:
                self.checkpoint.after_step(step, last=step == self.steps, loss=loss)
            stop = self.stop_early is not None and self.stop_early(
                step, lambda: self.memory.window_peaks().get("peak_mem_gb"))
            logged = step % self.log_every == 0 or step == self.steps or stop
            if logged or step == warmup_end:  # a window never straddles warm-up
                record, per_rank = self._record(step, loss, window, warmup_end)
                for key, values in per_rank.items():
                    run_peaks[key] = _over_windows(key, run_peaks.get(key), values)
                for name in ("steady", "all") if step > warmup_end else ("all",):
                    totals[name].add(step - window.first_step + 1, record)
                if logged:
                    for sink in self.sinks:
                        sink.log(record)
                window = _Window(first_step=step + 1, start=time.perf_counter(),
                                 host_data_wait_s=self.host_data_wait_s)
                self.memory.start_window()
            if stop:
                self.steps = step
                break
        if self.checkpoint is not None:
            self.checkpoint.close()
        steady = totals["steady"] if totals["steady"].steps else totals["all"]
        summary = {
            "steps": self.steps,
            "final_loss": record["loss"],
            "world_size": self.ranks.world_size,
            "global_batch_size": self.global_batch,
            "warmup_only": not totals["steady"].steps,
            **self._means(steady),
            **{key: max(values) for key, values in run_peaks.items()},
            "peak_mem_gb_per_rank": run_peaks["peak_mem_gb"],
            **({"peak_reserved_gb_per_rank": run_peaks["peak_reserved_gb"]} if "peak_reserved_gb" in run_peaks else {}),
            "held_mem_gb": max(distributed.gather(self.memory.held_gb(), self.ranks.device)),
        }
        if self.start_step:
            summary["resumed_from_step"] = self.start_step
        saves = self.checkpoint.blocked_s if self.checkpoint is not None else []
        if saves:
            summary["checkpoint_saves"] = len(saves)
            summary["checkpoint_blocked_s"] = max(distributed.gather(sum(saves) / len(saves), self.ranks.device))
        return summary

    def _nothing_to_train(self) -> dict:
        """A restart after the final checkpoint (a rank died, or the job was preempted, after
        the last step): no step is left, so no throughput either; the loss is the saved one."""
        if self.ranks.is_main:
            log.warning("resumed at step %d of %d: nothing left to train", self.start_step, self.steps)
        if self.checkpoint is not None:
            self.checkpoint.close()
        return {"steps": self.steps, "resumed_from_step": self.start_step, "final_loss": self.start_loss,
                "world_size": self.ranks.world_size, "global_batch_size": self.global_batch}

    def _record(self, step: int, loss: torch.Tensor, window: _Window,
                warmup_end: int) -> tuple[dict, dict[str, list[float]]]:
        """The record for the window ending at `step`, and its memory peaks per rank."""
        mean_loss = distributed.mean(loss)
        distributed.synchronize(self.ranks.device)
        elapsed = time.perf_counter() - window.start
        per_rank = {k: distributed.gather(v, self.ranks.device) for k, v in self.memory.window_peaks().items()}
        tokens = positions = 0.0
        if self._tokens:  # the window's, summed over ranks (ranks may pad their batches differently)
            tokens, positions = distributed.total([sum(self._tokens), self._positions], self.ranks.device)
            self._tokens, self._positions = [], 0
        record = {
            "step": step,
            "time": time.time(),  # wall clock, for start-up and timeline figures
            "loss": mean_loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            **self._means(_Totals(step - window.first_step + 1, elapsed,
                                  self.host_data_wait_s - window.host_data_wait_s, tokens, positions)),
            **{key: max(values) for key, values in per_rank.items()},
            "peak_mem_gb_per_rank": per_rank["peak_mem_gb"],
        }
        if self.grad_scaler:
            record["loss_scale"] = self.grad_scaler.get_scale()
        if step <= warmup_end:
            record["warmup"] = True
        return record, per_rank

    def _means(self, t: _Totals) -> dict:
        """Throughput figures over `t.steps` steps that took `t.time_s`."""
        means = {
            "samples_per_s": self.global_batch * t.steps / t.time_s,
            "steps_per_s": t.steps / t.time_s,
            "step_time_s": t.time_s / t.steps,
            "host_data_wait_share": t.host_data_wait_s / t.time_s,
        }
        seen = 1.0  # the share of the token positions the loss sees
        if t.positions:  # token data whose padding the batches show
            seen = t.tokens / t.positions
            means |= {"tokens_per_s": t.tokens / t.time_s, "padded_tokens_per_s": t.positions / t.time_s,
                      "padding_share": 1 - seen}
        elif self.tokens_per_sample:
            means["tokens_per_s"] = means["samples_per_s"] * self.tokens_per_sample
        if self.flops_per_step:  # the model FLOPs of the tokens the loss sees; HFU counts every one
            means["tflops_per_device"] = self.flops_per_step * seen * t.steps / t.time_s / 1e12
            means["mfu"] = means["tflops_per_device"] / self.peak_tflops if self.peak_tflops else None
        if self.hardware_flops_per_step:
            hardware_tflops = self.hardware_flops_per_step * t.steps / t.time_s / 1e12
            means["hfu"] = hardware_tflops / self.peak_tflops if self.peak_tflops else None
        return means


def _over_windows(key: str, run: list[float] | None, window: list[float]) -> list[float]:
    """A run's figure per rank from its windows': the sum of the allocator's counts
    (retries, out-of-memory errors), the largest of the peaks."""
    if run is None:
        return list(window)
    if key in MemoryMonitor.COUNTS:
        return [a + b for a, b in zip(run, window)]
    return [max(a, b) for a, b in zip(run, window)]


@dataclass
class _Window:
    first_step: int
    start: float
    host_data_wait_s: float


@dataclass
class _Totals:
    steps: int = 0
    time_s: float = 0.0
    host_data_wait_s: float = 0.0
    tokens: float = 0.0  # the tokens the loss saw, on every rank (token data whose padding the batches show)
    positions: float = 0.0  # their token positions, padding included

    def add(self, steps: int, record: dict) -> None:
        time_s = record["step_time_s"] * steps
        self.steps += steps
        self.time_s += time_s
        self.host_data_wait_s += record["host_data_wait_share"] * time_s
        if "padded_tokens_per_s" in record:
            self.tokens += record["tokens_per_s"] * time_s
            self.positions += record["padded_tokens_per_s"] * time_s
