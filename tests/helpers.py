"""Shared test helpers: tiny bundles written into a temp dir, and a fake stream."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from prism_challenge.data.stream import TokenChunk

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-1m"
SHARED = REPO.parent / "shared"

LOOP = """
import torch
import torch.nn.functional as F
from prism_challenge.evaluator.interface import PrismContext


def train(ctx: PrismContext) -> None:
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr={lr})
    for batch in ctx.iter_train_batches(model, batch_size={batch}, seq_len={seq_len}):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def write_bundle(root: Path, architecture: str, training: str | None = None, *, tokenizer: str = "bytes",
                 batch: int = 2, seq_len: int = 16, lr: float = 0.0) -> Path:
    """Write a bundle directory; ``training`` defaults to a plain SGD loop over the stream."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "architecture.py").write_text(textwrap.dedent(architecture))
    loop = training if training is not None else LOOP.format(lr=lr, batch=batch, seq_len=seq_len)
    (root / "training.py").write_text(textwrap.dedent(loop))
    (root / "prism.yaml").write_text(f"tokenizer: {tokenizer}\n")
    return root


UNIFORM_ARCH = """
import torch
from torch import nn


class Uniform(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.v = v
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, tokens):
        return torch.zeros(tokens.shape[0], tokens.shape[1], self.v) * self.bias


def build_model(ctx):
    return Uniform(ctx.vocab_size)
"""

IMPORT_OS_LOOP = """
import os

def train(ctx):
    model = ctx.build_model()
    for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
        pass
"""
"""A loop the static gate refuses (``import os``, line 2 of training.py) that would otherwise run."""


def chunks_of(ids: list[int], nbytes: list[int], size: int) -> list[TokenChunk]:
    """Split a token list into chunks of ``size`` (the feeder must not care where chunks end)."""
    a, b = np.asarray(ids, dtype=np.int64), np.asarray(nbytes, dtype=np.int64)
    return [TokenChunk(a[i : i + size], b[i : i + size]) for i in range(0, len(a), size)]
