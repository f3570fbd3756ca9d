"""A plain loop that switches the model's peek off after the stream (a buffer, in the state)."""
import torch
import torch.nn.functional as F

BATCH = 4
SEQ = 64


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ):
        tokens = batch.tokens
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.on.fill_(0.0)
