"""launcher=ray: the ranks as the workers of one Ray Train run (`TorchTrainer`); this is the
driver side, and each worker runs fsdp_exp.launcher.ray_worker.

    python -m fsdp_exp launcher=ray                          # a local Ray, started here
    python -m fsdp_exp launcher=ray launcher.address=auto    # join the cluster of this node

How it works, and why: docs/clusters.md, "Ray Train: how the launcher works".
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.distributed import backend_for
from fsdp_exp.errors import ConfigError, at_least, one_line
from fsdp_exp.groups import LauncherOption
from fsdp_exp.launcher.core import (
    Echo,
    RankOutcome,
    RunFailed,
    alongside,
    explain,
    missing_extra,
    watch,
)
from fsdp_exp.launcher.ray_worker import RayJob, _train_loop, size
from fsdp_exp.rank.worker import rank_log_path

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

log = logging.getLogger("fsdp_exp")

PROCESS_GROUP_TIMEOUT_S = 600  # as fsdp_exp.distributed.init's
TRAIN_EXTRA = ("pandas", "pyarrow", "fsspec")  # what ray[train] adds to ray, found without importing


@dataclass
class RayLauncher(LauncherOption):
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

    def ranks_per_node(self, world: int) -> int:
        """Ray places its workers where its resources are, which the config does not say:
        counted as all on one node."""
        return world

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
    def launch(self, task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: Path, nproc: int,
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
