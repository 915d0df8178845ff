"""conf/loss/*: how the model's output and the batch's targets become the loss.

One place computes it: the trainer, the estimate's trace and task=eval all call the run's
loss option, and the checks before any rank starts ask it whether the model's output
suits the targets (`check_output`), on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812

from fsdp_exp.errors import ConfigError
from fsdp_exp.groups import LossOption


@dataclass
class CrossEntropy(LossOption):
    """loss=cross_entropy: over classes (a classifier's (batch, classes) logits), every
    position's next token (a language model's (batch, seq, vocab)), or every pixel
    (segmentation's (batch, classes, H, W), with class_dim=1)."""

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

    def __call__(self, output: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = output.float()
        if self.class_dim == -1:
            logits, targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        return F.cross_entropy(logits, targets, ignore_index=self.ignore_index,
                               label_smoothing=self.label_smoothing, reduction=reduction)

    def counted(self, targets: torch.Tensor) -> int:
        """How many targets the loss averages over: those not ignored."""
        return int((targets != self.ignore_index).sum())

    def predictions(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(self.class_dim)

    def classes(self, output: torch.Tensor) -> int:
        return output.shape[self.class_dim]

    def expected(self, targets: torch.Tensor) -> list:
        """The output's shape for these targets, with `classes` where the classes go."""
        shape: list = list(targets.shape)
        return [*shape, "classes"] if self.class_dim == -1 else [shape[0], "classes", *shape[1:]]

    def check_output(self, output: object, targets: torch.Tensor, model: str, hint: str = "") -> None:
        """The model contract for cross-entropy: for targets of shape (batch, *S), logits of
        shape (batch, *S, classes), or (batch, classes, *S) with class_dim=1."""
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
        raise ConfigError(f"model: {model} returns {got} for targets of shape {list(expected)}; expected logits of "
                          f"shape {self.expected(targets)}{hint}")


@dataclass
class MeanSquaredError(LossOption):
    """loss=mse: the mean of the squared differences between the output and the targets, of
    the same shape (a regression, a denoiser's predicted noise, an autoencoder's input)."""

    classifies: ClassVar[bool] = False

    def __call__(self, output: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.mse_loss(output.float(), targets.float(), reduction=reduction)

    def counted(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def check_output(self, output: object, targets: torch.Tensor, model: str, hint: str = "") -> None:
        if isinstance(output, torch.Tensor) and output.shape == targets.shape:
            return
        got = f"an output of shape {list(output.shape)}" if isinstance(output, torch.Tensor) else \
            f"a {type(output).__name__}"
        raise ConfigError(f"loss=mse: model {model} returns {got} for targets of shape {list(targets.shape)}; "
                          "the loss compares tensors of the same shape")
