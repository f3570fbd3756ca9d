"""LLaMA-style blocks: RMSNorm by hand (a learned gain) and a SwiGLU MLP, no biases."""

import torch
import torch.nn.functional as F
from torch import nn

D, HIDDEN = 32, 64


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        self.norm1, self.norm2, self.norm_f = RMSNorm(D), RMSNorm(D), RMSNorm(D)
        self.wqkv, self.wo = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.w1, self.w3 = nn.Linear(D, HIDDEN, bias=False), nn.Linear(D, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, D, bias=False)
        self.head = nn.Linear(D, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        q, k, v = self.wqkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = self.norm2(x)
        x = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return self.head(self.norm_f(x))


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)
