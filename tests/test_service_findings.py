"""Findings and suspension (issue 25, item 5): a run the audit caught records one finding against
its hotkey (its batch, both figures, its run), whatever the retries; an infrastructure failure or
an audit that could not run records none; the hotkey is suspended from the leaderboard, the
weights and submitting until an operator lifts it (``prism findings lift``) or the settings'
period ends; its pages say why.

The manifests are the real ``prism eval`` manifest of tests/data/scored_manifest.v2.json with an
``audit`` section and verdict built by hand (per ``results.RunManifest``), and every mismatch or
error message is made by the harness's own code (``rescore.compare_rescore``,
``rescore.compare_blind``, ``rescore._reply``, ``blindprobe.compare``,
``instrument.check_causal``), so the rule reads the words the harness really writes."""

from __future__ import annotations

import base64
import copy
import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace as NS

import httpx
import numpy as np
import pytest
import sr25519
import torch
from service_live import ALICE, ALICE_SEED, TOKEN, live_server, post, signed, zip_dir
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from helpers import EXAMPLE
from prism_challenge.cli import main
from prism_challenge.failures import EvalFailure
from prism_challenge.manifest.results import Audit, EvalResult, RunManifest, early_manifest
from prism_challenge.service import findings as fnd
from prism_challenge.service.models import Finding, utcnow
from prism_challenge.service.signing import ss58_encode
from prism_challenge.service.store import Store

SCORED = json.loads((Path(__file__).parent / "data" / "scored_manifest.v2.json").read_text())
BOB = ss58_encode(sr25519.pair_from_seed(bytes([2]) * 32)[0])
CAROL = ss58_encode(sr25519.pair_from_seed(bytes([3]) * 32)[0])
V = 16


# -- the harness's own messages ---------------------------------------------------------------
def rescore_mismatch(recorded: float, rescored: float, step: int = 7) -> dict:
    """An audit section whose batch ``step`` did not reproduce (``rescore.compare_rescore``)."""
    from prism_challenge.audit.rescore import AuditReport, compare_rescore

    pieces = {0: np.arange(16, dtype=np.int64).reshape(2, 8)}
    audits = {0: NS(recorded={0: 3.5}, sha256="aa" * 32, pieces=pieces),
              step: NS(recorded={0: recorded}, sha256="bb" * 32, pieces=pieces)}
    report = AuditReport()
    compare_rescore([NS(step=0, rank=0), NS(step=step, rank=0)], audits, [{"nats": 3.5}, {"nats": rescored}],
                    "cpu", 1, report)
    assert report.mismatch is not None
    return audit_section(report.batches, mismatch=report.mismatch)


def blind_mismatch(ref: float, got: float, step: int = 12, row: int = 1, k: int = 5) -> dict:
    """An audit section whose blind probe failed (``rescore.compare_blind``): every batch matched."""
    from prism_challenge.audit.rescore import compare_blind

    tokens = np.zeros((2, 8), dtype=np.int64)
    tokens[row, k] = 3
    job = NS(step=step, rank=0, picks=[(row, k)], tokens=tokens)
    lp = np.full(V, -10.0, dtype=np.float32)
    lp[3] = -got
    blind = [{"logprobs": [base64.b64encode(lp.tobytes()).decode()], "precision": "float32"}]
    probed, mismatch = compare_blind([job], [{"picked": [ref]}], [job], blind, V, None)
    assert probed == 1 and mismatch is not None
    batch = {"step": step, "snapshot_sha256": "cc" * 32, "inputs_sha256": "dd" * 32, "recorded_nats": [40.0],
             "rescored_nats": [40.0], "match": True}
    return audit_section([batch], mismatch=mismatch, blind=probed)


def audit_error(**child) -> dict:
    """An audit section of an audit that could not run (``rescore._reply``'s error for ``child``)."""
    from prism_challenge.audit.rescore import AuditError, _reply

    from prism_challenge.evaluator.jailchild import Finished

    done = Finished(**{"returncode": 1, "stdout": b"", "stderr": b"", "timed_out": False, "failure": None,
                       "refusal": None, **child})
    with pytest.raises(AuditError) as caught:
        _reply(done, "rescore")
    return audit_section([], error=str(caught.value))


