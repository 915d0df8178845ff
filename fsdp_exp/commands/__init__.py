"""The commands, one module each, and the one way `python -m fsdp_exp` and the installed
`fsdp-exp` start:

- experiment.py  `python -m fsdp_exp` / `fsdp-exp`: runs, sweeps and tasks through Hydra
- compare.py     `python -m fsdp_exp.compare`: finished runs side by side
- check_gpu.py   `python -m fsdp_exp.check_gpu`: does fsdp_exp work on this machine's GPUs
- gpu_checks.py  its checks: the runs each needs, and the judge that reads them
- gpu_judges.py  how each check is judged, from the finished runs
- gpu_session.py `python -m fsdp_exp.gpu_session` (`make gpu-session`): every GPU claim on one GPU

`python -m fsdp_exp.compare` and the others name a module at the package's top
(fsdp_exp/compare.py, ...) that only starts the command here. This module imports nothing
heavy: the rank server starts before torch is imported (fsdp_exp.launcher.rank_server).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn

ONLY_SHOWS = {"-h", "--help", "--hydra-help", "--info", "--cfg", "-c"}  # no run: no rank server


class EndAtOnce:
    """The process's end without Python's own teardown of every module it imported, which
    takes a second or more once torch is loaded. Made first thing, its atexit hook runs last:
    after the threads still running were waited for and every other hook ran (wandb's and
    Ray's shutdown); then logging's files are closed, the rank server is stopped, the streams
    flushed, and the process ends with `code` (1 unless set: an uncaught exception's)."""

    def __init__(self) -> None:
        self.code = 1
        atexit.register(self.end)

    def end(self) -> None:
        from fsdp_exp.launcher.rank_server import stop_rank_server

        logging.shutdown()
        stop_rank_server()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe (| head) or stream
                stream.flush()
        os._exit(self.code)


def experiment() -> NoReturn:
    """`python -m fsdp_exp` and `fsdp-exp`: the rank server started first thing (it imports
    what the ranks run while the command composes its runs), unless this process is a rank of
    an external torchrun or only shows something; then the command, and its end at once."""
    ending = EndAtOnce()
    if "RANK" not in os.environ and not ONLY_SHOWS & set(sys.argv[1:]):
        from fsdp_exp.launcher.rank_server import start_rank_server

        start_rank_server()
    from fsdp_exp.commands.experiment import command

    ending.code = command()
    sys.exit(ending.code)
