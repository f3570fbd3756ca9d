"""Red team, issue 25: a cheat that refuses its own audit.

A bundle can tell the live model from one the audit rebuilds from a snapshot (a plain attribute
its loop sets is not in the ``state_dict``), and a buffer tells it whether the snapshot's batch
was peeked. Raising there (tests/rescore_bundles/refuse_switch), or ending the child with a
``BaseException`` subclass (refuse_base; allow-listed, and the child caught ``Exception`` only),
turned a caught peek into ``audit.error``: the run was zeroed, and the service recorded no
finding, so the hotkey could draw again at once. Measured before the fix (12k tokens, CPU):
``audit.error = "score: RuntimeError: not here"`` (and ``"crash: no result ..."`` for the
BaseException), flags ``["audit"]``, ``finding_of(manifest) is None``.

Now a failure of the submission's doing is tried once more, one snapshot per fresh process, and
a second failure is ``audit.error = "refused: ..."``: the finding ``audit_refused``. A timeout
first is tried again too, one snapshot per child under its own limit: a child past it hung of
its own doing (``hang: ...``, a refusal); a retry that only runs out of time is no finding, nor is
a harness step.
"""
from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from prism_challenge.audit import rescore
from prism_challenge.evaluator.jailchild import Finished
from prism_challenge.audit.heldout_wire import _read_frame
from prism_challenge.pipeline import EvalOptions, evaluate
from prism_challenge.service.findings import finding_of

sys.path.insert(0, str(Path(__file__).parent / "rescore_bundles"))
from assemble import bundle  # noqa: E402


def ok(count: int) -> Finished:
    body = json.dumps({"ok": True, "jobs": [{"nats": 1.0, "picked": []}] * count})
    return Finished(0, body.encode(), b"", False, None, None)


def fails(error: str) -> Finished:
    return Finished(1, json.dumps({"ok": False, "error": error}).encode(), b"", False, "exit 1", None)


CRASH = Finished(1, b"", b"architecture.Refusal: not here", False, "exit 1", None)
TIMEOUT = Finished(-9, b"", b"", True, "timeout", None)


class ScriptedJail:
    """Answers each fed child with the next scripted outcome (``"ok"``: a reply for its jobs);
    records each child's mode, snapshot indices (the child's own: 0..n-1) and job count."""

    def __init__(self, *script):
        self.script, self.fed = list(script), []

    def run(self, argv, input, timeout_s, writable, warm_next=False):
        config = json.loads(_read_frame(io.BytesIO(input if isinstance(input, bytes) else b"".join(input))))
        self.fed.append((config["mode"], sorted({j["state"] for j in config["jobs"]}), len(config["jobs"])))
        outcome = self.script.pop(0) if self.script else "ok"
        return ok(len(config["jobs"])) if outcome == "ok" else outcome

    def drop_spare(self, argv, writable):
        pass


def attempt(tmp_path, jail):
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"snap{i}.pt")
        paths[-1].write_bytes(b"x" * 100)
    tokens = np.zeros((2, 8), dtype=np.int64)
    jobs = [rescore.Job(i, 0, i, tokens, []) for i in range(3)]
    art = tmp_path / "artifacts"  # emptied before each child
    art.mkdir(exist_ok=True)
    return rescore._run_or_retry(jail, {"seed": 1}, jobs, [], paths, time.monotonic() + 60, 60.0, str(art))


def test_the_submissions_own_failure_twice_is_a_refusal(tmp_path):
    jail = ScriptedJail(fails("score: RuntimeError: not here"), fails("score: RuntimeError: not here"))
    with pytest.raises(rescore.AuditError) as caught:
        attempt(tmp_path, jail)
    assert str(caught.value) == ("refused: score: RuntimeError: not here; again, one snapshot per fresh process: "
                                 "score: RuntimeError: not here")
    # the first try: one child for all three snapshots; the second: a child per snapshot (the first failed)
    assert jail.fed == [("rescore", [0, 1, 2], 3), ("rescore", [0], 1)]


def test_a_crash_then_a_hang_is_a_refusal_and_a_failure_once_is_not(tmp_path):
    with pytest.raises(rescore.AuditError, match=r"(?s)^refused: exit 1 in the rescore process.*again.*timeout: "):
        attempt(tmp_path, ScriptedJail(CRASH, TIMEOUT))
    jail = ScriptedJail(fails("build: ValueError: flaky"))  # then every child answers
    rescored, blind = attempt(tmp_path, jail)
    assert len(rescored) == 3 and blind is None
    assert [(f[1], f[2]) for f in jail.fed] == [([0, 1, 2], 3), ([0], 1), ([0], 1), ([0], 1)]  # one snapshot each


@pytest.mark.parametrize("first", [TIMEOUT, fails("setup: OSError: cgroup gone"), fails("memory: out of memory"),
                                   fails("protocol: malformed")], ids=["timeout", "setup", "memory", "protocol"])
