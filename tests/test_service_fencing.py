"""Fenced, exactly-once results on a real SQLite file (issue 18, items 1 and 2, without Ray):
fencing tokens, the superseded attempt's discarded result, idempotent writes across a dropped
connection, retries with backoff and every attempt's reason, the one run per submission the
database enforces, the watchdog, ``prism fleet status``, and migration 0003 over older rows."""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError, OperationalError

from prism_challenge.failures import EvalFailure
from prism_challenge.profiles import load_profile
from prism_challenge.manifest.results import EvalResult, RunManifest
from prism_challenge.service.dispatch import backoff_s, resources_for
from prism_challenge.service.fleet_cli import render
from prism_challenge.service.models import Attempt, Run, Submission, utcnow
from prism_challenge.service.store import Store, TransitionError
from prism_challenge.service.watch import STALE_AFTER_S, fleet_status, oldest_unowned_age_s, unowned
from prism_challenge.service.worker import failure_result

pytestmark = pytest.mark.fleet

SCORED = Path(__file__).parent / "data" / "scored_manifest.v2.json"  # from a real prism eval of bench/bundles/trivial
HOTKEY = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
SHA = "ab" * 32


def _scored(bpb_shift: float = 0.0) -> EvalResult:
    doc = json.loads(SCORED.read_text())
    doc["score"]["prequential_bpb"] += bpb_shift
    m = RunManifest.model_validate(doc)
    return EvalResult(status="scored", kind=None, failure=None, run_dir=None, manifest_path=None, manifest=m)


def _lost(message: str = "the Ray worker died") -> EvalResult:
    return failure_result(EvalFailure("dispatch", message))


@pytest.fixture
def store(db_url):  # a SQLite file, and a fresh PostgreSQL database (tests/databases.py)
    s = Store(db_url)
    yield s
    s.close()


def _runs(store: Store, sid: int) -> int:
    with store.sessions() as s:
        return s.scalar(select(func.count()).select_from(Run).join(Attempt, Attempt.id == Run.attempt_id)
                        .where(Attempt.submission_id == sid))


def _make_ready(store: Store, sid: int) -> None:
    with store.sessions.begin() as s:
        s.get(Submission, sid).not_before = utcnow() - timedelta(seconds=1)


def test_each_attempt_has_its_own_token_and_a_superseded_result_is_discarded(store, caplog):
    sid = store.submit(HOTKEY, SHA)
    first = store.claim(worker="d1")
    assert len(first.token) == 32 and int(first.token, 16) >= 0
    # the dispatcher decided attempt 1 was lost (its actor gone) and retries with a backoff
    done = store.record(first.token, _lost(), backoff_s=3600)
    assert (done.status, done.written, done.reason) == ("pending", True, "written")
    sub = store.submission(sid)
    assert sub.not_before - sub.updated_at == timedelta(seconds=3600)
    assert store.claim() is None and store.claim(sid) is None  # the backoff holds it back
    _make_ready(store, sid)
    second = store.claim(worker="d2")
    assert second.number == 2 and second.token != first.token
    # attempt 1's evaluation was not dead after all: its late result comes back and is discarded
    with caplog.at_level(logging.WARNING, logger="prism_challenge.service"):
        late = store.record(first.token, _scored())
    assert (late.status, late.written, late.reason) == ("running", False, "superseded")
    assert f"submission {sid}: discarded the scored result of superseded attempt 1 (token {first.token})" in caplog.text
    assert _runs(store, sid) == 0 and store.submission(sid).status == "running"
    assert store.ended([first.token, second.token, "f" * 32]) == {first.token}  # whose actors reconcile kills
    assert store.record(second.token, _scored()) == type(late)("completed", True, "written")
    assert _runs(store, sid) == 1 and store.result_of(sid).attempt_id == second.attempt_id
    assert [(a.number, a.outcome, a.failure_stage) for a in store.attempts(sid)] == [
        (1, "retry", "dispatch"), (2, "completed", None)]


def test_a_write_is_idempotent_and_another_result_for_a_written_attempt_is_refused(store):
    sid = store.submit(HOTKEY, SHA)
    claim = store.claim()
    assert store.record(claim.token, _scored()).reason == "written"
    before = store.submission(sid)
    again = store.record(claim.token, _scored())
    assert (again.status, again.written, again.reason) == ("completed", False, "duplicate")
    assert store.submission(sid).updated_at == before.updated_at and _runs(store, sid) == 1
    other = store.record(claim.token, _scored(bpb_shift=1.0))
    assert (other.written, other.reason) == (False, "superseded")
    assert store.result_of(sid).prequential_bpb == 8.018997287010148  # the first result stays
    with pytest.raises(TransitionError, match="token 00: no attempt has this fencing token"):
        store.record("00", _scored())


