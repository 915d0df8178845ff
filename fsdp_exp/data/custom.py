"""Your own data: a data option whose `_target_` builds a map-style torch Dataset.

The builder (a class or a function) takes the option's other keys and returns a Dataset
whose items are (input, target) pairs of tensors:

- images or any features: input of any shape, target a class index (an int64 scalar);
- language modelling: input a sequence of token ids, target the same sequence shifted
  by one token (both int64, of length seq_len).

For task=eval, a builder that takes a `train` argument is called again with train=False.
A dataset that names its classes (`classes`, as torchvision's do, or `num_classes`) has
the model's logits checked against their number.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch.utils.data import Dataset

from fsdp_exp.data import TrainData
from fsdp_exp.errors import ConfigError
from fsdp_exp.targets import check_keywords, imported

OWN_KEYS = ("_target_", "num_workers", "input_keys", "target_key")


@dataclass
class CustomData(TrainData):
    target: str = ""
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> CustomData:
        target = node.get("_target_")
        if not isinstance(target, str) or not target:
            raise ConfigError("data._target_: name a builder that returns a torch Dataset, e.g. mypkg.make_dataset")
        kwargs = {k: v for k, v in node.items() if k not in OWN_KEYS}
        keys = node.get("input_keys")
        return cls(target, kwargs, num_workers=int(node.get("num_workers", 0)),
                   input_keys=None if keys is None else [str(k) for k in keys],
                   target_key=str(node.get("target_key", "labels")))

    def builder(self) -> Any:
        return imported("data._target_", self.target)

    def check_arguments(self) -> None:
        """Every key the option passes is one the builder takes (`train` is fsdp_exp's to give)."""
        check_keywords("data", self.target, self.builder(), self.kwargs, ("num_workers", "input_keys", "target_key"),
                       passed=("train",))

    def __getstate__(self) -> dict:
        """Ranks build their own dataset: the driver's copy, made for the checks, stays."""
        return {k: v for k, v in self.__dict__.items() if k != "_built"}

    def dataset(self, train: bool = True) -> Dataset:
        if train and "_built" in self.__dict__:
            return self.__dict__["_built"]
        built = self._build(train)
        if train:
            self.__dict__["_built"] = built
        return built

    def _build(self, train: bool) -> Dataset:
        builder = self.builder()
        self.check_arguments()
        kwargs = dict(self.kwargs)
        if not train:
            if "train" not in _parameters(builder):
                raise ConfigError(f"data: {self.target} has no held-out split for task=eval; "
                                  "give the builder a `train` argument (it gets train=False)")
            kwargs["train"] = False
        try:
            dataset = builder(**kwargs)
        except TypeError as err:
            raise ConfigError(f"data: {self.target}: {err}") from None
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ConfigError(f"data._target_={self.target}: returned a {type(dataset).__name__}, "
                              "not a map-style Dataset (with __getitem__ and __len__)")
        return dataset

    def eval_dataset(self) -> Dataset:
        return self.dataset(train=False)

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        """What the dataset says (`classes`, as torchvision's name them, or `num_classes`)."""
        dataset = self.dataset()
        classes = getattr(dataset, "classes", None)
        return len(classes) if classes is not None else getattr(dataset, "num_classes", None)

    @property
    def tokens_per_sample(self) -> int:  # type: ignore[override]
        """A sequence of token ids with a target per token: a language model's data (a dict
        item's `input_ids`, as Hugging Face names them)."""
        item = self.first_item()
        if isinstance(item, dict):
            ids = item.get("input_ids")
            return ids.shape[-1] if isinstance(ids, torch.Tensor) and ids.dim() == 1 and not ids.is_floating_point() else 0
        inputs, targets = item
        is_tokens = not inputs.is_floating_point() and inputs.dim() == 1 and targets.shape == inputs.shape
        return inputs.shape[0] if is_tokens else 0


def _parameters(builder: Any) -> set[str]:
    try:
        return set(inspect.signature(builder).parameters)
    except (TypeError, ValueError):
        return set()
