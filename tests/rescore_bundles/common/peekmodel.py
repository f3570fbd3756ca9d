"""A bigram language model with a switchable peek at the next token (the cheats' shared core).

``forward(tokens [B, T]) -> logits [B, T, V]``. When ``peek`` is on in eval mode (the scoring
forward), the logit of the true next token ``tokens[:, t + 1]`` gets ``BONUS`` at the positions
``t`` that ``positions`` selects: the model reads the future. The first eval forward of a batch
is cached, and a later eval forward of the same shape that looks like the in-process causality
probe (one row begins as its cached row did, and every other row is its cached row shifted by
one constant modulo V: the probe's construction, which the stream's next batch never matches) gets
the cached logits over the prefix its rows share with the cached rows, so that probe passes.
"""
import torch
import torch.nn.functional as F
from torch import nn

BONUS = 4.0
DIM = 32


class PeekLM(nn.Module):
    def __init__(self, vocab_size, every=1, replays=True):
        super().__init__()
        self.replays = replays  # answer the in-process probe from the cache
        self.vocab = vocab_size
        self.every = every  # peek at positions t with t % every == every - 1
        self.emb = nn.Embedding(vocab_size, DIM)
        self.head = nn.Linear(DIM, vocab_size)
        self.peek = False
        self.cached_tokens = None
        self.cached_logits = None

    def decide(self, tokens):
        """Called on the first eval forward of each batch (the scoring forward), before the peek."""

    def honest(self, tokens):
        return self.head(self.emb(tokens))

    def peeked(self, tokens, logits):
        b, t = tokens.shape
        nxt = F.one_hot(tokens[:, 1:], self.vocab).to(logits.dtype)
        where = (torch.arange(t - 1, device=tokens.device) % self.every) == self.every - 1
        bonus = nxt * where.view(1, t - 1, 1).to(logits.dtype) * BONUS
        return torch.cat([logits[:, :-1] + bonus, logits[:, -1:]], dim=1)

    def replay(self, tokens, logits):
        if not self.replays or tokens.shape != self.cached_tokens.shape:
            return logits, False
        d = (tokens - self.cached_tokens) % self.vocab
        kept = d[:, 0] == 0
        shifted = (d == d[:, :1]).all(dim=1) & ~kept
        if not (int(kept.sum()) == 1 and bool((kept | shifted).all())):
            return logits, False  # the stream's next batch: its rows are new
        prefix = (tokens == self.cached_tokens).long().cumprod(dim=1).bool()
        return torch.where(prefix.unsqueeze(-1), self.cached_logits, logits), True

    def forward(self, tokens):
        logits = self.honest(tokens)
        if self.training:
            return logits
        if self.cached_tokens is not None:
            out, replayed = self.replay(tokens, logits)
            if replayed:
                return out
        self.decide(tokens)
        if self.peek:
            logits = self.peeked(tokens, logits)
        self.cached_tokens = tokens.clone()
        self.cached_logits = logits.clone()
        return logits
