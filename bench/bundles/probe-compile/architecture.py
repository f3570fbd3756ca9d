"""A tiny causal decoder language model (about 1M parameters with the GPT-2 tokenizer).

``build_model(ctx)`` returns a GPT-style decoder: token and learned position embeddings,
``N_LAYER`` pre-norm blocks (causal multi-head self-attention + GELU MLP), a final LayerNorm and
an output head tied to the token embedding. Input ``tokens`` ``[B, T]`` int64, output logits
``[B, T, ctx.vocab_size]`` float32. No module-level side effects: everything happens in
``build_model``.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL = 20
N_HEAD = 4
N_LAYER = 2
MLP_RATIO = 4


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, MLP_RATIO * d_model)
        self.out = nn.Linear(MLP_RATIO * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """Token ids ``[B, T]`` -> next-token logits ``[B, T, vocab_size]``."""

    def __init__(self, vocab_size: int, max_seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, D_MODEL)
        self.pos = nn.Embedding(max_seq_len, D_MODEL)
        self.blocks = nn.ModuleList([Block(D_MODEL, N_HEAD) for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: counted once
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(ctx):
    """The model for this challenge context: sized from ``ctx.vocab_size`` and ``ctx.max_seq_len``."""
    return TinyLM(ctx.vocab_size, ctx.max_seq_len)
