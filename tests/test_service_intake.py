"""``POST /v1/submissions`` and ``POST /internal/v1/submissions`` against a real uvicorn server
on 127.0.0.1 with a real SQLite file: every bad input of issue 17's acceptance list answers its
4xx code and error body, and the service keeps serving after each."""

from __future__ import annotations

import hashlib
import io
import shutil
import time
import zipfile

import httpx
import pytest

from prism_challenge.service.signing import sign_request
from helpers import EXAMPLE, REPO
from service_live import ALICE, BOB_SEED, TOKEN, live_server, post, signed, zip_dir, zip_files

ARCH = EXAMPLE / "architecture.py"
TRAIN = EXAMPLE / "training.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("svc"), rate_limit=1000, address_rate_limit=1000, max_in_flight=1000, max_body_bytes=64 * 1024) as (base, app):
        yield base, app


def _bundle(tmp_path, *, lr: str | None = None, arch_comment: str = "", name: str = "b", own_arch: bool = False) -> bytes:
    """examples/tiny-1m, its learning rate or its architecture's comments changed (``own_arch``:
    a line of code added to the architecture, so its family is not the shipped, public one)."""
    root = tmp_path / name
    shutil.copytree(EXAMPLE, root)
    if own_arch:
        (root / "architecture.py").write_text(ARCH.read_text() + "\nOWN_ARCHITECTURE = 1\n")
    if lr is not None:
        text = TRAIN.read_text()
        assert "EFFECTIVE_LEARNING_RATE = 0.005" in text
        (root / "training.py").write_text(text.replace("EFFECTIVE_LEARNING_RATE = 0.005", f"EFFECTIVE_LEARNING_RATE = {lr}"))
    if arch_comment:
        text = (root / "architecture.py").read_text()
        (root / "architecture.py").write_text(f"# {arch_comment}\n" + text.replace('"""', '"""' + arch_comment, 1))
    return zip_dir(root, "mybundle")


def _error(r: httpx.Response, status: int, code: str, stage: str, rule: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["stage"], err["rule"]) == (code, stage, rule), err
    assert err["message"]
    return err


def _still_serving(base: str) -> None:
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_a_signed_bundle_is_accepted_pending_and_its_bytes_stored(server, tmp_path):
    base, app = server
    body = _bundle(tmp_path, lr="0.0051")
    r = post(base, body, signed(body))
    assert r.status_code == 202, r.text
    got = r.json()
    assert got["status"] == "pending" and got["hotkey"] == ALICE and got["profile"] == "local"
    assert got["bundle_sha256"] == hashlib.sha256(body).hexdigest()
    assert app.state.blobs.get(got["bundle_sha256"]) == body
    row = app.state.store.submission(got["id"])
    assert (row.status, row.bundle_sha256, row.source_sha256, row.family_sha256, row.profile) == (
        "pending", got["bundle_sha256"], got["source_sha256"], got["family_sha256"], "local")
    view = httpx.get(f"{base}/v1/submissions/{got['id']}").json()
    assert (view["status"], view["hotkey"], view["failure"], view["scores"]) == ("pending", ALICE, None, None)


def test_not_a_zip(server):
    base, _ = server
    body = b"these bytes are not a zip archive"
    err = _error(post(base, body, signed(body)), 422, "not-a-zip", "intake", "prism:bad-zip")
    assert "not a valid zip archive" in err["message"]
    _still_serving(base)


def test_a_zip_bomb(server):
    base, _ = server
    body = zip_files({"architecture.py": "#" * 3_000_000, "training.py": "def train(ctx):\n    pass\n"})
    assert len(body) < 64 * 1024  # under the body limit: the archive rules refuse it
    err = _error(post(base, body, signed(body)), 422, "zip-bomb", "intake", "prism:zip-ratio")
    assert err["message"].startswith("architecture.py: compression ratio")
    _still_serving(base)


def test_a_path_traversal_member(server):
    base, _ = server
    body = zip_files({"../../etc/cron.d/x.py": "x = 1\n"})
    err = _error(post(base, body, signed(body)), 422, "unsafe-path", "intake", "prism:zip-parent-path")
    assert "../../etc/cron.d/x.py" in err["message"]


def test_a_bad_signature(server, tmp_path):
    base, _ = server
    body = _bundle(tmp_path, lr="0.0052")
    forged = sign_request(BOB_SEED, "forged-1", int(time.time()), body)  # Bob signs, claims to be Alice
    forged["X-Hotkey"] = ALICE
    err = _error(post(base, body, forged), 401, "bad-signature", "auth", "prism:signature")
    assert ALICE in err["message"]
    tampered = signed(body)  # Alice's signature over another body
    _error(post(base, body + b"\0", tampered), 401, "bad-signature", "auth", "prism:signature")
    garbage = {**signed(body), "X-Signature": "zz" * 64}
    err = _error(post(base, body, garbage), 401, "bad-signature", "auth", "prism:signature")
    assert "128 hex digits" in err["message"]
    _still_serving(base)


