"""A plain PyTorch classifier: a stack of residual MLP blocks over flattened images."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """One residual MLP block; each instance becomes one FSDP unit (model.blocks)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Images (batch, 1, size, size) in, logits (batch, num_classes) out."""

    def __init__(self, width: int = 64, depth: int = 4, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.stem = nn.Linear(image_size * image_size, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)