def test_a_harness_side_failure_is_not_retried_and_never_a_refusal(tmp_path, first):
    jail = ScriptedJail(first, fails("score: RuntimeError: again"))
    with pytest.raises(rescore.AuditError) as caught:
        attempt(tmp_path, jail)
    assert not str(caught.value).startswith(rescore.REFUSED) and len(jail.fed) == 1


def test_a_refusal_is_the_finding_audit_refused_and_a_plain_audit_error_is_none():
    from test_service_findings import audit_section, manifest

    error = "refused: score: RuntimeError: not here; again, one snapshot per fresh process: score: RuntimeError: x"
    facts = finding_of(manifest(audit=audit_section([], error=error), flags=("audit",)))
    assert facts is not None and (facts.kind, facts.step, facts.message) == ("audit_refused", None, error)
    assert finding_of(manifest(audit=audit_section([], error="score: RuntimeError: x"), flags=("audit",))) is None


def run(tmp_path, name):
    return evaluate(EvalOptions(bundle=str(bundle(name, tmp_path)), out_dir=str(tmp_path / "run"),
                                token_budget=12_000, heldout_bytes=20_000, device="cpu", threads=1))


@pytest.mark.slow
@pytest.mark.parametrize("name, error", [("refuse_switch", "score: RuntimeError: not here"),
                                         ("refuse_base", "score: Refusal: not here")])
def test_a_peek_that_refuses_its_audit_is_a_finding(tmp_path, name, error):
    outcome = run(tmp_path, name)
    assert outcome.failure is None, outcome.failure
    audit, verdict = outcome.manifest["audit"], outcome.manifest["verdict"]
    assert verdict["final_score"] == 0.0 and "audit" in verdict["flags"] and audit["mismatch"] is None
    assert audit["error"] == f"refused: {error}; again, one snapshot per fresh process: {error}"
    facts = finding_of(outcome.manifest)
    assert facts is not None and facts.kind == "audit_refused"


def test_a_refusal_is_named_even_beside_a_snapshot_that_never_arrived(tmp_path):
    from prism_challenge.evaluator.snapshots import AuditedStep

    snap = tmp_path / "snap.pt"
    snap.write_bytes(b"x" * 100)
    tokens = np.zeros((2, 8), dtype=np.int64)
    audits = {0: AuditedStep(0, {0: tokens}, {0: 1.0}, snap, "aa" * 32),
              9: AuditedStep(9, {0: tokens}, {0: 1.0}, None, None)}  # a loop that stalled after batch 9
    art = tmp_path / "artifacts"
    art.mkdir()
    jail = ScriptedJail(fails("score: RuntimeError: not here"), fails("score: RuntimeError: not here"))
    report = rescore.run_audit({"seed": 1, "vocab_size": 16}, audits, jail=jail, world_size=1, filler=None,
                               key=b"k" * 32, timeout_s=60, artifacts_dir=str(art))
    assert report.error.startswith("refused: score: RuntimeError: not here; again")
    assert finding_of({"status": "scored", "verdict": {"flags": ["audit"]}, "audit": report.to_dict()}).kind == (
        "audit_refused")


DRAWS_9 = bytes.fromhex("c311316627e8e470a4f71d1eec82e8a432fa1dc2e200cd36e68464a66bec42d4")  # batch 9 audited


@pytest.mark.slow
def test_a_peek_on_the_last_batch_then_a_stall_is_caught(tmp_path):
    """The answer to a record rode on the next BATCH frame, which rank 0 read only when the loop
    asked again: a loop that peeked on its last batch and then never asked (stopped as stalled,
    and scored) kept that batch's snapshot from the audit. Measured before the fix, with batch 9
    drawn: 10 batches scored, ``audit.error = "audited batch 9: its weight snapshot never
    arrived"``, no finding (and, batch 9 not drawn, the peek scored). Now the answer comes at
    once, in a frame of its own, and the snapshot leaves before the loop gets the batch."""
    from prism_challenge.evaluator.auditplan import is_audited

    assert is_audited(DRAWS_9, 9)
    outcome = evaluate(EvalOptions(bundle=str(bundle("stall_last", tmp_path)), out_dir=str(tmp_path / "run"),
                                   token_budget=12_000, heldout_bytes=20_000, device="cpu", threads=1,
                                   idle_timeout=20, run_secret=DRAWS_9))  # a margin for a busy machine
    assert outcome.failure is None, outcome.failure
    m = outcome.manifest
    audit = m["audit"]
    assert m["stream"]["batches"] == 10 and m["stream"]["stop_reason"] == "stalled"
    assert audit["error"] is None and [b["step"] for b in audit["batches"]][-1] == 9
    # the peek's switch is a plain attribute: the re-scoring from the snapshot does not peek
    assert [b["step"] for b in audit["batches"] if not b["match"]] == [9]
    assert audit["mismatch"].startswith("audited batch 9: recorded ")
    assert m["verdict"]["final_score"] == 0.0 and finding_of(m).kind == "rescore"


