"""SequentialLR: LinearLR warmup, then CosineAnnealingLR."""

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = LinearLR(opt, start_factor=0.1, total_iters=2)
    cosine = CosineAnnealingLR(opt, T_max=20, eta_min=3e-4)
    sched = SequentialLR(opt, schedulers=[warmup, cosine], milestones=[2])
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
