"""Mixed precision, the cast: the whole model in bf16 (``.to(torch.bfloat16)``), AdamW on bf16
weights. Scored in its own dtypes by every process (issue 26)."""

import torch
import torch.nn.functional as F

BATCH, SEQ = 4, 64


def next_token_loss(logits, tokens):
    logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(ctx):
    model = ctx.build_model().to(ctx.device).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ):
        loss = next_token_loss(model(batch.tokens), batch.tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
