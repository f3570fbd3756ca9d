"""The service's storage: SQLAlchemy 2 over SQLite (default) or PostgreSQL (by URL), its schema
made by the Alembic migrations of ``service/migrations``, applied when a :class:`Store` opens.

The state machine of a submission (:data:`TRANSITIONS`)::

    pending -> running -> completed | failed | rejected
                  \\-> pending   (an infrastructure failure while attempts are left)

``running`` is entered only by :meth:`Store.claim`, a compare-and-set on ``status = 'pending'``
that also counts the attempt and gives it a fresh fencing token, so two workers can never
evaluate one submission at once. Only the current attempt writes a result (:meth:`Store.record`,
by token: a superseded attempt's result is discarded and logged, the same result written twice
changes nothing; :meth:`Store.finish`, by attempt id, refuses both), and the transaction that
stores the submission's one run (``runs.submission_id`` is unique) makes it final (and records
the run's finding, if its manifest proves a cheat: :mod:`~prism_challenge.service.findings`,
so one finding per run however often a result is written); a retried
attempt stores its reason on its ``attempts`` row and no run. Outcomes (:func:`outcome_of`): scored -> ``completed``; a ``submission`` failure ->
``rejected`` (final); an ``infrastructure`` failure -> ``pending`` again while ``attempts <
max_attempts``, else ``failed``; a cancel -> ``failed``.

Confirmation (issue 29, :mod:`~prism_challenge.service.confirm`): a submission has
``runs_wanted`` runs, one after another, each ended by one attempt on its own secret seed. A
scored run that leaves runs to go moves the submission back to ``pending`` (the next claim starts
the next run, with the retry budget of a fresh run); it is ``completed`` when its last run is.
A confirmation run's ``submission`` or final ``infrastructure`` failure ends the submission as
for a first run.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import create_engine, event, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from prism_challenge.failures import CANCELLED, INFRASTRUCTURE, SUBMISSION
from prism_challenge.manifest.results import EvalResult
from prism_challenge.service.confirm import draw_seed, runs_wanted
from prism_challenge.service.findings import record_finding
from prism_challenge.service.models import Attempt, Dispatcher, Nonce, Run, Submission, Submitter, storable, utcnow

log = logging.getLogger("prism_challenge.service")

MIGRATIONS = Path(__file__).parent / "migrations"
DB_NAME = "prism.sqlite3"
DEFAULT_MAX_ATTEMPTS = 3  # one evaluation and two retries of infrastructure failures
CLAIM_CANDIDATES = 16  # the oldest ready submissions one claim tries (another worker may take some first)
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
    """A submission taken for evaluation: its id, the attempt's id and number (1, 2, ...), the
    attempt's fencing token (32 hex digits; ``""`` for an attempt made before migration 0003),
    its secret seed (``None`` before migration 0006), the run it is an attempt of (0, 1, ...)
    and the attempts the submission's earlier runs spent (``number - run_base``: this run's)."""

    submission_id: int
    attempt_id: int
    number: int
    token: str = ""
    seed: int | None = None
    run_index: int = 0
    run_base: int = 0


@dataclass(frozen=True)
class Recorded:
    """What :meth:`Store.record` did: the submission's status after it, whether this call wrote
    the result, and why (``written``, ``duplicate``: the same result was already written,
    ``superseded``: the attempt is not the current one, its result was discarded)."""

    status: str
    written: bool
    reason: str


class Store:
    """The service's database.

    Args:
        url: a SQLAlchemy URL (``sqlite:///path``, ``postgresql+psycopg://...``); ``None``:
            :func:`default_url`. A SQLite file's folder is created.

    Each connection taken from the pool is pinged first (SQLAlchemy's ``pool_pre_ping``): one
    the server ended while it sat in the pool (a restart, a dropped link,
    ``pg_terminate_backend``) is replaced, not handed to the next caller as an error.

    Raises:
        sqlalchemy.exc.ArgumentError: a malformed URL.
    """

    def __init__(self, url: str | None = None):
        self.url = url or default_url()
        if self.url.startswith("sqlite:///") and self.url != "sqlite:///:memory:":
            Path(self.url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = create_engine(self.url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.migrate()

    def migrate(self) -> None:
        """Apply every Alembic migration not applied yet (``upgrade head``).

        On SQLite, foreign keys are off while the migrations run (a batch migration copies a
        table that others refer to, which the check would refuse), and checked afterwards.

        Raises:
            StoreError: a row refers to a row that does not exist after the migrations.
        """
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        sqlite = self.engine.dialect.name == "sqlite"
        with self.engine.connect() as connection:
            if sqlite:  # a no-op inside a transaction: set before it begins
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            with connection.begin():
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()
                if broken:
                    raise StoreError(f"after the migrations, rows refer to missing rows: {broken[:5]}")

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
               profile: str | None = None, client_address: str | None = None,
               admit: Callable[[Session], None] | None = None) -> int:
        """A new ``pending`` submission of ``bundle_sha256`` by ``hotkey`` (the submitter is
        created on first use); returns its id.

        Args:
            source_sha256: sha256 of the bundle's normalized source (duplicates).
            family_sha256: sha256 of its normalized ``architecture.py`` (the family).
            variant_of: the id of the family's first submission when this is a training variant.
            profile: the challenge profile it is evaluated under.
            client_address: the client that sent it (the per-address limit counts these rows).
            admit: called with the transaction's session before the row is added (the admission
                limits, :func:`prism_challenge.service.admission.admit`); what it raises
                refuses the submission and writes nothing.

        Raises:
            StoreError: ``max_attempts`` below 1.
            sqlalchemy.exc.IntegrityError: ``variant_of`` names no submission.
        """
        if max_attempts < 1:
            raise StoreError(f"max_attempts = {max_attempts}: must be at least 1")
        now = utcnow()
        for last in (False, True):  # a hotkey's first two submissions at once: one makes the submitter
            try:
                with self.sessions.begin() as s:
                    if admit is not None:
                        admit(s)
                    submitter = _submitter(s, hotkey, now)
                    row = Submission(submitter_id=submitter.id, bundle_sha256=bundle_sha256, status="pending",
                                     attempts=0, max_attempts=max_attempts, created_at=now, updated_at=now,
                                     source_sha256=source_sha256, family_sha256=family_sha256, variant_of=variant_of,
                                     profile=profile, client_address=client_address)
                    s.add(row)
                    s.flush()
                    return row.id
            except IntegrityError as exc:
                if last or "hotkey" not in str(exc.orig):
                    raise
        raise AssertionError("unreachable")

    # -- evaluation ---------------------------------------------------------------------------
    def claim(self, submission_id: int | None = None, *, worker: str | None = None,
              public_seeds: Collection[int] = ()) -> Claim | None:
        """Take a ``pending`` submission (``submission_id``, or the oldest whose backoff is over)
        for evaluation: ``running``, one more attempt with a fresh fencing token, of the
        submission's next run, on that run's secret seed: drawn by the run's first attempt
        (:func:`~prism_challenge.service.confirm.draw_seed`, never one of ``public_seeds``: the
        profiles' public seeds) and reused by its retries. ``None``
        when there is none (or another worker took it).

        On PostgreSQL the candidate row is locked with ``FOR UPDATE SKIP LOCKED``, so concurrent
        workers take different rows without waiting on each other; on every database the change
        itself is a compare-and-set on ``status = 'pending'`` (SQLite has no row locks: its
        writers take turns on the file). At most :data:`CLAIM_CANDIDATES` rows are tried.
        """
        tried: list[int] = []
        with self.sessions.begin() as s:
            now = utcnow()
            ready = (Submission.not_before.is_(None)) | (Submission.not_before <= now)
            while len(tried) < CLAIM_CANDIDATES:
                q = (select(Submission.id)
                     .where(Submission.status == "pending", ready, Submission.attempts < Submission.max_attempts)
                     .order_by(Submission.id).limit(1).with_for_update(skip_locked=True))
                if submission_id is not None:
                    q = q.where(Submission.id == submission_id)
                if tried:
                    q = q.where(Submission.id.not_in(tried))
                sid = s.scalar(q)
                if sid is None:
                    return None
                taken = s.execute(
                    update(Submission)
                    .where(Submission.id == sid, Submission.status == "pending", ready,
                           Submission.attempts < Submission.max_attempts)
                    .values(status="running", attempts=Submission.attempts + 1, updated_at=now, not_before=None)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if taken != 1:  # another worker took it between the read and the write
                    tried.append(sid)
                    continue
                number, base = s.execute(select(Submission.attempts, Submission.run_base)
                                         .where(Submission.id == sid)).one()
                index = s.scalar(select(func.count()).select_from(Run).where(Run.submission_id == sid))
                # a run's seed is drawn once, by its first attempt; its retries reuse it, so a
                # failure the submission could provoke (kind infrastructure, retried) re-rolls nothing
                seed = s.scalar(select(Attempt.seed).where(Attempt.submission_id == sid, Attempt.run_index == index,
                                                           Attempt.seed.is_not(None)).order_by(Attempt.number).limit(1))
                attempt = Attempt(submission_id=sid, number=number, worker=worker, started_at=now,
                                  token=secrets.token_hex(16), heartbeat_at=now,
                                  seed=draw_seed(public_seeds) if seed is None else seed, run_index=index)
                s.add(attempt)
                s.flush()
                return Claim(sid, attempt.id, number, attempt.token, attempt.seed, index, base)
        return None

    def finish(self, attempt_id: int, result: EvalResult, *, backoff_s: float = 0.0) -> str:
        """Write the result of attempt ``attempt_id`` (once) and move its submission on;
        returns the submission's new status. Strict: for the fenced, idempotent write of a
        dispatcher see :meth:`record`.

        Raises:
            TransitionError: the attempt already has a result, is not its submission's current
                attempt, or the submission is not ``running``.
        """
        with self.sessions.begin() as s:
            attempt = s.get(Attempt, attempt_id, with_for_update=True)
            if attempt is None:
                raise TransitionError(f"attempt {attempt_id}: no such attempt")
            sub = s.get(Submission, attempt.submission_id, with_for_update=True)
            if attempt.outcome is not None:
                raise TransitionError(f"attempt {attempt_id}: its result was already written ({attempt.outcome})")
            if not _current(sub, attempt):
                raise TransitionError(f"attempt {attempt_id}: submission {sub.id} is {sub.status} at attempt "
                                      f"{sub.attempts}, not running attempt {attempt.number}")
            return _write(s, sub, attempt, result, backoff_s)

    def record(self, token: str, result: EvalResult, *, backoff_s: float = 0.0,
               max_attempts: int | None = None, policy_of: Callable[[str | None], object] | None = None) -> Recorded:
        """The fenced write of a dispatcher: store ``result`` under the attempt of fencing token
        ``token`` if it is its submission's current attempt, in one transaction with the
        submission's move to its next state (``backoff_s``: a retried submission is not claimed
        again for this many seconds). Idempotent: the same result written again changes
        nothing. A result of a superseded attempt (or another result for an attempt already
        written) is discarded and logged (logger ``prism_challenge.service``, warning).
        ``max_attempts``: the dispatcher's cap on attempts, below the submission's own when
        lower (an infrastructure failure at the cap is final), counted within the current run.
        ``policy_of``: the verdict policy of a profile name (``None``: unknown), read when a
        first run is stored to decide its confirmation
        (:func:`~prism_challenge.service.confirm.runs_wanted`); without it, no confirmation.

        Raises:
            TransitionError: no attempt has this token.
        """
        with self.sessions.begin() as s:
            attempt = s.scalar(select(Attempt).where(Attempt.token == token).with_for_update())
            if attempt is None:
                raise TransitionError(f"token {token}: no attempt has this fencing token")
            sub = s.get(Submission, attempt.submission_id, with_for_update=True)
            if attempt.outcome is not None and _same(s, attempt, result):
                return Recorded(sub.status, False, "duplicate")
            if attempt.outcome is not None or not _current(sub, attempt):
                why = (f"attempt {attempt.number} already ended ({attempt.outcome})" if attempt.outcome
                       else f"the submission is {sub.status} at attempt {sub.attempts}")
                log.warning("submission %d: discarded the %s result of superseded attempt %d (token %s): %s",
                            sub.id, result.status, attempt.number, token, why)
                return Recorded(sub.status, False, "superseded")
            policy = policy_of(sub.profile) if policy_of is not None else None
            return Recorded(_write(s, sub, attempt, result, backoff_s, max_attempts, policy), True, "written")

    def heartbeat(self, tokens: list[str], *, node: dict[str, str] | None = None) -> int:
        """Refresh the heartbeat of the live attempts of ``tokens`` (and set the nodes named in
        ``node``, token -> node); returns the number of attempts refreshed."""
        if not tokens:
            return 0
        now = utcnow()
        with self.sessions.begin() as s:
            n = s.execute(update(Attempt).where(Attempt.token.in_(tokens), Attempt.outcome.is_(None))
                          .values(heartbeat_at=now).execution_options(synchronize_session=False)).rowcount
            for token, where in (node or {}).items():
                s.execute(update(Attempt).where(Attempt.token == token).values(node=where[:128])
                          .execution_options(synchronize_session=False))
            return n

    def running(self) -> list[Claim]:
        """The current attempt of every ``running`` submission (oldest submission first)."""
        with self.sessions() as s:
            rows = s.execute(select(Attempt, Submission.run_base).join(Submission, Submission.id == Attempt.submission_id)
                             .where(Submission.status == "running", Attempt.number == Submission.attempts)
                             .order_by(Submission.id)).all()
            return [Claim(a.submission_id, a.id, a.number, a.token or "", a.seed, a.run_index, base)
                    for a, base in rows]

    def ended(self, tokens: list[str]) -> set[str]:
        """The fencing tokens among ``tokens`` whose attempt has ended (an outcome is written)."""
        if not tokens:
            return set()
        with self.sessions() as s:
            return set(s.scalars(select(Attempt.token).where(Attempt.token.in_(tokens), Attempt.outcome.is_not(None))))

    def dispatcher_beat(self, name: str, *, ray_address: str | None = None, stopped: bool = False) -> None:
        """Register dispatcher ``name`` (first call), refresh its heartbeat, or mark it stopped."""
        now = utcnow()
        with self.sessions.begin() as s:
            row = s.scalar(select(Dispatcher).where(Dispatcher.name == name))
            if row is None:
                row = Dispatcher(name=name, ray_address=ray_address, started_at=now, heartbeat_at=now)
                s.add(row)
            row.heartbeat_at = now
            if stopped:
                row.stopped_at = now

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

    def result_of(self, submission_id: int) -> Run | None:
        """The submission's latest run (its last stored run's), or ``None`` before one is stored."""
        with self.sessions() as s:
            return s.scalar(select(Run).where(Run.submission_id == submission_id).order_by(Run.run_index.desc())
                            .limit(1))

    def runs_of(self, submission_id: int) -> list[Run]:
        """The submission's runs, first first (detached rows; each ended, so its seed may be shown)."""
        with self.sessions() as s:
            return list(s.scalars(select(Run).where(Run.submission_id == submission_id).order_by(Run.run_index)))


