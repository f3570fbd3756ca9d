"""What a hostile submitter tried against a real uvicorn server on 127.0.0.1 (and a real SQLite
file), each attack answered with its 4xx and reason, and the service still serving after it."""

from __future__ import annotations

import hashlib
import io
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
    with live_server(tmp_path_factory.mktemp("svc"), rate_limit=1000) as (base, app):
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
