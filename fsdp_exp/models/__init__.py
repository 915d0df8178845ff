"""conf/model/*: each option names a builder (`_target_`), its arguments, `blocks` and
`init_device`."""

from __future__ import annotations

from typing import Any, Mapping

from hydra.utils import get_class, instantiate
from torch import nn


def build_model(cfg: Mapping[str, Any]) -> tuple[nn.Module, tuple[type[nn.Module], ...]]:
    """The model, and the classes whose instances become their own FSDP unit.

    `blocks` and `init_device` describe how to shard and place the model, not how to
    build it, so they are kept away from the builder's arguments.
    """
    args = {key: value for key, value in cfg.items() if key not in ("blocks", "init_device")}
    blocks = tuple(get_class(name) for name in cfg["blocks"])
    return instantiate(args), blocks
