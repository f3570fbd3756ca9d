"""``prism verify`` against the manifest forgeries of issue 25, on one real run of the example (the
seed's loop: examples/tiny-1m/training.py is ../shared/seed/training.py byte for byte, see
test_eval_e2e), and honest runs verifying with and without ``--reexecute``.

The run draws its audit from a known secret (EvalOptions.run_secret), which its manifest
reveals as ``run_secret`` with ``audit.schedule``; the manifest is signed by the user's key."""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge.manifest import verify as verify_mod
from prism_challenge.manifest.certificate import sign_manifest, user_key
from prism_challenge.cli import main as prism
from prism_challenge.manifest.run_manifest import MANIFEST_NAME
from prism_challenge.manifest.verify_recompute import check_score, policy_of, recompute_verdict

from helpers import EXAMPLE

pytestmark = pytest.mark.slow

SECRET = bytes(range(32))
A = 4  # audited_batches: steps 0-4 always, then A/k: about 12 of the run's 24 batches


def secret_run(out_dir):
    """The example at 20k tokens, its audit drawn from :data:`SECRET` by the harmonic schedule."""
    from prism_challenge import pipeline

    opts = pipeline.EvalOptions(bundle=str(EXAMPLE), out_dir=str(out_dir), device="cpu", threads=1,
                                token_budget=20_000, heldout_bytes=10_000, audited_batches=A, run_secret=SECRET)
    outcome = pipeline.evaluate(opts)
    assert outcome.failure is None, outcome.failure
    m = json.loads((out_dir / MANIFEST_NAME).read_text())
    assert m["run_secret"] == SECRET.hex() and m["audit"]["schedule"] == {"rule": "harmonic", "audited_batches": A}
    return out_dir


def write(run_dir, m, key=None):
    """Write ``m`` into ``run_dir``, signed by ``key`` (``None``: as it is)."""
    (run_dir / MANIFEST_NAME).write_text(json.dumps(sign_manifest(m, key) if key is not None else m, indent=2))


def read(run_dir):
    return json.loads((run_dir / MANIFEST_NAME).read_text())


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    return secret_run(tmp_path_factory.mktemp("verify") / "run")


def copy_run(honest, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(honest, dest)
    return dest


def consistent(m):
    """Recompute the score's totals and the verdict from the (edited) curve, as a forger would."""
    per, cum_t = m["curve"]["nats_per_target"], m["curve"]["cumulative_targets"]
    nats = math.fsum(p * (t - s) for p, t, s in zip(per, cum_t, [0, *cum_t[:-1]]))
    score = m["score"]
    score["total_nats"], score["total_bits"] = nats, nats / math.log(2)
    score["prequential_bpb"] = nats / math.log(2) / score["bytes"]
    check_score(m)
    m["verdict"] = recompute_verdict(m, policy_of(m)[0])
    return m


def verify_json(run_dir, *extra, capsys):
    code = prism(["verify", str(run_dir), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_the_honest_run_verifies_with_its_draws_and_signature(honest, capsys):
    m = read(honest)
    code, out = verify_json(honest, capsys=capsys)
    assert code == 0 and out["verified"], out
    assert out["draws_checked"] and out["audited_batches"] == len(m["audit"]["batches"])
    assert out["probes_redrawn"] == len(m["audit"]["batches"])  # one blind pass per audited batch, one rank
    assert out["key_id"] == m["certificate"]["key_id"] and out["prequential_bpb"] == pytest.approx(
        m["score"]["prequential_bpb"], rel=1e-12)
    steps = [b["step"] for b in m["audit"]["batches"]]
    assert steps[:A + 1] == list(range(A + 1)) and len(steps) < m["stream"]["batches"]  # some batches not audited
    # the key named on the command line, as base64
    assert prism(["verify", str(honest), "--key", m["certificate"]["public_key"]]) == 0
    err = capsys.readouterr().err
    for stage in ("certificate", "hashes", "score", "verdict", "draws", "re-scoring"):
        assert f"\n{stage} " in "\n" + err, err  # a line per stage while it works


def test_a_consistent_edit_of_the_curve_is_caught_by_the_signature(honest, tmp_path, capsys):
    run_dir = copy_run(honest, tmp_path)
    m = read(run_dir)
    audited = {b["step"] for b in m["audit"]["batches"]}
    before = m["score"]["prequential_bpb"]
    for k in range(len(m["curve"]["nats_per_target"])):
        if k not in audited:
            m["curve"]["nats_per_target"][k] *= 0.3
    consistent(m)
    sys.stderr.write(f"forged: {before:.4f} -> {m['score']['prequential_bpb']:.4f} bpb, final_score "
          f"{m['verdict']['final_score']:.4f}\n")
    assert m["score"]["prequential_bpb"] < before - 0.5
    attacker = Ed25519PrivateKey.generate()
    write(run_dir, m, attacker)
    code, out = verify_json(run_dir, capsys=capsys)
    kid = read(run_dir)["certificate"]["key_id"]
    assert code == 1 and out["mismatch"].startswith(f"certificate: signed by an untrusted key {kid}")
    m["certificate"] = read(honest)["certificate"]  # the honest run's signature kept
    write(run_dir, m)
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"] == (f"certificate: the signature does not match the manifest "
                                             f"(key {m['certificate']['key_id']})")
    # even signed by the trusted key (a leaked key, a dishonest operator): re-running it shows the edit
    write(run_dir, m, user_key()[0])
    code, out = verify_json(run_dir, "--reexecute", capsys=capsys)
    first = min(set(range(len(m["curve"]["nats_per_target"]))) - audited)
    assert code == 1 and out["mismatch"].startswith(f"re-execution: batch {first}: curve.nats_per_target is "), out


def test_an_edited_verdict_is_caught_by_the_signature_and_the_recomputation(honest, tmp_path, capsys):
    run_dir = copy_run(honest, tmp_path)
    m = read(run_dir)
    fair = m["verdict"]["final_score"]
    m["verdict"]["final_score"] = fair * 1.5
    write(run_dir, m)
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"].startswith("certificate: the signature does not match")
    write(run_dir, m, user_key()[0])  # as if the trusted key had signed it
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"] == (f"verdict.final_score is {fair * 1.5!r} in the manifest, the "
                                             f"recomputation gives {fair!r}")
    # a caught run (an audited batch that did not match: zeroed, flag "audit") with its flags cleared
    m = read(honest)
    bad = m["audit"]["batches"][2]
    bad["match"], m["audit"]["passed"] = False, False
    m["audit"]["mismatch"] = f"audited batch {bad['step']}: recorded ..."
    caught = recompute_verdict(m, policy_of(m)[0])
    assert caught["final_score"] == 0.0 and caught["flags"][-1] == "audit"
    m["verdict"]["flags"] = [f for f in caught["flags"] if f != "audit"]  # and final_score left as it was
    write(run_dir, m, user_key()[0])
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"] == ("verdict.anti_cheat_multiplier is 1.0 in the manifest, the "
                                             "recomputation gives 0.0")
    m["audit"]["passed"] = True  # and the audit said to have passed
    write(run_dir, m, user_key()[0])
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"] == "audit: passed is True, its batches, mismatch and error give False"


