"""SGD with Nesterov momentum by hand: a list of velocity buffers, updates under no_grad."""

import torch
import torch.nn.functional as F

LR, MOMENTUM = 0.05, 0.9


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    velocity = [torch.zeros_like(p) for p in params]
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p, v in zip(params, velocity):
                v.mul_(MOMENTUM).add_(p.grad)
                p.sub_(LR * (p.grad + MOMENTUM * v))
