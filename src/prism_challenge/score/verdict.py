"""The verdict of a scored run: tail bpb, memorization gap, anomaly, final score, ranking.

Pure functions over what the trusted side measured (the per-step loss records and, when it ran,
the held-out evaluation). Units: nats for losses, bits per UTF-8 byte (bpb) for rates;
``bits = nats / ln 2``.

* **Tail bpb** (:func:`tail_bpb`): the prequential bpb over the last ``fraction`` (10%) of the
  scored bytes. Each batch is scored before the loop trains on it, so the tail is an
  out-of-sample estimate of the model near the end of training.
* **Memorization gap** (:func:`memorization`): ``gap = val_bpb(trained) - tail_bpb``. On a
  random partition of one corpus the held-out split and the train stream come from the same
  distribution, so an honest model's val bpb is close to (or below: it trained on the tail)
  its tail bpb. A model whose loss on the stream is far better than on held-out text of the same
  kind knew the stream rather than learned the language (smuggled train text, lookahead). The
  threshold is measured in each run (:mod:`prism_challenge.score.gapnoise`): ``max(floor, z *
  se_gap)``, ``se_gap`` from the spread of the tail's batches and of the val batches.
* **Anomaly** (:func:`anomaly`): under the forced random init an honest model predicts close
  to uniform on the first batch, ``~ ln V`` nats per target. A first-batch loss below half of
  that is knowledge the model brought with it (constants baked into the source): zeroed.
* **Final score** (:func:`final_score`): ``a * m / (1 + prequential_bpb)``.
* **Ranking** (:func:`rank`): tiers (clean, flagged, zeroed; short runs below full ones), and in
  each the crown rule of :mod:`prism_challenge.score.crown` (re-exported here): first place changes
  hands only by a one-sided Welch t-test at ``p < significance_p`` between groups of seed
  repeats; the other places by mean bpb, then submission time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prism_challenge.score.crown import (
    DEFAULT_SIGNIFICANCE_P,
    CrownError,
    Difference,
    RankedGroup,
    RunGroup,
    budget_share,
    is_short,
    rank_groups,
    welch_difference,
    welch_p,
)
from prism_challenge.score.gapnoise import DEFAULT_GAP_FLOOR_BPB, DEFAULT_GAP_Z, GapNoiseError, gap_noise, tail_units

LN2 = math.log(2.0)

DEFAULT_TAIL_FRACTION = 0.1
DEFAULT_GAP_PENALTY = 0.5
DEFAULT_ANOMALY_RATIO = 0.5
DEFAULT_CONFIRM_TOP_N = 3
DEFAULT_CONFIRM_RUNS = 3


class VerdictError(ValueError):
    """Inputs a verdict cannot be computed from (no bytes, non-finite bpb, bad parameters)."""


@dataclass(frozen=True)
class Policy:
    """The configurable knobs of the verdict (defaults and their reasons in the module doc).

    Attributes:
        tail_fraction: share of the scored bytes that forms the tail (0 < f <= 1); 0.1.
        gap_z: a memorization gap above ``max(gap_floor_bpb, gap_z * se_gap)`` is flagged,
            ``se_gap`` the gap's standard error measured in the run
            (:func:`prism_challenge.score.gapnoise.gap_noise`); 4 (one-sided 3.2e-5 under normality).
        gap_floor_bpb: the smallest threshold (bpb); 0.05. Both measured and justified in
            :mod:`prism_challenge.score.gapnoise` and ``bench/gap_noise.py``. (A fixed 0.5 bpb let
            a peek at one position in six through with a gap of 0.43 bpb.)
        gap_penalty: the multiplier applied when the gap is flagged; 0.5 (halves the score,
            keeps the run ranked: a high gap is strong but not conclusive evidence).
        anomaly_ratio: first-batch nats per target below ``ratio * ln V`` is zeroed; 0.5.
        significance_p: the crown rule's level: a challenger takes first place only when a
            one-sided Welch t-test says its mean bpb is lower at ``p < significance_p``
            (:mod:`prism_challenge.score.crown`); 0.01.
        confirm_top_n: the service confirms a submission whose first run's bpb would place it
            among the first ``confirm_top_n`` entries (by their mean bpb); 3 (issue 29).
        confirm_runs: the runs such a submission gets in all, each on a fresh secret seed
            (K = 3: what record-setting challenges ask of a new record, issue 29).
    """

    tail_fraction: float = DEFAULT_TAIL_FRACTION
    gap_z: float = DEFAULT_GAP_Z
    gap_floor_bpb: float = DEFAULT_GAP_FLOOR_BPB
    gap_penalty: float = DEFAULT_GAP_PENALTY
    anomaly_ratio: float = DEFAULT_ANOMALY_RATIO
    significance_p: float = DEFAULT_SIGNIFICANCE_P
    confirm_top_n: int = DEFAULT_CONFIRM_TOP_N
    confirm_runs: int = DEFAULT_CONFIRM_RUNS

    @classmethod
    def from_record(cls, recorded: Mapping[str, Any]) -> Policy:
        """The policy a run manifest records (``config.policy``). ``rank_epsilon_bpb``, the
        ranking's tie width before issue 29, is dropped: no verdict figure ever depended on it."""
        return cls(**{k: v for k, v in recorded.items() if k != "rank_epsilon_bpb"})


