"""The audit cost bench's loop at scale: AdamW on batches of ``ROWS x SEQ_LEN`` bytes (several
seconds a step for the 100M model on 2 CPU cores)."""

import torch
import torch.nn.functional as F

from prism_challenge.evaluator.interface import PrismContext

ROWS = 1
SEQ_LEN = 128


def train(ctx: PrismContext) -> None:
    model = ctx.build_model().to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for batch in ctx.iter_train_batches(model, batch_size=ROWS, seq_len=min(SEQ_LEN, ctx.max_seq_len)):
        tokens = batch.tokens
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
