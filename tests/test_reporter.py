"""A batch's report leaves while the loop trains (issue 28, item 3): the deferred read-back of the
loss, on the CPU, through the same code path a GPU run takes (a stand-in for the CUDA event that
the test releases by hand). Structural, no timing."""
import math
import socket
import threading

import numpy as np
import torch
from torch import nn

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.instrument import measure
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.reporter import PendingNats, Reporter, defer
from prism_challenge.evaluator.runner import Runtime

V = 257


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, 8), nn.Linear(8, V)

    def forward(self, x):
        return self.head(self.emb(x))


class HeldEvent:
    """Stands in for a CUDA event whose copy has not finished: ``synchronize`` blocks until the
    test releases it."""

    def __init__(self):
        self.done = threading.Event()
        self.waited = False

    def synchronize(self):
        self.waited = True
        assert self.done.wait(60)


def _reference_nats(model, tokens):
    """The batch's code length by an independent path: float64 cross entropy summed by hand."""
    with torch.no_grad():
        logits = model(tokens)[:, :-1].double()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return float(-lp.sum())


def test_the_record_is_the_value_before_training_even_when_read_back_after_it():
    model, tokens = Tiny(), torch.arange(16).reshape(2, 8) % V
    expected = _reference_nats(model, tokens)
    with torch.no_grad():
        scored = measure(model, tokens, V)
        pending = defer(scored.total)
        model.head.bias.add_(5.0)  # the loop trains on the batch before the value is read back
    assert pending.event is None and isinstance(pending.host, float)  # on the CPU: a float before training
    assert math.isclose(pending.value(), expected, rel_tol=1e-6)
    assert pending.value() == scored.nats  # one value, read twice: float64, bit for bit


def test_a_report_waits_for_its_event_and_the_loop_does_not():
    """The record leaves only once the device copy is done; the request for the next batch leaves
    after it; the thread that holds the batch never waited."""
    rank_end, feeder_end = socket.socketpair()
    event = HeldEvent()
    pending = PendingNats(torch.tensor(123.5, dtype=torch.float64), event)
    reporter = Reporter(rank_end, protocol.FrameReader(rank_end), 7, pending, audit=False, kept=None,
                        then=((Kind.NEXT, {"batch_size": 2, "seq_len": 8}),))
    feeder_end.settimeout(0.2)
    try:
        protocol.recv(feeder_end, 0)
        arrived_early = True
    except (TimeoutError, socket.timeout):
        arrived_early = False
    assert not arrived_early and reporter.running  # nothing left before the copy was done
    event.done.set()
    feeder_end.settimeout(30)
    assert protocol.recv(feeder_end, 0)[:2] == (Kind.RECORD, {"step": 7, "nats": 123.5})
    assert protocol.recv(feeder_end, 0)[:2] == (Kind.NEXT, {"batch_size": 2, "seq_len": 8})
    reporter.settle()
    assert event.waited and not reporter.running


def test_the_stream_hands_out_batch_k_before_its_record_leaves_and_never_k_plus_1_before_it():
    """Through the runner's stream with a fake feeder that answers as the real one does (an
    audited run: ANSWER after each RECORD). The feeder holds its answer to batch 0 back: the loop
    has batch 0 all the same, trains on it, and the record it gets is the value before training;
    batch 1 is asked for only after that answer."""
    rank_end, feeder_end = socket.socketpair()
    batches = [np.arange(16, dtype=np.int64).reshape(2, 8) % V, (np.arange(16, dtype=np.int64).reshape(2, 8) * 7) % V]
    release, frames = threading.Event(), []

    def feeder():
        assert protocol.recv(feeder_end, 0)[0] == Kind.NEXT
        for step, tokens in enumerate(batches):
            protocol.send(feeder_end, Kind.BATCH, {"step": step, "rows": 2, "seq_len": 8}, tokens.tobytes())
            kind, header, _ = protocol.recv(feeder_end, 0)
            frames.append((kind, header))
            if step == 0:
                assert release.wait(60)
            protocol.send(feeder_end, Kind.ANSWER, {"audited": [step, False]})
            frames.append(protocol.recv(feeder_end, 0)[:2])  # the request for the next batch
        protocol.send(feeder_end, Kind.END, {"reason": "token_budget"})
        frames.append(protocol.recv(feeder_end, 0)[:2])

    t = threading.Thread(target=feeder, daemon=True)
    t.start()
    config = {"vocab_size": V, "seed": 1, "tokenizer": "bytes", "device": "cpu", "audit": True,
              "max_parameters": 10**8}
    runtime = Runtime(protocol.FrameReader(rank_end), config, 1)
    model = Tiny()
    expected = [_reference_nats(model, torch.from_numpy(batches[0]))]
    stream = runtime._stream(model, 2, 8)
    first = next(stream)  # the loop has batch 0 while the feeder still holds its answer back
    assert first.step == 0 and runtime.sender is not None and runtime.sender.running
    with torch.no_grad():
        model.head.bias.add_(1.0)  # the loop trains on batch 0
    expected.append(_reference_nats(model, torch.from_numpy(batches[1])))
    assert [k for k, _ in frames] in ([], [Kind.RECORD])  # nothing after the record: no request for batch 1
    release.set()
    second = next(stream)
    assert second.step == 1 and np.array_equal(second.tokens.numpy(), batches[1])
    assert next(stream, None) is None
    t.join(30)
    kinds = [k for k, _ in frames]
    assert kinds == [Kind.RECORD, Kind.NEXT, Kind.RECORD, Kind.NEXT, Kind.EVENT]
    records = [h for k, h in frames if k == Kind.RECORD]
    assert [r["step"] for r in records] == [0, 1]
    for got, want in zip(records, expected):
        assert math.isclose(got["nats"], want, rel_tol=1e-6)
    assert frames[-1][1] == {"event": "end", "batches": 2}
