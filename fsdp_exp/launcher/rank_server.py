"""The process the ranks of launcher=local and launcher=torchrun are forked from.

A rank started with `spawn` imports torch and this package again, seconds on a small
machine, and task=max_batch pays that on every probe. The ranks are forked instead from
multiprocessing's forkserver, which imports them once. It is started first thing
(`python -m fsdp_exp`), so it imports them while the command composes its runs. It never
trains and never touches CUDA, so every rank, and every probe, starts with fresh allocator
state. This module imports nothing heavy, so starting the server costs the command nothing.

The driver's check of the model against the data runs in a process forked from the server
too (`in_a_fork`): there the model's modules are imported already, and the command never
imports them (torchvision's take 1.1 s).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
from collections.abc import Callable
from typing import Any, TypeVar

from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.linux import children, command_line

T = TypeVar("T")

# What a rank runs, imported once by the server: the tasks, and the models of conf/model/
# but Hugging Face's (transformers takes seconds, and only model=hf uses it). torchvision's
# models alone take a rank 1.1 s on a small machine; the server imports them while the
# command composes and checks its run.
RANK_MODULES = ("torch", "fsdp_exp.tasks.train", "fsdp_exp.tasks.max_batch.probe", "fsdp_exp.tasks.eval",
                "fsdp_exp.tasks.export", "fsdp_exp.models.vit", "fsdp_exp.models.resnet", "fsdp_exp.models.cnn",
                "fsdp_exp.models.gpt")


started = False  # by this process: `python -m fsdp_exp` starts it first thing


def start_rank_server() -> None:
    """Start the server, unless it runs; it imports RANK_MODULES in the background."""
    global started
    multiprocessing.set_forkserver_preload(list(RANK_MODULES))
    multiprocessing.forkserver.ensure_running()
    started = True


def stop_rank_server() -> None:
    """The server stopped, should this process have started it, and waited for: by itself it
    ends only once it reads that the command has exited, about a second after with torch
    loaded, so the command would leave it running. On Linux (its children read from /proc);
    elsewhere it ends by itself."""
    if not started:
        return
    for pid in children():
        with contextlib.suppress(OSError):
            if b"multiprocessing.forkserver" in command_line(pid):
                os.kill(pid, signal.SIGKILL)  # it has no state to keep: the ranks it forked have ended
                os.waitpid(pid, 0)


def process_context() -> Any:
    """The multiprocessing context of a fresh process for work of a rank's kind: forked from the
    rank server, when this process started one (torch and the models imported already), else
    spawned."""
    return multiprocessing.get_context("forkserver" if started else "spawn")


def in_a_fork(check: Callable[..., T], *args: Any) -> T:
    """`check(*args)` in a process forked from the rank server, when this process started
    one, else here; its ConfigError is raised here as it was raised there."""
    if not started:
        return check(*args)
    context = multiprocessing.get_context("forkserver")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_send_result, args=(child, check, args), daemon=True)
    process.start()
    child.close()
    try:
        outcome, value = parent.recv()
    except EOFError:
        process.join(5)
        outcome, value = "failed", f"the process ended with exit code {process.exitcode}"
    finally:
        process.join()
    if outcome == "refused":
        raise ConfigError(value)
    if outcome == "failed":
        raise RuntimeError(f"{getattr(check, '__name__', check)}: {value}")
    return value


def _send_result(pipe: Any, check: Callable[..., Any], args: tuple) -> None:
    try:
        pipe.send(("ok", check(*args)))
    except ConfigError as err:
        pipe.send(("refused", str(err)))
    except Exception as err:  # noqa: BLE001 - raised in the command, as one line
        pipe.send(("failed", one_line(err, named=True, whole=True)))
