"""The search of task=max_batch, on the driver: the largest per-rank batch that trains
within the memory limit.

The driver runs probes (fresh launches of all ranks, `fsdp_exp.tasks.max_batch.probe`) at the batch
sizes `BatchSearch` picks, records each one in max_batch.json (a `MaxBatchRecord`,
fsdp_exp.tasks.max_batch.record) as soon as it ends, and reuses the recorded probes when it
is run again into the same run directory.

Without memory.limit_gb the limit is the memory of rank 0's device, as rank 0 of the first
probe reports it: on a cluster the driver is not a compute node, and may have no GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp_exp.config import Experiment
from fsdp_exp.estimate.curve import PeakCurve
from fsdp_exp.errors import ConfigError
from fsdp_exp.launcher.core import Launcher, RunFailed
from fsdp_exp.memory import device_memory_gb
from fsdp_exp.metrics.environment import (
    DEVICE_RECORD,
    read_device_record,
    write_device_record,
)
from fsdp_exp.metrics.figures import MaxBatchAnswer
from fsdp_exp.metrics.summary import PEAK_GB, Summary
from fsdp_exp.rank.worker import rank_log_path
from fsdp_exp.run_context import RunContext
from fsdp_exp.sharding.wrap import units_line
from fsdp_exp.tasks import setup_line
from fsdp_exp.tasks.max_batch.answer import (
    SPACING,
    fastest,
    fits_with_room,
    margin_gb,
    noise_band_gb,
    probe_to_place_fastest,
)
from fsdp_exp.tasks.max_batch.prior import estimate_curve, prior
from fsdp_exp.tasks.max_batch.policy import (
    BatchSearch,
    Outcome,
    fit_memory,
    recommended_size,
    too_small,
)
from fsdp_exp.tasks.max_batch.probe import Probe, fingerprint, probe_config, probes_log_wandb, run_probe
from fsdp_exp.tasks.max_batch.record import RECORD, MaxBatchRecord
from fsdp_exp.tasks.max_batch.report import report, summary_figures
from fsdp_exp.tasks.max_batch.verify import Verification, Verifying


log = logging.getLogger("fsdp_exp")


class MaxBatchSearch(Verifying):
    """One search, live: its settings (`cfg`, the run's with task=max_batch), where it writes,
    how its probes start, and what it has learned so far."""

    def __init__(self, cfg: Experiment, run_dir: Path, launcher: Launcher, nproc: int,
                 context: RunContext | None = None, own_wandb_run: bool = True) -> None:
        self.cfg, self.run_dir, self.launcher, self.nproc = cfg, run_dir, launcher, nproc
        self.context = context if context is not None else RunContext()  # the search's; the probes have their own
        self.own_wandb_run = own_wandb_run  # the search logs its answer to a wandb run (not a tune's setup: the tune does)
        settings = self.cfg.task
        self.steps = settings.steps_per_probe
        self.timeout_s = settings.probe_timeout
        self.limit_gb = self.cfg.memory.limit_gb  # or, without one, what rank 0's device holds (`learn_device`)
        self.device_seen: dict = {}  # rank 0's environment record (fsdp_exp.metrics.environment)
        self.fingerprint = fingerprint(self.cfg, self.nproc, self.steps)
        self.probes: list[Probe] = []
        self.need: Probe | None = None  # the smallest batch under all this device gives a rank, when none fits
        self.estimated: dict | None = None  # the estimate's curve (fsdp_exp.tasks.max_batch.prior), once traced
        self.reused = 0
        self.verification = Verification.of(settings.verify_length())
        self.probes_before_verifying: int | None = None  # set when the first run of the command starts
        self.units_told = False
        self.placed = False  # the probe that places the fastest batch has been spent (or was not needed)
        self.start = time.perf_counter()
        self.data_share = self.data_share_per_rank()

    def data_share_per_rank(self) -> int | None:
        """The samples each rank reads an epoch (data.num_samples for generated data): no
        batch above it can train, so the search stops there. None for files on a cluster,
        which are the cluster's."""
        if not self.launcher.runs_here and not self.cfg.data.generated:
            return None
        share = self.cfg.data.share_per_rank(self.nproc)
        if share is not None and share < self.cfg.task.resolution:
            raise ConfigError(f"task.resolution={self.cfg.task.resolution}: larger than each rank's share "
                              f"of the data ({share} samples on each of {self.nproc} ranks); lower it or use more data")
        return share

    def up_to(self) -> int:
        """The largest size the search tries: task.search_up_to, or the data's share."""
        up_to = self.cfg.task.search_up_to
        return up_to if self.data_share is None else min(up_to, self.data_share)

    def search(self) -> BatchSearch:
        """The search for the largest size that fits with the noise band to spare."""
        settings = self.cfg.task
        return BatchSearch(self.room_gb(), settings.resolution, self.up_to(), self.noise_gb(), prior(self.estimated))

    def room_gb(self) -> float:
        """The room a probe's peak has: the limit, less what a run of the command holds beyond
        a probe over its length (`counted_beyond_gb`)."""
        return self.limit_gb - self.counted_beyond_gb()

    def noise_gb(self) -> float:
        return noise_band_gb([p for p in self.probes if not p.killed], self.limit_gb,
                             rank0_alike=not probes_log_wandb(self.cfg))

    def outcomes(self) -> list[Outcome]:
        """The probes as the search reads them (it counts one that trained inside the noise
        band as not fitting, and starts above sizes too small to train)."""
        return [p.outcome() for p in self.probes if not p.killed]

    def next_size(self) -> int | None:
        """The search's next size; before any probe has told the device's memory, its first
        one, which needs none."""
        if self.limit_gb is None:
            return self.cfg.task.resolution
        self.estimate()  # before the first probe, which it places
        return self.search().next_size(self.outcomes())

    def estimate(self) -> PeakCurve | None:
        """The estimate's curve of this setup's peak against the batch (task.estimate), traced
        once the limit is known (under memory.limit_gb, or on a GPU once a probe has told the
        device's memory) and recorded; None without it, or when the trace failed."""
        if self.estimated is None and self.cfg.task.estimate and self.limit_gb is not None:
            probe = probe_config(self.cfg, self.cfg.task.resolution, self.steps, self.nproc)
            estimate_cfg = replace(probe, task=replace(self.cfg.task, search_up_to=self.up_to()))  # traced no further
            self.estimated = estimate_curve(estimate_cfg, self.nproc, self.limit_gb)
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)  # before the first probe makes it
            self.save(None)
        return prior(self.estimated)

    def boundary(self) -> int:
        return self.search().bracket(self.outcomes())[0]

    def too_small(self) -> list[Probe]:
        """Probes at sizes too small to train (they failed for a reason other than memory,
        below the smallest size that trained), which the search started above."""
        sizes = {o.batch_size for o in too_small(self.outcomes())}
        return [p for p in self.probes if p.batch_size in sizes and not p.killed]

    def searched_from(self) -> int:
        """The smallest size the search read: task.resolution, or the first size past
        those too small to train."""
        small = {p.batch_size for p in self.too_small()}
        return min((p.batch_size for p in self.probes if not p.killed and p.batch_size not in small),
                   default=self.cfg.task.resolution)

    def run(self) -> MaxBatchAnswer:
        self.start_or_resume()
        while self.step():
            pass
        return self.finish()

    def start_or_resume(self) -> None:
        """Read the probes an earlier run into this directory recorded, and what they tell."""
        self.probes = self.recorded_probes()
        self.reused = len(self.probes)
        self.learn_device()
        self.placed = any(p.for_fastest for p in self.probes)

    def step(self) -> bool:
        """Run the search's next probe (and its retry, if it was killed from outside); once the
        boundary is known and the fastest batch placed, the next run of the command that
        verifies it (`verify_step`). False when nothing is left to run."""
        size, for_fastest = self.next_size(), False
        if size is None and not self.placed and self.boundary():
            self.placed = for_fastest = True
            size = probe_to_place_fastest(self.probes, self.boundary(), self.cfg.task.resolution)
            if size is not None:
                log.info("one more probe, at batch %d: the probes next to the fastest batch are more than %gx "
                         "apart", size, SPACING)
        if size is None:
            return self.verify_step()
        small = self.too_small()
        if small and len(small) == len([p for p in self.probes if not p.killed]):
            log.info("batch %d failed for a reason other than memory; trying %d, in case it is too small to "
                     "train (as BatchNorm is with one value per channel)", small[-1].batch_size, size)
        as_command = not for_fastest and self.answers_at(size)
        probe = self.probe(size, for_fastest=for_fastest, as_command=as_command)
        if as_command and probe.status == "failed" and not probe.killed and not probe.timed_out:
            self.failed_as_command(probe, for_fastest)
        if probe.killed:  # stopped from outside: the batch may well fit; try it once more
            log.warning("batch %d was killed from outside; trying it once more", size)
            retry = self.probe(size, for_fastest=for_fastest, as_command=as_command)
            retry.killed = False  # a second kill counts as a failure at this size
            self.save(None)
        return True

    def finish(self) -> MaxBatchAnswer:
        """The answer, verified: max_batch.json, its plot, wandb and the log line; the summary's figures."""
        boundary = self.boundary()
        if not boundary:
            self.measure_need()
        record = self.save(self.verify(boundary))
        report(self.cfg, self.context, self.run_dir, record, self.own_wandb_run)
        return summary_figures(record)

    def probe(self, size: int, limit_gb: Any = "same", for_fastest: bool = False, as_command: bool = False) -> Probe:
        """A probe at `size`; `as_command`: at a size the search expects to answer (`answers_at`),
        run as the command, which verifies that answer too where it completes."""
        probe_dir = self.run_dir / "probes" / f"{len(self.probe_dirs()) + 1:02d}_b{size}"
        if as_command:
            log.info("batch %d is where the search expects its answer: its probe runs as the command (its data, "
                     "wandb and checkpoints), %s, and verifies it", size, self.verification.length().words())
            probe = self.command_run(size, probe_dir)
            probe.as_command = True
            if probe.status == "ok":
                self.verification.runs.append(probe)
        else:
            # Before the first probe has told the device's memory (no memory.limit_gb on a GPU), there
            # is no noise band to settle within: that probe, at task.resolution, runs its steps.
            settle_gb = self.noise_gb() if self.limit_gb is not None else None
            probe = run_probe(self.cfg, size, probe_dir, self.launcher, self.nproc, self.steps, self.timeout_s,
                              limit_gb, settle_gb=settle_gb)
        probe.for_fastest = for_fastest
        probe.set_estimate(self.estimated_peak_under_limit_gb(size))
        self.tell_units(probe_dir)
        if limit_gb == "same":
            log.info("probe %d: %s", len(self.probe_dirs()), probe.line())
        else:
            log.info("without the limit: %s", probe.line())
        self.learn_device(probe)
        if self.limit_gb is None:
            why = probe.reason or f"no {DEVICE_RECORD} in {probe_dir} (is it on a file system the nodes share?)"
            raise RunFailed(f"batch {size}: rank 0 did not report its device, so the memory to fit in is unknown: {why}")
        if limit_gb == "same":
            self.probes.append(probe)
        else:
            self.need = probe
        self.save(None)
        return probe

    def tell_units(self, probe_dir: Path) -> None:
        """The FSDP units, once a search, from the first probe that built the model: every
        probe shards it alike, and a probe's own lines stay in its rank logs."""
        if self.units_told:
            return
        summary = Summary.read(probe_dir)
        units = summary.fsdp_units if summary is not None else None
        if units:
            log.info("%s", units_line(units, rank_log_path(probe_dir, 0)))
            self.units_told = True

    def estimated_peak_under_limit_gb(self, size: int) -> float | None:
        curve = prior(self.estimated)
        return curve.peak_gb(size) if curve else None

    def learn_device(self, *probes: Probe) -> None:
        """Rank 0's environment record, from the first probe whose rank 0 wrote one: the
        run's own (device.json, and the environment of summary.json and wandb), and without
        memory.limit_gb the limit, all of rank 0's device."""
        if self.device_seen:
            return
        for probe in [*self.probes, *probes]:
            self.device_seen = read_device_record(self.run_dir / probe.dir) if probe.dir else {}
            if self.device_seen:
                break
        else:
            return
        write_device_record(self.run_dir, self.device_seen)
        self.context.environment.update(self.device_seen)
        if self.limit_gb is None:
            self.limit_gb = self.allocator_room_gb([*self.probes, *probes])

    def allocator_room_gb(self, probes: list[Probe]) -> float:
        """Without memory.limit_gb, the memory to fit in: what rank 0's GPU holds, less what the
        first probe's ranks held outside the allocator (the CUDA context, NCCL, cuBLAS), which
        the allocator can never get; all of it where no probe said (one that failed first)."""
        device_gb = self.device_seen["device_memory_gb"]
        outside = next((p.outside_allocator_gb for p in probes if p.outside_allocator_gb is not None), None)
        if outside is None:
            return device_gb
        log.info("the memory to fit in: rank 0's GPU holds %.2f GB, %.2f GB of it outside the caching allocator "
                 "(the CUDA context, NCCL, cuBLAS): %.2f GB", device_gb, outside, device_gb - outside)
        return device_gb - outside

    def probe_dirs(self) -> list[Path]:
        return sorted(p for p in (self.run_dir / "probes").glob("*_b*") if p.is_dir())

    def recorded_probes(self) -> list[Probe]:
        """The probes an earlier run into this directory recorded, when its setup was this one.
        A record of another setup, or one that cannot be read, is kept beside it, not reused."""
        path = self.run_dir / RECORD
        if not path.is_file():
            return []
        earlier = MaxBatchRecord.read(self.run_dir)
        if earlier is None:
            kept = unused_path(path.with_name("max_batch.unreadable.json"))
            path.replace(kept)
            log.warning("%s could not be read: kept as %s, not reused", path.name, kept.name)
            return []
        if earlier.fingerprint != self.fingerprint:
            kept = unused_path(path.with_name(f"max_batch.{earlier.fingerprint or 'earlier'}.json"))
            path.replace(kept)
            log.warning("%s was recorded for another setup: kept as %s, not reused", path.name, kept.name)
            return []
        probes = [Probe.from_json(p) for p in earlier.probes]
        if self.limit_gb is None:  # the device's memory then, should its probes not say it
            self.limit_gb = earlier.limit_gb
        self.estimated = earlier.estimate if self.cfg.task.estimate else None
        self.verification = Verification.from_json(earlier.verification, self.verification.length())
        self.probes_before_verifying = earlier.probes_before_verifying
        if earlier.smallest_batch_need_probe:
            self.need = Probe.from_json(earlier.smallest_batch_need_probe)
        if probes:
            log.info("reusing %d probe(s) recorded in %s", len(probes), path)
        return probes

    def measure_need(self) -> None:
        """None fits. What the smallest size needs is a result: a probe at it that trained
        within the noise band says it; after one that ran out of memory, one more probe under
        all the memory this device gives each rank measures it. Any other failure is an error."""
        small = self.too_small()
        if small and len(small) == len([p for p in self.probes if not p.killed]):
            tried = ", ".join(str(p.batch_size) for p in small[1:])
            raise RunFailed(f"batch {small[0].batch_size} does not train: {small[0].reason}"
                            + (f" (nor does batch {tried}, for a reason other than memory)" if tried else ""))
        size = self.searched_from()
        tried = [p for p in self.probes if p.batch_size == size and not p.killed]
        failed = next((p for p in tried if p.status == "failed"), None)
        if failed is not None:
            raise RunFailed(f"batch {size} does not train: {failed.reason}")
        if any(p.status == "ok" for p in tried) or self.need is not None or self.cfg.memory.limit_gb is None:
            return  # already measured, or it ran out of the device's own memory: nothing more to give it
        log.info("batch %d ran out of memory under %s; measuring what it needs without that limit", size,
                 f"memory.limit_gb={self.cfg.memory.limit_gb:g}" if self.cfg.memory.limit_gb else "the device's memory")
        machine_gb = self.device_seen.get("device_memory_gb") or device_memory_gb(self.cfg.device)
        share_gb = None if self.cfg.device == "cuda" else machine_gb / self.nproc
        need = self.probe(size, limit_gb=share_gb)
        if need.status == "failed":
            raise RunFailed(f"batch {size} runs out of memory under memory.limit_gb, and without it: {need.reason}")

    def smallest_batch_needs_gb(self) -> float | None:
        size = self.searched_from()
        peaks = [p.limited_peak_gb() for p in [*self.probes, self.need] if p is not None and p.batch_size == size
                 and p.status == "ok" and not p.killed]
        return max((p for p in peaks if p is not None), default=None)

    def save(self, boundary: int | None) -> MaxBatchRecord:
        """max_batch.json, rewritten whole after every probe, so no probe is ever lost;
        `boundary`: the answer, once verified."""
        settings = self.cfg.task
        noise = self.noise_gb()
        outcomes = self.outcomes()
        model = fit_memory(outcomes)
        for probe in self.probes:
            probe.predicted_peak_gb = model.peak_gb(probe.batch_size) if model else None
            probe.set_estimate(self.estimated_peak_under_limit_gb(probe.batch_size))
            probe.margin_gb = margin_gb(probe, self.room_gb())
            probe.within_noise = probe.status == "ok" and not fits_with_room(probe, self.room_gb(), noise)
        # The peak the search judges by (Probe.judged_peak_gb): allocated on GPU, not reserved.
        measure = "peak_under_limit_gb" if any(p.peak_under_limit_gb is not None and not p.on_gpu()
                                               for p in self.probes) else PEAK_GB
        _, hi = self.search().bracket(outcomes)
        verified = self.verification.completed()
        at_max = verified if verified is not None and verified.batch_size == boundary else \
            next((p for p in reversed(self.probes) if boundary and p.batch_size == boundary and p.status == "ok"), None)
        searched = self.boundary() if boundary is not None else None
        past = {p.status for p in self.probes if p.batch_size == hi and not p.killed}
        timed = [*self.probes, *([verified] if verified is not None and not verified.as_command else [])]
        fastest_size, fastest_speed, near_fastest = fastest(timed, boundary) if boundary else (None,) * 3
        margin = max(settings.margin, noise / self.limit_gb)
        length = self.held_beyond()
        beyond = length.counted_gb() if length else 0.0
        recommended = boundary and recommended_size(model, (1 - margin) * self.limit_gb - beyond, margin,
                                                    boundary, settings.resolution)
        record = MaxBatchRecord(
            setup=setup_line(self.context),
            device=self.cfg.device.value,
            device_name=self.device_seen.get("device"),
            world_size=self.nproc,
            limit_gb=self.limit_gb,
            resolution=settings.resolution,
            margin=settings.margin,
            search_up_to=settings.search_up_to,
            steps_per_probe=settings.steps_per_probe,
            max_batch_size=boundary,
            searched_max_batch_size=searched,
            verification=self.verification.to_json(),
            length_check=length.to_json() if length else None,
            run_beyond_probe_gb=length.counted_gb() if length else None,
            recommended_batch_size=recommended,
            recommended_keeps_margin=bool(recommended) and (
                model is None or model.peak_gb(recommended) + beyond <= (1 - margin) * self.limit_gb + 1e-9),
            bounded_by=None if boundary is None else "verification" if searched and boundary < searched else (
                ("data" if self.up_to() < settings.search_up_to else "search_up_to") if not past
                else "oom" if "oom" in past else "failed" if "failed" in past else "noise"),
            data_share_per_rank=self.data_share,
            searched_from=self.searched_from(),
            too_small_to_train=[{"batch_size": p.batch_size, "reason": p.reason} for p in self.too_small()],
            noise_band_gb=noise,
            noise_band_samples=noise / model.slope_gb_per_sample if model and model.slope_gb_per_sample > 0 else None,
            peak_under_limit_gb=at_max.limited_peak_gb() if at_max else None,
            peak_mem_gb=at_max.peak_mem_gb if at_max else None,
            peak_mem_gb_per_rank=at_max.peak_mem_gb_per_rank if at_max else None,
            alloc_retries=at_max.alloc_retries if at_max else None,
            samples_per_s=at_max.samples_per_s if at_max else None,
            fastest_batch_size=fastest_size,
            fastest_samples_per_s=fastest_speed,
            near_fastest_batch_size=near_fastest,
            smallest_batch_needs_gb=self.smallest_batch_needs_gb() if boundary == 0 else None,
            memory_model=None if model is None else {
                "intercept_gb": model.intercept_gb, "slope_gb_per_sample": model.slope_gb_per_sample,
                "points": model.points, "measure": measure},
            estimate=self.estimated,
            probes=[p.to_json() for p in self.probes],
            smallest_batch_need_probe=self.need.to_json() if self.need else None,
            probe_count=len(self.probes),
            probes_before_verifying=self.probes_before_verifying,
            probes_reused=self.reused,
            wall_s=time.perf_counter() - self.start,
            probe_wall_s=sum(p.wall_s for p in self.probes) + (self.need.wall_s if self.need else 0.0),
            estimate_wall_s=(self.estimated or {}).get("wall_s"),
            verify_wall_s=self.commands_wall_s(),
            fingerprint=self.fingerprint,
        )
        record.write(self.run_dir)
        return record


def unused_path(path: Path) -> Path:
    """`path`, or where it is taken, the first free one of its name with .2, .3, ... before its suffix."""
    n, free = 1, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.stem}.{n}{path.suffix}")
    return free
