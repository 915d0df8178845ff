"""A DiT-like denoiser: patches of the noisy image as tokens, transformer blocks whose
layer norms the time step modulates (adaLN), and a head that predicts each patch's noise."""

from __future__ import annotations

import math

import torch
from torch import nn


def time_features(t: torch.Tensor, width: int) -> torch.Tensor:
    """Sinusoidal features of the time steps t in [0, 1), (batch, width)."""
    half = width // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class DiTBlock(nn.Module):
    """Attention and an MLP, each after a layer norm shifted, scaled and gated by the time
    step: the FSDP unit."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.modulation = nn.Linear(width, 6 * width)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c)[:, None].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attention(h, h, h, need_weights=False)[0]
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class Denoiser(nn.Module):
    """`forward(noisy, t)`: the predicted noise, the shape of `noisy` (batch, channels, H, W)."""

    def __init__(self, image_size: int = 16, channels: int = 1, patch: int = 4, width: int = 128,
                 depth: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.patch, self.channels, self.side = patch, channels, image_size // patch
        self.patches = nn.Conv2d(channels, width, kernel_size=patch, stride=patch)
        self.position = nn.Parameter(torch.zeros(1, self.side * self.side, width))
        self.time = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(DiTBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.head = nn.Linear(width, patch * patch * channels)
        self.width = width

    def forward(self, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.patches(noisy).flatten(2).transpose(1, 2) + self.position
        c = self.time(time_features(t, self.width).to(x.dtype))
        for block in self.blocks:
            x = block(x, c)
        out = self.head(self.norm(x))  # (batch, patches, patch * patch * channels)
        b, p = out.shape[0], self.patch
        out = out.view(b, self.side, self.side, self.channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, self.channels, self.side * p, self.side * p)
