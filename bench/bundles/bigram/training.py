"""The gap-noise benchmark's bigram loop: AdamW on batches of 8 x 256 byte tokens, world size 1."""

import torch
import torch.nn.functional as F

from prism_challenge.evaluator.interface import PrismContext

BATCH = 8
SEQ_LEN = 256
LEARNING_RATE = 0.05


def train(ctx: PrismContext) -> None:
    model = ctx.build_model().to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    tokenizer = ctx.reference_tokenizer("bytes")
    seq_len = min(SEQ_LEN, ctx.max_seq_len)
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=seq_len, tokenizer=tokenizer):
        tokens = batch.tokens
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
