"""The instrument: the model's code length of a batch, measured before the loop trains on it.

For a batch ``tokens`` ``[B, T]`` (int64) and a tokenizer with ``V`` real tokens, the harness
puts every module in eval mode, runs ``model(tokens)`` under ``torch.no_grad()`` to get logits
``[B, T, V']`` (``V' >= V``), keeps the first ``V`` columns, takes ``log_softmax`` in float32 and
sums the negative log-probability of ``tokens[:, 1:]`` at positions ``0..T-2`` in float64
(block by block, :func:`target_logprobs`: the working set is at most :data:`SCORE_BLOCK_BYTES`
beside the model's own logits; the forward runs under the run's scoring autocast and the
harness's attention kernels, never the loop's: :func:`scoring_forward`):

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from prism_challenge.evaluator.scoringstate import scoring_state


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


SCORE_BLOCK_BYTES = 128 << 20
"""Most bytes of float32 log-probabilities the instrument holds at once: the loss is computed in
blocks of whole rows (or, for a row larger than this, of positions of one row), so scoring never
adds a second ``[B, T, V]`` float32 tensor to the model's logits."""

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``prism.yaml``'s ``scoring_autocast`` values (:data:`prism_challenge.intake.bundle.SCORING_AUTOCAST`)
-> the autocast dtype the harness runs its scoring forwards under (``None``: no autocast)."""


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """The autocast dtype of a ``scoring_autocast`` value (``None``: the default, no autocast).

    Raises:
        ValueError: a value that is not a key of :data:`AUTOCAST_DTYPES`.
    """
    if name is None:
        return None
    if name not in AUTOCAST_DTYPES:
        raise ValueError(f"scoring_autocast must be one of {', '.join(AUTOCAST_DTYPES)}, got {name!r}")
    return AUTOCAST_DTYPES[name]


PROBE_TOLERANCE_NATS: dict[torch.dtype, float] = {
    torch.float64: 1e-4,
    torch.float32: 1e-4,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
}
"""The causality probes' tolerance, in nats per scored target, by the probe's precision
(:func:`probe_precision`). Both sides of a probe run the same way (same batch shape, same row,
same kernels), so a causal model with deterministic per-row kernels matches bit for bit; the
tolerance only absorbs kernels that are not exactly causal in floating point (an FFT convolution,
say). It is one machine epsilon of the half-precision dtypes (bf16 ``2**-7``, fp16 ``2**-10``) and
the former fp32 rule's ``1e-4``, and it bounds what a model that reads the future can gain
unnoticed to that many nats per target. It is absolute, on log-probabilities: an offset added to
every logit (which leaves the scored distribution as it is) cannot widen it."""


@dataclass(frozen=True)
class Scored:
    """One scoring forward of a batch.

    Attributes:
        total: ``[]`` float64 on the model's device: the total code length in nats (the float64
            sum of ``-logprobs``), not read back yet (:attr:`nats` reads it).
        logprobs: ``[B, T-1]`` float32: the log-probability of each target ``tokens[b, t+1]``
            given ``tokens[b, :t+1]``.
        precision: the coarsest of the logits' dtype and the scoring autocast dtype.
    """

    total: torch.Tensor
    logprobs: torch.Tensor
    precision: torch.dtype

    @property
    def nats(self) -> float:
        """:attr:`total` as a Python float (may be ``inf``/``nan``); waits for the device."""
        return float(self.total.item())


def probe_precision(*dtypes: torch.dtype | None) -> torch.dtype:
    """The coarsest floating dtype of ``dtypes`` (``None`` ignored; by machine epsilon), the key of
    :data:`PROBE_TOLERANCE_NATS`. float64 when none is given."""
    given = [d for d in dtypes if d is not None]
    return max(given, key=lambda d: torch.finfo(d).eps, default=torch.float64)


def logprob_blocks(rows: int, positions: int, vocab_size: int) -> list[tuple[slice, slice]]:
    """The blocks ``(row slice, position slice)`` of a ``[rows, positions, V]`` log-probability
    computation, each at most :data:`SCORE_BLOCK_BYTES` of float32 (one position at least)."""
    per_row = positions * vocab_size * 4
    if per_row <= SCORE_BLOCK_BYTES:
        step = max(1, SCORE_BLOCK_BYTES // per_row)
        return [(slice(r, min(r + step, rows)), slice(0, positions)) for r in range(0, rows, step)]
    step = max(1, SCORE_BLOCK_BYTES // (vocab_size * 4))
    return [(slice(r, r + 1), slice(p, min(p + step, positions)))
            for r in range(rows) for p in range(0, positions, step)]


def _block_logprobs(logits: torch.Tensor, rs: slice, ps: slice, vocab_size: int) -> torch.Tensor:
    # float32 log_softmax of one block: bit for bit the same values as over the whole batch (the
    # kernel normalises each position on its own), so blocks change memory, not figures. A block
    # of whole rows takes the rows' last position too (it has no target; its values are dropped):
    # ``[rows, T, V]`` is contiguous, ``[rows, T - 1, V]`` is not and costs the kernel 1.8x the
    # time (4 x 256 x 50257 float32 on 2 cores: 0.16 s instead of 0.28 s, the same values)
    whole_rows = ps.start == 0 and ps.stop == logits.shape[1] - 1
    block = logits[rs, : ps.stop + 1] if whole_rows else logits[rs, ps]
    return torch.log_softmax(block[..., :vocab_size].float(), dim=-1)[:, : ps.stop - ps.start]


def target_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                    row: int | None = None) -> torch.Tensor:
    """``[B, T-1]`` float32 log-probabilities of the targets ``tokens[:, 1:]``, block by block.

    ``log p(tokens[b, t+1] | ...) = log_softmax(logits[b, t, :V])[tokens[b, t+1]]`` in float32
    (the logits cast up per block of :func:`logprob_blocks`). With ``row`` only the blocks that
    hold that row are computed (the other entries are left unset): the probe's values of that row
    are then computed on blocks of the same shapes as the scored ones.

    Args:
        logits: ``[B, T, V' >= V]`` floats (:func:`check_logits`).
        tokens: ``[B, T]`` int64 on the same device, the harness's copy.
        vocab_size: ``V``.
    """
    b, t = tokens.shape
    out = torch.empty(b, t - 1, dtype=torch.float32, device=logits.device)
    for rs, ps in logprob_blocks(b, t - 1, vocab_size):
        if row is not None and not rs.start <= row < rs.stop:
            continue
        idx = tokens[rs, ps.start + 1 : ps.stop + 1].unsqueeze(-1)
        out[rs, ps] = _block_logprobs(logits, rs, ps, vocab_size).gather(-1, idx).squeeze(-1)
    return out


def position_logprobs(logits: torch.Tensor, row: int, pos: int, vocab_size: int) -> torch.Tensor:
    """``[V]`` float32 log-probabilities of the next token at ``(row, pos)``, computed on the block
    of :func:`logprob_blocks` that holds it, so each value equals :func:`target_logprobs`'s bit for
    bit. ``logits`` ``[B, T, V' >= V]``, ``0 <= pos < T - 1``."""
    return positions_logprobs(logits, [(row, pos)], vocab_size)[0]


def positions_logprobs(logits: torch.Tensor, points: Sequence[tuple[int, int]], vocab_size: int
                       ) -> list[torch.Tensor]:
    """:func:`position_logprobs` at each ``(row, pos)`` of ``points``, in their order: ``[V]``
    float32 each, every block of :func:`logprob_blocks` that holds one computed once.

    Raises:
        ValueError: a point outside ``logits`` ``[B, T, V']`` (``0 <= pos < T - 1``).
    """
    b, t = logits.shape[0], logits.shape[1]
    blocks = logprob_blocks(b, t - 1, vocab_size)
    where = []
    for row, pos in points:
        i = next((i for i, (rs, ps) in enumerate(blocks)
                  if rs.start <= row < rs.stop and ps.start <= pos < ps.stop), None)
        if i is None:
            raise ValueError(f"position ({row}, {pos}) is outside logits of shape {list(logits.shape)}")
        where.append(i)
    done = {i: _block_logprobs(logits, *blocks[i], vocab_size) for i in sorted(set(where))}
    return [done[i][row - blocks[i][0].start, pos - blocks[i][1].start] for i, (row, pos) in zip(where, points)]


def scoring_forward(model: nn.Module, tokens: torch.Tensor, autocast: torch.dtype | None) -> object:
    """``model(tokens)`` under the run's scoring autocast (``None``: autocast off) and the
    harness's attention kernels, whatever autocast or ``sdpa_kernel`` the caller (the loop, in
    the stream) is inside (:func:`~prism_challenge.evaluator.scoringstate.scoring_state`). The
    caller holds ``no_grad`` and eval mode."""
    with scoring_state(tokens.device.type, autocast):
        return model(tokens)


def measure(model: nn.Module, tokens: torch.Tensor, vocab_size: int, probe: tuple[int, ...] | None = None,
            census: TorchDispatchMode | None = None, autocast: torch.dtype | None = None) -> Scored:
    """Score ``tokens[:, 1:]`` under ``model`` in eval mode (see module docstring); the probe, if any.

    Args:
        model: the scored module; its per-module train/eval modes are restored afterwards.
        tokens: ``[B, T]`` int64 on the model's device, ``T >= 2``.
        vocab_size: ``V``, the tokenizer's number of real tokens.
        probe: ``(k, shift[, row])``: also run the causality probe (:func:`check_causal`).
        census: a :class:`~prism_challenge.evaluator.census.TensorCensus` to take on the scored
            forward (it only observes: the logits are the same).
        autocast: the scoring autocast dtype (:data:`AUTOCAST_DTYPES`), for both forwards.

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
                out = scoring_forward(model, tokens, autocast)
            logits = check_logits(out, tokens.shape[0], tokens.shape[1], vocab_size)
            # scored before any more submitted code runs (the probe's forward could change the logits)
            logprobs = target_logprobs(logits, original, vocab_size)
            total = -logprobs.double().sum()  # read back by the caller: no wait for the device here
            precision = probe_precision(logits.dtype, autocast)
            del out, logits  # freed before the probe's forward: its logits take their place in memory
            if probe is not None and math.isfinite(total.item()):  # non-finite: charged 2 ln V per target
                check_causal(model, original, logprobs, vocab_size, *probe, autocast=autocast,
                             precision=precision)
            return Scored(total, logprobs, precision)
    finally:
        for m, mode in modes:
            m.training = mode


def score_batch(model: nn.Module, tokens: torch.Tensor, vocab_size: int, probe: tuple[int, ...] | None = None,
                census: TorchDispatchMode | None = None, autocast: torch.dtype | None = None) -> float:
    """Total nats of ``tokens[:, 1:]`` under ``model`` (:func:`measure`'s ``nats``): the float64
    sum of float32 per-target losses; may be ``inf``/``nan``.

    Raises:
        ContractError: see :func:`measure`.
    """
    return measure(model, tokens, vocab_size, probe, census, autocast).nats


def probe_batch(tokens: torch.Tensor, vocab_size: int, k: int, shift: int, row: int) -> torch.Tensor:
    """The probe's input: a copy of ``tokens`` ``[B, T]`` whose row ``row`` has every token at
    positions ``>= k`` replaced by ``(token + shift) mod V`` and whose other rows have every token
    so replaced; same shape, device and dtype."""
    changed = (tokens + shift) % vocab_size
    changed[row, :k] = tokens[row, :k]
    return changed


def check_causal(model: nn.Module, tokens: torch.Tensor, logprobs: torch.Tensor, vocab_size: int,
                 k: int, shift: int, row: int = 0, *, autocast: torch.dtype | None = None,
                 precision: torch.dtype = torch.float32) -> None:
    """The causality probe: predictions at positions ``< k`` must not depend on tokens ``>= k``.

    A model whose logits at position ``t`` read token ``t + 1`` (a non-causal mask, a roll of
    the input, state carried from the batch) would be scored on text it has already seen. The
    probe runs ``model`` (already in eval mode, under ``no_grad``) once more on the whole batch
    as it was scored, same shape, same row order, under the same autocast
    (:func:`probe_batch`): row ``row`` keeps its first ``k`` tokens and has the rest shifted by
    ``shift`` modulo ``V``; every other row has all its tokens shifted. The log-probabilities
    of row ``row``'s first ``k`` targets (``tokens[row, 1..k]``, the true ones) must equal the
    scored ones, ``logprobs[row, :k]``, within :data:`PROBE_TOLERANCE_NATS` of ``precision``.
    Like with like: both forwards have the same shape and run the same kernels, so the probe
    cannot be told by its shape and an honest model in any precision matches. Changing the
    other rows catches a model that mixes rows (consecutive rows are consecutive stretches of
    the stream, so a row that sees another may see the future). On every rank the feeder draws
    the same probe for the same step, so a collective inside ``forward`` stays matched. The
    caller skips a batch whose scored loss is not finite (it is charged ``2 ln V`` per target).

    Raises:
        ContractError: naming ``k``, the largest difference and the rule.
        ValueError: ``k``, ``shift`` or ``row`` out of range.
    """
    b, t = tokens.shape
    if not 1 <= k < t or not 1 <= shift < vocab_size or not 0 <= row < b:
        raise ValueError(f"bad probe k={k}, shift={shift}, row={row} for B={b}, T={t}, V={vocab_size}")
    ref = logprobs[row, :k].clone()  # copied before the model runs again: it could keep a handle on it
    changed = probe_batch(tokens, vocab_size, k, shift, row)
    devices = [tokens.device] if tokens.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the probe leaves the RNG streams as they were
        logits = check_logits(scoring_forward(model, changed, autocast), b, t, vocab_size)
    precision = probe_precision(precision, logits.dtype)
    other = target_logprobs(logits, tokens, vocab_size, row=row)[row, :k]  # the TRUE targets
    tol = PROBE_TOLERANCE_NATS[precision]
    gap = (other - ref).abs()
    if not bool(((other == ref) | (gap <= tol)).all()):  # a nan fails
        diff = float(torch.nan_to_num(gap, nan=float("inf")).max())
        raise ContractError(
            f"the model is not causal: its logits at positions < {k} changed when only later tokens "
            f"(positions >= {k} of row {row}, and the other rows) changed: a target's code length moved by "
            f"{diff:.3g} nats, over the {str(precision).removeprefix('torch.')} tolerance of {tol:.3g}; a "
            f"prediction may use earlier tokens of its own row only"
        )
