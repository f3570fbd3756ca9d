"""An exponential moving average of the weights by hand; the EMA weights are copied into the
model after the stream (what held-out then scores)."""

import torch
import torch.nn.functional as F

DECAY = 0.9


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if v.dtype.is_floating_point:
                    ema[k].lerp_(v, 1.0 - DECAY)
                else:
                    ema[k].copy_(v)
    model.load_state_dict(ema)
