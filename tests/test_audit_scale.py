"""An audit that scales (issue 26): snapshots written and hashed as their frames arrive, sent by
rank 0 while the loop trains, and re-scored several to a child, one held at a time."""
import hashlib
import io
import json
import socket
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.snapfile import (
    MAGIC,
    SnapshotStream,
    read_snapshot,
    read_snapshot_file,
    write_snapshot,
)
from prism_challenge.evaluator.snapshots import AuditedStep, SnapshotStore
from prism_challenge.evaluator.statedict import StateError, frames

sys.path.insert(0, str(Path(__file__).parent))
from test_rescore import RNG, _config, _nats, _trained  # noqa: E402


def _state():
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "n": torch.tensor([3], dtype=torch.int64), "m": torch.tensor([True, False, True]),
            "e": torch.zeros(0, 5)}


# -- the file ----------------------------------------------------------------------------------
def test_a_snapshot_file_reads_back_every_dtype_and_refuses_what_is_not_one(tmp_path):
    state = _state()
    digest = write_snapshot(state, tmp_path / "s.snap")
    raw = (tmp_path / "s.snap").read_bytes()
    assert digest == hashlib.sha256(raw).hexdigest() and raw[:8] == raw[-8:] == MAGIC
    back = read_snapshot_file(tmp_path / "s.snap")
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)
    index = json.loads(raw[raw.rindex(b'{"format"'):-16])
    assert all(off % 64 == 0 for _, _, _, off, _ in index["tensors"])  # aligned for any dtype
    for bad in (b"PK\x03\x04" + raw[4:], raw[:-1], raw[:40] + raw[-16:]):
        with pytest.raises(StateError):
            read_snapshot(np.frombuffer(bad, dtype=np.uint8).copy())
    # an entry whose shape disagrees with its bytes: refused, never read
    forged = raw.replace(b'"n","torch.int64",[1],', b'"n","torch.int64",[9],')  # the index keeps its length
    with pytest.raises(StateError, match="snapshot tensor 'n'"):
        read_snapshot(np.frombuffer(forged, dtype=np.uint8).copy())


def test_the_store_writes_each_frame_as_it_arrives_and_binds_the_files_own_sha256(tmp_path):
    store = SnapshotStore(tmp_path / "audit", 1 << 20)
    store.expect(4)
    state = _state()
    sizes = []
    for head, payload in frames(state):
        store.add({**head, "step": 4}, bytearray(payload))
        sizes.append((tmp_path / "audit" / "step-000004.snap").stat().st_size)  # on disk before the end
    assert sizes == sorted(sizes) and sizes[0] >= 8 + 48 and len(set(sizes)) >= 3
    a = AuditedStep(4)
    store.end({"step": 4, "tensors": len(state)}, a)
    # the digest bound when the last byte was written is the sha256 of the file, read independently
    assert a.sha256 == hashlib.sha256(a.snapshot.read_bytes()).hexdigest()
    assert all(torch.equal(read_snapshot_file(a.snapshot)[k], v) for k, v in state.items())
    # a second snapshot left unfinished is removed by abort()
    store.expect(5)
    head, payload = next(iter(frames(state)))
    store.add({**head, "step": 5}, bytearray(payload))
    store.abort()
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == ["step-000004.snap"]


# -- the rank ----------------------------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(257, 8), nn.Linear(8, 257)
        self.register_buffer("ballast", torch.zeros(4 << 20))  # 16 MiB: far more than a socket buffer

    def forward(self, x):
        return self.head(self.emb(x))


