"""Trivial model for the overhead benchmark: an 8-dim embedding and a linear head (bytes, V=257)."""

from torch import nn


class Trivial(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab_size]`` from an 8-dim embedding."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8)
        self.head = nn.Linear(8, vocab_size)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def build_model(ctx):
    """An 8-dim embedding and a linear head sized from ``ctx.vocab_size``."""
    return Trivial(ctx.vocab_size)
