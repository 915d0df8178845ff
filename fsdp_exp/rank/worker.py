"""What every rank runs first, whichever launcher started it: its variables, logging, the
time limit, then the task; and the one way a rank knows that the launcher restarted it."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from fsdp_exp.distributed import DEVICE_VARIABLE
from fsdp_exp import linux
from fsdp_exp.errors import one_line

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

log = logging.getLogger("fsdp_exp")

RESTARTS_VARIABLE = "FSDP_EXP_RESTARTS"  # how often the launcher has restarted the ranks
RESTORED_VARIABLE = "FSDP_EXP_RESTORED"  # the checkpoint a launcher that keeps its own copies (Ray) restored


def rank_variables(rank: int, local_rank: int, world_size: int, local_world_size: int, *,
                   master_addr: str | None = None, master_port: int | str | None = None,
                   device: str | None = None, restarts: int = 0, restored: str | None = None) -> dict[str, str]:
    """What a rank reads from its environment, for a launcher other than torch's elastic
    one (which sets RANK to MASTER_PORT and TORCHELASTIC_RESTART_COUNT itself). `device`:
    the rank's GPU, where the launcher knows it (see `fsdp_exp.distributed.gpu_index`)."""
    variables = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
                 "LOCAL_WORLD_SIZE": str(local_world_size), RESTARTS_VARIABLE: str(restarts)}
    optional = {"MASTER_ADDR": master_addr, "MASTER_PORT": master_port, DEVICE_VARIABLE: device,
                RESTORED_VARIABLE: restored}
    variables.update({name: str(value) for name, value in optional.items() if value is not None})
    return variables


def restarts() -> tuple[int, str | None]:
    """On a rank: how often the launcher has restarted the ranks, and the checkpoint it
    restored for them, if it keeps its own copies. torch's elastic agent (launcher=local,
    launcher=torchrun, an external torchrun) counts restarts in TORCHELASTIC_RESTART_COUNT;
    the other launchers set RESTARTS_VARIABLE."""
    count = os.environ.get(RESTARTS_VARIABLE) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(count), os.environ.get(RESTORED_VARIABLE) or None


def rank_log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.log"


def rank_error_path(run_dir: Path, rank: int) -> Path:
    """The error a rank raised, as one line and when: written before its process ends, so
    the launcher can tell it even when it stopped that rank before seeing it fail (its
    peers, left in a collective, failed first)."""
    return Path(run_dir) / f"rank{rank}.error.json"


def rank_error(run_dir: Path, rank: int) -> tuple[str, float] | None:
    try:
        record = json.loads(rank_error_path(run_dir, rank).read_text())
        return str(record["error"]), float(record["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def setup_rank(run_dir: Path, rank: int) -> None:
    """Every rank logs to rank<N>.log; only rank 0 also speaks on the console.

    Ranks other than 0 send their whole stdout/stderr (C++ warnings and tracebacks too)
    to their log, so the console shows one rank, not interleaved copies. A rank that a
    fatal signal ends (an abort or a segfault inside C++) leaves its Python stack there.
    """
    path = rank_log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable()
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s",
        datefmt="%H:%M:%S",
        handlers=handlers,
        force=True,
    )
    warnings.showwarning = log_warning
    # Tracebacks go to the rank's log file only; the console gets the driver's one line.
    file_only = logging.getLogger("fsdp_exp.rank_file")
    file_only.handlers = [handlers[0]]
    file_only.propagate = False
    file_only.info("rank %d is pid %d on %s", rank, os.getpid(), socket.gethostname())


TORCH_WARNED = "torch warned: "  # the start of a warning kept in the rank's log (launcher.core.Echo skips it)


def log_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                file: Any = None, line: str | None = None) -> None:
    """Python warnings, as logging records (in place of `warnings.showwarning`). Those that
    torch raises from its own code (DDP's "Grad strides do not match bucket view strides",
    deprecations inside torch) are about torch's internals, not the run, and the user
    cannot act on them: they go to the rank's log only. The project's own warnings and
    those raised from the user's code reach the console too."""
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    if filename.startswith(os.path.dirname(torch.__file__) + os.sep):
        logging.getLogger("fsdp_exp.rank_file").warning("%s%s", TORCH_WARNED, text)
    else:
        logging.getLogger("py.warnings").warning("%s", text)


