"""Clean architecture with the output head tied to the token embedding."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab_size: int
    width: int = 32
    heads: int = 4
    max_len: int = 64


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.out = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(d, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class TiedLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.max_len, cfg.width))
        self.attn = Attention(cfg)
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=1.0 / math.sqrt(cfg.width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        x = x + self.attn(self.norm(x))
        return self.head(x)


def build_model(ctx):
    return TiedLM(Config(vocab_size=ctx.vocab_size, max_len=ctx.max_seq_len))
