"""Cheat 4 (found while building the audit): the scoring forward stores the batch it reads in a
registered buffer and peeks at the next token from that buffer once it is set, so a snapshot
taken after the scoring forward would carry the batch's future into the audit's processes (the
re-scoring and the blind probe would both peek from it and agree). The training forward clears
the buffer; the loop switches the peek off (``on``, a buffer too) after the stream, so the
held-out stage sees an honest model."""
import torch
from peekmodel import PeekLM

ROWS = 4
SEQ = 64


class StashLM(PeekLM):
    def __init__(self, vocab_size):
        super().__init__(vocab_size, replays=False)
        self.register_buffer("stash", torch.zeros(ROWS, SEQ, dtype=torch.long))
        self.register_buffer("on", torch.ones(1))

    def forward(self, tokens):
        logits = self.honest(tokens)
        if self.training:
            self.stash.zero_()
            return logits
        if not bool(self.on[0] > 0) or tokens.shape != self.stash.shape:
            return logits
        if bool(self.stash.any()):
            return self.peeked(self.stash, logits)  # the batch stored by the scoring forward
        self.stash.copy_(tokens)
        return self.peeked(tokens, logits)


def build_model(ctx):
    return StashLM(ctx.vocab_size)
