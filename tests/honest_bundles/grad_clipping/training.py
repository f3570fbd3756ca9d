"""Gradient clipping by norm (its returned total norm logged) and by value."""

import torch
import torch.nn.functional as F


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    norms = []
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 5.0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)))
        opt.step()
    print("mean grad norm", sum(norms) / max(1, len(norms)))
