"""Secret seeds and confirmation at the top (issue 29, items 1-2).

**Seeds.** Every service run gets its own seed, drawn by :func:`draw_seed` from :mod:`secrets`
when the run's first attempt is claimed, and reused by the run's retries (an infrastructure
failure the submission could provoke, such as ranks that drift apart in their last bits, must
not buy it another seed). The seed is stored on each ``attempts`` row and shown only once its
run has ended (its run's manifest records it; ``GET /v1/submissions/{id}`` lists it).
A profile's public seed is the local default of ``prism eval``: never a service run's. With the
revealed seed, ``prism eval --profile P --seed S`` on the same bundle and data repeats the run's
bpb to the last bit. A submitter who tries variants locally against the public seed learns
nothing about the seed the service will draw.

**Confirmation.** Seed noise is the size of the ranking rule (0.007 to 0.04 bpb between seeds
of one bundle, issue 29), so a submission whose first run's prequential bpb would place it among
the first ``policy.confirm_top_n`` entries (:func:`would_place`: fewer than ``confirm_top_n``
hotkeys have an entry whose mean bpb is at or below it, ties going to the earlier entry) gets
``policy.confirm_runs`` runs in all, each on a fresh secret seed. The decision is taken in the
transaction that stores the first run (:func:`runs_wanted`). A run zeroed by the anti-cheat
(``final_score == 0``) ranks in the last tier and is never confirmed.
"""

from __future__ import annotations

import secrets
import statistics
from collections.abc import Collection
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from prism_challenge.options import DEFAULT_SEED
from prism_challenge.service.models import Run, Submission, Submitter

SEED_BOUND = 2**31
"""Seeds are drawn from ``0 .. 2**31 - 1`` (a 31-bit secret: a submitter guessing it has a chance
of 2**-31; every RNG the harness seeds accepts it)."""

LIVE = ("pending", "running", "completed")
"""Submissions whose scored runs are entries: completed, or provisional (confirmation runs to go)."""


def draw_seed(public: Collection[int] = ()) -> int:
    """A fresh secret seed, uniform on ``0 .. SEED_BOUND - 1`` (:func:`secrets.randbelow`),
    never one of ``public`` nor :data:`~prism_challenge.options.DEFAULT_SEED` (drawn again)."""
    avoid = {DEFAULT_SEED, *public}
    while True:
        seed = secrets.randbelow(SEED_BOUND)
        if seed not in avoid:
            return seed


def entry_means(s: Session, profile: str | None, exclude: int) -> dict[str, float]:
    """The best mean prequential bpb (bits per byte) per hotkey among the live entries under
    ``profile`` (:data:`LIVE` submissions with scored, non-zeroed runs), submission ``exclude``
    left out: ``{hotkey: min over its submissions of mean(bpb of their runs)}``."""
    rows = s.execute(
        select(Submission.id, Submitter.hotkey, Run.prequential_bpb)
        .join(Submitter, Submitter.id == Submission.submitter_id)
        .join(Run, Run.submission_id == Submission.id)
        .where(Submission.profile == profile if profile is not None else Submission.profile.is_(None),
               Submission.status.in_(LIVE), Submission.id != exclude, Run.status == "scored",
               Run.final_score > 0, Run.prequential_bpb.is_not(None))).all()
    per: dict[int, tuple[str, list[float]]] = {}
    for sid, hotkey, bpb in rows:
        per.setdefault(sid, (hotkey, []))[1].append(bpb)
    best: dict[str, float] = {}
    for hotkey, bpbs in per.values():
        best[hotkey] = min(best.get(hotkey, float("inf")), statistics.fmean(bpbs))
    return best


def would_place(bpb: float, means: dict[str, float], hotkey: str, top_n: int) -> bool:
    """Whether a first run of ``bpb`` would place ``hotkey``'s entry among the first ``top_n``:
    fewer than ``top_n`` other hotkeys have a mean at or below ``bpb`` (an earlier entry keeps
    a tie)."""
    return sum(1 for h, m in means.items() if h != hotkey and m <= bpb) < top_n


def runs_wanted(s: Session, sub: Submission, run: Run, policy: Any | None) -> int:
    """How many runs ``sub`` gets, decided as its first run ``run`` is stored (the caller's
    transaction): ``policy.confirm_runs`` when the run scored, is not zeroed and
    :func:`would_place` it among the first ``policy.confirm_top_n``; else 1 (also without a
    policy: a submission whose profile cannot be read)."""
    if policy is None or run.status != "scored" or not run.final_score or policy.confirm_runs <= 1:
        return 1
    hotkey = s.scalar(select(Submitter.hotkey).where(Submitter.id == sub.submitter_id))
    means = entry_means(s, sub.profile, sub.id)
    return int(policy.confirm_runs) if would_place(run.prequential_bpb, means, hotkey, policy.confirm_top_n) else 1


__all__ = ["LIVE", "SEED_BOUND", "draw_seed", "entry_means", "runs_wanted", "would_place"]
