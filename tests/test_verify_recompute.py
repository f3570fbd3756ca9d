"""``prism verify``'s recomputations on hand-built manifests (no run): the verdict under the policy
the manifest records and with the loop's early stop, and the audit draws from the revealed secret.

Each manifest starts from tests/data/scored_manifest.v2.json with its verdict rebuilt by
:func:`prism_challenge.score.verdict.build_verdict` under a known policy: the independent path the
recomputation must agree with, and disagree with once a field is edited."""

from __future__ import annotations

import dataclasses
import math
import json
from pathlib import Path

import pytest

from prism_challenge.evaluator.auditplan import drawn_steps
from prism_challenge.profiles import load_profile
from prism_challenge.score.verdict import Policy, build_verdict
from prism_challenge.manifest.verify_recompute import Mismatch, check_draws, check_verdict, policy_of

FIXTURE = Path(__file__).parent / "data" / "scored_manifest.v2.json"
SECRET = bytes(range(32))


def manifest(*, stop_reason: str = "token_budget", policy: Policy = Policy(), record: bool = True,
             tokens: int = 4000) -> dict:
    """The fixture, with no profile, ``stop_reason``, ``tokens`` of its 4000-token budget, and its
    verdict built under ``policy`` (recorded in ``config.policy`` when ``record``)."""
    m = json.loads(FIXTURE.read_text())
    m["profile"] = None
    m["stream"]["stop_reason"] = stop_reason
    m["stream"]["tokens"] = tokens
    assert m["budgets"]["token_budget"] == 4000
    m["config"]["policy"] = dataclasses.asdict(policy) if record else None
    v = build_verdict(m["score"]["prequential_bpb"], m["curve"], m["tokenizer"]["vocab_size"],
                      m["verdict"]["heldout"], policy=policy, stop_reason=stop_reason, covered=tokens / 4000)
    m["verdict"] = v.to_dict()
    return m


def test_a_loop_stopped_run_recomputes_with_its_flag_and_an_edit_of_it_is_named():
    m = manifest(stop_reason="loop_stopped")
    assert "loop_stopped" in m["verdict"]["flags"]
    policy, _ = policy_of(m)
    check_verdict(m, policy)
    m["verdict"]["flags"] = [f for f in m["verdict"]["flags"] if f != "loop_stopped"]
    with pytest.raises(Mismatch, match=r"^verdict\.flags"):
        check_verdict(m, policy)


def test_a_short_run_recomputes_with_its_flag_from_the_stream_and_the_budget():
    m = manifest(stop_reason="loop_stopped", tokens=3000)  # 75 % of the budget: short
    assert m["verdict"]["flags"][-2:] == ["loop_stopped", "short"]
    policy, _ = policy_of(m)
    check_verdict(m, policy)
    assert "short" not in manifest(stop_reason="loop_stopped", tokens=3990)["verdict"]["flags"]  # 99.75 %
    m["stream"]["tokens"] = 3990  # an edited count no longer gives "short"
    with pytest.raises(Mismatch, match=r"^verdict\.flags is \[.*'short'\] in the manifest"):
        check_verdict(m, policy)


def test_a_manifest_recording_the_old_rank_epsilon_reads_as_the_policy_without_it():
    m = manifest()
    m["config"]["policy"] = {k: v for k, v in m["config"]["policy"].items() if k != "significance_p"}
    m["config"]["policy"]["rank_epsilon_bpb"] = 0.01  # before issue 29
    policy, source = policy_of(m)
    assert policy == Policy() and "records" in source
    check_verdict(m, policy)


def test_the_recorded_policy_is_the_one_recomputed_and_without_it_the_default_disagrees():
    custom = Policy(tail_fraction=0.5)
    m = manifest(policy=custom)
    policy, source = policy_of(m)
    assert policy == custom and "records" in source
    check_verdict(m, policy)
    m["config"]["policy"] = None  # a manifest that records none is judged under the default
    policy, source = policy_of(m)
    assert policy == Policy() and "default" in source
    with pytest.raises(Mismatch, match=r"^verdict\.(memorization_gap|tail_bpb) is"):
        check_verdict(m, policy)


