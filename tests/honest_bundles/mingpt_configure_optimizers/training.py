"""minGPT's trainer: the optimizer comes from model.configure_optimizers(config)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TrainConfig:
    learning_rate: float = 3e-3
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.1
    grad_norm_clip: float = 1.0


def train(ctx):
    config = TrainConfig()
    model = ctx.build_model().to(ctx.device)
    optimizer = model.configure_optimizers(config)
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        x, y = batch.tokens[:, :-1], batch.tokens[:, 1:]
        logits = model(batch.tokens)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
        optimizer.step()
