"""conf/launcher/*: how the ranks of one run are started. The trainer is the same under each."""

from __future__ import annotations


class RunFailed(Exception):
    """A rank of the run failed; the message names the rank, its error and its log."""
