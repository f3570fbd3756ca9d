"""sr25519 request signatures and SS58 addresses, against published vectors: the Substrate
development key Alice (`subkey inspect //Alice`: secret seed 0xe5be9a50..., public key
0xd43593c7..., generic address 5GrwvaEF..., Polkadot 15oF4uVJ..., Kusama HNZata7i...)."""

from __future__ import annotations

import hashlib

import pytest
import sr25519

from prism_challenge.service.signing import (
    SignatureError,
    message,
    sign,
    sign_request,
    ss58_decode,
    ss58_encode,
    verify,
)

ALICE_SEED = bytes.fromhex("e5be9a5092b81bca64be81d212e7f2f9eba183bb7a90954f7b76361f6edb5c0a")
ALICE_PUBLIC = bytes.fromhex("d43593c715fdd31c61141abd04a99fd6822c8558854ccde39a5684e7a56da27d")
ALICE = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
ALICE_POLKADOT = "15oF4uVJwmo4TdGW7VfQxNLavjCXviqxT9S1MgbjMNHr6Sp5"
ALICE_KUSAMA = "HNZata7iMYWmk5RvZRTiAsSDhV8366zq2YGb3tLH5Upf74F"


def test_alices_seed_gives_her_published_public_key_and_addresses():
    public, _ = sr25519.pair_from_seed(ALICE_SEED)
    assert public == ALICE_PUBLIC
    assert ss58_encode(ALICE_PUBLIC) == ALICE
    assert ss58_encode(ALICE_PUBLIC, 0) == ALICE_POLKADOT
    assert ss58_encode(ALICE_PUBLIC, 2) == ALICE_KUSAMA
    for address, prefix in ((ALICE, 42), (ALICE_POLKADOT, 0), (ALICE_KUSAMA, 2)):
        assert ss58_decode(address) == (ALICE_PUBLIC, prefix)


def test_two_byte_prefixes_round_trip():
    for prefix in (64, 255, 1000, 16383):
        assert ss58_decode(ss58_encode(ALICE_PUBLIC, prefix)) == (ALICE_PUBLIC, prefix)


@pytest.mark.parametrize("address, words", [
    (ALICE[:-1] + "Z", "bad SS58 checksum"),
    ("0OIl", "not a base58"),
    ("5Grwva", "not an SS58 account id"),
    ("héllo", "not a base58"),
])
def test_malformed_addresses_are_refused(address, words):
    with pytest.raises(SignatureError, match=words):
        ss58_decode(address)


def test_the_signed_message_is_the_reference_format():
    body_sha = hashlib.sha256(b"zip").hexdigest()
    assert message(ALICE, "n1", 1700000000, body_sha) == f"prism:{ALICE}:n1:1700000000:{body_sha}".encode()


def test_a_signature_verifies_with_the_library_itself_and_fails_when_anything_changes():
    body = b"the bundle"
    headers = sign_request(ALICE_SEED, "nonce-7", 1700000000, body)
    assert headers["X-Hotkey"] == ALICE and headers["X-Nonce"] == "nonce-7" and headers["X-Timestamp"] == "1700000000"
    signed = message(ALICE, "nonce-7", 1700000000, hashlib.sha256(body).hexdigest())
    raw = bytes.fromhex(headers["X-Signature"].removeprefix("0x"))
    assert len(raw) == 64 and sr25519.verify(raw, signed, ALICE_PUBLIC)  # the independent check
    verify(ALICE, headers["X-Signature"], signed)
    verify(ALICE, headers["X-Signature"].removeprefix("0x"), signed)
    for other in (message(ALICE, "nonce-8", 1700000000, hashlib.sha256(body).hexdigest()),
                  message(ALICE, "nonce-7", 1700000001, hashlib.sha256(body).hexdigest()),
                  message(ALICE, "nonce-7", 1700000000, hashlib.sha256(b"other").hexdigest())):
        with pytest.raises(SignatureError, match="not a valid sr25519 signature"):
            verify(ALICE, headers["X-Signature"], other)
    bob = ss58_encode(sr25519.pair_from_seed(bytes(32))[0])
    with pytest.raises(SignatureError, match=bob):
        verify(bob, headers["X-Signature"], signed)


def test_a_polkadot_js_style_wrapped_signature_is_accepted():
    signed = message(ALICE, "n", 1, "ab" * 32)
    wrapped = sign(ALICE_SEED, b"<Bytes>" + signed + b"</Bytes>")
    verify(ALICE, wrapped, signed)


@pytest.mark.parametrize("sig", ["", "0x", "ab" * 63, "zz" * 64, "ab" * 65])
def test_malformed_signatures_are_refused(sig):
    with pytest.raises(SignatureError, match="128 hex digits"):
        verify(ALICE, sig, b"x")
