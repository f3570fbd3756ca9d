"""Snapshots store each tensor once: a tied weight (two state_dict names, one storage) crosses the
socket and lands on the trusted disk once, every reader ties it again, and a malformed or lying
alias is the submission's problem, named, never a crash (issue 27)."""
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
from prism_challenge.evaluator.snapfile import ALIGN, MAGIC, read_snapshot, read_snapshot_file, write_snapshot
from prism_challenge.evaluator.snapsend import send_snapshot
from prism_challenge.evaluator.snapshots import AuditedStep, SnapshotStore, file_sha256, snapshot_name
from prism_challenge.evaluator.statedict import StateError, load_scored_state

from test_rescore import KEY, RNG, _config, _nats, _trained, audit_feeder
from test_feeder import FakeRunner

sys.path.insert(0, str(Path(__file__).parent / "rescore_bundles"))


class Tied(nn.Module):
    """``tok.weight`` [11, 8] tied to ``head.weight`` (one Parameter), an untied ``head.bias`` [11],
    a buffer ``scale`` [8] and an empty buffer."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)
        self.head.weight = self.tok.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("nothing", torch.zeros(0))

    def forward(self, x):
        return self.head(self.tok(x) * self.scale)


def _rank_snapshot(model, step=0):
    """The rank's copy (Runtime._state_before) of ``model`` sent over a socket pair: the frames."""
    from prism_challenge.evaluator.runner import Runtime

    rank_end, feeder_end = socket.socketpair()
    runtime = Runtime(protocol.FrameReader(rank_end), {"audit": True, "vocab_size": 11, "seed": 1, "tokenizer": "bytes",
                                                            "device": "cpu", "max_parameters": 10**6}, 0)
    kept = runtime._state_before(model, step)
    got = []
    t = threading.Thread(target=lambda: got.append(send_snapshot(rank_end, step, kept[1])))
    t.start()
    frames = []
    while not frames or frames[-1][0] != Kind.SNAPSHOT_END:
        frames.append(protocol.recv(feeder_end, 1 << 20))
    t.join(10)
    rank_end.close(), feeder_end.close()
    return frames, got[0]


def _store(tmp_path, frames, max_bytes=1 << 20):
    store = SnapshotStore(tmp_path / "audit", max_bytes)
    store.expect(0)
    audited = AuditedStep(0)
    for kind, header, payload in frames:
        if kind == Kind.SNAPSHOT:
            store.add(header, payload)
        else:
            store.end(header, audited)
    return store, audited


