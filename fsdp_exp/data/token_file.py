"""data=token_file: the uint16 token files of nanoGPT-style experiments, train.bin and val.bin.

Each file is a flat run of token ids with no header, as `np.array(ids, np.uint16).tofile`
writes it (nanoGPT's prepare.py scripts do exactly that). A sample is a window of
seq_len + 1 tokens: the input is its first seq_len tokens, the target its last seq_len.
Windows start every `stride` tokens, so the samples are a fixed numbered list:
DistributedSampler shuffles and splits them per epoch, and a resumed run finds its place
by counting samples, as with every other dataset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from fsdp_exp.data.tokens import TokenData
from fsdp_exp.errors import ConfigError, at_least

# Token ids are checked against vocab_size whenever the data is built (on the driver before
# any rank starts, then on each rank). A file of up to _SCAN_TOKENS tokens (128 MB, a few
# ms from the page cache) is read whole; a bigger one in _SCAN_STRETCHES evenly spaced
# stretches of the same total, so that a 20 GB file is not read through before step 1.
# An id the sample misses stops the run when its window is read (TokenWindows).
_SCAN_TOKENS = 1 << 26
_SCAN_STRETCHES = 256
_UINT16_IDS = 1 << 16
# llm.c and modded-nanogpt put a header of 256 int32 before the tokens, starting with this.
_LLMC_MAGIC = 20240520


@dataclass
class TokenFile(TokenData):
    """Windows of a uint16 token file; `path` is a directory holding train.bin (and val.bin
    for task=eval) or one .bin file, which then has no held-out split.

    `vocab_size` is the tokenizer's: GPT-2's BPE by default, as nanoGPT's openwebtext and
    shakespeare scripts use. Every id in the file must be below it, and it must not exceed
    model.vocab_size (the model may be padded larger, as nanoGPT pads to 50304).
    """

    path: str | None = None
    seq_len: int = 1024
    stride: int | None = None  # tokens from one window's start to the next; None: seq_len
    vocab_size: int = 50257

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("seq_len", "vocab_size"):
            at_least(f"data.{key}", getattr(self, key), 1)
        if self.stride is not None and self.stride < 1:
            raise ConfigError(f"data.stride={self.stride}: must be at least 1, or null for seq_len")
        if self.vocab_size > _UINT16_IDS:
            raise ConfigError(f"data.vocab_size={self.vocab_size}: uint16 files hold ids below "
                              f"{_UINT16_IDS}, so at most {_UINT16_IDS}")

    def dataset(self) -> Dataset:
        """The files are checked here: on the driver before any rank starts (when the ranks
        run on this machine), and on each rank."""
        train = self._train_file()
        self._open_checked(train)
        return TokenWindows(train, self.seq_len, self.stride or self.seq_len, self.vocab_size)

    def eval_dataset(self) -> Dataset:
        """val.bin in windows that do not overlap, so every held-out token after the first is
        predicted exactly once, whatever the training stride."""
        where = Path(self.path).expanduser()
        if where.is_file():
            raise ConfigError(f"data.path={self.path}: one .bin file has no held-out split; for task=eval "
                              "set it to a directory holding train.bin and val.bin")
        val = where / "val.bin"
        if not val.is_file():
            raise ConfigError(f"data.path={self.path}: no val.bin in this directory; task=eval reads "
                              "the held-out tokens from it")
        self._open_checked(val)
        return TokenWindows(val, self.seq_len, self.seq_len, self.vocab_size)

    def _train_file(self) -> Path:
        if self.path is None:
            raise ConfigError("data.path=null: set it to a directory holding train.bin (and val.bin), "
                              "or to one .bin file")
        where = Path(self.path).expanduser()
        if where.is_dir():
            if not (where / "train.bin").is_file():
                raise ConfigError(f"data.path={self.path}: no train.bin in this directory")
            return where / "train.bin"
        if not where.exists():
            raise ConfigError(f"data.path={self.path}: no such file or directory")
        if where.suffix != ".bin" or not where.is_file():
            raise ConfigError(f"data.path={self.path}: not a directory or a .bin file of uint16 tokens")
        return where

    def _open_checked(self, file: Path) -> None:
        checked_tokens(file, f"data.path={self.path}", self.seq_len + 1, f"data.seq_len={self.seq_len}",
                       self.vocab_size)


def checked_tokens(file: Path, setting: str, needed: int, why: str, vocab_size: int) -> np.memmap:
    """`file`'s uint16 tokens, read through a memory map; a ConfigError naming `setting` for
    a file that is not whole uint16 tokens, holds fewer than `needed` (which `why` needs),
    starts with llm.c's header or holds an id at or above vocab_size."""
    size = file.stat().st_size
    if size % 2:
        raise ConfigError(f"{setting}: {file.name} has {size} bytes, an odd number; "
                          "uint16 tokens take 2 bytes each")
    if size // 2 < needed:
        raise ConfigError(f"{setting}: {file.name} holds {size // 2} tokens; {why} needs at least {needed}")
    tokens = np.memmap(file, dtype=np.uint16, mode="r")
    if size >= 1024 and tokens[:2].view(np.int32)[0] == _LLMC_MAGIC:
        raise ConfigError(f"{setting}: {file.name} starts with llm.c's header (magic "
                          f"{_LLMC_MAGIC}); fsdp_exp reads headerless files as nanoGPT writes them")
    bad = first_bad_id(tokens, vocab_size)
    if bad is not None:
        offset, token = bad
        raise ConfigError(f"{setting}: {file.name} holds token id {token} at token "
                          f"{offset}; ids must be below data.vocab_size={vocab_size}")
    return tokens


def first_bad_id(tokens: np.ndarray, vocab_size: int, budget: int = _SCAN_TOKENS,
                 stretches: int = _SCAN_STRETCHES) -> tuple[int, int] | None:
    """(offset, id) of the first id >= vocab_size found, reading at most `budget` tokens:
    all of them, or `stretches` evenly spaced stretches from the first token to the last."""
    if vocab_size >= _UINT16_IDS:
        return None
    if len(tokens) <= budget:
        starts, length = [0], len(tokens)
    else:
        length = budget // stretches
        starts = np.linspace(0, len(tokens) - length, stretches).astype(np.int64).tolist()
    for start in starts:
        stretch = tokens[start : start + length]
        if int(stretch.max()) >= vocab_size:
            at = int(np.argmax(stretch >= vocab_size))
            return start + at, int(stretch[at])
    return None


class TokenWindows(Dataset):
    """Windows of seq_len + 1 tokens starting every `stride` tokens of a uint16 file, read on
    demand through a memory map, so a file of any size costs no memory up front."""

    def __init__(self, file: Path, seq_len: int, stride: int, vocab_size: int) -> None:
        self.file, self.seq_len, self.stride, self.vocab_size = file, seq_len, stride, vocab_size
        self.num_tokens = file.stat().st_size // 2
        assert self.num_tokens >= seq_len + 1, "TokenFile checks the length"
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        # Opened where it is read: a DataLoader worker started by spawn gets the path, not the data.
        if self._tokens is None:
            self._tokens = np.memmap(self.file, dtype=np.uint16, mode="r")
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return (self.num_tokens - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.stride
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        if int(window.max()) >= self.vocab_size:  # an id the sampled check at build time missed
            at = int((window >= self.vocab_size).nonzero()[0])
            raise ValueError(f"{self.file} holds token id {int(window[at])} at token {start + at}; "
                             f"ids must be below data.vocab_size={self.vocab_size}")
        return window[:-1], window[1:]
