"""What a hostile submitter tried against a real uvicorn server on 127.0.0.1 (and a real SQLite
file), each attack answered with its 4xx and reason, and the service still serving after it."""

from __future__ import annotations

import hashlib
import io
import shutil
import time
import zipfile

import base58
import httpx
import pytest
import sr25519

from prism_challenge.service.signing import SignatureError, message, sign, ss58_decode, ss58_encode
from helpers import EXAMPLE
from service_live import ALICE, ALICE_SEED, live_server, post, signed, zip_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("svc"), rate_limit=1000, address_rate_limit=1000, max_in_flight=1000) as (base, app):
        yield base, app


def _still_serving(base: str) -> None:
    assert httpx.get(base + "/health").json()["status"] == "ok"


def _two_byte_form(public: bytes, prefix: int) -> str:
    """``public`` under ``prefix`` written with SS58's two-byte prefix form (by hand: the
    format of https://docs.substrate.io/reference/address-formats/, which reserves it for 64..16383)."""
    head = bytes([0x40 | ((prefix & 0xFC) >> 2), (prefix >> 8) | ((prefix & 0x03) << 6)])
    body = head + public
    return base58.b58encode(body + hashlib.blake2b(b"SS58PRE" + body, digest_size=64).digest()[:2]).decode()


def test_the_same_key_has_one_address_per_network():
    """The two-byte form of prefix 42 names Alice's key too; it would be a second hotkey (its own
    rate limit, nonces and leaderboard entry). Refused as non-canonical."""
    public, _ = sr25519.pair_from_seed(ALICE_SEED)
    alias = _two_byte_form(public, 42)
    assert alias != ALICE and alias != ss58_encode(public, 42) and len(base58.b58decode(alias)) == 36
    with pytest.raises(SignatureError, match="two-byte SS58 prefix 42"):
        ss58_decode(alias)
    assert ss58_decode(_two_byte_form(public, 64)) == (public, 64)  # the form's smallest legal prefix


def test_a_second_address_of_one_key_is_not_a_second_hotkey(server):
    base, _ = server
    public, _ = sr25519.pair_from_seed(ALICE_SEED)
    alias = _two_byte_form(public, 42)
    body = zip_dir(EXAMPLE, "alias")
    nonce, ts = "alias-1", int(time.time())
    headers = {"X-Hotkey": alias, "X-Nonce": nonce, "X-Timestamp": str(ts),
               "X-Signature": sign(ALICE_SEED, message(alias, nonce, ts, hashlib.sha256(body).hexdigest()))}
    r = post(base, body, headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["stage"], err["rule"]) == ("bad-hotkey", "auth", "prism:ss58")
    assert "X-Hotkey" in err["message"] and "two-byte" in err["message"]
    _still_serving(base)


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_a_corrupt_compressed_stream_is_a_bad_zip_not_a_500(server, method):
    """Each member's compressed bytes garbled, its sizes and the directory left intact: the
    decompressor (zlib, bz2, lzma) fails while the member is read."""
    base, _ = server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for p in sorted(EXAMPLE.iterdir()):
            if p.is_file():
                zf.writestr(p.name, p.read_text() * 4)
    data = bytearray(buf.getvalue())
    for info in zipfile.ZipFile(io.BytesIO(bytes(data))).infolist():
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        for i in range(start + 4, start + min(info.compress_size, 40)):
            data[i] ^= 0x5A
    body = bytes(data)
    r = post(base, body, signed(body))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["stage"], err["rule"]) == ("not-a-zip", "intake", "prism:bad-zip"), err
    assert "corrupt" in err["message"] or "unreadable" in err["message"] or "Bad CRC" in err["message"], err
    _still_serving(base)


