"""One probe of task=max_batch: a short, real training run at one batch size, on fresh ranks.

A probe is started by the run's launcher like any run, in its own directory
(`<run>/probes/<n>_b<batch>/`, with its rank logs, metrics.jsonl and summary.json), so
an out-of-memory rank can never poison the allocator or hang a collective for the next one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from fsdp_exp.blocks import warmup_steps_to_skip
from fsdp_exp.checkpoint import NoCheckpoint
from fsdp_exp.config import Device, Experiment, as_dict
from fsdp_exp.launcher.core import Launcher, RunFailed
from fsdp_exp.metrics.wandb_sink import WandbMode
from fsdp_exp.metrics.summary import Summary
from fsdp_exp.profile import NoProfile
from fsdp_exp.rank.train import train_rank
from fsdp_exp.run_context import RunContext
from fsdp_exp.tasks.max_batch.policy import Outcome
from fsdp_exp.tasks.max_batch.settings import VERIFY_WINDOW
from fsdp_exp.tasks.train import Train


# A probe's figures that the search sets, not its run: the estimate is the search's own,
# traced once for every probe (Probe.set_estimate), and the time is the probe's from its launch.
OWN_FIGURES = ("batch_size", "status", "reason", "estimated_peak_under_limit_gb", "estimate_ratio", "wall_s")


@dataclass
class Probe:
    batch_size: int
    status: str  # ok | oom | failed
    reason: str | None = None
    peak_mem_gb: float | None = None  # the largest over the ranks
    peak_mem_gb_per_rank: list[float] | None = None
    peak_reserved_gb: float | None = None  # GPU: what the allocator held, which the cap limits
    peak_reserved_gb_per_rank: list[float] | None = None
    peak_under_limit_gb: float | None = None  # CPU: the peak as memory.limit_gb counts it
    peak_under_limit_gb_per_rank: list[float] | None = None
    held_before_limit_gb_per_rank: list[float] | None = None  # CPU: what each rank held when its limit was set
    held_mem_gb: float | None = None
    alloc_retries: float | None = None  # GPU: the caching allocator's retries (it freed its cache to allocate)
    # GPU: what the device held beyond the allocator's reserved peak (the CUDA context, NCCL's and
    # cuBLAS's memory), the most on any rank: device_used_gb less peak_reserved_gb
    outside_allocator_gb: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None  # token data: the tokens the loss saw (padding left out)
    mfu: float | None = None  # model FLOPs utilisation, where the device's peak is known
    predicted_peak_gb: float | None = None  # the line fitted to the probes that fit
    estimated_peak_under_limit_gb: float | None = None  # task=estimate's, before any probe (task.estimate), as the limit counts
    estimate_ratio: float | None = None  # estimated_peak_under_limit_gb over the peak the limit caps (limited_peak_gb)
    margin_gb: float | None = None  # the room left under the limit
    within_noise: bool = False  # trained, with less room than the noise band: counted as not fitting
    for_fastest: bool = False  # spent to place the fastest batch, not by the search
    wall_s: float = 0.0
    startup_s: float | None = None  # from the launch to the first step's start: forked ranks, process group, build
    dir: str = ""
    killed: bool = False  # stopped by a signal from outside, not by its own error
    timed_out: bool = False  # ran past task.probe_timeout (a larger batch would not train sooner)
    steps: int | None = None  # the steps it trained: a probe trains on until its peak settles
    settled_at_step: int | None = None  # the step at which its peak was found settled (None: it ran its steps)
    # run as the command at a size the search expected to answer (MaxBatchSearch.answers_at): it
    # verifies that answer too, as a run of the command (fsdp_exp.tasks.max_batch.verify)
    as_command: bool = False

    def limited_peak_gb(self) -> float | None:
        """The peak that the memory limit caps: reserved memory on GPU, the limit's own
        count on CPU (fsdp_exp.memory.peak_under_limit_gb)."""
        for peak in (self.peak_under_limit_gb, self.peak_reserved_gb, self.peak_mem_gb):
            if peak is not None:
                return peak
        return None

    def set_estimate(self, estimated_gb: float | None) -> None:
        """task=estimate's peak for this probe, and its ratio to the peak measured."""
        self.estimated_peak_under_limit_gb = estimated_gb
        measured = self.limited_peak_gb() if self.status == "ok" else None
        self.estimate_ratio = estimated_gb / measured if estimated_gb is not None and measured else None

    def judged_peak_gb(self) -> float | None:
        """The peak the search judges a probe by and fits its line to: on CPU the limit's own
        count; on GPU the allocated peak (peak_mem_gb), not the reserved one the cap limits.
        Near the cap the caching allocator frees its cache and retries (alloc_retries) before
        it raises, so the reserved peaks of sizes that still train flatten just under the cap:
        judged by them, those sizes would read as inside the noise band. Allocated memory
        keeps growing with the batch, so a GPU probe that trained fits, and the size that
        really runs out of memory sets the boundary. (A GPU rank's peak_under_limit_gb is its
        reserved peak, what the cap limits: not judged.) As fsdp_exp.rank.peak_settled judges."""
        if self.on_gpu():
            return self.peak_mem_gb
        return self.peak_under_limit_gb if self.peak_under_limit_gb is not None else self.peak_mem_gb

    def judged_peak_gb_per_rank(self) -> list[float]:
        if self.on_gpu():
            return self.peak_mem_gb_per_rank or []
        return self.peak_under_limit_gb_per_rank or self.peak_mem_gb_per_rank or []

    @classmethod
    def trained(cls, batch_size: int, summary: Summary, startup_s: float | None) -> Probe:
        """A probe whose run trained: each figure its run's summary.json has by the same
        name, but those the search sets (OWN_FIGURES)."""
        read = {name: summary.get(name) for name in cls.__dataclass_fields__
                if name in Summary.names() and name not in OWN_FIGURES}
        return cls(batch_size, "ok", **read, outside_allocator_gb=outside_allocator_gb(summary), startup_s=startup_s,
                   settled_at_step=summary.peak_settled_at_step)

    def on_gpu(self) -> bool:
        """Whether its ranks ran on GPUs: only a GPU rank reports a reserved peak."""
        return self.peak_reserved_gb is not None

    def outcome(self) -> Outcome:
        return Outcome(self.batch_size, self.status == "ok", self.judged_peak_gb(), self.held_mem_gb,
                       failed_otherwise=self.status == "failed" and not self.timed_out)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> Probe:
        known = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def line(self) -> str:
        estimated = "" if self.estimated_peak_under_limit_gb is None else f"estimated {self.estimated_peak_under_limit_gb:.3f} GB" + \
            ("" if self.estimate_ratio is None else f", {self.estimate_ratio - 1:+.1%}")
        if self.status != "ok":
            return (f"batch {self.batch_size}: {self.status} ({self.reason})"
                    f"{f' ({estimated})' if estimated else ''} [{self.wall_s:.0f} s]")
        others = [f"{peak:.3f} GB {name}" for peak, name in ((self.peak_under_limit_gb, "as the limit counts it"),
                                                              (self.peak_reserved_gb, "reserved")) if peak is not None]
        primary = self.peak_mem_gb if self.peak_mem_gb is not None else self.judged_peak_gb()
        named = f" ({', '.join(others)})" if others else ""
        return (f"batch {self.batch_size}: ok, peak {primary:.3f} GB{named}"
                f"{f' ({estimated})' if estimated else ''}, {self.samples_per_s:,.1f} samples/s [{self.wall_s:.0f} s]")