def test_a_tied_weight_crosses_the_socket_and_lands_on_disk_once(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    frames, sent = _rank_snapshot(model)
    heads = [(h["name"], h.get("alias"), len(p)) for _, h, p in frames[:-1]]
    assert heads == [("scale", None, 8 * 4), ("nothing", None, 0), ("tok.weight", None, 11 * 8 * 4),
                     ("head.weight", "tok.weight", 0), ("head.bias", None, 11 * 4)]
    assert sent == (8 + 88 + 11) * 4 and frames[-1][1] == {"step": 0, "tensors": 5}
    store, audited = _store(tmp_path, frames)
    assert store.total == (8 + 88 + 11) * 4 and not store.outgrew_fp32()
    # the file, computed here from the documented layout: MAGIC, each stored tensor 64-byte aligned,
    # the alias an entry over the tied bytes, the JSON index, its length, MAGIC
    entries, pos = [], len(MAGIC)
    for name, shape, nbytes in (("scale", [8], 32), ("nothing", [0], 0), ("tok.weight", [11, 8], 352),
                                ("head.bias", [11], 44)):
        pos += -pos % ALIGN
        entries.append([name, "torch.float32", shape, pos, nbytes])
        pos += nbytes
    entries.insert(3, ["head.weight", *entries[2][1:]])
    assert [e[3] for e in entries] == [64, 128, 128, 128, 512]
    index = json.dumps({"format": "prism-snapshot-1", "tensors": entries}, separators=(",", ":")).encode()
    data = audited.snapshot.read_bytes()
    assert len(data) == pos + len(index) + 8 + len(MAGIC)  # the tied [11, 8] is in it once
    assert data[pos : pos + len(index)] == index and audited.sha256 == file_sha256(audited.snapshot)
    back = read_snapshot_file(audited.snapshot)
    assert back["head.weight"] is back["tok.weight"] and torch.equal(back["tok.weight"], model.tok.weight)
    assert torch.equal(back["head.bias"], model.head.bias) and back["nothing"].shape == (0,)
    assert write_snapshot(model.state_dict(), tmp_path / "tool.snap") == audited.sha256  # the tools' writer agrees


def test_the_reloaded_model_is_tied_as_the_scored_one_and_stays_tied_when_moved(tmp_path):
    torch.manual_seed(1)
    scored = Tied()
    write_snapshot(scored.state_dict(), tmp_path / "s.snap")
    again = Tied()  # build_model's fresh module, other weights
    load_scored_state(again, read_snapshot_file(tmp_path / "s.snap"))
    assert again.head.weight is again.tok.weight and len(list(again.parameters())) == 2
    x = torch.tensor([[1, 5, 10, 0]])
    assert torch.equal(again(x), scored(x))  # bit for bit
    again.to(torch.float64)  # one object is moved once: still tied (two objects would be copied apart)
    assert again.head.weight is again.tok.weight and again.tok.weight.dtype == torch.float64
    # an untied model's equal values stay two objects
    plain = nn.Linear(3, 3)
    twins = {"weight": torch.ones(3, 3), "bias": torch.ones(3)}
    load_scored_state(plain, twins)
    assert plain.weight.data_ptr() != plain.bias.data_ptr()


def test_a_stream_reused_snapshot_keeps_its_alias_in_each_copy(tmp_path):
    import io

    from prism_challenge.evaluator.snapfile import SnapshotStream

    path = tmp_path / "s.snap"
    write_snapshot(Tied().state_dict(), path)
    stream = SnapshotStream(io.BufferedReader(io.BytesIO(struct.pack(">Q", path.stat().st_size) + path.read_bytes())),
                            [2])
    first, last = stream.load(0), stream.load(0)  # a copy at the first use, the file's views at the last
    for sd in (first, last):
        assert sd["head.weight"] is sd["tok.weight"]
    assert first["tok.weight"].data_ptr() != last["tok.weight"].data_ptr()


def _alias(name, of, dtype="torch.float32", shape=(4,), step=0):
    return {"step": step, "name": name, "alias": of, "dtype": dtype, "shape": list(shape)}


def _real(name, t, step=0):
    return {"step": step, "name": name, "dtype": str(t.dtype), "shape": list(t.shape)}, bytearray(t.numpy().tobytes())


@pytest.mark.parametrize("frames, message", [
    ([(_alias("b", "a"), b"")], "an alias of 'a', which this snapshot did not store before it"),
    ([(_alias("a", "a"), b"")], "an alias of 'a', which this snapshot did not store before it"),  # a cycle
    ([_real("a", torch.ones(4)), (_alias("b", "a"), b""), (_alias("c", "b"), b"")],
     "an alias of 'b', which this snapshot did not store before it"),  # a chain
    ([_real("a", torch.ones(4)), (_alias("b", "a", shape=(2, 2)), b"")],
     "an alias of 'a', which is torch.float32 [4], not torch.float32 [2, 2]"),
    ([_real("a", torch.ones(4)), (_alias("b", "a", dtype="torch.int32"), b"")],
     "an alias of 'a', which is torch.float32 [4], not torch.int32 [4]"),
    ([_real("a", torch.ones(4)), (_alias("b", "a"), bytearray(16))], "a malformed alias frame"),
    ([_real("a", torch.ones(4)), (_alias("b", ["a"]), b"")], "a malformed alias frame"),
    ([_real("a", torch.ones(4)), (_alias(7, "a"), b"")], "a malformed alias frame"),
    ([_real("a", torch.ones(4)), (_alias("a", "a"), b"")], "snapshot tensor 'a' of batch 0 sent twice"),
    ([_real("a", torch.ones(4)), (_alias("b", "a"), b""), _real("b", torch.ones(4))],
     "snapshot tensor 'b' of batch 0 sent twice"),
])
def test_a_malformed_alias_is_refused_by_name(tmp_path, frames, message):
    store = SnapshotStore(tmp_path / "audit", 1 << 20)
    store.expect(0)
    with pytest.raises(StateError) as err:
        for header, payload in frames:
            store.add(header, payload)
    assert message in str(err.value)
    store.abort()
    assert not (tmp_path / "audit").exists() or list((tmp_path / "audit").iterdir()) == []


def test_a_malformed_alias_fails_the_run_as_the_ranks_protocol_error(tmp_path):
    f = audit_feeder(tmp_path, step_budget=3, audited_batches=1)
    r = FakeRunner(f)
    r.next(2, 10)
    protocol.send_small(r.sock, (Kind.RECORD, {"step": 0, "nats": 7.5}), (Kind.NEXT, {"batch_size": 2, "seq_len": 10}))
    r.take()
    protocol.send(r.sock, Kind.SNAPSHOT, *_real("w", torch.ones(4)))
    protocol.send(r.sock, Kind.SNAPSHOT, _alias("v", "nope"))
    assert f.failed.wait(5)
    error = f.finish().error
    assert error["stage"] == "runner" and error["rank"] == 0
    assert error["message"] == ("rank 0: snapshot tensor 'v' of batch 0: an alias of 'nope', which this snapshot "
                                "did not store before it")
    assert not (tmp_path / "audit" / snapshot_name(0)).exists()  # the unfinished file went with the run


def _index_of(data, entries):
    """``data`` (a snapshot file's bytes) with its index replaced by ``entries``."""
    (size,) = struct.unpack("<Q", data[-16:-8])
    index = json.dumps({"format": "prism-snapshot-1", "tensors": entries}).encode()
    return np.frombuffer(data[: len(data) - 16 - size] + index + struct.pack("<Q", len(index)) + MAGIC,
                         dtype=np.uint8).copy()


def test_a_file_whose_entries_overlap_without_being_aliases_is_refused(tmp_path):
    write_snapshot({"a": torch.ones(32), "b": torch.zeros(16)}, tmp_path / "s.snap")
    data = (tmp_path / "s.snap").read_bytes()
    at = [e[3] for e in json.loads(data[-16 - struct.unpack("<Q", data[-16:-8])[0]: -16])["tensors"]]
    assert at == [64, 192]  # 8 bytes of MAGIC padded to 64; a's 128 bytes end at 192
    good = read_snapshot(_index_of(data, [["a", "torch.float32", [32], 64, 128], ["b", "torch.float32", [32], 64, 128]]))
    assert good["a"] is good["b"]  # an alias entry: one tensor
    with pytest.raises(StateError, match="not an alias"):
        read_snapshot(_index_of(data, [["a", "torch.float32", [32], 64, 128], ["b", "torch.float32", [4, 8], 64, 128]]))
    with pytest.raises(StateError, match="not an alias"):
        read_snapshot(_index_of(data, [["a", "torch.float32", [32], 64, 128], ["b", "torch.int32", [32], 64, 128]]))
    with pytest.raises(StateError, match="'a' and 'b' overlap without being aliases"):
        read_snapshot(_index_of(data, [["a", "torch.float32", [32], 64, 128], ["b", "torch.float32", [16], 128, 64]]))
    with pytest.raises(StateError, match="'b' and 'a' overlap without being aliases"):  # in any order
        read_snapshot(_index_of(data, [["a", "torch.float32", [16], 128, 64], ["b", "torch.float32", [32], 64, 128]]))


@pytest.mark.slow
def test_a_lying_alias_rescores_another_model_and_fails_the_audit(tmp_path):
    """The rank claims the untied ``head.weight`` [257, 32] is ``emb.weight`` (same dtype and
    shape): the store takes the claim (it is well formed), the re-scoring loads both names from
    the one stored tensor, and the record of the real model no longer matches: the audit names
    the batch, the submission's fault, as any edited snapshot."""
    from prism_challenge.evaluator.jail import Jail
    from prism_challenge.evaluator.isolation import Limits
    from prism_challenge.audit.rescore import run_audit

    root, model, _ = _trained(tmp_path, "honest")
    (tmp_path / "art").mkdir()
    state = model.state_dict()
    assert state["head.weight"].shape == state["emb.weight"].shape and not torch.equal(state["head.weight"],
                                                                                         state["emb.weight"])
    frames = [(Kind.SNAPSHOT, *_real("emb.weight", state["emb.weight"])),
              (Kind.SNAPSHOT, _alias("head.weight", "emb.weight", shape=(257, 32)), b""),
              (Kind.SNAPSHOT, *_real("head.bias", state["head.bias"])), (Kind.SNAPSHOT_END, {"step": 0, "tensors": 3}, b"")]
    _, audited = _store(tmp_path, frames)
    tokens = RNG.integers(0, 257, (3, 20)).astype(np.int64)
    audited.pieces, audited.recorded = {0: tokens}, {0: _nats(model, tokens)}  # the real model's record
    report = run_audit(_config(root, tmp_path), {0: audited}, jail=Jail("none", str(root), (), Limits(), 1), world_size=1,
                       filler=RNG.integers(0, 257, 500).astype(np.int64), key=KEY, timeout_s=120,
                       artifacts_dir=str(tmp_path / "art"))
    assert report.error is None and not report.passed and report.batches[0]["match"] is False
    assert report.mismatch.startswith(f"audited batch 0: recorded {audited.recorded[0]!r} nats, re-scored ")
    tied = {**state, "head.weight": state["emb.weight"]}  # what the claim re-scores, by hand
    liar = type(model)(257)
    liar.load_state_dict(tied)
    assert report.batches[0]["rescored_nats"] == [pytest.approx(_nats(liar, tokens), rel=1e-6)]
