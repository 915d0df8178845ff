"""Images of a bright bar and captions that say where it is: items are dicts."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Captioned(Dataset):
    def __init__(self, num_samples: int = 2048, image_size: int = 16, vocab: int = 64, caption_len: int = 8,
                 seed: int = 0, train: bool = True) -> None:
        g = torch.Generator().manual_seed(seed if train else seed + 1)
        self.rows = torch.randint(0, image_size, (num_samples,), generator=g)
        self.images = 0.3 * torch.randn(num_samples, image_size, image_size, generator=g)
        self.images[torch.arange(num_samples), self.rows] += 1.0
        # the caption names the bar's row among noise words
        self.captions = torch.randint(image_size, vocab, (num_samples, caption_len), generator=g)
        self.captions[:, 0] = self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "caption": self.captions[i], "row": int(self.rows[i])}
