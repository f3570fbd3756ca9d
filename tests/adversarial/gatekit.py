"""Helpers for the hostile-bundle tests: a clean tiny bundle and a way to poison it."""

from __future__ import annotations

import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-1m"
SEED_TRAINING = (EXAMPLE / "training.py").read_text(encoding="utf-8")
MODELS = Path(__file__).resolve().parent / "clean_models"

ARCH_TEMPLATE = '''\
import math

import torch
import torch.nn.functional as F
from torch import nn

{top}


class Tiny(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8)
        self.head = nn.Linear(8, vocab_size)

    def forward(self, tokens):
        return self.head(F.gelu(self.emb(tokens)) / math.sqrt(8.0))


def build_model(ctx):
    model = Tiny(ctx.vocab_size)
{body}
    return model
'''


def arch(top: str = "", body: str = "") -> str:
    """The clean architecture with ``top`` at module level and ``body`` inside build_model."""
    top = textwrap.dedent(top).strip("\n")
    body = textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") if body.strip() else ""
    return ARCH_TEMPLATE.format(top=top, body=body)


def write_bundle(root: Path, files: dict[str, str | bytes]) -> Path:
    """Write ``files`` (relative path -> text or bytes) under ``root``; default architecture.py
    and training.py (the seed) when not given. Returns ``root``."""
    files = {"architecture.py": arch(), "training.py": SEED_TRAINING, **files}
    for rel, content in files.items():
        if content is None:
            continue
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")
    return root


def line_of(text: str, needle: str) -> int:
    """1-based line of the first occurrence of ``needle`` in ``text``."""
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in text")
