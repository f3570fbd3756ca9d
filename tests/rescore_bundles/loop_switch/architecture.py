from peekmodel import PeekLM


def build_model(ctx):
    return PeekLM(ctx.vocab_size)
