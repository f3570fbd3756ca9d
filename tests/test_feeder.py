import math
import socket
import threading

import numpy as np
import pytest
import torch

from prism_challenge.evaluator import feedbatch
from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.feeder import Feeder, RowAssembler
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.statedict import frames
from prism_challenge.score.scoring import prequential_score

from helpers import chunks_of

RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 256, 1000).tolist()
NBYTES = RNG.integers(0, 5, 1000).tolist()


def drain(asm, rows, seq_len):
    cuts = []
    while (c := asm.cut(rows, seq_len)) is not None:
        cuts.append(c)
    return cuts


@pytest.mark.parametrize("rows, seq_len, chunk", [(3, 5, 7), (4, 2, 1000), (1, 512, 33), (7, 64, 100), (2, 999, 5)])
def test_every_token_after_the_first_is_a_target_once(rows, seq_len, chunk):
    cuts = drain(RowAssembler(iter(chunks_of(IDS, NBYTES, chunk))), rows, seq_len)
    targets = np.concatenate([c.tokens[:, 1:].reshape(-1) for c in cuts])
    assert targets.tolist() == IDS[1:]
    assert sum(int(c.target_bytes.sum()) for c in cuts) == sum(NBYTES[1:])
    # consecutive rows overlap by exactly one token, across batches too
    rows_all = [r for c in cuts for r in c.tokens]
    assert all(a[-1] == b[0] for a, b in zip(rows_all, rows_all[1:]))
    # full rows first, short batch at the end never padded
    assert all(c.tokens.shape[1] == seq_len for c in cuts[:-1])


def test_seq_len_2_and_512_score_the_same_targets_and_bytes():
    a = drain(RowAssembler(iter(chunks_of(IDS, NBYTES, 50))), 4, 2)
    b = drain(RowAssembler(iter(chunks_of(IDS, NBYTES, 50))), 4, 512)
    assert sum(c.tokens.shape[0] * (c.tokens.shape[1] - 1) for c in a) == 999
    assert sum(c.tokens.shape[0] * (c.tokens.shape[1] - 1) for c in b) == 999
    assert sum(int(c.target_bytes.sum()) for c in a) == sum(int(c.target_bytes.sum()) for c in b) == sum(NBYTES[1:])


def test_short_final_batch_has_fewer_rows_then_a_short_row():
    # 1000 tokens, rows of 10 (9 targets): 111 full rows cover 999 targets exactly
    cuts = drain(RowAssembler(iter(chunks_of(IDS, NBYTES, 64))), 50, 10)
    assert [c.tokens.shape for c in cuts] == [(50, 10), (50, 10), (11, 10)]
    # 1000 tokens, rows of 8 (7 targets): 142 full rows (994 targets), then one row of 6 tokens
    cuts = drain(RowAssembler(iter(chunks_of(IDS, NBYTES, 64))), 100, 8)
    assert [c.tokens.shape for c in cuts] == [(100, 8), (42, 8), (1, 6)]


def test_token_budget_truncates_the_stream():
    asm = RowAssembler(iter(chunks_of(IDS, NBYTES, 10)), token_budget=101)
    cuts = drain(asm, 3, 11)
    assert sum(c.tokens.size - c.tokens.shape[0] for c in cuts) == 100
    assert asm.tokens_consumed == 101 and asm.budget_hit


