"""The audit: its schedule, the feeder's answer and snapshots, and the re-scoring children."""
import hashlib
import math
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from prism_challenge.evaluator import isolation, protocol
from prism_challenge.evaluator.auditplan import (
    AUDITED_BATCHES,
    audit_draw,
    catch_probability,
    drawn_steps,
    escape_bound,
    expected_audits,
    rate_at,
    within,
)
from prism_challenge.evaluator.feeder import Feeder
from prism_challenge.evaluator.jail import Jail
from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.snapfile import read_snapshot_file, write_snapshot
from prism_challenge.evaluator.snapshots import AuditedStep
from prism_challenge.evaluator.statedict import frames
from prism_challenge.audit.rescore import BLIND_PASSES, probe_batch, run_audit

from helpers import chunks_of
from test_feeder import FakeRunner, wait_done

sys.path.insert(0, str(Path(__file__).parent / "rescore_bundles"))
from assemble import bundle  # noqa: E402

RNG = np.random.default_rng(5)
IDS = RNG.integers(0, 257, 4000).tolist()
NBYTES = [1] * 4000


# -- the schedule ------------------------------------------------------------------------------
def test_the_harmonic_rate_decays_as_a_over_k():
    assert [rate_at(k, 4) for k in (0, 1, 4, 5, 8, 400)] == [1.0, 1.0, 1.0, 0.8, 0.5, 0.01]
    assert rate_at(0, 0) == 0.0 and rate_at(7, 0) == 0.0
    key = b"k" * 32
    assert drawn_steps(key, 5, 4) == [0, 1, 2, 3, 4]  # rate 1 up to k = A
    # the drawn steps are those whose keyed draw is under the rate, and a prefix of a longer stream's
    n = 20_000
    steps = drawn_steps(key, n, 4)
    assert steps == [k for k in range(n) if k == 0 or audit_draw(key, k) < min(1.0, 4 / k)]
    assert drawn_steps(key, 300, 4) == [k for k in steps if k < 300]
    # E(n) = 1 + sum_{k=1}^{n-1} min(1, A/k), by hand for n = 7, A = 4: 1 + 1 + 1 + 1 + 1 + 4/5 + 4/6
    assert expected_audits(7, 4) == pytest.approx(5 + 0.8 + 4 / 6)
    e = expected_audits(n, 4)
    var = math.fsum(r * (1 - r) for r in (rate_at(k, 4) for k in range(n)))
    assert abs(len(steps) - e) <= 4 * math.sqrt(var)
    assert e == pytest.approx(4 * (1 + math.log(n / 4)), rel=0.05)  # ~ A (1 + ln(n / A))


def test_catch_probability_is_the_complement_of_the_harmonic_bound():
    assert escape_bound(0.5, 4) == 0.0625 and catch_probability(0.5, 4) == 0.9375
    assert catch_probability(0.25, 4) == pytest.approx(1 - 0.75**4)
    assert catch_probability(0.1, AUDITED_BATCHES) == pytest.approx(1 - 0.9**AUDITED_BATCHES)
    assert escape_bound(0.0, 4) == 1.0 and escape_bound(1.0, 4) == 0.0
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        escape_bound(1.5)
    # the exact escape of a cheat on the last f n batches, prod (1 - r_k), is under the bound at every n
    for n in (10, 40, 197, 646, 50_000):
        for f in (0.5, 0.25, 0.1):
            m = max(1, int(f * n))
            exact = math.prod(1 - rate_at(k, 4) for k in range(n - m, n))
            assert exact <= escape_bound(m / n, 4) + 1e-12, (n, f)


def test_tolerance_is_relative_and_per_device():
    assert within(100.0, 100.0, "cpu") and within(None, None, "cpu")
    assert within(100.00005, 100.0, "cpu") and not within(100.0002, 100.0, "cpu")
    assert within(100.0009, 100.0, "cuda:0") and not within(100.002, 100.0, "cuda:0")
    assert not within(None, 5.0, "cpu") and not within(5.0, float("nan"), "cpu")


