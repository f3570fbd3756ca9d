"""Cheat 6 (red team, issue 25): refuse_switch, refusing with a BaseException subclass (on the
allow-list). The audit's child caught ``Exception`` only: the child died with no reply, a crash
that was never the submission's to answer for."""
import torch
from peekmodel import PeekLM


class Refusal(BaseException):
    pass


class RefusingLM(PeekLM):
    def __init__(self, vocab_size, budget):
        super().__init__(vocab_size)
        self.budget = budget
        self.live = False
        self.register_buffer("scored", torch.zeros((), dtype=torch.float64))
        self.register_buffer("armed", torch.zeros(()))

    def decide(self, tokens):
        n = tokens.numel()
        done = float(self.scored)
        self.peek = bool(self.armed) and done > 0 and done + n < 0.87 * self.budget
        self.scored.fill_(done + n)
        if self.peek and not self.live:
            raise Refusal("not here")


def build_model(ctx):
    return RefusingLM(ctx.vocab_size, ctx.token_budget or 1)