def _steps(curve_or_steps: Any) -> list[tuple[float, int]]:
    """(nats, bytes) per step from StepRecords, ``(nats, bytes)`` pairs, dicts or a manifest curve."""
    if isinstance(curve_or_steps, Mapping):  # the run manifest's "curve"
        per = curve_or_steps["nats_per_target"]
        cum_t = curve_or_steps["cumulative_targets"]
        cum_b = curve_or_steps["cumulative_bytes"]
        out, pt, pb = [], 0, 0
        for npt, t, b in zip(per, cum_t, cum_b):
            out.append((float(npt) * (t - pt), int(b - pb)))
            pt, pb = t, b
        return out
    out = []
    for s in curve_or_steps:
        if isinstance(s, Mapping):
            out.append((float(s["nats"]), int(s["bytes"])))
        elif isinstance(s, (tuple, list)):
            out.append((float(s[0]), int(s[1])))
        else:
            out.append((float(s.nats), int(s.bytes)))
    return out


def tail_bpb(curve_or_steps: Any, fraction: float = DEFAULT_TAIL_FRACTION) -> float:
    """Prequential bits per byte over the last ``fraction`` of the scored bytes.

    Step ``i`` covers the byte interval ``(C_{i-1}, C_i]`` of the stream (``C`` the cumulative
    bytes, ``B = C_last``); the tail is ``(B - f*B, B]``. A step inside the tail counts whole;
    the step straddling the boundary counts **pro rata**: the share of its bytes that falls in the
    tail times its nats (its code length is taken as spread evenly over its bytes). A step of zero
    bytes (only end-of-text targets) counts whole when its position ``C_i`` is inside the tail
    (``C_i > B - f*B``). So

        tail_bpb = (sum_i w_i * nats_i) / ln 2 / (f * B),   w_i = |(C_{i-1}, C_i] & tail| / bytes_i

    Args:
        curve_or_steps: the steps in stream order: ``StepRecord``s, ``(nats, bytes)`` pairs,
            dicts with ``nats`` and ``bytes``, or the run manifest's ``curve`` (nats per target,
            cumulative targets, cumulative bytes).
        fraction: ``f``, in ``(0, 1]``.

    Raises:
        VerdictError: ``fraction`` out of range, no bytes scored, or a non-finite total.
    """
    if not 0.0 < fraction <= 1.0:
        raise VerdictError(f"tail fraction {fraction} must be in (0, 1]")
    steps = _steps(curve_or_steps)
    total = sum(b for _, b in steps)
    if total <= 0:
        raise VerdictError("no bytes were scored: the tail bpb is undefined")
    nats, _ = tail_units(steps, fraction)  # each batch weighted by its share of the tail
    value = math.fsum(nats) / LN2 / (fraction * total)
    if not math.isfinite(value):
        raise VerdictError(f"the tail bpb is not finite ({value})")
    return value


def memorization(
    val_bpb_trained: float,
    tail: float,
    threshold: float,
    penalty: float = DEFAULT_GAP_PENALTY,
) -> tuple[float, float, bool]:
    """The memorization gap and its multiplier: ``(gap, multiplier, flagged)``.

    ``gap = val_bpb_trained - tail`` (bpb); ``flagged = gap > threshold`` (the run's threshold,
    :func:`prism_challenge.score.gapnoise.gap_noise`); ``multiplier`` is
    ``penalty`` when flagged, else 1.0. A non-finite ``val_bpb_trained`` (the trained model's
    held-out loss blew up) is flagged with an infinite gap.

    Raises:
        VerdictError: ``tail`` not finite, a negative threshold, or ``penalty`` outside [0, 1].
    """
    if not math.isfinite(tail):
        raise VerdictError(f"tail bpb {tail} is not finite")
    if threshold < 0 or not 0.0 <= penalty <= 1.0:
        raise VerdictError(f"threshold {threshold} must be >= 0 and penalty {penalty} in [0, 1]")
    gap = val_bpb_trained - tail if math.isfinite(val_bpb_trained) else math.inf
    flagged = gap > threshold
    return gap, (penalty if flagged else 1.0), flagged


