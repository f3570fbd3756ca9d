"""torch.compile of the model (inductor: g++ on CPU); the harness is given the module itself."""

import torch
import torch.nn.functional as F


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = compiled(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
