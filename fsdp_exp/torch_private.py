"""torch's private APIs, at one door.

A few features need names torch keeps private (a leading underscore in the module or the
name): the estimate's fake tensors, fake process group and memory trackers, the
activation-checkpoint wrapper, dispatch modes, the CUDA allocator's history. Any torch
release may change them without notice, so every use goes through this module:
`from fsdp_exp.torch_private import FakeTensorMode` imports it on first use (some take
seconds to import: the memory trackers pull in torch's runtime estimator). TESTED_WITH is
the torch release they were read against; `changed()` names each one whose place or
parameters differ in the installed torch, and tests/test_torch_private.py fails with that
name.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

TESTED_WITH = "2.14"

# The name used here -> where torch keeps it (a module, then attributes).
PLACES = {
    "FakeTensorMode": "torch._subclasses.fake_tensor.FakeTensorMode",
    "FakeStore": "torch.testing._internal.distributed.fake_pg.FakeStore",
    "MemTracker": "torch.distributed._tools.mem_tracker.MemTracker",
    "UpdateType": "torch.distributed._tools.mem_tracker._UpdateType",
    "FSDPMemTracker": "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
    "TorchDispatchMode": "torch.utils._python_dispatch.TorchDispatchMode",
    "CheckpointImpl": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointImpl",
    "CheckpointWrapper": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper",
    "checkpoint_wrapper": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
    "CHECKPOINT_PREFIX": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX",
    "is_dynamo_supported": "torch._dynamo.is_dynamo_supported",
    "record_memory_history": "torch.cuda.memory._record_memory_history",
    "dump_snapshot": "torch.cuda.memory._dump_snapshot",
    "flash_attention_for_cpu": "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
}

# What the uses rely on beyond a name: the parameters of the methods the estimate overrides
# (fsdp_exp.estimate.counting.CountingTracker) and of the calls made with keywords.
PARAMETERS = {
    "MemTracker._update_snap": ("self", "u_type", "winfo", "old_mem_consumed", "old_reftype"),
    "MemTracker._update_peak_stats": ("self", "peak_state"),
    "record_memory_history": ("enabled", "context", "stacks", "max_entries"),
    "dump_snapshot": ("filename",),
}
MEMBERS = {"UpdateType": ("ADD", "DEL", "REF", "SIZE")}


def resolve(place: str) -> Any:
    """The object at a dotted place: the longest importable module, then its attributes."""
    parts = place.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(place)


def __getattr__(name: str) -> Any:
    if name not in PLACES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return resolve(PLACES[name])


def op_name(func: Any) -> tuple[str, str]:
    """An aten op's schema name and overload (torch.ops.aten.mm.default: ("aten::mm", "default"))."""
    return func._schema.name, func._overloadname


def op(name: str, overload: str) -> Any:
    """The aten op `op_name` named."""
    return getattr(getattr(torch.ops.aten, name.split("::", 1)[1]), overload)


def changed() -> list[str]:
    """Each private use the installed torch no longer has as it was read (TESTED_WITH), with
    what differs; empty when all hold."""
    found = []
    for name, place in PLACES.items():
        try:
            resolve(place)
        except (ImportError, AttributeError) as err:
            found.append(f"{name} ({place}): gone: {err}")
    for name, expected in PARAMETERS.items():
        owner, _, method = name.partition(".")
        try:
            target = getattr(resolve(PLACES[owner]), method) if method else resolve(PLACES[owner])
            parameters = tuple(inspect.signature(target).parameters)
        except (ImportError, AttributeError, ValueError) as err:
            found.append(f"{name}: gone: {err}")
            continue
        if parameters[:len(expected)] != expected:
            found.append(f"{name}: parameters {parameters}, read as {expected}")
    for name, members in MEMBERS.items():
        try:
            missing = [m for m in members if not hasattr(resolve(PLACES[name]), m)]
        except (ImportError, AttributeError) as err:
            missing = [str(err)]
        if missing:
            found.append(f"{name}: no {', '.join(missing)}")
    return found


def same_release() -> bool:
    """Whether the installed torch is the release these uses were read against."""
    return torch.__version__.split("+")[0].rsplit(".", 1)[0] == TESTED_WITH
