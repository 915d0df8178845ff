"""checkpoint=dcp, dcp_async, dcp_async_pinned: PyTorch Distributed Checkpoint during training.

- dcp: every rank writes its shards; training waits for the files.
- dcp_async: `dcp.async_save`. Training waits while the state is copied to CPU memory
  (the staging copy), then goes on while a thread writes the files.
- dcp_async_pinned: the same, through one persistent staging buffer that is reused by
  every save. On GPU it is pinned memory, copied without blocking, and training waits
  for the copy only before the next optimizer step changes the weights. Without a GPU the
  buffer is plain memory (there is nothing to pin for), copied on a thread of our own.

At most one save is in flight: a new save first waits for the previous one.
"""

from __future__ import annotations

import logging
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from fsdp_exp.checkpoint.files import mark_latest, prune, step_name
from fsdp_exp.checkpoint.state import TrainState
from fsdp_exp import distributed
from fsdp_exp.errors import ConfigError, choice
from fsdp_exp.groups import CheckpointOption

log = logging.getLogger("fsdp_exp")
Mode = choice("Mode", ("sync", "async", "async_pinned"), __name__)


@dataclass
class DCPCheckpoint(CheckpointOption):
    mode: Mode = Mode["sync"]  # sync | async | async_pinned
    every: int = 100  # steps between saves; the last step is always saved
    keep: int | None = 3  # the newest K checkpoints are kept, older ones removed; None keeps all
    dir: str | None = None  # None: checkpoints/ in the run directory
    overwrite: bool = False  # a new run may write into a dir holding another run's checkpoints
    export_full: bool = False  # at the end, also write the full unsharded weights to model.safetensors
    saves = True

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"checkpoint.every={self.every}: must be at least 1")
        if self.keep is not None and self.keep < 1:
            raise ConfigError(f"checkpoint.keep={self.keep}: must be at least 1, or null to keep all")

    def check(self) -> None:
        """On the driver: `dir`, when set, is a directory this process can create and write."""
        if self.dir is None:
            return
        path = Path(self.dir).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"checkpoint.dir={self.dir}: is a file, not a directory")
        existing = path
        while not existing.exists():
            existing = existing.parent
        try:
            tempfile.TemporaryDirectory(dir=existing).cleanup()
        except OSError as err:
            raise ConfigError(f"checkpoint.dir={self.dir}: cannot be written here "
                              f"({err.strerror} in {existing}); choose a directory you can write") from None

    @property
    def stages_a_copy(self) -> bool:
        """A save copies the rank's state to CPU memory and writes it from there while
        training goes on (async, async_pinned: the copy is kept for the next save)."""
        return self.mode != "sync"

    @property
    def threads_started(self) -> int:
        """The threads a rank's saves start (torch 2.14, seen on CPU): an async save's
        process group of its own (gloo's loop and two workers) and the thread that writes
        its files; async_pinned's stager one more."""
        return {"sync": 0, "async": 4, "async_pinned": 5}[str(self.mode)]

    def dir_for(self, run_dir: Path) -> Path:
        """Where the run in `run_dir` keeps its checkpoints, as an absolute path."""
        return Path(self.dir or Path(run_dir) / "checkpoints").expanduser().resolve()

    def start(self, state: TrainState, root: Path) -> DCPSaver:
        """This rank's saver of `state` into `root`, once the objects exist (collective:
        with an async mode it makes a process group)."""
        return DCPSaver(self, state, root)


