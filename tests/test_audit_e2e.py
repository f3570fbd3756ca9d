"""The audit in real runs: honest bundles pass with re-scored nats equal to their records, the
three cheats of issue 15 end zeroed, and ``prism verify`` re-checks a run directory."""
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from prism_challenge.cli import main as prism
from prism_challenge.evaluator.pagecache import EMPTIED
from prism_challenge.evaluator.snapfile import read_snapshot_file, write_snapshot
from prism_challenge.pipeline import EvalOptions, evaluate
from prism_challenge.manifest.run_manifest import MANIFEST_NAME

from helpers import EXAMPLE

sys.path.insert(0, str(Path(__file__).parent / "rescore_bundles"))
from assemble import bundle  # noqa: E402

BUDGET = 12_000  # bytes tokens: 4 rows x 63 new tokens per batch, 48 batches


def run(tmp_path, root, name, **kw):
    opts = dict(token_budget=BUDGET, heldout_bytes=20_000, device="cpu", threads=1)
    opts.update(kw)
    return evaluate(EvalOptions(bundle=str(root), out_dir=str(tmp_path / name), **opts))


def audit_of(outcome):
    assert outcome.failure is None, outcome.failure
    return outcome.manifest["audit"], outcome.manifest["verdict"]


def assert_passes(outcome):
    audit, verdict = audit_of(outcome)
    assert audit["passed"], audit["mismatch"] or audit["error"]
    assert audit["batches"][0]["step"] == 0 and len(audit["batches"]) >= 2
    for b in audit["batches"]:  # bit for bit on CPU: the same kernels, shapes and threads
        assert b["rescored_nats"] == b["recorded_nats"] and b["match"]
    curve = outcome.manifest["curve"]
    first = curve["nats_per_target"][0] * curve["cumulative_targets"][0]
    assert math.fsum(audit["batches"][0]["recorded_nats"]) == pytest.approx(first, rel=1e-12)  # the curve's batch 0
    assert audit["blind_probes"] > 0 and "audit" not in verdict["flags"]
    expected = EMPTIED if os.geteuid() == 0 else "not emptied: the harness is not root (/proc/sys/vm/drop_caches needs it)"
    assert audit["page_cache"] == expected  # before the blind probe child (evaluator/pagecache.py)
    if (verdict.get("heldout") or {}).get("blind_probes"):
        assert verdict["heldout"]["page_cache"] == expected
    return audit, verdict


@pytest.mark.slow
def test_the_example_passes_the_audit(tmp_path):
    assert_passes(run(tmp_path, EXAMPLE, "example", token_budget=6_000, heldout_bytes=10_000))


@pytest.mark.slow
def test_the_init_template_passes_the_audit(tmp_path):
    from prism_challenge.research.scaffold import write_bundle

    write_bundle(tmp_path / "seed", tokenizer="bytes")
    outcome = run(tmp_path, tmp_path / "seed", "run", token_budget=6_000, heldout_bytes=10_000)
    audit, _ = assert_passes(outcome)  # the tied model re-scored bit for bit
    # its head is tied to the token embedding: each snapshot holds that tensor once (issue 27).
    # The file's tensor bytes, from the template's own module: its unique storages, 64-byte aligned
    sys.path.insert(0, str(tmp_path / "seed"))
    try:
        from architecture import TinyLM

        state = TinyLM(257, 256).state_dict()
    finally:
        sys.path.remove(str(tmp_path / "seed"))
        sys.modules.pop("architecture", None)
    assert state["head.weight"].data_ptr() == state["tok.weight"].data_ptr()
    pos, seen = 8, set()
    for t in state.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            pos += -pos % 64 + t.numel() * t.element_size()
    tied = state["tok.weight"].numel() * 4
    for b in audit["batches"]:
        data = (outcome.run_dir / "model" / "audit" / f"step-{b['step']:06d}.snap").read_bytes()
        size = int.from_bytes(data[-16:-8], "little")
        index = {e[0]: e for e in json.loads(data[-16 - size : -16])["tensors"]}
        assert len(data) == pos + size + 16 and index["head.weight"][1:] == index["tok.weight"][1:]
        assert sum(t.numel() * t.element_size() for t in state.values()) - tied < pos  # once, not twice


@pytest.fixture(scope="module")
def honest_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("honest")
    outcome = run(tmp, bundle("honest", tmp), "run")
    return outcome