def test_a_forged_request_does_not_burn_the_nonce(server, tmp_path):
    base, _ = server
    body = _bundle(tmp_path, lr="0.0053")
    good = signed(body, nonce="shared-nonce-1")
    forged = {**good, "X-Signature": sign_request(BOB_SEED, "shared-nonce-1", int(good["X-Timestamp"]), body)[
        "X-Signature"]}
    _error(post(base, body, forged), 401, "bad-signature", "auth", "prism:signature")
    assert post(base, body, good).status_code == 202


def test_a_stale_timestamp(server, tmp_path):
    base, _ = server
    body = _bundle(tmp_path, lr="0.0054")
    for skew in (-305, 305):  # int(time.time()) lags the clock by up to 1 s
        err = _error(post(base, body, signed(body, timestamp=int(time.time()) + skew)), 401, "stale-timestamp",
                     "auth", "prism:timestamp-window")
        assert "300 s window" in err["message"]
        assert ("s ahead of the service's clock" if skew > 0 else "s behind the service's clock") in err["message"]
    assert post(base, body, signed(body, timestamp=int(time.time()) - 290)).status_code == 202
    _still_serving(base)


def test_a_replayed_nonce(server, tmp_path):
    base, _ = server
    body = _bundle(tmp_path, lr="0.0055")
    headers = signed(body, nonce="replay-me")
    assert post(base, body, headers).status_code == 202
    err = _error(post(base, body, headers), 409, "nonce-reused", "auth", "prism:nonce")
    assert "'replay-me' was already used" in err["message"]
    other = _bundle(tmp_path, lr="0.0056", name="bob")  # another hotkey may use the same nonce
    assert post(base, other, signed(other, BOB_SEED, nonce="replay-me")).status_code == 202
    _still_serving(base)


def test_an_oversized_body_is_refused_by_its_length_and_while_streaming(server):
    base, _ = server
    body = b"PK" + b"\0" * (64 * 1024)
    err = _error(post(base, body, signed(body)), 413, "body-too-large", "request", "prism:body-limit")
    assert "Content-Length 65,538: the limit is 65,536 bytes" in err["message"]

    def chunks():  # no Content-Length: chunked transfer, cut at the limit while it arrives
        for _ in range(4):
            yield b"\0" * 20_000

    r = httpx.post(base + "/v1/submissions", content=chunks(), headers=signed(b"x"), timeout=60)
    err = _error(r, 413, "body-too-large", "request", "prism:body-limit")
    assert err["message"].endswith("bytes arrived so far: the limit is 65,536 bytes")
    assert int(err["message"].split()[0].replace(",", "")) <= 80_000
    _still_serving(base)


def test_a_bundle_with_a_syntax_error(server):
    base, _ = server
    body = zip_files({"architecture.py": "def build_model(ctx:\n    return None\n",
                      "training.py": "def train(ctx):\n    pass\n"})
    err = _error(post(base, body, signed(body)), 422, "gates-refused", "gates", "prism:syntax")
    syntax = [f for f in err["findings"] if f["rule"] == "prism:syntax"]
    assert [(f["file"], f["line"], f["blocking"]) for f in syntax] == [("architecture.py", 1, True)]
    assert "architecture.py:1:" in err["message"]
    _still_serving(base)


def test_a_bundle_the_gates_refuse(server):
    base, _ = server
    arch = "import socket\n\n\ndef build_model(ctx):\n    return socket.socket()\n"
    body = zip_files({"architecture.py": arch, "training.py": "def train(ctx):\n    pass\n"})
    err = _error(post(base, body, signed(body)), 422, "gates-refused", "gates", "prism:no-network")
    blocking = [(f["rule"], f["file"], f["line"]) for f in err["findings"] if f["blocking"]]
    assert ("prism:no-network", "architecture.py", 1) in blocking
    _still_serving(base)