# -- the wire ----------------------------------------------------------------------------------
KEY = b"t" * 32  # with A = 1: batches 0 and 1 audited (rate 1), batch 2 not (its draw is 0.86 >= 1/2)


def audit_feeder(tmp_path, **kw):
    f = Feeder(str(tmp_path / "f.sock"), iter(chunks_of(IDS, NBYTES, 100)), {"seed": 1}, vocab_size=257,
               audit_dir=tmp_path / "audit", probe_key=KEY, **kw)
    f.start()
    return f


def _snapshot(r, step, state):
    for head, payload in frames(state):
        protocol.send(r.sock, Kind.SNAPSHOT, {**head, "step": step}, payload)
    protocol.send(r.sock, Kind.SNAPSHOT_END, {"step": step, "tensors": len(state)})


def test_batch_zero_is_audited_and_its_snapshot_is_stored(tmp_path):
    assert drawn_steps(KEY, 3, 1) == [0, 1]
    f = audit_feeder(tmp_path, step_budget=3, audited_batches=1)
    r = FakeRunner(f)
    b0 = r.next(2, 10)
    assert r.audits == []  # nothing recorded yet: no answer
    protocol.send_small(r.sock, (Kind.RECORD, {"step": 0, "nats": 7.5}), (Kind.NEXT, {"batch_size": 2, "seq_len": 10}))
    r.take()  # the answer to batch 0's record came first, in a frame of its own
    assert r.audits == [[0, True]]
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor([3])}
    _snapshot(r, 0, state)
    protocol.send_small(r.sock, (Kind.RECORD, {"step": 1, "nats": 6.5}), (Kind.NEXT, {"batch_size": 2, "seq_len": 10}))
    r.take()
    _snapshot(r, 1, {"w": torch.zeros(2, 3), "n": torch.tensor([4])})
    r.record(2, 6.0)
    assert r.next(2, 10) is None
    assert r.audits == [[0, True], [1, True], [2, False]]  # the last answer came before the end
    protocol.send(r.sock, Kind.DONE, {})
    assert wait_done(f)
    res = f.finish()
    assert res.error is None and sorted(res.audits) == [0, 1]
    a = res.audits[0]
    assert a.recorded == {0: 7.5} and np.array_equal(a.pieces[0], b0)
    assert a.sha256 == hashlib.sha256(a.snapshot.read_bytes()).hexdigest()
    loaded = read_snapshot_file(a.snapshot)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["n"], state["n"])


def test_a_drawn_batch_the_loop_never_recorded_is_not_an_audited_batch(tmp_path):
    f = audit_feeder(tmp_path, step_budget=5, audited_batches=1)  # batches 0 and 1 drawn
    r = FakeRunner(f)
    r.next(2, 10)
    protocol.send_small(r.sock, (Kind.RECORD, {"step": 0, "nats": 7.5}), (Kind.NEXT, {"batch_size": 2, "seq_len": 10}))
    r.take()  # batch 1, drawn, served: the loop stops before it records it
    _snapshot(r, 0, {"w": torch.ones(2)})
    protocol.send(r.sock, Kind.DONE, {})
    assert wait_done(f)
    res = f.finish()
    assert res.error is None and [s.step for s in res.steps] == [0] and res.stop_reason == "loop_stopped"
    assert sorted(res.audits) == [0] == drawn_steps(KEY, len(res.steps), 1)


def test_a_snapshot_for_a_batch_not_audited_fails_the_run(tmp_path):
    f = audit_feeder(tmp_path, step_budget=4, audited_batches=1)
    r = FakeRunner(f)
    r.next(2, 10)
    for step in (0, 1):
        protocol.send_small(r.sock, (Kind.RECORD, {"step": step, "nats": 7.5}),
                            (Kind.NEXT, {"batch_size": 2, "seq_len": 10}))
        r.take()
        _snapshot(r, step, {})
    r.record(2, 6.0)
    protocol.send(r.sock, Kind.SNAPSHOT, {"step": 2, "name": "w", "dtype": "torch.float32", "shape": [1]}, b"\0" * 4)
    assert f.failed.wait(5)
    assert "which was not audited now" in f.finish().error["message"]


