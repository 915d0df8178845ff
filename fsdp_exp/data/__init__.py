"""conf/data/*: where the samples come from, and how each rank reads its part of them."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from fsdp_exp.batch import BatchKeys, describe
from fsdp_exp.errors import ConfigError, at_least

WORKERS_START = "fork" if sys.platform == "linux" else None  # DataLoader workers: forked where Linux forks them


@dataclass(kw_only=True)
class TrainData:
    """A dataset of (input, target) pairs plus how to load it. Subclasses make `dataset()`.

    `tokens_per_sample` is 0 for images and the sequence length for language models.
    `num_classes`: how many distinct targets there are (classes, or the token vocabulary),
    when known; the model's logits must have at least that many. Every data option has
    `num_workers`, `input_keys` and `target_key` (keyword-only, so that each option's own
    fields keep their order; the two keys say what of a dict batch the model and the loss
    read, fsdp_exp.batch).
    """

    num_workers: int = 0  # DataLoader worker processes per rank
    input_keys: list[str] | None = None  # a dict batch's keys the model takes (null: those its forward takes)
    target_key: str = "labels"  # a dict batch's key the loss reads its targets at
    tokens_per_sample = 0
    num_classes = None
    labels_in_line = False  # a dict's labels[t] is input_ids[t], which the model shifts (data=padded_tokens)

    def __post_init__(self) -> None:
        at_least("data.num_workers", self.num_workers, 0)

    @property
    def batch_keys(self) -> BatchKeys:
        """What of a dict batch the model and the loss read (fsdp_exp.batch)."""
        return BatchKeys(None if self.input_keys is None else tuple(self.input_keys), self.target_key,
                         self.labels_in_line)

    def dataset(self) -> Dataset:
        raise NotImplementedError

    generated = False  # made from a seed on each rank, not read from files

    def share_per_rank(self, world_size: int) -> int | None:
        """The samples each of `world_size` ranks reads an epoch (as `batches` splits them: no
        rank's batch can be larger), or None where it cannot be known before the ranks read it."""
        return len(self.dataset()) // world_size

    def first_item(self) -> tuple[torch.Tensor, torch.Tensor] | dict:
        """The data set's first item as (input, target) tensors, or a dict (its keys the
        model's keyword arguments, fsdp_exp.batch), as the trainer reads every item; a
        ConfigError saying what it is instead."""
        item = self.dataset()[0]
        if isinstance(item, Mapping) and item and all(isinstance(k, str) for k in item):
            return dict(item)
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ConfigError(f"data: items must be (input, target) pairs or dicts of named fields; the first is "
                              f"{describe(item)}; have the data set return the model's input and the loss's target")
        tensors = []
        for name, part in zip(("input", "target"), item):
            try:
                tensors.append(torch.as_tensor(part))
            except (TypeError, ValueError, RuntimeError):
                raise ConfigError(f"data: the first item's {name} is {describe(part)}, not a tensor; items must be "
                                  "(input, target) pairs of tensors (or numbers, for a target)") from None
        return tensors[0], tensors[1]

    def eval_dataset(self) -> Dataset:
        """Samples held out from training, for task=eval."""
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
        return Batches(dataset, sampler, batch_size, world_size, self.num_workers, pin_memory)


class GeneratedData(TrainData):
    """Data made from a seed: as many samples as asked for (`num_samples`)."""

    num_samples: int

    generated = True

    def share_per_rank(self, world_size: int) -> int | None:
        return self.num_samples // world_size


class EpochAfterEpoch(Sampler[int]):
    """This rank's sample indices, epoch after epoch without end, from where `batches` is
    when iteration starts: each epoch the rank's share of its shuffled order, cut to whole
    batches. One DataLoader reads them for the whole run, so its workers (and their prefetch)
    carry over an epoch's start instead of starting again there."""

    def __init__(self, batches: "Batches") -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[int]:
        epoch, skip = self.batches.epoch, self.batches.position * self.batches.batch_size
        sampler = self.batches.sampler
        while True:
            sampler.set_epoch(epoch)
            yield from list(sampler)[skip:self.batches.per_epoch * self.batches.batch_size]
            epoch, skip = epoch + 1, 0


@dataclass
class Batches:
    """Endless batches that know where they are: `state_dict()` says how far into which
    epoch, and `load_state_dict` continues from there, at this or another world size.

    The global batch at each step is the next slice of the epoch's shuffled order, at any
    world size, so the position is kept in samples of that order.
    """

    dataset: Dataset
    sampler: DistributedSampler
    batch_size: int
    world_size: int
    num_workers: int = 0
    pin_memory: bool = False
    epoch: int = 0
    position: int = 0  # batches handed out in this epoch

    @property
    def per_epoch(self) -> int:
        """Whole batches in this rank's share of an epoch."""
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.position >= self.per_epoch:  # saved at a larger world size, at an epoch's end
            self.epoch, self.position = self.epoch + 1, 0
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=EpochAfterEpoch(self),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            # Its own generator: starting to read must not draw from the global RNG, or a
            # resumed run's dropout would differ from an uninterrupted one.
            generator=torch.Generator(),
            # Workers forked from the rank, sharing its data set's pages, as Linux's
            # DataLoader does: a rank started by spawn or a forkserver (every launcher
            # here) would otherwise start each worker that way too, a fresh interpreter
            # with its own copy of the data set (0.28 GB a worker for the default ViT).
            multiprocessing_context=WORKERS_START if self.num_workers else None,
        )
        for batch in loader:
            self.position += 1
            if self.position == self.per_epoch:
                self.epoch, self.position = self.epoch + 1, 0
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples": self.position * self.batch_size * self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["samples"]) // (self.batch_size * self.world_size)
