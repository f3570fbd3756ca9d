"""The service's signing key: made (0600) in its state directory when the settings name none,
refused when its group or others may read it, published at GET /version and on the pages, and
handed to the workers."""

from __future__ import annotations

import base64
import hashlib
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge.manifest.certificate import CertificateError, load_private_key
from prism_challenge.service.settings import SIGNING_KEY_ENV, ServiceSettings


def settings(tmp_path, **kw):
    return ServiceSettings(database_url=f"sqlite:///{tmp_path / 'db.sqlite3'}", profile="local",
                           blob_root=tmp_path / "blobs", dispatch=False, **kw)


def test_the_default_key_is_made_private_and_published(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from prism_challenge.service.app import create_app

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    with TestClient(create_app(settings(tmp_path))) as client:
        body = client.get("/version").json()
        page = client.get("/").text
    path = tmp_path / "data" / "prism-challenge" / "signing-key.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = load_private_key(path).public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert base64.b64decode(body["signing_public_key"]) == raw
    assert body["signing_key_id"] == hashlib.sha256(raw).hexdigest()[:16]
    assert f">{body['signing_key_id']}</span>" in page
    from prism_challenge.profiles import load_profile
    from prism_challenge.service.worker import options_for

    # the workers sign with the same file
    assert options_for(load_profile("local"), "b", tmp_path / "run").signing_key_file == str(path)


def test_a_named_key_that_others_can_read_is_refused(tmp_path, monkeypatch):
    from prism_challenge.service.app import create_app

    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    key = tmp_path / "operator.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(0o644)
    with pytest.raises(CertificateError, match=rf"{key}: the signing key file has mode 0644"):
        create_app(settings(tmp_path, signing_key_file=key))
    key.chmod(0o600)
    create_app(settings(tmp_path, signing_key_file=key))
    import os

    assert os.environ[SIGNING_KEY_ENV] == str(key.resolve())  # the workers this process starts use it


def test_verify_trusts_the_key_the_service_publishes(tmp_path, monkeypatch):
    from service_live import live_server

    from prism_challenge.manifest.certificate import check_certificate, public_key_text, sign_manifest
    from prism_challenge.manifest.verify import service_key

    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    key = tmp_path / "operator.pem"
    operator = Ed25519PrivateKey.generate()
    key.write_bytes(operator.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key.chmod(0o600)
    with live_server(tmp_path, signing_key_file=key) as (base, _):
        published = service_key(base)
    assert published == public_key_text(operator)
    m = sign_manifest({"schema": "prism.run.v2", "score": {"prequential_bpb": 1.5}}, operator)
    assert check_certificate(m, [published]) == m["certificate"]["key_id"]
    with pytest.raises(CertificateError, match="untrusted key"):
        check_certificate(m, None)  # the user's own key is not the service's
    with pytest.raises(ValueError, match=r"--service http://127.0.0.1:9: cannot read its /version"):
        service_key("http://127.0.0.1:9", timeout_s=2)


def test_a_cluster_hands_the_head_s_key_path_to_every_node_s_workers(monkeypatch):
    from prism_challenge.service.dispatch import signing_env
    from prism_challenge.service.settings import SIGNING_KEY_ENV

    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    assert signing_env() is None
    monkeypatch.setenv(SIGNING_KEY_ENV, "/etc/prism/signing-key.pem")
    assert signing_env() == {"env_vars": {SIGNING_KEY_ENV: "/etc/prism/signing-key.pem"}}
