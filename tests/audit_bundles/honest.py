"""An honest training step (optionally compiled) for tests/test_audit.py."""
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class Config:
    vocab: int = 64
    dim: int = 16


def train(artifacts, compiled):
    cfg = Config()
    model = nn.Sequential(nn.Embedding(cfg.vocab, cfg.dim), nn.Linear(cfg.dim, cfg.vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    run = torch.compile(model) if compiled else model
    x = torch.randint(0, cfg.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = F.cross_entropy(run(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    torch.save(model.state_dict(), artifacts + "/state.pt")
    return float(loss)
