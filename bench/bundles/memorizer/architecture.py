"""A memorizing bundle for the gap-noise benchmark: the bytes bigram plus a table of the stream.

``tail_text.py`` (written by ``bench/gap_noise.py``, never committed) holds ``IDS``, the token
ids of a stretch of the train stream around its last 10 %, and ``ALPHA``, a logit boost in nats.
The model adds ``ALPHA`` to the logit of the byte that followed the same ``CONTEXT`` bytes in
``IDS``: causal (it reads only the current and earlier tokens), a function of its buffers and
its input only, so the audit reproduces it. On the stream's tail nearly every context is in the
table; on held-out text almost none is: the tail bpb drops below the val bpb, the memorization
gap the verdict measures.
"""

import torch
from torch import nn

from tail_text import ALPHA, IDS

CONTEXT = 6
BASE = 257


class Memorizer(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab_size]``: bigram + the remembered next byte."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, vocab_size)
        nn.init.normal_(self.emb.weight, std=0.01)
        pows = torch.tensor([BASE ** (CONTEXT - 1 - j) for j in range(CONTEXT)], dtype=torch.int64)
        ids = torch.tensor(IDS, dtype=torch.int64)
        keys = (ids.unfold(0, CONTEXT, 1)[:-1] * pows).sum(-1)
        keys, order = torch.sort(keys, stable=True)
        self.register_buffer("pows", pows)
        self.register_buffer("keys", keys)
        self.register_buffer("vals", ids[CONTEXT:][order])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.emb(tokens)
        if tokens.shape[1] < CONTEXT:
            return logits
        key = (tokens.unfold(1, CONTEXT, 1) * self.pows).sum(-1)  # [B, T - CONTEXT + 1]
        idx = torch.searchsorted(self.keys, key).clamp(max=self.keys.shape[0] - 1)
        hit = (self.keys[idx] == key).to(logits.dtype) * ALPHA
        boost = torch.zeros_like(logits[:, CONTEXT - 1:])
        boost.scatter_(2, self.vals[idx].unsqueeze(-1), hit.unsqueeze(-1))
        return torch.cat([logits[:, :CONTEXT - 1], logits[:, CONTEXT - 1:] + boost], dim=1)


def build_model(ctx):
    """The memorizer sized from ``ctx.vocab_size``."""
    return Memorizer(ctx.vocab_size)
