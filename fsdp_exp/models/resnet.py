"""torchvision's ResNet for the data's images: its stem takes the data's channels.

A model with BatchNorm, as most users' convolutional nets have: its running statistics are
buffers (which `model.init_device=meta` and offload must place on the rank's device), and it
cannot train on one sample per rank where its last stage's maps are 1x1 (28x28 images).
"""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet18, resnet34

from fsdp_exp.errors import ConfigError

DEPTHS = {18: resnet18, 34: resnet34}  # both of torchvision's BasicBlock (model.blocks)


def build_resnet(depth: int = 18, num_classes: int = 10, channels: int = 1) -> nn.Module:
    if depth not in DEPTHS:
        raise ConfigError(f"model.depth={depth}: choose one of: {', '.join(map(str, DEPTHS))}")
    model = DEPTHS[depth](num_classes=num_classes)
    model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
