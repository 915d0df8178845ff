"""A decoder-only transformer language model in the GPT-2 layout, in plain PyTorch.

Each `Block` is meant to be its own FSDP unit, so everything a layer owns lives in it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_exp.errors import ConfigError

# Shapes by name. `small` to `xl` are the GPT-2 family (124M, 350M, 774M, 1.5B with a
# 50257-token vocabulary); `tiny` is for tests and quick runs on a CPU.
GPT_SIZES: dict[str, dict] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64},
    "small": {"n_layer": 12, "n_head": 12, "n_embd": 768},
    "medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024},
    "large": {"n_layer": 36, "n_head": 20, "n_embd": 1280},
    "xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600},
}


class Block(nn.Module):
    """One transformer layer: pre-norm causal self-attention, then a pre-norm 4x MLP.

    Normalising before each sublayer keeps the residual stream unscaled, which lets
    deep stacks train without warm-up tricks.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attn_out = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp_in = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_out = nn.Linear(4 * n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # (B, T, 3C) -> three (B, heads, T, head_dim) tensors.
        q, k, v = (
            self.qkv(x)
            .view(batch, seq, 3, self.n_head, width // self.n_head)
            .permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.attn_out(y))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.mlp_out(F.gelu(self.mlp_in(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, a stack of `Block`s, and a head tied to the embedding.

    Tying the head to `wte` saves vocab_size x n_embd parameters, the largest single
    matrix in the small sizes.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2's init. The residual output projections are scaled down by depth so that
        the residual stream's variance does not grow with the number of layers."""
        for module in self.modules():
            if module is self.lm_head:
                continue  # same tensor as wte.weight, initialised once there
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn_out.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp_out.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids (B, T); position t sees tokens <= t."""
        seq = idx.shape[1]
        if seq > self.block_size:
            raise ValueError(f"sequence length {seq} is longer than block_size={self.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @property
    def max_seq_len(self) -> int:
        return self.block_size

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, tied weights once. `non_embedding` leaves out wte and wpe,
        the figure usually quoted when comparing model sizes by compute."""
        total = sum(p.numel() for p in self.parameters())  # parameters() skips the tied copy
        if non_embedding:
            total -= self.wte.weight.numel() + self.wpe.weight.numel()
        return total


def build_gpt(size: str, vocab_size: int, block_size: int, dropout: float = 0.0) -> GPT:
    """A GPT of one of the named shapes in `GPT_SIZES`."""
    if size not in GPT_SIZES:
        raise ConfigError(f"model.size={size}: choose one of: {', '.join(GPT_SIZES)}")
    return GPT(vocab_size=vocab_size, block_size=block_size, dropout=dropout, **GPT_SIZES[size])
