"""Reads of the service's database that the routes share: duplicates, families, a
submission's view and the scored entries of a profile (the leaderboard's and the weights')."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select

from prism_challenge.service.models import Attempt, Nonce, Run, Submission, Submitter
from prism_challenge.service.store import Store

REFUSES_DUPLICATES = ("pending", "running", "completed", "rejected")
"""An earlier submission in one of these states makes a new one with the same normalized source
a duplicate. A ``failed`` one (infrastructure failures with no attempt left, or a cancel) does
not: its bundle was never judged, so it may be sent again."""


def duplicate_of(store: Store, source_sha256: str, profile: str) -> int | None:
    """The earliest submission under ``profile`` with this normalized source that refuses a
    duplicate (:data:`REFUSES_DUPLICATES`), or ``None``."""
    with store.sessions() as s:
        return s.scalar(select(Submission.id).where(
            Submission.source_sha256 == source_sha256, Submission.profile == profile,
            Submission.status.in_(REFUSES_DUPLICATES)).order_by(Submission.id).limit(1))


def family_root(store: Store, family_sha256: str, profile: str) -> int | None:
    """The first submission of the family under ``profile`` (the one a new member is a
    training variant of), or ``None`` for a new family."""
    with store.sessions() as s:
        return s.scalar(select(Submission.id).where(
            Submission.family_sha256 == family_sha256, Submission.profile == profile,
            Submission.variant_of.is_(None)).order_by(Submission.id).limit(1))


def prune_nonces(store: Store, before: datetime) -> int:
    """Delete the nonces recorded before ``before``; returns how many. Safe for
    ``before = now - 2 * window``: such a nonce's request had a timestamp within the window of
    its recording, so a replay of it now carries a timestamp outside the window and is refused
    for that."""
    with store.sessions.begin() as s:
        return s.execute(delete(Nonce).where(Nonce.created_at < before)).rowcount


def hotkey_of(store: Store, submission: Submission) -> str:
    """The SS58 hotkey of ``submission``'s submitter."""
    with store.sessions() as s:
        return s.scalar(select(Submitter.hotkey).where(Submitter.id == submission.submitter_id))


def latest_run(store: Store, submission_id: int) -> Run | None:
    """The run of the submission's latest attempt that wrote one, or ``None``."""
    with store.sessions() as s:
        return s.scalar(select(Run).join(Attempt, Run.attempt_id == Attempt.id)
                        .where(Attempt.submission_id == submission_id).order_by(Attempt.number.desc()).limit(1))


def scored_runs(store: Store, submission_id: int) -> list[Run]:
    """The submission's scored runs, one per run index (its first run and confirmation runs), in
    run order."""
    with store.sessions() as s:
        return list(s.scalars(select(Run).where(Run.submission_id == submission_id, Run.status == "scored")
                              .order_by(Run.run_index, Run.id)))


@dataclass(frozen=True)
class Entry:
    """One scored submission as :func:`prism_challenge.score.verdict.rank` reads it (attribute names
    are its keys) plus what the leaderboard shows.

    Over the submission's scored runs (issue 29: several once confirmed): ``prequential_bpb``
    is their mean (bits per byte), ``bpbs`` each run's in run order, ``bpb_std`` their sample
    std (ddof=1; ``None`` for one run), ``heldout_delta`` (bpb) and ``final_score`` means (the
    delta ``None`` when no run has one), ``anti_cheat_multiplier`` and
    ``memorization_penalty`` the lowest, ``flags`` every run's; all from the run manifests'
    ``verdict``. ``provisional``: runs are still to come (the submission is not final).
    ``submitted_at`` is the submission's creation (UTC).
    """

    id: int
    hotkey: str
    submitted_at: datetime
    prequential_bpb: float
    heldout_delta: float | None
    final_score: float
    anti_cheat_multiplier: float
    memorization_penalty: float
    flags: tuple[str, ...]
    family_sha256: str | None
    variant_of: int | None
    bpbs: tuple[float, ...] = ()
    bpb_std: float | None = None
    provisional: bool = False


def scored_entries(store: Store, profile: str, *, provisional: bool = False) -> list[Entry]:
    """Every ``completed`` submission under ``profile`` with its scored runs, unranked (only the
    manifests' ``verdict`` sections are read from the database, not their curves);
    ``provisional``: also the submissions with a scored run and confirmation runs to go."""
    states = ("completed", "pending", "running") if provisional else ("completed",)
    with store.sessions() as s:
        rows = s.execute(
            select(Submission, Submitter.hotkey, Run.manifest["verdict"])
            .join(Submitter, Submitter.id == Submission.submitter_id)
            .join(Run, Run.submission_id == Submission.id)
            .where(Submission.profile == profile, Submission.status.in_(states), Run.status == "scored")
            .order_by(Submission.id, Run.run_index)).all()
    per: dict[int, tuple[Submission, str, list[dict[str, Any]]]] = {}
    for sub, hotkey, verdict in rows:
        per.setdefault(sub.id, (sub, hotkey, []))[2].append(verdict)
    return [_entry(sub, hotkey, verdicts) for sub, hotkey, verdicts in per.values()]


def _entry(sub: Submission, hotkey: str, vs: list[dict[str, Any]]) -> Entry:
    bpbs = tuple(v["prequential_bpb"] for v in vs)
    deltas = [d for v in vs if (d := (v.get("heldout") or {}).get("heldout_delta")) is not None]
    flags = tuple(dict.fromkeys(f for v in vs for f in (v.get("flags") or ())))
    return Entry(id=sub.id, hotkey=hotkey, submitted_at=sub.created_at, prequential_bpb=statistics.fmean(bpbs),
                 heldout_delta=statistics.fmean(deltas) if deltas else None,
                 final_score=statistics.fmean(v["final_score"] for v in vs),
                 anti_cheat_multiplier=min(v["anti_cheat_multiplier"] for v in vs),
                 memorization_penalty=min(v["memorization_penalty"] for v in vs), flags=flags,
                 family_sha256=sub.family_sha256, variant_of=sub.variant_of, bpbs=bpbs,
                 bpb_std=statistics.stdev(bpbs) if len(bpbs) > 1 else None, provisional=sub.status != "completed")


__all__ = ["Entry", "REFUSES_DUPLICATES", "duplicate_of", "family_root", "hotkey_of", "latest_run", "prune_nonces", "scored_entries"]