def test_a_dropped_connection_during_the_result_write_leaves_exactly_one_run(store):
    """On PostgreSQL the writer's server process is really ended (pg_terminate_backend); on
    SQLite the error is injected (tests/db_faults.py)."""
    from db_faults import DroppedResultWrite

    sid, other = store.submit(HOTKEY, SHA), store.submit(HOTKEY, SHA)
    claim, second = store.claim(sid), store.claim(other)
    drops = DroppedResultWrite(store, {sid: "before", other: "after"})
    try:
        with pytest.raises(OperationalError):
            store.record(claim.token, _scored())  # rolled back: nothing written
        assert store.submission(sid).status == "running" and _runs(store, sid) == 0
        with pytest.raises(OperationalError):
            store.record(second.token, _scored())  # committed, but the caller never heard back
        assert store.submission(other).status == "completed" and _runs(store, other) == 1
    finally:
        drops.remove()
    postgres = store.engine.dialect.name == "postgresql"
    assert [(s, when, pid is not None) for s, when, pid in drops.fired] == [
        (sid, "before", postgres), (other, "after", postgres)]
    assert store.record(claim.token, _scored()).reason == "written"  # the dispatcher's retries
    assert store.record(second.token, _scored()).reason == "duplicate"
    for s in (sid, other):
        assert store.submission(s).status == "completed" and _runs(store, s) == 1
        assert [(a.number, a.outcome) for a in store.attempts(s)] == [(1, "completed")]


def test_a_result_whose_text_no_database_stores_is_written_with_it_replaced(store):
    """A failure's message is the bundle's own exception text: a NUL (PostgreSQL's text refuses
    it) or a lone surrogate (no driver encodes it) must not fail the write on every retry.
    ``EvalFailure`` shows both as escapes from the start (``terminal.printable``); a message that
    holds them raw anyway (set after, or from elsewhere) is written with them replaced."""
    text = "ValueError: a\x00b\ud800c"
    assert EvalFailure("gates", text).message == "ValueError: a\\x00b\\ud800c"

    def raw(stage, message):
        failure = EvalFailure(stage, "")
        failure.message = message  # past printable: the store's own replacement
        return failure

    sid, other = store.submit(HOTKEY, SHA), store.submit(HOTKEY, SHA)
    rejected = failure_result(raw("gates", text))
    done = store.record(store.claim(sid).token, rejected)
    assert (done.status, done.reason) == ("rejected", "written")
    (attempt,) = store.attempts(sid)
    assert attempt.failure_message == store.submission(sid).error_message == "ValueError: a\ufffdb\ufffdc"
    assert store.result_of(sid).manifest["failure"]["message"] == text  # JSON escapes them: the exact text
    assert store.record(attempt.token, rejected).reason == "duplicate"
    retried = failure_result(raw("dispatch", text + "x" * 100_000))
    claim = store.claim(other)
    assert store.record(claim.token, retried).status == "pending"
    assert store.record(claim.token, retried).reason == "duplicate"
    assert len(store.attempts(other)[0].failure_message) == len(text) + 100_000


def test_infrastructure_failures_retry_to_the_cap_with_every_reason_and_a_submission_fault_is_final(store):
    sid = store.submit(HOTKEY, SHA, max_attempts=5)
    for n in (1, 2):
        claim = store.claim(sid)
        assert store.record(claim.token, _lost(f"node {n} lost"), max_attempts=3).status == "pending"
    claim = store.claim(sid)
    assert store.record(claim.token, _lost("node 3 lost"), max_attempts=3).status == "failed"  # the dispatcher's cap
    sub = store.submission(sid)
    assert (sub.status, sub.attempts, sub.error_stage, sub.error_kind) == ("failed", 3, "dispatch", "infrastructure")
    assert [(a.outcome, a.failure_message) for a in store.attempts(sid)] == [
        ("retry", "node 1 lost"), ("retry", "node 2 lost"), ("failed", "node 3 lost")]
    assert _runs(store, sid) == 1 and store.result_of(sid).status == "failed"
    bad = store.submit(HOTKEY, SHA)
    claim = store.claim(bad)
    assert store.record(claim.token, failure_result(EvalFailure("gates", "blocking finding"))).status == "rejected"
    assert store.submission(bad).attempts == 1 and store.claim(bad) is None


