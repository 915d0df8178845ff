"""conf/model/*: a model option is a builder (`_target_`, a class or a function), the
keyword arguments it takes, `blocks` and `init_device`.

The schema is open: fsdp_exp types its own two keys and passes every other key to the
builder, so a user's model with arguments fsdp_exp cannot know needs no code here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from hydra.utils import get_class
from torch import nn

from fsdp_exp.errors import Choice, ConfigError, one_line
from fsdp_exp.targets import check_keywords, imported



class InitDevice(Choice):
    cpu = "cpu"  # build, then move to the device
    meta = "meta"  # build without memory, shard, then fill each rank's shards
OWN_KEYS = ("_target_", "blocks", "init_device")
NO_BUILDER = ("model._target_: name the builder, a class or function such as mypkg.Net "
              "(model=custom model._target_=mypkg.Net)")


@dataclass
class ModelSpec:
    """How to build the model and how to shard and place it.

    target: the builder's import path; it returns an nn.Module whose forward takes a
      batch of inputs and returns logits (see the model contract in docs/own_model.md).
    kwargs: every other key of the option, passed to the builder.
    blocks: import paths of the classes whose instances become FSDP units.
    init_device: cpu (build, then move to the device) | meta (build without memory,
      shard, then fill each rank's shards).
    """

    target: str
    kwargs: dict = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    init_device: InitDevice = InitDevice.cpu

    def __post_init__(self) -> None:
        try:  # the model group is open: its own keys are typed here, not by OmegaConf
            self.init_device = InitDevice(self.init_device)
        except ValueError:
            raise ConfigError(f"model.init_device={self.init_device}: choose one of: "
                              f"{', '.join(d.value for d in InitDevice)}") from None

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> ModelSpec:
        """From the composed `model` node: its own keys typed, the rest the builder's."""
        target = node.get("_target_")
        if not isinstance(target, str) or not target or target == "???":
            raise ConfigError(NO_BUILDER)
        blocks = node.get("blocks") or []
        if isinstance(blocks, str) or not all(isinstance(name, str) for name in blocks):
            raise ConfigError(f"model.blocks={blocks}: a list of class import paths, e.g. [mypkg.Block]")
        kwargs = {key: value for key, value in node.items() if key not in OWN_KEYS}
        return cls(target, kwargs, list(blocks), str(node.get("init_device", "cpu")))

    @property
    def name(self) -> str:
        return self.target

    def as_dict(self) -> dict:
        """The option as it was composed (what checkpoints record)."""
        return {"_target_": self.target, **self.kwargs, "blocks": list(self.blocks), "init_device": self.init_device}

    def builder(self) -> Callable[..., nn.Module]:
        return imported("model._target_", self.target)

    def block_classes(self) -> tuple[type[nn.Module], ...]:
        classes = []
        for name in self.blocks:
            try:
                classes.append(get_class(name))
            except Exception as err:
                raise ConfigError(f"model.blocks: cannot import {name} ({one_line(err)})") from None
        return tuple(classes)

    def check_arguments(self) -> None:
        """Every key the option passes is one the builder takes."""
        check_keywords("model", self.target, self.builder(), self.kwargs, ("blocks", "init_device"),
                       "; model=custom starts another builder with none of this option's keys")

    def build(self) -> tuple[nn.Module, tuple[type[nn.Module], ...]]:
        """The model, and the classes whose instances become their own FSDP unit."""
        model = self.builder()(**self.kwargs)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model._target_={self.target}: returned a {type(model).__name__}, not a torch.nn.Module")
        return model, self.block_classes() or own_blocks(model)


def own_blocks(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The blocks a model names itself (Hugging Face's `_no_split_modules`), by class name."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    if not names:
        return ()
    found: dict[str, type[nn.Module]] = {}
    for module in model.modules():
        if type(module).__name__ in names:
            found.setdefault(type(module).__name__, type(module))
    return tuple(found.values())


def build_model(model: ModelSpec | Mapping[str, Any]) -> tuple[nn.Module, tuple[type[nn.Module], ...]]:
    """The model and its block classes, from a spec or a model option as a mapping."""
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)
    return spec.build()
