"""Cheat 3: a peek at the next token at one position in six, on every batch."""
from peekmodel import PeekLM


def build_model(ctx):
    model = PeekLM(ctx.vocab_size, every=6)
    model.peek = True
    return model
