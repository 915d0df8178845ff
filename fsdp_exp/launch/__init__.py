"""conf/launcher/*: how the ranks of one run are started. The trainer is the same under each.

A launcher is built from its config (`_target_`) on the driver and offers:

- `ranks(on_gpu) -> int`: the world size it will start;
- `launch(task, cfg, run_dir, nproc, time_limit_s=None)`: start `nproc` fresh ranks, each
  running `fsdp_exp.launch.worker.run_rank(task, cfg, run_dir, time_limit_s)` with RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and return rank 0's result
  (the tasks return the same figures on every rank). When a rank fails it raises
  RunFailed, with `out_of_memory` when any rank ran out of memory, so task=max_batch can
  use any launcher: every probe is one `launch`.
"""

from __future__ import annotations


class RunFailed(Exception):
    """A rank of the run failed; the message names the rank, its error and its log.

    `out_of_memory`: some rank ran out of memory (the others then fail or are stopped).
    `timed_out`: the ranks ran past the launch's time limit.
    `killed_by`: the signal that ended the rank, when a signal did (e.g. "SIGKILL").
    """

    def __init__(self, message: str, out_of_memory: bool = False, timed_out: bool = False,
                 killed_by: str | None = None):
        super().__init__(message)
        self.out_of_memory = out_of_memory
        self.timed_out = timed_out
        self.killed_by = killed_by
