"""conf/model/*: each option names a builder (`_target_`), its arguments, `blocks` and
`init_device`."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from hydra.utils import get_class, instantiate
from torch import nn


def build_model(cfg: Mapping[str, Any]) -> tuple[nn.Module, tuple[type[nn.Module], ...]]:
    """The model, and the classes whose instances become their own FSDP unit.

    `blocks` and `init_device` describe how to shard and place the model, not how to
    build it, so they are kept away from the builder's arguments. With `blocks` empty,
    the model's own choice, when it names one (`own_blocks`).
    """
    args = {key: value for key, value in cfg.items() if key not in ("blocks", "init_device")}
    model = instantiate(args)
    blocks = tuple(get_class(name) for name in cfg["blocks"]) or own_blocks(model)
    return model, blocks


def own_blocks(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes the model (or a module inside it) names in `_no_split_modules`, the
    Hugging Face convention for "keep each of these whole": its layers."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    classes = (type(module) for module in model.modules() if type(module).__name__ in names)
    return tuple(dict.fromkeys(classes))


def block_classes(cfg: Mapping[str, Any]) -> tuple[type[nn.Module], ...]:
    """The block classes of the model `cfg` describes, without building its weights."""
    if cfg["blocks"]:
        return tuple(get_class(name) for name in cfg["blocks"])
    with torch.device("meta"):
        return build_model(cfg)[1]
