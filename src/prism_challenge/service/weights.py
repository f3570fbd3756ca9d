"""The leaderboard's order and the weights per hotkey (issue 17, item 5).

Both start from the scored entries of the service's profile
(:func:`prism_challenge.service.queries.scored_entries`) and order them with
:func:`prism_challenge.score.verdict.rank` under the profile's ``significance_p`` (the crown rule, the
one ranking of the challenge: ``prism compare`` uses it too).

Leaderboard (:func:`leaderboard`): one entry per hotkey, its best run: the hotkey's first entry
in the ranking of every entry; those bests are then ranked again among themselves (the crown's holder depends on the set
ranked).

Weights (:func:`weights`), normalized to sum to 1 over hotkeys; only entries with a
``final_score`` above 0 are eligible (a zeroed run earns nothing); no eligible entry: no
weights. Rules (``weights_rule``):

- ``winner-takes-all``: the first-ranked entry's hotkey gets 1.
- ``family-split`` (the reference implementation's; ``family_share`` = 0.6 by default): the
  best architecture family is the family of the first-ranked entry; the hotkey that submitted
  the family's first submission (its architecture's author, :attr:`Entry.variant_of` or the
  entry itself) gets ``family_share``, and the hotkey of the family's best entry (the
  first-ranked one: the best training on that architecture, a variant or the original) gets
  ``1 - family_share``. One hotkey holding both gets 1.

Suspended hotkeys (:mod:`prism_challenge.service.findings`; ``excluded``) are left out of both:
their entries are dropped before the ranking, and a family author's share that would go to one
is not paid: the best entry's hotkey gets 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prism_challenge.service.queries import Entry
from prism_challenge.score.verdict import DEFAULT_SIGNIFICANCE_P, rank


def leaderboard(entries: Iterable[Entry], significance_p: float = DEFAULT_SIGNIFICANCE_P, *,
                excluded: frozenset[str] = frozenset()) -> list[Entry]:
    """One entry per hotkey (its best), in rank order; the hotkeys of ``excluded`` left out.

    Raises:
        prism_challenge.score.verdict.VerdictError: a non-finite bpb (a harness bug) or ``significance_p``
            outside (0, 1).
    """
    best: dict[str, Entry] = {}
    for e in rank([e for e in entries if e.hotkey not in excluded], significance_p):
        best.setdefault(e.hotkey, e)
    return rank(best.values(), significance_p)


def weights(entries: Iterable[Entry], rule: str, *, family_share: float = 0.6,
            owner_of: Callable[[int], str], significance_p: float = DEFAULT_SIGNIFICANCE_P,
            excluded: frozenset[str] = frozenset()) -> dict[str, float]:
    """The weight of each hotkey (sorted by hotkey; zero weights left out).

    Args:
        entries: the scored entries.
        rule: ``family-split`` or ``winner-takes-all``.
        family_share: ``family-split``'s share of the family's author, in [0, 1].
        owner_of: the hotkey of a submission id (the family's first submission may have no
            scored run).
        significance_p: the crown rule's level (:func:`prism_challenge.score.verdict.rank`).
        excluded: suspended hotkeys: no entry of theirs is ranked, no share paid to them.

    Raises:
        ValueError: an unknown rule, or ``family_share`` outside [0, 1].
    """
    if rule not in ("family-split", "winner-takes-all"):
        raise ValueError(f"weights rule {rule!r}: must be family-split or winner-takes-all")
    if not 0.0 <= family_share <= 1.0:
        raise ValueError(f"family_share {family_share}: must be in [0, 1]")
    ranked = rank([e for e in entries if e.final_score > 0 and e.hotkey not in excluded], significance_p)
    if not ranked:
        return {}
    best = ranked[0]
    if rule == "winner-takes-all":
        return {best.hotkey: 1.0}
    out: dict[str, float] = {}
    author = owner_of(best.variant_of if best.variant_of is not None else best.id)
    for hotkey, share in ((author, family_share), (best.hotkey, 1.0 - family_share)):
        out[hotkey] = out.get(hotkey, 0.0) + share
    if author in excluded:  # the suspended author's share is not paid: the best training gets all
        return {best.hotkey: 1.0}
    return {k: out[k] for k in sorted(out) if out[k] > 0}


__all__ = ["leaderboard", "weights"]
