"""A plain loop: train on every batch."""
import torch
import torch.nn.functional as F

BATCH = 4
SEQ = 64


def step(model, opt, tokens):
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ):
        step(model, opt, batch.tokens)
