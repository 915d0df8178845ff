"""A batch as the data gives it, and what of it the model and the loss read.

A data set's items are (input, target) pairs, or dicts. A pair's batch is the model's one
input and the loss's targets (given to the model as `targets` too, when the loss is the
model's and its forward takes them). A dict's batch is passed to the model as keyword arguments,
as Hugging Face models and torchtitan's take theirs: every key the model's `forward` takes,
or `data.input_keys`. The loss reads its targets at `data.target_key` (`labels`): loss=model
leaves them to the model (a Hugging Face model given `labels` returns its own loss), and
loss=custom reads the whole batch. Tensors, also in nested lists and dicts, go to the
rank's device; other fields (strings, ids) pass through as the DataLoader collated them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_exp.errors import ConfigError


@dataclass
class Batch:
    """One micro-batch on the rank's device: `raw`, as the data gave it; the model's
    positional and keyword inputs; the loss's targets (None where the batch has none)."""

    raw: Any
    args: tuple
    kwargs: dict
    targets: torch.Tensor | None
    target_key: str | None = None  # where a dict batch's targets are (data.target_key)
    labels_in_line: bool = False  # its targets are in line with its input_ids: the model shifts them

    @property
    def labels(self) -> torch.Tensor | None:
        """The targets the model was given (a dict's at `target_key`, a pair's as `targets`), if any."""
        given = self.kwargs.get(self.target_key) if self.target_key else None
        given = self.kwargs.get(PAIR_TARGETS) if given is None else given
        return given if isinstance(given, torch.Tensor) else None

    def forward(self, model: torch.nn.Module) -> Any:
        return model(*self.args, **self.kwargs)

    @property
    def token_ids(self) -> torch.Tensor | None:
        """Token data's ids, (batch, seq): a pair's input, a dict's `input_ids`; else None."""
        ids = self.raw.get("input_ids") if isinstance(self.raw, Mapping) else self.args[0] if self.args else None
        return ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() == 2 else None

    def tokens(self, ignore_index: int = -100) -> torch.Tensor | None:
        """For token data: how many tokens the loss sees, on the device (read it later:
        reading waits for the GPU). Padding is what `attention_mask` masks, else targets
        equal to `ignore_index`. None for other data."""
        if self.token_ids is None:
            return None
        mask = self.raw.get("attention_mask") if isinstance(self.raw, Mapping) else None
        if isinstance(mask, torch.Tensor):
            return mask.sum()
        if self.targets is not None and not self.targets.is_floating_point():
            return (self.targets != ignore_index).sum()
        return None

    def positions(self) -> int:
        """Every token position of the batch, padding included (0 for other data)."""
        ids = self.token_ids
        return 0 if ids is None else ids.numel()

    def fields(self) -> str:
        """What the batch holds, for a refusal: a dict's keys, or its shape in a few words."""
        return ", ".join(map(str, self.raw)) if isinstance(self.raw, Mapping) else describe(self.raw)

    @property
    def size(self) -> int:
        """How many samples it holds."""
        first = next(iter_tensors(self.raw), None)
        return 0 if first is None else first.shape[0]


# The keyword a pair's target is given to the model as, when the loss is the model's own
# (or custom) and its forward takes it: nanoGPT's `GPT.forward(idx, targets=None)`.
PAIR_TARGETS = "targets"