def test_probe_rows_keep_their_prefix_and_go_on_with_the_filler():
    tokens = np.arange(40, dtype=np.int64).reshape(4, 10)
    filler = np.arange(1000, 1100, dtype=np.int64)
    probe, picks = probe_batch(tokens, filler, b"k" * 32, step=3, rank=0)
    assert probe.shape == tokens.shape and [r for r, _ in picks] == [0, 1, 2, 3]  # no k = 9 for these draws
    for row, k in picks:
        assert 1 <= k < 10
        assert probe[row, :k].tolist() == tokens[row, :k].tolist()
        tail = probe[row, k:]
        assert tail.min() >= 1000 and np.all(np.diff(tail) == 1)  # consecutive real text
    # no kept row holds another probed row's true next token (rows overlap by one token)
    for row, k in picks:
        if k == 9 and row + 1 < 4:
            assert (row + 1) not in [r for r, _ in picks] and probe[row + 1].min() >= 1000
    short = np.arange(80, dtype=np.int64).reshape(40, 2)  # T = 2: every pick is a last target
    _, every_other = probe_batch(short, filler, b"k" * 32, step=0, rank=0)
    assert [r for r, _ in every_other] == list(range(0, 40, 2))
    again, picks2 = probe_batch(tokens, filler, b"k" * 32, step=3, rank=0)
    assert np.array_equal(again, probe) and picks2 == picks
    assert probe_batch(tokens, filler, b"k" * 32, step=4, rank=0)[1] != picks  # another step, other draws


# -- the children ------------------------------------------------------------------------------
def _trained(tmp_path, name):
    """A bundle, a model of it with non-trivial weights, its snapshot, and one batch."""
    root = bundle(name, tmp_path)
    sys.path.insert(0, str(root))
    try:
        import importlib

        import peekmodel

        importlib.reload(peekmodel)
        model = peekmodel.PeekLM(257)
    finally:
        sys.path.remove(str(root))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    snap = tmp_path / "step-000000.snap"
    write_snapshot({k: v for k, v in model.state_dict().items()}, snap)
    return root, model, snap


def _config(root, tmp_path):
    return {"seed": 1234, "threads": 1, "vocab_size": 257, "tokenizer": "bytes", "sequence_length": 64,
            "max_parameters": 10**6, "device": "cpu", "bundle_root": str(root),
            "architecture": ["architecture", "build_model"], "scoring_autocast": None, "hidden": [],
            "context": {"seed": 1234, "vocab_size": 257, "sequence_length": 64, "max_parameters": 10**6,
                        "world_size": 1, "artifacts_dir": str(tmp_path / "art"), "token_budget": 1000,
                        "step_budget": None, "tokenizer_name": "bytes"}}


def _nats(model, tokens):
    with torch.no_grad():
        model.eval()
        lp = torch.log_softmax(model.honest(torch.tensor(tokens)).float(), dim=-1)
        tgt = torch.tensor(tokens[:, 1:]).unsqueeze(-1)
        return float(-lp[:, :-1].gather(-1, tgt).double().sum())