def heldout_blind_error(full: float, seen: float) -> str:
    """``verdict.heldout_error`` of a failed held-out blind probe (``blindprobe.compare``)."""
    from prism_challenge.audit.blindprobe import BlindProbeError, compare

    batches = [np.zeros((2, 8), dtype=np.int64) for _ in range(5)]
    batches[4][0, 5] = 3
    lp = np.full(V, -10.0, dtype=np.float32)
    lp[3] = -seen
    with pytest.raises(BlindProbeError) as caught:
        compare([(4, 0, 5, None)], batches, [full], [lp.tobytes().hex()], ["float32"], V)
    return str(caught.value)


def heldout_causal_error() -> str:
    """``verdict.heldout_error`` of a model the in-process probe found not causal
    (``instrument.check_causal`` through ``heldout.submission_failure``)."""
    from prism_challenge.evaluator.instrument import ContractError, check_causal, target_logprobs
    from prism_challenge.audit.heldout import HeldoutError
    from prism_challenge.audit.heldout_child import submission_failure

    class Peek(torch.nn.Module):  # position t's logits are the next token's one-hot: it reads the future
        def forward(self, tokens):
            return torch.nn.functional.one_hot(torch.roll(tokens, -1, dims=1), V).float() * 5

    tokens = torch.arange(16).reshape(2, 8) % V
    model = Peek().eval()
    with torch.no_grad():
        logprobs = target_logprobs(model(tokens), tokens, V)
        with pytest.raises(ContractError) as caught:
            check_causal(model, tokens, logprobs, V, 4, 1)
    return str(submission_failure(caught.value, "score", HeldoutError))


def audit_section(batches: list, *, mismatch: str | None = None, error: str | None = None, blind: int = 0) -> dict:
    a = {"audited_batches_target": 20, "rate": 0.25, "expected_batches": 2, "rtol": 1e-6, "shape": [2, 8],
         "context": {"seq_len": 8}, "batches": batches, "blind_probes": blind, "probe_skipped": None,
         "mismatch": mismatch, "error": error, "passed": mismatch is None and error is None, "wall_s": 1.5}
    if "schedule" in Audit.model_fields:  # issue 25's harmonic schedule, once merged
        a["schedule"] = {"rule": "harmonic", "audited_batches": 20}
    return a


def manifest(*, audit: dict | None = None, flags: tuple[str, ...] = (), heldout_error: str | None = None) -> dict:
    """The fixture's scored manifest with ``audit``, more verdict ``flags`` (a zeroing flag zeroes
    the score) and ``heldout_error``."""
    m = copy.deepcopy(SCORED)
    v = m["verdict"]
    v["flags"] = [*v["flags"], *flags]
    v["heldout_error"] = heldout_error
    if {"audit", "heldout_contract", "anomaly"} & set(flags):
        v["anti_cheat_multiplier"], v["final_score"] = 0.0, 0.0
    m["audit"] = audit
    if "run_secret" in RunManifest.model_fields and "run_secret" not in m:
        m["run_secret"] = "ab" * 32
    return m


def result(m: dict) -> EvalResult:
    rm = RunManifest.model_validate(m)
    return EvalResult(status="scored", kind=None, failure=None, run_dir="/runs/x", manifest_path="/runs/x/m.json",
                      manifest=rm)


def failed(stage: str) -> EvalResult:
    f = EvalFailure(stage, f"{stage} went wrong").to_dict()
    m = early_manifest(f, bundle_path="/b", seed=1, findings=[], profile=None, version="0.1.0")
    return EvalResult(status=m.status, kind=f["kind"], failure=m.failure, run_dir=None, manifest_path=None, manifest=m)


def caught() -> dict:
    return manifest(audit=rescore_mismatch(41.25, 44.0625), flags=("audit",))


# -- the rule -------------------------------------------------------------------------------
def test_each_proven_cheat_is_a_finding_with_its_batch_and_figures():
    got = fnd.finding_of(caught())
    assert (got.kind, got.step, got.rank, got.row, got.recorded_nats, got.rescored_nats) == (
        "rescore", 7, 0, None, 41.25, 44.0625)
    assert got.message.startswith("audited batch 7: recorded 41.25 nats, re-scored 44.0625 nats")
    got = fnd.finding_of(manifest(audit=blind_mismatch(2.5, 0.125), flags=("audit",)))
    assert (got.kind, got.step, got.rank, got.row, got.recorded_nats, got.rescored_nats) == (
        "blind_probe", 12, 0, 1, 2.5, 0.125)
    got = fnd.finding_of(manifest(audit=audit_section([]), flags=("heldout_contract",),
                                  heldout_error=heldout_blind_error(3.25, 1.5)))
    assert (got.kind, got.step, got.row, got.recorded_nats, got.rescored_nats) == (
        "heldout_blind_probe", 4, 0, 3.25, 1.5)
    got = fnd.finding_of(manifest(flags=("heldout_contract",), heldout_error=heldout_causal_error()))
    assert (got.kind, got.step, got.recorded_nats, got.rescored_nats) == ("heldout_causality", None, None, None)
    assert "not causal" in got.message


