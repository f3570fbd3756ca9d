"""Reading the fleet from the database: the watchdog query and ``prism fleet status``.

Owners (issue 18, item 2): a ``running`` submission is owned by the dispatcher tracking its
current attempt, which refreshes ``attempts.heartbeat_at`` every
:data:`~prism_challenge.service.dispatch.HEARTBEAT_S` seconds; a ``pending`` one is owned by the
queue, that is by any dispatcher that is not stopped and whose own heartbeat is fresh. A
heartbeat older than :data:`STALE_AFTER_S` is no owner. :func:`unowned` lists the non-final
submissions without one; :func:`oldest_unowned_age_s` is the figure ``/health`` reports (``None``:
every non-final submission has an owner).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select

from prism_challenge.service.dispatch import HEARTBEAT_S
from prism_challenge.service.models import Attempt, Dispatcher, Run, Submission, utcnow
from prism_challenge.service.store import Store

STALE_AFTER_S = 6 * HEARTBEAT_S  # six missed heartbeats: the owner is gone
RECENT_S = 3600.0  # "the last hour" of fleet status


@dataclass(frozen=True)
class Unowned:
    """A non-final submission without an owner, and since when (UTC) it has had none."""

    submission_id: int
    status: str
    since: datetime
    age_s: float


def _live_dispatchers(s, cutoff: datetime) -> tuple[int, datetime | None]:
    """How many dispatchers are live at ``cutoff``, and the last time any was seen."""
    live = s.scalar(select(func.count()).select_from(Dispatcher)
                    .where(Dispatcher.stopped_at.is_(None), Dispatcher.heartbeat_at >= cutoff))
    last = s.scalar(select(func.max(Dispatcher.heartbeat_at)))
    return int(live or 0), last


def unowned(store: Store, *, stale_after_s: float = STALE_AFTER_S, now: datetime | None = None) -> list[Unowned]:
    """The non-final submissions without an owner (module docstring), the longest unowned first.

    A ``running`` one is unowned since its current attempt's last heartbeat; a ``pending`` one,
    when no dispatcher is live, since the later of its last change and the last dispatcher
    heartbeat.
    """
    now = now or utcnow()
    cutoff = now - timedelta(seconds=stale_after_s)
    out: list[Unowned] = []
    with store.sessions() as s:
        rows = s.execute(select(Submission.id, Attempt.heartbeat_at, Attempt.started_at)
                         .join(Attempt, (Attempt.submission_id == Submission.id)
                               & (Attempt.number == Submission.attempts))
                         .where(Submission.status == "running")).all()
        for sid, beat, started in rows:
            since = beat or started
            if since < cutoff:
                out.append(Unowned(sid, "running", since, (now - since).total_seconds()))
        live, last = _live_dispatchers(s, cutoff)
        if live == 0:
            for sid, changed in s.execute(select(Submission.id, Submission.updated_at)
                                          .where(Submission.status == "pending")).all():
                since = max(changed, last) if last is not None else changed
                out.append(Unowned(sid, "pending", since, max(0.0, (now - since).total_seconds())))
    return sorted(out, key=lambda u: (u.since, u.submission_id))


def oldest_unowned_age_s(store: Store, *, stale_after_s: float = STALE_AFTER_S) -> float | None:
    """Seconds the longest-unowned non-final submission has been without an owner, or ``None``
    when there is none (what ``/health`` reports)."""
    rows = unowned(store, stale_after_s=stale_after_s)
    return rows[0].age_s if rows else None


@dataclass(frozen=True)
class RunningAttempt:
    """A running attempt: submission, attempt number, node, age and heartbeat age (s)."""

    submission_id: int
    number: int
    node: str | None
    worker: str | None
    age_s: float
    heartbeat_age_s: float | None


@dataclass(frozen=True)
class FleetStatus:
    """What ``prism fleet status`` shows.

    Attributes:
        pending: submissions waiting; ``ready`` of them past their retry backoff.
        running: the running attempts, oldest first.
        last_hour: final states reached in the last hour -> count.
        recent: the last hour's results, newest first: ``(submission, status, attempts, bpb,
            finished)`` (bpb: the mean of its runs).
        dispatchers: ``(name, heartbeat age s, stopped)`` of every dispatcher not stopped, and
            of those stopped in the last hour.
        oldest_unowned_s: :func:`oldest_unowned_age_s`.
    """

    pending: int
    ready: int
    running: list[RunningAttempt]
    last_hour: dict[str, int]
    recent: list[tuple[int, str, int, float | None, datetime]]
    dispatchers: list[tuple[str, float, bool]]
    oldest_unowned_s: float | None


def fleet_status(store: Store, *, now: datetime | None = None, recent: int = 20) -> FleetStatus:
    """Read :class:`FleetStatus` from the database (``recent``: how many results to list)."""
    now = now or utcnow()
    hour = now - timedelta(seconds=RECENT_S)
    age = lambda t: (now - t).total_seconds() if t is not None else None  # noqa: E731
    with store.sessions() as s:
        pending = s.scalar(select(func.count()).where(Submission.status == "pending"))
        ready = s.scalar(select(func.count()).where(
            Submission.status == "pending", Submission.not_before.is_(None) | (Submission.not_before <= now)))
        running = [RunningAttempt(a.submission_id, a.number, a.node, a.worker, age(a.started_at), age(a.heartbeat_at))
                   for a in s.scalars(select(Attempt).join(Submission, (Submission.id == Attempt.submission_id)
                                                           & (Attempt.number == Submission.attempts))
                                      .where(Submission.status == "running").order_by(Attempt.started_at))]
        counts = dict(s.execute(select(Submission.status, func.count()).where(Submission.finished_at >= hour)
                                .group_by(Submission.status)).all())
        bpb = (select(func.avg(Run.prequential_bpb)).where(Run.submission_id == Submission.id)  # over its runs
               .correlate(Submission).scalar_subquery())
        rows = s.execute(select(Submission.id, Submission.status, Submission.attempts, bpb, Submission.finished_at)
                         .where(Submission.finished_at >= hour)
                         .order_by(Submission.finished_at.desc()).limit(recent)).all()
        dispatchers = [(d.name, age(d.heartbeat_at), d.stopped_at is not None)
                       for d in s.scalars(select(Dispatcher).where(Dispatcher.stopped_at.is_(None)
                                                                   | (Dispatcher.stopped_at >= hour))
                                          .order_by(Dispatcher.started_at))]
    return FleetStatus(int(pending), int(ready), running, counts, [tuple(r) for r in rows], dispatchers,
                       oldest_unowned_age_s(store))


__all__ = ["FleetStatus", "RECENT_S", "RunningAttempt", "STALE_AFTER_S", "Unowned", "fleet_status",
           "oldest_unowned_age_s", "unowned"]
