"""A GPT-2-style decoder of about 100M parameters (the GPU session's large model, phase 5 of
``bench/gpu_session.sh``).

``build_model(ctx)``: token and learned position embeddings, ``N_LAYER`` pre-norm blocks
(causal ``scaled_dot_product_attention`` with ``N_HEAD`` heads, GELU MLP x4), a final LayerNorm
and a head tied to the token embedding. Input ``tokens`` ``[B, T]`` int64, output logits
``[B, T, ctx.vocab_size]`` in the dtype of the forward (float32, or bfloat16 under autocast).
With the GPT-2 tokenizer (V = 50257) and ``ctx.max_seq_len`` 512: 9 x 7,087,872 block parameters,
38,597,376 tied embedding, 393,216 positions, 1,536 final norm = 102,782,976.
The session shrinks ``D_MODEL``, ``N_LAYER`` and ``N_HEAD`` for its CPU dry run.
"""

import math

import torch.nn.functional as F
from torch import nn
import torch

D_MODEL = 768
N_HEAD = 12
N_LAYER = 9


class Block(nn.Module):
    """Pre-norm transformer block ``[B, T, D]`` -> ``[B, T, D]``: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, N_HEAD, d // N_HEAD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token ids ``[B, T]`` -> next-token logits ``[B, T, vocab_size]``."""

    def __init__(self, vocab_size, max_seq_len):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, D_MODEL)
        self.pos = nn.Embedding(max_seq_len, D_MODEL)
        self.blocks = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(ctx):
    """The GPT sized from ``ctx.vocab_size`` and ``ctx.max_seq_len``."""
    return GPT(ctx.vocab_size, ctx.max_seq_len)
