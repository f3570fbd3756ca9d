"""The service's storage: migrations applied at start (and matching the models), the default
SQLite file under the user data directory, nonces, and the submission state machine with its
timestamps and attempt cap, on a real SQLite file."""

from __future__ import annotations

import json
import sqlite3
import threading
from datetime import timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from prism_challenge.failures import EvalFailure
from prism_challenge.manifest.results import EvalResult, RunManifest, early_manifest
from prism_challenge.service.models import Base
from prism_challenge.service.store import (
    NonceReused,
    Store,
    StoreError,
    TransitionError,
    default_url,
    outcome_of,
)

SCORED = Path(__file__).parent / "data" / "scored_manifest.v2.json"  # from a real prism eval of bench/bundles/trivial
HOTKEY = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
SHA = "ab" * 32


def _scored() -> EvalResult:
    m = RunManifest.model_validate(json.loads(SCORED.read_text()))
    return EvalResult(status="scored", kind=None, failure=None, run_dir="/runs/a", manifest_path="/runs/a/m.json",
                      manifest=m)


def _failed(stage: str, cause: str = "") -> EvalResult:
    f = EvalFailure(stage, f"{stage} went wrong", cause=cause).to_dict()
    m = early_manifest(f, bundle_path="/b", seed=1, findings=[], profile=None, version="0.1.0")
    return EvalResult(status=m.status, kind=f["kind"], failure=m.failure, run_dir=None, manifest_path=None, manifest=m)


@pytest.fixture
def store(db_url):
    s = Store(db_url)
    yield s
    s.close()


def test_the_migrations_run_at_start_and_match_the_models(store):
    with store.engine.connect() as c:
        assert set(inspect(c).get_table_names()) == {"alembic_version", "submitters", "submissions", "attempts",
                                                     "runs", "nonces", "dispatchers", "findings"}
        assert c.execute(text("SELECT version_num FROM alembic_version")).all() == [("0006",)]
    if store.engine.dialect.name == "sqlite":  # read by an independent client too
        con = sqlite3.connect(store.url.removeprefix("sqlite:///"))
        assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("0006",)]
        con.close()
    with store.engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata)
    assert diff == [], diff


def test_a_restart_keeps_the_rows_and_migrates_nothing_twice(store):
    sid = store.submit(HOTKEY, SHA)
    again = Store(store.url)
    assert again.submission(sid).status == "pending"
    again.close()


def test_the_default_database_is_under_the_user_data_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_url() == f"sqlite:///{tmp_path / 'data' / 'prism-challenge' / 'prism.sqlite3'}"
    s = Store()
    assert (tmp_path / "data" / "prism-challenge" / "prism.sqlite3").is_file()
    s.close()


def test_a_reused_nonce_is_refused_per_hotkey(store):
    store.use_nonce(HOTKEY, "n1", 1_700_000_000)
    store.use_nonce("other", "n1", 1_700_000_000)  # another hotkey's nonce space
    with pytest.raises(NonceReused, match=f"hotkey {HOTKEY}: nonce 'n1' was already used"):
        store.use_nonce(HOTKEY, "n1", 1_700_000_001)


def test_a_scored_run_completes_with_its_run_and_timestamps(store):
    sid = store.submit(HOTKEY, SHA)
    sub = store.submission(sid)
    assert (sub.status, sub.attempts, sub.max_attempts, sub.finished_at) == ("pending", 0, 3, None)
    claim = store.claim(worker="w1")
    assert (claim.submission_id, claim.number) == (sid, 1)
    assert store.submission(sid).status == "running"
    assert store.claim() is None  # nothing else pending: no second evaluation of a running one
    assert store.finish(claim.attempt_id, _scored()) == "completed"
    sub, (att,) = store.submission(sid), store.attempts(sid)
    assert (sub.status, sub.error_kind, att.outcome, att.worker) == ("completed", None, "completed", "w1")
    assert sub.created_at <= att.started_at <= att.finished_at == sub.finished_at
    assert sub.created_at.tzinfo is timezone.utc
    run = store.run_of(claim.attempt_id)
    assert (run.status, run.prequential_bpb, run.final_score) == ("scored", 8.018997287010148, 0.11087707071830222)
    assert run.manifest["score"]["bytes"] == 3999 and run.manifest["schema"] == "prism.run.v2"
    with pytest.raises(TransitionError, match="its result was already written"):
        store.finish(claim.attempt_id, _scored())  # written once


