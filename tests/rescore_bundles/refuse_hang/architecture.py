"""Cheat 5b (issue 25): refuse_switch's peek, made to hang where refuse_switch raises.

The peek's switch (the tokens scored so far) is a buffer, so the snapshot of an audited batch
says whether the record peeked. The loop marks its live model (``live``, a plain attribute, not
in the state_dict): a model rebuilt from a snapshot in the audit's fresh process never is. There,
a forward that would peek spins for ever instead of scoring: the audit times out (``audit.error``)
rather than catching the peek. A timeout is tried again, one snapshot per process under its own
limit: the child that spins past it is the finding ``audit_refused``."""
import torch
from peekmodel import PeekLM


class RefusingLM(PeekLM):
    def __init__(self, vocab_size, budget):
        super().__init__(vocab_size)
        self.budget = budget
        self.live = False
        self.register_buffer("scored", torch.zeros((), dtype=torch.float64))
        self.register_buffer("armed", torch.zeros(()))  # set by the loop: a fresh build never peeks

    def decide(self, tokens):
        n = tokens.numel()
        done = float(self.scored)
        self.peek = bool(self.armed) and done > 0 and done + n < 0.87 * self.budget
        self.scored.fill_(done + n)
        while self.peek and not self.live:
            n += 1


def build_model(ctx):
    return RefusingLM(ctx.vocab_size, ctx.token_budget or 1)
