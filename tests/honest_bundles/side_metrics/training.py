"""Side metrics: next-token accuracy and a running mean loss, printed every few steps."""

import torch
import torch.nn.functional as F


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    running, seen = 0.0, 0
    for step, batch in enumerate(ctx.iter_train_batches(model, batch_size=4, seq_len=64)):
        logits = model(batch.tokens)
        targets = batch.tokens[:, 1:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            accuracy = (logits[:, :-1].argmax(dim=-1) == targets).float().mean().item()
        running, seen = running + loss.item(), seen + 1
        if step % 4 == 0:
            print(f"step {step:4d} loss {running / seen:.4f} acc {accuracy:.3f}")
