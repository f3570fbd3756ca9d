"""The library API on real runs (torchrun, strict isolation, CPU): the typed manifest of a scored
run, of a contract failure and of a gate refusal; the progress events against the manifest;
the cancel hook mid-stream and during the gates; a run killed from outside."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from prism_challenge import EvalOptions, evaluate
from prism_challenge.cli_eval import ProgressBar
from prism_challenge.events import BatchScored, RunFinished, StageCount, StageFinished, StageStarted
from prism_challenge.manifest.results import RunManifest
from prism_challenge.manifest.run_manifest import MANIFEST_NAME

from helpers import REPO

pytestmark = pytest.mark.slow

TRIVIAL = REPO / "bench" / "bundles" / "trivial"  # 8 x 1024 byte tokens per batch
CANCEL_BOUND_S = 5.0


def _opts(tmp_path: Path, **kw) -> EvalOptions:
    kw.setdefault("seq_len", 1024)
    kw.setdefault("heldout_bytes", 0)
    return EvalOptions(bundle=str(kw.pop("bundle", TRIVIAL)), out_dir=str(tmp_path / "run"), device="cpu", **kw)


def _on_disk(result) -> RunManifest:
    return RunManifest.model_validate(json.loads(Path(result.manifest_path).read_text()))


def test_a_scored_run_its_typed_manifest_and_its_events(tmp_path):
    events = []
    result = evaluate(_opts(tmp_path, token_budget=20_000, heldout_bytes=20_000), on_progress=events.append)
    assert result.status == "scored" and result.kind is None and result.failure is None, result.failure
    disk = _on_disk(result)
    assert disk == result.manifest
    m = result.manifest
    assert m.stream.stop_reason == "token_budget" and m.isolation.isolated and m.verdict.heldout is not None
    # stages in order, each started then finished ok; the run's end last
    stages = [(type(e).__name__, e.stage) for e in events if isinstance(e, (StageStarted, StageFinished))]
    assert stages == [(k, s) for s in ("intake", "data", "gates", "stream", "heldout", "manifest")
                      for k in ("StageStarted", "StageFinished")]
    assert all(e.ok for e in events if isinstance(e, StageFinished))
    stream = next(e for e in events if isinstance(e, StageStarted) and e.stage == "stream")
    assert (stream.total, stream.unit) == (20_000, "tokens")
    # the batches against the manifest, computed independently from the events
    batches = [e for e in events if isinstance(e, BatchScored)]
    assert [b.batch for b in batches] == list(range(m.stream.batches))
    assert sum(b.targets for b in batches) == m.score.targets == batches[-1].targets_so_far
    assert [b.bytes_so_far for b in batches] == m.curve.cumulative_bytes
    assert math.fsum(b.nats for b in batches) == pytest.approx(m.score.total_nats, rel=1e-12)
    assert batches[-1].bpb_so_far == pytest.approx(m.score.total_nats / math.log(2) / m.score.bytes, rel=1e-12)
    assert batches[-1].bpb_so_far == pytest.approx(m.score.prequential_bpb, rel=1e-12)
    end = events[-1]
    assert isinstance(end, RunFinished) and (end.status, end.kind, end.stage) == ("scored", None, None)
    assert end.final_score == m.verdict.final_score == result.final_score
    assert end.run_dir == result.run_dir
    # prism eval's bar, fed the same events, counts the scored targets (unit tokens)
    bar = ProgressBar(Console(file=StringIO()), disable=True)
    for e in events:
        bar(e)
    # the bar counts the stream's tokens, so it reaches the budget; the stages after it get a line each, done
    assert bar.progress.tasks[0].completed == m.stream.tokens == 20_000 == bar.progress.tasks[0].total
    assert [(t.description, t.fields["note"], t.finished) for t in bar.progress.tasks[1:]] == [
        ("audit + held-out", "done", True), ("manifest", "done", True)]
    # the parts of the audit + held-out stage: each at its start, then its count, against the manifest
    parts = [(e.part, e.done) for e in events if isinstance(e, StageCount)]
    audit, heldout = m.audit, m.verdict.heldout
    assert parts == [("re-scored", None), ("re-scored", len(audit.batches)), ("blind probes", audit.blind_probes),
                     ("held-out batches", None), ("held-out batches", heldout.batches)]
    assert len(audit.batches) >= 1 and heldout.batches >= 1
    assert bar.progress.tasks[1].fields["counts"] == (f"{len(audit.batches)} re-scored · {audit.blind_probes} "
                                                      f"blind probes · {heldout.batches} held-out batches")


def test_a_contract_failure_has_a_typed_manifest_and_the_kind_submission(tmp_path):
    # the trivial loop asks for rows of 1024 tokens; at --seq-len 256 the runner refuses them
    result = evaluate(_opts(tmp_path, seq_len=256, token_budget=20_000))
    assert (result.status, result.kind) == ("failed", "submission")
    assert (result.failure.stage, result.failure.cause) == ("contract", "reported")
    assert result.failure.message == "iter_train_batches(seq_len=1024) must be in 2..256 (ctx.max_seq_len)"
    disk = _on_disk(result)
    assert disk.status == "failed" and disk.failure == result.failure and disk.score is None
    assert disk.failure.kind == "submission"


def test_a_gate_refusal_returns_a_typed_manifest_without_a_run_directory(tmp_path):
    bundle = tmp_path / "b"
    bundle.mkdir()
    for name in ("architecture.py", "prism.yaml"):
        (bundle / name).write_text((TRIVIAL / name).read_text())
    (bundle / "training.py").write_text("import os\n" + (TRIVIAL / "training.py").read_text())
    result = evaluate(_opts(tmp_path, bundle=bundle, token_budget=20_000))
    assert (result.status, result.kind, result.failure.stage) == ("failed", "submission", "gates")
    assert result.run_dir is None and result.manifest_path is None and not (tmp_path / "run").exists()
    findings = [f for f in result.manifest.gates.findings if f.blocking]
    assert findings and findings[0].file == "training.py" and findings[0].line == 1
    assert RunManifest.model_validate(json.loads(json.dumps(result.manifest.to_json_dict()))) == result.manifest


# -- cancel --------------------------------------------------------------------------------------
def _processes() -> dict[int, tuple[int, int, int, int]]:
    """pid -> (ppid, pgrp, uid, starttime) of every live process (zombies left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            uid = os.stat(f"/proc/{entry}").st_uid
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        out[int(entry)] = (int(fields[1]), int(fields[2]), uid, int(fields[19]))
    return out


def _descendants(procs, root: int) -> dict[int, tuple[int, int, int, int]]:
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, info in procs.items():
            if info[0] == parent and pid not in found:
                found[pid] = info
                frontier.append(pid)
    return found


def _run_in_thread(opts, cancel, when):
    """Start ``evaluate`` in a thread; ``when(event)`` says when the run reached the point to act."""
    reached, box = threading.Event(), {}

    def progress(event):
        if when(event):
            reached.set()

    def target():
        box["result"] = evaluate(opts, cancel=cancel, on_progress=progress)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, reached, box


def test_cancel_mid_stream_kills_the_tree_within_5_s_and_the_manifest_says_cancelled(tmp_path):
    cancel = threading.Event()
    thread, reached, box = _run_in_thread(_opts(tmp_path, token_budget=50_000_000), cancel,
                                          lambda e: isinstance(e, BatchScored))
    assert reached.wait(300), "no batch was scored"
    tree = _descendants(_processes(), os.getpid())
    assert tree, "the run's processes are not children of this process"
    t0 = time.monotonic()
    cancel.set()
    thread.join(60)
    elapsed = time.monotonic() - t0
    print(f"cancel mid-stream: evaluate returned {elapsed:.2f} s after the cancel")
    assert not thread.is_alive()
    result = box["result"]
    assert elapsed < CANCEL_BOUND_S
    assert (result.status, result.kind, result.failure.stage) == ("cancelled", "cancelled", "cancelled")
    disk = _on_disk(result)
    assert disk.status == "cancelled" and disk.failure.kind == "cancelled" and disk.stream.batches >= 1
    now = _processes()
    left = {pid for pid, info in tree.items() if now.get(pid, (None,) * 4)[3] == info[3]}
    assert left == set(), f"processes of the run still alive: {left}"
    groups = {info[1] for info in tree.values()} - {os.getpgrp()}
    assert [pid for pid, info in now.items() if info[1] in groups] == []
    uid = disk.isolation.guard.uid
    if uid is not None:  # run as root: the dedicated sandbox uid owns no process any more
        assert [pid for pid, info in now.items() if info[2] == uid] == []


def test_cancel_during_the_gates_leaves_no_run_directory(tmp_path):
    cancel = threading.Event()
    thread, reached, box = _run_in_thread(_opts(tmp_path, token_budget=20_000), cancel,
                                          lambda e: isinstance(e, StageStarted) and e.stage == "gates")
    assert reached.wait(300)
    tree = _descendants(_processes(), os.getpid())
    t0 = time.monotonic()
    cancel.set()
    thread.join(60)
    elapsed = time.monotonic() - t0
    print(f"cancel during the gates: evaluate returned {elapsed:.2f} s after the cancel")
    result = box["result"]
    assert elapsed < CANCEL_BOUND_S
    assert (result.status, result.kind, result.run_dir) == ("cancelled", "cancelled", None)
    assert result.manifest.status == "cancelled" and not (tmp_path / "run").exists()
    now = _processes()
    assert {pid for pid, info in tree.items() if now.get(pid, (None,) * 4)[3] == info[3]} == set()


def test_a_run_killed_from_outside_is_an_infrastructure_failure(tmp_path):
    thread, reached, box = _run_in_thread(_opts(tmp_path, token_budget=50_000_000), None,
                                          lambda e: isinstance(e, BatchScored))
    assert reached.wait(300)
    children = [pid for pid, info in _processes().items() if info[0] == os.getpid()]
    assert len(children) == 1, children  # the launcher (the sandbox around the single-rank agent)
    os.kill(children[0], signal.SIGKILL)
    thread.join(120)
    result = box["result"]
    assert (result.status, result.kind) == ("failed", "infrastructure")
    assert (result.failure.stage, result.failure.cause) == ("runner", "killed")
    assert result.failure.message.startswith("the single-rank agent ended on signal 9 that the harness did not send")
    assert _on_disk(result).failure.kind == "infrastructure"


@pytest.mark.parametrize("seq_len,code,status,kind", [("1024", 0, "scored", None), ("256", 1, "failed", "submission")])
def test_prism_eval_writes_manifests_the_models_accept(tmp_path, capsys, seq_len, code, status, kind):
    from prism_challenge.cli import main

    out = tmp_path / "run"
    argv = ["eval", str(TRIVIAL), "--seq-len", seq_len, "--token-budget", "20000", "--heldout-bytes", "10000",
            "--device", "cpu", "--json", "--no-progress", "--out", str(out)]
    assert main(argv) == code
    summary = json.loads(capsys.readouterr().out)
    manifest = RunManifest.model_validate(json.loads((out / MANIFEST_NAME).read_text()))
    assert (summary["status"], manifest.status) == (status, status)
    assert (summary["failure"] or {}).get("kind") == kind == (manifest.failure.kind if manifest.failure else None)
    if status == "scored":
        assert summary["prequential_bpb"] == manifest.score.prequential_bpb
        assert summary["final_score"] == manifest.verdict.final_score


def test_prism_eval_json_lists_the_findings_of_a_refused_bundle(tmp_path, capsys):
    """A bundle the gates refuse: ``--json`` carries each blocking finding, as ``prism check`` has it."""
    import shutil

    from prism_challenge.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(TRIVIAL, bundle)
    training = bundle / "training.py"
    lines = training.read_text().splitlines()
    training.write_text("\n".join([*lines, "import subprocess"]) + "\n")
    assert main(["eval", str(bundle), "--json", "--no-progress", "--out", str(tmp_path / "run")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["failure"]["stage"] == "gates" and out["run_dir"] is None
    assert [f for f in out["findings"] if f["blocking"]] == [{"rule": "prism:no-process", "file": "training.py", "line": len(lines) + 1, "col": 1,
                                "message": "import subprocess: module 'subprocess' is blocked", "blocking": True}]
