"""The cheats' model with its peek never switched on: an honest bigram model."""
from peekmodel import PeekLM


def build_model(ctx):
    return PeekLM(ctx.vocab_size, replays=False)
