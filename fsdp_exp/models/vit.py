"""The ViT for 28x28 grayscale images: torchvision's VisionTransformer with a 1-channel stem."""

from __future__ import annotations

import math

from torch import nn
from torchvision.models import VisionTransformer


def build_vit(
    image_size: int,
    patch_size: int,
    num_layers: int,
    num_heads: int,
    hidden_dim: int,
    mlp_dim: int,
    num_classes: int,
) -> VisionTransformer:
    model = VisionTransformer(
        image_size=image_size,
        patch_size=patch_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        mlp_dim=mlp_dim,
        num_classes=num_classes,
    )
    # torchvision's stem expects RGB. Replace it, initialised the way torchvision does.
    stem = nn.Conv2d(1, hidden_dim, kernel_size=patch_size, stride=patch_size)
    fan_in = stem.in_channels * patch_size * patch_size
    nn.init.trunc_normal_(stem.weight, std=math.sqrt(1 / fan_in))
    nn.init.zeros_(stem.bias)
    model.conv_proj = stem
    return model
