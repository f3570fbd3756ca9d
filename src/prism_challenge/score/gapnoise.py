"""The memorization gap's noise, measured in each run: the standard errors of its two rates.

The gap is ``val_bpb(trained) - tail_bpb`` (:func:`prism_challenge.score.verdict.memorization`). Both
rates are **ratio estimators** over units of text: ``R = sum(y_i) / sum(x_i)`` with ``y_i`` a
unit's code length in bits (``nats / ln 2``) and ``x_i`` its UTF-8 bytes. The units are

* **the tail**: the scored batches of the last ``fraction`` of the stream's bytes
  (:func:`tail_units`), the batch straddling the tail's start weighted by the share of its bytes
  inside it (``(w y_i, w x_i)``, the weight :func:`prism_challenge.score.verdict.tail_bpb` gives it);
* **the held-out text**: the val batches the trusted side cut (their bytes are its own counts,
  never the child's), with the trained model's nats per batch from the held-out child.

**Standard error of a ratio estimator** (Cochran, *Sampling Techniques*, 3rd ed., 1977, ch. 6,
§6.3-6.4, with the finite-population correction 1: the text is a sample of an unbounded
population)::

    v(R) = n / (n - 1) * sum_i (y_i - R x_i)^2 / X^2,      X = sum_i x_i,   se = sqrt(v(R))

(Cochran's ``(1 / (n xbar^2)) * sum (y_i - R x_i)^2 / (n - 1)`` with ``xbar = X / n``), each
residual ``y_i - R x_i`` first winsorized (:func:`_residuals`: one outlying unit, which the
submission's model can make at will on the val text, must raise the gap more than the SE). Then

    se_gap = sqrt(se_tail^2 + se_val^2)    (disjoint text: the two estimates are independent)
    threshold = max(floor, z * se_gap)     (flagged when gap > threshold; one-sided)

**Per-byte variance** (Cochran §6.7: the ratio estimator is the best linear unbiased one when
``Var(y_i | x_i)`` is proportional to ``x_i``): ``s2 = sum_i (y_i - R x_i)^2 / x_i / (n - 1)``
bits^2 per byte; a rate over ``X`` bytes of such text has ``se = sqrt(s2 / X)``. It serves as
the other side's measurement where one side's spread cannot be measured, and as a lower bound
on the tail's own: a tail of 2 to 5 batches (a 20k-token local run) has an SE estimated from 1
to 4 degrees of freedom, which can be small by chance; the val side's per-byte variance is
measured on tens to hundreds of batches (200 kB to 1 MB of text) of the same model family.

**The tail's SE is kept within [1, 3] times that bound** (:data:`TAIL_CAP`). The floor side:
above. The cap: the tail's units are the submission's batches, so its loop shapes their
spread; a cheat active on every other batch of a tail of ``n`` batches (gain ``g`` on half of
them: gap ``g / 2``, se about ``g / (2 sqrt n)``) has ``gap / se ~ sqrt(n)``, so a loop whose
batches are large enough to leave ``n < z^2 = 16`` tail batches would widen its own threshold
past any gap. The val side's units are the harness's (:data:`prism_challenge.pipeline.finish.HELDOUT_BATCH`
rows), so the capped tail SE is one the submission cannot widen at will. The honest ratio of
the tail's own SE to the bound that ``bench/gap_noise.py`` measured was 0.55 to 0.88 (those
tails were raised to the bound, none came near the cap).

**Rules where a spread cannot be measured** (fewer than :data:`MIN_UNITS` units with bytes):

* the tail: its SE is the val side's per-byte variance over the tail's bytes (``rule`` says
  ``tail_from_val``); the val side likewise from the tail's (``val_from_tail``);
* neither side: no SE (``None``); the threshold is the floor alone (``rule`` ``floor``): a
  submission cannot gain room by choosing batch shapes that leave one unit, and an honest run
  that small is a local experiment (the official profile's tail holds hundreds of batches).

**Correlation.** Consecutive batches are consecutive text, so two batches cut from one document
are positively correlated and a per-batch SE understates the noise when documents span several
batches. ``block`` merges each run of ``block`` consecutive units into one unit (the batch-means
remedy for a correlated series). Measured (``bench/gap_noise.py`` on the FineWeb-Edu sample,
60 kB of val text): the val side's per-batch residuals have a lag-1 autocorrelation of +0.18 to
+0.57 and ``se(block 4) / se(block 1)`` is 1.7 to 1.8, so the per-batch val SE understates by
about 1.8x at these shapes. :data:`DEFAULT_BLOCK` is still 1 (so ``z = 4`` acts as about 2.2
on a val-dominated SE): blocks of 4 leave 2 units of a 60 kB GPT-2 val prefix; a val block of 4
at the official 1 MB (about 125 batches) is the change to make next. The
tail's learning trend also lands in its residuals, which only widens its SE (an honest model's
final weights beat its tail, so the gap is then negative).

**z and the floor.** :data:`DEFAULT_GAP_Z` = 4: a one-sided false-flag rate of ``3.2e-5`` if the
gap's noise were normal with the measured SE. :data:`DEFAULT_GAP_FLOOR_BPB` = 0.05 bpb: what
the SE does not see (the split's documents are not a random sample of batches; the models that
scored the tail are not the final one). Measured honest z-scores (``gap / se_gap``): +1.21,
+1.51 and -0.85 at 40 kB of stream (the two GPT-2 bundles' gaps were +0.50 bpb there, over a
tail of one batch: the old fixed 0.5 bpb flagged the example), +0.43 and +0.38 at 160 kB; a
memorizer's +4.10 (gap 0.24 bpb) and +28.7 (gap 2.46 bpb), both flagged (docs/how-a-run-works.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

LN2 = math.log(2.0)
DEFAULT_GAP_Z = 4.0
DEFAULT_GAP_FLOOR_BPB = 0.05
DEFAULT_BLOCK = 1
MIN_UNITS = 2
WINSOR_K = 3.0  # robust deviations a unit's residual may lie from the median (:func:`_residuals`)
MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): the MAD of a normal sample times this is its sigma
TAIL_CAP = 3.0
"""The tail's own SE is kept within ``[1, TAIL_CAP]`` times the val side's per-byte bound (module doc)."""


class GapNoiseError(ValueError):
    """Units a standard error cannot be computed from (mismatched lengths, negative or non-finite
    values, a bad ``block``, ``z`` or ``floor``)."""


def _units(nats: Sequence[float], nbytes: Sequence[float], block: int) -> list[tuple[float, float]]:
    """``(bits, bytes)`` per unit, consecutive runs of ``block`` units merged."""
    if len(nats) != len(nbytes):
        raise GapNoiseError(f"{len(nats)} nats for {len(nbytes)} byte counts: one of each per unit")
    if not isinstance(block, int) or block < 1:
        raise GapNoiseError(f"block {block!r} must be an integer >= 1")
    out: list[tuple[float, float]] = []
    for i, (n, b) in enumerate(zip(nats, nbytes)):
        n, b = float(n), float(b)
        if not (math.isfinite(n) and math.isfinite(b)) or n < 0 or b < 0:
            raise GapNoiseError(f"unit {i}: nats {n} and bytes {b} must be finite and >= 0")
        if i % block == 0:
            out.append((n / LN2, b))
        else:
            y, x = out[-1]
            out[-1] = (y + n / LN2, x + b)
    return out


def ratio_se(nats: Sequence[float], nbytes: Sequence[float], *, block: int = DEFAULT_BLOCK) -> float | None:
    """The standard error (bits per byte) of ``R = sum(nats) / ln 2 / sum(bytes)`` (module doc).

    Args:
        nats: ``[n]`` each unit's code length (nats; a weighted unit's already weighted).
        nbytes: ``[n]`` each unit's UTF-8 bytes (weighted alike).
        block: merge runs of this many consecutive units first.

    Returns:
        ``sqrt(n / (n - 1) * sum (y_i - R x_i)^2) / X``; ``None`` with fewer than
        :data:`MIN_UNITS` units that hold bytes (or no bytes at all).

    Raises:
        GapNoiseError: lengths differ, a value negative or not finite, a bad ``block``.
    """
    units = _units(nats, nbytes, block)
    total = math.fsum(x for _, x in units)
    if sum(1 for _, x in units if x > 0) < MIN_UNITS or total <= 0:
        return None
    r = math.fsum(y for y, _ in units) / total
    n = len(units)
    ss = math.fsum(d * d for d in _residuals(units, r))
    return math.sqrt(n / (n - 1) * ss) / total


def per_byte_variance(nats: Sequence[float], nbytes: Sequence[float], *, block: int = DEFAULT_BLOCK) -> float | None:
    """``s2 = sum_i (y_i - R x_i)^2 / x_i / (n - 1)`` in bits^2 per byte over the units with bytes
    (module doc, Cochran §6.7); ``None`` with fewer than :data:`MIN_UNITS` such units.

    Raises:
        GapNoiseError: as :func:`ratio_se`.
    """
    units = [(y, x) for y, x in _units(nats, nbytes, block) if x > 0]
    if len(units) < MIN_UNITS:
        return None
    r = math.fsum(y for y, _ in units) / math.fsum(x for _, x in units)
    return math.fsum(d * d / x for d, (_, x) in zip(_residuals(units, r), units)) / (len(units) - 1)


def _residuals(units: list[tuple[float, float]], r: float) -> list[float]:
    """``d_i = y_i - R x_i`` per unit, **winsorized**: each unit with bytes has its per-byte
    residual ``e_i = d_i / sqrt(x_i)`` clamped to ``median(e) +- WINSOR_K * 1.4826 * MAD(e)``
    (1.4826 MAD: the normal-consistent robust scale; Huber, *Robust Statistics*, 1981, §5.1).
    Red team 9: one val batch made confidently wrong (a causal per-row trigger that passes every
    probe) raised the SE as much as the gap, ``se ~ d / X`` against ``gap + d / X``, so with
    ``z = 4`` any ``d / X > gap / 3`` hid a memorization gap. Clamped, an outlier raises the gap
    by all its loss and the SE by at most ``WINSOR_K`` robust deviations."""
    e = [(y - r * x) / math.sqrt(x) for y, x in units if x > 0]
    if len(e) < 3:
        return [y - r * x for y, x in units]
    med = statistics.median(e)
    spread = WINSOR_K * MAD_TO_SIGMA * statistics.median(abs(v - med) for v in e)
    lo, hi = med - spread, med + spread
    return [min(max((y - r * x) / math.sqrt(x), lo), hi) * math.sqrt(x) if x > 0 else y - r * x for y, x in units]


def tail_units(steps: Sequence[tuple[float, int]], fraction: float) -> tuple[list[float], list[float]]:
    """The tail's units: ``(nats, bytes)`` lists, each weighted by its share of the tail.

    ``steps`` are ``(nats, bytes)`` per scored batch in stream order (``verdict._steps``); the
    tail is the byte interval ``(B - f B, B]``. A batch inside counts whole (weight 1); the one
    straddling the start counts with ``w = overlap / bytes`` on both its nats and its bytes; a
    zero-byte batch inside counts whole (its nats, 0 bytes), as in
    :func:`prism_challenge.score.verdict.tail_bpb`, so ``sum(nats) / ln 2 / sum(bytes)`` is the tail bpb.
    """
    total = sum(b for _, b in steps)
    start = total - fraction * total
    nats: list[float] = []
    nbytes: list[float] = []
    end = 0
    for n, b in steps:
        lo, end = end, end + b
        if b == 0:
            if end > start:
                nats.append(n)
                nbytes.append(0.0)
            continue
        overlap = min(end, total) - max(lo, start)
        if overlap > 0:
            w = overlap / b
            nats.append(n * w)
            nbytes.append(b * w)
    return nats, nbytes


@dataclass(frozen=True)
class GapNoise:
    """The gap's measured noise and the threshold it sets (``manifest["verdict"]["memorization_noise"]``).

    Attributes:
        se_tail_bpb: the tail bpb's standard error (bpb), or ``None``.
        se_val_bpb: the trained model's val bpb's standard error (bpb), or ``None``.
        se_gap_bpb: ``sqrt(se_tail^2 + se_val^2)``, or ``None`` when neither side is measured.
        tail_units: the tail's units (after ``block``), ``val_units`` the val side's.
        rule: ``measured`` (both sides' own spread), ``tail_from_val``, ``val_from_tail`` or
            ``floor`` (module doc); a tail whose own SE was below the val side's per-byte bound
            reads ``measured, tail raised to the val bound``, one above :data:`TAIL_CAP` times
            it ``measured, tail capped at 3 x the val bound``.
        z: the policy's multiplier; floor_bpb: the policy's floor (bpb).
        threshold_bpb: ``max(floor, z * se_gap)``, or the floor when ``se_gap`` is ``None``.
    """

    se_tail_bpb: float | None
    se_val_bpb: float | None
    se_gap_bpb: float | None
    tail_units: int
    val_units: int
    rule: str
    z: float
    floor_bpb: float
    threshold_bpb: float

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def gap_noise(tail: tuple[Sequence[float], Sequence[float]], val: tuple[Sequence[float], Sequence[float]], *,
              z: float = DEFAULT_GAP_Z, floor: float = DEFAULT_GAP_FLOOR_BPB, block: int = DEFAULT_BLOCK) -> GapNoise:
    """The gap's standard error and threshold from the tail's and the val side's units.

    Args:
        tail: ``(nats, bytes)`` of the tail's units (:func:`tail_units`).
        val: ``(nats, bytes)`` of the val batches: the trained model's nats, the trusted side's bytes.
        z: the threshold's multiplier of ``se_gap`` (> 0).
        floor: the smallest threshold (bpb, >= 0).
        block: consecutive units merged per unit (module doc).

    Raises:
        GapNoiseError: bad units, ``z <= 0`` or ``floor < 0`` (or either not finite).
    """
    if not (math.isfinite(z) and z > 0 and math.isfinite(floor) and floor >= 0):
        raise GapNoiseError(f"gap z {z} must be > 0 and floor {floor} >= 0 (finite)")
    se_t, se_v = ratio_se(*tail, block=block), ratio_se(*val, block=block)
    s2_t, s2_v = per_byte_variance(*tail, block=block), per_byte_variance(*val, block=block)
    x_t, x_v = math.fsum(tail[1]), math.fsum(val[1])
    rule = "measured"
    bound = math.sqrt(s2_v / x_t) if s2_v is not None and x_t > 0 else None
    if bound is not None and se_t is None:
        se_t, rule = bound, "tail_from_val"
    elif bound is not None and se_t < bound:
        se_t, rule = bound, "measured, tail raised to the val bound"
    elif bound is not None and se_t > TAIL_CAP * bound:
        se_t, rule = TAIL_CAP * bound, f"measured, tail capped at {TAIL_CAP:g} x the val bound"
    if se_v is None and s2_t is not None and x_v > 0:
        se_v, rule = math.sqrt(s2_t / x_v), "val_from_tail"
    if se_t is None or se_v is None:
        se_gap, rule = None, "floor"
    else:
        se_gap = math.hypot(se_t, se_v)
    threshold = floor if se_gap is None else max(floor, z * se_gap)
    n_t = len(_units(*tail, block))
    n_v = len(_units(*val, block))
    return GapNoise(se_t if se_gap is not None else None, se_v if se_gap is not None else None, se_gap,
                    n_t, n_v, rule, float(z), float(floor), threshold)
