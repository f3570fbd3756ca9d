"""A top-1 mixture of experts: tokens routed per position, outputs gathered with index_add_."""

import torch
import torch.nn.functional as F
from torch import nn

D, EXPERTS = 32, 4


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, EXPERTS)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(EXPERTS)])

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        gate = F.softmax(self.router(flat), dim=-1)
        weight, choice = gate.max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == e, as_tuple=True)[0]
            if idx.numel():
                out.index_add_(0, idx, expert(flat[idx]) * weight[idx, None])
        return out.view_as(x)


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln1, self.ln2, self.moe = nn.LayerNorm(D), nn.LayerNorm(D), MoE()
        self.head = nn.Linear(D, vocab)

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.head(x + self.moe(self.ln2(x)))


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)
