"""The GPT model and the token data it trains on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fsdp_exp.data.tokens import SyntheticTokens, TextBytes, shipped_corpus
from fsdp_exp.errors import ConfigError
from fsdp_exp.models.gpt import GPT_SIZES, Block, build_gpt


def tiny(vocab_size: int = 50, block_size: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    return build_gpt("tiny", vocab_size=vocab_size, block_size=block_size)


def test_logits_have_one_row_per_position_and_token() -> None:
    model = tiny()
    idx = torch.randint(0, 50, (3, 16))
    assert model(idx).shape == (3, 16, 50)
    assert model(idx[:, :5]).shape == (3, 5, 50)


def test_head_is_tied_to_the_token_embedding() -> None:
    model = tiny()
    assert model.lm_head.weight is model.wte.weight
    assert sum(isinstance(m, Block) for m in model.modules()) == GPT_SIZES["tiny"]["n_layer"]


def test_a_token_does_not_change_earlier_logits() -> None:
    model = tiny().eval()
    idx = torch.randint(0, 50, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 50
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_same_seed_gives_bitwise_equal_weights() -> None:
    a, b, c = tiny(seed=3), tiny(seed=3), tiny(seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_init_is_gpt2_style() -> None:
    model = build_gpt("tiny", vocab_size=4096, block_size=512)
    block = model.blocks[0]
    assert block.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp_out.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.1)
    assert torch.count_nonzero(block.qkv.bias) == 0
    assert list(model.buffers()) == []


def test_small_has_the_gpt2_124m_parameter_count() -> None:
    model = build_gpt("small", vocab_size=50257, block_size=1024)
    total = model.num_params(non_embedding=False)
    assert 123e6 < total < 126e6
    assert total == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    embeddings = (50257 + 1024) * 768
    assert model.num_params() == total - embeddings


def test_unknown_size_names_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="model.size=huge: choose one of: tiny, small, medium, large, xl"):
        build_gpt("huge", vocab_size=10, block_size=8)


def test_sequence_longer_than_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size=16"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


def test_synthetic_tokens_are_shifted_pairs_and_deterministic() -> None:
    data = SyntheticTokens(num_samples=32, seq_len=20, vocab_size=40, seed=1)
    assert data.tokens_per_sample == 20
    first, again = data.dataset(), data.dataset()
    other = SyntheticTokens(num_samples=32, seq_len=20, vocab_size=40, seed=2).dataset()
    x, y = first[5]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (20,)
    assert torch.equal(y[:-1], x[1:])
    assert torch.equal(first.tensors[0], again.tensors[0])
    assert not torch.equal(first.tensors[0], other.tensors[0])
    assert 0 <= first.tensors[0].min() and first.tensors[1].max() < 40


def test_tiny_gpt_learns_synthetic_tokens() -> None:
    data = SyntheticTokens(num_samples=256, seq_len=32, vocab_size=64, seed=0)
    x, y = data.dataset().tensors
    model = tiny(vocab_size=64, block_size=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(25):
        batch = slice(16 * step % 256, 16 * step % 256 + 16)
        loss = F.cross_entropy(model(x[batch]).flatten(0, 1), y[batch].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(64), rel=0.1)
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0], losses


def test_text_bytes_defaults_to_the_shipped_corpus() -> None:
    data = TextBytes(seq_len=64)
    dataset = data.dataset()
    text = shipped_corpus().read_bytes()
    assert data.tokens_per_sample == 64
    assert len(text) > 5000 and len(dataset) == len(text) - 64
    x, y = dataset[100]
    assert bytes(x.tolist()) == text[100:164]
    assert torch.equal(y[:-1], x[1:]) and y[-1].item() == text[164]
    assert x.dtype == torch.long
    x, y = dataset[len(dataset) - 1]
    assert y[-1].item() == text[-1]


def test_text_bytes_reads_a_file_of_ones_own(tmp_path: Path) -> None:
    path = tmp_path / "abc.txt"
    path.write_bytes(b"abcdefgh")
    dataset = TextBytes(path=str(path), seq_len=3).dataset()
    assert len(dataset) == 5
    x, y = dataset[4]
    assert bytes(x.tolist()) == b"efg" and bytes(y.tolist()) == b"fgh"
    with pytest.raises(IndexError):
        dataset[5]


def test_text_bytes_reports_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match=f"data.path={path}: no such file"):
        TextBytes(path=str(path)).dataset()


def test_text_bytes_reports_a_file_too_short(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_bytes(b"12345")
    with pytest.raises(ConfigError, match=r"data\.seq_len=5: .* 5 bytes"):
        TextBytes(path=str(path), seq_len=5).dataset()
    assert len(TextBytes(path=str(path), seq_len=4).dataset()) == 1
