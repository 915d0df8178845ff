"""task=max_batch: the largest per-rank batch that trains within the memory limit.

The driver runs probes (fresh launches of all ranks, `fsdp_exp.tasks.probe`) at the batch
sizes `BatchSearch` picks, records each one in max_batch.json as soon as it ends, and
reuses the recorded probes when it is run again into the same run directory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.errors import ConfigError
from fsdp_exp.launch import RunFailed
from fsdp_exp.memory import device_memory_gb
from fsdp_exp.tasks.batch_search import BatchSearch, fit_memory, recommended_size
from fsdp_exp.tasks.probe import Probe, fingerprint, run_probe

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

log = logging.getLogger("fsdp_exp")

RECORD = "max_batch.json"


@dataclass
class MaxBatchSettings:
    """max_batch.*: how task=max_batch searches."""

    steps_per_probe: int = 3  # optimizer steps per probe; at least 2, so optimizer state counts
    probe_timeout: float = 600  # seconds; a probe past it is killed and recorded as failed
    resolution: int = 1  # the answer is exact to this; every probed size is a multiple of it
    margin: float = 0.1  # the recommended size keeps this share of the memory limit free
    search_up_to: int = 4096  # the largest batch size tried

    def __post_init__(self) -> None:
        if self.steps_per_probe < 2:
            raise ConfigError(f"max_batch.steps_per_probe={self.steps_per_probe}: must be at least 2 "
                              "(the second step holds the optimizer state the first one made)")
        if self.probe_timeout <= 0:
            raise ConfigError(f"max_batch.probe_timeout={self.probe_timeout}: must be greater than 0 (seconds)")
        if self.resolution < 1:
            raise ConfigError(f"max_batch.resolution={self.resolution}: must be at least 1")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"max_batch.margin={self.margin}: must be at least 0 and below 1")
        if self.search_up_to < self.resolution:
            raise ConfigError(f"max_batch.search_up_to={self.search_up_to}: must be at least "
                              f"max_batch.resolution={self.resolution}")


@dataclass
class MaxBatch:
    def check(self, exp: Experiment) -> None:
        """Refuse what the search cannot do, before any probe starts."""
        if exp.device == "cpu" and exp.memory.limit_gb is None:
            raise ConfigError(
                "memory.limit_gb: task=max_batch on CPU needs a per-rank limit to fit in "
                "(without one the boundary is the machine's RAM and the kernel's OOM killer)"
            )
        if exp.train.grad_accum != 1:
            raise ConfigError(
                f"train.grad_accum={exp.train.grad_accum}: task=max_batch searches the batch "
                "of one forward and backward; set train.grad_accum=1"
            )
        if not exp.launcher.starts_all_ranks:
            raise ConfigError(
                f"launcher.nnodes={exp.launcher.nnodes}: with launcher=torchrun each node's command would search "
                "on its own; search on one node, or with launcher=slurm or ray, whose one command starts every probe")
        if exp.launcher.restarts:
            key = exp.launcher.restarts_key
            raise ConfigError(
                f"{key}={exp.launcher.restarts}: task=max_batch needs every probe "
                f"to fail when it runs out of memory, not to restart; set {key}=0")
        if exp.resume:
            raise ConfigError(f"resume={exp.resume}: task=max_batch starts every probe fresh; "
                              "resume is for task=train")

    def run(self, exp: Experiment, run_dir: Path, launcher: Any, nproc: int) -> dict:
        return Sweep(exp, run_dir, launcher, nproc).run()


@dataclass
class Sweep:
    cfg: Experiment
    run_dir: Path
    launcher: Any
    nproc: int

    def __post_init__(self) -> None:
        settings = self.cfg.max_batch
        self.steps = settings.steps_per_probe
        self.timeout_s = settings.probe_timeout
        self.limit_gb = self.cfg.memory.limit_gb or device_memory_gb(self.cfg.device)
        self.search = BatchSearch(self.limit_gb, settings.resolution, settings.search_up_to)
        self.fingerprint = fingerprint(self.cfg, self.nproc, self.steps)
        self.probes: list[Probe] = []
        self.need: Probe | None = None  # batch 1 without the limit, when it did not fit under it
        self.reused = 0
        self.start = time.perf_counter()

    def run(self) -> dict:
        self.probes = self.recorded_probes()
        self.reused = len(self.probes)
        while (size := self.search.next_size(self.outcomes())) is not None:
            probe = self.probe(size)
            if probe.killed:  # stopped from outside: the batch may well fit; try it once more
                log.warning("batch %d was killed from outside; trying it once more", size)
                retry = self.probe(size)
                retry.killed = False  # a second kill counts as a failure at this size
                self.save(None)
        lo, _ = self.search.bracket(self.outcomes())
        if lo == 0:
            self.save(None)
            raise RunFailed(self.first_size_does_not_fit())
        record = self.save(lo)
        self.report(record)
        return summary_figures(record)

    def outcomes(self) -> list:
        return [p.outcome() for p in self.probes if not p.killed]

    def probe(self, size: int, limit_gb: Any = "same") -> Probe:
        probe_dir = self.run_dir / "probes" / f"{len(self.probe_dirs()) + 1:02d}_b{size}"
        probe = run_probe(self.cfg, size, probe_dir, self.launcher, self.nproc, self.steps, self.timeout_s, limit_gb)
        log.info("probe %d: %s", len(self.probe_dirs()), probe.line())
        if limit_gb == "same":
            self.probes.append(probe)
        else:
            self.need = probe
        self.save(None)
        return probe

    def probe_dirs(self) -> list[Path]:
        return sorted(p for p in (self.run_dir / "probes").glob("*_b*") if p.is_dir())

    def recorded_probes(self) -> list[Probe]:
        """The probes an earlier run into this directory recorded, when its setup was this one."""
        path = self.run_dir / RECORD
        if not path.is_file():
            return []
        earlier = json.loads(path.read_text())
        if earlier.get("fingerprint") != self.fingerprint:
            kept = path.with_name(f"max_batch.{earlier.get('fingerprint', 'earlier')}.json")
            path.replace(kept)
            log.warning("%s was recorded for another setup: kept as %s, not reused", path.name, kept.name)
            return []
        probes = [Probe.from_json(p) for p in earlier.get("probes", [])]
        if probes:
            log.info("reusing %d probe(s) recorded in %s", len(probes), path)
        return probes

    def first_size_does_not_fit(self) -> str:
        """Why not even the smallest batch trains; for an OOM under a limit, what it needs."""
        first = self.probes[0]
        size = first.batch_size
        limit = self.cfg.memory.limit_gb
        if first.status != "oom" or limit is None:
            return f"batch {size} does not train: {first.reason}"
        log.info("batch %d ran out of memory under memory.limit_gb=%g; measuring its need without the limit",
                 size, limit)
        need = self.probe(size, limit_gb=None)
        if need.status != "ok":
            return f"memory.limit_gb={limit:g}: batch {size} does not fit, and without the limit: {need.reason}"
        return (f"memory.limit_gb={limit:g}: below what batch {size} needs "
                f"({need.peak_mem_gb:.2f} GB per rank, measured without the limit); raise it")

    def save(self, boundary: int | None) -> dict:
        """max_batch.json, rewritten whole after every probe, so no probe is ever lost."""
        settings = self.cfg.max_batch
        model = fit_memory(self.outcomes())
        for probe in self.probes:
            probe.predicted_peak_gb = model.peak_gb(probe.batch_size) if model else None
        measure = next((m for m in ("peak_under_limit_gb", "peak_reserved_gb", "peak_mem_gb")
                        if any(getattr(p, m) is not None for p in self.probes)), "peak_mem_gb")
        _, hi = self.search.bracket(self.outcomes())
        at_max = next((p for p in reversed(self.probes) if p.batch_size == boundary and p.status == "ok"), None)
        after = next((p for p in self.probes if p.batch_size == hi), None)
        record = {
            "setup": setup_line(self.cfg),
            "device": self.cfg.device.value,
            "world_size": self.nproc,
            "limit_gb": self.limit_gb,
            **{k: getattr(settings, k) for k in ("resolution", "margin", "search_up_to", "steps_per_probe")},
            "max_batch_size": boundary,
            "recommended_batch_size": boundary and recommended_size(
                model, self.limit_gb, settings.margin, boundary, settings.resolution),
            "bounded_by": None if boundary is None else ("search_up_to" if after is None else after.status),
            "samples_per_s": at_max.samples_per_s if at_max else None,
            "peak_mem_gb": at_max.peak_mem_gb if at_max else None,
            "peak_mem_gb_per_rank": at_max.peak_mem_gb_per_rank if at_max else None,
            "memory_model": None if model is None else {
                "intercept_gb": model.intercept_gb, "slope_gb_per_sample": model.slope_gb_per_sample,
                "points": model.points, "measure": measure},
            "probes": [p.to_json() for p in self.probes],
            "need_without_limit": self.need.to_json() if self.need else None,
            "probe_count": len(self.probes),
            "probes_reused": self.reused,
            "wall_s": time.perf_counter() - self.start,  # this run's, after any reused probes
            "probe_wall_s": sum(p.wall_s for p in self.probes) + (self.need.wall_s if self.need else 0.0),
            "fingerprint": self.fingerprint,
        }
        path = self.run_dir / RECORD
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)
        return record

    def report(self, record: dict) -> None:
        """max_batch.png, wandb, and the answer in one line."""
        from fsdp_exp.metrics.plots import plot_max_batch

        png = self.run_dir / "max_batch.png"
        plot_max_batch(record, png)
        log_to_wandb(self.cfg, self.run_dir, record, png)
        log.info("%s", answer_line(record, self.cfg.memory.limit_gb) + f" -> {self.run_dir / RECORD}")


def answer_line(record: dict, limit_gb: float | None) -> str:
    size, ranks = record["max_batch_size"], record["world_size"]
    under = f"memory.limit_gb={limit_gb:g}" if limit_gb else f"the device's {record['limit_gb']:.0f} GB"
    if record["bounded_by"] == "search_up_to":
        why = f"fits at max_batch.search_up_to={record['search_up_to']} under {under}"
    else:
        why = f"{size + record['resolution']} {'ran out of memory' if record['bounded_by'] == 'oom' else 'failed'} under {under}"
    speed = f"{record['samples_per_s']:,.1f} samples/s" if record["samples_per_s"] else "no throughput"
    return (f"max batch: {size} per rank on {ranks} rank(s) ({why}); recommended {record['recommended_batch_size']} "
            f"({record['margin']:.0%} margin); {speed} at {size}; {record['probe_count']} probes, "
            f"{record['probe_wall_s']:.0f} s of probing")


def setup_line(cfg: Experiment) -> str:
    overrides = [o for o in cfg.environment.get("overrides", []) if not o.startswith(("task=", "hydra."))]
    return " ".join(overrides) or "defaults"


def summary_figures(record: dict) -> dict:
    keys = ("max_batch_size", "recommended_batch_size", "bounded_by", "samples_per_s", "peak_mem_gb",
            "peak_mem_gb_per_rank", "limit_gb", "world_size")
    return {"task": "max_batch", **{k: record[k] for k in keys}, "probes": record["probe_count"]}


def log_to_wandb(cfg: Experiment, run_dir: Path, record: dict, png: Path) -> None:
    """The probes as a wandb table, the plot as an image, the answer in the run summary."""
    from fsdp_exp.config import as_dict

    sink = cfg.wandb.sink(as_dict(cfg), run_dir)
    if sink.run is None:
        return
    import wandb

    columns = ["batch_size", "status", "peak_mem_gb", "predicted_peak_gb", "samples_per_s", "wall_s", "reason"]
    table = wandb.Table(columns=columns, data=[[p[c] for c in columns] for p in record["probes"]])
    sink.run.log({"probes": table, "max_batch": wandb.Image(str(png))})
    sink.finish(summary_figures(record))