def anomaly(
    first_batch_nats_per_target: float, vocab_size: int, ratio: float = DEFAULT_ANOMALY_RATIO
) -> tuple[float, bool]:
    """The anti-cheat multiplier from the first batch's loss: ``(multiplier, flagged)``.

    Flagged (multiplier 0.0) when ``first_batch_nats_per_target < ratio * ln(V)``; else 1.0.
    A non-finite loss is not an anomaly (the instrument charges it ``2 ln V`` per target).

    Raises:
        VerdictError: ``vocab_size < 2`` or ``ratio`` outside (0, 1].
    """
    if vocab_size < 2:
        raise VerdictError(f"vocab_size {vocab_size} must be at least 2")
    if not 0.0 < ratio <= 1.0:
        raise VerdictError(f"anomaly ratio {ratio} must be in (0, 1]")
    flagged = math.isfinite(first_batch_nats_per_target) and first_batch_nats_per_target < ratio * math.log(vocab_size)
    return (0.0 if flagged else 1.0), flagged


def final_score(prequential_bpb: float, anti_cheat_multiplier: float, memorization_penalty: float) -> float:
    """``anti_cheat_multiplier * memorization_penalty / (1 + prequential_bpb)`` (issue 5, item 7).

    In ``(0, 1]`` for an unpenalized run (1 would be a perfect, zero-bit code).

    Raises:
        VerdictError: ``prequential_bpb`` negative or not finite, or a multiplier outside [0, 1].
    """
    if not math.isfinite(prequential_bpb) or prequential_bpb < 0:
        raise VerdictError(f"prequential bpb {prequential_bpb} must be finite and >= 0")
    for name, m in (("anti-cheat multiplier", anti_cheat_multiplier), ("memorization penalty", memorization_penalty)):
        if not 0.0 <= m <= 1.0:
            raise VerdictError(f"{name} {m} must be in [0, 1]")
    return anti_cheat_multiplier * memorization_penalty / (1.0 + prequential_bpb)


def _get(e: Any, key: str) -> Any:
    return e.get(key) if isinstance(e, Mapping) else getattr(e, key, None)


def rank(entries: Iterable[Any], significance_p: float = DEFAULT_SIGNIFICANCE_P) -> list[Any]:
    """Order entries for a leaderboard by the crown rule: a deterministic total order.

    Each entry (a mapping or an object) is one submission (or one bundle's runs) with
    ``prequential_bpb`` (bpb), ``submitted_at`` (any comparable value: a timestamp or an
    ISO-8601 UTC string), an optional ``id`` (breaks exact ties) and optional ``bpbs``: the bpb
    of each of its runs (seed repeats; without it the entry is one run of ``prequential_bpb``).

    Three tiers: clean entries; then flagged ones (``memorization_penalty < 1``, or ``flags``
    holding ``"memorization"`` or ``"heldout_unavailable"``: a stream score the held-out text
    does not back, or none to back it); then zeroed ones (``anti_cheat_multiplier == 0`` or
    ``final_score == 0``: smuggled knowledge, or found non-causal by a held-out probe). Inside
    each, entries flagged ``"short"`` (the loop stopped under 99 % of its budget:
    :func:`prism_challenge.score.crown.is_short`) rank below the full ones. Each (sub-)tier is ordered
    by :func:`prism_challenge.score.crown.rank_groups`: first the crown holder (among entries with two
    or more runs, the earliest submission unless a later one's mean bpb is lower by a one-sided
    Welch t-test at ``p < significance_p``; without such entries the lowest mean), then by mean
    bpb, then ``submitted_at``, then ``id``. The held-out delta does not order entries.

    The result depends on the set of entries only, not on their input order (when ``id`` or
    the other keys tell every pair apart). Entries without these keys are clean.

    Raises:
        VerdictError: ``significance_p`` outside (0, 1), or an entry without a finite
            ``prequential_bpb`` or with a non-finite value in ``bpbs``.
    """
    if not 0.0 < significance_p < 1.0:
        raise VerdictError(f"significance p {significance_p} must be in (0, 1)")
    items = list(entries)
    for e in items:
        b = _get(e, "prequential_bpb")
        if not isinstance(b, (int, float)) or not math.isfinite(b):
            raise VerdictError(f"entry {e!r}: prequential_bpb {b!r} must be a finite number")

    def submitted(i: int) -> tuple:
        ident = _get(items[i], "id")
        return (_get(items[i], "submitted_at"), "" if ident is None else str(ident))

    order = {i: n for n, i in enumerate(sorted(range(len(items)), key=submitted))}

    def zeroed(e: Any) -> bool:
        return _get(e, "anti_cheat_multiplier") == 0 or _get(e, "final_score") == 0

    def tier(e: Any) -> int:
        if zeroed(e):
            return 2
        penalty, flags = _get(e, "memorization_penalty"), _get(e, "flags") or ()
        flagged = isinstance(penalty, (int, float)) and penalty < 1
        return 1 if flagged or "memorization" in flags or "heldout_unavailable" in flags else 0

    def group(i: int) -> RunGroup:
        e = items[i]
        bpbs = tuple(_get(e, "bpbs") or (_get(e, "prequential_bpb"),))
        return RunGroup(key=str(i), bpbs=bpbs, order=order[i], short="short" in (_get(e, "flags") or ()))

    out: list[Any] = []
    for t in (0, 1, 2):
        try:
            ranked = rank_groups([group(i) for i, e in enumerate(items) if tier(e) == t], significance_p)
        except CrownError as exc:
            raise VerdictError(f"rank: {exc}") from None
        out += [items[int(r.key)] for r in ranked]
    return out


