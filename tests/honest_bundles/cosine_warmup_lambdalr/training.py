"""Linear warmup then cosine decay, as a LambdaLR stepped every batch."""

import math

import torch
import torch.nn.functional as F

WARMUP = 2


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    total = max(ctx.token_budget // (4 * 64), WARMUP + 1)

    def lr_lambda(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        progress = (step - WARMUP) / max(1, total - WARMUP)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