def test_an_unknown_tokenizer_and_one_the_profile_does_not_allow(server, tmp_path):
    base, _ = server
    body = zip_files({"architecture.py": ARCH.read_text(), "training.py": "def train(ctx):\n    pass\n",
                      "prism.yaml": "tokenizer: llama3\n"})
    err = _error(post(base, body, signed(body)), 422, "gates-refused", "gates", "prism:spec")
    assert "unknown tokenizer 'llama3'" in err["message"]
    profile = tmp_path / "bytes-only.toml"
    local = (REPO / "src/prism_challenge/profiles/local.toml").read_text()
    profile.write_text(local.replace('name = "local"', 'name = "bytes-only"').replace(
        'allowed = ["gpt2", "bytes"]', 'allowed = ["bytes"]'))
    with live_server(tmp_path / "svc", profile=str(profile)) as (other, _):
        gpt2 = zip_dir(EXAMPLE)  # examples/tiny-1m declares no tokenizer: gpt2
        err = _error(post(other, gpt2, signed(gpt2)), 422, "tokenizer-not-allowed", "intake", "prism:tokenizer")
        assert err["message"] == "prism.yaml: tokenizer 'gpt2' is not allowed by profile bytes-only (allowed: bytes)"


def test_a_duplicate_by_normalized_source_and_a_training_variant(server, tmp_path):
    base, _ = server
    first = _bundle(tmp_path, lr="0.0061", name="first", own_arch=True)
    r1 = post(base, first, signed(first))
    assert r1.status_code == 202
    first_id, family = r1.json()["id"], r1.json()["family_sha256"]
    # Bob copies it, with a new comment and docstring: the same normalized source
    copy = _bundle(tmp_path, lr="0.0061", arch_comment="my own model", name="copy", own_arch=True)
    assert hashlib.sha256(copy).hexdigest() != hashlib.sha256(first).hexdigest()
    err = _error(post(base, copy, signed(copy, BOB_SEED)), 409, "duplicate", "intake", "prism:duplicate")
    assert err["duplicate_of"] == first_id
    # another learning rate on the same architecture: a training variant of the family's first submission
    variant = _bundle(tmp_path, lr="0.0062", arch_comment="reworded", name="variant", own_arch=True)
    r3 = post(base, variant, signed(variant, BOB_SEED))
    assert r3.status_code == 202
    root = httpx.get(f"{base}/v1/submissions/{first_id}").json()["variant_of"] or first_id
    assert (r3.json()["family_sha256"], r3.json()["variant_of"]) == (family, root)
    _still_serving(base)


def test_an_unknown_submission_id(server):
    base, _ = server
    err = _error(httpx.get(base + "/v1/submissions/987654"), 404, "not-found", "request", "prism:unknown-id")
    assert "987654" in err["message"]
    for path in ("/v1/submissions/abc", "/v1/submissions/0", "/v1/submissions/-3/curve"):
        _error(httpx.get(base + path), 400, "invalid-request", "request", "prism:request")
    _error(httpx.get(base + "/v1/nothing-here"), 404, "not-found", "request", "prism:request")
    _error(httpx.get(base + "/v1/submissions"), 405, "method-not-allowed", "request", "prism:request")
    _still_serving(base)


def test_missing_and_malformed_headers(server, tmp_path):
    base, _ = server
    body = _bundle(tmp_path, lr="0.0071")
    good = signed(body)
    for drop in ("X-Hotkey", "X-Signature", "X-Nonce", "X-Timestamp"):
        err = _error(post(base, body, {k: v for k, v in good.items() if k != drop}), 400, "missing-header", "auth",
                     "prism:signed-request")
        assert drop in err["message"]
    _error(post(base, body, {**good, "X-Hotkey": "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQZ"}), 400,
           "bad-hotkey", "auth", "prism:ss58")
    polkadot = "15oF4uVJwmo4TdGW7VfQxNLavjCXviqxT9S1MgbjMNHr6Sp5"  # Alice's key on network 0
    err = _error(post(base, body, {**good, "X-Hotkey": polkadot}), 400, "bad-hotkey", "auth", "prism:ss58")
    assert "network 0; this service takes network 42" in err["message"]
    _error(post(base, body, {**good, "X-Timestamp": "soon"}), 400, "bad-header", "auth", "prism:signed-request")
    _error(post(base, body, {**good, "X-Nonce": "a b"}), 400, "bad-header", "auth", "prism:signed-request")
    _error(post(base, b"", signed(b"")), 400, "empty-body", "request", "prism:body")


def test_the_rate_limit_counts_accepted_submissions_and_answers_429_with_retry_after(tmp_path):
    with live_server(tmp_path, rate_limit=2, rate_window_s=600, max_in_flight=10) as (base, _):
        refused = [zip_files({"x.py": f"x = {i}\n"}) for i in range(3)]  # refused at intake: not counted
        assert [post(base, b, signed(b)).status_code for b in refused] == [422, 422, 422]
        good = [_bundle(tmp_path, lr=f"0.00{i + 2}", name=f"r{i}") for i in range(3)]
        assert [post(base, b, signed(b)).status_code for b in good[:2]] == [202, 202]
        r = post(base, good[2], signed(good[2]))
        err = _error(r, 429, "rate-limited", "auth", "prism:rate-limit")
        assert 590 <= int(r.headers["Retry-After"]) <= 600
        assert ALICE in err["message"]
        assert post(base, good[2], signed(good[2], BOB_SEED)).status_code == 202  # per hotkey
        _still_serving(base)


