"""``prism keygen``, ``prism submit`` and ``prism status`` end to end, against a real server: the
in-process one of the tests (whose results the test writes as the dispatcher would) and a real
``prism serve`` subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import EXAMPLE
from service_live import ALICE, ALICE_SEED, live_server, zip_files
from test_service_read import scored

from prism_challenge.cli import main
from prism_challenge.service.keys import KeyfileError, read_keyfile, write_keyfile

PRISM = [sys.executable, "-m", "prism_challenge.cli"]


def test_keygen_writes_a_0600_key_it_reads_back_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "hotkey.json"
    assert main(["keygen", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    seed, address = read_keyfile(out)
    doc = json.loads(out.read_text())
    assert doc["ss58Address"] == address and address in capsys.readouterr().out and len(seed) == 32
    before = out.read_bytes()
    assert main(["keygen", "--out", str(out)]) == 2
    assert out.read_bytes() == before


def test_a_keyfile_of_alices_seed_is_alice_and_a_mismatch_is_refused(tmp_path):
    key = tmp_path / "alice.json"
    assert write_keyfile(key, ALICE_SEED) == ALICE
    assert read_keyfile(key) == (ALICE_SEED, ALICE)
    doc = json.loads(key.read_text())
    doc["ss58Address"] = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"  # Bob's published address
    key.write_text(json.dumps(doc))
    with pytest.raises(KeyfileError, match="is not " + ALICE):
        read_keyfile(key)
    key.write_text('{"secretSeed": "0x1234"}')
    with pytest.raises(KeyfileError, match="32 bytes"):
        read_keyfile(key)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*PRISM, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _run(capsys, *args: str) -> tuple[int, str, str]:
    """``prism ARGS`` in this process (the CLI's own code, the test server's real HTTP)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_submit_gates_locally_uploads_and_follows_to_the_end(tmp_path, capsys):
    key = tmp_path / "alice.json"
    write_keyfile(key, ALICE_SEED)
    with live_server(tmp_path / "svc") as (base, app):
        store = app.state.store

        def evaluate_when_it_arrives():  # what the dispatcher does
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                claim = store.claim()
                if claim is not None:
                    time.sleep(0.5)
                    store.finish(claim.attempt_id, scored(1.25, 0.2))
                    return
                time.sleep(0.1)

        worker = threading.Thread(target=evaluate_when_it_arrives)
        worker.start()
        code, out, err = _run(capsys, "submit", str(EXAMPLE), "--url", base, "--keyfile", str(key), "--poll", "0.2",
                              "--timeout", "60")
        worker.join()
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == f"accepted: submission 1 by {ALICE} under profile local"
        assert lines[-1].startswith("submission 1: completed (attempt 1/3)  prequential_bpb 1.2500  final_score "
                                    f"{1 / 2.25:.6f}")
        assert httpx.get(f"{base}/v1/submissions/1").json()["scores"]["prequential_bpb"] == 1.25

        code, _, err = _run(capsys, "submit", str(EXAMPLE), "--url", base, "--keyfile", str(key), "--no-wait")
        assert code == 1 and "409 duplicate" in err and "the earlier submission: 1" in err

        # --json: stdout is the one JSON object; the progress lines go to stderr
        variant = tmp_path / "variant"
        shutil.copytree(EXAMPLE, variant)
        (variant / "training.py").write_text((EXAMPLE / "training.py").read_text().replace(
            "EFFECTIVE_LEARNING_RATE = 0.005", "EFFECTIVE_LEARNING_RATE = 0.004"))
        code, out, err = _run(capsys, "submit", str(variant), "--url", base, "--keyfile", str(key), "--no-wait",
                              "--json")
        assert code == 0 and json.loads(out)["id"] == 2 and err.startswith("accepted: submission 2 by ")

        code, out, _ = _run(capsys, "status", "1", "--url", base, "--json")
        assert code == 0 and json.loads(out)["status"] == "completed"
        code, _, err = _run(capsys, "status", "77", "--url", base)
        assert code == 1 and "404 not-found: submission 77: no such submission" in err


def test_submit_refuses_locally_before_sending(tmp_path, capsys):
    key = tmp_path / "k.json"
    write_keyfile(key)
    bundle = tmp_path / "bad"
    bundle.mkdir()
    (bundle / "architecture.py").write_text("import socket\n\n\ndef build_model(ctx):\n    return None\n")
    (bundle / "training.py").write_text("def train(ctx):\n    pass\n")
    code, _, err = _run(capsys, "submit", str(bundle), "--url", "http://127.0.0.1:9", "--keyfile", str(key))
    assert code == 1  # nothing listens on port 9: the refusal came before any upload
    assert "the local gates refuse" in err and "architecture.py:1:1: prism:no-network" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two interpreters that import torch (the serve and the submit processes)
