"""Two encoders, one for images and one for captions, into one embedding space (as CLIP)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm MLP block with a residual: the FSDP unit of both encoders."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ImageCaption(nn.Module):
    """`forward(image, caption)`: each batch is a dict with those keys, which fsdp_exp passes
    as keyword arguments. Returns both embeddings, normalised, and the learnt temperature."""

    def __init__(self, image_size: int = 16, vocab: int = 64, width: int = 128, depth: int = 2,
                 embed: int = 64) -> None:
        super().__init__()
        self.image_in = nn.Linear(image_size * image_size, width)
        self.image_blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.image_out = nn.Linear(width, embed)
        self.tokens = nn.Embedding(vocab, width)
        self.caption_blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.caption_out = nn.Linear(width, embed)
        self.log_scale = nn.Parameter(torch.full((1,), 2.0))  # 1-D: fully_shard shards no scalar

    def forward(self, image: torch.Tensor, caption: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.image_in(image.flatten(1))
        for block in self.image_blocks:
            x = block(x)
        t = self.tokens(caption).mean(1)
        for block in self.caption_blocks:
            t = block(t)
        return {"image": nn.functional.normalize(self.image_out(x), dim=-1),
                "caption": nn.functional.normalize(self.caption_out(t), dim=-1),
                "scale": self.log_scale.exp()}