class FakeRunner:
    """Speaks the runner's side of the protocol without a model."""

    def __init__(self, feeder, rank=0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(feeder.socket_path)
        protocol.send(self.sock, Kind.HELLO, {"rank": rank, "local_rank": rank, "world_size": feeder.world_size,
                                              "pid": 1, "token": feeder.token})
        kind, self.config, _ = protocol.recv(self.sock, 0)
        assert kind == Kind.CONFIG
        self.audits = []  # the feeder's answers to the records (no audit dir: never audited)

    def next(self, b, t):
        protocol.send(self.sock, Kind.NEXT, {"batch_size": b, "seq_len": t})
        return self.take()

    def take(self):
        """Read the frame already asked for (as the runner does after a record sent with NEXT)."""
        kind, header, payload = protocol.recv(self.sock, 1 << 24)
        while kind == Kind.ANSWER:  # the answer to the previous record (audited runs), sent at once
            self.audits.append(header["audited"])
            kind, header, payload = protocol.recv(self.sock, 1 << 24)
        if kind == Kind.END:
            protocol.send(self.sock, Kind.EVENT, {"event": "end"})
            return None
        return np.frombuffer(payload, dtype=np.int64).reshape(header["rows"], header["seq_len"])

    def record(self, step, nats):
        protocol.send(self.sock, Kind.RECORD, {"step": step, "nats": nats})


def make_feeder(tmp_path, world_size=1, **kw):
    f = Feeder(str(tmp_path / "f.sock"), iter(chunks_of(IDS, NBYTES, 37)), {"seed": 1}, world_size=world_size,
               vocab_size=257, **kw)
    f.start()
    return f


def test_feeder_records_and_charges_nonfinite(tmp_path):
    f = make_feeder(tmp_path, step_budget=3)
    r = FakeRunner(f)
    b0 = r.next(4, 10)
    assert b0.tolist()[0] == IDS[:10]
    r.record(0, 10.0)
    r.next(4, 10)
    r.record(1, None)  # non-finite loss
    r.next(4, 10)
    r.record(2, 5.0)
    assert r.next(4, 10) is None
    protocol.send(r.sock, Kind.DONE, {"peak_rss_bytes": 1})
    for _ in range(100):
        if f.all_done():
            break
        threading.Event().wait(0.01)
    res = f.finish()
    assert res.stop_reason == "step_budget" and res.nonfinite_batches == 1
    assert [s.targets for s in res.steps] == [36, 36, 36]
    assert res.steps[1].nats == pytest.approx(2 * math.log(257) * 36)
    assert res.tokens_consumed == 109
    score = prequential_score(res.steps)
    assert score.bytes == sum(NBYTES[1:109])
    assert score.prequential_bpb == pytest.approx((15.0 + 72 * math.log(257)) / math.log(2) / score.bytes)


def test_no_lookahead_next_before_record_fails_the_run(tmp_path):
    f = make_feeder(tmp_path)
    r = FakeRunner(f)
    r.next(2, 8)
    protocol.send(r.sock, Kind.NEXT, {"batch_size": 2, "seq_len": 8})
    assert f.failed.wait(5)
    res = f.finish()
    assert "before reporting the loss of batch 0" in res.error["message"]


def test_wrong_token_is_refused(tmp_path):
    f = make_feeder(tmp_path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(f.socket_path)
    protocol.send(s, Kind.HELLO, {"rank": 0, "token": "guess"})
    with pytest.raises(protocol.ProtocolError):
        protocol.recv(s, 0)
    f.finish()


def test_two_ranks_split_one_global_batch(tmp_path):
    f = make_feeder(tmp_path, world_size=2, step_budget=1)
    r0, r1 = FakeRunner(f, 0), FakeRunner(f, 1)
    a, b = r0.next(3, 5), r1.next(3, 5)
    assert a.shape == b.shape == (3, 5)
    rows = np.concatenate([a, b])
    assert np.concatenate([rows[:, 1:].reshape(-1)]).tolist() == IDS[1:25]
    r0.record(0, 1.0)
    r1.record(0, 2.0)
    assert r0.next(3, 5) is None and r1.next(3, 5) is None
    res = f.finish()
    assert len(res.steps) == 1 and res.steps[0].nats == 3.0 and res.steps[0].targets == 24


def wait_done(f, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if f.all_done():
            return True
        threading.Event().wait(0.01)
    return False


def test_batch_asked_for_ahead_but_never_taken_is_neither_scored_nor_counted(tmp_path):
    # the runner asks for batch k+1 in the same write as the record of batch k (as the real one does)
    f = make_feeder(tmp_path)
    r = FakeRunner(f)
    b0 = r.next(2, 10)
    assert b0.shape == (2, 10)
    protocol.send_small(r.sock, (Kind.RECORD, {"step": 0, "nats": 4.0}), (Kind.NEXT, {"batch_size": 2, "seq_len": 10}))
    # batch 1 now waits in the socket; the loop leaves instead of reading it
    protocol.send(r.sock, Kind.EVENT, {"event": "left", "batches": 1})
    protocol.send(r.sock, Kind.DONE, {})
    assert wait_done(f)
    res = f.finish()
    assert [s.step for s in res.steps] == [0] and res.steps[0].targets == 18
    assert res.tokens_consumed == 19  # 2 rows of 10 sharing one token; batch 1's tokens are not counted
    assert res.stop_reason == "loop_stopped" and res.error is None


def test_a_rank_that_never_reads_a_large_batch_cannot_block_its_final_reports(tmp_path):
    # batch 2 MiB and state 4 MiB: far beyond a Unix socket's buffer in both directions
    n = 600_000
    ids = RNG.integers(0, 256, n)
    f = Feeder(str(tmp_path / "f.sock"), iter(chunks_of(ids.tolist(), [1] * n, 100_000)), {"seed": 1},
               vocab_size=257)
    f.start()
    r = FakeRunner(f)
    b0 = r.next(64, 4096)
    assert b0.shape == (64, 4096) and b0[0].tolist() == ids[:4096].tolist()
    protocol.send_small(r.sock, (Kind.RECORD, {"step": 0, "nats": 1.0}), (Kind.NEXT, {"batch_size": 64, "seq_len": 4096}))
    threading.Event().wait(0.2)  # the feeder is now sending batch 1, which nobody reads

    def final_reports():  # on a thread: with a feeder that stopped reading, these sends would block
        protocol.send(r.sock, Kind.EVENT, {"event": "left", "batches": 1})
        for header, payload in frames({"w": torch.arange(1 << 20, dtype=torch.float32)}):
            protocol.send(r.sock, Kind.STATE, header, payload)
        protocol.send(r.sock, Kind.DONE, {})

    threading.Thread(target=final_reports, daemon=True).start()
    assert wait_done(f), f"the feeder stopped reading while a batch was stuck in the socket: {f.result.error}"
    res = f.finish()
    assert res.error is None and len(res.steps) == 1
    assert torch.equal(res.state["w"], torch.arange(1 << 20, dtype=torch.float32))


def early(r, step, nats, b, t):
    protocol.send_small(r.sock, (Kind.RECORD, {"step": step, "nats": nats}), (Kind.NEXT, {"batch_size": b, "seq_len": t}))


def test_two_ranks_that_stop_at_the_same_batch_are_in_step(tmp_path):
    f = make_feeder(tmp_path, world_size=2)
    r0, r1 = FakeRunner(f, 0), FakeRunner(f, 1)
    r0.next(2, 5), r1.next(2, 5)
    early(r0, 0, 1.0, 2, 5)
    early(r1, 0, 1.0, 2, 5)  # both asked for batch 1 ahead; both loops stop after batch 0
    for r in (r0, r1):
        protocol.send(r.sock, Kind.EVENT, {"event": "left", "batches": 1})
        protocol.send(r.sock, Kind.DONE, {})
    assert wait_done(f)
    res = f.finish()
    assert res.error is None and len(res.steps) == 1 and res.tokens_consumed == 17


def test_a_rank_that_takes_a_batch_its_peer_left_before_fails_the_run(tmp_path):
    f = make_feeder(tmp_path, world_size=2)
    r0, r1 = FakeRunner(f, 0), FakeRunner(f, 1)
    r0.next(2, 5), r1.next(2, 5)
    early(r0, 0, 1.0, 2, 5)
    early(r1, 0, 1.0, 2, 5)
    protocol.send(r1.sock, Kind.EVENT, {"event": "left", "batches": 1})
    assert r0.take().shape == (2, 5)  # rank 0's loop takes batch 1 ...
    early(r0, 1, 1.0, 2, 5)  # ... and scores it: out of step with rank 1
    assert f.failed.wait(5)
    res = f.finish()
    assert res.error["stage"] == "contract" and "rank 1 left ctx.iter_train_batches after 1 batch" in res.error["message"]


def test_a_runner_that_records_batches_it_never_read_is_stopped(tmp_path, monkeypatch):
    # the trusted side holds at most one unsent batch per rank: it does not queue the stream
    monkeypatch.setattr(feedbatch, "DRAIN_WAIT_S", 0.5)
    n = 600_000
    f = Feeder(str(tmp_path / "f.sock"), iter(chunks_of(RNG.integers(0, 256, n).tolist(), [1] * n, 100_000)),
               {"seed": 1}, vocab_size=257)
    f.start()
    r = FakeRunner(f)
    r.next(64, 4096)
    early(r, 0, 1.0, 64, 4096)  # batch 1 (2 MiB) is now on its way, and never read
    early(r, 1, 1.0, 64, 4096)  # a record of batch 1 all the same
    assert f.failed.wait(5)
    res = f.finish()
    assert "asked for batch 2 while batch 1 was still unread" in res.error["message"]


def test_a_rank_stuck_in_its_last_step_is_caught_after_the_end_was_sent(tmp_path):
    f = make_feeder(tmp_path, world_size=2, step_budget=1)
    r0, r1 = FakeRunner(f, 0), FakeRunner(f, 1)
    r0.next(2, 5), r1.next(2, 5)
    early(r0, 0, 1.0, 2, 5)
    early(r1, 0, 1.0, 2, 5)  # both are sent END in answer; only rank 0's loop reads it
    assert r0.take() is None
    protocol.send(r0.sock, Kind.DONE, {})
    threading.Event().wait(0.4)
    stalled = f.check_stall(0.2)
    assert stalled is not None and stalled[2] == 1 and "rank 1 made no progress" in stalled[1]
    f.finish()


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_loop_that_never_asks_for_a_batch_is_caught_after_the_timeout(tmp_path, world_size):
    f = make_feeder(tmp_path, world_size=world_size)
    runners = [FakeRunner(f, r) for r in range(world_size)]  # connected, configured, then silent
    assert f.check_first_batch(0.2) is None  # just released
    threading.Event().wait(0.4)
    assert f.check_first_batch(10.0) is None  # not yet 10 s
    assert f.check_stall(0.2) is None  # the stall rules start with the first batch
    msg = f.check_first_batch(0.2)
    assert msg is not None and msg.startswith("no batch was asked for 0 s after the start")
    assert "never reached ctx.iter_train_batches" in msg
    assert runners[0].next(2, 5) is not None  # taken, but its scoring forward never returns
    for _ in range(100):  # the feeder counts the batch as served just after it sent it
        msg = f.check_first_batch(0.2)
        if msg is not None and not msg.startswith("no batch was asked for"):
            break
        threading.Event().wait(0.01)
    assert msg is not None and msg.startswith("no batch was scored 0 s after the start: the first batch was taken")
    runners[0].record(0, 1.0)  # one batch scored: the stall rules take over
    for _ in range(100):
        if f.check_first_batch(0.2) is None:
            break
        threading.Event().wait(0.01)
    assert f.check_first_batch(0.2) is None
    f.finish()


def test_probe_schedule_is_fixed_by_the_key_and_differs_between_keys(tmp_path):
    a = Feeder(str(tmp_path / "a.sock"), iter([]), {}, vocab_size=257, probe_key=b"k1")
    b = Feeder(str(tmp_path / "b.sock"), iter([]), {}, vocab_size=257, probe_key=b"k1")
    c = Feeder(str(tmp_path / "c.sock"), iter([]), {}, vocab_size=257, probe_key=b"k2")
    sched = lambda f: [f._probe(step, 8, 64) for step in range(800)]  # noqa: E731
    sa, sb, sc = sched(a), sched(b), sched(c)
    assert sa == sb and sa != sc
    probed = [p for p in sa if p is not None]
    # the first PROBE_FIRST steps always, then about PROBE_RATE of the rest (800 draws: 2 + ~50)
    assert all(sa[i] is not None for i in range(feedbatch.PROBE_FIRST))
    assert 20 < len(probed) < 100
    assert all(1 <= k < 64 and 1 <= shift < 257 and 0 <= row < 8 for k, shift, row in probed)
    for f in (a, b, c):
        f.close()


@pytest.mark.parametrize("key", [b"k1", None])
def test_every_rank_gets_the_same_probes_at_the_same_steps(tmp_path, key):
    # lockstep: a collective inside forward needs every rank to run the probe's forward too
    f = Feeder(str(tmp_path / "f.sock"), iter([]), {}, world_size=3, vocab_size=257, probe_key=key)
    per_rank = {r: [] for r in range(3)}
    for step in range(300):
        for r, rows in ((2, 5), (0, 5), (1, 4)):  # ranks ask in any order; rank 1 holds fewer rows
            per_rank[r].append(f._probe(step, rows, 64))
    steps = [[p is not None for p in per_rank[r]] for r in range(3)]
    assert steps[0] == steps[1] == steps[2] and 5 < sum(steps[0]) < 60
    for a, b in zip(per_rank[0], per_rank[1]):
        assert (a is None) == (b is None) and (a is None or (a[:2] == b[:2] and b[2] < 4 and a[2] < 5))
    assert per_rank[0] == per_rank[2]
    if key is None:  # no key given: a fresh secret key from `secrets`, never a guessable one
        g = Feeder(str(tmp_path / "g.sock"), iter([]), {}, vocab_size=257)
        assert len(f._probe_key) == 32 and f._probe_key != g._probe_key
        g.close()
    f.close()


def test_feeder_refuses_a_batch_shape_outside_the_run_limits(tmp_path):
    f = Feeder(str(tmp_path / "f.sock"), iter(chunks_of(IDS, NBYTES, 37)), {"sequence_length": 16}, vocab_size=257)
    f.start()
    r = FakeRunner(f)
    protocol.send(r.sock, Kind.NEXT, {"batch_size": 10**9, "seq_len": 32})
    assert f.failed.wait(5)
    res = f.finish()
    assert "seq_len in 2..16" in res.error["message"] and not res.steps


def test_frame_reader_reads_coalesced_split_and_oversized_frames_exactly():
    # the buffered reader sees the same frames as the unbuffered one, however the bytes arrive:
    # several frames in one write, one frame in many writes, payloads larger than its buffer
    big = bytes(range(256)) * ((protocol.FrameReader.BUFFER * 3) // 256 + 7)  # 3x the buffer, not aligned
    sent = [(Kind.RECORD, {"step": 0, "nats": 1.5}, b""), (Kind.NEXT, {"batch_size": 2, "seq_len": 8}, b""),
            (Kind.BATCH, {"step": 1, "rows": 1, "seq_len": 3}, np.arange(3, dtype=np.int64).tobytes()),
            (Kind.STATE, {"name": "w", "note": "x" * 300_000}, big), (Kind.DONE, {}, b"")]
    wire = b"".join(protocol.encode(k, h, len(p)) + p for k, h, p in sent)
    a, b = socket.socketpair()
    try:
        def write():
            cut = [0, 5, 9, 11, 200, 70_000, 70_001, len(wire) // 2, len(wire)]
            for lo, hi in zip(cut, cut[1:]):
                a.sendall(wire[lo:hi])
        t = threading.Thread(target=write)
        t.start()
        reader = protocol.FrameReader(b)
        got = [reader.recv(max_payload=len(big)) for _ in sent]
        t.join()
    finally:
        a.close()
        b.close()
    assert [(k, h, bytes(p)) for k, h, p in got] == sent
    assert np.frombuffer(got[2][2], dtype=np.int64).tolist() == [0, 1, 2]


def test_frame_reader_refuses_an_oversized_payload_before_reading_it():
    a, b = socket.socketpair()
    try:
        a.sendall(protocol.encode(Kind.RECORD, {"step": 0}, payload_length=1 << 20))
        with pytest.raises(protocol.ProtocolError, match="oversized frame"):
            protocol.FrameReader(b).recv(max_payload=0)
        a.close()
        with pytest.raises(protocol.ProtocolError, match="closed by peer"):
            protocol.FrameReader(b).recv(max_payload=0)
    finally:
        b.close()


def test_a_state_frame_over_the_state_budget_is_refused_before_its_payload_is_allocated(tmp_path):
    f = make_feeder(tmp_path, max_state_bytes=1000)
    r = FakeRunner(f)
    r.sock.sendall(protocol.encode(Kind.STATE, {"name": "w", "dtype": "float32", "shape": [1 << 28]},
                                   payload_length=1 << 30))  # 1 GiB announced, never sent
    assert f.failed.wait(5)
    res = f.finish()
    assert res.error["stage"] == "runner" and "oversized frame" in res.error["message"]
    assert res.error["rank"] == 0


@pytest.mark.parametrize("header, why", [(b"[" * 100_000, "deep nesting"), (b'{"n":' + b"9" * 5000 + b"}", "huge int"),
                                         (b"\xff\xfe", "not UTF-8"), (b"[1]", "not an object")])
def test_a_hostile_frame_header_is_a_protocol_error(header, why):
    frame = protocol._PREFIX.pack(int(Kind.RECORD), len(header), 0) + header
    for read in (lambda s: protocol.recv(s, 0), lambda s: protocol.FrameReader(s).recv(0)):
        a, b = socket.socketpair()
        try:
            a.sendall(frame)
            with pytest.raises(protocol.ProtocolError, match="frame header is not"):
                read(b)
        finally:
            a.close()
            b.close()


def test_a_rank_still_compiling_its_first_forward_is_not_a_stall(tmp_path):
    # rank 1 recorded batch 0; rank 0 took it and is still in its first scoring forward (a first
    # torch.compile can take minutes): its stall clock starts at its first record, so until then
    # it is held to first_timeout (prism eval: --idle-timeout), not to the rank timeout
    f = make_feeder(tmp_path, world_size=2)
    r0, r1 = FakeRunner(f, 0), FakeRunner(f, 1)
    r0.next(2, 5), r1.next(2, 5)
    early(r1, 0, 1.0, 2, 5)
    threading.Event().wait(0.5)
    assert f.check_stall(0.2, first_timeout=30.0) is None
    stalled = f.check_stall(0.2, first_timeout=0.3)  # past its first-record allowance: hung
    assert stalled is not None and stalled[0] == "consistency" and stalled[2] == 0
    assert "rank 0 made no progress" in stalled[1]
    early(r0, 0, 1.0, 2, 5)  # its first record: from now on the rank timeout holds it
    for _ in range(100):
        if f.check_stall(0.2, first_timeout=30.0) is None:
            break
        threading.Event().wait(0.01)
    assert f.check_stall(0.2, first_timeout=30.0) is None  # both took one batch: in step
    f.finish()