class TimedJail(ScriptedJail):
    """A :class:`ScriptedJail` that also records each child's time limit."""

    def __init__(self, *script):
        super().__init__(*script)
        self.limits: list[float] = []

    def run(self, argv, input, timeout_s, writable, warm_next=False):
        self.limits.append(timeout_s)
        return super().run(argv, input, timeout_s, writable, warm_next)


def test_a_timeout_then_a_child_past_its_own_limit_is_a_hang_refusal(tmp_path):
    """A loop that busy-waits only where it is re-scored: the first try times out, the retry's
    child of one snapshot runs past its own limit, 60 s + 20 x 0.5 s per job (one job here)."""
    jail = TimedJail(TIMEOUT, TIMEOUT)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"snap{i}.pt")
        paths[-1].write_bytes(b"x" * 100)
    jobs = [rescore.Job(i, 0, i, np.zeros((2, 8), dtype=np.int64), []) for i in range(3)]
    (tmp_path / "art").mkdir()
    with pytest.raises(rescore.AuditError) as caught:
        rescore._run_or_retry(jail, {"seed": 1}, jobs, [], paths, time.monotonic() + 60, 60.0, str(tmp_path / "art"),
                              batch_s=0.5)
    assert str(caught.value).startswith("refused: timeout: the rescore process ran past the audit's time limit; "
                                        "again, one snapshot per fresh process: hang: the rescore process of one "
                                        "snapshot (1 job(s)) ran past its own limit of 70 s")
    assert jail.limits[1] == 70.0  # the retry's first child: its own limit, below the retry's deadline (140 s)
    assert finding_of_refusal(str(caught.value)) == "audit_refused"


def finding_of_refusal(error: str) -> str | None:
    from test_service_findings import audit_section, manifest

    facts = finding_of(manifest(audit=audit_section([], error=error), flags=("audit",)))
    return facts.kind if facts is not None else None


def test_a_timeout_whose_retry_only_runs_out_of_time_stays_a_plain_timeout(tmp_path, monkeypatch):
    """An honest model too slow for the audit's limit: no child past its own limit, the whole
    retry past its deadline: the first timeout is the error (it zeroes the run, proves nothing)."""
    calls = []

    def slow(*args, **kw):
        calls.append(kw.get("child_limit"))
        raise rescore.AuditError("timeout: the rescore process ran past the audit's time limit")

    monkeypatch.setattr(rescore, "run_both", slow)
    with pytest.raises(rescore.AuditError) as caught:
        attempt_with(tmp_path, batch_s=2.0)
    assert str(caught.value) == "timeout: the rescore process ran past the audit's time limit"
    assert calls[0] is None and calls[1](1) == 60.0 + 20 * 2.0 and calls[1](2) == 60.0 + 20 * 2.0 * 2
    assert finding_of_refusal(str(caught.value)) is None


def attempt_with(tmp_path, batch_s):
    paths = [tmp_path / "snap0.pt"]
    paths[0].write_bytes(b"x")
    jobs = [rescore.Job(0, 0, 0, np.zeros((2, 8), dtype=np.int64), [])]
    (tmp_path / "art").mkdir(exist_ok=True)
    return rescore._run_or_retry(None, {"seed": 1}, jobs, [], paths, time.monotonic() + 60, 60.0,
                                 str(tmp_path / "art"), batch_s=batch_s)


def test_the_runs_own_seconds_per_batch():
    from types import SimpleNamespace

    from prism_challenge.audit.auditstage import seconds_per_batch

    assert seconds_per_batch(SimpleNamespace(steps=[0] * 5, first_batch_at=10.0, last_record_at=18.0)) == 2.0
    assert seconds_per_batch(SimpleNamespace(steps=[0], first_batch_at=10.0, last_record_at=18.0)) is None


@pytest.mark.slow
def test_a_peek_that_hangs_where_it_is_re_scored_is_a_finding(tmp_path):
    """refuse_hang spins for ever in the audit's child instead of raising: the first try times out
    (the audit's limit, 30 s here), the retry's child of the peeked snapshot runs past its own
    limit, and the run's audit error is the refusal the service records as ``audit_refused``."""
    outcome = evaluate(EvalOptions(bundle=str(bundle("refuse_hang", tmp_path)), out_dir=str(tmp_path / "run"),
                                   token_budget=12_000, heldout_bytes=20_000, device="cpu", threads=1,
                                   heldout_timeout=30.0))
    assert outcome.failure is None, outcome.failure
    audit, verdict = outcome.manifest["audit"], outcome.manifest["verdict"]
    assert verdict["final_score"] == 0.0 and "audit" in verdict["flags"] and audit["mismatch"] is None
    assert audit["error"].startswith("refused: timeout: the rescore process ran past the audit's time limit; again, "
                                     "one snapshot per fresh process: hang: the rescore process of one snapshot")
    assert finding_of(outcome.manifest).kind == "audit_refused"
