"""Estimates made earlier, kept by setup: a training run of a setup traced before (by a run
whose trace ended in time, or by task=estimate) has its own estimate at once, without a trace.

They are kept in `estimates/` of fsdp_exp's cache folder ($FSDP_EXP_CACHE, else
$XDG_CACHE_HOME/fsdp_exp, else ~/.cache/fsdp_exp), one file a setup, named by its key. The key
holds everything the estimate reads: every setting but those it does not read (the task,
train.steps, train.log_every, memory.estimate, the seed, metrics.*, profile, wandb's
names), the world size, the ranks a
node, the device, this machine, the versions of torch and of fsdp_exp's estimate, and the
source files of the model's, the data's and the optimizer's `_target_`: an edited model is
traced again. Removing the folder forgets them all.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.estimate.record import EstimateRecord

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment

LEFT_OUT = {"task", "seed", "metrics", "profile"}  # settings the estimate does not read
# and of these settings: a wandb run (offline or online) holds memory on rank 0, its names do not
LEFT_OUT_OF = {"train": {"steps", "log_every"}, "memory": {"estimate"},
               "wandb": {"project", "entity", "group", "tags", "id", "job_type"}}


def cache_dir() -> Path:
    """fsdp_exp's cache folder: $FSDP_EXP_CACHE, $XDG_CACHE_HOME/fsdp_exp or ~/.cache/fsdp_exp."""
    if os.environ.get("FSDP_EXP_CACHE"):
        return Path(os.environ["FSDP_EXP_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fsdp_exp"


def setup_key(exp: Experiment, world_size: int, ranks_per_node: int | None, on_gpu: bool) -> str:
    """The key of the estimate of a rank's training at train.batch_size for this setup."""
    described = []
    for f in fields(exp):
        value = getattr(exp, f.name)
        if f.name in LEFT_OUT:
            continue
        if f.name in LEFT_OUT_OF:
            value = {t.name: getattr(value, t.name) for t in fields(value) if t.name not in LEFT_OUT_OF[f.name]}
        described.append(f"{f.name}={value!r}")
    described += [f"world_size={world_size}", f"ranks_per_node={ranks_per_node}", f"on_gpu={on_gpu}",
                  *this_machine()]
    digest = hashlib.sha256("\n".join(described).encode())
    for path in sorted(_sources(exp)):
        digest.update(path.encode() + b"\0" + Path(path).read_bytes())
    return digest.hexdigest()[:32]


def this_machine() -> list[str]:
    """What a kept figure measured on this machine holds for: the machine, torch and Python."""
    import torch

    return [f"machine={platform.node()} {platform.machine()}", f"torch={torch.__version__}",
            f"python={sys.version_info[:2]}"]


def _sources(exp: Experiment) -> set[str]:
    """The source files whose code the estimate runs: fsdp_exp's estimate, and the modules of
    the model's, the data's and the optimizer's `_target_` (where they are files)."""
    found = {str(p) for p in Path(__file__).parent.glob("*.py")}
    for target in _targets(exp):
        module = target.rpartition(".")[0]
        while module:
            spec = _spec(module)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                found.add(spec.origin)
                break
            module = module.rpartition(".")[0]
    return found


def _spec(module: str) -> Any:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _targets(exp: Experiment) -> list[str]:
    """The model's, the user's data's (built-in data has none) and the optimizer's `_target_`."""
    targets = [exp.model.target, getattr(exp.data, "target", None), exp.optimizer.get("_target_")]
    return [t for t in targets if isinstance(t, str)]


def earlier(key: str) -> EstimateRecord | None:
    """The estimate kept under `key` (saying where it was kept), or None."""
    path = cache_dir() / "estimates" / f"{key}.json"
    record = EstimateRecord.read_from(path)
    if record is not None:
        record.reused_from = str(path)
    return record


def keep(key: str, record: EstimateRecord) -> None:
    """`record` kept under `key` for the runs of its setup (a record of why the setup cannot
    be traced too: the caller keeps only a failure of the trace itself). A cache that cannot
    be written is skipped: the estimate is the run's."""
    path = cache_dir() / "estimates" / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        record.write_to(path)
    except OSError:
        pass