@pytest.mark.parametrize("why", ["timeout", "refusal", "crash", "no-snapshot", "bad-logits", "anomaly", "no-flag",
                                 "failed"])
def test_what_never_counts(why):
    if why == "timeout":  # the audit could not run: never a finding
        m = manifest(audit=audit_error(timed_out=True), flags=("audit",))
    elif why == "refusal":  # one audit-hook refusal zeroes the run but proves no cheat (twice: test_audit_refusal)
        m = manifest(audit=audit_error(refusal="open", failure="audit: open('/data') refused"), flags=("audit",))
    elif why == "crash":
        m = manifest(audit=audit_error(failure="crash: signal 9"), flags=("audit",))
    elif why == "no-snapshot":
        m = manifest(audit=audit_section([], error="audited batch 3: its weight snapshot never arrived"),
                     flags=("audit",))
    elif why == "bad-logits":  # a held-out contract error that is not a causality probe's
        m = manifest(flags=("heldout_contract",), heldout_error="contract: model(tokens) returned tuple, expected "
                     "logits: a plain float torch.Tensor [B=2, T=8, V'>=16]")
    elif why == "anomaly":  # a statistical flag, not a proof
        m = manifest(audit=audit_section([]), flags=("anomaly",))
    elif why == "no-flag":  # a mismatch the verdict was not zeroed for is no proof of the harness
        m = manifest(audit=rescore_mismatch(1.0, 2.0))
    else:
        m = failed("data").manifest.to_json_dict()
    if why != "failed":
        RunManifest.model_validate(m)
    assert m.get("audit") is None or m["audit"]["mismatch"] is None or why == "no-flag"
    assert fnd.finding_of(m) is None


# -- the store ------------------------------------------------------------------------------
@pytest.fixture
def store(db_url):
    s = Store(db_url)
    yield s
    s.close()


def _count(store: Store) -> int:
    with store.sessions() as s:
        return s.scalar(select(func.count()).select_from(Finding))


def test_a_caught_run_records_one_finding_with_its_figures(store):
    sid = store.submit(BOB, "ab" * 32)
    claim = store.claim(sid)
    before = utcnow()
    assert store.record(claim.token, result(caught())).reason == "written"
    assert store.record(claim.token, result(caught())).reason == "duplicate"  # the dispatcher writes again
    rows = fnd.findings(store)
    assert len(rows) == 1
    f = rows[0]
    run = store.result_of(sid)
    assert (f.hotkey, f.submission_id, f.attempt_id, f.run_id, f.kind, f.step) == (
        BOB, sid, claim.attempt_id, run.id, "rescore", 7)
    assert (f.recorded_nats, f.rescored_nats, f.lifted_at) == (41.25, 44.0625, None)
    assert f.message == run.manifest["audit"]["mismatch"] and before <= f.created_at <= utcnow()
    assert store.submission(sid).status == "completed" and run.final_score == 0.0
    with pytest.raises(IntegrityError), store.sessions.begin() as s:  # the database refuses a second one
        s.add(Finding(hotkey=BOB, submission_id=sid, attempt_id=claim.attempt_id, run_id=run.id, kind="rescore",
                      message="again", created_at=utcnow()))


def test_a_retried_and_reconciled_run_still_has_one_finding(store):
    sid = store.submit(BOB, "ab" * 32, max_attempts=3)
    first = store.claim(sid)
    # the reconcile found attempt 1's actor gone: recorded as an infrastructure failure, retried
    assert store.record(first.token, failed("dispatch")).status == "pending"
    assert _count(store) == 0
    with store.sessions.begin() as s:  # the backoff over
        from prism_challenge.service.models import Submission

        s.get(Submission, sid).not_before = None
    second = store.claim(sid)
    assert store.record(second.token, result(caught())).written
    assert store.record(first.token, result(caught())).reason == "superseded"  # the lost actor reports late
    assert store.record(second.token, result(caught())).reason == "duplicate"
    rows = fnd.findings(store)
    assert [(f.submission_id, f.attempt_id) for f in rows] == [(sid, second.attempt_id)]