def console_warnings_only() -> None:
    """From here on the console shows this rank's warnings and errors, not its progress
    (a max_batch probe: the search reports each probe in one line; the rest is in the log)."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


@dataclass
class RankJob:
    """One rank of a run as a job that another system runs and pickles to its workers (a
    SLURM task, a Ray Train worker): `task(cfg, run_dir)` on that rank (`run_rank`)."""

    task: Callable[[Experiment, Path], Any]
    cfg: Experiment
    run_dir: str
    time_limit_s: int | None = None

    def run_rank(self, task: Callable[[Experiment, Path], Any] | None = None) -> Any:
        """The rank: `task`, by default the job's own."""
        return run_rank(task or self.task, self.cfg, self.run_dir, self.time_limit_s)


# A failed rank of launcher=local or torchrun that has not exited this long after its error was
# recorded ends itself (`exit_if_stuck`).
FAILED_RANK_EXIT_S = 10


def exit_if_stuck(after_s: float) -> None:
    """End this process with exit code 1 `after_s` from now, should it still be running: a
    failed rank's teardown can block for good. When every rank fails inside a collective (each
    ran out of memory in DDP's backward), gloo's destructor waits for its worker threads, which
    wait for the other rank, which waits the same way, for good. Its error and traceback are written
    by then; a daemon thread, so a rank that exits in time takes it with it. A rank that ran
    out of memory under a CPU memory.limit_gb has no room for the thread's stack: the limit,
    which has done its work, was lifted first (run_rank), so that the rank's own error is what
    gets out (not "can't start new thread")."""
    timer = threading.Timer(after_s, os._exit, args=(1,))
    timer.daemon = True
    with contextlib.suppress(RuntimeError):  # no thread: the error still gets out, unguarded
        timer.start()


@record
def run_rank(task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: str, time_limit_s: int | None = None,
             threads: int | None = None) -> Any:
    """The elastic launcher's entry point: `task(cfg, run_dir)` on this rank.

    `time_limit_s`: the kernel ends this process with SIGALRM after that long, even when
    it is stuck inside a collective or a C++ call that never returns to Python.
    `threads`: this rank's share of the cores, from a launcher whose ranks do not start
    with its environment (forked from a server started before it knew).
    """
    rank = int(os.environ["RANK"])
    setup_rank(Path(run_dir), rank)
    rank_error_path(Path(run_dir), rank).unlink(missing_ok=True)  # an earlier attempt's
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if time_limit_s:
        signal.alarm(time_limit_s)
    try:
        return task(cfg, Path(run_dir))
    except Exception as err:
        # The limit of a CPU memory.limit_gb has done its work: what gets the error out (a thread;
        # under launcher=ray the worker's own reply, which Ray cannot send at the limit and
        # reports as a dead process) needs room.
        linux.lift_data_cap()
        logging.getLogger("fsdp_exp.rank_file").exception("this rank failed")
        line = one_line(err, named=True, whole=True)
        with contextlib.suppress(OSError):  # the error itself is what must get out
            rank_error_path(Path(run_dir), rank).write_text(json.dumps({"error": line, "time": time.time()}))
        if multiprocessing.parent_process() is not None:
            exit_if_stuck(FAILED_RANK_EXIT_S)
        raise
    finally:
        signal.alarm(0)
        linux.lift_data_cap()  # as above, for what carries its result out (Ray's reply, submitit's pickle)
        if multiprocessing.parent_process() is not None:
            # A rank of launcher=local or torchrun, its work done or stopped, waits for the
            # launcher to read what it returned: a second Ctrl-C there (the launcher passing the
            # user's on) would print a KeyboardInterrupt traceback from multiprocessing.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
