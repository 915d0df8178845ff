"""launcher=ray: the ranks as the workers of one Ray Train run (`TorchTrainer`).

    python -m fsdp_exp launcher=ray                          # a local Ray, started here
    python -m fsdp_exp launcher=ray launcher.address=auto    # join the cluster of this node

How it works, and why: docs/clusters.md, "Ray Train: how the launcher works".
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.checkpoint.files import METADATA, TRAIN_STATE, latest, step_name
from fsdp_exp.errors import ConfigError, at_least, one_line
from fsdp_exp.launch.core import (
    POLL_S,
    Echo,
    RankOutcome,
    RunFailed,
    alongside,
    explain,
    missing_extra,
    watch,
)
from fsdp_exp.launch.tail import NewLines
from fsdp_exp.rank.worker import rank_log_path, rank_variables, run_rank

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

log = logging.getLogger("fsdp_exp")

PROCESS_GROUP_TIMEOUT_S = 600  # as fsdp_exp.rank.distributed.init's
UPLOAD_DIR = ".ray_upload"  # in checkpoint.dir: the hard-linked snapshot Ray uploads, removed after
ATTEMPTS_FILE = "fsdp_exp_attempts"  # in Ray's directory of the run: one line per start of rank 0
TRAIN_EXTRA = ("pandas", "pyarrow", "fsspec")  # what ray[train] adds to ray, found without importing


@dataclass
class RayLauncher:
    num_workers: int = 2  # the world size: one rank per Ray Train worker
    use_gpu: bool = False  # true: one GPU per worker (nccl); false: CPU workers (gloo)
    # What Ray reserves for each worker (with use_gpu, GPU: 1 is added); CPU is also each
    # worker's torch threads (Ray sets OMP_NUM_THREADS to it).
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    address: str | None = None  # None: start a local Ray, kept for the whole command; "auto": this node's cluster; or host:port
    storage_path: str | None = None  # Ray's storage (its copies of the checkpoints), a path or a URI; None: <run_dir>/ray
    max_failures: int = 0  # after a worker fails, Ray restarts all workers this many times (from the latest checkpoint)
    start_timeout: int = 60  # seconds to join the cluster at `address` before a clear error
    max_parallel: int = 4  # a sweep's runs on the cluster at once, each with its own workers (1: one after another)
    starts_all_ranks = True
    restarts_key = "launcher.max_failures"

    def __post_init__(self) -> None:
        at_least("launcher.num_workers", self.num_workers, 1)
        at_least("launcher.max_failures", self.max_failures, 0)
        at_least("launcher.max_parallel", self.max_parallel, 1)
        if self.start_timeout < 1:
            raise ConfigError(f"launcher.start_timeout={self.start_timeout}: must be at least 1 (seconds)")
        for name, amount in dict(self.resources_per_worker or {}).items():
            if amount < 0:
                raise ConfigError(f"launcher.resources_per_worker.{name}={amount}: must be at least 0")

    @property
    def restarts(self) -> int:
        return self.max_failures

    @property
    def runs_here(self) -> bool:
        return self.address is None

    def gpus(self, local_gpus: int) -> int:
        return self.num_workers if self.use_gpu else 0

    def connect(self, nproc: int, at_once: int) -> None:
        """Start or join Ray for `at_once` runs of `nproc` workers, from this (the main)
        thread. A local Ray is sized for all of them; one that is running is kept, since
        runs may be in flight on it."""
        self.check()
        cpus = float(dict(self.resources_per_worker or {}).get("CPU", 1.0))
        connect(self.address, self.start_timeout, at_once * nproc * cpus, keep=True)

    def world_size(self, gpus: int) -> int:
        """`num_workers`. Also the checks of what this machine must have, since the
        driver calls it before any run."""
        self.check()
        return self.num_workers

    def check(self) -> None:
        """One ConfigError line for what cannot run. Cheap: ray itself is imported, Ray
        Train (tens of seconds on a small machine) only once a run starts."""
        try:
            import ray  # noqa: F401
        except ImportError:
            raise missing_extra("ray", "ray[train]", "ray") from None
        if any(importlib.util.find_spec(name) is None for name in TRAIN_EXTRA):
            raise missing_extra("ray", "ray[train]", "ray")
        if self.use_gpu and self.address is None:
            import torch

            if torch.cuda.device_count() < self.num_workers:
                raise ConfigError(
                    f"launcher.use_gpu=true: the local Ray (launcher.address=null) has this machine's "
                    f"{torch.cuda.device_count()} GPU(s), fewer than launcher.num_workers={self.num_workers}")

    # ---- the driver ------------------------------------------------------------------------
    def launch(self, task: Callable[[dict, Path], Any], cfg: dict, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any:
        """Run `task(cfg, run_dir)` on `nproc` Ray Train workers; rank 0's return value.

        Blocks until the run ends (Ray's restarts included), echoing rank 0's log lines.
        Raises RunFailed when a rank failed (past `max_failures`), ConfigError when Ray
        cannot be reached or cannot place the workers.
        """
        self.check()
        try:
            from ray.train import (
                CheckpointConfig,
                FailureConfig,
                RunConfig,
                ScalingConfig,
            )
            from ray.train.torch import TorchConfig, TorchTrainer
        except ImportError:
            raise missing_extra("ray", "ray[train]", "ray") from None

        from fsdp_exp.rank.distributed import backend_for

        run_dir = Path(run_dir).resolve()
        resources = {str(k): float(v) for k, v in dict(self.resources_per_worker or {}).items()}
        if alongside.get() is None:  # beside others, `connect` made the session on the main thread
            connect(self.address, self.start_timeout, nproc * resources.get("CPU", 1.0))
        storage = self.storage(run_dir)
        name = f"fsdp_exp-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        ckpt = cfg.checkpoint
        job = RayJob(task=task, cfg=cfg, run_dir=str(run_dir),
                      time_limit_s=math.ceil(time_limit_s) if time_limit_s else None,
                      ray_dir=None if "://" in storage else str(Path(storage) / name))
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"job": job},
            scaling_config=ScalingConfig(num_workers=nproc, use_gpu=self.use_gpu, resources_per_worker=resources or None),
            torch_config=TorchConfig(backend=backend_for("cuda" if self.use_gpu else "cpu", cfg.offload), timeout_s=PROCESS_GROUP_TIMEOUT_S),
            run_config=RunConfig(
                name=name,
                storage_path=storage,
                failure_config=FailureConfig(max_failures=self.max_failures, controller_failure_limit=0),
                checkpoint_config=CheckpointConfig(num_to_keep=ckpt.keep if ckpt.saves else None),
            ),
        )
        starts = Starts(run_dir, nproc)
        result, error, stopped = fit(trainer, starts, time_limit_s)
        if stopped:
            raise explain([RankOutcome(0, signal="SIGKILL", started=starts.first())], run_dir, time_limit_s,
                          stopped_for_time=True)
        if error is None:
            return result.return_value
        raise failure(error, run_dir, time_limit_s, starts.since_launch(), nproc, resources)

    def storage(self, run_dir: Path) -> str:
        """Ray's storage: `storage_path` (a path, or a URI such as s3://...), or <run_dir>/ray."""
        if self.storage_path is None:
            return str(run_dir / "ray")
        if "://" in self.storage_path:
            return self.storage_path
        return str(Path(self.storage_path).expanduser().resolve())


_session: dict = {}  # the Ray session this module started or joined: {"address": ...}


def _exit_before_ray_teardown() -> None:
    """End a process whose join of a Ray cluster never answered, with the run's failure,
    before the interpreter's teardown: Ray's client, still connecting in its thread, can
    abort the process there (std::bad_alloc) and turn the exit code 1 into a signal."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def connect(address: str | None, start_timeout: float, cpus: float, keep: bool = False) -> None:
    """Start a local Ray (address None) or join a cluster, unless this process already is
    connected as asked; at most `start_timeout` seconds to join. `keep`: a session at the
    same address is kept even when it has fewer CPUs than asked for."""
    import ray

    if ray.is_initialized():
        if not _session:
            return  # connected by someone else in this process (e.g. a notebook): use that
        if _session["address"] == address and (
                keep or address is not None or ray.cluster_resources().get("CPU", 0) >= cpus):
            return
        ray.shutdown()
        _session.clear()
    options: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address is None:
        # In this thread: a local start from another thread can deadlock.
        try:
            ray.init(address="local", num_cpus=max(math.ceil(cpus), os.cpu_count() or 1),
                     include_dashboard=False, **options)  # "local": even when RAY_ADDRESS is set
        except Exception as err:  # noqa: BLE001 - any failure to start is one line
            raise ConfigError(f"launcher.address=null: could not start a local Ray: {one_line(err)}") from None
        _session["address"] = None
        return
    joiner, outcome = in_thread(lambda: ray.init(address=address, **options), "fsdp_exp-ray-connect")
    joiner.join(start_timeout)
    if joiner.is_alive():
        atexit.register(_exit_before_ray_teardown)
        raise ConfigError(
            f"launcher.address={address}: no Ray cluster answered within launcher.start_timeout="
            f"{start_timeout:g} s (is it running and reachable? a cluster with token authentication "
            "also needs RAY_AUTH_MODE=token here)")
    if "error" in outcome:
        raise ConfigError(f"launcher.address={address}: could not join a Ray cluster: "
                          f"{one_line(outcome['error'])}") from None
    _session["address"] = address


def in_thread(work: Callable[[], Any], name: str) -> tuple[threading.Thread, dict[str, Any]]:
    """`work()` in a daemon thread, started; the box gets its "result", or the "error" it
    raised, for the caller's thread."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, box


def disconnect() -> None:
    """Leave Ray (a local Ray shuts down): Ray then ends the actors of this process's runs."""
    import ray

    _session.clear()
    with contextlib.suppress(Exception):  # already half gone
        ray.shutdown()


def fit(trainer: Any, starts: Starts, time_limit_s: float | None) -> tuple[Any, BaseException | None, bool]:
    """`trainer.fit()` in a thread, while this one echoes rank 0's lines (`core.watch`):
    (result, error, whether the driver stopped the run for its time limit)."""
    runner, box = in_thread(trainer.fit, "fsdp_exp-ray-fit")

    def done() -> bool:
        starts.poll()
        return not runner.is_alive()

    stopped = watch(done, Echo(starts.logs[0], starts.sizes[0]), starts.first, disconnect, time_limit_s,
                    state=lambda: "running" if starts.first() is not None else "starting its workers")
    return box.get("result"), box.get("error"), stopped


def failure(err: BaseException, run_dir: Path, time_limit_s: float | None, started: list[float],
            nproc: int, resources: dict) -> Exception:
    """The one-line failure that explains the run: `core.explain` of the workers' errors,
    or ConfigError for a cluster that cannot place the workers."""
    failures = getattr(err, "worker_failures", None)
    if not isinstance(failures, dict) or not failures:
        cause = getattr(err, "controller_failure", err)
        if type(cause).__name__ in ("WorkerGroupStartupTimeoutError", "InsufficientClusterResourcesError"):
            return ConfigError(f"launcher=ray: the Ray cluster cannot place {nproc} worker(s) with "
                               f"{resources or {'CPU': 1.0}} each: {one_line(cause)}")
        return RunFailed(f"Ray Train failed: {one_line(cause, named=True)}")
    died = "died: its process ended without an error (killed by a signal, or its node was lost)"
    outcomes = [RankOutcome(rank, signal="signal", started=started[rank], how=died) if process_died(error)
                else RankOutcome(rank, error=one_line(error, named=True, whole=True), started=started[rank])
                for rank, error in failures.items()]
    return explain(outcomes, run_dir, time_limit_s)


def process_died(error: BaseException) -> bool:
    """Whether Ray reports the worker's process as gone, rather than an exception it raised."""
    import ray.exceptions

    return isinstance(error, ray.exceptions.RayActorError) or type(error).__name__ in (
        "WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError")


class Starts:
    """On the driver, from the run directory: when each rank started (its log grew)."""

    def __init__(self, run_dir: Path, nproc: int):
        self.launched = time.time()
        self.logs = [rank_log_path(run_dir, rank) for rank in range(nproc)]
        self.sizes = [size(path) for path in self.logs]
        self.started: list[float | None] = [None] * nproc

    def poll(self) -> None:
        now = time.time()
        for rank, path in enumerate(self.logs):
            if self.started[rank] is None and size(path) > self.sizes[rank]:
                self.started[rank] = now

    def first(self) -> float | None:
        return min((s for s in self.started if s is not None), default=None)

    def since_launch(self) -> list[float]:
        """When each rank started, or the launch for a rank not seen to start."""
        return [s or self.launched for s in self.started]


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# ---- in each worker ------------------------------------------------------------------------
def _train_loop(config: dict) -> Any:
    """Ray Train's train_loop_per_worker (in a thread of each worker process)."""
    return config["job"]()


@dataclass
class RayJob:
    """What each Ray Train worker runs: one rank of the run (Ray pickles it to the workers)."""

    task: Callable[[Any, Path], Any]
    cfg: Experiment
    run_dir: str
    time_limit_s: int | None = None
    ray_dir: str | None = None  # Ray's directory of this run, when it is a local path

    def __call__(self) -> Any:
        import ray.train

        context = ray.train.get_context()
        rank = context.get_world_rank()
        device = None
        if self.cfg.device == "cuda":
            import ray.train.torch

            device = ray.train.torch.get_device()
        restored = ray.train.get_checkpoint()
        os.environ.update(worker_variables(
            context, device, restarts=self.count_start(restored) if rank == 0 else 0,
            restored=restored_path(restored, self.cfg, rank) if restored is not None else None))
        reporter = Reporter(rank, self.cfg, Path(self.run_dir))

        def task(cfg: Experiment, run_dir: Path) -> Any:
            quiet = QuietRay()  # on the handlers run_rank has just set up
            for handler in logging.getLogger().handlers:
                handler.addFilter(quiet)
            reporter.start()
            return self.task(cfg, run_dir)

        result = run_rank(task, self.cfg, self.run_dir, self.time_limit_s)
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


def restored_path(checkpoint: Any, cfg: Experiment, rank: int) -> str:
    """Where the ranks read Ray's checkpoint: its own path on a local (or mounted) file
    system; from remote storage, rank 0 first downloads it into checkpoint.dir, which every
    rank reads (train_rank takes rank 0's `resume` on every rank)."""
    filesystem = getattr(checkpoint, "filesystem", None)
    if filesystem is None or filesystem.type_name == "local":
        return str(checkpoint.path)
    target = Path(cfg.checkpoint.dir) / ".ray_restored" / Path(checkpoint.path).name
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        checkpoint.to_directory(str(target))
    return str(target)


def json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def resume_step(cfg: Experiment) -> int:
    resume = cfg.resume
    if not resume:
        return 0
    try:
        return int(json.loads((Path(resume) / TRAIN_STATE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def step_of(path: Path | None) -> int:
    """The step of a checkpoint directory named step_<N>; -1 for none."""
    match = re.fullmatch(r"step_(\d+)", path.name) if path is not None else None
    return int(match.group(1)) if match else -1


class Reporter:
    """In each worker, beside training: `ray.train.report` at every step of the run at
    which a checkpoint is saved.

    The report is a barrier that every rank must reach equally often: rank 0 broadcasts
    the steps, the other ranks report nothing at each of them (waiting there for rank 0),
    and rank 0 reports each once `latest` has reached it and its record is in
    metrics.jsonl. Once the task has returned, the steps left are reported at once. A
    report that fails ends the thread; `finish` then raises it.
    """

    def __init__(self, rank: int, cfg: Experiment, run_dir: Path):
        self.rank = rank
        steps, log_every, ckpt = cfg.train.steps, cfg.train.log_every, cfg.checkpoint
        self.root = Path(ckpt.dir) if ckpt.saves and ckpt.dir else None
        self.saves: list[int] = []
        self.logged: set[int] = set()
        if self.root is not None:
            left = range(resume_step(cfg) + 1, steps + 1)
            self.saves = [s for s in left if s % ckpt.every == 0 or s == steps]
            self.logged = {s for s in left if s % log_every == 0 or s == steps}
        self.metrics = run_dir / "metrics.jsonl"
        self.new_records = NewLines(self.metrics, size(self.metrics))  # not earlier attempts' records
        self.records: dict[int, dict] = {}
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        from ray.train.collective import broadcast_from_rank_zero

        steps = broadcast_from_rank_zero(self.saves if self.rank == 0 else None)
        self.thread = threading.Thread(target=self.run, args=(steps,), name="fsdp_exp-ray-report", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """After the task returned: report the steps left, and wait for the reports."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        if self.root is not None and self.rank == 0:
            shutil.rmtree(self.root / UPLOAD_DIR, ignore_errors=True)
        if self.error is not None:
            raise RuntimeError(f"reporting to Ray Train failed: {type(self.error).__name__}: "
                               f"{one_line(self.error)}") from self.error

    def run(self, steps: list[int]) -> None:
        import ray.train

        try:
            for step in steps:
                if self.rank != 0:
                    ray.train.report({})
                    continue
                while not self.ready(step) and not self.done.wait(POLL_S):
                    pass
                snapshot = self.snapshot(step)
                metrics = {**self.record(step), "step": step}
                if snapshot is None:  # pruned already, or the save never came
                    ray.train.report(metrics)
                else:
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(snapshot)),
                                     checkpoint_dir_name=step_name(step), delete_local_checkpoint_after_upload=True)
        except BaseException as err:  # raised again by finish()
            self.error = err
            logging.getLogger("fsdp_exp.rank_file").exception("reporting to Ray Train failed")

    def ready(self, step: int) -> bool:
        if step in self.logged and self.record(step).get("step") != step:
            return False
        return step_of(latest(self.root)) >= step

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


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
