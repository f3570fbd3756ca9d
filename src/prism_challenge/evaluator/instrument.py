"""The instrument: the model's code length of a batch, measured before the loop trains on it.

For a batch ``tokens`` ``[B, T]`` (int64) and a tokenizer with ``V`` real tokens, the harness
puts every module in eval mode, runs ``model(tokens)`` under ``torch.no_grad()`` to get logits
``[B, T, V']`` (``V' >= V``), keeps the first ``V`` columns, takes ``log_softmax`` in float32 and
sums the negative log-probability of ``tokens[:, 1:]`` at positions ``0..T-2`` in float64:

    nats = - sum_{b, t=1..T-1} log p(tokens[b, t] | tokens[b, :t])

then restores every module's previous train/eval mode. Targets are never reduced modulo the
model's output size: that would score a different, easier sequence. Bits are ``nats / ln 2``.
This is the prequential (predictive sequential) code length of Dawid (1984), "Statistical
theory: the prequential approach", J. R. Stat. Soc. A 147(2); the per-token code lengths are the
ideal arithmetic-coding lengths ``-log2 p``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


class ContractError(RuntimeError):
    """The submission broke the harness contract (bad logits, bad batch request, ...)."""


@dataclass(frozen=True)
class BatchLoss:
    """The recorded loss of one batch.

    Attributes:
        nats: total code length of the batch's targets in nats (float64 sum); when not finite,
            the harness charges ``2 * ln(V)`` nats per target instead (see :func:`charge`).
        targets: number of scored targets, ``B * (T - 1)``.
        finite: whether the model's loss was finite.
    """

    nats: float
    targets: int
    finite: bool


def charge(nats: float, targets: int, vocab_size: int) -> tuple[float, bool]:
    """The nats recorded for a batch: ``nats`` if finite, else ``2 * ln(V)`` per target.

    Returns (recorded nats, finite flag).
    """
    if math.isfinite(nats):
        return nats, True
    return 2.0 * math.log(vocab_size) * targets, False


def check_logits(logits: object, batch: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Validate a model's output: a floating tensor ``[batch, seq_len, V' >= vocab_size]``.

    Raises:
        ContractError: naming the type or shape returned and the ``V`` required.
    """
    if type(logits) is not torch.Tensor:  # noqa: E721 - subclasses could run code while scored
        raise ContractError(
            f"model(tokens) returned {type(logits).__name__}, expected logits: a plain float torch.Tensor "
            f"[B={batch}, T={seq_len}, V'>={vocab_size}]"
        )
    shape = tuple(logits.shape)
    if (
        not logits.is_floating_point()
        or logits.dim() != 3
        or shape[0] != batch
        or shape[1] != seq_len
        or shape[2] < vocab_size
    ):
        raise ContractError(
            f"model(tokens) returned logits of shape {list(shape)} and dtype {logits.dtype}; "
            f"expected a float tensor [B={batch}, T={seq_len}, V'>={vocab_size}] "
            f"(V={vocab_size} is the tokenizer's vocabulary)"
        )
    return logits


def score_batch(model: nn.Module, tokens: torch.Tensor, vocab_size: int) -> float:
    """Total nats of ``tokens[:, 1:]`` under ``model`` in eval mode (see module docstring).

    Args:
        model: the scored module; its per-module train/eval modes are restored afterwards.
        tokens: ``[B, T]`` int64 on the model's device, ``T >= 2``.
        vocab_size: ``V``, the tokenizer's number of real tokens.

    Returns:
        Total nats (float64 sum of float32 per-target losses); may be ``inf``/``nan``.

    Raises:
        ContractError: the logits are not ``[B, T, V' >= V]`` floats.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            logits = check_logits(model(tokens), tokens.shape[0], tokens.shape[1], vocab_size)
            if logits.shape[2] != vocab_size:
                logits = logits[..., :vocab_size]
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
            picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1))  # [B, T-1, 1]
            total = -picked.double().sum()
            return float(total.item())
    finally:
        for m, mode in modes:
            m.training = mode
