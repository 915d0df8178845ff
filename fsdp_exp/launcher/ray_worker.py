"""launcher=ray, in each worker: one rank of the run in Ray Train's worker, and the thread
that reports the run's checkpoints to Ray Train (fsdp_exp.launcher.ray starts them).

How it works, and why: docs/clusters.md, "Ray Train: how the launcher works".
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.checkpoint.files import LATEST, METADATA, latest, step_name
from fsdp_exp.errors import one_line
from fsdp_exp.launcher.core import POLL_S
from fsdp_exp.launcher.tail import NewLines
from fsdp_exp.metrics.sinks import METRICS
from fsdp_exp.rank.worker import RankJob, rank_variables

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

UPLOAD_DIR = ".ray_upload"  # in checkpoint.dir: the hard-linked snapshot Ray uploads, removed after
ATTEMPTS_FILE = "fsdp_exp_attempts"  # in Ray's directory of the run: one line per start of rank 0


def _train_loop(config: dict) -> Any:
    """Ray Train's train_loop_per_worker (in a thread of each worker process)."""
    return config["job"]()


@dataclass
class RayJob(RankJob):
    """What each Ray Train worker runs: one rank of the run (Ray pickles it to the workers)."""

    ray_dir: str | None = None  # Ray's directory of this run, when it is a local path

    def __call__(self) -> Any:
        import ray.train

        context = ray.train.get_context()
        rank = context.get_world_rank()
        device = trains_on(self.cfg.device)
        restored = ray.train.get_checkpoint()
        os.environ.update(worker_variables(
            context, device, restarts=self.count_start(restored) if rank == 0 else 0,
            restored=restored_path(restored, self.cfg.checkpoint.dir_for(Path(self.run_dir)), rank)
            if restored is not None else None))
        reporter = Reporter(rank, self.cfg, Path(self.run_dir))

        def task(cfg: Experiment, run_dir: Path) -> Any:
            quiet = QuietRay()  # on the handlers run_rank has just set up
            for handler in logging.getLogger().handlers:
                handler.addFilter(quiet)
            reporter.start()
            return self.task(cfg, run_dir)

        result = self.run_rank(task)
        reporter.finish()
        ray.train.report(json_safe(result) if isinstance(result, dict) else {})
        return result

    def count_start(self, restored: Any) -> int:
        """Rank 0: the starts of the worker group before this one, counted in Ray's directory
        of the run (without a local one: 1 after a restart from a checkpoint, else 0)."""
        if self.ray_dir is None:
            return int(restored is not None)
        path = Path(self.ray_dir) / ATTEMPTS_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a+") as f:
                f.seek(0)
                before = len(f.read().splitlines())
                f.write(f"{os.getpid()}\n")
            return before
        except OSError:
            return int(restored is not None)


def trains_on(device: str) -> Any:
    """The GPU Ray Train gave this worker (`device=cuda`); None on CPU."""
    if device == "cuda":
        import ray.train.torch

        return ray.train.torch.get_device()
    return None


def worker_variables(context: Any, device: Any = None, restarts: int = 0, restored: str | None = None) -> dict[str, str]:
    """What a worker's rank reads from its environment, from Ray Train's context and, on
    GPUs, the device Ray Train gave the worker."""
    return rank_variables(context.get_world_rank(), context.get_local_rank(), context.get_world_size(),
                          context.get_local_world_size(), device=None if device is None else str(device),
                          restarts=restarts, restored=restored)


class QuietRay(logging.Filter):
    """Keeps Ray's own INFO lines (one per report, from loggers outside the `ray` tree) out
    of the rank's log and console; its warnings and errors stay."""

    def __init__(self) -> None:
        super().__init__()
        import ray

        self.package = os.path.dirname(ray.__file__) + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(self.package)


def restored_path(checkpoint: Any, checkpoint_dir: Path | None, rank: int) -> str:
    """Where the ranks read Ray's checkpoint: its own path on a local (or mounted) file
    system; from remote storage, rank 0 first downloads it into checkpoint.dir, which every
    rank reads (train_rank takes rank 0's `resume` on every rank)."""
    filesystem = getattr(checkpoint, "filesystem", None)
    if filesystem is None or filesystem.type_name == "local":
        return str(checkpoint.path)
    assert checkpoint_dir is not None, "Ray holds checkpoints only of a run that saves them"
    target = checkpoint_dir / ".ray_restored" / Path(checkpoint.path).name
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        checkpoint.to_directory(str(target))
    return str(target)


def json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def step_of(path: Path | None) -> int:
    """The step of a checkpoint directory named step_<N>; -1 for none."""
    match = re.fullmatch(r"step_(\d+)", path.name) if path is not None else None
    return int(match.group(1)) if match else -1


