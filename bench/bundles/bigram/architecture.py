"""A bytes bigram for the gap-noise benchmark: next-byte logits from the current byte alone."""

import torch
from torch import nn


class Bigram(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab_size]``: one learned row per byte."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, vocab_size)
        nn.init.normal_(self.emb.weight, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens)


def build_model(ctx):
    """A bigram sized from ``ctx.vocab_size``."""
    return Bigram(ctx.vocab_size)