def test_an_infrastructure_failure_or_an_audit_that_could_not_run_records_none(store):
    sid = store.submit(BOB, "ab" * 32, max_attempts=2)
    for _ in range(2):
        claim = store.claim(sid)
        store.finish(claim.attempt_id, failed("data"))
        with store.sessions.begin() as s:
            from prism_challenge.service.models import Submission

            s.get(Submission, sid).not_before = None
    assert store.submission(sid).status == "failed"
    other = store.submit(BOB, "cd" * 32)
    store.finish(store.claim(other).attempt_id, result(manifest(audit=audit_error(timed_out=True), flags=("audit",))))
    assert store.submission(other).status == "completed" and store.result_of(other).final_score == 0.0
    assert _count(store) == 0
    assert not fnd.suspension(store, BOB, utcnow(), None).suspended


def test_suspension_ends_after_its_period_or_when_lifted(store):
    sid = store.submit(BOB, "ab" * 32)
    store.finish(store.claim(sid).attempt_id, result(caught()))
    t0 = fnd.findings(store)[0].created_at
    s = fnd.suspension(store, BOB, t0 + timedelta(seconds=3599), 3600.0)
    assert s.suspended and s.until == t0 + timedelta(seconds=3600)
    assert not fnd.suspension(store, BOB, t0 + timedelta(seconds=3600), 3600.0).suspended
    forever = fnd.suspension(store, BOB, t0 + timedelta(days=3650), None)
    assert forever.suspended and forever.until is None
    assert fnd.suspended_hotkeys(store, t0, None) == {BOB}
    assert fnd.lift(store, BOB, by="op@host", reason="appeal upheld", now=t0 + timedelta(seconds=5)) == 1
    assert fnd.suspended_hotkeys(store, t0 + timedelta(seconds=6), None) == frozenset()
    f = fnd.findings(store, BOB)[0]  # kept, marked
    assert (f.lifted_by, f.lift_reason, f.lifted_at) == ("op@host", "appeal upheld", t0 + timedelta(seconds=5))
    assert fnd.lift(store, BOB, by="op@host", reason=None, now=t0) == 0


def test_the_standing_counts_runs_submitted_after_the_finding_only():
    t = utcnow()
    st = fnd.Standing(frozenset({ALICE}), {ALICE: t, BOB: t})
    assert not st.counts(ALICE, t + timedelta(days=1))  # suspended: nothing counts
    assert not st.counts(BOB, t) and not st.counts(BOB, t - timedelta(seconds=1))  # made before it was caught
    assert st.counts(BOB, t + timedelta(microseconds=1)) and st.counts(CAROL, t)


# -- the service ----------------------------------------------------------------------------
def _scored(store: Store, hotkey: str, m: dict, family: str) -> int:
    sid = store.submit(hotkey, f"{len(family):064x}", family_sha256=family * 64, profile="local")
    store.finish(store.claim(sid).attempt_id, result(m))
    return sid


def _bpb(m: dict, bpb: float) -> dict:
    m["verdict"]["prequential_bpb"] = m["score"]["prequential_bpb"] = bpb
    if m["verdict"]["final_score"]:
        m["verdict"]["final_score"] = 1.0 / (1.0 + bpb)
    return m


def _board(base: str) -> list[tuple[str, int]]:
    return [(e["hotkey"], e["submission_id"]) for e in httpx.get(f"{base}/v1/leaderboard").json()["entries"]]


def _weights(base: str) -> dict:
    return httpx.get(f"{base}/internal/v1/weights", headers={"Authorization": f"Bearer {TOKEN}"}).json()["weights"]


def _bundle(tmp_path: Path, lr: str) -> bytes:
    import shutil

    root = tmp_path / f"b{lr}"
    shutil.copytree(EXAMPLE, root)
    t = root / "training.py"
    t.write_text(t.read_text() + f"\nLR_TAG = {lr}\n")
    return zip_dir(root, "mybundle")


