"""Dropout in the attention and the MLP (off in eval mode: the harness scores in eval mode)."""

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS, P = 32, 2, 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(P))
        self.resid_drop = nn.Dropout(P)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=P if self.training else 0.0, is_causal=True)
        x = x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        self.drop = nn.Dropout(P)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, vocab, bias=False)

    def forward(self, tokens):
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device)))
        return self.head(self.ln_f(self.blocks(x)))


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)
