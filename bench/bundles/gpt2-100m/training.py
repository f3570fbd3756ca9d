"""The large model's loop (``bench/gpu_session.sh`` phase 5): AdamW on batches of ``BATCH`` rows
of ``ctx.max_seq_len`` tokens, the forward and loss under bf16 autocast when ``AUTOCAST`` is on
(nanoGPT's idiom; the session's bf16 variant turns it on and sets ``scoring_autocast: bf16`` in
``prism.yaml``, so the harness's scoring forward runs in the same precision)."""

import torch
import torch.nn.functional as F

from prism_challenge.evaluator.interface import PrismContext

BATCH = 16
AUTOCAST = False
LEARNING_RATE = 6e-4


def train(ctx: PrismContext) -> None:
    model = ctx.build_model().to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    device_type = "cuda" if ctx.device.startswith("cuda") else "cpu"
    tokenizer = ctx.reference_tokenizer("gpt2")
    for batch in ctx.iter_train_batches(model, batch_size=BATCH, seq_len=ctx.max_seq_len, tokenizer=tokenizer):
        tokens = batch.tokens
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=AUTOCAST):
            logits = model(tokens)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
