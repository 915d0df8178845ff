"""The process the ranks of launcher=local and launcher=torchrun are forked from.

A rank started with `spawn` imports torch and this package again, seconds on a small
machine, and task=max_batch pays that on every probe. The ranks are forked instead from
multiprocessing's forkserver, which imports them once. It is started first thing
(`python -m fsdp_exp`), so it imports them while the command composes its runs. It never
trains and never touches CUDA, so every rank, and every probe, starts with fresh allocator
state. This module imports nothing heavy, so starting the server costs the command nothing.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

# What a rank runs, imported once by the server.
RANK_MODULES = ("torch", "fsdp_exp.tasks.train", "fsdp_exp.tasks.max_batch.probe", "fsdp_exp.tasks.eval", "fsdp_exp.tasks.export")


def start_rank_server() -> None:
    """Start the server, unless it runs; it imports RANK_MODULES in the background."""
    multiprocessing.set_forkserver_preload(list(RANK_MODULES))
    multiprocessing.forkserver.ensure_running()
