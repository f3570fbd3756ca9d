"""A scored batch's report leaves on a thread of its own while the loop trains on the batch.

Per batch ``k`` a rank sends, in this order on its socket: the loss record (RECORD ``k``); on an
audited run it reads the feeder's answer (ANSWER ``k``: is batch ``k`` audited?) and, when it is
and this is rank 0, sends the copy of the weights it kept from before the batch's scoring
forward (SNAPSHOT frames, SNAPSHOT_END); then the request for batch ``k + 1`` (NEXT). A
:class:`Reporter` does all of that on a daemon thread, so the loop gets batch ``k`` as soon as its
scoring forward is enqueued and the feeder's round trip overlaps the loop's training step.

The record's value on a GPU (:class:`PendingNats`): the scoring forward's total is copied to
pinned host memory with a non-blocking copy and a CUDA event is recorded right after it, both
enqueued on the current stream *before* the loop gets the batch. The reporter waits on that
event only (never on the whole device), then reads the value. The rank's host thread never
waits for the device between batches (no ``.item()``), and the device queue never waits for the
feeder.

Why the loss is still recorded before the loop trains on the batch (no lookahead):

* **On the device.** The scoring forward of batch ``k`` and the copy of its total are enqueued
  before batch ``k`` is handed to the loop, on the current stream. The loop can enqueue work on
  batch ``k`` only after that, and only on the same stream: the static gate admits no CUDA
  stream, graph or event API (:mod:`~prism_challenge.gates.allowlist`), so the device runs the
  scoring kernels, then the copy, then the loop's kernels, in that order. The value copied is
  the value of the weights before any training on batch ``k``.
* **On the trusted side.** The feeder serves batch ``k + 1`` only after batch ``k``'s record (and
  an audited batch's whole snapshot) arrived (:meth:`~prism_challenge.evaluator.feedbatch.BatchServer._on_next`):
  no rank ever holds two batches whose records are missing, whatever the rank's threads do.
* **The audit.** The copy of the weights is taken before the scoring forward; the trusted side
  re-scores audited batches from it and compares with their records, as before.

On the CPU the same code path runs; the value is already on the host when the batch is handed
over (CPU kernels run synchronously): it is read into a Python float before the loop gets the
batch, and :meth:`PendingNats.value` waits for nothing.
"""

from __future__ import annotations

import math
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.snapsend import send_snapshot


@dataclass
class PendingNats:
    """A batch's code length in nats, on its way from the device.

    Attributes:
        host: CUDA: ``[]`` float64 in pinned CPU memory, filled by a non-blocking copy. CPU: the
            value itself, a Python float (immutable: read before the loop got the batch).
        event: the CUDA event recorded after that copy, or ``None`` on the CPU.
    """

    host: torch.Tensor | float
    event: Any = None

    def value(self) -> float:
        """The float64 total (may be ``inf``/``nan``), once the copy is done: waits on the event
        alone (the host thread that calls this, never the device queue)."""
        if self.event is not None:
            self.event.synchronize()
        return float(self.host.item()) if isinstance(self.host, torch.Tensor) else float(self.host)


def defer(total: torch.Tensor) -> PendingNats:
    """Start reading a ``[]`` float64 total back from its device without waiting for it.

    CUDA: a pinned host tensor, a ``copy_(non_blocking=True)`` and an event, all enqueued on the
    current stream. CPU: the value, read at once (the kernels already ran: nothing to wait for),
    as a float no later code can change.
    """
    if total.device.type != "cuda":
        return PendingNats(float(total.item()))
    host = torch.empty((), dtype=total.dtype, pin_memory=True)
    host.copy_(total.detach(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return PendingNats(host, event)


class Reporter:
    """Sends batch ``step``'s record, reads the feeder's answer (audited runs), sends the kept
    snapshot when the batch is audited and this is rank 0, then sends ``then``: on a daemon
    thread, started at once. The runner sends and reads nothing on the socket until
    :meth:`settle` returned.

    Args:
        sock: the feeder's socket; reader: its :class:`~prism_challenge.evaluator.protocol.FrameReader`.
        step: the batch; nats: its pending code length.
        audit: whether the run is audited (the feeder answers every record).
        kept: rank 0 of an audited run: ``(step, state copy)`` taken before the scoring forward;
            ``None`` elsewhere. The caller keeps it alive until :meth:`settle` returned and frees
            it on its own thread (:attr:`~prism_challenge.evaluator.runner.Runtime.held`), so the
            loop's allocations do not depend on when this thread ran
            (:func:`~prism_challenge.evaluator.snapsend.send_snapshot`).
        then: payload-less frames sent last (the request for the next batch).
    """

    def __init__(self, sock: socket.socket, reader: protocol.FrameReader, step: int, nats: PendingNats,
                 audit: bool, kept: tuple[int, dict[str, torch.Tensor]] | None,
                 then: tuple[tuple[Kind, dict], ...] = ()):
        self.step = step
        self.error: BaseException | None = None
        self._args: tuple | None = (sock, reader, nats, audit, kept, then)
        self._thread = threading.Thread(target=self._run, name="prism-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock, reader, nats, audit, kept, then = self._args
        self._args = None
        try:
            value = nats.value()
            record = (Kind.RECORD, {"step": self.step, "nats": value if math.isfinite(value) else None})
            if not audit:  # no answer to wait for: the record and the request in one send
                protocol.send_small(sock, record, *then)
                return
            protocol.send(sock, *record)
            kind, header, _ = reader.recv(max_payload=0)
            answer = header.get("audited")
            if kind != Kind.ANSWER or not (isinstance(answer, list) and len(answer) == 2 and answer[0] == self.step):
                raise protocol.ProtocolError(f"expected the feeder's answer to batch {self.step}'s record, "
                                             f"got {kind.name}")
            if answer[1] is True and kept is not None:
                if kept[0] != self.step:
                    raise protocol.ProtocolError(f"batch {self.step} is audited, and its weights were not kept")
                send_snapshot(sock, self.step, kept[1])
            kept = None  # the copy itself stays alive with the caller (Runtime.held)
            if then:
                protocol.send_small(sock, *then)
        except BaseException as exc:  # noqa: BLE001 - handed to the runner's thread by settle()
            self.error = exc

    @property
    def running(self) -> bool:
        """Whether the thread still reports."""
        return self._thread.is_alive()

    def settle(self) -> None:
        """Wait for the thread's end.

        Raises:
            protocol.ProtocolError: the report could not be made (the socket closed, a frame out
                of order, a state dtype the harness cannot store), naming the batch.
        """
        self._thread.join()
        if isinstance(self.error, protocol.ProtocolError):
            raise self.error
        if self.error is not None:
            raise protocol.ProtocolError(f"the report of batch {self.step} could not be made: "
                                         f"{type(self.error).__name__}: {self.error}")