def probe_config(cfg: Experiment, batch_size: int, steps: int, world_size: int,
                 limit_gb: Any = "same", up_to_steps: int = 0) -> Experiment:
    """The run's config, trimmed to a probe: `steps` steps at `batch_size` (or, to let its peak
    settle, up to `up_to_steps`: `settling_rule`), the first of them warm-up (with train.compile the
    first two, and then at least 3 steps, so that the probe's samples/s times training, not
    the compiler), no profile or export.
    - On CPU, wandb logs as the run would, offline, in a run of its own, a record every step:
      rank 0 holds what wandb's first log takes while it trains on, as the run's rank 0 does
      under the limit (about 42 MB on the 2-layer ViT, docs/max_batch.md). Disabled where the run's is, and on
      GPU, whose cap counts the caching allocator alone, which wandb does not touch.
    - A checkpoint, where the run has one, is saved after `steps` steps, and the steps after
      it train beside what the save holds (async staging), as the run's do.
    - The data is the run's, read as the run reads it (the search stays within each rank's share).
    - The task is the run's, `task=train`: the ranks get the config a run's get. The search's
      own settings in it moved what a rank held before its limit was set, and with it the
      peak as the limit counts it, by about 0.8 MB (docs/max_batch.md)."""
    warmup = warmup_steps_to_skip(cfg.train.compile)
    steps = max(steps, warmup + 1)
    logs = probes_log_wandb(cfg)
    wandb = replace(cfg.wandb, mode=WandbMode.offline if logs else WandbMode.disabled, id=None, group=None,
                    job_type="probe")
    total = max(steps, up_to_steps)
    checkpoint = cfg.checkpoint if isinstance(cfg.checkpoint, NoCheckpoint) else \
        replace(cfg.checkpoint, dir=None, every=steps)
    return replace(
        cfg,
        train=replace(cfg.train, batch_size=batch_size, steps=total,
                      log_every=1 if logs else total),
        metrics=replace(cfg.metrics, warmup_steps=warmup),
        profile=NoProfile(),
        checkpoint=checkpoint,
        wandb=wandb,
        memory=cfg.memory if limit_gb == "same" else replace(cfg.memory, limit_gb=limit_gb),
        task=Train(),  # the run's: the search's settings are the driver's, and move a rank's layout (below)
    )


