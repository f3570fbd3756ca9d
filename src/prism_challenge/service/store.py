"""The service's storage: SQLAlchemy 2 over SQLite (default) or PostgreSQL (by URL), its schema
made by the Alembic migrations of ``service/migrations``, applied when a :class:`Store` opens.

The state machine of a submission (:data:`TRANSITIONS`)::

    pending -> running -> completed | failed | rejected
                  \\-> pending   (an infrastructure failure while attempts are left)

``running`` is entered only by :meth:`Store.claim`, a compare-and-set on ``status = 'pending'``
that also counts the attempt, so two workers can never evaluate one submission at once; an
attempt's result is written once (:meth:`Store.finish` refuses a second write and a stale
attempt). Outcomes (:func:`outcome_of`): scored -> ``completed``; a ``submission`` failure ->
``rejected`` (final); an ``infrastructure`` failure -> ``pending`` again while ``attempts <
max_attempts``, else ``failed``; a cancel -> ``failed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine, event, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from prism_challenge.failures import CANCELLED, INFRASTRUCTURE, SUBMISSION
from prism_challenge.results import EvalResult
from prism_challenge.service.models import Attempt, Nonce, Run, Submission, Submitter, utcnow

MIGRATIONS = Path(__file__).parent / "migrations"
DB_NAME = "prism.sqlite3"
DEFAULT_MAX_ATTEMPTS = 3  # one evaluation and two retries of infrastructure failures
TRANSITIONS = frozenset({("pending", "running"), ("running", "completed"), ("running", "failed"),
                         ("running", "rejected"), ("running", "pending")})
"""Every change of a submission's status the store makes (``(from, to)``)."""


class StoreError(RuntimeError):
    """A request the store refuses (the message names the row and the rule)."""


class NonceReused(StoreError):
    """The hotkey already used this nonce (a replayed request)."""


class TransitionError(StoreError):
    """A change the state machine does not allow, or an attempt's result written twice."""


def default_url() -> str:
    """``sqlite:///<user data dir>/prism-challenge/prism.sqlite3`` (``platformdirs``; on Linux
    ``$XDG_DATA_HOME`` or ``~/.local/share``)."""
    from platformdirs import user_data_dir

    return f"sqlite:///{Path(user_data_dir('prism-challenge')) / DB_NAME}"


def outcome_of(result: EvalResult, attempts: int, max_attempts: int) -> tuple[str, str]:
    """The attempt's outcome and the submission's next status for ``result``.

    Returns:
        ``(outcome, status)``: ``("completed", "completed")``, ``("rejected", "rejected")``,
        ``("retry", "pending")`` or ``("failed", "failed")``.

    Raises:
        StoreError: a failed result without a known kind.
    """
    if result.status == "scored":
        return "completed", "completed"
    if result.kind == SUBMISSION:
        return "rejected", "rejected"
    if result.kind == INFRASTRUCTURE and attempts < max_attempts:
        return "retry", "pending"
    if result.kind not in (INFRASTRUCTURE, CANCELLED):
        raise StoreError(f"a {result.status} result of kind {result.kind!r}: not a kind of prism_challenge.failures")
    return "failed", "failed"


@dataclass(frozen=True)
class Claim:
    """A submission taken for evaluation: its id, the attempt's id and number (1, 2, ...)."""

    submission_id: int
    attempt_id: int
    number: int


