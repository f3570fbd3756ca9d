"""The stock EMA: torch.optim.swa_utils.AveragedModel with get_ema_multi_avg_fn, updated every
step; its averaged weights are loaded into the model after the stream."""

import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema_model.update_parameters(model)
    model.load_state_dict(ema_model.module.state_dict())
