"""conf/data/*: where the samples come from, and how each rank reads its part of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from fsdp_exp.config import ConfigError


class TrainData:
    """A dataset of (input, target) pairs plus how to load it. Subclasses make `dataset()`.

    `tokens_per_sample` is 0 for images and the sequence length for language models.
    """

    num_workers: int = 0
    tokens_per_sample: int = 0

    def dataset(self) -> Dataset:
        raise NotImplementedError

    def batches(
        self, batch_size: int, rank: int, world_size: int, seed: int, pin_memory: bool = False
    ) -> "Batches":
        """Endless per-rank batches. Each epoch is shuffled by `seed` and split across ranks,
        so the ranks' batches at one step together form one global batch."""
        dataset = self.dataset()
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        if len(sampler) < batch_size:
            raise ConfigError(
                f"train.batch_size={batch_size}: larger than this rank's share of the data "
                f"({len(sampler)} samples); lower it or use more data"
            )
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=pin_memory,
            persistent_workers=self.num_workers > 0,
        )
        return Batches(loader, sampler)


@dataclass
class Batches:
    loader: DataLoader
    sampler: DistributedSampler
    epoch: int = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            self.sampler.set_epoch(self.epoch)
            yield from self.loader
            self.epoch += 1
