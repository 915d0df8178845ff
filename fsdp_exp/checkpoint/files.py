"""A checkpoint directory on disk: its layout, which checkpoint is the latest, and the
checks that say whether one is complete and safe to load.

    <checkpoint.dir>/
        latest                  the name of the newest complete checkpoint
        step_00000040/          one DCP checkpoint: every rank's shards, then .metadata
            train_state.json    step, data position, LR schedule, model config
            rng_rank<N>.json    each rank's random number generator state
        step_00000050/ ...

A checkpoint becomes `latest` only after every rank has written it (DCP writes .metadata
last, after gathering every rank's result), and `latest` is replaced atomically, so a
crash during a save leaves the previous checkpoint the latest.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_exp.files import write_atomically

LATEST = "latest"
TRAIN_STATE = "train_state.json"
METADATA = ".metadata"


class CheckpointError(Exception):
    """A checkpoint that cannot be used: one line naming the path and what is wrong."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def mark_latest(root: Path, name: str) -> None:
    write_atomically(Path(root) / LATEST, name + "\n")


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint in `root`, or None when it has none yet."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    return Path(root) / marker.read_text().strip()


def committed(root: Path) -> list[Path]:
    """The checkpoints in `root` up to the latest, oldest first."""
    newest = latest(root)
    if newest is None:
        return []
    return sorted(p for p in Path(root).glob("step_*") if p.is_dir() and p.name <= newest.name)


def prune(root: Path, keep: int | None) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints, and any unfinished save
    older than the latest; returns what was removed. Never touches a save in flight."""
    newest = latest(root)
    if newest is None or keep is None:
        return []
    done = [p for p in committed(root) if (p / METADATA).is_file()]
    old = set(done[:-keep]) | {p for p in committed(root) if not (p / METADATA).is_file()}
    old.discard(newest)
    for path in sorted(old):
        shutil.rmtree(path, ignore_errors=True)
    return sorted(old)


# ---- reading safely ------------------------------------------------------------------------
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP stores .metadata as a pickle. This reads only the classes DCP itself writes
    there, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_metadata(path: Path, where: str | None = None) -> Metadata:
    """The checkpoint's DCP metadata, read without running any code from the file.
    `where` names the checkpoint in errors (default: its path)."""
    where = where or str(path)
    try:
        with open(Path(path) / METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - any decoding failure means a bad file
        raise CheckpointError(f"{where}: corrupt checkpoint ({METADATA} unreadable: {err})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: corrupt checkpoint ({METADATA} holds {type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, but its metadata is read by `read_metadata`; tensors and other
    values are already read with `torch.load(weights_only=True)` by DCP."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- what a checkpoint holds ---------------------------------------------------------------
@dataclass
class Checkpoint:
    path: Path
    train_state: dict
    metadata: Metadata

    @property
    def step(self) -> int:
        return int(self.train_state["step"])

    def tensor_shapes(self, prefix: str) -> dict[str, list[int]]:
        """The saved tensors under `prefix` (e.g. "model."), by name, with their full shapes."""
        return {
            key[len(prefix):]: list(meta.size)
            for key, meta in self.metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
        }


def open_checkpoint(path: Path, key: str = "resume") -> Checkpoint:
    """The complete checkpoint at `path` (a checkpoint, or a directory of them: its latest).

    Raises CheckpointError naming `key`, the path and what is wrong: missing, half-written
    (a save that never finished) or corrupt (unreadable metadata, missing or short files).
    """
    path = Path(path).expanduser().resolve()
    where = f"{key}={path}"
    if not path.exists():
        raise CheckpointError(f"{where}: no such checkpoint")
    if (path / LATEST).is_file():
        path = latest(path)
        where = f"{key}={path}"
    elif not (path / METADATA).exists() and not (path / TRAIN_STATE).exists():
        found = sorted(p.name for p in path.glob("step_*"))
        hint = f" (it has {', '.join(found)} but no '{LATEST}' marker)" if found else ""
        raise CheckpointError(f"{where}: not a checkpoint{hint}; give a step_* directory or a checkpoint.dir")
    if not (path / METADATA).is_file():
        raise CheckpointError(f"{where}: half-written checkpoint (no {METADATA}: its save never finished); "
                              "use an earlier one")
    metadata = read_metadata(path, where)
    try:
        train_state = json.loads((path / TRAIN_STATE).read_text())
        int(train_state["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{where}: corrupt checkpoint ({TRAIN_STATE} unreadable: {err})") from None
    for info in metadata.storage_data.values():
        file = path / info.relative_path
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < info.offset + info.length:
            state = "missing" if size is None else f"{size} bytes, needs {info.offset + info.length}"
            raise CheckpointError(f"{where}: corrupt checkpoint ({info.relative_path} {state})")
    return Checkpoint(path, train_state, metadata)


def model_differences(saved: Checkpoint, model_shapes: dict[str, list[int]], model_cfg: dict) -> list[str]:
    """Why the checkpoint cannot fill this model: the parameters whose names or shapes
    differ, led by the model settings that differ. Empty when every tensor matches
    (settings such as dropout may differ then)."""
    saved_shapes = saved.tensor_shapes("model.")
    tensors = [
        f"{name} is {saved_shapes.get(name) or 'absent'} there, {model_shapes.get(name) or 'absent'} here"
        for name in sorted(set(saved_shapes) | set(model_shapes))
        if saved_shapes.get(name) != model_shapes.get(name)
    ]
    if not tensors:
        return []
    saved_cfg = saved.train_state.get("model", {})
    settings = [
        f"model.{key} is {saved_cfg.get(key)} there, {model_cfg.get(key)} here"
        for key in sorted(set(saved_cfg) | set(model_cfg))
        if key not in _LAYOUT_ONLY and saved_cfg.get(key) != model_cfg.get(key)
    ]
    return settings + tensors


# Model settings that change how the model is built or sharded, not its weights.
_LAYOUT_ONLY = {"blocks", "init_device"}
