"""``prism runs prune`` on real runs: exactly the snapshots of verified runs go, every other file
and every other run stays, and ``prism verify`` of a pruned run checks all the rest and says the
snapshots were pruned (issue 27)."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from prism_challenge.cli import main as prism
from prism_challenge.pipeline import EvalOptions, evaluate
from prism_challenge.manifest.run_manifest import MANIFEST_NAME

AUDIT = Path("model") / "audit"


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """A real run of the template (bytes tokenizer, 2000 tokens), audited and signed by the
    session's own key (conftest keeps it out of the home folder)."""
    from prism_challenge.research.scaffold import write_bundle

    tmp = tmp_path_factory.mktemp("prune")
    write_bundle(tmp / "seed", tokenizer="bytes")
    outcome = evaluate(EvalOptions(bundle=str(tmp / "seed"), out_dir=str(tmp / "run"), token_budget=2_000,
                                   heldout_bytes=0, device="cpu", threads=1))
    assert outcome.failure is None, outcome.failure
    audit = outcome.manifest["audit"]
    assert audit["passed"] and audit["error"] is None and len(audit["batches"]) >= 2
    return outcome.run_dir


def files_of(root):
    """Every file under ``root``: relative path -> sha256 (computed here)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def snaps(run):
    return sorted(str(p.relative_to(run)) for p in (run / AUDIT).glob("step-*.snap"))


def resign(run, edit):
    from prism_challenge.manifest.certificate import sign_manifest, user_key

    manifest = json.loads((run / MANIFEST_NAME).read_text())
    edit(manifest)
    (run / MANIFEST_NAME).write_text(json.dumps(sign_manifest(manifest, user_key()[0])))


def runs_folder(honest, tmp_path):
    """``runs/`` holding the honest run twice (one as a seed repeat's ``seed-1``) and four runs
    that must keep their snapshots: an audit that did not end, an unsigned manifest, no manifest
    (interrupted), a snapshot that is not the one the manifest binds."""
    runs = tmp_path / "runs"
    for name in ("ok", "repeat/seed-1", "unfinished", "unsigned", "interrupted", "edited"):
        shutil.copytree(honest, runs / name, symlinks=True)
    resign(runs / "unfinished", lambda m: m["audit"].update(passed=False, error="audit: the child timed out"))
    manifest = json.loads((runs / "unsigned" / MANIFEST_NAME).read_text())
    del manifest["certificate"]
    (runs / "unsigned" / MANIFEST_NAME).write_text(json.dumps(manifest))
    (runs / "interrupted" / MANIFEST_NAME).unlink()
    last = runs / "edited" / snaps(honest)[-1]
    last.chmod(0o600)
    last.write_bytes(last.read_bytes()[:-1] + b"!")
    return runs


@pytest.mark.slow
def test_prune_removes_exactly_the_verified_runs_snapshots(honest, tmp_path, capsys):
    runs = runs_folder(honest, tmp_path)
    before = files_of(runs)
    sizes = {r: sum(os.stat(runs / r / s).st_size for s in snaps(honest)) for r in ("ok", "repeat/seed-1")}
    assert min(sizes.values()) > 0

    assert prism(["runs", "prune", str(runs), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert files_of(runs) == before  # a dry run removes nothing
    n = len(snaps(honest))
    assert f"would prune {runs / 'ok'}: {n} snapshots, {sizes['ok']} bytes ({sizes['ok'] / 2**20:.1f} MiB)" in out
    assert any(line.startswith(f"would prune {runs / 'repeat/seed-1'}: ") for line in out)
    kept = {line.split()[1].rstrip(":"): line for line in out if line.startswith("kept")}
    assert sorted(kept) == [str(runs / r) for r in ("edited", "interrupted", "unfinished", "unsigned")]
    assert "its audit did not end: audit: the child timed out" in kept[str(runs / "unfinished")]
    assert "not certified by a trusted key (certificate: the manifest is unsigned" in kept[str(runs / "unsigned")]
    assert kept[str(runs / "interrupted")].endswith(f"no {MANIFEST_NAME}: the run did not end")
    assert f"{Path(snaps(honest)[-1]).name} is not the snapshot the manifest binds" in kept[str(runs / "edited")]
    total = sizes["ok"] + sizes["repeat/seed-1"]
    assert out[-1] == f"2 runs to prune, 4 kept: would free {total} bytes ({total / 2**20:.1f} MiB)"

    assert prism(["runs", "prune", str(runs)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"2 runs pruned, 4 kept: freed {total} bytes ({total / 2**20:.1f} MiB)"
    after = files_of(runs)
    gone = {f"{r}/{s}" for r in ("ok", "repeat/seed-1") for s in snaps(honest)}
    added = {f"{r}/{AUDIT}/pruned.json" for r in ("ok", "repeat/seed-1")}
    assert set(before) - set(after) == gone and set(after) - set(before) == added
    assert all(after[k] == before[k] for k in after if k not in added)  # nothing else changed
    record = json.loads((runs / "ok" / AUDIT / "pruned.json").read_text())
    assert record["snapshots"] == {Path(s).name: {"sha256": before[f"ok/{s}"], "bytes": os.stat(honest / s).st_size}
                                   for s in snaps(honest)}

    assert prism(["runs", "prune", str(runs), "--all"]) == 0  # the rest, whatever their state
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[-1].startswith("4 runs pruned, 0 kept: freed ")
    assert not list(runs.rglob("*.snap")) and len(list(runs.rglob("*.npz"))) == 6 * n


@pytest.mark.slow
def test_verify_of_a_pruned_run_checks_the_rest_and_says_the_snapshots_were_pruned(honest, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(honest, run, symlinks=True)
    steps = [b["step"] for b in json.loads((run / MANIFEST_NAME).read_text())["audit"]["batches"]]
    keep = {s: (run / s).read_bytes() for s in snaps(run)}
    assert prism(["runs", "prune", str(run)]) == 0
    capsys.readouterr()
    assert prism(["verify", str(run), "--json"]) == 3
    got = json.loads(capsys.readouterr().out)
    assert got["verified"] is False and got["snapshots_pruned"] == steps and got["audited_batches"] == 0
    assert got["draws_checked"] and got["probes_redrawn"] == len(steps)
    assert prism(["verify", str(run)]) == 3
    assert capsys.readouterr().out.startswith(f"verified except the re-scoring: the snapshots of {len(steps)} "
                                              f"audited batches (steps {', '.join(map(str, steps[:8]))}")
    # an interrupted prune left the last one: it is re-scored, the others are said pruned
    last = snaps(honest)[-1]
    (run / last).write_bytes(keep[last])
    assert prism(["verify", str(run), "--json"]) == 3
    got = json.loads(capsys.readouterr().out)
    assert got["audited_batches"] == 1 and got["snapshots_pruned"] == steps[:-1] and got["blind_probes"] > 0
    # what was pruned is still checked: an edited input of a pruned batch is a mismatch
    npz = run / AUDIT / f"step-{steps[0]:06d}.npz"
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["tokens_0"][0, 0] ^= 1
    npz.chmod(0o600)
    np.savez(npz, **arrays)
    assert prism(["verify", str(run)]) == 1
    assert capsys.readouterr().out == f"mismatch: audited batch {steps[0]}: its stored inputs do not hash to the manifest's\n"


@pytest.mark.slow
def test_a_snapshot_gone_without_its_prune_record_is_still_a_mismatch(honest, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(honest, run, symlinks=True)
    first = run / snaps(run)[0]
    first.unlink()
    assert prism(["verify", str(run)]) == 1
    assert capsys.readouterr().out.startswith(f"mismatch: audited batch 0: the snapshot {first} is missing")
    # a record naming another sha256 does not make it pruned
    (run / AUDIT / "pruned.json").write_text(json.dumps(
        {"format": "prism-pruned-1", "pruned_at": "x", "snapshots": {first.name: {"sha256": "0" * 64, "bytes": 1}}}))
    assert prism(["verify", str(run)]) == 1
    assert capsys.readouterr().out.startswith("mismatch: audited batch 0: the snapshot ")
    (run / AUDIT / "pruned.json").write_text("{not json")
    assert prism(["verify", str(run)]) == 2
    assert "not a readable prune record" in capsys.readouterr().err


def test_prune_refuses_a_folder_that_is_not_one(tmp_path, capsys):
    assert prism(["runs", "prune", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"prism runs prune: {tmp_path / 'nope'}: no such directory\n"
    assert prism(["runs", "prune", str(tmp_path)]) == 0  # an empty folder: nothing to do
    assert capsys.readouterr().out == "0 runs pruned, 0 kept: freed 0 bytes (0.0 MiB)\n"
