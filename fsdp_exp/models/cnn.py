"""The classic two-conv MNIST net from pytorch/examples, returning logits."""

from __future__ import annotations

import torch
from torch import nn


class MnistCNN(nn.Module):
    def __init__(self, num_classes: int = 10, dropout1: float = 0.25, dropout2: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(dropout1)
        self.dropout2 = nn.Dropout(dropout2)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = self.dropout1(torch.max_pool2d(x, 2))
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(self.dropout2(x))
