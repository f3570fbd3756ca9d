"""The service's tables (SQLAlchemy 2 declarative): submitters, submissions, attempts, runs, nonces,
dispatchers, findings.

Every change of a submission's state is recorded with a UTC timestamp: its creation
(``submissions.created_at``, state ``pending``), every start of an evaluation (an ``attempts``
row: ``started_at``), every end (the attempt's ``finished_at`` and ``outcome``), and the final
state (``submissions.finished_at``). ``submissions.attempts`` counts the attempts started; a
retry is allowed while it is below ``submissions.max_attempts``. The schema is created by the
Alembic migrations of ``service/migrations`` (a test checks they match these models).

Fencing (migration 0003, issue 18): every attempt has its own random ``token``; only the
submission's current attempt (its ``number`` equals ``submissions.attempts``, no outcome yet) may
write a result, and a run is stored once per submission (``runs.submission_id`` is unique), in
the transaction that moves the submission to its final state. ``attempts.heartbeat_at`` is
refreshed by the dispatcher that tracks the attempt, ``dispatchers.heartbeat_at`` by each running
dispatcher: a non-final submission whose owner's heartbeat is stale has no owner (the watchdog).

Findings (migration 0004, issue 25): a run whose manifest proves a cheat
(:mod:`prism_challenge.service.findings`) has one ``findings`` row against its hotkey, written in
the transaction that stores the run (``findings.run_id`` and ``findings.attempt_id`` are unique);
an operator's lift marks it (``lifted_at``, ``lifted_by``, ``lift_reason``), never deletes it.

Admission (migration 0005, issue 27): ``submissions.client_address``, so that every limit of
:mod:`prism_challenge.service.admission` is a count of accepted rows (a restart keeps it).

Seeds and confirmation (migration 0006, issue 29): every attempt runs on its own secret seed
(``attempts.seed``, drawn by :meth:`~prism_challenge.service.store.Store.claim`), shown only once
the attempt has ended. A submission gets ``runs_wanted`` runs (1, or the policy's
``confirm_runs`` once its first run places it at the top:
:mod:`prism_challenge.service.confirm`); each run is one ``runs`` row (``(submission_id,
run_index)`` unique), written by the attempt of that ``run_index`` that ended it. The fence is
unchanged: one attempt at a time per submission, numbered on; ``run_base`` counts the attempts
of the runs already stored, so ``attempts - run_base`` are the current run's.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

STATUSES = ("pending", "running", "completed", "failed", "rejected")
OUTCOMES = ("completed", "failed", "rejected", "retry")
"""An attempt's outcome: ``completed`` (scored), ``rejected`` (a ``submission`` failure: final),
``failed`` (an infrastructure failure with no attempt left, or a cancel), ``retry`` (an
infrastructure failure with attempts left: the submission is pending again)."""


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
"""Characters no text column stores on every backend: NUL (PostgreSQL's ``text`` refuses it)
and lone surrogates (not UTF-8: both drivers refuse to encode them)."""


def storable(text: str | None, limit: int | None = None) -> str | None:
    """``text`` as every backend's text column holds it: each character of :data:`_UNSTORABLE`
    replaced by U+FFFD, then cut to ``limit`` characters (a ``String(limit)`` column: PostgreSQL
    refuses a longer value). ``None`` stays ``None``.

    A failure's message is the bundle's own exception text, chosen by the submitter: a
    character the database refuses would fail the result's write on every retry, and the
    dispatcher, retrying it each round, would write no other result. (The run's manifest keeps
    the exact text: JSON escapes these characters.)
    """
    if text is None:
        return None
    text = _UNSTORABLE.sub("\ufffd", text)
    return text if limit is None else text[:limit]


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend (SQLite stores it naive, read back as UTC).

    Raises:
        ValueError: a naive datetime is written.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"{value!r}: timestamps must be timezone-aware (UTC)")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    """The declarative base of the service's tables."""


class Submitter(Base):
    """A submitter, known by its sr25519 hotkey (SS58 address)."""

    __tablename__ = "submitters"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hotkey: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)


