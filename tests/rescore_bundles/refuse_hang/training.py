"""The plain loop, which marks the model it trains as live (see architecture.py)."""
import torch
import torch.nn.functional as F

BATCH = 4
SEQ = 64


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    model.live = True
    model.armed.fill_(1.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
