"""From the experiment's built settings to the trainer's object graph, on one rank.

The ranks receive `fsdp_exp.config.Experiment`, whose groups are already objects (built
on the driver); here they become the live things a rank trains with: the sharded model,
the optimizer, the batches, the checkpointer and the metric sinks. The trainer receives
only those objects.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from fsdp_exp.batch import Batch, Batches
from fsdp_exp.blocks import block_names, checkpoint_blocks, compile_blocks, warmup_steps_to_skip
from fsdp_exp.checkpoint import TrainState
from fsdp_exp.config import Experiment, as_dict
from fsdp_exp.distributed import Ranks
from fsdp_exp.groups import LossOption
from fsdp_exp.metrics.flops import (
    counting_flops,
    device_peak,
    flops_per_token,
    peak_column,
    step_flops_figures,
)
from fsdp_exp.metrics.sinks import METRICS, JsonLines, Progress
from fsdp_exp.logger import Guarded
from fsdp_exp.metrics.peaks import MemoryMonitor, Runtime
from fsdp_exp.rank import worker
from fsdp_exp.rank.trainer import AfterFit, Hooks, OptimizerStep, Trainer, TrainerSettings
from fsdp_exp.rank.report import Known, StartupMarks
from fsdp_exp.rank.peak_settled import PeakSettled
from fsdp_exp.rank.trace_held import TraceHeld
from fsdp_exp.run_context import RunContext
from fsdp_exp.schedule import lr_schedule
from fsdp_exp.sharding import unwrap
from fsdp_exp.sharding.wrap import unit_sizes, units_line
from fsdp_exp.torch_private import CHECKPOINT_PREFIX


T = TypeVar("T")
log = logging.getLogger("fsdp_exp")


@dataclass
class Built:
    """One rank's live objects for a run."""

    trainer: Trainer
    trackers: list  # rank 0's (logger): wandb's run, TensorBoard's writer, ...
    jsonl: JsonLines | None
    progress: Progress | None
    figures: dict  # what is known before training: FSDP units, FLOPs per step


def rank0_first(ranks: Ranks, make: Callable[[], T]) -> T:
    """Rank 0 makes it first (a download, a cache), then the others."""
    if not ranks.is_main and dist.is_initialized():
        dist.barrier()
    made = make()
    if ranks.is_main and dist.is_initialized():
        dist.barrier()
    return made


def build_model_for_training(cfg: Experiment, ranks: Ranks,
                             mesh: DeviceMesh | None = None) -> tuple[nn.Module, list[dict]]:
    """The model with its per-block transforms and sharding applied, and its FSDP units
    (`mesh`: the sharding's, made beforehand; by default the sharding makes it).

    With `model.init_device=meta` the model is built without memory, sharded, and only
    then given storage: each rank holds just its shards. The weights are those of a plain
    build with the same seed, made once on rank 0's CPU and sent out shard by shard
    (DTensor's own random init is wrong on a CPU mesh).
    """
    sharding, train, meta = cfg.sharding, cfg.train, cfg.model.init_device == "meta"
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    with torch.device("meta") if meta else contextlib.nullcontext():
        model, blocks = cfg.model.build()
    units = sharding.select_units(model, blocks)
    fsdp_units = unit_sizes(model, units) if sharding.shards_params else []
    names = block_names(model, blocks)
    if train.activation_checkpointing:
        checkpoint_blocks(model, names)
    if train.compile:
        compile_blocks(model, names)
    # Only when it moves: `.to` cannot swap task=estimate's fake tensors, already on the CPU.
    if not meta and any(p.device != ranks.device for p in model.parameters()):
        model.to(ranks.device)
    model = sharding.apply(model, units, ranks.device, cfg.precision, offload=cfg.offload, mesh=mesh)
    if meta:
        plain = None
        if ranks.is_main:
            torch.manual_seed(cfg.seed)
            plain = cfg.model.build()[0]
        fill_from_rank0(unwrap(model), plain, params_on=torch.device("cpu") if cfg.offload else ranks.device,
                        buffers_on=ranks.device)
    return model, fsdp_units


