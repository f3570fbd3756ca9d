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

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


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


def score_batch(model: nn.Module, tokens: torch.Tensor, vocab_size: int,
                probe: tuple[int, int] | None = None, census: TorchDispatchMode | None = None) -> float:
    """Total nats of ``tokens[:, 1:]`` under ``model`` in eval mode (see module docstring).

    Args:
        model: the scored module; its per-module train/eval modes are restored afterwards.
        tokens: ``[B, T]`` int64 on the model's device, ``T >= 2``.
        vocab_size: ``V``, the tokenizer's number of real tokens.
        probe: ``(k, shift[, row])``: also run the causality probe (:func:`check_causal`) on
            row ``row`` (default 0) with every token at positions ``>= k`` replaced by
            ``(token + shift) mod V``.
        census: a :class:`~prism_challenge.evaluator.census.TensorCensus` to take on the scored
            forward (it only observes: the logits are the same).

    Returns:
        Total nats (float64 sum of float32 per-target losses); may be ``inf``/``nan``.

    Raises:
        ContractError: the logits are not ``[B, T, V' >= V]`` floats, or the probe found that
            a prediction depends on a later token.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            # the trusted copy: the model is handed ``tokens`` and may write to it (a red team
            # rewrote its own targets in place), so targets and probes come from this copy
            original = tokens.clone()
            with census if census is not None else contextlib.nullcontext():
                out = model(tokens)
            logits = check_logits(out, tokens.shape[0], tokens.shape[1], vocab_size)
            if logits.shape[2] != vocab_size:
                logits = logits[..., :vocab_size]
            # scored before any more submitted code runs (the probe's forward could change the logits)
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
            picked = logp.gather(-1, original[:, 1:].unsqueeze(-1))  # [B, T-1, 1]
            total = float((-picked.double().sum()).item())
            if probe is not None:
                check_causal(model, original, logits, vocab_size, *probe)
            return total
    finally:
        for m, mode in modes:
            m.training = mode


CAUSAL_RTOL = 1e-4


def check_causal(model: nn.Module, tokens: torch.Tensor, logits: torch.Tensor, vocab_size: int,
                 k: int, shift: int, row: int = 0) -> None:
    """The causality probe: predictions at positions ``< k`` must not depend on tokens ``>= k``.

    A model whose logits at position ``t`` read token ``t + 1`` (a non-causal mask, a roll of
    the input, state carried from the batch) would be scored on text it has already seen. The
    probe runs ``model`` (already in eval mode, under ``no_grad``) on a copy of row ``row`` of
    ``tokens`` alone, its positions ``>= k`` shifted by ``shift`` modulo ``V``, and requires the
    first ``k`` positions' logits to equal ``logits[row, :k]`` within ``CAUSAL_RTOL`` of their
    largest magnitude. Running the row alone costs ``1/B`` of a scoring forward and also catches
    a model that mixes rows (consecutive rows are consecutive stretches of the stream, so a row
    that sees the next one sees the future). A row whose logits before ``k`` are not finite is
    not compared (its batch is charged as non-finite). The feeder picks which batches are probed, ``k`` and ``shift``, from a secret
    random source; the submission cannot tell a probed batch from another before it is scored.

    Raises:
        ContractError: naming ``k``, the largest difference and the rule.
    """
    b, t = tokens.shape
    if not 1 <= k < t or not 1 <= shift < vocab_size or not 0 <= row < b:
        raise ValueError(f"bad probe k={k}, shift={shift}, row={row} for B={b}, T={t}, V={vocab_size}")
    changed = tokens[row : row + 1].clone()
    changed[:, k:] = (changed[:, k:] + shift) % vocab_size
    ref = logits[row : row + 1, :k].float().clone()  # copied before the model runs again: it could keep
    devices = [tokens.device] if tokens.device.type == "cuda" else []  # and change its earlier output
    with torch.random.fork_rng(devices=devices):  # the probe leaves the RNG streams as they were
        other = check_logits(model(changed), 1, t, vocab_size)[:, :k, :vocab_size].float()
    if not bool(torch.isfinite(ref).all()):  # non-finite already: the batch is charged 2 ln V per target
        return
    diff = float((other - ref).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    if not diff <= CAUSAL_RTOL * scale:  # also catches nan
        raise ContractError(
            f"the model is not causal: its logits at positions < {k} changed by {diff:.3g} when only the "
            f"tokens at positions >= {k} changed; a prediction may use earlier tokens only"
        )
