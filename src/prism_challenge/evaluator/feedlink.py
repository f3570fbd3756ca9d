"""The feeder's link to each rank: what it keeps of a rank, and the frames it sends to it.

:class:`RankState` is the trusted side's bookkeeping of one connected rank. :class:`RankLink` (a
base of :class:`~prism_challenge.evaluator.feeder.Feeder`) sends a frame to a rank without ever
blocking the thread that reads that rank: what the socket does not take at once goes to the
rank's writer thread, in order.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.snapshots import SnapshotStore


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@dataclass
class RankState:
    """Per-rank bookkeeping on the trusted side."""

    rank: int
    sock: socket.socket
    pid: int = 0
    step: int = 0  # next step to serve
    taken: int = 0  # batches the loop took: served, scored and recorded
    pending: dict[str, int] | None = None  # served, not yet recorded: {"step","targets","bytes"}
    outbox: queue.Queue = field(default_factory=queue.Queue)  # bytes the writer thread sends in order
    backlog: bool = False  # the writer thread has bytes to send: later frames queue behind them
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    drained: threading.Event = field(default_factory=lambda: _set(threading.Event()))  # outbox empty
    done: dict[str, Any] | None = None
    end_sent: bool = False  # the stream's end was sent (in answer to a request made ahead)
    ended: bool = False  # the loop asked past the last batch: the runner read the end
    last_active: float = field(default_factory=time.monotonic)
    left: bool = False  # the loop dropped the stream before its end
    state_bytes: int = 0
    snapshots: SnapshotStore | None = None  # rank 0: the audited batches' snapshots


class RankLink:
    """Sends frames to the ranks (a base of :class:`~prism_challenge.evaluator.feeder.Feeder`):
    :meth:`_send` from a rank's reading thread, :meth:`_write` on that rank's writer thread."""

    def _send(self, st: RankState, kind: Kind, header: dict[str, Any], payload: memoryview | bytes = b"") -> None:
        """Send a frame to a rank without ever blocking this (reading) thread.

        The frame goes out directly when the socket takes it whole; what it does not take is
        queued for the rank's writer thread (a rank that never reads its last batch must not
        stop the feeder from reading that rank's final reports).
        """
        head = protocol.encode(kind, header, len(payload))
        with st.send_lock:
            if not st.backlog:
                try:
                    sent = st.sock.sendmsg([head, payload], (), socket.MSG_DONTWAIT) if len(payload) else (
                        st.sock.send(head, socket.MSG_DONTWAIT))
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return
                if sent == len(head) + len(payload):
                    return
                st.backlog = True
                st.drained.clear()
            else:
                sent = 0
            st.outbox.put((bytes(head) + bytes(payload))[sent:])

    def _write(self, st: RankState) -> None:
        """The rank's writer thread: sends the queued bytes in order until ``None`` or a closed socket."""
        while (data := st.outbox.get()) is not None:
            try:
                st.sock.sendall(data)
            except OSError:
                return
            with st.send_lock:
                if st.outbox.empty():
                    st.backlog = False
                    st.drained.set()
