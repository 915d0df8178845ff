"""The full, unsharded model as one file, and loading weights into a plain model.

The file is `model.safetensors` (or `model.pt`): the plain model's state dict and
nothing else, so it loads with `safetensors.torch.load_file` or
`torch.load(path, weights_only=True)`, into the model built without any sharding.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from fsdp_exp.checkpoint.files import CheckpointError, SafeReader, open_checkpoint
from fsdp_exp.errors import one_line
from fsdp_exp.sharding import unwrap

FORMATS = {"safetensors": "model.safetensors", "pt": "model.pt"}


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Every entry is written whole, a tied one too (a head sharing the embedding's
    tensor): safetensors refuses tensors that share memory."""
    written: set[int] = set()
    copies = {}
    for key, value in state.items():
        tensor = value.detach().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        copies[key] = tensor.clone() if storage in written else tensor
        written.add(storage)
    state = copies
    if Path(path).suffix == ".pt":
        torch.save(state, path)
    else:
        save_file(state, str(path))


def export_full_model(model: nn.Module, path: Path) -> None:
    """Gather the full weights shard by shard into rank 0's CPU memory (never a whole
    model on one GPU) and write one file. Every rank must call this; rank 0 writes."""
    state = get_model_state_dict(
        unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_weights(state, path)


def weight_shapes(path: Path, key: str) -> dict[str, list[int]]:
    """The tensors a weights file holds, by name, read without loading them (the
    safetensors header, or a memory-mapped .pt); a damaged file is a CheckpointError."""
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        try:
            state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError as err:  # the legacy (not zip) format cannot be memory-mapped
            if "mmap" not in str(err):
                raise
            state = torch.load(path, weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise TypeError(f"holds a {type(state).__name__}, not a state dict of tensors")
        return {name: list(t.shape) for name, t in state.items()}
    except pickle.UnpicklingError:
        raise CheckpointError(f"{key}={path}: not a weights file (not a state dict torch.save wrote)") from None
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file
        raise CheckpointError(f"{key}={path}: not a weights file ({one_line(err, named=True, whole=True, limit=200)})") from None


def load_weights(model: nn.Module, path: Path, key: str) -> None:
    """Fill the plain `model` from model.safetensors, model.pt or a DCP checkpoint.

    Nothing is unpickled: .pt files load with weights_only=True, and a DCP checkpoint's
    metadata through `SafeReader`. Names or shapes that do not match are an error.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        checkpoint = open_checkpoint(path, key)
        state = model.state_dict()
        dcp.load({"model": state}, storage_reader=SafeReader(checkpoint.path), no_dist=True)
        return
    if not path.is_file():
        raise CheckpointError(f"{key}={path}: no such file or checkpoint")
    try:
        state = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file
        raise CheckpointError(f"{key}={path}: not a weights file ({one_line(err, named=True, whole=True, limit=200)})") from None
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes that differ
        raise CheckpointError(f"{key}={path}: does not match this model: {' '.join(str(err).split())[:300]}") from None
    problems = [f"missing {k}" for k in result.missing_keys] + [f"unexpected {k}" for k in result.unexpected_keys]
    if problems:
        raise CheckpointError(f"{key}={path}: does not match this model: {', '.join(problems[:5])}")
