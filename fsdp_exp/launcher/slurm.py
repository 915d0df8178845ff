"""launcher=slurm: the ranks as the tasks of one SLURM job, submitted through submitit.

`launcher.cluster=slurm` submits with sbatch; `launcher.cluster=local` runs the same job
through submitit's local executor on this machine (one process per task, the same
pickles, signals and requeue path), so everything but sbatch itself can be tried and
tested without a cluster.

This is the driver side; each task runs fsdp_exp.launcher.slurm_worker.
How it works, and why: docs/clusters.md, "SLURM: how the launcher works".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.errors import ConfigError, at_least, choice
from fsdp_exp.groups import LauncherOption
from fsdp_exp.launcher.core import (
    POLL_S,
    Echo,
    RankOutcome,
    check_nproc,
    explain,
    failure_line,
    missing_extra,
    ranks_per_node,
    threads_per_rank,
    watch,
)
from fsdp_exp.launcher.slurm_worker import RankError, SlurmJob, started_path

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

log = logging.getLogger("fsdp_exp")

Cluster = choice("Cluster", ("slurm", "local"), __name__)
FORCE_STATE_S = 30  # on a cluster, how often it also asks sacct (submitit alone may wait 10 minutes)
LOCAL_SUBMIT = threading.Lock()  # launcher.cluster=local: submissions of runs side by side, one at a time
RESULT_WAIT_S = 15  # on a cluster, how long result files may take to appear on the shared file system


@dataclass
class SlurmLauncher(LauncherOption):
    cluster: Cluster = Cluster["slurm"]  # slurm: sbatch on this cluster | local: submitit's local executor, here
    nproc_per_node: Any = "auto"  # ranks (SLURM tasks) per node; auto: gpus_per_node, or 2 when it is 0
    nodes: int = 1  # the world size is nodes x nproc_per_node; local: 1
    gpus_per_node: int = 0  # GPUs asked for per node (one rank per GPU, nccl); 0: CPU ranks (gloo)
    cpus_per_task: int = 2  # cores per rank; the ranks' torch threads
    mem_gb: float | None = None  # memory per node; None: the partition's default
    timeout_min: int = 60  # the job's time limit; 90 s before it (30 s locally) the job is requeued
    # Requeues after preemption or the time limit, and resubmissions after a failure, each
    # from the latest checkpoint in checkpoint.dir.
    max_restarts: int = 0
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: list[str] = field(default_factory=list)  # shell lines run before the ranks start
    folder: str | None = None  # submitit's job files and logs; None: slurm/ in the run directory
    max_parallel: int = 16  # a sweep's runs: jobs in flight at once (1: one after another)
    starts_all_ranks = True
    restarts_key = "launcher.max_restarts"

    def __post_init__(self) -> None:
        check_nproc(self.nproc_per_node)
        for key, low in (("nodes", 1), ("gpus_per_node", 0), ("cpus_per_task", 1), ("timeout_min", 1),
                         ("max_restarts", 0), ("max_parallel", 1)):
            at_least(f"launcher.{key}", getattr(self, key), low)
        if self.mem_gb is not None and self.mem_gb <= 0:
            raise ConfigError(f"launcher.mem_gb={self.mem_gb}: must be greater than 0, or null")
        if self.cluster == "local" and self.nodes > 1:
            raise ConfigError(f"launcher.nodes={self.nodes}: launcher.cluster=local runs on this "
                              "machine only; use launcher.nodes=1")

    @property
    def restarts(self) -> int:
        return self.max_restarts

    @property
    def runs_here(self) -> bool:
        return self.cluster == "local"

    def gpus(self, local_gpus: int) -> int:
        return self.gpus_per_node

    def connect(self, nproc: int, at_once: int) -> None:
        """Nothing to connect to: each launch submits its own job."""

    def world_size(self, gpus: int) -> int:
        """`nodes` x `nproc_per_node` (auto: gpus_per_node, or 2 without GPUs). Also the
        checks of what this machine must have, since the driver calls it before any run."""
        self.check()
        return self.nodes * self.per_node()

    def per_node(self) -> int:
        return ranks_per_node(self.nproc_per_node, self.gpus_per_node)

    def ranks_per_node(self, world: int) -> int:
        return max(1, world // self.nodes)

    def check(self) -> None:
        """One ConfigError line for what cannot be submitted from here."""
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise missing_extra("slurm", "submitit", "slurm") from None
        if self.cluster == "slurm" and shutil.which("sbatch") is None:
            raise ConfigError("launcher.cluster=slurm: no SLURM here (sbatch not found); "
                              "use launcher.cluster=local to try it on this machine")
        if self.cluster == "local":
            import torch

            if self.gpus_per_node > torch.cuda.device_count():
                raise ConfigError(f"launcher.gpus_per_node={self.gpus_per_node}: launcher.cluster=local "
                                  f"has {torch.cuda.device_count()} GPU(s) here")

    # ---- the driver ------------------------------------------------------------------------
    def launch(self, task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any:
        """Run `task(cfg, run_dir)` on `nproc` ranks, the tasks of one job; rank 0's result.

        Blocks until the job ends (requeues included). A failed job is resubmitted while
        `max_restarts` allows, resuming from the latest checkpoint; then RunFailed.
        """
        self.check()
        run_dir = Path(run_dir).resolve()
        folder = Path(self.folder).expanduser().resolve() if self.folder else run_dir / "slurm"
        nodes = self.nodes if nproc == self.nodes * self.per_node() else 1
        job_fn = SlurmJob(task=task, cfg=cfg, run_dir=str(run_dir),
                         time_limit_s=math.ceil(time_limit_s) if time_limit_s else None,
                         max_restarts=self.max_restarts, local=self.cluster == "local")
        while True:
            job = self._submit(job_fn, folder, nodes, nproc // nodes)
            failure, result = self._outcome(job, nproc, run_dir, time_limit_s)
            if failure is None:
                return result
            used = self._restarts_used(job, job_fn)
            if failure.timed_out or used >= self.max_restarts:
                raise failure
            job_fn = dataclasses.replace(job_fn, restarts=used).restarted()
            log.warning("%s; restarting the ranks (%d of launcher.max_restarts=%d)",
                        failure, job_fn.restarts, self.max_restarts)

    def executor(self, folder: Path, nodes: int, tasks_per_node: int) -> Any:
        """submitit's executor for one job of `nodes` x `tasks_per_node` ranks."""
        import submitit

        executor = submitit.AutoExecutor(folder=folder, cluster=self.cluster,
                                         slurm_max_num_timeout=self.max_restarts,
                                         local_max_num_timeout=self.max_restarts)
        executor.update_parameters(
            name="fsdp_exp", nodes=nodes, tasks_per_node=tasks_per_node, gpus_per_node=self.gpus_per_node,
            cpus_per_task=self.cpus_per_task, mem_gb=self.mem_gb, timeout_min=self.timeout_min,
            slurm_partition=self.partition, slurm_account=self.account, slurm_qos=self.qos,
            slurm_constraint=self.constraint, slurm_srun_args=["--kill-on-bad-exit=1"],
            **{f"{self.cluster}_setup": list(self.setup)} if self.setup else {},
        )
        return executor

    def _submit(self, job_fn: SlurmJob, folder: Path, nodes: int, tasks_per_node: int) -> Any:
        executor = self.executor(folder, nodes, tasks_per_node)
        if self.cluster == "local":
            job_fn = dataclasses.replace(job_fn, master_port=free_port())
            # the local tasks inherit this process's environment: one run's setting at a time
            with LOCAL_SUBMIT, threads_per_rank(nodes * tasks_per_node):
                job = executor.submit(job_fn)
        else:
            job = executor.submit(job_fn)
            log.info("submitted SLURM job %s: %d node(s) x %d rank(s); its files in %s",
                     job.job_id, nodes, tasks_per_node, folder)
        return job

    def _outcome(self, job: Any, nproc: int, run_dir: Path, time_limit_s: float | None) -> tuple:
        """Wait for the job; (None, rank 0's result) or (RunFailed, None)."""
        forced = [time.monotonic()]

        def done() -> bool:
            if self.cluster == "slurm" and time.monotonic() - forced[0] > FORCE_STATE_S:
                job.get_info(mode="force")  # refreshes the state every task's done() reads
                forced[0] = time.monotonic()
            return job.done()

        def first_start() -> float | None:
            return min((s for s in started(job, nproc) if s is not None), default=None)

        stopped = watch(done, Echo(job.task(0).paths.stdout), first_start, lambda: job.cancel(check=False),
                        time_limit_s, state=lambda: f"job {job.job_id} {job.state}")
        while not job.done():  # cancelled: the tasks end within seconds
            time.sleep(POLL_S)
        ended = time.time()
        if self.cluster == "slurm":
            wait_for_results(job, nproc)
        results = [read_result(job.task(rank).paths.result_pickle) for rank in range(nproc)]
        if all(r is not None and r[0] == "success" for r in results):
            return None, results[0][1]
        return explain(outcomes(job, results, started(job, nproc)), run_dir, time_limit_s, ended, stopped), None

    @staticmethod
    def _restarts_used(job: Any, job_fn: SlurmJob) -> int:
        """The requeues so far: the callable submitit last saved for the job counts them."""
        try:
            return int(job.submission().function.restarts)
        except Exception:  # noqa: BLE001 - no readable submission: count the one we sent
            return job_fn.restarts