class DCPSaver:
    """The checkpoints of one run on one rank, by `DCPCheckpoint`'s settings; `blocked_s`:
    the training time each save took."""

    def __init__(self, settings: DCPCheckpoint, state: TrainState, root: Path) -> None:
        self.mode, self.every, self.keep = settings.mode, settings.every, settings.keep
        self.state = state
        self.root = Path(root)
        self.blocked_s: list[float] = []
        self._pending: tuple[int, Future] | None = None
        self._staging: Future | None = None
        self._stager: AsyncStager | None = None
        self._group: Any = None
        if self.mode == "sync":
            return
        # The background writer runs collectives of its own: on the training's group
        # they could interleave with the training's collectives and hang.
        self._group = dist.new_group(backend="gloo")
        if self.mode == "async_pinned":
            on_gpu = state.ranks.device.type == "cuda"
            if not on_gpu and state.ranks.is_main:
                log.info("checkpoint=dcp_async_pinned: no GPU, so the staging buffer is plain CPU memory, not pinned")
            self._stager = staging_for(state.ranks.device)

    @property
    def stager(self) -> AsyncStager | None:
        """What a checkpoint=dcp_async_pinned save stages through (None: the other modes)."""
        return self._stager

    @property
    def staging(self) -> bool:
        """Whether the last save's copy of the weights is still under way (the optimizer's
        next update waits for it)."""
        return self._staging is not None

    def before_update(self) -> None:
        """Before the optimizer changes the weights: the staging copy must be complete."""
        if self._staging is not None:
            start = time.perf_counter()
            self._staging.result()
            self._staging = None
            self.blocked_s[-1] += time.perf_counter() - start

    def after_step(self, step: int, last: bool, loss: torch.Tensor) -> None:
        if self._pending is not None and self._pending[1].done():
            self._finish_pending()
        if step % self.every == 0 or last:
            self.save(step, loss)

    def save(self, step: int, loss: torch.Tensor | None = None) -> None:
        """Collective. `loss`: this rank's loss at `step`; their mean is saved with it."""
        # The step's kernels may still be queued: their time is the step's, not the save's.
        distributed.synchronize(self.state.ranks.device)
        start = time.perf_counter()
        self._finish_pending()
        path = self.root / step_name(step)
        self.state.write_small_state(path, step, distributed.mean(loss) if loss is not None else None)
        tensors = self.state.tensors()
        if self.mode == "sync":
            dcp.save(tensors, checkpoint_id=path)
            self._commit(step)
        elif self.mode == "async":
            self._pending = (step, dcp.async_save(tensors, checkpoint_id=path, process_group=self._group))
        else:
            response = dcp.async_save(tensors, checkpoint_id=path, process_group=self._group,
                                      async_stager=self._stager)
            self._staging = response.staging_completion
            self._pending = (step, response.upload_completion)
        self.blocked_s.append(time.perf_counter() - start)

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, upload = self._pending
        self._pending = None
        upload.result()
        self._commit(step)

    def _commit(self, step: int) -> None:
        """Rank 0 marks the checkpoint the latest: DCP's coordinator wrote .metadata only
        after every rank had written its shards."""
        if not self.state.ranks.is_main:
            return
        mark_latest(self.root, step_name(step))
        removed = prune(self.root, self.keep)
        log.info("checkpoint %s saved%s", self.root / step_name(step),
                 f"; removed {', '.join(p.name for p in removed)}" if removed else "")

    def close(self) -> None:
        """Wait for the save in flight; every rank must call this before the group ends."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None
        self._finish_pending()
        if self._stager is not None:
            self._stager.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def staging_for(device: torch.device) -> AsyncStager:
    """The stager of checkpoint=dcp_async_pinned: one reused buffer, filled in the background.

    On a GPU, torch's DefaultStager copies into pinned memory on a stream of its own. That
    stager takes a stream whenever any accelerator is present (`torch.Stream()`, on GPU 0),
    even for a rank that runs on the CPU of a GPU machine: a CUDA context per rank. So a CPU
    rank stages through DefaultStager's synchronous path, on a thread of its own.
    """
    if device.type == "cuda":
        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=True))
    return CPUStager()


class CPUStager(AsyncStager):
    """Stages into one reused CPU buffer on a background thread, with no device stream."""

    _synchronize_after_execute = False  # the training waits on the staging Future itself

    def __init__(self) -> None:
        self._copy = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-staging")
        self._staging: Future | None = None

    def stage(self, state_dict: dict) -> Future:
        self._staging = self._thread.submit(self._copy.stage, state_dict)
        return self._staging

    def synchronize_staging(self) -> None:
        if self._staging is not None:
            self._staging.result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._copy.close()