@dataclass(frozen=True)
class Verdict:
    """Everything the verdict adds to the run manifest (``manifest["verdict"]``).

    Attributes:
        prequential_bpb: the run's score rate (bpb).
        tail_bpb: prequential bpb over the last ``tail_fraction`` of scored bytes.
        tail_fraction: the tail's share of the bytes.
        first_batch_nats_per_target: the step-0 loss per target (nats).
        anomaly_threshold_nats: ``anomaly_ratio * ln V``.
        anomaly_flagged: the first batch was below that threshold.
        anti_cheat_multiplier: 0.0 when flagged, else 1.0.
        heldout: the held-out figures (``val_bpb_twin``, ``val_bpb_trained``, ``heldout_delta``,
            ``targets``, ``bytes``), or ``None`` when it did not run.
        heldout_error: why the held-out evaluation did not run or failed, else ``None``.
        memorization_gap: ``val_bpb_trained - tail_bpb`` (``None`` without held-out figures).
        memorization_threshold: this run's threshold (bpb): ``max(floor, z * se_gap)``; the
            floor without held-out figures.
        memorization_se_bpb: ``se_gap``, the gap's measured standard error (bpb), or ``None``.
        memorization_noise: :class:`prism_challenge.score.gapnoise.GapNoise` as a dict, plus
            ``gap_over_se`` (``gap / se_gap``), or ``None`` without held-out figures.
        memorization_flagged: the gap is above the threshold.
        memorization_penalty: the policy's penalty when flagged, else 1.0 (1.0 without held-out).
        final_score: ``anti_cheat_multiplier * memorization_penalty / (1 + prequential_bpb)``.
        flags: short names of everything flagged (``"anomaly"``, ``"memorization"``,
            ``"heldout_unavailable"``, ``"loop_stopped"``: the loop ended before its budget,
            no figure changed; ``"short"``: it ended under 99 % of its budget, ranked in the
            lower tier).
    """

    prequential_bpb: float
    tail_bpb: float
    tail_fraction: float
    first_batch_nats_per_target: float
    anomaly_threshold_nats: float
    anomaly_flagged: bool
    anti_cheat_multiplier: float
    heldout: dict[str, Any] | None
    heldout_error: str | None
    memorization_gap: float | None
    memorization_threshold: float
    memorization_flagged: bool
    memorization_penalty: float
    final_score: float
    flags: list[str]
    memorization_se_bpb: float | None = None
    memorization_noise: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``)."""

        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v

        return clean(asdict(self))


def build_verdict(
    prequential_bpb: float,
    steps: Any,
    vocab_size: int,
    heldout: Mapping[str, Any] | None,
    *,
    heldout_error: str | None = None,
    policy: Policy = Policy(),
    stop_reason: str | None = None,
    covered: float | None = None,
) -> Verdict:
    """Assemble the verdict of a scored run (for the manifest and the console summary).

    Args:
        prequential_bpb: from :func:`prism_challenge.score.scoring.prequential_score`.
        steps: the step records in stream order (see :func:`tail_bpb` for accepted forms);
            the first one's nats per target is the anomaly signal. A step's targets are needed
            for that: ``StepRecord``s, dicts with ``targets``, or the manifest curve.
        vocab_size: ``V``.
        heldout: the output of :func:`prism_challenge.audit.heldout_parent.run_heldout`, or ``None``.
        heldout_error: the reason the held-out evaluation is missing (flag
            ``heldout_unavailable``; the memorization penalty is then 1.0: no evidence).
        stop_reason: the stream's ``stop_reason``; ``loop_stopped`` (the loop ended before its
            budget) adds the flag ``loop_stopped`` and changes no figure: the audit's bound holds
            at any stop (:mod:`~prism_challenge.evaluator.auditplan`), and how a ranking treats
            a short run is the ranking's decision.
        covered: the share of its budget the run covered
            (:func:`prism_challenge.score.crown.budget_share`; ``None``: no countable budget). A
            ``loop_stopped`` run under 99 % of it is also flagged ``short``
            (:func:`prism_challenge.score.crown.is_short`): :func:`rank` puts it below the full runs.

    Raises:
        VerdictError: no bytes scored or no steps (the run must fail instead of scoring).
    """
    if isinstance(steps, Mapping):
        per = steps["nats_per_target"]
        if not per:
            raise VerdictError("no step was scored")
        first = float(per[0])
    else:
        steps = list(steps)
        if not steps:
            raise VerdictError("no step was scored")
        s0 = steps[0]
        nats0 = _get(s0, "nats") if not isinstance(s0, (tuple, list)) else s0[0]
        targets0 = _get(s0, "targets") if not isinstance(s0, (tuple, list)) else (s0[2] if len(s0) > 2 else None)
        if not targets0:
            raise VerdictError("the first step records no targets: the anomaly signal is undefined")
        first = float(nats0) / int(targets0)
    tail = tail_bpb(steps, policy.tail_fraction)
    multiplier, a_flag = anomaly(first, vocab_size, policy.anomaly_ratio)
    flags = ["anomaly"] if a_flag else []
    gap = None
    m_flag = False
    penalty = 1.0
    ho = dict(heldout) if heldout is not None else None
    available = ho is not None and ho.get("val_bpb_trained") is not None
    threshold, noise = policy.gap_floor_bpb, None
    if available:
        heldout_error = None
        noise = _noise(steps, policy, ho)
        threshold = noise["threshold_bpb"]
        gap, penalty, m_flag = memorization(float(ho["val_bpb_trained"]), tail, threshold, policy.gap_penalty)
        se = noise["se_gap_bpb"]
        noise["gap_over_se"] = gap / se if se and math.isfinite(gap) else None
        if m_flag:
            flags.append("memorization")
    else:
        flags.append("heldout_unavailable")
        heldout_error = heldout_error or "the held-out evaluation did not run"
    if stop_reason == "loop_stopped":
        flags.append("loop_stopped")
    if is_short(stop_reason, covered):
        flags.append("short")
    return Verdict(
        prequential_bpb=prequential_bpb,
        tail_bpb=tail,
        tail_fraction=policy.tail_fraction,
        first_batch_nats_per_target=first,
        anomaly_threshold_nats=policy.anomaly_ratio * math.log(vocab_size),
        anomaly_flagged=a_flag,
        anti_cheat_multiplier=multiplier,
        heldout=ho,
        heldout_error=heldout_error,
        memorization_gap=gap,
        memorization_threshold=threshold,
        memorization_flagged=m_flag,
        memorization_penalty=penalty,
        final_score=final_score(prequential_bpb, multiplier, penalty),
        flags=flags,
        memorization_se_bpb=noise["se_gap_bpb"] if noise else None,
        memorization_noise=noise,
    )


def _noise(steps: Any, policy: Policy, ho: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`~prism_challenge.score.gapnoise.gap_noise` of a run as a dict: the tail's units from
    ``steps``, the val side's from ``ho["batch_nats_trained"]`` and ``ho["batch_bytes"]`` (held-out
    figures without them, e.g. from an older harness, have no val units: see the module's rules).

    Raises:
        VerdictError: the per-batch figures are malformed.
    """
    val = (ho.get("batch_nats_trained") or [], ho.get("batch_bytes") or [])
    try:
        return gap_noise(tail_units(_steps(steps), policy.tail_fraction), val, z=policy.gap_z,
                         floor=policy.gap_floor_bpb).to_dict()
    except GapNoiseError as exc:
        raise VerdictError(f"memorization noise: {exc}") from None


__all__ = ["CrownError", "DEFAULT_SIGNIFICANCE_P", "Difference", "LN2", "Policy", "RankedGroup", "RunGroup", "Verdict",
           "VerdictError", "anomaly", "budget_share", "build_verdict", "final_score", "is_short", "memorization",
           "rank", "rank_groups", "tail_bpb", "welch_difference", "welch_p"]
