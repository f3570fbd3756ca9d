"""An evaluation pass inside the loop: model.eval() and torch.no_grad() every few steps on the
batch just trained on, then back to model.train()."""

import torch
import torch.nn.functional as F


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, batch in enumerate(ctx.iter_train_batches(model, batch_size=4, seq_len=64)):
        model.train()
        loss = lm_loss(model(batch.tokens), batch.tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 3 == 0:
            model.eval()
            with torch.no_grad():
                print(f"step {step}: train {loss.item():.3f} after {lm_loss(model(batch.tokens), batch.tokens).item():.3f}")
            model.train()
