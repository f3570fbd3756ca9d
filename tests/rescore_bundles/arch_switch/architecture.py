"""Cheat 2: the architecture alone switches its peek, counting the tokens it scored against
ctx.token_budget: off on the first batch and for the last 13 % of the budget."""
from peekmodel import PeekLM


class CountingLM(PeekLM):
    def __init__(self, vocab_size, budget):
        super().__init__(vocab_size)
        self.budget = budget
        self.scored = 0

    def decide(self, tokens):
        n = tokens.numel()
        self.peek = self.scored > 0 and self.scored + n < 0.87 * self.budget
        self.scored += n


def build_model(ctx):
    return CountingLM(ctx.vocab_size, ctx.token_budget or 1)
