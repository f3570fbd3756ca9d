"""Cheat 7 (red team, issue 25): peek on the last batch the loop takes, then stall.

The answer to a record (audited or not) rides on the next BATCH frame, which rank 0 reads only
when the loop asks for it; a loop that never asks again (an endless loop after its last batch)
is stopped as ``stalled`` and scored on what it recorded. If the last batch was drawn, its
snapshot never arrives: the audit "could not run" rather than catching the peek."""
from peekmodel import PeekLM


class LastPeekLM(PeekLM):
    def __init__(self, vocab_size):
        super().__init__(vocab_size)
        self.batches = 0
        self.last = 1 << 30  # set by the loop

    def decide(self, tokens):
        self.peek = self.batches == self.last
        self.batches += 1


def build_model(ctx):
    return LastPeekLM(ctx.vocab_size)
