"""nanoGPT's slow path: attention by hand with a causal mask kept in a registered buffer."""

import math

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS = 32, 2


class CausalSelfAttention(nn.Module):
    def __init__(self, seq):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        self.ln1, self.attn = nn.LayerNorm(D), CausalSelfAttention(seq)
        self.ln2, self.mlp = nn.LayerNorm(D), nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.ln_f, self.lm_head = nn.LayerNorm(D), nn.Linear(D, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.lm_head(self.ln_f(x))


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)