def test_the_loop_gets_its_batch_while_the_snapshot_is_still_on_its_way(tmp_path):
    """Structural, no timing: the fake feeder reads nothing after its answer until the test lets
    it, so the 16 MiB snapshot cannot have left; the loop holds its batch all the same. The
    request for the next batch reaches the feeder only after SNAPSHOT_END."""
    from prism_challenge.evaluator.runner import Runtime

    rank_end, feeder_end = socket.socketpair()
    tokens = np.arange(16, dtype=np.int64).reshape(2, 8)
    go, seen = threading.Event(), []

    def feeder():
        assert protocol.recv(feeder_end, 0)[0] == Kind.NEXT
        protocol.send(feeder_end, Kind.BATCH, {"step": 0, "rows": 2, "seq_len": 8}, tokens.tobytes())
        assert protocol.recv(feeder_end, 0)[0] == Kind.RECORD
        protocol.send(feeder_end, Kind.ANSWER, {"audited": [0, True]})
        go.wait(60)  # a rank that sent its snapshot before the loop got the batch: seen is then not empty
        state = {}
        while True:
            kind, header, payload = protocol.recv(feeder_end, 1 << 26)
            seen.append(kind)
            if kind == Kind.SNAPSHOT:
                flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
                state[header["name"]] = flat.reshape(header["shape"])
            if kind == Kind.NEXT:
                break
        seen.append(state)
        protocol.send(feeder_end, Kind.END, {"reason": "token_budget"})
        seen.append(protocol.recv(feeder_end, 0)[1])

    t = threading.Thread(target=feeder, daemon=True)
    t.start()
    config = {"vocab_size": 257, "seed": 1, "tokenizer": "bytes", "device": "cpu", "audit": True,
              "max_parameters": 10**8}
    runtime = Runtime(protocol.FrameReader(rank_end), config, 0)
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream = runtime._stream(model, 2, 8)
    batch = next(stream)  # the loop has batch 0 ...
    assert np.array_equal(batch.tokens.numpy(), tokens)
    assert runtime.sender is not None and runtime.sender.running and seen == []  # ... its snapshot has not left
    with torch.no_grad():
        model.head.bias.add_(1.0)  # the loop trains meanwhile: the snapshot is the copy taken before
    go.set()
    assert next(stream, None) is None  # the next request waited for the snapshot: then END
    t.join(30)
    kinds, state, event = seen[:-2], seen[-2], seen[-1]
    assert kinds == [Kind.SNAPSHOT] * len(before) + [Kind.SNAPSHOT_END, Kind.NEXT]
    assert all(torch.equal(state[k], v) for k, v in before.items()) and event["event"] == "end"
    assert runtime.sender is None


# -- the children ------------------------------------------------------------------------------
def _frames_of(paths):
    return b"".join(struct.pack(">Q", p.stat().st_size) + p.read_bytes() for p in paths)


def test_a_stream_of_three_snapshots_is_read_one_at_a_time(tmp_path):
    states = [{"w": torch.full((64,), float(i))} for i in range(3)]
    paths = [tmp_path / f"{i}.snap" for i in range(3)]
    for s, p in zip(states, paths):
        write_snapshot(s, p)
    stream = io.BufferedReader(io.BytesIO(_frames_of(paths)))
    feed = SnapshotStream(stream, [1, 2, 1])
    got = []
    for i in (0, 1, 1, 2):
        sd = feed.load(i)
        got.append(float(sd["w"][0]))
        sd["w"].add_(100)  # a model may write to what it loaded: the next use of snapshot 1 is intact
        del sd
    assert got == [0.0, 1.0, 1.0, 2.0] and feed.held_max == 1
    with pytest.raises(StateError, match="out of order"):
        feed.load(1)
    # a caller that keeps what it loaded holds two at once: the count can tell
    kept = SnapshotStream(io.BufferedReader(io.BytesIO(_frames_of(paths))), [1, 1, 1])
    held = [kept.load(i) for i in range(3)]
    assert kept.held_max == 3 and len(held) == 3


