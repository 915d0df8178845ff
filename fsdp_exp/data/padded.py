"""data=padded_tokens: documents of any length, each one sample padded to seq_len, as a
Hugging Face causal LM takes them: a dict of `input_ids`, `attention_mask` and `labels`.

The documents come from one file, by its name:
- `.jsonl`: JSON lines, each {"text": ...}, or {"prompt": ..., "response": ...} for
  instruction tuning (the prompt's tokens are masked in `labels`), as UTF-8 bytes;
- `.bin`: a uint16 token file as nanoGPT's prepare.py writes it, split at `separator`
  (GPT-2's end-of-text token by default, which its openwebtext script puts after each);
- any other file: a text file, one document a line, as UTF-8 bytes;
- none (`path=null`): `num_samples` synthetic documents, learnable and offline: runs of
  data=synthetic_tokens' next-token table, each of a random length from a quarter of
  seq_len to all of it, its first tokens (up to a quarter) a prompt.

A document longer than seq_len is cut to its first seq_len tokens. `labels` are in line
with `input_ids` (the model shifts them by one, as transformers' causal LMs do), with -100
where the loss must not look: padding, and a prompt. So the loss is the model's own
(loss=model); tokens/s counts the tokens `attention_mask` keeps, and the summary gives the
share of padding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from fsdp_exp.data.token_file import checked_tokens
from fsdp_exp.data.tokens import HELD_OUT, SyntheticTokens, TokenData
from fsdp_exp.errors import ConfigError, at_least

IGNORED = -100  # the label the loss skips (transformers' and torch's ignore_index)
_BYTES = 256
_SCAN = 1 << 24  # tokens of a .bin file searched for separators at once


@dataclass
class PaddedTokens(TokenData):
    """Documents padded (or cut) to `seq_len` tokens, with their attention mask and labels."""

    path: str | None = None  # a .jsonl, a .bin of uint16 tokens, or a text file; null: synthetic documents
    seq_len: int = 128
    vocab_size: int | None = None  # null: 256 (bytes), or 50257 (GPT-2's) for a .bin file
    separator: int = 50256  # a .bin file's end-of-document token (GPT-2's <|endoftext|>)
    pad_id: int = 0  # the token id padding holds (attention_mask and labels mask it)
    eval_path: str | None = None  # held-out documents for task=eval, a file of the same kind
    num_samples: int = 4096  # path=null: how many synthetic documents
    seed: int = 0  # path=null: fixes the synthetic documents

    labels_in_line = True  # labels[t] is input_ids[t]: the model shifts them

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("data.seq_len", self.seq_len, 2)
        at_least("data.num_samples", self.num_samples, 1)
        tokens = self.path is not None and Path(self.path).suffix == ".bin"
        if self.vocab_size is None:
            self.vocab_size = 50257 if tokens else _BYTES
        at_least("data.vocab_size", self.vocab_size, 1)
        if not tokens and self.vocab_size < _BYTES:
            raise ConfigError(f"data.vocab_size={self.vocab_size}: text is read as bytes, ids up to 255; "
                              f"at least {_BYTES}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(f"data.pad_id={self.pad_id}: must be a token id, from 0 to data.vocab_size - 1 "
                              f"({self.vocab_size - 1})")

    def dataset(self) -> Dataset:
        return self.padded("data.path", self.path)

    def eval_dataset(self) -> Dataset:
        if self.path is None:  # new documents from the same table: a tenth as many
            documents = synthetic_documents(self, max(1, self.num_samples // 10), HELD_OUT)
            return PaddedDocuments(documents, self.seq_len, self.pad_id)
        if self.eval_path is None:
            raise ConfigError("data.eval_path: data=padded_tokens has no held-out split; set it to a file of "
                              "held-out documents to evaluate on")
        return self.padded("data.eval_path", self.eval_path)

    def padded(self, setting: str, path: str | None) -> Dataset:
        return PaddedDocuments(self.documents(setting, path), self.seq_len, self.pad_id)

    def documents(self, setting: str, path: str | None) -> Documents:
        """The file's documents that leave the loss something within seq_len; a ConfigError
        naming `setting` for a file that holds none. (Synthetic ones always do.)"""
        if path is None:
            return synthetic_documents(self, self.num_samples)
        file = Path(path).expanduser()
        setting = f"{setting}={path}"
        if not file.is_file():
            raise ConfigError(f"{setting}: no such file")
        if file.suffix == ".bin":
            found = token_documents(file, setting, self.separator, self.vocab_size)
        elif file.suffix == ".jsonl":
            found = json_documents(file, setting)
        else:
            found = Documents.of([(line.encode(), 0) for line in file.read_text(errors="replace").splitlines()])
        kept = found.answered_within(self.seq_len)
        if not len(kept):
            raise ConfigError(f"{setting}: no document in {file.name} has 2 tokens or more (past its prompt, "
                              f"within data.seq_len={self.seq_len})")
        return kept


@dataclass
class Documents:
    """Documents as spans of one run of token ids: document i is tokens[starts[i]:ends[i]],
    its first prompts[i] tokens a prompt."""

    tokens: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    prompts: np.ndarray

    @classmethod
    def of(cls, texts: list[tuple[bytes, int]]) -> Documents:
        """Byte documents, each (its bytes, how many of them are the prompt); those of fewer
        than 2 bytes are left out (a document of one token teaches nothing)."""
        kept = [(text, prompt) for text, prompt in texts if len(text) >= 2]
        lengths = np.array([len(text) for text, _ in kept], dtype=np.int64)
        ends = np.cumsum(lengths)
        tokens = np.frombuffer(b"".join(text for text, _ in kept), dtype=np.uint8)
        return cls(tokens, ends - lengths, ends, np.array([prompt for _, prompt in kept], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.starts)

    def answered_within(self, seq_len: int) -> Documents:
        """Without the documents whose prompt fills their first seq_len tokens: nothing of
        them would be left for the loss."""
        kept = self.prompts < np.minimum(self.ends - self.starts, seq_len) - 1
        return Documents(self.tokens, self.starts[kept], self.ends[kept], self.prompts[kept])


def synthetic_documents(data: PaddedTokens, count: int, offset: int = 0) -> Documents:
    """`count` runs of synthetic_tokens' table (vocabulary 256) of random lengths, a quarter of
    seq_len to all of it, each with a prompt of up to a quarter of its length."""
    table = SyntheticTokens(num_samples=count, seq_len=data.seq_len, vocab_size=_BYTES, seed=data.seed)
    runs, _ = table.sequences(count, offset)
    g = torch.Generator().manual_seed(data.seed + offset + 1)
    shortest = max(2, data.seq_len // 4)
    lengths = torch.randint(shortest, data.seq_len + 1, (count,), generator=g)
    prompts = (torch.rand(count, generator=g) * (lengths // 4)).long()
    return Documents.of([(bytes(run[:n].tolist()), int(p)) for run, n, p in zip(runs, lengths, prompts)])


def json_documents(file: Path, setting: str) -> Documents:
    """A JSON lines file's documents: each line {"text": ...}, or {"prompt": ..., "response": ...}."""
    texts = []
    with file.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{setting}: line {number} of {file.name} is not JSON ({err.msg})") from None
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                texts.append((record["text"].encode(), 0))
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and \
                    isinstance(record.get("response"), str):
                prompt = record["prompt"].encode()
                texts.append((prompt + record["response"].encode(), len(prompt)))
            else:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{setting}: line {number} of {file.name} holds {keys}; each line must be "
                                  '{"text": ...} or {"prompt": ..., "response": ...}')
    return Documents.of(texts)


