"""Input embedding and output head share one weight (GPT-2)."""

import torch
import torch.nn.functional as F
from torch import nn

D = 32


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.lm_head(self.ln_f(x))


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)
