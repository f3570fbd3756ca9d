"""A service that knows what it can run (issue 27, item 3): the profile's GPUs and data checked
where it evaluates, a start refused naming what is missing, an attempt whose Ray lease is never
met ended ``failed`` (``infrastructure``) and reported by ``/health``, and SIGTERM a clean stop.

The lease is tested on the real dispatcher rounds and database (SQLite and PostgreSQL) with Ray
faked (``tests/fake_ray.py``); the start and the stop on a real ``prism serve`` process (slow: it
starts an embedded Ray)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fake_ray import FakeRay, Ref

from prism_challenge.profiles import load_profile
from prism_challenge.service.blobs import BlobStore
from prism_challenge.service.capacity import CannotEvaluate, missing
from prism_challenge.service.dispatch import Dispatcher, resources_for
from prism_challenge.service.store import Store
from service_live import ALICE, live_server

ray = pytest.importorskip("ray")
SRC = Path(__file__).resolve().parents[1] / "src"
V2 = load_profile("prism-v2")


def _two_gpu_profile(tmp_path: Path):
    text = (SRC / "prism_challenge" / "profiles" / "prism-v2.toml").read_text()
    assert "nproc = 1\n" in text
    path = tmp_path / "two.toml"
    path.write_text(text.replace('name = "prism-v2"', 'name = "two-gpus"').replace("nproc = 1\n", "nproc = 2\n"))
    return load_profile(str(path))


def test_missing_names_the_gpus_and_the_data_a_profile_needs(tmp_path):
    cpu_node = [{"CPU": 16.0}]
    got = missing(V2, resources_for(V2, 0.0), cpu_node, None, local=True)
    assert got[0] == "GPU: one attempt (device cuda, nproc 1) needs 1 on one Ray node; the largest has 0 (1 node(s), " \
                     "0 in all)"
    assert got[1].startswith("data: profile prism-v2 evaluates on prepared fineweb-edu data and no data directory is "
                             "set (--data, PRISM_DATA_DIR); make it with: prism data prepare")
    assert len(got) == 2
    data = tmp_path / "data"
    assert missing(V2, resources_for(V2, 1.0), [{"CPU": 8.0, "GPU": 1.0}], str(data), local=True) == [
        f"data: {data}: no such directory; make it with: " + got[1].split("make it with: ")[1]]
    data.mkdir()
    assert "holds no MANIFEST.json" in missing(V2, resources_for(V2, 1.0), [{"CPU": 8.0, "GPU": 1.0}], str(data),
                                               local=True)[0]
    assert missing(V2, resources_for(V2, 1.0), [{"CPU": 8.0, "GPU": 1.0}], str(data), local=False) == []  # a node's path
    (data / "MANIFEST.json").write_text("{}")
    assert missing(V2, resources_for(V2, 1.0), [{"CPU": 8.0, "GPU": 1.0}], str(data), local=True) == []
    two = _two_gpu_profile(tmp_path)
    got = missing(two, resources_for(two, 2.0), [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}], str(data),
                  local=True)
    assert got == ["GPU: one attempt (device cuda, nproc 2) needs 2 on one Ray node; the largest has 1 (2 node(s), "
                   "2 in all)"]
    local = load_profile("local")
    assert missing(local, resources_for(local, 0.0), cpu_node, None, local=True) == []  # the embedded corpus, CPU
    assert "PRISM_CHECK_RESOURCES=false" in str(CannotEvaluate("prism-v2", ["GPU: x"]))


def test_the_start_check_raises_or_with_check_resources_off_keeps_the_problem(tmp_path, monkeypatch):
    from prism_challenge.service.capacity import check_capacity

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0}},
                                               {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0}}])  # a dead node
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite3'}")
    try:
        for refuse in (True, False):
            d = Dispatcher(store, BlobStore(tmp_path / "blobs"), default_profile="prism-v2", check_resources=refuse)
            if refuse:
                with pytest.raises(CannotEvaluate) as got:
                    check_capacity(d)
                assert [m.split(":")[0] for m in got.value.missing] == ["GPU", "data"]
                assert "the largest has 0 (1 node(s), 0 in all)" in got.value.missing[0]
            else:
                check_capacity(d)
                assert d.problem.startswith("cannot evaluate profile prism-v2 here: GPU: one attempt (device cuda, "
                                            "nproc 1) needs 1 on one Ray node")
    finally:
        store.close()


class _Never:
    """An actor method whose answer never comes (the actor was never scheduled)."""

    def remote(self, *args) -> Ref:
        ref = Ref(None)
        ref.never = True
        return ref


class Unschedulable(FakeRay):
    """A cluster where no node takes an actor's lease: ``where()`` and ``result()`` never answer."""

    def remote(self, job):
        actor = super().remote(job)
        actor.result, actor.where = _Never(), _Never()
        return actor

    @staticmethod
    def wait(refs, num_returns=1, timeout=None):
        return [r for r in refs if not getattr(r, "never", False)], [r for r in refs if getattr(r, "never", False)]