def test_a_removed_audited_batch_is_caught_by_the_draws(honest, tmp_path, capsys):
    run_dir = copy_run(honest, tmp_path)
    m = read(run_dir)
    gone = m["audit"]["batches"].pop(-1)
    write(run_dir, m)
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"].startswith("certificate: the signature does not match")
    write(run_dir, m, user_key()[0])
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"].startswith(
        f"draws: the run_secret draws batch {gone['step']} for the audit, which the manifest does not list"), out
    m = read(honest)  # a batch the secret never drew, added
    extra = next(k for k in range(m["stream"]["batches"]) if k not in {b["step"] for b in m["audit"]["batches"]})
    m["audit"]["batches"] = sorted([*m["audit"]["batches"], {**m["audit"]["batches"][-1], "step": extra}],
                                   key=lambda b: b["step"])
    write(run_dir, m, user_key()[0])
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"].startswith(f"draws: audited batch {extra} is listed but the run_secret")


def test_another_secret_is_caught_by_the_draws_or_the_probes(honest, tmp_path, capsys):
    run_dir = copy_run(honest, tmp_path)
    m = read(run_dir)
    m["run_secret"] = "00" * 32
    write(run_dir, m, user_key()[0])
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and (out["mismatch"].startswith("draws: ") or out["mismatch"].startswith("probes: ")), out


def test_an_unsigned_manifest_is_refused(honest, tmp_path, capsys):
    run_dir = copy_run(honest, tmp_path)
    m = read(run_dir)
    del m["certificate"]
    write(run_dir, m)
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"] == "certificate: the manifest is unsigned (no certificate)"


def test_reexecution_repeats_the_run_bit_for_bit_twice(honest, capsys):
    m = read(honest)
    runs = []
    for _ in range(2):
        code, out = verify_json(honest, "--reexecute", capsys=capsys)
        assert code == 0, out
        runs.append(out["reexecuted"])
    print(f"re-executed: {runs[0]['prequential_bpb']!r} and {runs[1]['prequential_bpb']!r} bpb, the run "
          f"{m['score']['prequential_bpb']!r}")
    assert runs[0]["prequential_bpb"] == runs[1]["prequential_bpb"] == m["score"]["prequential_bpb"]
    assert runs[0]["state_sha256"] == runs[1]["state_sha256"] == m["model"]["state_sha256"]


def test_a_key_that_cannot_be_read_is_a_usage_error(honest, capsys):
    assert prism(["verify", str(honest), "--key", "nonsense"]) == 2
    assert "prism verify: --key nonsense: neither a key file nor the base64" in capsys.readouterr().err


def test_a_stored_blind_probe_the_secret_does_not_draw_is_caught(honest, tmp_path, capsys):
    import numpy as np

    run_dir = copy_run(honest, tmp_path)
    step = read(run_dir)["audit"]["batches"][1]["step"]
    npz = run_dir / "model" / "audit" / f"step-{step:06d}.npz"
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["picks_0_0"][0, 1] = arrays["picks_0_0"][0, 1] % 60 + 1  # another position, as a loop would like
    npz.chmod(0o644)
    np.savez(npz, **arrays)
    code, out = verify_json(run_dir, capsys=capsys)
    assert code == 1 and out["mismatch"] == (f"probes: audited batch {step}, rank 0, pass 0: the stored blind probe "
                                             "is not the one the run_secret draws")


def test_reexecution_on_another_device_kind_is_refused_before_anything_runs(honest, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: a CUDA run would re-execute here")
    run_dir = copy_run(honest, tmp_path)
    m = read(run_dir)
    m["compute"]["device"] = "cuda"
    write(run_dir, m, user_key()[0])
    assert prism(["verify", str(run_dir), "--reexecute"]) == 2
    captured = capsys.readouterr()
    # since issue 26 any verify of a CUDA run is refused without CUDA, --reexecute or not
    assert "the run was made on CUDA" in captured.err and "this machine has no CUDA device" in captured.err
    assert "re-scoring" not in captured.err  # refused first