def settling_rule(cfg: Experiment, steps: int, tolerance_gb: float) -> dict:
    """A probe's rule for when its peak has settled (fsdp_exp.rank.peak_settled.PeakSettled): checked
    from its `steps`-th step, every (steps less warm-up) steps after, until two checks agree
    within `tolerance_gb` (the search's noise band)."""
    warmup = warmup_steps_to_skip(cfg.train.compile)
    steps = max(steps, warmup + 1)
    return {"tolerance_gb": tolerance_gb, "first_check": steps, "window": max(1, steps - warmup)}


def probes_log_wandb(cfg: Experiment) -> bool:
    """Whether a probe of this run logs to wandb (`probe_config`): on CPU, where the run does."""
    return cfg.wandb.mode != WandbMode.disabled and cfg.device == Device.cpu


def command_config(cfg: Experiment, batch_size: int, steps: int, job_type: str,
                   save_within: int | None = None) -> Experiment:
    """The run as its command line runs it with `train.batch_size=<batch_size>`: its own data,
    sinks, checkpoints and export, for `steps` steps, in a run directory of its
    own (checkpoint.dir is left to it, so no checkpoint of the user's is touched); wandb in
    the run's own mode, as a new run of `job_type`. `save_within`: a run that may stop once
    its peak settles saves a checkpoint at least this often, so that a save's memory falls
    inside it, as it falls inside the run's length, and logs at least twice a window, so that
    its speed has readings enough to tell its spread (fsdp_exp.tasks.tune.confirm.step_spread)."""
    wandb = replace(cfg.wandb, id=None if cfg.wandb.mode == WandbMode.disabled else uuid.uuid4().hex[:16],
                    job_type=job_type)
    checkpoint = replace(cfg.checkpoint, dir=None) if getattr(cfg.checkpoint, "dir", None) else cfg.checkpoint
    log_every = cfg.train.log_every
    if save_within is not None:
        log_every = min(log_every, max(1, save_within // 2))
        if not isinstance(checkpoint, NoCheckpoint) and checkpoint.every > save_within:
            checkpoint = replace(checkpoint, every=save_within)
    return replace(cfg, train=replace(cfg.train, batch_size=batch_size, steps=steps, log_every=log_every),
                   wandb=wandb, checkpoint=checkpoint, task=Train())


def verify_rule(cfg: Experiment, tolerance_gb: float) -> dict:
    """A run of the command's rule for when its peak has settled (fsdp_exp.rank.peak_settled.PeakSettled):
    first read where a probe first reads it (task.steps_per_probe, past the warm-up a compiled
    step needs), then every VERIFY_WINDOW steps, until its peak rose by at most `tolerance_gb`
    over the last VERIFY_WINDOW: a run that holds still stops after steps_per_probe +
    VERIFY_WINDOW steps (8 by default)."""
    first = settling_rule(cfg, getattr(cfg.task, "steps_per_probe", VERIFY_WINDOW), tolerance_gb)["first_check"]
    return {"tolerance_gb": tolerance_gb, "first_check": first, "window": VERIFY_WINDOW}


def fingerprint(cfg: Experiment, world_size: int, steps: int) -> str:
    """Probes made under the same fingerprint can be reused: same setup but the batch."""

    probe = as_dict(probe_config(cfg, 1, steps, world_size, up_to_steps=getattr(cfg.task, "settle_steps", 0)))
    probe["wandb"] = probe["wandb"]["mode"]  # held in rank 0's memory; tags and ids change no probe
    probe["task"] = None  # the search's own settings
    text = json.dumps({"cfg": probe, "world_size": world_size}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def outside_allocator_gb(summary: Summary) -> float | None:
    """GPU: the most any rank's device held beyond its allocator's reserved peak (None on CPU)."""
    used, reserved = summary.device_used_gb_per_rank, summary.peak_reserved_gb_per_rank
    if not used or not reserved or len(used) != len(reserved):
        return None
    return max(max(u - r, 0.0) for u, r in zip(used, reserved))


def startup_s(summary: Summary, launched: float) -> float | None:
    """From the launch to the first step's start, by rank 0's marks (none from a launcher
    whose ranks do not report them)."""
    ready = (summary.startup or {}).get("ready")
    return None if ready is None else ready - launched


def run_probe(cfg: Experiment, batch_size: int, probe_dir: Path, launcher: Launcher, world_size: int,
              steps: int, timeout_s: float, limit_gb: Any = "same", as_command: str | None = None,
              settle_gb: float | None = None, until_settled: float | None = None) -> Probe:
    """Train `steps` steps at `batch_size` on fresh ranks; the outcome, never an exception
    for a rank's failure (KeyboardInterrupt still stops the search). `as_command`: the run as
    its command line runs it (`command_config`), as a wandb run of this job type, which with
    `until_settled` stops once its peak rose by at most that over VERIFY_WINDOW steps
    (`verify_rule`); else a probe, which with `settle_gb` trains on, up to task.settle_steps,
    until its peak settles within it. The checkpoints either saves are removed when it ends:
    they are no one's."""
    probe_dir.mkdir(parents=True, exist_ok=True)
    context = RunContext(startup={"launched": time.time()})
    if as_command is not None:
        run_cfg = command_config(cfg, batch_size, steps, as_command,
                                 save_within=VERIFY_WINDOW if until_settled is not None else None)
        if until_settled is not None:
            context.settle = verify_rule(cfg, until_settled)
    elif settle_gb is not None:
        run_cfg = probe_config(cfg, batch_size, steps, world_size, limit_gb, cfg.task.settle_steps)
        context.settle = settling_rule(cfg, steps, settle_gb)
    else:
        run_cfg = probe_config(cfg, batch_size, steps, world_size, limit_gb)
    start = time.perf_counter()
    try:
        summary = Summary(status="ok").with_figures(
            launcher.launch(partial(train_rank, context=context, probe=True), run_cfg, probe_dir, world_size,
                            time_limit_s=timeout_s))
        probe = Probe.trained(batch_size, summary, startup_s(summary, context.startup["launched"]))
    except RunFailed as err:
        status = "oom" if err.out_of_memory else "failed"
        reason = f"ran past task.probe_timeout={timeout_s:g} s" if err.timed_out else str(err)
        probe = Probe(batch_size, status, reason=reason, killed=err.killed_by is not None and not err.timed_out,
                      timed_out=err.timed_out)
        summary = Summary(status=status, error=reason)
    probe.wall_s = time.perf_counter() - start
    probe.dir = f"{probe_dir.parent.name}/{probe_dir.name}"
    shutil.rmtree(probe_dir / "checkpoints", ignore_errors=True)
    summary.batch_size, summary.wall_s = batch_size, probe.wall_s
    summary.write(probe_dir)
    return probe
