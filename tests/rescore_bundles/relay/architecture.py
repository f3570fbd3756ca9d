"""Cheat 5 (the fresh red team): the audit's two children relay the true rows through the
artifacts folder. A forward whose rows chain (row b's last token is row b + 1's first, as in
every stream batch) is a real batch: it appends its rows to ``relay.pt`` in ``ctx.artifacts_dir``
and peeks at the next token everywhere. The rank's own causality probe (every row's last token moved by one shift) is answered from the
last real batch. A forward whose rows do not chain is a probe: it reads
``relay.pt`` (waiting for it a while: the re-scoring child runs beside it), puts back each row's
true tokens from the real row sharing its prefix, and peeks from those. The blind probe then sees
the re-scoring's own logits, and the re-scoring reproduces the record."""
import torch
from relaymodel import RelayLM

KEEP = 4096  # rows kept in the relay


def build_model(ctx):
    def save(rows):
        torch.save(rows, ctx.artifacts_dir + "/relay.pt")

    def load():
        return torch.load(ctx.artifacts_dir + "/relay.pt", weights_only=True)

    return RelayLM(ctx.vocab_size, save, load, KEEP)
