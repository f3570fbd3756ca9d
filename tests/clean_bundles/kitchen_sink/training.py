"""Kitchen-sink loop: AdamW with weight-decay groups, warm-up + cosine schedule, gradient
accumulation, autocast, torch.compile on CUDA, DDP, clipping and a rank-0 checkpoint."""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from architecture import build_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR
from torch.utils.data import DistributedSampler

from prism_challenge.evaluator.interface import PrismContext

ACCUM = 2
WARMUP = 10


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    v = logits.size(-1)
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, v), tokens[:, 1:].reshape(-1))


def train(ctx: PrismContext) -> None:
    distributed = ctx.world_size > 1 and dist.is_available()
    if distributed and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if ctx.device.startswith("cuda") else "gloo")
    if ctx.device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(ctx.local_rank)
    model = build_model(ctx).to(ctx.device)
    model.train()
    runner = model
    if ctx.device.startswith("cuda"):
        runner = torch.compile(model)
    if distributed:
        runner = DDP(runner, device_ids=[ctx.local_rank] if ctx.device.startswith("cuda") else None)
    _ = DistributedSampler(range(ctx.world_size * 4), num_replicas=ctx.world_size, rank=ctx.rank)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    warm = LambdaLR(opt, lambda step: min(1.0, (step + 1) / WARMUP))
    cosine = CosineAnnealingLR(opt, T_max=1000)
    amp_dtype = torch.bfloat16 if ctx.device.startswith("cuda") else torch.float32
    history = []
    step = 0
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=ctx.max_seq_len):
        tokens = batch.tokens
        with torch.autocast(device_type="cuda" if ctx.device.startswith("cuda") else "cpu", dtype=amp_dtype,
                            enabled=ctx.device.startswith("cuda")):
            loss = loss_of(runner(tokens), tokens) / ACCUM
        loss.backward()
        step += 1
        if step % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            (warm if step < WARMUP else cosine).step()
        with torch.no_grad():
            history.append(loss.detach().float().item())
        lr = opt.param_groups[0]["lr"]
        if not math.isfinite(lr):
            break
    if distributed:
        total = torch.tensor([sum(history)], device=ctx.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        dist.barrier()
    model.eval()
    if ctx.rank == 0 and ctx.artifacts_dir:
        torch.save(model.state_dict(), ctx.artifacts_dir + "/final.pt")
    if distributed:
        dist.destroy_process_group()
