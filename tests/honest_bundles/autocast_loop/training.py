"""Mixed precision, the standard idiom: the whole loop inside ``torch.autocast`` (bf16). The
harness's scoring forward sets its own autocast state, so the loop's does not leak into it
(issue 26)."""

import torch
import torch.nn.functional as F

BATCH, SEQ = 4, 64


def next_token_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.autocast(device_type=torch.device(ctx.device).type, dtype=torch.bfloat16):
        for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=SEQ):
            loss = next_token_loss(model(batch.tokens), batch.tokens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