@pytest.mark.slow
def test_children_reproduce_an_honest_record_and_name_an_edited_one(tmp_path):
    root, model, snap = _trained(tmp_path, "honest")
    (tmp_path / "art").mkdir()
    tokens = RNG.integers(0, 257, (3, 20)).astype(np.int64)
    nats = _nats(model, tokens)  # an independent path: the bigram's log-softmax by hand
    filler = RNG.integers(0, 257, 500).astype(np.int64)
    jail = Jail("none", str(root), (), Limits(), 1)
    from prism_challenge.evaluator.snapshots import file_sha256

    def audits(recorded):
        return {0: AuditedStep(0, {0: tokens}, {0: recorded}, snap, file_sha256(snap))}

    report = run_audit(_config(root, tmp_path), audits(nats), jail=jail, world_size=1, filler=filler, key=b"k" * 32,
                       timeout_s=120, artifacts_dir=str(tmp_path / "art"))
    assert report.passed, report.mismatch or report.error
    assert report.batches[0]["rescored_nats"] == [pytest.approx(nats, rel=1e-6)]
    assert report.blind_probes == 3 * BLIND_PASSES
    edited = nats * (1 - 1e-4)
    report = run_audit(_config(root, tmp_path), audits(edited), jail=jail, world_size=1, filler=filler,
                       key=b"k" * 32, timeout_s=120, artifacts_dir=str(tmp_path / "art"))
    assert not report.passed and report.batches[0]["match"] is False
    assert report.mismatch.startswith(f"audited batch 0: recorded {edited!r} nats, re-scored ")


@pytest.mark.slow
def test_the_blind_probe_catches_a_peek_the_snapshot_reproduces(tmp_path):
    root, model, snap = _trained(tmp_path, "peek6")
    (tmp_path / "art").mkdir()
    tokens = RNG.integers(0, 257, (24, 30)).astype(np.int64)  # 24 rows: some k - 1 is a peeked position
    jail = Jail("none", str(root), (), Limits(), 1)
    from prism_challenge.evaluator.snapshots import file_sha256
    from prism_challenge.audit.rescore import Job, plan, run_children

    filler = RNG.integers(0, 257, 500).astype(np.int64)
    a = {0: AuditedStep(0, {0: tokens}, {0: 0.0}, snap, file_sha256(snap))}
    jobs, _, paths, _ = plan(a, 1, filler, b"k" * 32)
    got = run_children(jail, _config(root, tmp_path), jobs, paths, mode="rescore", deadline=time.monotonic() + 120,
                       writable=[str(tmp_path / "art")])
    a[0].recorded[0] = got[0]["nats"]  # the peek is in the weights' behaviour: the re-scoring reproduces it
    report = run_audit(_config(root, tmp_path), a, jail=jail, world_size=1, filler=filler, key=b"k" * 32,
                       timeout_s=120, artifacts_dir=str(tmp_path / "art"))
    assert report.batches[0]["match"] is True
    assert report.mismatch is not None and report.mismatch.startswith("blind probe of audited batch 0, row ")
    assert isinstance(jobs[0], Job)


def test_verify_re_derives_the_bpb_from_the_curve():
    from prism_challenge.manifest.verify import curve_bpb

    # three batches of 10, 10 and 5 targets costing 20, 15 and 4 nats, over 30 bytes
    curve = {"nats_per_target": [2.0, 1.5, 0.8], "cumulative_targets": [10, 20, 25], "cumulative_bytes": [12, 24, 30]}
    bpb, nats = curve_bpb(curve)
    assert nats == [20.0, 15.0, 4.0]
    assert bpb == pytest.approx(39.0 / math.log(2) / 30, rel=1e-15)


def test_the_children_see_the_artifacts_folder_empty_and_the_loops_files_come_back(tmp_path):
    from prism_challenge.audit.auditstage import empty_artifacts

    art = tmp_path / "artifacts"
    art.mkdir()
    (art / "switch.pt").write_text("the loop's")
    with empty_artifacts(art) as empty:
        assert empty == art and list(art.iterdir()) == []
        (art / "child.txt").write_text("the child's")
    assert [p.name for p in art.iterdir()] == ["switch.pt"] and (art / "switch.pt").read_text() == "the loop's"
    assert not (tmp_path / "artifacts.loop").exists()


def _chained(rows, t, seed):
    """``rows`` stream rows of ``t`` tokens that overlap by one token, as the feeder cuts them."""
    ids = np.random.default_rng(seed).integers(0, 257, rows * (t - 1) + 1).astype(np.int64)
    return np.stack([ids[r * (t - 1): r * (t - 1) + t] for r in range(rows)])


