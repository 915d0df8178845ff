"""Token data for language models: synthetic learnable sequences, and bytes of a text file."""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from fsdp_exp.data import GeneratedData, TrainData
from fsdp_exp.errors import ConfigError, at_least

# Share of tokens in a synthetic sequence drawn at random instead of from the table:
# enough that the loss cannot reach zero, little enough that the table is easy to learn.
_NOISE = 0.1
HELD_OUT = 1_000_003  # offset to the seed of held-out sequences


class TokenData(TrainData):
    """Sequences of `seq_len` token ids below `vocab_size`, each target the next token."""

    seq_len: int
    vocab_size: int

    @property
    def tokens_per_sample(self) -> int:  # type: ignore[override]
        return self.seq_len

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        return self.vocab_size


@dataclass
class SyntheticTokens(GeneratedData, TokenData):
    """Sequences that mostly follow a fixed random "next token" table, with some noise.

    A model that learns the table predicts about 90% of the tokens, so the loss falls
    quickly and far; the same `seed` gives the same table and sequences on every rank.
    """

    num_samples: int = 4096
    seq_len: int = 128
    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("num_samples", "seq_len", "vocab_size"):
            at_least(f"data.{key}", getattr(self, key), 1)

    def dataset(self) -> Dataset:
        return TensorDataset(*self.sequences(self.num_samples))

    def eval_dataset(self) -> Dataset:
        """New sequences from the same table: a tenth as many, from another generator."""
        return TensorDataset(*self.sequences(max(1, self.num_samples // 10), HELD_OUT))

    def sequences(self, count: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` sequences (inputs, and targets one token later) of the table that `seed`
        fixes, drawn from a generator `offset` past it (another offset, other sequences)."""
        g = torch.Generator().manual_seed(self.seed)
        table = torch.randperm(self.vocab_size, generator=g)
        if offset:  # held out: the same table, sequences from another generator
            g = torch.Generator().manual_seed(self.seed + offset)
        return self._sequences(table, count, g)

    def _sequences(self, next_token: torch.Tensor, count: int,
                   g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = torch.empty(count, self.seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, self.vocab_size, (count,), generator=g)
        noisy = torch.rand(count, self.seq_len, generator=g) < _NOISE
        noise = torch.randint(0, self.vocab_size, (count, self.seq_len), generator=g)
        for t in range(self.seq_len):
            seqs[:, t + 1] = torch.where(noisy[:, t], noise[:, t], next_token[seqs[:, t]])
        return seqs[:, :-1], seqs[:, 1:]


def shipped_corpus() -> Path:
    """The English text shipped with the package, the default for `TextBytes`."""
    return Path(str(files("fsdp_exp.data") / "corpus.txt"))


@dataclass
class TextBytes(TokenData):
    """Byte-level language modelling on one text file: vocab 256, one sample per offset."""

    path: str | None = None  # None: the short English text shipped with fsdp_exp
    seq_len: int = 128
    eval_path: str | None = None  # held-out text for task=eval (the training text has no split)
    vocab_size = 256  # byte-level tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("data.seq_len", self.seq_len, 1)

    def eval_dataset(self) -> Dataset:
        if self.eval_path is None:
            raise ConfigError("data.eval_path: data=text has no held-out split; set it to a text file to evaluate on")
        if not Path(self.eval_path).expanduser().is_file():
            raise ConfigError(f"data.eval_path={self.eval_path}: no such file")
        return replace(self, path=self.eval_path, eval_path=None).dataset()

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
