"""Rotary position embeddings with cos/sin caches in non-persistent buffers."""

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS = 32, 2
HD = D // HEADS


def rotate(x, cos, sin):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, seq):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        freqs = torch.outer(torch.arange(seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos_cached[:t], self.sin_cached[:t]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList([Block(seq) for _ in range(2)])
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)