def _current(sub: Submission, attempt: Attempt) -> bool:
    """Whether ``attempt`` is ``sub``'s current attempt, still running (the fence)."""
    return sub.status == "running" and sub.attempts == attempt.number and attempt.outcome is None


def _write(s: Session, sub: Submission, attempt: Attempt, result: EvalResult, backoff_s: float,
           max_attempts: int | None = None, policy: object | None = None) -> str:
    """Store the attempt's outcome and, when its run ends, the run, and move the submission on
    (the caller's transaction); returns the new status. ``max_attempts`` counts the current
    run's attempts; ``policy``: the confirmation policy (:func:`runs_wanted`)."""
    now = utcnow()
    cap = sub.max_attempts if max_attempts is None else min(sub.max_attempts, sub.run_base + max_attempts)
    outcome, status = outcome_of(result, sub.attempts, cap)
    _check(sub.status, status)
    failure = _failure_columns(result)
    attempt.finished_at, attempt.outcome, attempt.heartbeat_at = now, outcome, now
    if result.failure is not None:
        attempt.failure_stage, attempt.failure_kind, attempt.failure_message = failure
    if status == "pending":
        sub.not_before = now + timedelta(seconds=max(0.0, backoff_s))
    else:
        manifest = result.manifest.to_json_dict()
        run = Run(attempt_id=attempt.id, submission_id=sub.id, status=result.status, run_dir=storable(result.run_dir),
                  prequential_bpb=result.prequential_bpb, final_score=result.final_score, manifest=manifest,
                  created_at=now, run_index=attempt.run_index, seed=attempt.seed)
        s.add(run)
        s.flush()
        record_finding(s, sub, attempt, run, manifest, now)
        if status == "completed" and attempt.run_index == 0:
            sub.runs_wanted = runs_wanted(s, sub, run, policy)
        if status == "completed" and attempt.run_index + 1 < sub.runs_wanted:
            status = "pending"  # the next run: claimed at once, with a fresh run's retry budget
            sub.max_attempts = sub.attempts + (sub.max_attempts - sub.run_base)
            sub.run_base, sub.not_before = sub.attempts, None
        else:
            sub.finished_at = now
    sub.status, sub.updated_at = status, now
    sub.error_stage, sub.error_kind, sub.error_message = failure
    return status


def _failure_columns(result: EvalResult) -> tuple[str | None, str | None, str | None]:
    """The result's failure as its ``(stage, kind, message)`` columns store it (:func:`storable`;
    ``String(32)``, ``String(16)``, ``Text``), or three ``None``."""
    f = result.failure
    if f is None:
        return None, None, None
    return storable(f.stage, 32), storable(f.kind, 16), storable(f.message)


def _same(s: Session, attempt: Attempt, result: EvalResult) -> bool:
    """Whether ``result`` is what the ended ``attempt`` already stored (its run's manifest, or
    for a retried attempt, which stores no run, its failure)."""
    run = s.scalar(select(Run).where(Run.attempt_id == attempt.id))
    if run is not None:
        return run.manifest == result.manifest.to_json_dict()
    return result.failure is not None and (attempt.failure_stage, attempt.failure_kind, attempt.failure_message) == (
        _failure_columns(result))


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


__all__ = ["Claim", "DEFAULT_MAX_ATTEMPTS", "NonceReused", "Recorded", "Store", "StoreError", "TRANSITIONS", "TransitionError",
           "default_url", "outcome_of"]