def test_infrastructure_failures_retry_up_to_the_attempt_cap(store):
    sid = store.submit(HOTKEY, SHA, max_attempts=2)
    first = store.claim(sid)
    assert store.finish(first.attempt_id, _failed("data")) == "pending"
    sub = store.submission(sid)
    assert (sub.status, sub.attempts, sub.error_kind, sub.finished_at) == ("pending", 1, "infrastructure", None)
    second = store.claim(sid)
    assert second.number == 2
    with pytest.raises(TransitionError, match=r"attempt 1: its result was already written \(retry\)"):
        store.finish(first.attempt_id, _scored())  # the first attempt cannot write over the second
    assert store.finish(second.attempt_id, _failed("runner", "killed")) == "failed"
    sub = store.submission(sid)
    assert (sub.status, sub.attempts, sub.error_stage) == ("failed", 2, "runner")
    assert [a.outcome for a in store.attempts(sid)] == ["retry", "failed"]
    assert store.claim(sid) is None


def test_a_submission_failure_is_rejected_at_once_and_a_cancel_fails(store):
    sid = store.submit(HOTKEY, SHA)
    assert store.finish(store.claim(sid).attempt_id, _failed("gates")) == "rejected"
    assert store.submission(sid).error_message == "gates went wrong"
    sid2 = store.submit(HOTKEY, SHA)
    assert store.finish(store.claim(sid2).attempt_id, _failed("cancelled")) == "failed"


def test_outcome_of_is_the_documented_rule():
    assert outcome_of(_scored(), 1, 3) == ("completed", "completed")
    assert outcome_of(_failed("contract"), 1, 3) == ("rejected", "rejected")
    assert outcome_of(_failed("isolation"), 2, 3) == ("retry", "pending")
    assert outcome_of(_failed("isolation"), 3, 3) == ("failed", "failed")
    assert outcome_of(_failed("data", "reported"), 1, 3) == ("rejected", "rejected")  # the runner's word


def test_two_workers_never_claim_one_submission(store):
    sid = store.submit(HOTKEY, SHA)
    claims, barrier = [], threading.Barrier(4)

    def worker():
        barrier.wait()
        claims.append(store.claim(sid))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(c is not None for c in claims) == [False, False, False, True]
    assert store.submission(sid).attempts == 1 and len(store.attempts(sid)) == 1


def test_bad_requests_are_refused(store):
    with pytest.raises(StoreError, match="max_attempts = 0: must be at least 1"):
        store.submit(HOTKEY, SHA, max_attempts=0)
    with pytest.raises(TransitionError, match="attempt 99: no such attempt"):
        store.finish(99, _scored())


def test_concurrent_workers_claim_every_submission_exactly_once(store):
    """8 workers drain 40 pending submissions: each is claimed once (one attempt, number 1), none twice
    (``SKIP LOCKED`` on PostgreSQL, the compare-and-set on both)."""
    sids = [store.submit(HOTKEY, SHA) for _ in range(40)]
    claims, barrier, lock = [], threading.Barrier(8), threading.Lock()

    def worker(name):
        barrier.wait()
        while (c := store.claim(worker=name)) is not None:
            with lock:
                claims.append(c)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(c.submission_id for c in claims) == sids
    assert {c.number for c in claims} == {1}
    assert [store.submission(s).status for s in sids] == ["running"] * 40
    assert [len(store.attempts(s)) for s in sids] == [1] * 40
