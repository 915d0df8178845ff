"""The training loop. It takes its settings and built parts and knows nothing of Hydra or
config files: `Trainer(settings, ranks, model, optimizer, loss, batches, memory, checkpoint, hooks)`."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from fsdp_exp import distributed
from fsdp_exp.batch import Batch, Batches, forward_keys
from fsdp_exp.distributed import Ranks
from fsdp_exp.groups import LossOption
from fsdp_exp.loss import CrossEntropy
from fsdp_exp.metrics.peaks import MemoryMonitor, over_windows
from fsdp_exp.metrics.summary import PEAK_GB, Summary
from fsdp_exp.metrics.throughput import Throughput, Totals
from fsdp_exp.sharding import gradient_sync, unwrap

log = logging.getLogger("fsdp_exp")

PHASE_STEPS = 2  # the fewest steps whose phases' memory is read: the second holds the optimizer's state


def _no_phase(name: str | None) -> None:
    """A step that reads no phase's memory (past the warm-up)."""


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """The trainer's numbers. `batch_size`: a rank's samples a step, in `grad_accum`
    micro-batches. Every `log_every` steps (and at the last) one record goes to the sinks;
    the first `warmup_steps` are left out of the summary's means. `tokens_per_sample` > 0:
    token data (tokens/s). `peak_tflops`: the device's, for MFU and HFU. `start_step`: the step a
    resumed run continues after (its first `warmup_steps` are warm-up again); `start_loss`:
    the loss the checkpoint saved at it."""

    steps: int
    batch_size: int
    log_every: int = 1
    warmup_steps: int = 0
    grad_accum: int = 1
    tokens_per_sample: int = 0
    peak_tflops: float | None = None
    start_step: int = 0
    start_loss: float | None = None


@dataclass
class OptimizerStep:
    """The optimizer and what runs with its step: fp16's loss scaler, the learning-rate schedule."""

    optimizer: torch.optim.Optimizer
    grad_scaler: torch.amp.GradScaler | None = None
    lr_schedule: torch.optim.lr_scheduler.LRScheduler | None = None

    def backward(self, loss: torch.Tensor) -> None:
        (self.grad_scaler.scale(loss) if self.grad_scaler else loss).backward()

    def step(self) -> None:
        if self.grad_scaler:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def scheduled(self) -> None:
        """After the step's memory is measured: the learning rate of the next step."""
        if self.lr_schedule is not None:
            self.lr_schedule.step()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def loss_scale(self) -> dict:
        """fp16's loss scale, for a record; nothing without a scaler."""
        return {"loss_scale": self.grad_scaler.get_scale()} if self.grad_scaler else {}


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
    def check(self, output: object, batch: Batch) -> None: ...
    def flops(self) -> tuple[int, int] | None: ...  # after it ran: model and hardware FLOPs per step


class AfterFit(Protocol):
    """Figures added to the summary once training ended (the memory limit's count, the run's
    own estimate beside its peak), in order, each seeing the ones before. Every rank calls it."""

    def figures(self, summary: Summary) -> dict: ...


class PeakMemory(Protocol):
    """What the trainer asks of its memory figures (fsdp_exp.metrics.peaks.MemoryMonitor; the
    estimate's trace counts phases its own way)."""

    def start_run(self) -> None: ...
    def start_window(self) -> None: ...
    def start_phase(self, name: str) -> None: ...
    def end_phase(self) -> None: ...
    def window_peaks(self) -> dict[str, float]: ...
    def held_gb(self) -> float: ...


@dataclass
class Hooks:
    """What the trainer calls besides its own work. `sinks` take each record (rank 0's files,
    console and wandb). `steps`: called around each step. `first_micro_batch`: what the first
    micro-batch also does (counts FLOPs, checks the model's output). `stop_early(step,
    window_peak_gb)`: called by every rank after each step, with what reads the window's peak so
    far; True ends training there (a probe whose peak has settled, fsdp_exp.rank.peak_settled).
    `after_fit`: figures added to the summary."""

    sinks: list[Sink] = field(default_factory=list)
    steps: list[StepHooks] = field(default_factory=list)
    first_micro_batch: FirstMicroBatch | None = None
    stop_early: Callable[[int, Callable[[], float | None]], bool] | None = None
    after_fit: list[AfterFit] = field(default_factory=list)


# A micro-batch's count of the items its loss averages over, and what waits for their sum over the ranks.
Counted = tuple[torch.Tensor, Callable[[], torch.Tensor]]


