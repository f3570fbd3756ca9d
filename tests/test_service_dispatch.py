"""Evaluation on Ray with fenced, exactly-once results (issue 17 item 4, issue 18 items 1-2): a
real local Ray (2 CPUs, one per module), a real SQLite file, real strict-isolation runs of a tiny
bundle on fixture data. End to end against ``evaluate()`` run directly (bit-exact); the Ray
worker SIGKILLed mid-run; the service process SIGKILLed mid-run and a new dispatcher
reconciling (a running attempt adopted, a lost one re-dispatched, one that finished while no
dispatcher ran collected). Every test asserts the database: attempts and runs per submission."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from fixtures_data import make_rows, write_jsonl, write_salt
from sqlalchemy import func, select

from prism_challenge import EvalOptions, evaluate
from prism_challenge.data.prepare import prepare
from prism_challenge.profiles import load_profile
from prism_challenge.service.blobs import BlobStore
from prism_challenge.service.dispatch import Dispatcher
from prism_challenge.service.models import Attempt, Run
from prism_challenge.service.store import Store
from prism_challenge.service.worker import ACTOR_PREFIX, NAMESPACE, actor_name

from helpers import REPO, write_bundle

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

HOTKEY = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
PROFILE = "fleet-test"
FINAL = ("completed", "failed", "rejected")
PROFILE_TOML = """schema = "prism.profile.v1"
name = "fleet-test"
version = 1
description = "a tiny CPU run on fixture data for the dispatcher's tests"

[data]
source = "files"

[tokenizers]
allowed = ["bytes"]

[run]
seq_len = 128
nproc = 1
device = "cpu"
seed = 1234
threads = 1
max_parameters = 1_000_000

[budgets]
token_budget = 4096

