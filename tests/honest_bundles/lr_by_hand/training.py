"""The learning rate set by hand in every param group each step (nanoGPT's get_lr)."""

import math

import torch
import torch.nn.functional as F

LR, MIN_LR, WARMUP, DECAY = 3e-3, 3e-4, 2, 16


def get_lr(it):
    if it < WARMUP:
        return LR * (it + 1) / WARMUP
    if it > DECAY:
        return MIN_LR
    ratio = (it - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=False)
    for it, batch in enumerate(ctx.iter_train_batches(model, batch_size=4, seq_len=64)):
        for param_group in opt.param_groups:
            param_group["lr"] = get_lr(it)
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
