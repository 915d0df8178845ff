"""Token data for language models: synthetic learnable sequences, and bytes of a text file."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from fsdp_exp.config import ConfigError
from fsdp_exp.data import TrainData

# Share of tokens in a synthetic sequence drawn at random instead of from the table:
# enough that the loss cannot reach zero, little enough that the table is easy to learn.
_NOISE = 0.1


@dataclass
class SyntheticTokens(TrainData):
    """Sequences that mostly follow a fixed random "next token" table, with some noise.

    A model that learns the table predicts about 90% of the tokens, so the loss falls
    quickly and far; the same `seed` gives the same table and sequences on every rank.
    """

    num_samples: int = 4096
    seq_len: int = 128
    vocab_size: int = 256
    seed: int = 0
    num_workers: int = 0

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    def dataset(self) -> Dataset:
        g = torch.Generator().manual_seed(self.seed)
        next_token = torch.randperm(self.vocab_size, generator=g)
        seqs = torch.empty(self.num_samples, self.seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, self.vocab_size, (self.num_samples,), generator=g)
        noisy = torch.rand(self.num_samples, self.seq_len, generator=g) < _NOISE
        noise = torch.randint(0, self.vocab_size, (self.num_samples, self.seq_len), generator=g)
        for t in range(self.seq_len):
            seqs[:, t + 1] = torch.where(noisy[:, t], noise[:, t], next_token[seqs[:, t]])
        return TensorDataset(seqs[:, :-1], seqs[:, 1:])


def shipped_corpus() -> Path:
    """The English text shipped with the package, the default for `TextBytes`."""
    return Path(str(files("fsdp_exp.data") / "corpus.txt"))


@dataclass
class TextBytes(TrainData):
    """Byte-level language modelling on one text file: vocab 256, one sample per offset."""

    path: str | None = None
    seq_len: int = 128
    num_workers: int = 0

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    def dataset(self) -> Dataset:
        path = shipped_corpus() if self.path is None else Path(self.path).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.path={self.path}: no such file")
        data = path.read_bytes()
        if self.seq_len < 1 or len(data) < self.seq_len + 1:
            raise ConfigError(
                f"data.seq_len={self.seq_len}: {path} has {len(data)} bytes; "
                f"it needs at least seq_len + 1 and seq_len must be at least 1"
            )
        return ByteWindows(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.seq_len)


class ByteWindows(Dataset):
    """Every window of `seq_len` bytes and the window one byte later, cut on demand so
    that a text of N bytes costs N bytes of memory rather than N x seq_len."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.data) - self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        window = self.data[i : i + self.seq_len + 1].long()
        return window[:-1], window[1:]