def test_a_recorded_policy_other_than_the_profiles_is_a_mismatch():
    p = load_profile("local")
    m = manifest(policy=Policy(tail_fraction=0.5))
    m["profile"] = {"name": p.name, "version": p.version, "sha256": p.sha256, "overridden": []}
    with pytest.raises(Mismatch, match="records the policy"):
        policy_of(m)
    m["config"]["policy"] = dataclasses.asdict(p.options.get("policy", Policy()))
    assert policy_of(m)[0] == p.options.get("policy", Policy())


def _audited(batches: int, a: int) -> dict:
    m = {"run_secret": SECRET.hex(), "stream": {"batches": batches}}
    steps = drawn_steps(SECRET, batches, a)
    m["audit"] = {"schedule": {"rule": "harmonic", "audited_batches": a}, "audited_batches_target": a,
                  "batches": [{"step": s} for s in steps], "passed": True}
    return m


def test_the_draws_are_the_secrets_and_a_removed_batch_or_a_hidden_secret_is_named():
    m = _audited(60, 4)
    steps = check_draws(m)
    assert steps[:5] == [0, 1, 2, 3, 4] and steps == [e["step"] for e in m["audit"]["batches"]]
    gone = m["audit"]["batches"].pop(6)
    with pytest.raises(Mismatch, match=f"draws batch {gone['step']} for the audit"):
        check_draws(m)
    m = _audited(60, 4)
    del m["run_secret"]
    with pytest.raises(Mismatch, match="reveals no run_secret"):
        check_draws(m)


def test_the_reexecution_says_each_stage_and_each_tenth_with_the_runs_own_bpb_beside():
    from prism_challenge.events import BatchScored, StageCount, StageStarted
    from prism_challenge.manifest.verify_reexecute import progress

    per, cum_t, cum_b = [2.0, 1.0, 0.5], [10, 20, 30], [12, 24, 36]  # nats per target, cumulative targets/bytes
    m = {"stream": {"batches": 3}, "curve": {"nats_per_target": per, "cumulative_targets": cum_t,
                                               "cumulative_bytes": cum_b}}
    lines: list[str] = []
    on_event = progress(m, lines.append)
    on_event(StageStarted(stage="stream", total=100, unit="tokens"))
    for i in range(3):
        on_event(BatchScored(batch=i, targets=10, bytes=12, nats=per[i] * 10, targets_so_far=cum_t[i],
                             bytes_so_far=cum_b[i], nats_so_far=0.0, bpb_so_far=0.5))
    # batch 2 of 3: (2*10 + 1*10) nats / ln 2 / 24 bytes; batch 3: 35 nats / ln 2 / 36 bytes
    assert lines[0] == "stage stream"
    assert lines[2] == f"batch 2/3: 0.500000 bpb so far, the run's {30 / math.log(2) / 24:.6f}"
    assert lines[-1] == f"batch 3/3: 0.500000 bpb so far, the run's {35 / math.log(2) / 36:.6f}"
    assert len(lines) == 4  # every batch is a tenth's mark when there are 3
    m.update(audit={"batches": [{}, {}, {}], "blind_probes": 8}, verdict={"heldout": {"batches": 5}})
    lines.clear()
    on_event = progress(m, lines.append)
    for part, done in (("re-scored", None), ("re-scored", 3), ("blind probes", 8), ("held-out batches", 4)):
        on_event(StageCount(stage="heldout", part=part, done=done))
    assert lines == ["stage heldout: 3 re-scored, the run's 3", "stage heldout: 8 blind probes, the run's 8",
                     "stage heldout: 4 held-out batches, the run's 5"]


def test_a_run_audited_with_a_smaller_a_than_the_harness_is_refused_unless_accepted():
    from prism_challenge.evaluator.auditplan import AUDITED_BATCHES

    m = _audited(60, AUDITED_BATCHES - 2)
    with pytest.raises(Mismatch, match=f"A = {AUDITED_BATCHES - 2}, below {AUDITED_BATCHES}"):
        check_draws(m)
    assert check_draws(m, min_audited=AUDITED_BATCHES - 2) == [e["step"] for e in m["audit"]["batches"]]