@dataclass(frozen=True)
class BatchKeys:
    """Which keys of a dict batch the model and the loss read (data.input_keys, data.target_key)."""

    inputs: tuple[str, ...] | None = None  # None: every key the model's forward takes
    target: str = "labels"
    labels_in_line: bool = False  # the data's labels are in line with input_ids (data=padded_tokens)

    def read(self, raw: Any, takes: set[str] | None, loss_reads_targets: bool,
             device: torch.device | str | None = None) -> Batch:
        """`raw` (moved to `device`, when given) as the model's inputs and the loss's targets.
        `takes`: the keywords the model's forward takes (`forward_keys`). `loss_reads_targets`:
        the loss takes its targets from the batch (cross_entropy, mse), so they are kept from
        the model; otherwise (model, custom) the model gets them too when it takes them: a
        dict's at their key, a pair's as `targets`."""
        if device is not None:
            raw = to_device(raw, device)
        if isinstance(raw, Mapping):
            targets = raw.get(self.target) if isinstance(raw.get(self.target), torch.Tensor) else None
            kwargs = {k: raw[k] for k in self.input_keys(raw, takes, loss_reads_targets)}
            return Batch(raw, (), kwargs, targets, self.target, self.labels_in_line)
        if isinstance(raw, Sequence) and len(raw) == 2:
            targets = raw[1] if isinstance(raw[1], torch.Tensor) else torch.as_tensor(raw[1])
            given = not loss_reads_targets and takes is not None and PAIR_TARGETS in takes
            return Batch(raw, (raw[0],), {PAIR_TARGETS: targets} if given else {}, targets)
        raise ConfigError(f"data: a batch is {describe(raw)}; items must be (input, target) pairs or dicts")

    def input_keys(self, raw: Mapping, takes: set[str] | None, loss_reads_targets: bool) -> list[str]:
        if self.inputs is not None:
            missing = [k for k in self.inputs if k not in raw]
            if missing:
                raise ConfigError(f"data.input_keys=[{', '.join(self.inputs)}]: the batch has no "
                                  f"{', '.join(missing)}; its keys: {', '.join(map(str, raw))}")
            return list(self.inputs)
        keys = [k for k in raw if takes is None or k in takes]
        if loss_reads_targets:
            keys = [k for k in keys if k != self.target]
        return keys


@dataclass
class Batches:
    """The data's micro-batches as it gives them, and what of a dict batch the model and the loss read."""

    items: Iterable
    keys: BatchKeys = field(default_factory=BatchKeys)


def forward_keys(model: torch.nn.Module | None) -> set[str] | None:
    """The keyword arguments the model's forward takes (`model`: without the wrappers of
    fsdp_exp.sharding.unwrap); None: any (it takes **kwargs, or its signature cannot be read)."""
    parameters = forward_parameters(model)
    if parameters is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in NAMED}


def required_keys(model: torch.nn.Module | None) -> list[str]:
    """The forward's named parameters without a default, which a dict batch must give."""
    return [p.name for p in forward_parameters(model) or () if p.kind in NAMED and p.default is inspect.Parameter.empty]


NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def forward_parameters(model: torch.nn.Module | None) -> list[inspect.Parameter] | None:
    if model is None:
        return None
    module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def to_device(value: Any, device: torch.device | str) -> Any:
    """Every tensor in `value` (a tensor, or lists, tuples and dicts of them) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in `value`, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from iter_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_tensors(v)


def stacked(item: Any, size: int) -> Any:
    """A batch of `size` samples shaped like `item` (a data set's item), as the DataLoader
    would collate them, of zeros: tensors get a leading batch dimension, numbers become
    tensors of them, other fields are repeated in a list. Inside FakeTensorMode it takes no
    memory."""
    if isinstance(item, torch.Tensor):
        return torch.zeros((size, *item.shape), dtype=item.dtype)
    if isinstance(item, bool):
        return torch.zeros(size, dtype=torch.bool)
    if isinstance(item, int):
        return torch.zeros(size, dtype=torch.int64)
    if isinstance(item, float):
        return torch.zeros(size, dtype=torch.float64)
    if isinstance(item, Mapping):
        return {k: stacked(v, size) for k, v in item.items()}
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(stacked(v, size) for v in item))
    if isinstance(item, (list, tuple)):
        return [stacked(v, size) for v in item]
    return [item] * size


def describe(value: Any) -> str:
    """A batch or an item in a few words: `a dict (input_ids: Tensor[8, 64], labels: Tensor[8, 64])`."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, Mapping):
        parts = ", ".join(f"{k}: {describe(v) if isinstance(v, torch.Tensor) else type(v).__name__}"
                          for k, v in list(value.items())[:6])
        return f"a {type(value).__name__} ({parts}{', ...' if len(value) > 6 else ''})"
    if isinstance(value, (tuple, list)):
        parts = ", ".join(describe(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value[:4])
        return f"a {type(value).__name__} of {len(value)} ({parts}{', ...' if len(value) > 4 else ''})"
    return f"a {type(value).__name__}"