def fill_from_rank0(model: nn.Module, plain: nn.Module | None, params_on: torch.device,
                    buffers_on: torch.device) -> None:
    """Storage and weights for a model built on the meta device and sharded: rank 0's plain
    build (`plain`, None on the other ranks), sent out shard by shard. Parameters go where
    FSDP keeps its shards (the CPU under offload), buffers where the forward runs.

    `to_empty` puts both on one device, and FSDP2 moves buffers to the rank's device only
    inside `fully_shard`, so under offload the buffers are moved after. Not before the
    weights are in: `set_model_state_dict` takes every parameter and persistent buffer on
    one device, and raises `Multiple devices found` on every rank when they are on two
    (torch.distributed.checkpoint.state_dict, `_load_model_state_dict`)."""
    model.to_empty(device=params_on)
    set_model_state_dict(model, plain.state_dict() if plain is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    move_buffers(model, buffers_on)
    buffers_from_rank0(model, plain)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer to `device` (BatchNorm's running stats, a mask): where the forward runs."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def buffers_from_rank0(model: nn.Module, plain: nn.Module | None) -> None:
    """Every buffer as rank 0's plain build has it. The state dict carries the persistent
    ones; a buffer registered with `persistent=False` (a mask, a position table) is in no
    state dict, and `to_empty` leaves it uninitialised memory."""
    # Activation checkpointing's wrapper adds a level to the names; the plain build has none.
    own = {name.replace(CHECKPOINT_PREFIX, ""): b for name, b in model.named_buffers()}
    source = dict(plain.named_buffers()) if plain is not None else own
    with torch.no_grad():
        for name, buffer in own.items():
            if plain is not None:
                buffer.copy_(source[name])
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(buffer, src=0)


def start_trackers(cfg: Experiment, ranks: Ranks, run_dir: Path, context: RunContext) -> list:
    """Rank 0's trackers (`logger`: wandb's run, TensorBoard's writer, MLflow's run, the CSV
    files), each said on the console with where it logs. Started before the rank marks its
    runtime: their modules and wandb's run (about 25 MB on rank 0, which the estimate holds
    too) are the runtime's, not the run's peak."""
    if not ranks.is_main:
        return []
    config = {**as_dict(cfg), "environment": context.environment}
    trackers: list = []
    if cfg.logger.wandb:
        trackers.append(cfg.wandb.sink(config, run_dir))
    trackers += cfg.logger.start(config, run_dir, cfg.wandb.project or "fsdp_exp", cfg.wandb.job_type or "train",
                                 cfg.wandb.tags)
    for tracker in trackers:
        log.info("%s: %s", tracker.name if isinstance(tracker, Guarded) else "wandb", tracker.where())
    return trackers


def build_experiment(cfg: Experiment, ranks: Ranks, run_dir: Path, context: RunContext,
                     checkpoint_dir: Path | None = None, resume: Path | None = None, probe: bool = False,
                     trackers: Sequence = (), runtime: Runtime = Runtime(),
                     after_fit: Sequence[AfterFit] = ()) -> Built:
    """Every object of the run on this rank, saving its checkpoints into `checkpoint_dir`;
    with `resume`, restored from that checkpoint. `context`: the run's, which gets the
    mark of the build's end. `probe`: a probe of task=max_batch, which draws no progress
    bar of its own. `trackers`: rank 0's (wandb's run, ...), started before the runtime
    was marked (`start_trackers`). `runtime`: what this rank held before it built its model, which its
    peak_mem_gb leaves out (`mark_runtime`). `after_fit`: what adds to the trainer's figures
    once it trained, after what the build knew and the start-up marks (fsdp_exp.rank.report)."""
    model, fsdp_units = build_model_for_training(cfg, ranks)
    optimizer = instantiate(cfg.optimizer)(model.parameters())

    train, data = cfg.train, cfg.data
    micro_batch = train.batch_size // train.grad_accum
    batches = rank0_first(
        ranks,
        lambda: data.batches(micro_batch, ranks.rank, ranks.world_size, cfg.seed,
                             pin_memory=ranks.device.type == "cuda"),
    )

    tf32 = cfg.precision.apply_tf32(ranks.device.type)
    peak = device_peak(ranks.device, peak_column(cfg.precision.param_dtype, tf32), cfg.metrics.peak_tflops)
    figures: dict = {"fsdp_units": fsdp_units, "tf32": tf32,
                     "peak_tflops": peak.tflops, "peak_tflops_source": peak.source}
    grad_scaler = cfg.precision.grad_scaler(ranks.device.type)
    schedule = lr_schedule(optimizer, train.lr_schedule, train.lr_warmup_steps, train.steps)

    state = TrainState(model, optimizer, ranks, cfg.model.as_dict(), batches, schedule, grad_scaler)
    checkpoint = cfg.checkpoint.start(state, checkpoint_dir)
    start_step, start_loss = state.load(resume) if resume is not None else (0, None)
    if resume is not None and ranks.is_main:
        log.info("resumed from %s at step %d", resume, start_step)

    hooks: list = [cfg.profile.start(run_dir, ranks.rank, ranks.device)]
    held = TraceHeld(context.estimate_pid, first_timed=start_step + cfg.metrics.warmup_steps + 1) \
        if ranks.is_main and context.estimate_pid else None
    if held is not None:
        hooks.append(held)
    sinks: list = []
    jsonl = progress = None
    if ranks.is_main:
        if fsdp_units:
            full, shown = units_line(fsdp_units), units_line(fsdp_units, worker.rank_log_path(run_dir, 0))
            log.info("%s", shown)
            if shown != full:
                logging.getLogger("fsdp_exp.rank_file").info("%s", full)
        if peak.warning:
            log.warning(peak.warning)
        compiled_warmup = warmup_steps_to_skip(compile=True)
        if train.compile and cfg.metrics.warmup_steps < compiled_warmup:
            log.warning("metrics.warmup_steps=%d with train.compile=true: compiling comes after step 1's first "
                        "micro-batch, which runs eagerly while its FLOPs are counted, so the summary's "
                        "throughput includes the compiler; set metrics.warmup_steps=%d or more",
                        cfg.metrics.warmup_steps, compiled_warmup)
        jsonl = JsonLines(run_dir / METRICS)
        if resume is not None:  # earlier records stay; readers take the last record of a step
            jsonl.log({"event": "resumed", "step": start_step, "checkpoint": str(resume)})

        # A probe draws no bar of its own: the search reports each probe in one line.
        progress = Progress(train.steps, done=start_step, live=False if probe else None)
        sinks = [jsonl, progress, *trackers]
        hooks.append(progress)

    first = CountedFirstMicroBatch(model, train.grad_accum, ranks.is_main, figures, cfg.model.name,
                                   analytic_flops(model, data.tokens_per_sample, micro_batch), cfg.loss)
    settled = PeakSettled(**context.settle, device=ranks.device, is_main=ranks.is_main) if context.settle else None
    settings = TrainerSettings(steps=train.steps, batch_size=train.batch_size, log_every=train.log_every,
                             warmup_steps=cfg.metrics.warmup_steps, grad_accum=train.grad_accum,
                             tokens_per_sample=data.tokens_per_sample, peak_tflops=peak.tflops,
                             start_step=start_step, start_loss=start_loss)
    trainer = Trainer(settings, ranks, model, OptimizerStep(optimizer, grad_scaler, schedule), cfg.loss,
                      Batches(batches, data.batch_keys), MemoryMonitor(ranks.device, cfg.metrics.phase_peaks, runtime),
                      checkpoint, Hooks(sinks, hooks, first, settled,
                                        [Known(figures), StartupMarks(context.startup),
                                         *([held] if held else []), *after_fit,
                                         *([settled] if settled else [])]))
    context.startup["built"] = time.time()
    return Built(trainer, list(trackers), jsonl, progress, figures)


def log_flops(figures: dict) -> None:
    model, hardware = figures["flops_per_step"], figures["hardware_flops_per_step"]
    source, analytic = figures["flops_source"], figures.get("flops_per_step_analytic")
    counted = figures.get("flops_per_step_counted", model)
    line = f"FLOPs per step on each rank: {model:.3g} ({source}; MFU counts these)"
    if hardware != model:
        line += f"; {hardware:.3g} with the forward activation checkpointing recomputes (HFU)"
    if analytic is not None:
        line += f"; {counted:.3g} counted, {analytic:.3g} by the 6N formula (ratio {counted / analytic:.3f})"
    log.info(line)
    uncounted = ", ".join(figures.get("flops_uncounted_ops", []))
    if uncounted:
        log.warning("FlopCounterMode has no FLOP formula for %s: %s", uncounted,
                    "TFLOP/s and MFU use the analytic count" if source == "analytic"
                    else "TFLOP/s and MFU leave those kernels out")
    if analytic is not None and abs(counted / analytic - 1) > 0.1:
        log.warning("counted and analytic FLOPs differ by %.0f%%: TFLOP/s and MFU use the %s figure",
                    abs(counted / analytic - 1) * 100, source)


def analytic_flops(model: nn.Module, tokens_per_sample: int, micro_batch: int) -> int | None:
    """For a language model, the 6N count of one micro-batch on this rank."""
    if not tokens_per_sample:
        return None
    per_token = flops_per_token(unwrap(model), tokens_per_sample)
    return None if per_token is None else per_token * tokens_per_sample * micro_batch


@dataclass
class CountedFirstMicroBatch:
    """The first micro-batch of training is counted (FlopCounterMode) and its logits checked
    against the model contract: this rank's FLOPs per step need no forward and backward of
    their own. Rank 0 logs them; the figures go into the run's."""

    model: nn.Module
    grad_accum: int
    is_main: bool
    figures: dict
    model_name: str
    analytic: int | None
    loss: LossOption
    counted: bool = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with counting_flops(self.model) as count:
            yield
        assert count.step is not None
        self.figures.update(step_flops_figures(count.step, self.analytic, self.grad_accum))
        self.counted = True
        if self.is_main:
            log_flops(self.figures)

    def flops(self) -> tuple[int, int] | None:
        if not self.counted:
            return None
        return self.figures["flops_per_step"], self.figures["hardware_flops_per_step"]

    def check(self, output: Any, batch: Batch) -> None:
        self.loss.check_output(output, batch, self.model_name)