def test_a_suspended_hotkey_leaves_the_board_and_weights_gets_403_and_lifting_restores_it(db_url, tmp_path, capsys):
    with live_server(tmp_path, database_url=db_url, rate_limit=3) as (base, app):  # 2 rows of alice: 1 more
        store = app.state.store
        honest = _scored(store, ALICE, _bpb(manifest(), 2.0), "a")
        cheat = _scored(store, ALICE, _bpb(caught(), 0.5), "b")  # alice's bundle tuned to escape, caught once
        carol = _scored(store, CAROL, _bpb(manifest(), 2.5), "c")
        assert _board(base) == [(CAROL, carol)] and _weights(base) == {CAROL: 1.0}
        hk = httpx.get(f"{base}/v1/hotkeys/{ALICE}").json()
        f = hk["findings"][0]
        assert (hk["suspended"], hk["until"], len(hk["findings"])) == (True, None, 1)
        assert (f["submission_id"], f["kind"], f["step"], f["recorded_nats"], f["rescored_nats"], f["active"]) == (
            cheat, "rescore", 7, 41.25, 44.0625, True)
        view = httpx.get(f"{base}/v1/submissions/{cheat}").json()
        assert view["finding"]["id"] == f["id"]
        assert httpx.get(f"{base}/v1/submissions/{honest}").json()["finding"] is None
        for page in (f"/hotkeys/{ALICE}", f"/submissions/{cheat}", f"/submissions/{honest}"):
            html = httpx.get(base + page).text
            assert "suspended" in html.lower() and "batch 7" in html and "44.0625" in html
            assert f"run {f['run_id']}" in html
        assert ALICE not in httpx.get(base + "/").text
        body = _bundle(tmp_path, "1")
        for _ in range(2):  # refused, and not counted against the rate limit of 1
            r = post(base, body, signed(body, ALICE_SEED))
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["rule"], err["suspended_until"]) == (
                403, "suspended", "prism:suspended", None)
            assert f"finding {f['id']} (rescore) on submission {cheat}" in err["message"]
            assert "until an operator lifts it" in err["message"] and err["finding"]["step"] == 7
        gateway = {"Authorization": f"Bearer {TOKEN}", "X-Verified-Hotkey": ALICE}
        assert post(base, body, gateway, "/internal/v1/submissions").status_code == 403

        assert main(["findings", "lift", ALICE, "--database-url", db_url, "--reason", "false positive",
                     "--by", "ops"]) == 0
        assert "lifted 1 finding against" in capsys.readouterr().out
        # restored: the caught run is zeroed and ranks last, the honest run earns the weight
        assert _board(base) == [(ALICE, honest), (CAROL, carol)]
        assert _weights(base) == {ALICE: 1.0}
        r = post(base, body, signed(body, ALICE_SEED))
        assert r.status_code == 202, r.text
        hk = httpx.get(f"{base}/v1/hotkeys/{ALICE}").json()
        assert hk["suspended"] is False and hk["findings"][0]["lifted_by"] == "ops"
        assert "lifted" in httpx.get(f"{base}/hotkeys/{ALICE}").text


def test_a_timed_suspension_expires_on_the_injected_clock_and_the_runs_before_it_stay_out(tmp_path):
    with live_server(tmp_path, suspension_s=3600.0) as (base, app):
        store = app.state.store
        sid = _scored(store, BOB, _bpb(caught(), 0.5), "a")
        carol = _scored(store, CAROL, _bpb(manifest(), 2.0), "c")
        t0 = fnd.findings(store)[0].created_at
        app.state.clock = lambda: t0 + timedelta(seconds=3599)
        hk = httpx.get(f"{base}/v1/hotkeys/{BOB}").json()
        assert hk["suspended"] and hk["until"] == (t0 + timedelta(seconds=3600)).isoformat()
        assert [h for h, _ in _board(base)] == [CAROL]
        app.state.clock = lambda: t0 + timedelta(seconds=3600)
        assert httpx.get(f"{base}/v1/hotkeys/{BOB}").json()["suspended"] is False
        # no longer suspended, but its runs submitted before the finding stay out; a new one counts
        assert _board(base) == [(CAROL, carol)] and _weights(base) == {CAROL: 1.0}
        later = _scored(store, BOB, _bpb(manifest(), 1.0), "b")
        assert _board(base) == [(BOB, later), (CAROL, carol)] and _weights(base) == {BOB: 1.0}
        assert sid not in [s for _, s in _board(base)]


