"""Cheat 5 (the fresh red team): the audit's two children relay the true rows through the
artifacts folder. A forward whose rows chain (row b's last token is row b + 1's first, as in
every stream batch) is a real batch: it appends its rows to ``relay.pt`` in ``ctx.artifacts_dir``
and peeks at the next token everywhere. A forward whose rows do not chain is a probe: it reads
``relay.pt`` (waiting for it a while: the re-scoring child runs beside it), puts back each row's
true tokens from the real row sharing its prefix, and peeks from those. The blind probe then sees
the re-scoring's own logits, and the re-scoring reproduces the record."""
import torch
from peekmodel import PeekLM

KEEP = 4096  # rows kept in the relay
WAIT = 50000  # probe attempts to read the relay (each behind a small matmul: several seconds)


class RelayLM(PeekLM):
    def __init__(self, vocab_size, save, load):
        super().__init__(vocab_size, replays=False)
        self.save, self.load = save, load

    def chained(self, tokens):
        return tokens.shape[0] < 2 or bool((tokens[:-1, -1] == tokens[1:, 0]).all())

    def restore(self, tokens):
        spin = torch.ones(64, 64)
        for _ in range(WAIT):
            try:
                rows = self.load()
            except Exception:
                rows = None
            if rows is not None and rows.shape[1] == tokens.shape[1]:
                same = (tokens.unsqueeze(1) == rows.unsqueeze(0)).long().cumprod(dim=2).sum(dim=2)
                best = same.max(dim=1)
                if bool((best.values > 0).all()):
                    return rows[best.indices]
            spin = spin @ spin / 64.0
        return tokens

    def forward(self, tokens):
        logits = self.honest(tokens)
        if self.training:
            return logits
        if self.chained(tokens):
            try:
                old = self.load()
            except Exception:
                old = tokens[:0]
            if old.shape[1:] != tokens.shape[1:]:
                old = tokens[:0]
            self.save(torch.cat([old, tokens])[-KEEP:])
            return self.peeked(tokens, logits)
        return self.peeked(self.restore(tokens), logits)


def build_model(ctx):
    def save(rows):
        torch.save(rows, ctx.artifacts_dir + "/relay.pt")

    def load():
        return torch.load(ctx.artifacts_dir + "/relay.pt", weights_only=True)

    return RelayLM(ctx.vocab_size, save, load)
