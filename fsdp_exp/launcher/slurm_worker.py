"""launcher=slurm, in each task of the job: one rank of the run (fsdp_exp.launcher.slurm
submits the job; submitit pickles a SlurmJob to every task).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_exp.errors import one_line
from fsdp_exp.rank.worker import RankJob, rank_variables


class RankError(RuntimeError):
    """A rank's exception as one line, "Type: message"; the original is chained to it."""


class RequeueRefused(RuntimeError):
    """The job was signalled for preemption or its time limit, and no requeue is left."""


def started_path(folder: Path, job_id: str, rank: int) -> Path:
    return Path(folder) / f"{job_id}_{rank}_started"


@dataclass
class SlurmJob(RankJob):
    """What each task of the job runs (submitit pickles it): one rank of the run.

    `checkpoint` is submitit's hook for preemption and time limits (called on rank 0): the
    same ranks again, from the latest checkpoint, while `max_restarts` allows.
    """

    max_restarts: int = 0
    local: bool = False
    master_port: int | None = None
    restarts: int = 0

    def __call__(self) -> Any:
        import submitit

        env = submitit.JobEnvironment()
        env.paths.result_pickle.unlink(missing_ok=True)  # an earlier attempt's, before a requeue
        started_path(env.paths.folder, env.job_id, env.global_rank).touch()
        os.environ.update(rank_variables(
            env.global_rank, env.local_rank, env.num_tasks, env.num_tasks // env.num_nodes,
            master_addr="127.0.0.1" if self.local else env.hostnames[0],
            master_port=self.master_port or os.environ.get("MASTER_PORT")
            or random.Random(env.job_id).randint(20000, 60000),
            restarts=self.restarts))
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        if cpus and "OMP_NUM_THREADS" not in os.environ:
            import torch

            torch.set_num_threads(int(cpus))
        logging.getLogger("submitit").propagate = False  # its lines stay in its own files
        try:
            return self.run_rank()
        except Exception as err:
            raise RankError(one_line(err, named=True, whole=True)) from err

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        if self.restarts >= self.max_restarts:
            raise RequeueRefused(f"the job was preempted or reached its time limit, and "
                                 f"launcher.max_restarts={self.max_restarts} allows no further requeue")
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self.restarted())

    def restarted(self) -> SlurmJob:
        """The next attempt, which resumes from the latest checkpoint in checkpoint.dir
        (`fsdp_exp.checkpoint.resume.resume_point`)."""
        return dataclasses.replace(self, restarts=self.restarts + 1)