def test_a_suspended_family_author_is_paid_nothing():
    from prism_challenge.service.queries import Entry
    from prism_challenge.service.weights import leaderboard, weights

    def entry(i, hotkey, bpb, variant_of=None):
        return Entry(id=i, hotkey=hotkey, submitted_at=utcnow(), prequential_bpb=bpb, heldout_delta=0.1,
                     final_score=1 / (1 + bpb), anti_cheat_multiplier=1.0, memorization_penalty=1.0, flags=(),
                     family_sha256="f" * 64, variant_of=variant_of)

    entries = [entry(1, ALICE, 2.0), entry(2, BOB, 1.0, variant_of=1), entry(3, CAROL, 1.5)]
    owners = {1: ALICE, 2: BOB, 3: CAROL}
    assert weights(entries, "family-split", owner_of=owners.get) == {ALICE: 0.6, BOB: 0.4}
    assert weights(entries, "family-split", owner_of=owners.get, excluded=frozenset({ALICE})) == {BOB: 1.0}
    assert weights(entries, "family-split", owner_of=owners.get, excluded=frozenset({BOB})) == {CAROL: 1.0}
    assert [e.hotkey for e in leaderboard(entries, excluded=frozenset({BOB}))] == [CAROL, ALICE]


# -- the operator's commands ----------------------------------------------------------------
def test_prism_findings_lists_and_lifts(db_url, capsys, monkeypatch):
    store = Store(db_url)
    try:
        cheat = store.submit(BOB, "ab" * 32)
        store.finish(store.claim(cheat).attempt_id, result(caught()))
        probe = store.submit(CAROL, "cd" * 32)
        store.finish(store.claim(probe).attempt_id, result(manifest(audit=blind_mismatch(2.5, 0.125),
                                                                    flags=("audit",))))
    finally:
        store.close()
    monkeypatch.setenv("PRISM_DATABASE_URL", db_url)  # the settings of prism serve
    assert main(["findings", "list", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(v["hotkey"], v["submission_id"], v["kind"], v["step"], v["recorded_nats"], v["rescored_nats"],
             v["active"]) for v in got] == [(CAROL, probe, "blind_probe", 12, 2.5, 0.125, True),
                                            (BOB, cheat, "rescore", 7, 41.25, 44.0625, True)]
    assert main(["findings", "list", "--hotkey", BOB]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and BOB in out[0] and "rescore" in out[0] and "batch 7" in out[0] and "[suspends]" in out[0]
    assert main(["findings", "lift", BOB, "--reason", "reviewed"]) == 0
    capsys.readouterr()
    assert main(["findings", "lift", BOB]) == 1  # nothing left to lift
    assert "no finding to lift" in capsys.readouterr().err
    assert main(["findings", "list", "--hotkey", BOB, "--json"]) == 0
    lifted = json.loads(capsys.readouterr().out)[0]
    assert lifted["lift_reason"] == "reviewed" and lifted["lifted_by"] and lifted["active"] is False
    monkeypatch.delenv("PRISM_DATABASE_URL")
    assert main(["findings", "list", "--database-url", "sqlite:////nonexistent/prism.sqlite3"]) == 2
    assert "no database" in capsys.readouterr().err


def test_migration_0004_keeps_the_rows_of_0003(tmp_path):
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine, text

    from prism_challenge.service.store import MIGRATIONS

    db = tmp_path / "old.sqlite3"
    engine = create_engine(f"sqlite:///{db}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0003")
        t = "'2026-01-01 00:00:00'"
        connection.execute(text(f"INSERT INTO submitters VALUES (1, 'hk', {t})"))
        connection.execute(text("INSERT INTO submissions (id, submitter_id, bundle_sha256, status, attempts, "
                                "max_attempts, created_at, updated_at) "
                                f"VALUES (1, 1, 'x', 'completed', 1, 3, {t}, {t})"))
        connection.execute(text(f"INSERT INTO attempts (id, submission_id, number, started_at, outcome) "
                                f"VALUES (1, 1, 1, {t}, 'completed')"))
        connection.execute(text("INSERT INTO runs (id, attempt_id, submission_id, status, manifest, created_at) "
                                f"VALUES (1, 1, 1, 'scored', :m, {t})"), {"m": json.dumps(caught())})
    engine.dispose()
    store = Store(f"sqlite:///{db}")
    try:
        assert store.result_of(1).attempt_id == 1 and _count(store) == 0  # no finding made retroactively
        with store.engine.connect() as c:
            assert c.execute(text("SELECT version_num FROM alembic_version")).all() == [("0006",)]
    finally:
        store.close()
