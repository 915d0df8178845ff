"""Noised images and the noise in them: items are dicts {"noisy", "t", "noise"}."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset


class NoisyImages(Dataset):
    """Images of bright squares, each noised at a random time t in [0, 1) of a cosine
    schedule: noisy = cos(t pi/2) image + sin(t pi/2) noise. The model predicts the noise
    (the `noise` key, the loss's target); `t` is a float per sample."""

    def __init__(self, num_samples: int = 2048, image_size: int = 16, seed: int = 0, train: bool = True) -> None:
        g = torch.Generator().manual_seed(seed if train else seed + 1)
        side = image_size // 4
        corners = torch.randint(0, image_size - side + 1, (num_samples, 2), generator=g)
        rows = torch.arange(image_size)
        inside_y = (rows[None, :] >= corners[:, :1]) & (rows[None, :] < corners[:, :1] + side)
        inside_x = (rows[None, :] >= corners[:, 1:]) & (rows[None, :] < corners[:, 1:] + side)
        self.images = (inside_y[:, :, None] & inside_x[:, None, :]).float().unsqueeze(1) * 2 - 1
        self.t = torch.rand(num_samples, generator=g)
        self.noise = torch.randn(self.images.shape, generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        angle = self.t[i] * math.pi / 2
        noisy = torch.cos(angle) * self.images[i] + torch.sin(angle) * self.noise[i]
        return {"noisy": noisy, "t": self.t[i], "noise": self.noise[i]}
