"""The held-out stage's blind causality probe (see :mod:`prism_challenge.audit.heldout`).

The in-process probe can be answered from a cache by a model that remembers the rows it has just
scored. So for up to :data:`BLIND_PROBES` held-out rows the trained model's log-probability of a
token ``k`` is computed twice: in the held-out process, from the batch as it was scored, and in
a second, fresh process that is only ever shown a batch of the same shape, of real held-out text
from elsewhere in the prefix, in which that row keeps its own tokens before ``k``.
Like with like: both forwards see a ``[B, T]`` batch with the row at the same index, run the same
kernels, and take the log-probabilities on blocks of the same shapes
(:func:`~prism_challenge.evaluator.instrument.position_logprobs`), so a causal model gives the
same value bit for bit; the tolerance (:data:`~prism_challenge.evaluator.instrument.PROBE_TOLERANCE_NATS`
of the precision the fresh process reports, at least the bundle's ``scoring_autocast``) only absorbs
kernels that are not exactly causal in floating point. Anything else is
``HeldoutError("contract: ...")``, which zeroes the run. The other rows, from another batch, also
catch a model that reads another row of the batch (consecutive rows are consecutive stretches of
the stream).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

BLIND_PROBES = 8  # held-out rows whose prediction is recomputed in a process that never saw their future
PRECISIONS = ("float64", "float32", "float16", "bfloat16")
"""The precisions a blind-probe process may report (``torch.<name>``)."""


class BlindProbeError(RuntimeError):
    """A blind probe failed: ``"contract: ..."`` (not causal) or ``"protocol: ..."`` (a bad reply)."""


def blind_probes(batches: Sequence[np.ndarray], key: bytes, vocab_size: int,
                 count: int = BLIND_PROBES) -> list[tuple[int, int, int, np.ndarray]]:
    """The blind causality probes of a held-out evaluation: ``(batch, row, k, probe_batch)``.

    Up to ``count`` batches spread over the prefix; in each, one row and ``k`` (``1 <= k < T``)
    drawn from a generator seeded by ``HMAC-SHA256(key, "heldout-blind-probes")``, ``key`` the
    run's secret (:func:`prism_challenge.pipeline.start.run_secret`): never the public seed, so no
    one can tell in advance which rows and positions are probed. ``probe_batch`` ``[B, T]`` int64 has the batch's
    shape and is **real text**: a copy of another held-out batch of that shape, two batches away
    at least (so none of its tokens is the probed row's true future, which runs on into the next
    row and the next batch), whose row ``row`` is replaced, before ``k``, by the probed row's own
    tokens. The fresh process that scores it can know neither token ``k`` nor any row of the
    held-out batch beyond that prefix, and cannot tell the probe from text by its tokens. A prefix
    with no such other batch gets random tokens instead (uniform over ``V``).
    """
    if not batches:
        return []
    rng = np.random.default_rng(int.from_bytes(hmac.new(key, b"heldout-blind-probes", hashlib.sha256).digest(), "big"))
    picks = sorted({int(round(x)) for x in np.linspace(0, len(batches) - 1, num=min(count, len(batches)))})
    out = []
    for b in picks:
        rows, t = batches[b].shape
        if t < 2:
            continue
        row, k = int(rng.integers(rows)), int(rng.integers(1, t))
        others = [j for j in range(len(batches)) if abs(j - b) > 1 and batches[j].shape == (rows, t)]
        if others:
            probe = np.array(batches[others[int(rng.integers(len(others)))]], dtype=np.int64)
        else:
            probe = rng.integers(0, vocab_size, (rows, t)).astype(np.int64)
        probe[row, :k] = batches[b][row, :k]
        out.append((b, row, k, probe))
    return out


def logprobs_at(model: Any, batch: np.ndarray, row: int, pos: int, vocab_size: int, device: str,
                autocast: Any = None) -> tuple[bytes, str]:
    """float32 log-probabilities ``[V]`` of the next token at ``(row, pos)`` of ``batch`` ``[B, T]``
    (eval mode, ``no_grad``, the scoring autocast, on the instrument's blocks) and the probe's
    precision name (one of :data:`PRECISIONS`).

    Raises:
        prism_challenge.evaluator.instrument.ContractError: logits of the wrong shape.
    """
    import torch

    from prism_challenge.evaluator.instrument import check_logits, position_logprobs, probe_precision, scoring_forward

    tokens = torch.tensor(batch, dtype=torch.int64)  # a copy: the model may write to its input
    if device != "cpu":
        tokens = tokens.to(device)
    model.eval()
    with torch.no_grad():
        logits = check_logits(scoring_forward(model, tokens, autocast), tokens.shape[0], tokens.shape[1], vocab_size)
        lp = position_logprobs(logits, row, pos, vocab_size)
        precision = str(probe_precision(logits.dtype, autocast)).removeprefix("torch.")
        return lp.cpu().numpy().astype(np.float32).tobytes(), precision


def compare(probes: list, batches: Sequence[np.ndarray], check_nats: list, blind: Any, precisions: Any,
            vocab_size: int, autocast: Any = None) -> None:
    """Compare the held-out process's nats of each probed token (``check_nats``) with the fresh
    process's log-probabilities (``blind``: hex float32 ``[V]``, ``precisions``: their names).

    Raises:
        BlindProbeError: ``"contract: ..."`` when a prediction changed without its future,
            ``"protocol: ..."`` for a malformed reply.
    """
    import torch

    from prism_challenge.evaluator.instrument import PROBE_TOLERANCE_NATS, probe_precision

    if not (isinstance(blind, list) and isinstance(precisions, list) and len(blind) == len(precisions) == len(probes)):
        raise BlindProbeError("protocol: malformed reply from the blind probe process")
    for (b, row, k, _), full, hexed, name in zip(probes, check_nats, blind, precisions):
        try:
            lp = np.frombuffer(bytes.fromhex(hexed), dtype=np.float32)
            if lp.shape != (vocab_size,) or not isinstance(full, (int, float)) or isinstance(full, bool):
                raise ValueError("shape")
            if name not in PRECISIONS:
                raise ValueError("precision")
        except (TypeError, ValueError):
            raise BlindProbeError("protocol: malformed reply from the blind probe process") from None
        precision = probe_precision(getattr(torch, name), autocast)
        tol = PROBE_TOLERANCE_NATS[precision]
        seen = 0.0 - float(lp[int(batches[b][row, k])])
        if not (math.isfinite(full) and math.isfinite(seen)):
            continue  # non-finite: charged 2 ln V per target already
        if not (full == seen or abs(full - seen) <= tol):
            raise BlindProbeError(
                f"contract: the trained model is not causal on held-out text: its prediction of token {k} of "
                f"held-out row {row} of batch {b} cost {full:.4g} nats when it was shown the whole batch and "
                f"{seen:.4g} nats in a separate process shown only the tokens before it in a batch of the same "
                f"shape (over the {name} tolerance of {tol:.3g} nats; a prediction may use earlier tokens of "
                f"its own row only)")
