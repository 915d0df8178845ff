"""A map-style dataset of (image, label) pairs: a bright square whose corner is the label."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset


class Squares(TensorDataset):
    classes = ["top left", "top right", "bottom left", "bottom right"]  # as torchvision's datasets name them


def squares(num_samples: int = 2048, image_size: int = 28, seed: int = 0, train: bool = True) -> Dataset:
    """Four classes: the quadrant the square sits in. `train=False` gives new samples
    (fsdp_exp's task=eval asks for them that way)."""
    g = torch.Generator().manual_seed(seed if train else seed + 1)
    labels = torch.randint(0, 4, (num_samples,), generator=g)
    images = 0.3 * torch.randn(num_samples, 1, image_size, image_size, generator=g)
    half, side = image_size // 2, image_size // 4
    for i, label in enumerate(labels.tolist()):
        top, left = (label // 2) * half, (label % 2) * half
        images[i, 0, top + 2:top + 2 + side, left + 2:left + 2 + side] += 1.0
    return Squares(images, labels)
