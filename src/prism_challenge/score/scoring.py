"""Scoring: prequential bits-per-byte from the per-batch loss records.

``prequential_bpb = total_bits / total_bytes`` where ``total_bits = sum(nats) / ln 2`` over every
scored target of the stream and ``total_bytes`` is the UTF-8 length those targets stand for.
This is the prequential code length of the stream (Dawid 1984; Blier & Ollivier 2018, "The
Description Length of Deep Learning Models", NeurIPS) normalized per byte of text, so models
with different tokenizers are comparable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prism_challenge.evaluator.feeder import StepRecord

LN2 = math.log(2.0)


class ScoringError(RuntimeError):
    """Nothing can be scored: no bytes covered, or a non-finite total."""


@dataclass(frozen=True)
class Score:
    """The prequential score of a run.

    Attributes:
        total_nats: float64 sum of the recorded code lengths (nats).
        total_bits: ``total_nats / ln 2``.
        targets: scored target tokens.
        bytes: UTF-8 bytes the targets stand for.
        prequential_bpb: ``total_bits / bytes`` (bits per byte).
        batches: scored global steps.
        nonfinite_batches: steps charged ``2 * log2 V`` bits per target for a non-finite loss.
    """

    total_nats: float
    total_bits: float
    targets: int
    bytes: int
    prequential_bpb: float
    batches: int
    nonfinite_batches: int


def prequential_score(steps: Sequence[StepRecord]) -> Score:
    """Sum the records (float64) and divide bits by bytes.

    Raises:
        ScoringError: zero bytes covered or a non-finite total.
    """
    nats = math.fsum(s.nats for s in steps)
    targets = sum(s.targets for s in steps)
    nbytes = sum(s.bytes for s in steps)
    if nbytes <= 0:
        raise ScoringError("no bytes were scored: the stream covered no text")
    if not math.isfinite(nats):
        raise ScoringError(f"the total code length is not finite ({nats})")
    bits = nats / LN2
    return Score(nats, bits, targets, nbytes, bits / nbytes, len(steps), sum(not s.finite for s in steps))


def curve(steps: Sequence[StepRecord]) -> dict[str, list]:
    """Per-step learning curve: nats per target, cumulative targets, cumulative bytes."""
    per, cum_t, cum_b = [], [], []
    t = b = 0
    for s in steps:
        t += s.targets
        b += s.bytes
        per.append(s.nats / s.targets if s.targets else 0.0)
        cum_t.append(t)
        cum_b.append(b)
    return {"nats_per_target": per, "cumulative_targets": cum_t, "cumulative_bytes": cum_b}
