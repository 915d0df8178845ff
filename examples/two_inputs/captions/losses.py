"""The contrastive loss: each image against every caption of the batch, and back."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def contrastive(output: dict[str, torch.Tensor], batch: dict) -> torch.Tensor:
    """CLIP's symmetric cross-entropy over the batch's image-caption similarities: the
    matching pair is the right class. It reads no targets: the batch's order is the pairing."""
    logits = output["scale"] * output["image"] @ output["caption"].T
    pairs = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, pairs) + F.cross_entropy(logits.T, pairs)) / 2