class Submission(Base):
    """One submitted bundle (by content: ``bundle_sha256``) and its state."""

    __tablename__ = "submissions"
    __table_args__ = (
        CheckConstraint(f"status IN ({', '.join(repr(s) for s in STATUSES)})", name="ck_submissions_status"),
        CheckConstraint("attempts >= 0 AND attempts <= max_attempts", name="ck_submissions_attempts"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    submitter_id: Mapped[int] = mapped_column(ForeignKey("submitters.id"), nullable=False, index=True)
    bundle_sha256: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False, index=True)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False)
    max_attempts: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    error_stage: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error_kind: Mapped[str | None] = mapped_column(String(16), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Intake (migration 0002); NULL on rows made before it.
    source_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    """sha256 of the bundle's normalized source (AST without comments or docstrings): duplicates."""
    family_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    """sha256 of the normalized ``architecture.py``: the architecture family."""
    variant_of: Mapped[int | None] = mapped_column(ForeignKey("submissions.id"), nullable=True, index=True)
    """The first submission of this family when this one is a training variant of it."""
    profile: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    """The challenge profile the submission is evaluated under (``prism-v2``)."""
    # Fencing and recovery (migration 0003).
    not_before: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    """A retried submission is not claimed before this time (the backoff); ``None``: at once."""
    # Admission (migration 0005); NULL on rows made before it and on the gateway's.
    client_address: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    """The client that sent it (:func:`prism_challenge.service.admission.client_key`: an IPv4
    address, or an IPv6 network): the per-address limit counts these rows."""
    # Confirmation (migration 0006).
    runs_wanted: Mapped[int] = mapped_column(Integer, nullable=False, default=1, server_default="1")
    """The runs the submission gets: 1, or the policy's ``confirm_runs`` once confirmed."""
    run_base: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    """The attempts spent on its stored runs (``attempts - run_base``: the current run's)."""


class Attempt(Base):
    """One evaluation of a submission: started when the submission went ``running``."""

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("submission_id", "number", name="uq_attempts_submission_number"),
        UniqueConstraint("token", name="uq_attempts_token"),
        CheckConstraint(f"outcome IS NULL OR outcome IN ({', '.join(repr(s) for s in OUTCOMES)})",
                        name="ck_attempts_outcome"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    submission_id: Mapped[int] = mapped_column(ForeignKey("submissions.id"), nullable=False, index=True)
    number: Mapped[int] = mapped_column(Integer, nullable=False)  # 1, 2, ... within the submission
    worker: Mapped[str | None] = mapped_column(String(128), nullable=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    failure_stage: Mapped[str | None] = mapped_column(String(32), nullable=True)
    failure_kind: Mapped[str | None] = mapped_column(String(16), nullable=True)
    failure_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Fencing and recovery (migration 0003); NULL on rows made before it.
    token: Mapped[str | None] = mapped_column(String(32), nullable=True)
    """The attempt's fencing token (32 hex digits, random): its result is written only under it."""
    node: Mapped[str | None] = mapped_column(String(128), nullable=True)
    """The Ray node the evaluation runs on (``ip node-id``), once known."""
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    """Refreshed by the dispatcher tracking the attempt while it runs."""
    # Seeds (migration 0006); NULL on rows made before it (those ran on the profile's seed).
    seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """The attempt's secret seed (``secrets``): shown only once the attempt has ended."""
    run_index: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    """The run (0, 1, ... within the submission) this is an attempt of."""


class Run(Base):
    """One run of a submission: the manifest of the attempt that ended it (one per
    ``(submission_id, run_index)``, written once, in the transaction that ends that run)."""

    __tablename__ = "runs"
    __table_args__ = (UniqueConstraint("submission_id", "run_index", name="uq_runs_submission_run"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"), unique=True, nullable=False)
    submission_id: Mapped[int | None] = mapped_column(ForeignKey("submissions.id", name="fk_runs_submission_id"),
                                                      nullable=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False)  # the manifest's status
    run_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    prequential_bpb: Mapped[float | None] = mapped_column(Float, nullable=True)
    final_score: Mapped[float | None] = mapped_column(Float, nullable=True)
    manifest: Mapped[dict] = mapped_column(JSON, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    # Seeds and confirmation (migration 0006).
    run_index: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    """0 for the submission's first run, 1, 2, ... for its confirmation runs."""
    seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """The run's secret seed (its attempt's), revealed now that it has ended."""


class Dispatcher(Base):
    """A dispatcher process (:mod:`prism_challenge.service.dispatch`) and its heartbeat."""

    __tablename__ = "dispatchers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)  # host:pid:random
    ray_address: Mapped[str | None] = mapped_column(String(256), nullable=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Nonce(Base):
    """A request nonce a hotkey used (a reuse is refused: replay protection)."""

    __tablename__ = "nonces"
    __table_args__ = (UniqueConstraint("hotkey", "nonce", name="uq_nonces_hotkey_nonce"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hotkey: Mapped[str] = mapped_column(String(64), nullable=False)
    nonce: Mapped[str] = mapped_column(String(128), nullable=False)
    timestamp: Mapped[int] = mapped_column(Integer, nullable=False)  # the request's X-Timestamp (Unix s)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, index=True)


class Finding(Base):
    """A run the audit caught (:func:`prism_challenge.service.findings.finding_of`): the proof
    against ``hotkey``, and its lift. One per run (and so per attempt and per submission).

    ``step``: the audited batch (the stream's step; for ``heldout_blind_probe``, the held-out
    batch); ``rank``, ``row``: where in it, when the manifest says. ``recorded_nats`` and
    ``rescored_nats`` (nats): ``rescore``: the batch's recorded nats and those its re-scoring
    gave; ``blind_probe`` and ``heldout_blind_probe``: the probed token's nats with the whole row
    shown and with only its past shown (the probe's two figures); ``None`` where the manifest
    gives none (``heldout_causality``: its message names the shift). A ``rescore``'s figures are
    the manifest's exact floats; the probes' are read from their messages (6 significant digits
    for ``blind_probe``, 4 for ``heldout_blind_probe``: the manifest has them nowhere else).
    """

    __tablename__ = "findings"
    __table_args__ = (UniqueConstraint("run_id", name="uq_findings_run_id"),
                      UniqueConstraint("attempt_id", name="uq_findings_attempt_id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hotkey: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    submission_id: Mapped[int] = mapped_column(ForeignKey("submissions.id", name="fk_findings_submission_id"),
                                               nullable=False, index=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", name="fk_findings_attempt_id"), nullable=False)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", name="fk_findings_run_id"), nullable=False)
    kind: Mapped[str] = mapped_column(String(32), nullable=False)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    row: Mapped[int | None] = mapped_column(Integer, nullable=True)
    recorded_nats: Mapped[float | None] = mapped_column(Float, nullable=True)
    rescored_nats: Mapped[float | None] = mapped_column(Float, nullable=True)
    message: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    lifted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    lifted_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lift_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