def test_the_database_allows_one_run_per_submission_and_run_index(store):
    sid = store.submit(HOTKEY, SHA)
    claim = store.claim()
    store.record(claim.token, _scored())
    with pytest.raises(IntegrityError, match=r"UNIQUE constraint failed: runs.submission_id, runs.run_index|"
                                             r"unique constraint \"uq_runs_submission_run\""):
        with store.sessions.begin() as s:
            s.add(Run(attempt_id=claim.attempt_id + 100, submission_id=sid, status="scored", manifest={},
                      created_at=utcnow(), run_index=0))


def test_the_watchdog_finds_non_final_submissions_without_an_owner(store):
    now = utcnow()
    running, pending = store.submit(HOTKEY, SHA), store.submit(HOTKEY, SHA)
    claim = store.claim(running)
    assert store.heartbeat([claim.token], node={claim.token: "10.0.0.2 abcdef pid 7"}) == 1
    # a live dispatcher owns the queue; the attempt's heartbeat is fresh
    store.dispatcher_beat("d1")
    assert unowned(store) == [] and oldest_unowned_age_s(store) is None
    later = now + timedelta(seconds=STALE_AFTER_S + 10)
    rows = unowned(store, now=later)
    assert [(u.submission_id, u.status) for u in rows] == [(running, "running"), (pending, "pending")]
    assert rows[0].age_s == pytest.approx((later - store.attempts(running)[0].heartbeat_at).total_seconds())
    store.dispatcher_beat("d1", stopped=True)
    assert [u.submission_id for u in unowned(store)] == [pending]  # stopped: the queue has no owner now
    assert oldest_unowned_age_s(store) == pytest.approx(0.0, abs=5.0)


def test_fleet_status_shows_the_queue_running_attempts_and_the_last_hour(store):
    a, b, c = (store.submit(HOTKEY, SHA) for _ in range(3))
    ca = store.claim(a)
    store.record(ca.token, _scored())
    cb = store.claim(b)
    store.heartbeat([cb.token], node={cb.token: "10.0.0.2 abcdef012345 pid 7"})
    store.dispatcher_beat("host:1:abc")
    st = fleet_status(store)
    assert (st.pending, st.ready, [r.submission_id for r in st.running]) == (1, 1, [b])
    assert st.running[0].node == "10.0.0.2 abcdef012345 pid 7" and st.last_hour == {"completed": 1}
    assert [(r[0], r[1], r[2], r[3]) for r in st.recent] == [(a, "completed", 1, 8.018997287010148)]
    out = StringIO()
    render(st, Console(file=out, width=160))
    shown = out.getvalue()
    for needle in ("10.0.0.2 abcdef012345 pid 7", "8.018997", "host:1:abc", "completed, last hour"):
        assert needle in shown, shown
    assert c not in [r.submission_id for r in st.running]


def test_prism_fleet_status_reads_the_database(store, capsys):
    from prism_challenge.cli import main

    sid = store.submit(HOTKEY, SHA)
    store.record(store.claim(sid).token, _scored())
    assert main(["fleet", "status", "--db", store.url]) == 0
    out = capsys.readouterr().out
    assert "results, last hour" in out and "8.018997" in out and "completed" in out
    assert main(["fleet", "status", "--db", "sqlite:////nonexistent/prism.sqlite3"]) == 2
    assert "no database at /nonexistent/prism.sqlite3" in capsys.readouterr().err


def test_resources_and_backoff_follow_their_rules():
    local = load_profile("local")  # nproc 1, device auto
    v2 = load_profile("prism-v2")  # nproc 1, device cuda
    assert resources_for(local, cluster_gpus=0) == {"num_cpus": 1}
    assert resources_for(local, cluster_gpus=8) == {"num_gpus": 1, "num_cpus": 1}
    assert resources_for(v2, cluster_gpus=0) == {"num_gpus": 1, "num_cpus": 1}
    assert [backoff_s(n, 10.0, 600.0) for n in (1, 2, 3, 7, 8)] == [10.0, 20.0, 40.0, 600.0, 600.0]


def test_migration_0003_keeps_older_rows_and_fills_each_submissions_result(tmp_path):
    from alembic import command
    from alembic.config import Config

    from prism_challenge.service.store import MIGRATIONS

    db = tmp_path / "old.sqlite3"  # the schema as of 0002, with rows written by hand below
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{db}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0002")
        t = "'2026-01-01 00:00:00'"
        connection.execute(text(f"INSERT INTO submitters VALUES (1, 'hk', {t})"))
        connection.execute(text("INSERT INTO submissions (id, submitter_id, bundle_sha256, status, attempts, "
                                f"max_attempts, created_at, updated_at) VALUES (1, 1, 'x', 'completed', 2, 3, {t}, {t})"))
        for n in (1, 2):
            connection.execute(text(f"INSERT INTO attempts (id, submission_id, number, started_at, outcome) "
                                    f"VALUES ({n}, 1, {n}, {t}, '{'retry' if n == 1 else 'completed'}')"))
            connection.execute(text(f"INSERT INTO runs (id, attempt_id, status, manifest, created_at) "
                                    f"VALUES ({n}, {n}, 'x', '{{}}', {t})"))
    engine.dispose()
    store = Store(f"sqlite:///{db}")
    with store.sessions() as s:
        assert s.execute(select(Run.id, Run.submission_id).order_by(Run.id)).all() == [(1, None), (2, 1)]
        assert s.scalar(select(Attempt.token).where(Attempt.id == 1)) is None
    store.close()