[heldout]
bytes = 4000
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A local Ray of 2 CPUs, the fixture data directory, the profile, the tiny bundle (folder and
    zip) and its direct ``evaluate()`` result."""
    root = tmp_path_factory.mktemp("fleet")
    src = write_jsonl(root / "docs.jsonl", make_rows(400, seed=11))
    data = root / "data"
    prepare([src], data, salt_file=write_salt(root / "salt"))
    (root / "fleet-test.toml").write_text(PROFILE_TOML)
    profile = load_profile(str(root / "fleet-test.toml"))
    arch = (REPO / "bench" / "bundles" / "trivial" / "architecture.py").read_text()
    bundle = write_bundle(root / "bundle", arch, batch=4, seq_len=128, lr=0.05)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in sorted(bundle.iterdir()):
            z.write(f, f.name)
    t0 = time.monotonic()
    direct = evaluate(EvalOptions(bundle=str(bundle), data_dir=str(data), out_dir=str(root / "direct"),
                                  isolation="strict", profile=profile, profile_overridden=[], **profile.options))
    assert direct.status == "scored", direct.failure
    print(f"direct evaluate(): {time.monotonic() - t0:.1f} s")
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield {"root": root, "data": str(data), "profile": profile, "zip": buf.getvalue(), "direct": direct}
    ray.shutdown()


@pytest.fixture
def service(world, tmp_path):
    """A fresh database and blob store; ``make()`` builds dispatchers on them (stopped at the end)."""
    store = Store(f"sqlite:///{tmp_path / 'prism.sqlite3'}")
    blobs = BlobStore(tmp_path / "blobs")
    made: list[Dispatcher] = []

    def make(**kw) -> Dispatcher:
        kw.setdefault("slots", 2)
        kw.setdefault("backoff_base_s", 0.5)
        d = Dispatcher(store, blobs, data_dir=world["data"], profiles={PROFILE: world["profile"]}, **kw)
        made.append(d)
        return d

    yield store, blobs, make
    for d in made:
        if d._thread is not None:
            d.stop()
    store.close()


def _submit(store: Store, blobs: BlobStore, data: bytes) -> int:
    return store.submit(HOTKEY, blobs.put(data), profile=PROFILE)


def _wait(pred, what: str, timeout: float = 240.0, every: float = 0.2):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _final(store: Store, *sids: int, timeout: float = 240.0) -> None:
    _wait(lambda: all(store.submission(s).status in FINAL for s in sids), f"submissions {sids} to end", timeout)


def _counts(store: Store, sid: int) -> tuple[int, int]:
    """(attempts, runs) of submission ``sid``, counted in the database."""
    with store.sessions() as s:
        attempts = s.scalar(select(func.count()).select_from(Attempt).where(Attempt.submission_id == sid))
        runs = s.scalar(select(func.count()).select_from(Run).join(Attempt, Attempt.id == Run.attempt_id)
                        .where(Attempt.submission_id == sid))
    return attempts, runs


def _assert_same_as_direct(store: Store, sid: int, direct) -> None:
    run = store.result_of(sid)
    assert run.status == "scored" and run.prequential_bpb == direct.prequential_bpb  # bit-exact
    m, d = run.manifest, direct.manifest
    assert m["score"] == d.score.model_dump(mode="json")
    assert m["curve"]["nats_per_target"] == d.curve.nats_per_target and len(m["curve"]["nats_per_target"]) == 8
    assert m["bundle"]["sha256"] == d.bundle.sha256 and m["isolation"]["isolated"] is True
    assert m["profile"]["name"] == PROFILE and m["profile"]["overridden"] == []


def _stage(actor) -> str | None:
    try:
        return ray.get(actor.progress.remote(), timeout=10)["stage"]
    except Exception:  # noqa: BLE001 - not created yet
        return None


def _named_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(ACTOR_PREFIX)]


def test_a_submission_is_evaluated_on_ray_bit_exact_with_evaluate(world, service):
    store, blobs, make = service
    sid = _submit(store, blobs, world["zip"])
    t0 = time.monotonic()
    make().start()
    _final(store, sid)
    print(f"submit to completed on Ray: {time.monotonic() - t0:.1f} s")
    assert store.submission(sid).status == "completed" and _counts(store, sid) == (1, 1)
    _assert_same_as_direct(store, sid, world["direct"])
    (attempt,) = store.attempts(sid)
    assert attempt.outcome == "completed" and attempt.node and " pid " in attempt.node
    _wait(lambda: not _named_actors(), "the finished attempt's actor to be killed", timeout=30)


def test_a_sigkilled_ray_worker_is_retried_and_gives_exactly_one_result(world, service):
    store, blobs, make = service
    sid = _submit(store, blobs, world["zip"])
    d = make().start()
    token = _wait(lambda: next(iter(d.in_flight), None), "the attempt to be dispatched")
    actor = d.actor(token)
    _wait(lambda: _stage(actor) in ("gates", "stream", "heldout"), "the run to reach the gates")
    pid = ray.get(actor.where.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    _final(store, sid)
    first, second = store.attempts(sid)
    assert (first.outcome, first.failure_stage, first.failure_kind) == ("retry", "dispatch", "infrastructure")
    assert "the Ray worker of attempt 1 died" in first.failure_message
    assert second.outcome == "completed" and _counts(store, sid) == (2, 1)
    assert store.result_of(sid).attempt_id == second.id
    _assert_same_as_direct(store, sid, world["direct"])


def test_a_sigkilled_service_is_reconciled_by_the_next_dispatcher(world, service, tmp_path):
    store, blobs, make = service
    running = _submit(store, blobs, world["zip"])
    gone = _submit(store, blobs, world["zip"])
    # the service: another process, joined to this Ray cluster, SIGKILLed mid-run
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "fleet_service.py"), store.url, str(tmp_path / "blobs"),
         address, PROFILE, str(world["root"] / "fleet-test.toml"), world["data"]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        claims = _wait(lambda: {c.submission_id: c for c in store.running()} if len(store.running()) == 2 else None,
                       "the service to dispatch both submissions", timeout=120)
        actor = _wait(lambda: _lookup(claims[running].token), "the first attempt's actor")
        _wait(lambda: _stage(actor) in ("gates", "stream", "heldout"), "the first run to reach the gates")
    finally:
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL, out
    # the second attempt's work is gone from the cluster (its actor killed with no one to see it)
    victim = _wait(lambda: _lookup(claims[gone].token), "the second attempt's actor")
    ray.kill(victim, no_restart=True)
    _wait(lambda: _lookup(claims[gone].token) is None, "the second actor to be gone", timeout=30)
    assert _stage(actor) is not None  # the detached actor outlived the service that made it
    d = make()
    d.start()
    assert (d.reconciled.adopted, d.reconciled.lost) == ([running], [gone])
    _final(store, running, gone)
    assert _counts(store, running) == (1, 1) and store.attempts(running)[0].outcome == "completed"
    lost, redone = store.attempts(gone)
    assert (lost.outcome, lost.failure_stage) == ("retry", "dispatch") and "was gone" in lost.failure_message
    assert redone.outcome == "completed" and _counts(store, gone) == (2, 1)
    for sid in (running, gone):
        _assert_same_as_direct(store, sid, world["direct"])
    # an attempt that finished while no dispatcher ran is collected by the next one
    later = _submit(store, blobs, world["zip"])
    token = _wait(lambda: next(iter(d.in_flight), None), "the third attempt to be dispatched")
    actor = d.actor(token)
    d.stop()
    _wait(lambda: ray.get(actor.progress.remote())["done"], "the third run to end with no dispatcher")
    assert store.submission(later).status == "running"
    d2 = make()
    d2.start()
    assert d2.reconciled.adopted == [later]
    _final(store, later, timeout=30)
    assert _counts(store, later) == (1, 1)
    _assert_same_as_direct(store, later, world["direct"])


def _lookup(token: str):
    try:
        return ray.get_actor(actor_name(token), namespace=NAMESPACE)
    except ValueError:
        return None
