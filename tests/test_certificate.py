"""The signed run certificate (prism_challenge.manifest.certificate): RFC 8032's published Ed25519 vector,
RFC 8785 canonical bytes written out by hand, the key rules, and every way a certificate fails."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge.manifest.certificate import (
    CertificateError,
    canonical,
    check_certificate,
    create_key_file,
    load_private_key,
    parse_public_key,
    public_key_text,
    sign_manifest,
    user_key,
)

# RFC 8032, section 7.1, TEST 1 (the empty message)
RFC_SECRET = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC_SIGNATURE = bytes.fromhex("e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bac"
                              "c61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b")

MANIFEST = {"schema": "prism.run.v2", "status": "scored", "score": {"prequential_bpb": 2.5, "bytes": 12000},
            "run_secret": "ab" * 32, "curve": {"nats_per_target": [5.5, 4.25], "cumulative_targets": [10, 20]},
            "verdict": {"final_score": 0.2857142857142857, "flags": []}}


def write_key(path, key, mode=0o600):
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(mode)
    return path


def test_the_signature_is_rfc_8032s_ed25519():
    key = Ed25519PrivateKey.from_private_bytes(RFC_SECRET)
    assert base64.b64decode(public_key_text(key)) == RFC_PUBLIC
    assert key.sign(b"") == RFC_SIGNATURE


def test_the_canonical_form_is_rfc_8785s():
    # sorted keys, no whitespace, 1.0 written as 1, 1e21 as 1e+21, UTF-8; the certificate left out
    m = {"b": 1.0, "a": "\u00e9", "c": [1e21, 0.5, -0.0], "certificate": {"signature": "x"}}
    assert canonical(m) == b'{"a":"\xc3\xa9","b":1,"c":[1e+21,0.5,0]}'


def test_a_manifest_signs_and_verifies_whatever_its_layout(tmp_path):
    key = Ed25519PrivateKey.from_private_bytes(RFC_SECRET)
    signed = sign_manifest(MANIFEST, key)
    cert = signed["certificate"]
    assert cert["alg"] == "ed25519" and cert["canonicalization"] == "RFC 8785"
    assert cert["public_key"] == base64.b64encode(RFC_PUBLIC).decode()
    assert cert["key_id"] == hashlib.sha256(RFC_PUBLIC).hexdigest()[:16] == "21fe31dfa154a261"
    assert "certificate" not in MANIFEST  # the input is left alone
    relaid = json.loads(json.dumps(dict(reversed(list(signed.items()))), indent=7))  # another order and layout
    assert check_certificate(relaid, [public_key_text(key)]) == cert["key_id"]
    # the signature is over the canonical bytes: checked here with the key alone
    key.public_key().verify(base64.b64decode(cert["signature"]), canonical(MANIFEST))


@pytest.mark.parametrize("edit", [
    lambda m: m["score"].__setitem__("prequential_bpb", 2.4),
    lambda m: m["curve"]["nats_per_target"].__setitem__(1, 4.0),
    lambda m: m["verdict"]["flags"].append("audit"),
    lambda m: m.__setitem__("run_secret", "cd" * 32),
    lambda m: m.__setitem__("extra", None),
])
def test_any_edit_breaks_the_signature(edit):
    key = Ed25519PrivateKey.generate()
    signed = json.loads(json.dumps(sign_manifest(MANIFEST, key)))
    edit(signed)
    with pytest.raises(CertificateError, match=r"signature does not match the manifest \(key [0-9a-f]{16}\)"):
        check_certificate(signed, [public_key_text(key)])


def test_another_key_unsigned_and_a_forged_key_id_are_refused():
    mine, theirs = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    signed = sign_manifest(MANIFEST, theirs)
    with pytest.raises(CertificateError, match=f"signed by an untrusted key {signed['certificate']['key_id']}"):
        check_certificate(signed, [public_key_text(mine)])
    with pytest.raises(CertificateError, match="unsigned"):
        check_certificate(dict(MANIFEST), [public_key_text(mine)])
    forged = json.loads(json.dumps(signed))
    forged["certificate"]["key_id"] = sign_manifest(MANIFEST, mine)["certificate"]["key_id"]
    with pytest.raises(CertificateError, match="is not its public key's"):
        check_certificate(forged, [public_key_text(mine)])


def test_trusted_keys_come_as_base64_or_pem_files(tmp_path):
    key = Ed25519PrivateKey.generate()
    signed = sign_manifest(MANIFEST, key)
    pub = tmp_path / "pub.pem"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    private = write_key(tmp_path / "key.pem", key)
    kid = signed["certificate"]["key_id"]
    assert check_certificate(signed, [str(pub)]) == check_certificate(signed, [str(private)]) == kid
    with pytest.raises(CertificateError, match="--key nonsense: neither a key file nor the base64"):
        parse_public_key("nonsense")


def test_a_key_file_its_group_or_others_can_read_is_refused(tmp_path):
    path = write_key(tmp_path / "key.pem", Ed25519PrivateKey.generate(), mode=0o644)
    with pytest.raises(CertificateError, match=rf"{path}: the signing key file has mode 0644; .* \(chmod 600 {path}\)"):
        load_private_key(path)
    path.chmod(0o640)
    with pytest.raises(CertificateError, match="mode 0640"):
        load_private_key(path)
    path.chmod(0o400)
    assert isinstance(load_private_key(path), Ed25519PrivateKey)


def test_a_missing_file_and_a_non_ed25519_key_are_refused(tmp_path):
    with pytest.raises(CertificateError, match=f"{tmp_path / 'none.pem'}: the signing key file cannot be read"):
        load_private_key(tmp_path / "none.pem")
    ecdsa = write_key(tmp_path / "ec.pem", ec.generate_private_key(ec.SECP256R1()))
    with pytest.raises(CertificateError, match="must be ed25519, not"):
        load_private_key(ecdsa)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    junk.chmod(0o600)
    with pytest.raises(CertificateError, match="not an unencrypted PEM"):
        load_private_key(junk)


def test_the_users_key_is_made_once_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    old = os.umask(0o022)
    try:
        key, path = user_key()
    finally:
        os.umask(old)
    assert path == tmp_path / "config" / "prism" / "signing-key.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again, same = user_key()
    assert same == path and public_key_text(again) == public_key_text(key)
    # O_EXCL: creating over an existing file loads the key there, never replaces it
    assert public_key_text(create_key_file(path)) == public_key_text(key)
    # with no trusted key named, the user's own is trusted
    assert check_certificate(sign_manifest(MANIFEST, key), None) == sign_manifest(MANIFEST, key)["certificate"]["key_id"]
    with pytest.raises(CertificateError, match="untrusted key"):
        check_certificate(sign_manifest(MANIFEST, Ed25519PrivateKey.generate()), None)


def test_a_bad_key_stops_eval_before_anything_runs(tmp_path):
    from prism_challenge.failures import USAGE_STAGE, EvalFailure
    from prism_challenge.pipeline import EvalOptions, evaluate

    from helpers import EXAMPLE

    bad = write_key(tmp_path / "key.pem", Ed25519PrivateKey.generate(), mode=0o644)
    with pytest.raises(EvalFailure) as caught:
        evaluate(EvalOptions(bundle=str(EXAMPLE), out_dir=str(tmp_path / "run"), device="cpu", token_budget=1000,
                             signing_key_file=str(bad)))
    assert caught.value.stage == USAGE_STAGE and f"signing key: {bad}: the signing key file has mode 0644" \
        in caught.value.message
    assert not (tmp_path / "run").exists()


def test_the_key_is_hidden_from_every_jailed_process(tmp_path):
    from prism_challenge.manifest.certificate import user_key_path
    from prism_challenge.pipeline import EvalOptions
    from prism_challenge.pipeline.start import _hidden, _key_paths

    given = EvalOptions(bundle="b", signing_key_file=str(tmp_path / "k.pem"))
    assert _key_paths(given) == [tmp_path / "k.pem"]
    assert _key_paths(EvalOptions(bundle="b")) == [user_key_path().parent, user_key_path()]
    assert _hidden(tmp_path / "data", tmp_path / "run", _key_paths(given))[-1] == tmp_path / "k.pem"


def test_verifying_never_makes_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "fresh"))
    signed = sign_manifest(MANIFEST, Ed25519PrivateKey.generate())
    with pytest.raises(CertificateError, match="untrusted key .* \\(trusted: none: you have no key yet; pass --key"):
        check_certificate(signed, None)
    assert not (tmp_path / "fresh").exists()