@pytest.mark.slow
def test_the_children_cannot_relay_the_true_rows_through_the_artifacts_folder(tmp_path):
    """Red team (cheat 5, bundle ``relay``): the re-scoring child writes the real rows it scores
    to ``ctx.artifacts_dir``; the blind probe child, beside it, reads them back, restores its rows'
    true futures and peeks. Each child must see the folder empty (and the children run one after
    the other), so the probe sees no true token and catches the peek."""
    root, model, snap = _trained(tmp_path, "relay")
    tokens = _chained(4, 64, 11)
    assert all(tokens[b, -1] == tokens[b + 1, 0] for b in range(3))
    jail = Jail("none", str(root), (), Limits(), 1)
    from prism_challenge.evaluator.snapshots import file_sha256
    from prism_challenge.audit.rescore import plan, run_children

    filler = RNG.integers(0, 257, 500).astype(np.int64)
    a = {0: AuditedStep(0, {0: tokens}, {0: 0.0}, snap, file_sha256(snap))}
    jobs, _, paths, _ = plan(a, 1, filler, b"k" * 32)
    (tmp_path / "art").mkdir()
    got = run_children(jail, _config(root, tmp_path), jobs, paths, mode="rescore",
                       deadline=time.monotonic() + 120, writable=[str(tmp_path / "art")])
    (tmp_path / "art" / "relay.pt").unlink()  # the rank's run leaves the audit nothing: the folder is emptied
    peeked = got[0]["nats"]
    assert peeked < _nats(model, tokens) - 3.0 * 4 * 63  # the peek is on: a bonus of 4 nats at each target
    a[0].recorded[0] = peeked  # what the rank recorded (the relay is deterministic from the input)
    report = run_audit(_config(root, tmp_path), a, jail=jail, world_size=1, filler=filler, key=b"k" * 32,
                       timeout_s=300, artifacts_dir=str(tmp_path / "art"))
    assert report.error is None, report.error
    assert report.batches[0]["match"] is True
    assert report.mismatch is not None and report.mismatch.startswith("blind probe of audited batch 0, row ")


def test_empty_folders_removes_files_folders_and_links_without_following_them(tmp_path):
    from prism_challenge.evaluator.freshdir import empty_folders

    keep = tmp_path / "outside"
    keep.mkdir()
    (keep / "kept.txt").write_text("not the child's")
    art = tmp_path / "art"
    (art / "sub").mkdir(parents=True)
    (art / "relay.pt").write_bytes(b"rows")
    (art / "sub" / "deep.pt").write_bytes(b"rows")
    (art / "link").symlink_to(keep, target_is_directory=True)
    os.setxattr(art, "user.prism", b"rows")  # the folder's own metadata: red team 9's relay
    os.chmod(art, 0o755)
    os.utime(art, ns=(123_456_789, 987_654_321))
    empty_folders([art, tmp_path / "absent"])
    st = art.stat()  # before a listing, which moves the access time again (relatime)
    assert os.listxattr(art) == [] and stat.S_IMODE(st.st_mode) == 0o700 and (st.st_atime_ns, st.st_mtime_ns) == (0, 0)
    assert art.is_dir() and list(art.iterdir()) == []
    assert (keep / "kept.txt").read_text() == "not the child's"


