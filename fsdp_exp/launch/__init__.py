"""conf/launcher/*: how the ranks of one run are started. The trainer is the same under each."""

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
