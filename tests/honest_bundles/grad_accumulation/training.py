"""Gradient accumulation: the loss divided by the micro-steps, one optimizer step every 2 batches."""

import torch
import torch.nn.functional as F

ACCUM = 2


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt.zero_grad(set_to_none=True)
    for micro, batch in enumerate(ctx.iter_train_batches(model, batch_size=4, seq_len=64)):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        (loss / ACCUM).backward()
        if (micro + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
