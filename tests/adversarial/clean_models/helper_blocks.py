"""Helper module of a clean bundle: small building blocks."""

import functools

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


@functools.lru_cache(maxsize=8)
def causal_mask(t: int, device: torch.device) -> torch.Tensor:
    return torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))