class Trainer:
    """Trains `model` for `settings.steps` optimizer steps; every rank measures, the sinks
    (rank 0's) write. Every `log_every` steps (and at the last) the loss is averaged over ranks
    and one record goes to each sink. A record's window never mixes warm-up steps with later
    ones, and the summary's averages leave the warm-up steps out. `loss(output, batch)`: the
    run's loss option (fsdp_exp.loss). `memory`: the memory figures, by default this rank's
    MemoryMonitor. `checkpoint`: saves the training state."""

    def __init__(self, settings: TrainerSettings, ranks: Ranks, model: nn.Module, optimizer: OptimizerStep,
                 loss: LossOption | None = None, batches: Batches | None = None, memory: PeakMemory | None = None,
                 checkpoint: Checkpointer | None = None, hooks: Hooks | None = None):
        self.settings, self.ranks, self.model, self.optimizer = settings, ranks, model, optimizer
        self.loss = loss if loss is not None else CrossEntropy()
        self.batches = batches if batches is not None else Batches([])
        self.memory = memory if memory is not None else MemoryMonitor(ranks.device)
        self.checkpoint = checkpoint
        self.hooks = hooks if hooks is not None else Hooks()
        self.takes = forward_keys(unwrap(model))
        self._first_micro_batch = self.hooks.first_micro_batch  # what it does once, then None
        self.throughput = Throughput(settings.batch_size * ranks.world_size, settings.tokens_per_sample,
                                     settings.peak_tflops,
                                     # padding's target, where the loss has one
                                     ignore_index=getattr(self.loss, "ignore_index", -100))
        self.host_data_wait_s = 0.0

    def _next(self, batches: Iterator) -> Batch:
        """The next batch, on this rank's device; the host's time waiting for it is counted
        (on a GPU, queued kernels may run meanwhile, so the GPU waits at most that long)."""
        start = time.perf_counter()
        raw = next(batches)
        self.host_data_wait_s += time.perf_counter() - start
        batch = self.batches.keys.read(raw, self.takes, self.loss.reads_targets, self.ranks.device)
        self.throughput.count(batch)
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

    def train_step(self, batches: Iterator, read_phases: bool = True) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches; gradients are reduced across
        ranks only after the last. Returns this rank's part of the step's loss: its mean over
        ranks is the step's loss."""
        phase = self._phase if read_phases else _no_phase  # each phase's memory, where it starts and ends
        total = torch.zeros((), device=self.ranks.device)
        grad_accum = self.settings.grad_accum
        for micro in range(grad_accum):
            first, self._first_micro_batch = self._first_micro_batch, None
            with gradient_sync(self.model, enabled=micro == grad_accum - 1), \
                    first.running() if first is not None else contextlib.nullcontext():
                phase("forward")
                batch = self._next(batches)
                counted = self.items_over_ranks(batch)
                output = batch.forward(self.model)
                if first is not None:
                    first.check(output, batch)
                loss = self.weighed(self.loss(output, batch), counted) / grad_accum
                phase("backward")
                self.optimizer.backward(loss)
            flops = first.flops() if first is not None else None
            if flops is not None:
                self.throughput.flops_per_step, self.throughput.hardware_flops_per_step = flops
            total += loss.detach()
        # The backward ends where the optimizer step starts (one read of the allocator's stats,
        # not two): waiting for a save's staging, which runs in its own thread, allocates nothing.
        if self.checkpoint is not None:
            self.checkpoint.before_update()
        phase("optimizer_step")
        self.optimizer.step()
        phase(None)
        self.optimizer.scheduled()
        return total

    def _phase(self, name: str | None) -> None:
        """The memory figures' phase boundary (None: the step's last phase ends)."""
        if name is None:
            self.memory.end_phase()
        else:
            self.memory.start_phase(name)

    def fit(self) -> Summary:
        """Train; return the run's figures: steady-state means and the run's peaks, then what
        the `after_fit` hooks add."""
        summary = self._nothing_to_train() if self.settings.start_step >= self.settings.steps else self._train()
        for hook in self.hooks.after_fit:
            summary.with_figures(hook.figures(summary))
        return summary

    def _train(self) -> Summary:
        settings, hooks = self.settings, self.hooks
        self.model.train()
        batches = iter(self.batches.items)
        first, warmup_end = settings.start_step + 1, settings.start_step + settings.warmup_steps
        # Each phase's peak is read in the warm-up steps, at least the first two (the second is
        # the first with the optimizer's state): every later step holds the same, and the reads
        # (a settling wait for gloo's threads on CPU, the allocator's stats on GPU) stay out of
        # the timed steps. The window's peaks, the kernel's and the allocator's own, see every step.
        phases_until = max(warmup_end, first + PHASE_STEPS - 1)
        # Work still queued from before training (a checkpoint load) must
        # not fall into the first window's time.
        distributed.synchronize(self.ranks.device)
        self.memory.start_run()
        window = _Window(first_step=first, start=time.perf_counter(), host_data_wait_s=0.0)
        totals = {"steady": Totals(), "all": Totals()}
        run_peaks: dict[str, list[float]] = {}
        record: dict = {}
        last = settings.steps
        for step in range(first, settings.steps + 1):
            for hook in hooks.steps:
                hook.before_step(step)
            loss = self.train_step(batches, read_phases=step <= phases_until)
            for hook in hooks.steps:
                hook.after_step(step)
            if self.checkpoint is not None:
                self.checkpoint.after_step(step, last=step == settings.steps, loss=loss)
            stop = hooks.stop_early is not None and hooks.stop_early(
                step, lambda: self.memory.window_peaks().get(PEAK_GB))
            logged = step % settings.log_every == 0 or step == settings.steps or stop
            if logged or step == warmup_end:  # a window never straddles warm-up
                record, per_rank, counted = self._record(step, loss, window, warmup_end)
                for key, values in per_rank.items():
                    run_peaks[key] = over_windows(key, run_peaks.get(key), values)
                for name in ("steady", "all") if step > warmup_end else ("all",):
                    totals[name].add(counted)
                if logged:
                    for sink in hooks.sinks:
                        sink.log(record)
                window = _Window(first_step=step + 1, start=time.perf_counter(),
                                 host_data_wait_s=self.host_data_wait_s)
                self.memory.start_window()
            if stop:
                last = step
                break
        if self.checkpoint is not None:
            self.checkpoint.close()
        steady = totals["steady"] if totals["steady"].steps else totals["all"]
        summary = Summary(steps=last, final_loss=record["loss"], world_size=self.ranks.world_size,
                          global_batch_size=self.throughput.global_batch, warmup_only=not totals["steady"].steps)
        summary.with_figures(self.throughput.means(steady))
        summary.with_figures({key: max(values) for key, values in run_peaks.items()})
        summary.peak_mem_gb_per_rank = run_peaks[PEAK_GB]
        summary.peak_reserved_gb_per_rank = run_peaks.get("peak_reserved_gb")
        summary.held_mem_gb = max(distributed.gather(self.memory.held_gb(), self.ranks.device))
        summary.resumed_from_step = settings.start_step or None
        saves = self.checkpoint.blocked_s if self.checkpoint is not None else []
        if saves:
            summary.checkpoint_saves = len(saves)
            summary.checkpoint_blocked_s = max(distributed.gather(sum(saves) / len(saves), self.ranks.device))
        return summary

    def _nothing_to_train(self) -> Summary:
        """A restart after the final checkpoint (a rank died, or the job was preempted, after
        the last step): no step is left, so no throughput either; the loss is the saved one."""
        settings = self.settings
        if self.ranks.is_main:
            log.warning("resumed at step %d of %d: nothing left to train", settings.start_step, settings.steps)
        if self.checkpoint is not None:
            self.checkpoint.close()
        return Summary(steps=settings.steps, resumed_from_step=settings.start_step, final_loss=settings.start_loss,
                       world_size=self.ranks.world_size, global_batch_size=self.throughput.global_batch)

    def _record(self, step: int, loss: torch.Tensor, window: _Window,
                warmup_end: int) -> tuple[dict, dict[str, list[float]], Totals]:
        """The record for the window ending at `step`, its memory peaks per rank and its totals."""
        mean_loss = distributed.mean(loss)
        distributed.synchronize(self.ranks.device)
        elapsed = time.perf_counter() - window.start
        per_rank = {k: distributed.gather(v, self.ranks.device) for k, v in self.memory.window_peaks().items()}
        counted = self.throughput.window(step - window.first_step + 1, elapsed,
                                         self.host_data_wait_s - window.host_data_wait_s, self.ranks.device)
        record = {
            "step": step,
            "time": time.time(),  # wall clock, for start-up and timeline figures
            "loss": mean_loss,
            "lr": self.optimizer.lr,
            **self.throughput.means(counted),
            **{key: max(values) for key, values in per_rank.items()},
            "peak_mem_gb_per_rank": per_rank[PEAK_GB],
            **self.optimizer.loss_scale(),
        }
        if step <= warmup_end:
            record["warmup"] = True
        return record, per_rank, counted


@dataclass
class _Window:
    first_step: int
    start: float
    host_data_wait_s: float
