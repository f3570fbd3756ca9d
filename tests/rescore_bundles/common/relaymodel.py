"""The relay cheats' shared model (``relay``, ``xrelay``): a forward whose rows chain (row b's
last token is row b + 1's first, as in every stream batch) is a real batch: it appends its rows to
the relay (``save``) and peeks at the next token everywhere. The rank's own causality probe (every
row's last token moved by one shift) is answered from the last real batch. A forward whose rows
do not chain is a probe: it reads the relay (``load``, waiting for it a while), puts back each
row's true tokens from the real row sharing its prefix, and peeks from those."""
import torch
from peekmodel import PeekLM

WAIT = 50000  # probe attempts to read the relay (each behind a small matmul: several seconds)


class RelayLM(PeekLM):
    def __init__(self, vocab_size, save, load, keep):
        super().__init__(vocab_size, replays=False)
        self.save, self.load, self.keep = save, load, keep  # keep: rows kept in the relay
        self.patience = WAIT  # once a wait found nothing, the next probe does not wait
        self.last = None  # the last real batch this process scored

    def in_process_probe(self, tokens):
        """Whether this is the rank's own causality probe of the last batch: every row's last token
        moved by one shift (mod V); it is answered from that batch."""
        if self.last is None or self.last.shape != tokens.shape:
            return False
        d = (tokens - self.last) % self.vocab
        return bool((d[:, -1] == d[0, -1]).all()) and int(d[0, -1]) != 0

    def chained(self, tokens):
        return tokens.shape[0] < 2 or bool((tokens[:-1, -1] == tokens[1:, 0]).all())

    def match(self, tokens, rows):
        """Each row's true tokens from the latest relay row sharing the longest prefix with it
        (the row itself when none shares its first token), and whether every row found one."""
        rows = rows.flip(0)  # the latest first: max() keeps the first of equals
        same = (tokens.unsqueeze(1) == rows.unsqueeze(0)).long().cumprod(dim=2).sum(dim=2)
        best = same.max(dim=1)
        found = best.values > 0
        return torch.where(found.unsqueeze(1), rows[best.indices], tokens), bool(found.all())

    def restore(self, tokens):
        spin = torch.ones(64, 64)
        out = tokens
        for _ in range(self.patience):
            try:
                rows = self.load()
            except Exception:
                rows = None
            if rows is not None and rows.shape[1] == tokens.shape[1]:
                out, every = self.match(tokens, rows)
                if every:
                    return out
            spin = spin @ spin / 64.0
        self.patience = 1
        return out

    def forward(self, tokens):
        logits = self.honest(tokens)
        if self.training:
            return logits
        if self.in_process_probe(tokens):
            return self.peeked(self.last, logits)
        if self.chained(tokens):
            self.last = tokens.clone()
            try:
                old = self.load()
            except Exception:
                old = tokens[:0]
            if old.shape[1:] != tokens.shape[1:]:
                old = tokens[:0]
            self.save(torch.cat([old, tokens])[-self.keep:])
            return self.peeked(tokens, logits)
        return self.peeked(self.restore(tokens), logits)