@pytest.mark.slow
def test_one_child_rescores_three_snapshots_holding_one_at_a_time(tmp_path):
    from prism_challenge.evaluator.isolation import Limits
    from prism_challenge.evaluator.jail import Jail
    from prism_challenge.audit.rescore import Job, _payloads, child_argv

    root, model, _ = _trained(tmp_path, "honest")
    (tmp_path / "art").mkdir()
    tokens = RNG.integers(0, 257, (3, 20)).astype(np.int64)
    paths, expected = [], []
    for i in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        paths.append(tmp_path / f"step-{i:06d}.snap")
        write_snapshot(model.state_dict(), paths[-1])
        expected.append(_nats(model, tokens))  # an independent path: the bigram's log-softmax by hand
    jobs = [Job(i, 0, i, tokens, []) for i in range(3)]
    [(mode, count, payload)] = _payloads(_config(root, tmp_path), jobs, paths, "rescore")
    feed = payload()
    assert (mode, count, feed.files) == ("rescore", 3, paths)  # one child for the three
    jail = Jail("none", str(root), (), Limits(), 1)
    done = jail.run(child_argv("cpu"), input=feed, timeout_s=120, writable=[str(tmp_path / "art")])
    reply = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert reply["ok"], reply
    assert [j["nats"] for j in reply["jobs"]] == [pytest.approx(e, rel=1e-6) for e in expected]
    assert reply["held"] == 1  # each snapshot released before the next was read
    assert feed.digests == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def test_a_snapshot_changed_after_it_was_hashed_is_named(tmp_path):
    from prism_challenge.evaluator.snapfile import SnapshotFeed

    path = tmp_path / "step-000000.snap"
    digest = write_snapshot({"w": torch.ones(3)}, path)
    feed = SnapshotFeed(b"head", [path], [digest])
    fed = b"".join(feed)
    assert fed == b"head" + struct.pack(">Q", path.stat().st_size) + path.read_bytes() and feed.changed() == []
    write_snapshot({"w": torch.zeros(3)}, path)
    feed = SnapshotFeed(b"head", [path], [digest])
    list(feed)
    assert feed.changed() == ["step-000000.snap"]


def test_a_cuda_spare_starts_its_device_in_the_prologue_and_a_cpu_one_does_not(monkeypatch):
    """No GPU here: torch's CUDA start is replaced by a recorder. The spare's argv names the
    device, so its prologue (before stdin, before the audit hook) is where CUDA starts."""
    from prism_challenge.audit import rescore_child
    from prism_challenge.audit.rescore import CHILD_ARGV, child_argv

    calls = []
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda n: calls.append(("set_device", n)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.append("device_count") or 1)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: calls.append(("empty", k.get("device"))))
    assert child_argv("cpu") == list(CHILD_ARGV) and child_argv("cuda:0")[-2:] == ["--device", "cuda"]
    assert rescore_child._device_arg(child_argv("cuda")[3:]) == "cuda"
    assert rescore_child._device_arg(["--stdin"]) == "cpu"
    assert rescore_child._device_arg(["--stdin", "--device"]) is None
    rescore_child._warm_up("cpu")
    assert calls == []
    rescore_child._warm_up("cuda")
    assert calls == ["init", ("set_device", 0), "device_count", ("empty", "cuda:0")]  # cudainit.start_cuda


def test_a_full_trusted_disk_is_the_submissions_fault_only_past_the_float32_size_at_the_cap(tmp_path):
    """Red team F2: a snapshot-write failure once earned every run a retry (under a new secret)."""
    from prism_challenge.evaluator.feedstate import SnapshotDiskError
    from prism_challenge.failures import kind_of

    cap = 16 * 1000  # the pipeline's cap: 16 bytes per element of a model at 1000 parameters
    store = SnapshotStore(tmp_path / "audit", cap)
    for step, dtype in ((0, torch.float32), (1, torch.float64)):
        store.expect(step)
        for head, payload in frames({"w": torch.zeros(1000, dtype=dtype)}):
            store.add({**head, "step": step}, bytearray(payload))
        store.end({"step": step, "tensors": 1}, AuditedStep(step))
        # 4000 bytes of 4000 allowed after one float32 snapshot; 12000 of 8000 after a float64 one
        assert (store.taken, store.total, store.outgrew_fp32()) == (step + 1, 4000 * (step + 1) + 4000 * step, step == 1)
    full = OSError(28, "No space left on device")
    assert (SnapshotDiskError(3, full, False).stage, SnapshotDiskError(3, full, True).stage) == ("storage", "resources")
    assert (kind_of("storage"), kind_of("resources")) == ("infrastructure", "submission")
    assert "more than 4 bytes per element" in str(SnapshotDiskError(3, full, True))
