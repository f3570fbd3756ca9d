"""A GPT of about 100M parameters on bytes (V = 257): the audit's cost bench at scale
(``bench/audit_cost.py --params 100M``). ``WIDTH = 768``, ``LAYERS = 14``: ``14 * 12 * 768^2``
= 99.1M in the blocks, plus embeddings, the head (tied) and the norms: 99.5M in all. Tokens
``[B, T]`` int64 -> logits ``[B, T, 257]`` float32."""

import math

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 768
LAYERS = 14
HEADS = 12
MAX_LEN = 256


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP; ``[B, T, WIDTH]`` -> ``[B, T, WIDTH]``."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(WIDTH, dim=-1)
        q, k, v = (z.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token ids ``[B, T]`` -> next-token logits ``[B, T, vocab_size]``."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, WIDTH)
        self.pos = nn.Embedding(MAX_LEN, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02 / (math.sqrt(2 * LAYERS) if name.endswith(("proj.weight", "down.weight")) else 1.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(ctx):
    """The model for this context (``ctx.vocab_size`` outputs)."""
    return GPT(ctx.vocab_size)
