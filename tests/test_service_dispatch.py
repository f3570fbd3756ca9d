"""Evaluation on Ray with fenced, exactly-once results (issue 17 item 4, issue 18 items 1-2): a
real local Ray (2 CPUs, one per module), a real SQLite file, real strict-isolation runs of a tiny
bundle on fixture data. End to end against ``evaluate()`` run directly on the seed each run
reveals (bit-exact), ``prism eval --seed`` included; the Ray worker SIGKILLed mid-run; the
service process SIGKILLed mid-run and a new dispatcher reconciling (a running attempt adopted, a
lost one re-dispatched, one that finished while no dispatcher ran collected); the database
connection dropped while the dispatcher writes a result, before and after the commit. Every
submission is confirmed (the test profile: 2 runs, issue 29), and the faults strike confirmation
runs too. Every test asserts the database: attempts and runs (one per run) per submission."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fleet_fixtures import (  # noqa: F401 - world and service are fixtures
    PROFILE,
    assert_same_as_direct,
    counts,
    final,
    lookup,
    named_actors,
    ray,
    service,
    stage,
    submit,
    wait,
    world,
)

from prism_challenge import scratch
from prism_challenge.service.dispatch import start
from prism_challenge.service.worker import NAMESPACE, Evaluation, Job, actor_name

pytestmark = [pytest.mark.slow, pytest.mark.fleet]


@pytest.fixture(scope="module", autouse=True)
def local_ray(world):
    """One local Ray of 2 CPUs for the module."""
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_submission_is_evaluated_on_ray_bit_exact_with_evaluate(world, service):
    store, blobs, _ = service
    sid = submit(store, blobs, world["zip"])
    t0 = time.monotonic()
    # as prism serve's lifespan starts it, from the app's state (this process's Ray is joined)
    settings = SimpleNamespace(ray_address=None, slots=2, max_attempts=3, data_dir=Path(world["data"]),
                               profile=PROFILE, retry_backoff_s=0.5)
    d = start(SimpleNamespace(settings=settings, profile=world["profile"], store=store, blobs=blobs))
    try:
        final(store, sid)
    finally:
        d.stop()
    print(f"submit to completed on Ray (2 runs): {time.monotonic() - t0:.1f} s")
    assert store.submission(sid).status == "completed" and counts(store, sid) == (2, 2), [
        (a.outcome, a.failure_stage, a.failure_message) for a in store.attempts(sid)]
    assert_same_as_direct(store, sid, world["direct"])
    assert all(a.outcome == "completed" and a.node and " pid " in a.node for a in store.attempts(sid))
    wait(lambda: not named_actors(), "the finished attempts' actors to be killed", timeout=30)
    # the revealed seed repeats the run with `prism eval --seed` (strict isolation, the same bundle and data)
    run = store.runs_of(sid)[1]
    out = world["root"] / f"cli-run-{run.seed}"  # the module's world is shared by both databases
    proc = subprocess.run([sys.executable, "-m", "prism_challenge.cli", "eval", str(world["bundle"]), "--profile",
                           str(world["root"] / "fleet-test.toml"), "--data", world["data"], "--seed", str(run.seed),
                           "--out", str(out), "--json", "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = json.loads((out / "prism_run_manifest.v2.json").read_text())
    assert again["seed"] == run.seed and again["score"]["prequential_bpb"] == run.prequential_bpb  # to the last bit
    assert again["curve"]["nats_per_target"] == run.manifest["curve"]["nats_per_target"]


def test_a_sigkilled_ray_worker_is_retried_and_gives_exactly_one_result(world, service, tmp_path):
    store, blobs, make = service
    sid = submit(store, blobs, world["zip"])
    work = tmp_path / "work"  # the attempts' temporary folders (issue 27: nothing left behind)
    d = make(work_dir=str(work)).start()
    # the confirmation run's worker is killed (run 1: it is claimed once run 0 is written)
    token = wait(lambda: next((t for t, c in d.in_flight.items() if c.run_index == 1), None),
                 "the confirmation run to be dispatched")
    actor = d.actor(token)
    wait(lambda: stage(actor) in ("gates", "stream", "heldout"), "the run to reach the gates")
    assert (work / token / scratch.LOCK_NAME).is_file() and list(work.glob(f"{token}/prism-eval-*/run"))
    pid = ray.get(actor.where.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    final(store, sid)
    d.stop()  # the loop stopped: its reconcile is called here
    d.reconcile()  # the killed attempt's folder went at the retry's start, or goes now
    assert os.listdir(work) == []
    first, killed, again = store.attempts(sid)
    assert (first.run_index, first.outcome, killed.run_index, again.run_index) == (0, "completed", 1, 1)
    assert (killed.outcome, killed.failure_stage, killed.failure_kind) == ("retry", "dispatch", "infrastructure")
    assert "the Ray worker of attempt 2 died" in killed.failure_message
    assert killed.seed == again.seed != first.seed  # the retry runs the same run: its seed, not a fresh draw
    assert again.outcome == "completed" and counts(store, sid) == (3, 2)
    assert [r.attempt_id for r in store.runs_of(sid)] == [first.id, again.id]
    assert_same_as_direct(store, sid, world["direct"], exact=(1,))


def test_a_sigkilled_service_is_reconciled_by_the_next_dispatcher(world, service, tmp_path):
    store, blobs, make = service
    running = submit(store, blobs, world["zip"])
    gone = submit(store, blobs, world["zip"])
    # the service: another process, joined to this Ray cluster, SIGKILLed mid-run
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "fleet_service.py"), store.url, str(tmp_path / "blobs"),
         address, PROFILE, str(world["root"] / "fleet-test.toml"), world["data"]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        claims = wait(lambda: {c.submission_id: c for c in store.running()} if len(store.running()) == 2 else None,
                       "the service to dispatch both submissions", timeout=120)
        actor = wait(lambda: lookup(claims[running].token), "the first attempt's actor")
        wait(lambda: stage(actor) in ("gates", "stream", "heldout"), "the first run to reach the gates")
    finally:
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL, out
    # the second attempt's work is gone from the cluster (its actor killed with no one to see it)
    victim = wait(lambda: lookup(claims[gone].token), "the second attempt's actor")
    ray.kill(victim, no_restart=True)
    wait(lambda: lookup(claims[gone].token) is None, "the second actor to be gone", timeout=30)
    assert stage(actor) is not None  # the detached actor outlived the service that made it
    d = make()
    d.start()
    assert (d.reconciled.adopted, d.reconciled.lost) == ([running], [gone])
    final(store, running, gone)
    assert counts(store, running) == (2, 2) and [a.outcome for a in store.attempts(running)] == ["completed"] * 2
    lost, redone, confirmed = store.attempts(gone)
    assert (lost.outcome, lost.failure_stage) == ("retry", "dispatch") and "was gone" in lost.failure_message
    assert (redone.outcome, confirmed.outcome, confirmed.run_index) == ("completed", "completed", 1)
    assert counts(store, gone) == (3, 2)
    for sid in (running, gone):  # adopted, and lost then redone: their first runs
        assert_same_as_direct(store, sid, world["direct"], exact=(0,))
    # a confirmation run that finished while no dispatcher ran is collected by the next one
    later = submit(store, blobs, world["zip"])
    token = wait(lambda: next((tok for tok, c in d.in_flight.items() if c.submission_id == later and c.run_index == 1),
                              None), "the third submission's confirmation run to be dispatched")
    actor = d.actor(token)
    d.stop()
    wait(lambda: ray.get(actor.progress.remote())["done"], "the confirmation run to end with no dispatcher")
    assert store.submission(later).status == "running" and [r.run_index for r in store.runs_of(later)] == [0]
    d2 = make()
    d2.start()
    assert d2.reconciled.adopted == [later]
    final(store, later, timeout=30)
    assert counts(store, later) == (2, 2)
    assert_same_as_direct(store, later, world["direct"], exact=(1,))
    # an actor outliving its written result (the service died between the write and the kill)
    # is killed by the next reconcile; one whose token the database does not know is left alone
    ended = store.attempts(running)[0].token
    stray = ray.remote(Evaluation)
    for token in (ended, "f" * 32):
        stray.options(name=actor_name(token), namespace=NAMESPACE, lifetime="detached", num_cpus=0).remote(
            Job(token=token, submission_id=running, bundle=b"not a zip", profile=world["profile"]))
    wait(lambda: lookup(ended) and lookup("f" * 32), "the two stray actors")
    d2.stop()  # reconcile() is the loop's own; called here with the loop stopped
    assert d2.reconcile().killed == 1
    wait(lambda: lookup(ended) is None, "the ended attempt's actor to be killed", timeout=30)
    assert lookup("f" * 32) is not None
    ray.kill(lookup("f" * 32), no_restart=True)



def test_a_dropped_database_connection_during_the_dispatchers_result_write_is_retried(world, service, caplog):
    """Two real results, each written by the dispatcher's loop over a dropped connection: one
    before its commit (lost, written again), one after it (stored; the retried write is a
    duplicate). On PostgreSQL the dispatcher's server process is ended (tests/db_faults.py)."""
    from db_faults import DroppedResultWrite

    from prism_challenge.service.watch import unowned

    store, blobs, make = service
    lost, unanswered = submit(store, blobs, world["zip"]), submit(store, blobs, world["zip"])
    drops = DroppedResultWrite(store, {lost: "before", unanswered: "after"}, run_index=1)  # the confirmation runs
    d = make()
    try:
        with caplog.at_level(logging.INFO, logger="prism_challenge.service"):
            d.start()
            final(store, lost, unanswered)
            wait(lambda: not d.in_flight and not named_actors(), "the attempts' actors to be killed", timeout=60)
    finally:
        drops.remove()
    postgres = store.engine.dialect.name == "postgresql"
    assert sorted((sid, when, pid is not None) for sid, when, pid in drops.fired) == [
        (lost, "before", postgres), (unanswered, "after", postgres)]
    rounds = [r for r in caplog.records if "a round failed; retrying" in r.getMessage()]
    assert len(rounds) == 2 and all(r.exc_info[0].__name__ == "OperationalError" for r in rounds)
    writes = [r.getMessage() for r in caplog.records if " scored -> " in r.getMessage()]
    assert sorted(writes) == sorted([f"submission {lost}: attempt 1 scored -> pending (written)",
                                     f"submission {unanswered}: attempt 1 scored -> pending (written)",
                                     f"submission {lost}: attempt 2 scored -> completed (written)",
                                     f"submission {unanswered}: attempt 2 scored -> completed (duplicate)"])
    assert not [r for r in caplog.records if "discarded" in r.getMessage()]
    for sid in (lost, unanswered):
        assert store.submission(sid).status == "completed" and counts(store, sid) == (2, 2)
        attempts = store.attempts(sid)
        assert [a.outcome for a in attempts] == ["completed"] * 2
        assert [r.attempt_id for r in store.runs_of(sid)] == [a.id for a in attempts]
        assert_same_as_direct(store, sid, world["direct"], exact=(1,))  # the dropped write's run
    assert store.running() == [] and unowned(store) == []
    assert d._thread.is_alive()  # the loop lived through both drops
