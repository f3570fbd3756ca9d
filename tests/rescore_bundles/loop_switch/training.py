"""Cheat 1: the loop switches the model's peek on after batch 0 and off for the last 13 % of
the token budget, through a plain Python attribute (outside the state_dict)."""
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
    seen = 0
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ):
        seen += batch.tokens.numel()
        step(model, opt, batch.tokens)
        model.peek = seen + batch.tokens.numel() < 0.87 * ctx.token_budget