def test_the_internal_route_needs_the_token_and_a_verified_hotkey(server, tmp_path):
    base, _ = server
    body = _bundle(tmp_path, lr="0.0081")
    path = "/internal/v1/submissions"
    _error(post(base, body, {"X-Verified-Hotkey": ALICE}, path), 401, "unauthorized", "auth", "prism:internal-token")
    _error(post(base, body, {"Authorization": "Bearer wrong", "X-Verified-Hotkey": ALICE}, path), 401,
           "unauthorized", "auth", "prism:internal-token")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _error(post(base, body, auth, path), 400, "missing-header", "auth", "prism:internal-token")
    _error(post(base, body, {**auth, "X-Verified-Hotkey": "nope"}, path), 400, "bad-hotkey", "auth", "prism:ss58")
    r = post(base, body, {**auth, "X-Verified-Hotkey": ALICE}, path)
    assert r.status_code == 202 and r.json()["hotkey"] == ALICE


def test_the_internal_routes_are_closed_without_a_token(tmp_path):
    with live_server(tmp_path, internal_token=None) as (base, _):
        body = zip_files({"x.py": "x = 1\n"})
        err = _error(post(base, body, {"Authorization": "Bearer anything", "X-Verified-Hotkey": ALICE},
                          "/internal/v1/submissions"), 401, "unauthorized", "auth", "prism:internal-token")
        assert "disabled" in err["message"]
        _error(httpx.get(base + "/internal/v1/weights"), 401, "unauthorized", "auth", "prism:internal-token")


def test_metrics_count_the_outcomes(server):
    base, _ = server
    body = b"not a zip either"
    post(base, body, signed(body))
    text = httpx.get(base + "/metrics").text
    assert 'prism_intake_total{outcome="not-a-zip"}' in text
    assert 'prism_submissions{status="pending"}' in text
    assert 'prism_http_requests_total{method="POST",route="/v1/submissions",status="422"}' in text


def test_a_lying_zip_member(server):
    base, _ = server
    data = bytearray(zip_files({"architecture.py": ARCH.read_text(), "training.py": "def train(ctx):\n    pass\n"}))
    import struct

    local, central = data.find(b"PK\x03\x04"), data.find(b"PK\x01\x02")
    struct.pack_into("<I", data, local + 22, 10)
    struct.pack_into("<I", data, central + 24, 10)
    body = bytes(data)
    err = _error(post(base, body, signed(body)), 422, "not-a-zip", "intake", "prism:bad-zip")
    assert "Bad CRC-32" in err["message"]
    assert zipfile.is_zipfile(io.BytesIO(body))


def test_prism_yaml_counts_by_what_it_declares_and_a_yaml_bomb_does_not_expand(server, tmp_path):
    base, _ = server
    arch = ARCH.read_text()
    loop = TRAIN.read_text().replace("EFFECTIVE_LEARNING_RATE = 0.005", "EFFECTIVE_LEARNING_RATE = 0.0091")
    first = zip_files({"architecture.py": arch, "training.py": loop,
                       "prism.yaml": "tokenizer: gpt2\nname: mine\n"})
    r = post(base, first, signed(first))
    assert r.status_code == 202, r.text
    levels = "\n".join(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10))
    bomb = f"tokenizer: gpt2\ndescription:\n  l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n{levels}\n"
    copy = zip_files({"architecture.py": arch, "training.py": loop, "prism.yaml": bomb})  # 9**10 strings if expanded
    t0 = time.monotonic()
    err = _error(post(base, copy, signed(copy, BOB_SEED)), 409, "duplicate", "intake", "prism:duplicate")
    assert err["duplicate_of"] == r.json()["id"] and time.monotonic() - t0 < 30
    other = zip_files({"architecture.py": arch, "training.py": loop, "prism.yaml": "tokenizer: bytes\n"})
    assert post(base, other, signed(other, BOB_SEED)).status_code == 202  # another tokenizer: another source


def test_an_accepted_submission_wakes_the_dispatcher_and_a_refused_one_does_not(server, tmp_path):
    base, app = server

    class Waker:
        woken = 0

        def wake(self):
            self.woken += 1

    waker = Waker()
    app.state.dispatcher = waker
    try:
        assert post(base, b"not a zip", signed(b"not a zip")).status_code == 422
        assert waker.woken == 0
        body = _bundle(tmp_path, lr="0.00517")
        assert post(base, body, signed(body)).status_code == 202
        assert waker.woken == 1
    finally:
        app.state.dispatcher = None
