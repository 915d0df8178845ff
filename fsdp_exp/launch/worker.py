"""What every rank runs first, whichever launcher started it: logging, threads, then the task."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import record

log = logging.getLogger("fsdp_exp")


def rank_log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.log"


def setup_rank(run_dir: Path, rank: int) -> None:
    """Every rank logs to rank<N>.log; only rank 0 also speaks on the console.

    Ranks other than 0 send their whole stdout/stderr (C++ warnings and tracebacks too)
    to their log, so the console shows one rank, not interleaved copies.
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
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s",
        datefmt="%H:%M:%S",
        handlers=handlers,
        force=True,
    )
    logging.captureWarnings(True)
    # Tracebacks go to the rank's log file only; the console gets the driver's one line.
    file_only = logging.getLogger("fsdp_exp.rank_file")
    file_only.handlers = [handlers[0]]
    file_only.propagate = False
    file_only.info("rank %d is pid %d on %s", rank, os.getpid(), socket.gethostname())


@record
def run_rank(task: Callable[[dict, Path], Any], cfg: dict, run_dir: str, time_limit_s: int | None = None) -> Any:
    """The elastic launcher's entry point: `task(cfg, run_dir)` on this rank.

    `time_limit_s`: the kernel ends this process with SIGALRM after that long, even when
    it is stuck inside a collective or a C++ call that never returns to Python.
    """
    setup_rank(Path(run_dir), int(os.environ["RANK"]))
    if time_limit_s:
        signal.alarm(time_limit_s)
    try:
        return task(cfg, Path(run_dir))
    except Exception:
        logging.getLogger("fsdp_exp.rank_file").exception("this rank failed")
        raise
    finally:
        signal.alarm(0)