def test_prism_serve_migrates_names_its_profile_and_serves(tmp_path):
    port = _free_port()
    db = tmp_path / "svc.sqlite3"
    env = {**os.environ, "PRISM_DATABASE_URL": f"sqlite:///{db}", "PRISM_BLOB_ROOT": str(tmp_path / "blobs")}
    proc = subprocess.Popen([*PRISM, "serve", "--profile", "local", "--port", str(port), "--no-dispatch"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "prism serve did not start"
            time.sleep(0.2)
        assert httpx.get(base + "/version").json()["profile"]["name"] == "local"
        key = tmp_path / "k.json"
        write_keyfile(key, ALICE_SEED)
        bundle = tmp_path / "b"
        shutil.copytree(EXAMPLE, bundle)
        r = _cli("submit", str(bundle), "--url", base, "--keyfile", str(key), "--no-wait")
        assert r.returncode == 0, r.stderr
        assert httpx.get(base + "/v1/submissions/1").json()["status"] == "pending"
        body = zip_files({"x": "y"})
        assert httpx.post(base + "/v1/submissions", content=body).status_code == 400  # unsigned
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "prism serve: profile local (sha256 " in err and f"sqlite:///{db}" in err
    assert db.is_file()
    import sqlite3

    con = sqlite3.connect(db)
    assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("0006",)]
    con.close()


def test_prism_serve_refuses_bad_settings(capsys):
    code, _, err = _run(capsys, "serve", "--profile", "nope", "--no-dispatch")
    assert code == 2 and "bad settings" in err and "no such profile" in err


def test_the_client_says_what_to_check_when_there_is_no_answer(tmp_path, capsys):
    port = _free_port()  # nothing listens there
    code, _, err = _run(capsys, "status", "1", "--url", f"http://127.0.0.1:{port}")
    assert code == 1 and err.startswith("prism status: cannot connect to http://127.0.0.1:") and "prism serve" in err
    assert "refused" not in err.split("(")[0]
    code, _, err = _run(capsys, "status", "1", "--url", f"127.0.0.1:{port}")
    assert code == 1 and "not an http:// or https:// URL" in err and "http://127.0.0.1:8000" in err
    key = tmp_path / "k.json"
    write_keyfile(key, ALICE_SEED)
    with live_server(tmp_path / "svc") as (base, _):
        code, out, err = _run(capsys, "submit", str(EXAMPLE), "--url", base, "--keyfile", str(key), "--poll", "0.2",
                              "--timeout", "1")
    assert code == 1 and out.startswith("accepted: submission 1")
    assert "dispatcher is off (prism serve --no-dispatch)" in err
    assert "prism submit: stopped following: submission 1 is still pending after 1 s" in err
    assert f"prism status 1 --url {base}" in err and "refused" not in err


def test_a_confirmed_submission_reads_as_runs_and_their_mean_not_as_attempt_3_of_5():
    from prism_challenge.cli_service import _show

    runs = [{"run": i, "status": "scored", "prequential_bpb": b} for i, b in enumerate((4.0, 4.1, 4.3))]
    view = {"id": 7, "status": "running", "attempts": 2, "max_attempts": 4, "runs_wanted": 3, "runs": runs[:1],
            "scores": {"prequential_bpb": 4.0, "final_score": 0.2}, "failure": None}
    assert _show(view) == ("submission 7: running (run 2 of 3, 2 attempt(s) in all)  "
                           "prequential_bpb of the runs so far: 4.0000")
    done = {**view, "status": "completed", "attempts": 3, "runs": runs}
    # mean 12.4 / 3; sample std sqrt(((0.4/3)^2 + (0.1/3)^2 + (0.5/3)^2) / 2) = sqrt(0.42 / 18) = 0.15275
    assert _show(done) == ("submission 7: completed (3 of 3 runs, 3 attempt(s) in all)  prequential_bpb 4.1333 ± "
                           "0.1528 (mean ± std of the runs: 4.0000, 4.1000, 4.3000)")
    assert _show({**view, "status": "pending", "runs": []}) == "submission 7: pending (run 1 of 3, 2 attempt(s) in all)"


def test_a_submission_rejected_in_a_later_run_shows_its_runs_bpb_but_no_mean():
    from prism_challenge.cli_service import _show

    runs = [{"run": 0, "status": "scored", "prequential_bpb": 4.0},
            {"run": 1, "status": "scored", "prequential_bpb": 4.1},
            {"run": 2, "status": "rejected", "prequential_bpb": None}]
    view = {"id": 7, "status": "rejected", "attempts": 3, "max_attempts": 5, "runs_wanted": 3, "runs": runs,
            "scores": None, "failure": {"stage": "contract", "kind": "submission", "message": "no batch was scored"}}
    # rejected: on no leaderboard, so no mean ± std is printed as if it were the submission's figure
    assert _show(view) == ("submission 7: rejected (3 of 3 runs, 3 attempt(s) in all)  prequential_bpb of the runs "
                           "scored (on no leaderboard): 4.0000, 4.1000  [contract, submission] no batch was scored")