def token_documents(file: Path, setting: str, separator: int, vocab_size: int) -> Documents:
    """A uint16 token file's documents: the runs between separators (a separator ends the
    document before it and is not part of it), read in stretches, never whole."""
    tokens = checked_tokens(file, setting, 2, "a document", vocab_size)
    cuts = [np.flatnonzero(tokens[at:at + _SCAN] == separator) + at for at in range(0, len(tokens), _SCAN)]
    ends = np.concatenate([*cuts, [len(tokens)]]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    long_enough = ends - starts >= 2
    return Documents(tokens, starts[long_enough], ends[long_enough], np.zeros(int(long_enough.sum()), np.int64))


class PaddedDocuments(Dataset):
    """Each document as `input_ids`, `attention_mask` (1 on the document's tokens) and
    `labels` (its ids, -100 on padding and on its prompt), seq_len long."""

    def __init__(self, documents: Documents, seq_len: int, pad_id: int) -> None:
        self.documents, self.seq_len, self.pad_id = documents, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        docs = self.documents
        start = int(docs.starts[i])
        end = min(int(docs.ends[i]), start + self.seq_len)
        ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        ids[: end - start] = torch.from_numpy(docs.tokens[start:end].astype(np.int64))
        mask = torch.zeros(self.seq_len, dtype=torch.long)
        mask[: end - start] = 1
        labels = ids.masked_fill(mask == 0, IGNORED)
        labels[: min(int(docs.prompts[i]), self.seq_len)] = IGNORED
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