class Reporter:
    """In each worker, beside training: `ray.train.report` of each newer checkpoint rank 0
    has committed, so a restart starts from what the run last saved.

    Ray takes one report at a time from each worker: a report waits until Ray's controller
    has taken the one before (it looks every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s), and a
    report is a barrier that every rank must reach equally often. So there is no list of
    steps fixed in advance: in each round rank 0 names the newest checkpoint committed since
    its last report (once its record is in metrics.jsonl), every rank learns it from rank
    0's broadcast, and they report it together. A checkpoint that training outran is left
    out of Ray's list (it stays in checkpoint.dir), so Ray's latest is at most one round
    behind the latest on disk. When the task has returned, rank 0 names the last one left,
    then None, which ends the rounds. A report that fails ends the thread; `finish` then
    raises it.
    """

    def __init__(self, rank: int, cfg: Experiment, run_dir: Path):
        self.rank = rank
        steps, log_every, ckpt = cfg.train.steps, cfg.train.log_every, cfg.checkpoint
        self.root = ckpt.dir_for(run_dir)
        self.reported = 0
        self.logged = lambda step: step % log_every == 0 or step == steps
        # An earlier attempt's `latest` names a checkpoint this attempt will write again:
        # only one committed by this attempt (the marker replaced since) is reported.
        self.marker_before = marker(self.root)
        self.metrics = run_dir / METRICS
        self.new_records = NewLines(self.metrics, size(self.metrics))  # not earlier attempts' records
        self.records: dict[int, dict] = {}
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self.root is None:
            return
        self.thread = threading.Thread(target=self.run, name="fsdp_exp-ray-report", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """After the task returned: report the checkpoint left, and wait for the reports."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        if self.root is not None and self.rank == 0:
            shutil.rmtree(self.root / UPLOAD_DIR, ignore_errors=True)
        if self.error is not None:
            raise RuntimeError(f"reporting to Ray Train failed: {type(self.error).__name__}: "
                               f"{one_line(self.error)}") from self.error

    def run(self) -> None:
        import ray.train
        from ray.train.collective import broadcast_from_rank_zero

        try:
            while True:
                step = broadcast_from_rank_zero(self.next_step() if self.rank == 0 else None)
                if step is None:
                    return
                if self.rank != 0:
                    ray.train.report({})
                    continue
                snapshot = self.snapshot(step)
                metrics = {**self.record(step), "step": step}
                if snapshot is None:  # pruned meanwhile
                    ray.train.report(metrics)
                else:
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(snapshot)),
                                     checkpoint_dir_name=step_name(step), delete_local_checkpoint_after_upload=True)
                self.reported = step
        except BaseException as err:  # raised again by finish()
            self.error = err
            logging.getLogger("fsdp_exp.rank_file").exception("reporting to Ray Train failed")

    def next_step(self) -> int | None:
        """Rank 0: the step of the newest checkpoint to report, once there is one; None once
        the task has returned and none is left."""
        while True:
            ended = self.done.is_set()  # read first: a checkpoint committed before it is seen below
            step = self.newest()
            if step is not None:
                return step
            if ended:
                return None
            self.done.wait(POLL_S)

    def newest(self) -> int | None:
        """The step of the newest checkpoint committed by this attempt and not reported yet,
        once its record (if it logs one) is in metrics.jsonl."""
        assert self.root is not None
        if marker(self.root) == self.marker_before:
            return None
        step = step_of(latest(self.root))
        if step <= self.reported:
            return None
        if self.logged(step) and self.record(step).get("step") != step and not self.done.is_set():
            return None
        return step

    def record(self, step: int) -> dict:
        """Rank 0's latest record up to `step` in metrics.jsonl (written by this attempt), or {}."""
        for text in self.new_records.read():
            try:
                record = json.loads(text)
            except ValueError:
                continue
            if isinstance(record, dict) and "event" not in record and isinstance(record.get("step"), int):
                self.records[record["step"]] = record
        below = [s for s in self.records if s <= step]
        return self.records[max(below)] if below else {}

    def snapshot(self, step: int) -> Path | None:
        """A hard-linked copy of the committed checkpoint of `step` (a real copy where links
        fail), which Ray uploads and then deletes; None when it is not there."""
        assert self.root is not None
        source = self.root / step_name(step)
        if step_of(latest(self.root)) < step or not (source / METADATA).is_file():
            return None
        target = self.root / UPLOAD_DIR / step_name(step)
        shutil.rmtree(target, ignore_errors=True)
        try:
            shutil.copytree(source, target, copy_function=link_or_copy)
        except (OSError, shutil.Error):  # pruned meanwhile
            shutil.rmtree(target, ignore_errors=True)
            return None
        return target


def marker(root: Path | None) -> tuple[int, int] | None:
    """Which `latest` marker is in `root` (it is replaced whole at each commit), or None."""
    try:
        stat = (root / LATEST).stat() if root is not None else None
    except OSError:
        return None
    return None if stat is None else (stat.st_ino, stat.st_mtime_ns)


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