def test_fifty_submissions_from_concurrent_threads_each_end_with_exactly_one_result(store):
    """The store under load (no Ray: the claims and fenced writes of four dispatcher threads):
    submitted from five threads; every third attempt fails for the infrastructure, every result
    is written twice, and each retried submission's superseded attempt writes late."""
    sids: list[int] = []
    lock = threading.Lock()

    def submitter(k: int) -> None:
        for _ in range(10):
            sid = store.submit(HOTKEY, SHA, max_attempts=3)
            with lock:
                sids.append(sid)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(sids)) == 50
    stale: list[str] = []
    counter = iter(range(10_000))

    def worker() -> None:
        while True:
            claim = store.claim(worker=threading.current_thread().name)
            if claim is None:
                with store.sessions() as s:
                    left = s.scalar(select(func.count()).where(Submission.status.in_(("pending", "running"))))
                if not left:
                    return
                continue
            n = next(counter)
            result = _lost(f"attempt {claim.number} lost") if n % 3 == 0 and claim.number < 3 else _scored()
            for _ in range(2):  # the write, and its retry after a dropped answer
                store.record(claim.token, result, backoff_s=0.0)
            with lock:
                stale.append(claim.token)

    threads = [threading.Thread(target=worker, name=f"d{k}") for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for token in stale:  # every attempt writes once more, late: nothing changes
        assert not store.record(token, _scored(bpb_shift=2.0)).written
    with store.sessions() as s:
        statuses = dict(s.execute(select(Submission.status, func.count()).group_by(Submission.status)).all())
        per_sub = s.execute(select(Run.submission_id, func.count()).group_by(Run.submission_id)).all()
        attempts = s.scalar(select(func.count()).select_from(Attempt))
        retried = s.scalar(select(func.count()).select_from(Attempt).where(Attempt.outcome == "retry"))
    assert statuses == {"completed": 50}
    assert sorted(sid for sid, _ in per_sub) == sorted(sids) and {n for _, n in per_sub} == {1}
    assert attempts == 50 + retried and retried > 0
    assert all(store.result_of(sid).prequential_bpb == 8.018997287010148 for sid in sids)


class _RefusingRay:
    """Stands in for ``ray.remote(Evaluation)``: every actor creation is refused, so a claim
    ends at once as an infrastructure failure (the dispatcher's own path, no Ray needed)."""

    def options(self, **_kw):
        raise RuntimeError("no cluster in this test")


def test_an_idle_dispatcher_claims_a_new_submission_when_woken_not_after_its_poll(store):
    """The intake's wake-up (Dispatcher.wake): with an hour-long idle poll, a submission stored
    after the dispatcher went idle is claimed only because it was woken."""
    import time

    from prism_challenge.service.dispatch import Dispatcher

    idle = threading.Event()

    class Watched(threading.Event):
        def wait(self, timeout=None):
            idle.set()  # the round found nothing and sleeps now
            return super().wait(timeout)

    d = Dispatcher(store, blobs={SHA: b"PK"}, poll_s=3600.0, max_attempts=3)
    d._remote, d._last_reconcile, d._last_beat = _RefusingRay(), time.monotonic(), time.monotonic()
    d._wake = Watched()
    thread = threading.Thread(target=d._loop, daemon=True)
    thread.start()
    assert idle.wait(10)
    sid = store.submit(HOTKEY, SHA)
    time.sleep(0.5)  # the dispatcher sleeps in its poll: nothing claims the submission
    assert store.submission(sid).attempts == 0
    d.wake()
    deadline = time.monotonic() + 60
    while store.submission(sid).attempts == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    d._stop.set()
    d._wake.set()
    thread.join(10)
    sub, (attempt,) = store.submission(sid), store.attempts(sid)
    assert (sub.attempts, sub.status, attempt.outcome) == (1, "pending", "retry")
    assert (attempt.failure_kind, attempt.failure_stage) == ("infrastructure", "dispatch")
    assert "Ray could not create the attempt's actor" in attempt.failure_message
    assert not thread.is_alive()
