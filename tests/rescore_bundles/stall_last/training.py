"""The plain loop for LAST + 1 batches; after the last one's record it never asks again."""
import torch
import torch.nn.functional as F

BATCH = 4
SEQ = 64
LAST = 9  # a short run: batch 9 is audited with probability 4/9


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    model.last = LAST
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ):
        if batch.step == LAST:
            n = 0
            while True:  # never asks for the next batch: its answer (and the snapshot) stays unsent
                n += 1
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