@pytest.mark.slow
def test_the_children_cannot_relay_the_true_rows_through_the_folders_own_metadata(tmp_path):
    """Red team 9's ``xrelay``: ``relay`` with the rows in ``os.setxattr(ctx.artifacts_dir,
    "user.prism", ...)``; deleting the folder's entries kept them, and the blind probe passed a
    model that peeks at every target. The folder's metadata is reset before each child now."""
    root, model, snap = _trained(tmp_path, "xrelay")
    tokens = _chained(4, 64, 11)
    jail = Jail("none", str(root), (), Limits(), 1)  # the audit hooks armed
    from prism_challenge.evaluator.snapshots import file_sha256
    from prism_challenge.audit.rescore import plan, run_children

    filler = RNG.integers(0, 257, 500).astype(np.int64)
    a = {0: AuditedStep(0, {0: tokens}, {0: 0.0}, snap, file_sha256(snap))}
    jobs, _, paths, _ = plan(a, 1, filler, b"k" * 32)
    art = tmp_path / "art"
    art.mkdir()
    got = run_children(jail, _config(root, tmp_path), jobs, paths, mode="rescore",
                       deadline=time.monotonic() + 120, writable=[str(art)])
    assert "user.prism" in os.listxattr(art)  # the re-scoring child stored the rows there
    os.removexattr(art, "user.prism")  # the rank's run leaves the audit nothing
    peeked = got[0]["nats"]
    assert peeked < _nats(model, tokens) - 3.0 * 4 * 63  # the peek is on
    a[0].recorded[0] = peeked
    report = run_audit(_config(root, tmp_path), a, jail=jail, world_size=1, filler=filler, key=b"k" * 32,
                       timeout_s=300, artifacts_dir=str(art))
    assert report.error is None, report.error
    assert report.batches[0]["match"] is True
    assert report.mismatch is not None and report.mismatch.startswith("blind probe of audited batch 0, row ")


class _RecordingJail:
    """A jail stand-in with :class:`~prism_challenge.evaluator.jail.Jail`'s spare rule: ``run``
    feeds the spare if there is one, else starts a child; ``warm_next`` starts the next spare."""

    def __init__(self, events, fail=()):
        self.events, self.fail, self.n, self.alive, self.spare = events, set(fail), 0, set(), None

    def _start(self):
        name = f"c{self.n}"
        self.n += 1
        self.alive.add(name)
        self.events.append(("start", name))
        assert len(self.alive) <= 2
        return name

    def run(self, argv, input, timeout_s, writable, warm_next=False):
        from prism_challenge.evaluator.jailchild import Finished

        child, self.spare = self.spare or self._start(), None
        if warm_next:
            self.spare = self._start()
        self.events.append(("feed", child, input.decode()))
        self.alive.discard(child)
        count = int(input.decode().split(":")[1])
        ok = child not in self.fail
        body = ('{"ok": true, "jobs": [%s]}' % ", ".join(['{"i": 0}'] * count) if ok
                else '{"ok": false, "error": "score: boom"}')
        return Finished(0 if ok else 1, body.encode(), b"", False, None if ok else "exit 1", None)

    def drop_spare(self, argv, writable):
        if self.spare is not None:
            self.events.append(("drop", self.spare))
            self.alive.discard(self.spare)
            self.spare = None


def test_audit_children_are_fed_one_at_a_time_on_an_emptied_folder_with_the_next_one_warming(monkeypatch):
    from prism_challenge.audit import rescore

    events = []
    monkeypatch.setattr(rescore, "empty_folders", lambda folders: events.append(("empty", tuple(folders))))
    tasks = [("rescore", 2, lambda: b"r0:2"), ("rescore", 1, lambda: b"r1:1"), ("blind", 3, lambda: b"b0:3")]
    got = rescore._run_tasks(_RecordingJail(events), tasks, deadline=time.monotonic() + 60, writable=["/art"])
    assert [len(got["rescore"]), len(got["blind"])] == [3, 3]
    assert events == [
        ("empty", ("/art",)), ("start", "c0"), ("start", "c1"), ("feed", "c0", "r0:2"),
        ("empty", ("/art",)), ("start", "c2"), ("feed", "c1", "r1:1"),
        ("empty", ("/art",)), ("feed", "c2", "b0:3"),
    ]  # never more than two alive, each fed only after the folder was emptied, the last warms none
    events.clear()
    with pytest.raises(rescore.AuditError, match="score: boom"):
        rescore._run_tasks(_RecordingJail(events, fail={"c0"}), tasks, deadline=time.monotonic() + 60,
                           writable=["/art"])
    assert events[-1] == ("drop", "c1") and ("feed", "c1", "r1:1") not in events  # the spare: ended, never fed