def test_an_invented_http_method_does_not_make_a_metrics_series(server):
    """``prism_http_requests_total``'s ``method`` label: the methods of HTTP (RFC 9110) by
    name, any other as ``other`` (an attacker-chosen label value is one more series each)."""
    base, _ = server
    for m in ("PRISMX1", "PRISMX2", "PRISMX3"):
        assert httpx.request(m, base + "/health").status_code == 405
    text = httpx.get(base + "/metrics").text
    assert "PRISMX" not in text
    line = next(x for x in text.splitlines()
                if x.startswith('prism_http_requests_total{method="other",route="/health",status="405"}'))
    assert float(line.split()[-1]) == 3.0
    assert 'prism_http_requests_total{method="GET",route="/health",status="200"}' in text


def test_the_stock_architecture_makes_no_author(tmp_path):
    """Bob sends `prism init`'s bundle first; Alice then trains the same template architecture
    better. Without the public-family rule Bob would be the "architecture author" of Alice's
    run and take family_share (0.6) of the weights for code the project wrote."""
    from prism_challenge.research.scaffold import write_bundle
    from service_live import BOB_SEED, TOKEN
    from test_service_read import scored

    write_bundle(tmp_path / "stock", "gpt2")
    write_bundle(tmp_path / "tuned", "gpt2")
    train = tmp_path / "tuned" / "training.py"
    train.write_text(train.read_text() + "\nTUNED = 1\n")
    with live_server(tmp_path / "svc", rate_limit=1000, address_rate_limit=1000, max_in_flight=1000) as (base, app):
        first = zip_dir(tmp_path / "stock", "stock")
        r1 = post(base, first, signed(first, BOB_SEED))
        second = zip_dir(tmp_path / "tuned", "tuned")
        r2 = post(base, second, signed(second))
        assert (r1.status_code, r2.status_code) == (202, 202), (r1.text, r2.text)
        a, b = r1.json(), r2.json()
        assert a["family_sha256"] == b["family_sha256"] and a["source_sha256"] != b["source_sha256"]
        assert (a["variant_of"], b["variant_of"]) == (None, None)
        store = app.state.store
        for sid, bpb in ((a["id"], 2.0), (b["id"], 1.5)):
            store.finish(store.claim(sid).attempt_id, scored(bpb, 0.1))
        got = httpx.get(base + "/internal/v1/weights", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert got["weights"] == {ALICE: 1.0}


def test_an_own_architecture_still_has_its_author(tmp_path):
    """The same two steps with an architecture nobody shipped: Alice's bundle is Bob's variant."""
    from prism_challenge.research.scaffold import write_bundle
    from service_live import BOB_SEED

    for name in ("own", "own2"):
        write_bundle(tmp_path / name, "gpt2")
        arch = tmp_path / name / "architecture.py"
        arch.write_text(arch.read_text() + "\nOWN_ARCHITECTURE = 1\n")
    train = tmp_path / "own2" / "training.py"
    train.write_text(train.read_text() + "\nTUNED = 1\n")
    with live_server(tmp_path / "svc", rate_limit=1000, address_rate_limit=1000, max_in_flight=1000) as (base, _):
        first = zip_dir(tmp_path / "own", "own")
        r1 = post(base, first, signed(first, BOB_SEED))
        second = zip_dir(tmp_path / "own2", "own2")
        r2 = post(base, second, signed(second))
        assert (r1.status_code, r2.status_code) == (202, 202), (r1.text, r2.text)
        assert r2.json()["variant_of"] == r1.json()["id"]


def _trickle(base: str, body_bytes: bytes, declared: int):
    """A raw connection that sends signed headers declaring ``declared`` body bytes, then only
    ``body_bytes`` of them, and waits."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    head = "".join(f"{k}: {v}\r\n" for k, v in signed(b"x" * declared).items())
    s.sendall(f"POST /v1/submissions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/zip\r\n{head}"
              f"Content-Length: {declared}\r\n\r\n".encode() + body_bytes)
    return s


def test_a_trickled_body_is_cut_at_the_body_timeout(tmp_path):
    """Slowloris on the body: 10 of 5,000 declared bytes, then silence. 408 after
    body_timeout_s (1 s here), the connection closed, the service serving."""
    with live_server(tmp_path, body_timeout_s=1.0) as (base, _):
        s = _trickle(base, b"PK" + b"\0" * 8, 5000)
        s.settimeout(10)
        t0 = time.monotonic()
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        waited = time.monotonic() - t0
        s.close()
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert b'"code":"body-timeout"' in reply and b"10 bytes of the body arrived in 1 s" in reply
        assert 0.9 < waited < 8, waited
        _still_serving(base)


def test_connections_past_max_connections_get_503_not_memory(tmp_path):
    """max_connections = 3: two trickling uploads are open; a request on a third connection
    reaches the limit and is answered 503 by uvicorn before the app buffers anything; once the
    uploads time out, the service answers again."""
    with live_server(tmp_path, max_connections=3, body_timeout_s=2.0) as (base, _):
        held = [_trickle(base, b"PK", 100_000) for _ in range(2)]
        time.sleep(0.3)
        assert httpx.get(base + "/health", timeout=5).status_code == 503
        for s in held:
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.1 408 ")
            s.close()
        time.sleep(0.3)
        _still_serving(base)


def test_replaying_a_captured_request_does_not_spend_its_hotkeys_rate_limit(tmp_path):
    """Whoever saw one of Alice's signed requests (a proxy's log) replays it: each replay is
    409 ``nonce-reused``, and none counts against Alice's rate limit (2 here); nor does a refused
    duplicate, so her next fresh request is still accepted, and only the one after it is 429."""
    with live_server(tmp_path, rate_limit=2, max_in_flight=10) as (base, _):
        body = zip_dir(EXAMPLE, "first")
        headers = signed(body)
        assert post(base, body, headers).status_code == 202
        for _ in range(3):
            r = post(base, body, headers)
            assert (r.status_code, r.json()["error"]["code"]) == (409, "nonce-reused"), r.text
        same = zip_dir(EXAMPLE, "second")
        r = post(base, same, signed(same))
        assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate", r.text  # judged, not counted
        root = tmp_path / "other"
        shutil.copytree(EXAMPLE, root)
        (root / "training.py").write_text((root / "training.py").read_text() + "\nOTHER = 1\n")
        other = zip_dir(root, "third")
        assert post(base, other, signed(other)).status_code == 202  # the second accepted
        root2 = tmp_path / "other2"
        shutil.copytree(EXAMPLE, root2)
        (root2 / "training.py").write_text((root2 / "training.py").read_text() + "\nOTHER = 2\n")
        fourth = zip_dir(root2, "fourth")
        r = post(base, fourth, signed(fourth))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate-limited" and r.headers["Retry-After"], r.text


# Ristretto255's base point, compressed (RFC 9496, section 4.4's generator).
RISTRETTO_BASE = bytes.fromhex("e2f2ae0a6abc4e71a884a961c500515f58e30b6aa582dd8db6a65945e08d2d76")


def test_the_identity_key_cannot_be_used_as_a_hotkey(server):
    """The all-zero public key is Ristretto's identity A = 0: ``s*B == R + k*A`` holds for
    R = B, s = 1 and any message, so anyone can sign for its address. The library accepts such a
    forgery; the service must not."""
    base, _ = server
    zero = ss58_encode(bytes(32))
    forged = bytearray(RISTRETTO_BASE + (1).to_bytes(32, "little"))
    forged[63] |= 0x80  # schnorrkel's marker bit of an sr25519 signature
    body = zip_dir(EXAMPLE, "zero")
    nonce, ts = "zero-1", int(time.time())
    assert sr25519.verify(bytes(forged), message(zero, nonce, ts, hashlib.sha256(body).hexdigest()), bytes(32))
    headers = {"X-Hotkey": zero, "X-Nonce": nonce, "X-Timestamp": str(ts), "X-Signature": "0x" + forged.hex()}
    r = post(base, body, headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["rule"]) == ("bad-hotkey", "prism:ss58") and "identity" in err["message"], err
    _still_serving(base)


def _stub_bundle(tmp_path, name: str, model_extra: str) -> bytes:
    """A bundle whose architecture.py is a one-line stub importing the model from model.py
    (tiny-1m's architecture, plus ``model_extra``)."""
    import shutil

    root = tmp_path / name
    shutil.copytree(EXAMPLE, root)
    (root / "model.py").write_text((EXAMPLE / "architecture.py").read_text() + model_extra)
    (root / "architecture.py").write_text("from model import build_model\n")
    return zip_dir(root, name)


def test_a_family_is_the_architecture_and_the_modules_it_imports(server, tmp_path):
    """Bob sends a stub architecture.py (``from model import build_model``) first. Alice's
    bundle with the same stub but another model in model.py is another family, not Bob's
    variant; a bundle with Bob's very model (comments aside) and another training is his variant."""
    from prism_challenge.service.families import architecture_closure, family_sha256
    from service_live import BOB_SEED

    base, _ = server
    bob = _stub_bundle(tmp_path, "bob", "\nWIDTH_NOTE = 1\n")
    alice = _stub_bundle(tmp_path, "alice", "\nOTHER_MODEL = 2\n")
    r1 = post(base, bob, signed(bob, BOB_SEED))
    r2 = post(base, alice, signed(alice))
    assert (r1.status_code, r2.status_code) == (202, 202), (r1.text, r2.text)
    assert r2.json()["family_sha256"] != r1.json()["family_sha256"] and r2.json()["variant_of"] is None
    root = tmp_path / "carol"
    import shutil

    shutil.copytree(tmp_path / "bob", root)
    (root / "model.py").write_text("# my notes\n" + (root / "model.py").read_text())
    (root / "training.py").write_text((root / "training.py").read_text() + "\nTUNED = 1\n")
    carol = zip_dir(root, "carol")
    r3 = post(base, carol, signed(carol))
    assert r3.status_code == 202, r3.text
    assert (r3.json()["family_sha256"], r3.json()["variant_of"]) == (r1.json()["family_sha256"], r1.json()["id"])
    # the digest by hand: the architecture's path written as "", model.py by its path
    assert architecture_closure(root, "architecture.py") == ["architecture.py", "model.py"]
    from prism_challenge.service.intake import normalized_python

    lines = "".join(f"{name}\0{hashlib.sha256(normalized_python((root / rel).read_text(), rel).encode()).hexdigest()}\n"
                    for name, rel in (("", "architecture.py"), ("model.py", "model.py")))
    assert family_sha256(root, "architecture.py") == hashlib.sha256(lines.encode()).hexdigest()
    # one file: the sha256 of its normalized source, as before
    single = normalized_python((EXAMPLE / "architecture.py").read_text(), "architecture.py")
    assert family_sha256(EXAMPLE, "architecture.py") == hashlib.sha256(single.encode()).hexdigest()


def test_public_families_are_the_shipped_architectures_and_the_settings_extra(tmp_path):
    from prism_challenge.service.families import SHIPPED_ARCHITECTURES, family_sha256, public_families
    from prism_challenge.service.intake import normalized_python

    template = SHIPPED_ARCHITECTURES[0]
    assert template.name == "architecture.py.tmpl"
    by_hand = hashlib.sha256(normalized_python(template.read_text(), "a.py").encode()).hexdigest()
    assert by_hand in public_families()
    assert family_sha256(EXAMPLE, "architecture.py") in public_families()  # a source checkout
    extra = tmp_path / "nanogpt.py"
    extra.write_text("def build_model(ctx):\n    return None\n")
    mine = family_sha256(tmp_path, "nanogpt.py")
    assert mine not in public_families() and mine in public_families((extra,))
