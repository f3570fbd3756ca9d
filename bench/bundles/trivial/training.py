"""Trivial benchmark loop: AdamW on batches of 8 x 1024 byte tokens, world size 1."""

import torch
import torch.nn.functional as F

from prism_challenge.evaluator.interface import PrismContext

BATCH = 8
SEQ_LEN = 1024


def train(ctx: PrismContext) -> None:
    model = ctx.build_model().to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    tokenizer = ctx.reference_tokenizer("bytes")
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ_LEN, tokenizer=tokenizer):
        tokens = batch.tokens
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
