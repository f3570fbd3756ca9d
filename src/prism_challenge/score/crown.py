"""The crown rule: who holds first place when runs are noisy (issue 29, parts 3 and 4).

An entry of the ranking is a *group*: the runs of one submission (or of one bundle in
``prism compare``), each a prequential bpb (bits per UTF-8 byte; lower is better) measured on its
own seed. Its figures are the mean, the sample standard deviation (ddof=1) and ``n``.

**The rule** (:func:`rank_groups`), within a tier:

1. *First place.* Among the groups with ``n >= 2`` (confirmed: their noise can be estimated),
   the groups are replayed in submission order: the earliest holds the crown, and a later one
   takes it only if its mean bpb is lower than the holder's by a one-sided Welch t-test at
   ``p < significance_p`` (:func:`welch_p`; default :data:`DEFAULT_SIGNIFICANCE_P` = 0.01, the
   anchors' rule: openai/parameter-golf, modded-nanogpt). Otherwise the earlier submission
   keeps it (as in PlatformNetwork/prism). A group with ``n < 2`` never takes the crown from a
   confirmed one; when no group of the tier is confirmed (a profile without confirmation runs,
   single runs in ``prism compare``) no test is possible and the lowest mean leads.
2. *Every other place*: by mean bpb, ties by the earlier submission, then the key. (The
   significance rule is for the crown, the place that is paid; applying it between neighbours
   would order unconfirmed entries, which cannot be tested, by submission time.)

**Tiers.** A *short* group (part 4: a run that the loop stopped before its budget,
:func:`is_short`) ranks below every full group, in its own tier under the same rule: a loop that
may stop where it likes can end its average on a lucky stretch, and it was measured on less text
than the others.

**Undefined tests** (:func:`welch_p`): with ``n < 2`` in either group there is no variance
estimate and no displacement is significant (``p = 1``). With zero variance in both groups (two
deterministic models) the difference is exact: ``p = 0`` if the challenger's mean is lower,
else ``p = 1``; copies of one deterministic model tie and the earlier keeps the crown.

The false-displacement rate of the rule under the measured seed noise is ``bench/crown_noise.py``'s
figure (docs/how-a-run-works.md, "The crown rule").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_SIGNIFICANCE_P = 0.01
"""The crown's significance level (one-sided Welch t-test); the profile policy's ``significance_p``."""

SHORT_SHARE = 0.99
"""A ``loop_stopped`` run that covered less than this share of its budget is short."""


class CrownError(ValueError):
    """Groups that cannot be ranked: no runs, a non-finite bpb, a key twice, ``p`` outside (0, 1)."""


@dataclass(frozen=True)
class RunGroup:
    """The runs of one entry.

    Attributes:
        key: the entry's name (a submission id, a bundle); unique among the groups ranked.
        bpbs: each run's prequential bpb (bits per byte), one per seed; at least one.
        order: submission order, earlier is smaller.
        short: the entry ended before its budget (:func:`is_short`): ranked in the lower tier.
    """

    key: str
    bpbs: tuple[float, ...]
    order: int
    short: bool = False


@dataclass(frozen=True)
class RankedGroup:
    """One group's place and figures.

    Attributes:
        key, order, short: the group's (:class:`RunGroup`).
        place: 1-based, over all tiers.
        n: runs.
        mean: mean bpb.
        std: sample std (ddof=1) of the bpbs, ``None`` for ``n < 2``.
        p: :func:`welch_p` of this group against its tier's leader; ``None`` for the leader itself
            and where the test is undefined (``n < 2`` in either group).
        leads: the first place of its tier.
    """

    key: str
    place: int
    n: int
    mean: float
    std: float | None
    p: float | None
    short: bool
    order: int
    leads: bool


@dataclass(frozen=True)
class Difference:
    """Welch's comparison of two groups, ``a - b`` (bpb).

    Attributes:
        diff: ``mean(a) - mean(b)``.
        low, high: the two-sided ``confidence`` interval of the difference: ``diff -+ t_{df} * se``,
            ``se = sqrt(s_a^2/n_a + s_b^2/n_b)``, ``df`` Welch-Satterthwaite; ``(diff, diff)`` when
            ``se = 0``.
        df: the Welch-Satterthwaite degrees of freedom, ``None`` when ``se = 0``.
        p: :func:`welch_p` ``(a, b)``: one-sided, that ``a``'s mean is lower.
        confidence: the interval's level.
    """

    diff: float
    low: float
    high: float
    df: float | None
    p: float
    confidence: float


def _check(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out or not all(math.isfinite(v) for v in out):
        raise CrownError(f"{what}: {list(values)!r} must be one or more finite bpb")
    return out


def welch_p(challenger: Sequence[float], leader: Sequence[float]) -> float:
    """One-sided p-value that the challenger's mean bpb is lower than the leader's (Welch's t-test).

    ``t = (m_c - m_l) / sqrt(s_c^2/n_c + s_l^2/n_l)``, ``df`` by Welch-Satterthwaite,
    ``p = P(T_df <= t)``: ``scipy.stats.ttest_ind(equal_var=False, alternative="less")`` (B. L.
    Welch, Biometrika 34, 1947). Defined also where the test is not: ``n < 2`` in either group
    gives 1.0 (no variance estimate: not significant); zero variance in both gives 0.0 when
    ``m_c < m_l``, else 1.0 (the difference is exact).

    Raises:
        CrownError: an empty group or a non-finite value.
    """
    c, ldr = _check(challenger, "challenger"), _check(leader, "leader")
    if len(c) < 2 or len(ldr) < 2:
        return 1.0
    if statistics.variance(c) == 0 and statistics.variance(ldr) == 0:
        return 0.0 if statistics.mean(c) < statistics.mean(ldr) else 1.0
    from scipy import stats

    return float(stats.ttest_ind(c, ldr, equal_var=False, alternative="less").pvalue)


def welch_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Difference | None:
    """``mean(a) - mean(b)`` with its Welch confidence interval (``scipy.stats.ttest_ind(
    equal_var=False).confidence_interval``, the t distribution at Welch-Satterthwaite ``df``) and
    :func:`welch_p`; ``None`` when either group has fewer than 2 runs.

    Raises:
        CrownError: an empty group, a non-finite value, or ``confidence`` outside (0, 1).
    """
    x, y = _check(a, "a"), _check(b, "b")
    if not 0.0 < confidence < 1.0:
        raise CrownError(f"confidence {confidence} must be in (0, 1)")
    if len(x) < 2 or len(y) < 2:
        return None
    diff = statistics.mean(x) - statistics.mean(y)
    p = welch_p(x, y)
    if statistics.variance(x) == 0 and statistics.variance(y) == 0:
        return Difference(diff, diff, diff, None, p, confidence)
    from scipy import stats

    res = stats.ttest_ind(x, y, equal_var=False)
    ci = res.confidence_interval(confidence)
    return Difference(diff, float(ci.low), float(ci.high), float(res.df), p, confidence)


def _leader(groups: list[RunGroup], p: float) -> RunGroup:
    """Rule 1 of the module doc: the crown of one tier (``groups`` not empty)."""
    confirmed = sorted((g for g in groups if len(g.bpbs) >= 2), key=lambda g: (g.order, g.key))
    if not confirmed:
        return min(groups, key=lambda g: (statistics.mean(g.bpbs), g.order, g.key))
    holder = confirmed[0]
    for g in confirmed[1:]:
        if welch_p(g.bpbs, holder.bpbs) < p:
            holder = g
    return holder


def rank_groups(groups: Iterable[RunGroup], p: float = DEFAULT_SIGNIFICANCE_P) -> list[RankedGroup]:
    """Rank groups by the crown rule (module doc): full groups, then short ones; in each tier the
    crown holder first, the rest by mean bpb, then ``order``, then ``key``.

    The result depends on the set of groups only, not on their input order.

    Raises:
        CrownError: ``p`` outside (0, 1), a key twice, a group without runs or with a non-finite bpb.
    """
    if not 0.0 < p < 1.0:
        raise CrownError(f"significance p {p} must be in (0, 1)")
    items = list(groups)
    keys = [g.key for g in items]
    if len(set(keys)) != len(keys):
        raise CrownError(f"group keys must be unique: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    for g in items:
        _check(g.bpbs, f"group {g.key!r}")
    out: list[RankedGroup] = []
    for tier in ([g for g in items if not g.short], [g for g in items if g.short]):
        if not tier:
            continue
        lead = _leader(tier, p)
        rest = sorted((g for g in tier if g is not lead), key=lambda g: (statistics.mean(g.bpbs), g.order, g.key))
        for g in [lead, *rest]:
            n = len(g.bpbs)
            tested = g is not lead and n >= 2 and len(lead.bpbs) >= 2
            out.append(RankedGroup(key=g.key, place=len(out) + 1, n=n, mean=statistics.mean(g.bpbs),
                                   std=statistics.stdev(g.bpbs) if n >= 2 else None,
                                   p=welch_p(g.bpbs, lead.bpbs) if tested else None,
                                   short=g.short, order=g.order, leads=g is lead))
    return out


def budget_share(stream: Mapping[str, int | None], budgets: Mapping[str, int | None]) -> float | None:
    """The share of its budget a run covered, in the budget's unit: ``tokens / token_budget``,
    ``bytes / byte_budget``, ``batches / step_budget``; with several budgets the largest share (the
    first budget reached ends the run); ``None`` without a countable budget (only the wall clock,
    or the whole train split).

    Args:
        stream: the run manifest's ``stream`` (``tokens``, ``bytes``, ``batches``).
        budgets: the run manifest's ``budgets`` (``token_budget``, ``byte_budget``, ``step_budget``).
    """
    shares = [(stream.get(unit) or 0) / limit
              for unit, name in (("tokens", "token_budget"), ("bytes", "byte_budget"), ("batches", "step_budget"))
              if (limit := budgets.get(name))]
    return max(shares) if shares else None


def is_short(stop_reason: str | None, share: float | None) -> bool:
    """A run that the loop stopped (``stop_reason == "loop_stopped"``) under :data:`SHORT_SHARE` of its
    budget (:func:`budget_share`); a loop-stopped run without a countable budget is short too (it
    ended before its budget by definition, and no count says how close it came)."""
    return stop_reason == "loop_stopped" and (share is None or share < SHORT_SHARE)


__all__ = ["CrownError", "DEFAULT_SIGNIFICANCE_P", "Difference", "RankedGroup", "RunGroup", "SHORT_SHARE",
           "budget_share", "is_short", "rank_groups", "welch_difference", "welch_p"]