def outcomes(job: Any, results: list, starts: list[float | None]) -> list[RankOutcome]:
    """The job's result pickles as rank outcomes: the error a rank raised, with the time its
    pickle was written; no result: a rank killed by a signal, or one that never started."""
    ranks = []
    for rank, (result, start) in enumerate(zip(results, starts, strict=True)):
        if result is None:
            how = "never started" if start is None else \
                "ended without a result (killed by a signal, or its node was lost)"
            ranks.append(RankOutcome(rank, signal="signal", started=start,
                                     how=f"{how}; job {job.job_id}, its log: {job.task(rank).paths.stderr}"))
        elif result[0] != "success":
            ranks.append(RankOutcome(rank, error=error_line(str(result[1])), ended=result[2], started=start))
        else:
            ranks.append(RankOutcome(rank, started=start))
    return ranks


_RANK_ERROR = f"{RankError.__module__}.{RankError.__qualname__}: "


def error_line(trace: str) -> str:
    """The error of a rank's traceback (submitit keeps its text) as one line, "Type: message"."""
    lines = [line for line in trace.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(_RANK_ERROR):
            return line[len(_RANK_ERROR):]
    if not lines:
        return "unknown error"
    # Not raised through SlurmJob (e.g. unpickling failed): the last line, without the module.
    return failure_line(re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))", "", lines[-1]))


def read_result(path: Path) -> tuple[str, Any, float] | None:
    """submitit's ("success" | "error", value) for one task, and when it was written."""
    if not path.is_file():
        return None
    from submitit.core.utils import pickle_load

    try:
        outcome, value = pickle_load(path)
    except Exception as err:  # noqa: BLE001 - a truncated file is a failed task
        return ("error", f"unreadable result {path}: {err}", path.stat().st_mtime)
    return outcome, value, path.stat().st_mtime


def wait_for_results(job: Any, nproc: int) -> None:
    deadline = time.monotonic() + RESULT_WAIT_S
    while time.monotonic() < deadline and not all(job.task(r).paths.result_pickle.is_file() for r in range(nproc)):
        time.sleep(1)


def started(job: Any, nproc: int) -> list[float | None]:
    """When each rank's task last started (a requeue starts it again), or None."""
    times: list[float | None] = []
    for rank in range(nproc):
        path = started_path(job.paths.folder, job.job_id, rank)
        times.append(path.stat().st_mtime if path.is_file() else None)
    return times


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
