"""conf/loss/*: how the model's output and the batch become the loss.

One place computes it: the trainer, the estimate's trace and task=eval all call the run's
loss option on the model's output and the batch (`fsdp_exp.batch.Batch`), and the checks
before any rank starts ask it whether the model's output suits the batch
(`check_output`), on the meta device. cross_entropy and mse read the batch's targets (a
pair's second, a dict's `data.target_key`); model reads the loss the model returns; custom
calls the user's function of the output and the batch as the data gave it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812

from fsdp_exp.batch import PAIR_TARGETS, Batch, describe, iter_tensors
from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.groups import LossOption
from fsdp_exp.targets import imported


def targets_of(batch: Batch, loss: str) -> torch.Tensor:
    """The batch's targets, which loss=`loss` reads; a ConfigError where it has none."""
    if batch.targets is not None:
        return batch.targets
    raise ConfigError(f"data.target_key={batch.target_key}: not in this data's batches ({batch.fields()}), and "
                      f"loss={loss} reads its targets there; set data.target_key, or use loss=model (the model "
                      "returns its loss) or loss=custom (a function of the output and the batch)")


@dataclass
class CrossEntropy(LossOption):
    """loss=cross_entropy: over classes (a classifier's (batch, classes) logits), every
    position's next token (a language model's (batch, seq, vocab)), or every pixel
    (segmentation's (batch, classes, H, W), with class_dim=1)."""

    name: ClassVar[str] = "cross_entropy"

    ignore_index: int = -100  # targets of this value add nothing (padding, prompt tokens)
    label_smoothing: float = 0.0  # 0: none; up to 1, the share of each target spread over the classes
    class_dim: int = -1  # where the output holds the classes: -1 (the last) or 1 (segmentation)

    classifies: ClassVar[bool] = True  # its output's argmax along class_dim is a prediction

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"loss.label_smoothing={self.label_smoothing}: must be at least 0 and below 1")
        if self.class_dim not in (-1, 1):
            raise ConfigError(f"loss.class_dim={self.class_dim}: choose -1 (the last dimension) or 1 "
                              "(segmentation: (batch, classes, H, W))")

    def __call__(self, output: torch.Tensor, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        logits, targets = output.float(), targets_of(batch, self.name)
        if self.class_dim == -1:
            logits, targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        return F.cross_entropy(logits, targets, ignore_index=self.ignore_index,
                               label_smoothing=self.label_smoothing, reduction=reduction)

    def items(self, batch: Batch) -> torch.Tensor:
        """The targets the loss averages over: those not ignored."""
        return (targets_of(batch, self.name) != self.ignore_index).sum()

    def counted(self, batch: Batch) -> int:
        return int(self.items(batch))

    def predictions(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(self.class_dim)

    def classes(self, output: torch.Tensor) -> int:
        return output.shape[self.class_dim]

    def expected(self, targets: torch.Tensor) -> list:
        """The output's shape for these targets, with `classes` where the classes go."""
        shape: list = list(targets.shape)
        return [*shape, "classes"] if self.class_dim == -1 else [shape[0], "classes", *shape[1:]]

    def check_output(self, output: object, batch: Batch, model: str, hint: str = "") -> None:
        """The model contract for cross-entropy: for targets of shape (batch, *S), logits of
        shape (batch, *S, classes), or (batch, classes, *S) with class_dim=1."""
        targets = targets_of(batch, self.name)
        expected = tuple(targets.shape)
        if isinstance(output, torch.Tensor) and output.dim() == len(expected) + 1:
            rest = list(output.shape)
            del rest[self.class_dim]
            if tuple(rest) == expected:
                return
        if isinstance(output, dict) or hasattr(output, "logits"):  # a dict, or a Hugging Face model's output
            keys = ", ".join(map(str, output.keys())) if hasattr(output, "keys") else "logits"
            raise ConfigError(f"model: {model} returns a {type(output).__name__} ({keys}); the trainer reads a tensor "
                              f"of logits of shape {self.expected(targets)}: return that from forward (a Hugging "
                              f"Face model's output: its .logits)")
        got = f"logits of shape {list(output.shape)}" if isinstance(output, torch.Tensor) else f"a {type(output).__name__}"
        if isinstance(output, torch.Tensor) and output.dim() == len(expected) + 1 and self.class_dim != 1 \
                and tuple(output.shape[:1]) + tuple(output.shape[2:]) == expected:
            # classes on dimension 1, as a segmentation net returns them (batch, classes, H, W)
            raise ConfigError(f"model: {model} returns {got} for targets of shape {list(expected)}: its classes are "
                              f"on dimension 1 (a segmentation net's [batch, classes, *S]); set loss.class_dim=1")
        raise ConfigError(f"model: {model} returns {got} for targets of shape {list(expected)}; expected logits of "
                          f"shape {self.expected(targets)}{hint}")


@dataclass
class MeanSquaredError(LossOption):
    """loss=mse: the mean of the squared differences between the output and the targets, of
    the same shape (a regression, a denoiser's predicted noise, an autoencoder's input)."""

    name: ClassVar[str] = "mse"

    classifies: ClassVar[bool] = False

    def __call__(self, output: torch.Tensor, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        return F.mse_loss(output.float(), targets_of(batch, self.name).float(), reduction=reduction)

    def counted(self, batch: Batch) -> int:
        return targets_of(batch, self.name).numel()

    def check_output(self, output: object, batch: Batch, model: str, hint: str = "") -> None:
        targets = targets_of(batch, self.name)
        if isinstance(output, torch.Tensor) and output.shape == targets.shape:
            return
        got = f"an output of shape {list(output.shape)}" if isinstance(output, torch.Tensor) else \
            f"a {type(output).__name__}"
        raise ConfigError(f"loss=mse: model {model} returns {got} for targets of shape {list(targets.shape)}; "
                          "the loss compares tensors of the same shape")


class ReturnedLoss(LossOption):
    """A loss of the model's own or the user's: the mean over the micro-batch. task=eval
    weighs each batch's by its samples (`counted`)."""

    classifies: ClassVar[bool] = False
    reads_targets: ClassVar[bool] = False  # the model gets the targets too, where its forward takes them

    def __call__(self, output: Any, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        loss = self.mean(output, batch)
        if reduction != "sum":
            return loss
        items = self.items(batch)  # a tensor, not read: the estimate traces this on fake tensors
        return loss * (batch.size if items is None else items)

    def counted(self, batch: Batch) -> int:
        items = self.items(batch)
        return batch.size if items is None else int(items)

    def mean(self, output: Any, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


def returned_loss(output: Any) -> Any:
    """What a model returns as its loss: the output itself, its `loss` key or attribute,
    or a tuple's one scalar (nanoGPT's `(logits, loss)`, transformers' `(loss, logits)`)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        scalars = [item for item in output if is_scalar(item)]
        return scalars[0] if len(scalars) == 1 else None
    return getattr(output, "loss", None)


def is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


@dataclass
class ModelLoss(ReturnedLoss):
    """loss=model: the model computes its loss and returns it, alone or as its output's
    `loss` (a Hugging Face model given `labels` in the batch)."""

    name: ClassVar[str] = "model"

    def mean(self, output: Any, batch: Batch) -> torch.Tensor:
        return returned_loss(output).float()

    def items(self, batch: Batch) -> torch.Tensor | None:
        """The tokens a causal LM's own loss averages over, where fsdp_exp knows its rule: a
        pair's targets not -100 (model=hf's cross-entropy over them); in-line labels not -100
        past each sequence's first (the model shifts them: data=padded_tokens). Otherwise
        None: the model's own mean, each micro-batch weighing alike."""
        labels = batch.labels
        if labels is None or labels.is_floating_point() or labels.dim() < 2:
            return None
        if batch.labels_in_line:
            return (labels[:, 1:] != -100).sum()
        return (labels != -100).sum() if PAIR_TARGETS in batch.kwargs else None

    def check_output(self, output: object, batch: Batch, model: str, hint: str = "") -> None:
        loss = returned_loss(output)
        if is_scalar(loss):
            return
        if isinstance(output, tuple) and not hasattr(output, "_fields"):
            raise ConfigError(f"loss=model: model {model} returns {describe(output)}; of a tuple, loss=model reads its "
                              "one scalar float tensor (nanoGPT's (logits, loss)), and this has "
                              f"{sum(map(is_scalar, output)) or 'none'}")
        if loss is None and not isinstance(output, torch.Tensor):
            labels = " (a Hugging Face model computes it only when the batch has `labels`)"
            raise ConfigError(f"loss=model: model {model} returns a {type(output).__name__} whose loss is None{labels}; "
                              f"the batch it was given has: {batch.fields()}")
        got = describe(loss) if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise ConfigError(f"loss=model: model {model} returns {got}; loss=model reads the loss the model returns: a "
                          "scalar float tensor, or an output with one as its `loss`. For a model that returns "
                          "predictions, choose loss=cross_entropy, mse or custom")


@dataclass
class CustomLoss(ReturnedLoss):
    """loss=custom: `loss._target_`, the user's function of the model's output and the
    batch as the data gave it (a dict, or an (input, target) pair), on the rank's device."""

    name: ClassVar[str] = "custom"

    _target_: str = ""

    def __post_init__(self) -> None:
        if not self._target_:
            raise ConfigError("loss._target_: name your loss function, e.g. loss._target_=mypkg.losses.my_loss "
                              "(it takes the model's output and the batch)")

    def function(self) -> Callable[[Any, Any], torch.Tensor]:
        """The function, imported once (it is called every micro-batch)."""
        if "_function" not in self.__dict__:
            self.__dict__["_function"] = imported("loss._target_", self._target_)
        return self.__dict__["_function"]

    def __getstate__(self) -> dict:
        """Each rank imports the function itself."""
        return {k: v for k, v in self.__dict__.items() if k != "_function"}

    def mean(self, output: Any, batch: Batch) -> torch.Tensor:
        loss = self.function()(output, batch.raw)
        if not is_scalar(loss):  # checked as it is computed: the function runs once a micro-batch
            got = describe(loss) if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
            raise ConfigError(f"loss._target_={self._target_}: returned {got}; a loss function returns a scalar "
                              "float tensor (the mean over the batch)")
        return loss

    def check_output(self, output: object, batch: Batch, model: str, hint: str = "") -> None:
        """Before launch, on the meta device: the function runs on the model's output and a
        batch. On a rank its value is checked as the trainer computes it."""
        if next(iter_tensors(output), torch.empty(0)).device.type != "meta":
            return
        try:
            self.mean(output, batch)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's function, on the model's output
            got = describe(output) if isinstance(output, (torch.Tensor, Mapping, tuple, list)) else \
                f"a {type(output).__name__}"
            raise ConfigError(f"loss._target_={self._target_}: failed on model {model}'s output ({got}) and a batch "
                              f"({describe(batch.raw)}): {one_line(err, named=True)}") from None
