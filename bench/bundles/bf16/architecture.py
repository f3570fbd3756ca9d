"""A small GPT whose every forward runs under bf16 autocast (bytes, V=257): the GPU smoke bench's
bf16 bundle (``bench/gpu_smoke.py``). The harness's scoring forwards, its causality probes and
the held-out probes all see bf16 matmuls, as a bf16 model on a GPU gives them."""

import math

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 256
LAYERS = 4
HEADS = 4
MAX_LEN = 512


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP; ``[B, T, WIDTH]`` -> ``[B, T, WIDTH]``."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(WIDTH, dim=-1)
        q = q.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
        k = k.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
        v = v.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH // HEADS)
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab_size]`` (float32 out of a bf16 body)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, WIDTH)
        self.pos = nn.Embedding(MAX_LEN, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab_size)
        self.register_buffer("mask", torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        with torch.autocast(self.head.weight.device.type, dtype=torch.bfloat16):
            x = self.emb(tokens) + self.pos(torch.arange(t, device=tokens.device))
            for block in self.blocks:
                x = block(x, self.mask)
            logits = self.head(self.norm(x))
        return logits.float()


def build_model(ctx):
    """The tiny GPT sized from ``ctx.vocab_size``."""
    return TinyGPT(ctx.vocab_size)
