"""The signing key is hidden from the sandbox: a loop that reads it gets nothing, while a file
beside it, in a folder the sandbox shows, reads fine (so the hiding, not the folder's absence,
is what stops it; as root, the key belongs to the sandbox's uid, so its mode does not stop it
either). Gates and audit hooks are off: the sandbox alone is tested."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge.pipeline import EvalOptions, evaluate

from helpers import LOOP, UNIFORM_ARCH, write_bundle

pytestmark = pytest.mark.slow

READER = """
def _try(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except Exception as exc:
        return "refused: " + type(exc).__name__


_seen = {{"key": _try({key!r}), "canary": _try({canary!r})}}
""" + LOOP + """
    import json, os
    with open(os.path.join(ctx.artifacts_dir, "seen.json"), "w") as f:
        json.dump(_seen, f)
"""


def test_a_sandboxed_loop_cannot_read_the_signing_key(tmp_path, monkeypatch):
    folder = tmp_path / "shown"
    folder.mkdir()
    key = folder / "signing-key.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(0o600)
    (folder / "canary.txt").write_text("visible")
    if os.geteuid() == 0:  # the sandbox runs as its own uid: give it the key (0600), so hiding is the only defense
        from prism_challenge.evaluator import jail, sandboxwatch

        uid = sandboxwatch.pick_sandbox_uid()
        monkeypatch.setattr(jail, "pick_sandbox_uid", lambda: uid)
        os.chown(key, uid, uid)
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{folder}:{os.environ.get('LD_LIBRARY_PATH', '')}")  # bound read-only
    training = READER.format(key=str(key), canary=str(folder / "canary.txt"), lr=0.0, batch=2, seq_len=16)
    bundle = write_bundle(tmp_path / "b", UNIFORM_ARCH, training)
    o = evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / "run"), device="cpu", token_budget=500,
                             heldout_bytes=0, audited_batches=0, run_gates=False, audit_hooks=False,
                             signing_key_file=str(key)))
    assert o.failure is None, o.failure
    import json

    seen = json.loads((o.run_dir / "artifacts" / "seen.json").read_text())
    assert seen["canary"] == "visible"  # the folder is in the sandbox ...
    assert seen["key"].startswith("refused: ") or seen["key"] == "", seen  # ... the key is not readable
    assert "PRIVATE KEY" not in seen["key"]
    assert o.manifest["certificate"]["key_id"]  # and the run was signed with it


def test_a_failed_runs_manifest_is_signed_too(tmp_path):
    import json

    from prism_challenge.manifest.certificate import check_certificate
    from prism_challenge.manifest.run_manifest import MANIFEST_NAME

    arch = UNIFORM_ARCH.replace("Uniform(ctx.vocab_size)", "Uniform(2)")  # the wrong logits' shape: a contract failure
    o = evaluate(EvalOptions(bundle=str(write_bundle(tmp_path / "b", arch)), out_dir=str(tmp_path / "run"), device="cpu",
                             token_budget=500, heldout_bytes=0, run_gates=False))
    assert o.failure is not None and o.failure.stage == "contract"
    m = json.loads((o.run_dir / MANIFEST_NAME).read_text())
    assert m["status"] == "failed" and check_certificate(m, None) == m["certificate"]["key_id"]
    from prism_challenge.manifest.results import RunManifest

    # the typed model's JSON (what the service stores and the API returns) keeps the signature
    assert check_certificate(RunManifest.model_validate(m).to_json_dict(), None) == m["certificate"]["key_id"]
