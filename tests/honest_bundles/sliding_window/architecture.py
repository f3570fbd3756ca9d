"""Sliding-window (local) causal attention: a banded boolean mask for SDPA."""

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS, WINDOW = 32, 2, 16


class LocalAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        i = torch.arange(t, device=x.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        self.ln1, self.attn = nn.LayerNorm(D), LocalAttention()
        self.ln2, self.mlp = nn.LayerNorm(D), nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.head = nn.Linear(D, vocab)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        x = x + self.attn(self.ln1(x))
        return self.head(x + self.mlp(self.ln2(x)))


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)