class StartedNeverEnds(Unschedulable):
    """A cluster where an actor starts (``where()`` answers) and its run goes on."""

    def remote(self, job):
        actor = FakeRay.remote(self, job)
        actor.result = _Never()
        return actor


def test_an_attempt_whose_lease_is_never_met_ends_failed_infrastructure_and_health_says_so(db_url, tmp_path,
                                                                                           monkeypatch):
    store = Store(db_url)
    blobs = BlobStore(tmp_path / "blobs")
    sha = blobs.put(b"PK\x05\x06" + bytes(18))  # bytes only: the actor never runs them
    d = Dispatcher(store, blobs, max_attempts=3, backoff_base_s=0.0, poll_s=0.01, slots=2, lease_timeout_s=60.0,
                   default_profile="prism-v2", profiles={"prism-v2": V2})
    cluster = Unschedulable(lambda _job: None)
    cluster.install(d, monkeypatch)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "memory": 1e9})
    d._last_reconcile = time.monotonic()  # the rounds skip reconcile
    try:
        sid = store.submit(ALICE, sha, max_attempts=3, profile="prism-v2")
        d.step()
        (token,) = d.in_flight
        assert cluster.actors[0].options["num_gpus"] == 1 and store.submission(sid).status == "running"
        d._tracked[token].launched -= 59.0  # 59 s after its launch: still waiting
        d.step()
        assert store.submission(sid).status == "running" and d.problem is None
        d._tracked[token].launched -= 2.0  # 61 s
        d.step()
        d.step()
        sub = store.submission(sid)
        assert (sub.status, sub.error_kind, sub.error_stage, sub.attempts) == ("failed", "infrastructure", "dispatch", 1)
        assert sub.error_message == ("no Ray node started attempt 1's actor within lease_timeout_s = 60 s: it asks for "
                                     "num_cpus 1, num_gpus 1; the cluster has CPU 2 in all (busy, or lacking them)")
        assert cluster.actors[0].killed and d.in_flight == {}
        assert d.problem == sub.error_message
        with live_server(tmp_path / "svc", database_url=db_url) as (base, app):
            app.state.dispatcher = d
            try:
                r = httpx.get(base + "/health")
            finally:
                app.state.dispatcher = None
        assert r.status_code == 503
        body = r.json()
        assert (body["status"], body["dispatch_problem"], body["database"]) == ("cannot-evaluate", sub.error_message,
                                                                               "ok")
        StartedNeverEnds(lambda _job: None).install(d, monkeypatch)  # a node came: the next actor starts
        store.submit(ALICE, sha, max_attempts=3, profile="prism-v2")
        d.step()
        d.step()
        assert d.problem is None
    finally:
        store.close()


def test_no_dispatch_serves_a_gpu_profile_on_a_cpu_host(tmp_path):
    with live_server(tmp_path, profile="prism-v2") as (base, _):
        body = httpx.get(base + "/health").json()
        assert (body["status"], body["dispatcher"], body["profile"]) == ("ok", "off", "prism-v2")
        assert httpx.get(base + "/v1/leaderboard").status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "XDG_DATA_HOME": str(tmp_path / "data")}
    cmd = [sys.executable, "-m", "prism_challenge.cli", "serve", "--port", str(port), "--database-url",
           f"sqlite:///{tmp_path / 'db.sqlite3'}", "--blob-root", str(tmp_path / "blobs"), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), port


@pytest.mark.slow
def test_serve_refuses_a_cuda_profile_on_a_cpu_host_naming_what_is_missing(tmp_path):
    proc, _ = _serve(tmp_path, "--profile", "prism-v2")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 2, err
    assert "prism serve: cannot evaluate profile prism-v2 here: GPU: one attempt (device cuda, nproc 1) needs 1 on " \
           "one Ray node; the largest has 0" in err
    assert "data: profile prism-v2 evaluates on prepared fineweb-edu data and no data directory is set" in err
    assert "Traceback" not in err and "Uvicorn running" not in err


@pytest.mark.slow
def test_sigterm_is_a_clean_stop_with_exit_0(tmp_path):
    proc, port = _serve(tmp_path, "--profile", "local")  # with the dispatcher: its embedded Ray stops too
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").json()["dispatcher"] == "running":
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    tail = err[err.index("Shutting down"):]
    for bad in ("Traceback", "SystemExit", "CancelledError", "Error", "SIGTERM handler", "signal"):
        assert bad not in tail.replace("stopped (SIGTERM)", ""), tail
    assert tail.rstrip().endswith("prism serve: stopped (SIGTERM)"), tail
    assert "Application shutdown complete." in tail
