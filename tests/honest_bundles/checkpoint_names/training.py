"""Checkpoints every N steps under formatted names in ctx.artifacts_dir (f-string, + str(step))."""

import torch
import torch.nn.functional as F

EVERY = 3


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, batch in enumerate(ctx.iter_train_batches(model, batch_size=4, seq_len=64)):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if ctx.rank == 0 and step % EVERY == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            torch.save(state, f"{ctx.artifacts_dir}/ckpt_{step:06d}.pt")
            torch.save(model.state_dict(), ctx.artifacts_dir + "/model_" + str(step) + ".pt")
    if ctx.rank == 0:
        last = torch.load(f"{ctx.artifacts_dir}/ckpt_{0:06d}.pt", weights_only=True)
        print("first checkpoint holds step", last["step"])
