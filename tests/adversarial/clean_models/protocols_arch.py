"""Clean architecture using what the private/eval rules still allow: super(...).__init__,
protocol dunders, allow-listed typing/dataclasses/functools names, torch.compile with a named
backend, getattr with a literal, literal format strings and module aliases."""

from __future__ import annotations

import functools
import math
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

T = TypeVar("T")
ACT = F
LABEL = "{0}x{1}"
Shape = namedtuple("Shape", ["rows", "cols"])
MaybeTensor = Optional[torch.Tensor]
TensorOrNone = torch.Tensor | None


class Pair(NamedTuple):
    a: int
    b: int


class Box(Generic[T]):
    def __init__(self, item: T):
        self.item = item

    def __repr__(self) -> str:
        return "Box({!r})".format(self.item)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> T:
        return self.item


class Point(Shape):
    def area(self) -> int:
        return self.rows * self.cols


@dataclass
class Config:
    vocab_size: int
    width: int = 16
    tags: list = field(default_factory=list)


def logged(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs)

    return inner


class Mlp(nn.Module):
    def __init__(self, width: int, act: Optional[str] = None):
        super(Mlp, self).__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.act = getattr(ACT, "gelu") if act is None else F.relu
        self.name = type(self).__name__ + torch.__version__.split("+")[0]

    @logged
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return x
        return x + self.down(self.act(self.up(x)))


class ProtoLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.mlp = Mlp(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size)
        self.label = LABEL.format(Pair(1, 2).a, Point(2, 3).area()) + str(len(Box(cfg.width)))

    def forward(self, tokens: torch.Tensor, mask: MaybeTensor = None) -> torch.Tensor:
        assert isinstance(tokens, torch.Tensor) and type(self) is not nn.Module
        x = self.emb(tokens) / math.sqrt(self.emb.embedding_dim)
        return self.head(self.mlp(x))


def build_model(ctx):
    model = ProtoLM(Config(vocab_size=ctx.vocab_size))
    if hasattr(torch, "compile") and ctx.device.startswith("cuda"):
        model.mlp = torch.compile(model.mlp, backend="inductor", mode="reduce-overhead")
    return model