class Store:
    """The service's database.

    Args:
        url: a SQLAlchemy URL (``sqlite:///path``, ``postgresql+psycopg://...``); ``None``:
            :func:`default_url`. A SQLite file's folder is created.

    Raises:
        sqlalchemy.exc.ArgumentError: a malformed URL.
    """

    def __init__(self, url: str | None = None):
        self.url = url or default_url()
        if self.url.startswith("sqlite:///") and self.url != "sqlite:///:memory:":
            Path(self.url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = create_engine(self.url)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.migrate()

    def migrate(self) -> None:
        """Apply every Alembic migration not applied yet (``upgrade head``)."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with self.engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")

    def close(self) -> None:
        """Release the engine's connections."""
        self.engine.dispose()

    # -- intake -------------------------------------------------------------------------------
    def use_nonce(self, hotkey: str, nonce: str, timestamp: int) -> None:
        """Record ``nonce`` for ``hotkey``.

        Raises:
            NonceReused: the hotkey used it before.
        """
        try:
            with self.sessions.begin() as s:
                s.add(Nonce(hotkey=hotkey, nonce=nonce, timestamp=timestamp, created_at=utcnow()))
        except IntegrityError:
            raise NonceReused(f"hotkey {hotkey}: nonce {nonce!r} was already used") from None

    def submit(self, hotkey: str, bundle_sha256: str, *, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
               source_sha256: str | None = None, family_sha256: str | None = None, variant_of: int | None = None,
               profile: str | None = None) -> int:
        """A new ``pending`` submission of ``bundle_sha256`` by ``hotkey`` (the submitter is
        created on first use); returns its id.

        Args:
            source_sha256: sha256 of the bundle's normalized source (duplicates).
            family_sha256: sha256 of its normalized ``architecture.py`` (the family).
            variant_of: the id of the family's first submission when this is a training variant.
            profile: the challenge profile it is evaluated under.

        Raises:
            StoreError: ``max_attempts`` below 1.
            sqlalchemy.exc.IntegrityError: ``variant_of`` names no submission.
        """
        if max_attempts < 1:
            raise StoreError(f"max_attempts = {max_attempts}: must be at least 1")
        now = utcnow()
        with self.sessions.begin() as s:
            submitter = _submitter(s, hotkey, now)
            row = Submission(submitter_id=submitter.id, bundle_sha256=bundle_sha256, status="pending", attempts=0,
                             max_attempts=max_attempts, created_at=now, updated_at=now, source_sha256=source_sha256,
                             family_sha256=family_sha256, variant_of=variant_of, profile=profile)
            s.add(row)
            s.flush()
            return row.id

    # -- evaluation ---------------------------------------------------------------------------
    def claim(self, submission_id: int | None = None, *, worker: str | None = None) -> Claim | None:
        """Take a ``pending`` submission (``submission_id``, or the oldest) for evaluation:
        ``running``, one more attempt. ``None`` when there is none (or another worker took it).

        On PostgreSQL the candidate row is locked with ``FOR UPDATE SKIP LOCKED``, so concurrent
        workers take different rows without waiting on each other; on every database the change
        itself is a compare-and-set on ``status = 'pending'`` (SQLite has no row locks: its
        writers take turns on the file).
        """
        tried: list[int] = []
        with self.sessions.begin() as s:
            while True:
                q = (select(Submission.id)
                     .where(Submission.status == "pending", Submission.attempts < Submission.max_attempts)
                     .order_by(Submission.id).limit(1).with_for_update(skip_locked=True))
                if submission_id is not None:
                    q = q.where(Submission.id == submission_id)
                if tried:
                    q = q.where(Submission.id.not_in(tried))
                sid = s.scalar(q)
                if sid is None:
                    return None
                now = utcnow()
                taken = s.execute(
                    update(Submission)
                    .where(Submission.id == sid, Submission.status == "pending",
                           Submission.attempts < Submission.max_attempts)
                    .values(status="running", attempts=Submission.attempts + 1, updated_at=now)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if taken != 1:  # another worker took it between the read and the write
                    tried.append(sid)
                    continue
                number = s.scalar(select(Submission.attempts).where(Submission.id == sid))
                attempt = Attempt(submission_id=sid, number=number, worker=worker, started_at=now)
                s.add(attempt)
                s.flush()
                return Claim(sid, attempt.id, number)

    def finish(self, attempt_id: int, result: EvalResult) -> str:
        """Write the result of attempt ``attempt_id`` (once) and move its submission on;
        returns the submission's new status.

        Raises:
            TransitionError: the attempt already has a result, is not its submission's current
                attempt, or the submission is not ``running``.
        """
        now = utcnow()
        with self.sessions.begin() as s:
            attempt = s.get(Attempt, attempt_id, with_for_update=True)
            if attempt is None:
                raise TransitionError(f"attempt {attempt_id}: no such attempt")
            sub = s.get(Submission, attempt.submission_id, with_for_update=True)
            if attempt.outcome is not None:
                raise TransitionError(f"attempt {attempt_id}: its result was already written ({attempt.outcome})")
            if sub.status != "running" or sub.attempts != attempt.number:
                raise TransitionError(f"attempt {attempt_id}: submission {sub.id} is {sub.status} at attempt "
                                      f"{sub.attempts}, not running attempt {attempt.number}")
            outcome, status = outcome_of(result, sub.attempts, sub.max_attempts)
            _check(sub.status, status)
            failure = result.failure
            attempt.finished_at, attempt.outcome = now, outcome
            if failure is not None:
                attempt.failure_stage, attempt.failure_kind, attempt.failure_message = (
                    failure.stage, failure.kind, failure.message)
            s.add(Run(attempt_id=attempt.id, status=result.status, run_dir=result.run_dir,
                      prequential_bpb=result.prequential_bpb, final_score=result.final_score,
                      manifest=result.manifest.to_json_dict(), created_at=now))
            sub.status, sub.updated_at = status, now
            if status != "pending":
                sub.finished_at = now
            sub.error_stage = failure.stage if failure else None
            sub.error_kind = failure.kind if failure else None
            sub.error_message = failure.message if failure else None
            return status

    # -- reading ------------------------------------------------------------------------------
    def submission(self, submission_id: int) -> Submission | None:
        """The submission's row (detached), or ``None``."""
        with self.sessions() as s:
            return s.get(Submission, submission_id)

    def attempts(self, submission_id: int) -> list[Attempt]:
        """The submission's attempts, first first (detached rows)."""
        with self.sessions() as s:
            return list(s.scalars(select(Attempt).where(Attempt.submission_id == submission_id)
                                  .order_by(Attempt.number)))

    def run_of(self, attempt_id: int) -> Run | None:
        """The run an attempt wrote, or ``None``."""
        with self.sessions() as s:
            return s.scalar(select(Run).where(Run.attempt_id == attempt_id))


def _check(old: str, new: str) -> None:
    if (old, new) not in TRANSITIONS:
        raise TransitionError(f"status {old} -> {new}: not a transition of the state machine")


def _submitter(s: Session, hotkey: str, now) -> Submitter:
    row = s.scalar(select(Submitter).where(Submitter.hotkey == hotkey))
    if row is None:
        row = Submitter(hotkey=hotkey, created_at=now)
        s.add(row)
        s.flush()
    return row


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    """Foreign keys enforced; a writer waits up to 30 s for another's lock instead of failing."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


__all__ = ["Claim", "DEFAULT_MAX_ATTEMPTS", "NonceReused", "Store", "StoreError", "TRANSITIONS", "TransitionError",
           "default_url", "outcome_of"]