def _fresh_size(parent: Path) -> int:
    probe = parent / "probe"
    probe.mkdir()
    size = probe.stat().st_size
    probe.rmdir()
    return size


def test_empty_folders_replaces_a_folder_that_grew_and_keeps_one_that_did_not(tmp_path):
    """A directory's size is a channel between two children: ext4 keeps a directory's blocks once
    its entries are deleted, so a child that made many entries leaves the emptied folder larger,
    and the next child reads ``os.stat(ctx.artifacts_dir).st_size``. A folder that grew is
    replaced (new inode, same owner); one that did not keeps its inode (a spare bound to it stays
    usable)."""
    from prism_challenge.evaluator.freshdir import empty_folders

    art = tmp_path / "art"
    art.mkdir()
    fresh = _fresh_size(tmp_path)
    inode = art.stat().st_ino
    (art / "one.pt").write_bytes(b"x")
    empty_folders([art])
    assert art.stat().st_ino == inode and art.stat().st_size == fresh
    for i in range(600):  # about 40 names of this length per 4 KiB block
        (art / f"{i:04d}{'n' * 80}").touch()
    grown = art.stat().st_size
    if grown == fresh:
        pytest.skip("this filesystem's directories do not grow with their entries")
    for p in list(art.iterdir()):
        p.unlink()
    if art.stat().st_size == fresh:
        pytest.skip("this filesystem shrinks an emptied directory itself")
    empty_folders([art])
    st = art.stat()
    assert st.st_size == fresh and st.st_ino != inode and (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    assert stat.S_IMODE(st.st_mode) == 0o700 and list(art.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # the size probe is gone


@pytest.mark.slow
@pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")
def test_the_children_cannot_relay_the_true_rows_through_the_page_cache(tmp_path):
    """Red team rt19's ``pcrelay``: the re-scoring child evicted pages of site-packages files
    (``posix_fadvise``), the blind probe child tested them (``preadv2(RWF_NOWAIT)``), and under
    strict isolation every blind probe passed a model that peeks at every target. The sandbox's
    kernel-call filter denies both now: the re-scoring still matches the record (the peek is
    on), the relay comes back empty and the blind probe catches the peek."""
    root, model, snap = _trained(tmp_path, "pcrelay")
    for p in [root, *root.iterdir()]:  # readable by the sandbox uid
        p.chmod(0o755 if p.is_dir() else 0o644)
    tokens = _chained(4, 64, 11)
    jail = Jail.open("strict", bundle_dir=root, hidden=[], limits=Limits(), threads=1)  # hooks armed
    from prism_challenge.evaluator.snapshots import file_sha256
    from prism_challenge.audit.rescore import plan, run_children

    filler = RNG.integers(0, 257, 500).astype(np.int64)
    a = {0: AuditedStep(0, {0: tokens}, {0: 0.0}, snap, file_sha256(snap))}
    jobs, _, paths, _ = plan(a, 1, filler, b"k" * 32)
    art = tmp_path / "art"
    art.mkdir()
    try:
        got = run_children(jail, _config(root, tmp_path), jobs, paths, mode="rescore",
                           deadline=time.monotonic() + 120, writable=[str(art)])
        peeked = got[0]["nats"]
        assert peeked < _nats(model, tokens) - 3.0 * 4 * 63  # the peek is on
        a[0].recorded[0] = peeked
        report = run_audit(_config(root, tmp_path), a, jail=jail, world_size=1, filler=filler, key=b"k" * 32,
                           timeout_s=300, artifacts_dir=str(art))
    finally:
        jail.close()
    assert report.error is None, report.error
    assert report.batches[0]["match"] is True
    assert report.mismatch is not None and report.mismatch.startswith("blind probe of audited batch 0, row ")
