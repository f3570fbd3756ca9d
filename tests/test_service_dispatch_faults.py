"""The dispatcher's rounds under database faults (issue 18): a result the database keeps refusing
blocks no other and ends as an ``infrastructure`` failure; a write over a dropped connection is
retried as it is; a claim whose launch lost the connection is launched under its own token and
stays owned meanwhile; a lost attempt whose record is refused does not stop the reconcile.

The real :class:`Dispatcher` rounds (``step()``) and the real store (a SQLite file, and a fresh
PostgreSQL database: ``db_url``), with the faults of ``tests/db_faults.py`` (on PostgreSQL a
real refusal by the server and a really ended connection) and Ray faked (``tests/fake_ray.py``:
actors that answer at once with a stored scored result). Fast: no evaluation runs."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
from db_faults import DroppedLaunchRead, RefusedResultWrite
from fake_ray import FakeRay
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from prism_challenge.profiles import load_profile
from prism_challenge.manifest.results import EvalResult, RunManifest
from prism_challenge.service.blobs import BlobStore
from prism_challenge.service.dispatch import Dispatcher
from prism_challenge.service.models import Attempt, Run, Submission
from prism_challenge.service.store import Store
from prism_challenge.service.unstored import WRITE_TRIES
from prism_challenge.service.watch import unowned

pytestmark = pytest.mark.fleet

ray = pytest.importorskip("ray")

SCORED = Path(__file__).parent / "data" / "scored_manifest.v2.json"  # from a real prism eval of bench/bundles/trivial
SCORED_BPB = 8.018997287010148  # that manifest's prequential_bpb
HOTKEY = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
PG_REFUSAL = '(psycopg.errors.InvalidTextRepresentation) invalid input syntax for type integer: "refused"'


def _scored(seed: int | None = None) -> EvalResult:
    """The real scored manifest (``seed``: recorded as the run's, as the pipeline records the job's seed)."""
    doc = json.loads(SCORED.read_text())
    if seed is not None:
        doc["seed"] = seed
    m = RunManifest.model_validate(doc)
    return EvalResult(status="scored", kind=None, failure=None, run_dir=None, manifest_path=None, manifest=m)


def _single_run() -> dict:
    """The dispatcher's ``profiles``: ``local`` without confirmation (``confirm_top_n = 0``), for
    the tests of one run per submission."""
    local = load_profile("local")
    policy = replace(local.options["policy"], confirm_top_n=0)
    return {"local": replace(local, options={**local.options, "policy": policy})}


@pytest.fixture
def store(db_url):
    s = Store(db_url)
    yield s
    s.close()


@pytest.fixture
def blobs(tmp_path):
    return BlobStore(tmp_path / "blobs")


def _dispatcher(store: Store, blobs, monkeypatch, *, confirm: bool = False, **kw) -> tuple[Dispatcher, FakeRay]:
    kw.setdefault("slots", 3)
    if not confirm:
        kw.setdefault("profiles", _single_run())
    d = Dispatcher(store, blobs, max_attempts=3, backoff_base_s=0.0, poll_s=0.01, **kw)
    cluster = FakeRay(lambda job: _scored(job.seed if confirm else None))  # confirm: the seed each job ran on
    cluster.install(d, monkeypatch)
    d._last_reconcile = time.monotonic()  # the rounds skip reconcile (RECONCILE_S = 60 s)
    return d, cluster


def _status(store: Store, sid: int) -> str:
    with store.sessions() as s:
        return s.scalar(select(Submission.status).where(Submission.id == sid))


def _counts(store: Store, sid: int) -> tuple[int, int]:
    """(attempts, runs) of submission ``sid``, counted in the database."""
    with store.sessions() as s:
        attempts = s.scalar(select(func.count()).select_from(Attempt).where(Attempt.submission_id == sid))
        runs = s.scalar(select(func.count()).select_from(Run).where(Run.submission_id == sid))
    return attempts, runs


@pytest.mark.parametrize("how", ["refused", "bug"])
def test_a_result_that_cannot_be_stored_blocks_no_other_and_ends_as_an_infrastructure_failure(
        store, blobs, monkeypatch, caplog, how):
    bundle = blobs.put(b"PK\x03\x04 a bundle")
    stuck, *others = [store.submit(HOTKEY, bundle) for _ in range(3)]  # the first tracked is the refused one
    faults = RefusedResultWrite(store, {stuck}, how=how)  # every scored write of `stuck`, every attempt
    d, cluster = _dispatcher(store, blobs, monkeypatch)
    try:
        with caplog.at_level(logging.INFO, logger="prism_challenge.service"):
            d.step()  # round 1: three claims, three actors
            assert [a.job.submission_id for a in cluster.actors] == [stuck, *others]
            d.step()  # round 2: the three results; the first is refused, the other two are written
            assert [store.submission(s).status for s in (stuck, *others)] == ["running", "completed", "completed"]
            rounds = 2
            while store.submission(stuck).status not in ("completed", "failed") and rounds < 30:
                d.step()
                rounds += 1
    finally:
        faults.remove()
    # each attempt's result refused on WRITE_TRIES rounds, then its stand-in written: 3 attempts x 3 rounds
    assert WRITE_TRIES == 3 and rounds == 1 + 3 * WRITE_TRIES
    assert faults.fired == [(stuck, n) for n in (1, 2, 3) for _ in range(WRITE_TRIES)]
    for sid in others:
        assert _counts(store, sid) == (1, 1) and store.result_of(sid).prequential_bpb == SCORED_BPB
    sub = store.submission(stuck)
    assert (sub.status, sub.attempts, sub.error_stage, sub.error_kind) == ("failed", 3, "dispatch", "infrastructure")
    assert _counts(store, stuck) == (3, 1) and store.result_of(stuck).status == "failed"
    attempts = store.attempts(stuck)
    assert [(a.outcome, a.failure_stage, a.failure_kind) for a in attempts] == [
        ("retry", "dispatch", "infrastructure"), ("retry", "dispatch", "infrastructure"),
        ("failed", "dispatch", "infrastructure")]
    if how == "bug":
        error = "KeyError: 'run_dir'"
    elif store.engine.dialect.name == "postgresql":
        error = f"DataError: {PG_REFUSAL}"
    else:
        error = "DataError: (builtins.Exception) value out of range for the column"
    expected = json.dumps(_scored().manifest.to_json_dict(), sort_keys=True)
    key = blobs.put(expected.encode())  # content-addressed: the key the dispatcher kept it under
    assert {a.failure_message for a in attempts} == {
        f"the attempt's result could not be stored: {error}; its manifest is blob {key}"}
    assert json.loads(blobs.get(key)) == _scored().manifest.to_json_dict()
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name == "prism_challenge.service"]
    assert len(logged) == 3 and all(m.endswith(f"its manifest is blob {key}: {expected}") for m in logged)
    assert len(cluster.actors) == 5 and all(a.killed for a in cluster.actors)  # 3, then attempts 2 and 3
    assert d._tracked == {} and d._unlaunched == {}


def test_a_result_write_over_a_dropped_connection_is_retried_as_it_is_past_the_refusal_limit(
        store, blobs, monkeypatch):
    """A dropped connection is no refusal: the same result is written when the database answers,
    however many rounds that takes (on PostgreSQL the writer's server process is ended)."""
    sid = store.submit(HOTKEY, blobs.put(b"PK\x03\x04 a bundle"))
    drops = WRITE_TRIES + 2
    faults = RefusedResultWrite(store, {sid}, how="dropped", times=drops)
    d, cluster = _dispatcher(store, blobs, monkeypatch)
    try:
        d.step()  # the claim and its actor
        for _ in range(drops):  # the round fails (the loop logs it and runs the next one); the result is kept
            with pytest.raises(OperationalError):
                d.step()
            assert store.submission(sid).status == "running" and len(d._tracked) == 1
        d.step()
    finally:
        faults.remove()
    assert faults.fired == [(sid, 1)] * drops
    (attempt,) = store.attempts(sid)
    assert (attempt.outcome, attempt.failure_message) == ("completed", None)
    assert _counts(store, sid) == (1, 1) and store.result_of(sid).prequential_bpb == SCORED_BPB
    assert len(cluster.actors) == 1 and cluster.actors[0].killed and d._tracked == {}


def test_a_claim_whose_launch_lost_the_connection_is_launched_under_its_token_and_stays_owned(
        store, blobs, monkeypatch):
    """The two reads of the submission's row after its claim drop their connection: the claim is
    kept, heartbeated, and launched in the third round; one attempt, one run, never unowned (a
    watchdog whose staleness is 5 s, checked after each round, 6 s apart: a round may take seconds
    on a busy machine and still not be reported)."""
    stale_s, gap_s = 5.0, 6.0
    sid = store.submit(HOTKEY, blobs.put(b"PK\x03\x04 a bundle"))
    drops = DroppedLaunchRead(store, {sid}, times=2)
    d, cluster = _dispatcher(store, blobs, monkeypatch)
    reported, failed_rounds = [], 0
    try:
        for _ in range(6):
            d._last_beat = 0.0  # a heartbeat every round (HEARTBEAT_S = 5 s would skip them)
            try:
                d.step()
            except OperationalError:  # the loop logs it and runs the next round
                failed_rounds += 1
            reported += [u for u in unowned(store, stale_after_s=stale_s) if u.submission_id == sid]
            if _status(store, sid) == "completed":  # not store.submission(): a read the fault would drop
                break
            time.sleep(gap_s)
    finally:
        drops.remove()
    postgres = store.engine.dialect.name == "postgresql"
    assert [(s, pid is not None) for s, pid in drops.fired] == [(sid, postgres)] * 2 and failed_rounds == 2
    assert reported == []
    (attempt,) = store.attempts(sid)
    assert attempt.outcome == "completed" and _counts(store, sid) == (1, 1)
    assert (attempt.heartbeat_at - attempt.started_at).total_seconds() >= 2 * gap_s  # heartbeated while kept
    assert [a.job.token for a in cluster.actors] == [attempt.token] and cluster.actors[0].killed
    assert store.result_of(sid).prequential_bpb == SCORED_BPB and d._unlaunched == {}


def test_confirmation_runs_under_database_faults_end_with_one_result_each(store, blobs, monkeypatch):
    """A submission confirmed at the top (the local profile: 3 runs): its second run's write goes
    over a dropped connection twice, its third run's is refused once; each run is written once,
    by one attempt, on its own secret seed, and the submission completes after the third."""
    sid = store.submit(HOTKEY, blobs.put(b"PK\x03\x04 a bundle"))
    d, cluster = _dispatcher(store, blobs, monkeypatch, confirm=True)
    d.step()  # run 0's claim and actor
    d.step()  # its result: pending again (confirmation), run 1 claimed and launched
    assert (_status(store, sid), store.submission(sid).runs_wanted, _counts(store, sid)) == ("running", 3, (2, 1))
    faults = RefusedResultWrite(store, {sid}, how="dropped", times=2)
    try:
        for _ in range(2):
            with pytest.raises(OperationalError):
                d.step()
        d.step()  # run 1 written; run 2 claimed
    finally:
        faults.remove()
    assert faults.fired == [(sid, 2)] * 2 and _counts(store, sid) == (3, 2)
    faults = RefusedResultWrite(store, {sid}, how="refused", times=1)
    try:
        d.step()  # refused: kept for the next round
        assert _status(store, sid) == "running" and _counts(store, sid) == (3, 2)
        d.step()
    finally:
        faults.remove()
    assert faults.fired == [(sid, 3)] and _status(store, sid) == "completed" and _counts(store, sid) == (3, 3)
    attempts, runs = store.attempts(sid), store.runs_of(sid)
    assert [(a.number, a.run_index, a.outcome) for a in attempts] == [(1, 0, "completed"), (2, 1, "completed"),
                                                                      (3, 2, "completed")]
    assert [r.run_index for r in runs] == [0, 1, 2] and [r.attempt_id for r in runs] == [a.id for a in attempts]
    seeds = [a.seed for a in attempts]
    assert len(set(seeds)) == 3 and 1234 not in seeds
    assert [r.seed for r in runs] == seeds == [r.manifest["seed"] for r in runs] == [a.job.seed for a in cluster.actors]
    assert all(a.killed for a in cluster.actors) and d._tracked == {} and d._unlaunched == {}


def test_a_claim_whose_launch_keeps_failing_for_a_bug_ends_as_an_infrastructure_failure(store, monkeypatch):
    class BrokenBlobs:
        def get(self, sha256):
            raise TypeError("a harness bug in the blob store")

    sid = store.submit(HOTKEY, "ab" * 32, max_attempts=1)
    d, cluster = _dispatcher(store, BrokenBlobs(), monkeypatch)
    for _ in range(WRITE_TRIES):
        d.step()
    assert cluster.actors == [] and d._unlaunched == {}
    sub, (attempt,) = store.submission(sid), store.attempts(sid)
    assert (sub.status, attempt.outcome, attempt.failure_stage, attempt.failure_kind) == (
        "failed", "failed", "dispatch", "infrastructure")
    assert attempt.failure_message == "the attempt could not be launched: TypeError: a harness bug in the blob store"


def test_a_lost_attempt_whose_record_is_refused_does_not_stop_the_reconcile(store, blobs, monkeypatch):
    """Two attempts running when a service died, both actors gone: the first one's record is
    refused (every time), the second is still recorded as lost and the reconcile ends."""
    refused, other = store.submit(HOTKEY, "ab" * 32), store.submit(HOTKEY, "ab" * 32)
    store.claim(refused, worker="dead")
    store.claim(other, worker="dead")
    faults = RefusedResultWrite(store, {refused}, how="refused", outcome="retry")
    d, _ = _dispatcher(store, blobs, monkeypatch)

    def gone(name, namespace=None):
        raise ValueError(f"no actor {name}")

    monkeypatch.setattr(ray, "get_actor", gone)
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces=False: [])
    try:
        done = d.reconcile()
    finally:
        faults.remove()
    assert (done.adopted, done.lost, done.killed) == ([], [other], 0) and faults.fired == [(refused, 1)]
    assert store.submission(refused).status == "running" and store.submission(other).status == "pending"
    assert "was gone when the dispatcher reconciled" in store.attempts(other)[0].failure_message


def test_only_errors_of_an_unreachable_database_are_retried_as_they_are():
    from sqlalchemy import exc

    from prism_challenge.service.unstored import first_line, unreachable

    orig = Exception("boom")
    retried = [exc.OperationalError("SELECT 1", {}, orig), exc.InterfaceError("SELECT 1", {}, orig),
               exc.DisconnectionError("gone"), exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached"),
               exc.DBAPIError("SELECT 1", {}, orig, connection_invalidated=True)]
    refused = [exc.DataError("INSERT", {}, orig), exc.IntegrityError("INSERT", {}, orig),
               exc.StatementError("bad parameter", "INSERT", {}, orig), exc.DBAPIError("SELECT 1", {}, orig),
               KeyError("run_dir"), ValueError("x")]
    assert [unreachable(e) for e in retried] == [True] * 5
    assert [unreachable(e) for e in refused] == [False] * 6
    assert first_line(ValueError("first\nsecond")) == "ValueError: first"
    assert first_line(RuntimeError("x" * 400)) == "RuntimeError: " + "x" * 300
    assert first_line(KeyError("run_dir")) == "KeyError: 'run_dir'"