@pytest.mark.slow
def test_an_honest_bundle_passes_and_verifies(honest_run, capsys):
    audit, verdict = assert_passes(honest_run)
    assert verdict["final_score"] > 0
    assert prism(["verify", str(honest_run.run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verified: prequential_bpb ") and f"{len(audit['batches'])} audited batches" in out


@pytest.mark.slow
def test_each_snapshot_on_disk_hashes_to_the_value_the_manifest_binds(honest_run):
    audit, _ = audit_of(honest_run)
    folder = honest_run.run_dir / "model" / "audit"
    names = [f"step-{b['step']:06d}.snap" for b in audit["batches"]]
    assert sorted(p.name for p in folder.glob("*.snap")) == names and len(names) >= 2
    digests = [hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names]  # computed here, independently
    assert digests == [b["snapshot_sha256"] for b in audit["batches"]] and len(set(digests)) == len(digests)


def copy_run(honest_run, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(honest_run.run_dir, dest)
    return dest


@pytest.mark.slow
def test_verify_names_an_edited_record(honest_run, tmp_path, capsys):
    run_dir = copy_run(honest_run, tmp_path)
    manifest = json.loads((run_dir / MANIFEST_NAME).read_text())
    entry = manifest["audit"]["batches"][1]
    step = entry["step"]
    entry["recorded_nats"] = [entry["recorded_nats"][0] * 0.999]  # and the curve, so the score still adds up
    targets = manifest["curve"]["cumulative_targets"]
    manifest["curve"]["nats_per_target"][step] = entry["recorded_nats"][0] / (targets[step] - targets[step - 1])
    from prism_challenge.manifest.certificate import sign_manifest, user_key

    key = user_key()[0]  # the trusted key (prism eval's) signs the edit: the recomputation must catch it
    (run_dir / MANIFEST_NAME).write_text(json.dumps(sign_manifest(manifest, key)))
    assert prism(["verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("mismatch: score: ")  # the totals no longer follow from the curve
    from prism_challenge.manifest.verify import curve_bpb
    from prism_challenge.manifest.verify_recompute import policy_of, recompute_verdict

    bpb, nats = curve_bpb(manifest["curve"])
    manifest["score"].update(prequential_bpb=bpb, total_nats=math.fsum(nats), total_bits=math.fsum(nats) / math.log(2))
    manifest["verdict"] = recompute_verdict(manifest, policy_of(manifest)[0])
    (run_dir / MANIFEST_NAME).write_text(json.dumps(sign_manifest(manifest, key)))
    assert prism(["verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"mismatch: audited batch {step}: recorded {entry['recorded_nats'][0]!r} nats, re-scored ")


@pytest.mark.slow
def test_verify_names_a_replaced_snapshot(honest_run, tmp_path, capsys):
    run_dir = copy_run(honest_run, tmp_path)
    step = json.loads((run_dir / MANIFEST_NAME).read_text())["audit"]["batches"][-1]["step"]
    snap = run_dir / "model" / "audit" / f"step-{step:06d}.snap"
    state = read_snapshot_file(snap)
    state["head.bias"] = state["head.bias"] + 0.5
    snap.chmod(0o644)
    write_snapshot(state, snap)
    assert prism(["verify", str(run_dir)]) == 1
    assert capsys.readouterr().out.startswith(f"mismatch: audited batch {step}: the snapshot ")


def zeroed(outcome):
    audit, verdict = audit_of(outcome)
    assert not audit["passed"] and verdict["final_score"] == 0.0 and "audit" in verdict["flags"]
    return audit, verdict


@pytest.mark.slow
def test_the_loops_switch_turned_off_for_the_tail_is_zeroed(tmp_path, honest_run):
    outcome = run(tmp_path, bundle("loop_switch", tmp_path), "run")
    audit, verdict = zeroed(outcome)
    honest = honest_run.manifest["score"]["prequential_bpb"]
    cheat = outcome.manifest["score"]["prequential_bpb"]
    print(f"loop switch: honest {honest:.4f} bpb, cheating {cheat:.4f} bpb; {audit['mismatch']}")
    assert cheat < honest - 0.1  # the cheat paid: its records are far below the honest run's
    # the weights are the honest run's (the peek is off in training): the held-out stage alone sees the same
    assert [f for f in verdict["flags"] if f != "audit"] == honest_run.manifest["verdict"]["flags"]
    assert verdict["heldout"]["val_bpb_trained"] == honest_run.manifest["verdict"]["heldout"]["val_bpb_trained"]
    bad = next(b for b in audit["batches"] if not b["match"])
    assert bad["step"] > 0 and bad["rescored_nats"][0] > bad["recorded_nats"][0]
    assert audit["mismatch"].startswith(f"audited batch {bad['step']}: recorded {bad['recorded_nats'][0]!r} nats, "
                                        f"re-scored {bad['rescored_nats'][0]!r} nats")


@pytest.mark.slow
def test_the_architectures_own_switch_is_zeroed(tmp_path, honest_run):
    outcome = run(tmp_path, bundle("arch_switch", tmp_path), "run")
    audit, _ = zeroed(outcome)
    honest = honest_run.manifest["score"]["prequential_bpb"]
    cheat = outcome.manifest["score"]["prequential_bpb"]
    print(f"architecture switch: honest {honest:.4f} bpb, cheating {cheat:.4f} bpb; {audit['mismatch']}")
    assert cheat < honest - 0.1
    assert audit["batches"][0]["match"]  # batch 0 is honest: the switch turns on after it
    assert audit["mismatch"].startswith("audited batch ") and "re-scored" in audit["mismatch"]


@pytest.mark.slow
def test_a_peek_at_one_position_in_six_is_zeroed_by_the_blind_probe(tmp_path, honest_run):
    outcome = run(tmp_path, bundle("peek6", tmp_path), "run")
    audit, _ = zeroed(outcome)
    honest = honest_run.manifest["score"]["prequential_bpb"]
    cheat = outcome.manifest["score"]["prequential_bpb"]
    print(f"peek 1 in 6: honest {honest:.4f} bpb, cheating {cheat:.4f} bpb; {audit['mismatch']}")
    assert cheat < honest
    assert all(b["match"] for b in audit["batches"])  # the weights reproduce the records ...
    assert audit["mismatch"].startswith("blind probe of audited batch ")  # ... but not without the future
    assert math.isfinite(cheat)


@pytest.mark.slow
def test_every_process_that_runs_the_submission_sees_the_same_context(tmp_path, monkeypatch):
    import contextlib

    from prism_challenge.audit import auditstage
    from prism_challenge.pipeline import finish

    seen_by_children = []  # the held-out and audit children's files, read before their folder is emptied
    real = auditstage.empty_artifacts

    @contextlib.contextmanager
    def keeping(artifacts):
        with real(artifacts) as empty:
            yield empty
            if (empty / "ctx.pt").exists():
                seen_by_children.extend(torch.load(empty / "ctx.pt"))

    monkeypatch.setattr(auditstage, "empty_artifacts", keeping)
    monkeypatch.setattr(finish, "empty_artifacts", keeping)
    from prism_challenge.audit import heldout_parent
    from prism_challenge.audit import rescore
    from prism_challenge.evaluator import freshdir

    def reading_first(folders):  # each child's folder is emptied before the next child runs
        for folder in folders:
            if (Path(folder) / "ctx.pt").exists():
                seen_by_children.extend(torch.load(Path(folder) / "ctx.pt"))
        freshdir.empty_folders(folders)

    monkeypatch.setattr(heldout_parent, "empty_folders", reading_first)
    monkeypatch.setattr(rescore, "empty_folders", reading_first)
    outcome = run(tmp_path, bundle("ctx_probe", tmp_path), "run", token_budget=3_000)
    assert_passes(outcome)
    first = torch.load(outcome.run_dir / "artifacts" / "ctx.pt")  # the parameter child's, then the rank's
    assert len(first) == 2 and len(seen_by_children) >= 4  # held-out twin and trained, blind probe, audit
    expected = {"seed": 1234, "vocab_size": 257, "sequence_length": 256, "max_parameters": 150_000_000,
                "device": "cpu", "rank": 0, "local_rank": 0, "world_size": 1,
                "artifacts": str(outcome.run_dir / "artifacts"), "token_budget": 3_000, "step_budget": None}
    for ctx in first + seen_by_children:
        assert ctx == expected


@pytest.mark.slow
def test_a_forward_that_stores_the_batch_in_its_buffers_is_zeroed(tmp_path, honest_run):
    # the snapshot is the state before the scoring forward: the stored batch is not in it
    outcome = run(tmp_path, bundle("stash", tmp_path), "run")
    audit, _ = zeroed(outcome)
    honest = honest_run.manifest["score"]["prequential_bpb"]
    cheat = outcome.manifest["score"]["prequential_bpb"]
    print(f"stash: honest {honest:.4f} bpb, cheating {cheat:.4f} bpb; {audit['mismatch']}")
    assert cheat < honest - 1.0
    assert audit["batches"][0]["match"] and audit["mismatch"].startswith("blind probe of audited batch 0, row ")


@pytest.mark.slow
def test_two_ranks_pass_the_audit_slice_by_slice(tmp_path):
    outcome = run(tmp_path, EXAMPLE, "two", token_budget=6_000, heldout_bytes=10_000, nproc=2)
    audit, _ = assert_passes(outcome)
    assert all(len(b["recorded_nats"]) == 2 for b in audit["batches"])  # each rank's slice re-scored
