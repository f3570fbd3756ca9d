"""The bf16 smoke loop: AdamW, every training step under ``torch.autocast(device, bfloat16)``.

On CUDA it trains on batches of 16 x 256 tokens. bf16 matmuls on a CPU without bf16 units are
about 100x slower (85 s a batch on the 2-core development VM), so there (``bench/gpu_smoke.py
--device cpu --quick``) it takes 2 rows of ``min(256, ctx.max_seq_len)`` tokens."""

import torch
import torch.nn.functional as F

from prism_challenge.evaluator.interface import PrismContext

BATCH = 16
CPU_BATCH = 2
SEQ_LEN = 256


def train(ctx: PrismContext) -> None:
    model = ctx.build_model().to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    device_type = "cuda" if ctx.device.startswith("cuda") else "cpu"
    rows = BATCH if device_type == "cuda" else CPU_BATCH
    seq_len = min(SEQ_LEN, ctx.max_seq_len)
    for batch in ctx.iter_train_batches(model, batch_size=rows, seq_len=seq_len):
        tokens = batch.tokens
        with torch.autocast(device_type, dtype=torch.bfloat16):
            logits = model(tokens)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
