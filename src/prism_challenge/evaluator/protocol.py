"""Framing of the feeder socket between the trusted parent and each rank's runner.

A frame is ``kind`` (1 byte), ``header length`` (4 bytes, little endian), ``payload length``
(4 bytes), then a UTF-8 JSON header and a raw payload. Headers carry small records; the payload
carries a batch's token ids. The trusted side never unpickles anything from the untrusted side
and bounds every length it reads.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from enum import IntEnum
from typing import Any

_PREFIX = struct.Struct("<BII")
MAX_HEADER = 1 << 20  # 1 MiB: records and error reports are far smaller
MAX_BATCH_TOKENS = 1 << 24  # 16 Mi tokens per batch: far above any sane batch, bounds memory
MAX_STATE_TENSOR_BYTES = (1 << 32) - 1  # one STATE frame: a tensor of the scored model
ENV_SOCKET = "PRISM_FEEDER_SOCKET"  # the rank's environment: the feeder socket's path
ENV_TOKEN = "PRISM_FEEDER_TOKEN"  # and the token its HELLO must carry
LISTEN_SPARE = 4  # the feeder socket's backlog beyond one connection per rank


CONTEXT_FIELDS = ("seed", "vocab_size", "sequence_length", "max_parameters", "world_size", "artifacts_dir",
                  "token_budget", "step_budget", "tokenizer_name")
"""The :class:`~prism_challenge.evaluator.interface.PrismContext` fields every process that runs the submission gets from the run's
configuration (the ranks and the audit's children alike); ``rank``, ``local_rank``, ``device``
and the runtime are the process's own."""


def context_values(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The :data:`CONTEXT_FIELDS` of a run configuration (the feeder's CONFIG: ``tokenizer`` is
    the tokenizer's name, absent budgets are ``None``)."""
    return {"seed": config["seed"], "vocab_size": config["vocab_size"], "sequence_length": config["sequence_length"],
            "max_parameters": config["max_parameters"], "world_size": world_size,
            "artifacts_dir": config["artifacts_dir"], "token_budget": config.get("token_budget"),
            "step_budget": config.get("step_budget"), "tokenizer_name": config["tokenizer"]}


def listen(path: str, ranks: int) -> socket.socket:
    """The feeder's listening Unix socket at ``path`` (a stale file there is replaced), with room
    for ``ranks`` + :data:`LISTEN_SPARE` connections not yet accepted: a rank that connects
    before the feeder's accept loop runs waits in it.

    Raises:
        OSError: the path cannot be bound (too long: Unix socket paths hold ~107 bytes).
    """
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)
        server.bind(path)
        server.listen(ranks + LISTEN_SPARE)
    except OSError:
        server.close()
        raise
    return server


class Kind(IntEnum):
    """Frame kinds. R->F: runner to feeder; F->R: feeder to runner."""

    HELLO = 1  # R->F {rank, local_rank, world_size, pid}
    CONFIG = 2  # F->R the run configuration (seed, tokenizer, device, budgets, bundle)
    NEXT = 3  # R->F {batch_size, seq_len}: ask for the next batch (sent with the previous RECORD, or
    # after its ANSWER in an audited run)
    BATCH = 4  # F->R {step, rows, seq_len[, probe]} + int64 token ids [rows, seq_len]
    END = 5  # F->R {reason}: the stream is over for this rank
    RECORD = 6  # R->F {step, nats}: the loss of the batch just scored
    EVENT = 7  # R->F {event, batches}: "end" (the loop read END), "left" (it dropped the stream)
    ERROR = 8  # R->F {stage, message, traceback}
    DONE = 9  # R->F {peak_rss_bytes, state_sha256, ...}: train(ctx) returned
    STATE = 10  # R->F {name, dtype, shape} + raw bytes: one tensor of rank 0's scored model
    SNAPSHOT = 12  # R->F {step, name, dtype, shape} + raw bytes: one tensor of an audited batch's state;
    # with {alias: an earlier name} and no bytes: the same tensor as that name's (a tied weight)
    SNAPSHOT_END = 13  # R->F {step, tensors}: the audited batch's state is complete
    ANSWER = 14  # F->R {audited: [step, bool]}: the answer to a record, at once (audited runs)


class ProtocolError(RuntimeError):
    """A malformed or oversized frame, or the peer closed the connection."""


def encode(kind: Kind, header: dict[str, Any] | None = None, payload_length: int = 0) -> bytes:
    """A frame's prefix and header; its ``payload_length`` bytes of payload follow on the wire."""
    head = json.dumps(header or {}, separators=(",", ":")).encode()
    return _PREFIX.pack(int(kind), len(head), payload_length) + head


def send(sock: socket.socket, kind: Kind, header: dict[str, Any] | None = None, payload: bytes | memoryview = b"") -> None:
    """Send one frame (blocking)."""
    sock.sendall(encode(kind, header, len(payload)))
    if len(payload):
        sock.sendall(payload)


def send_small(sock: socket.socket, *frames: tuple[Kind, dict[str, Any]]) -> None:
    """Send several payload-less frames in one write (one wake-up of the peer)."""
    sock.sendall(b"".join(encode(kind, header) for kind, header in frames))


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("connection closed by peer")
        got += k


def _parse(prefix: bytes | memoryview, max_payload: int) -> tuple[Kind, int, int]:
    kind, hlen, plen = _PREFIX.unpack(prefix)
    if hlen > MAX_HEADER or plen > max_payload:
        raise ProtocolError(f"oversized frame (header {hlen} B, payload {plen} B)")
    try:
        return Kind(kind), hlen, plen
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


def _header(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        header = json.loads(str(raw, "utf-8")) if len(raw) else {}
    except (ValueError, RecursionError):  # bad JSON or UTF-8, an int over 4300 digits, deep nesting
        raise ProtocolError("frame header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    return header


def recv(sock: socket.socket, max_payload: int) -> tuple[Kind, dict[str, Any], bytearray]:
    """Receive one frame: (kind, header, payload), reading exactly its bytes (unbuffered).

    Raises:
        ProtocolError: the peer closed, the kind is unknown, a length exceeds its bound, or the
            header is not a JSON object.
    """
    kind, hlen, plen = _parse(_recv_exact(sock, _PREFIX.size), max_payload)
    header = _header(_recv_exact(sock, hlen)) if hlen else {}
    payload = _recv_exact(sock, plen) if plen else bytearray()
    return kind, header, payload


class FrameReader:
    """Reads the frames of one stream socket with as few system calls as possible.

    One ``recv_into`` takes whatever the peer has written, up to :attr:`BUFFER` bytes: a loss
    record and the request sent with it, or a whole batch, come in one call instead of three per
    frame (prefix, header, payload). Bytes past the current frame stay buffered for the next
    :meth:`recv`, so every read of the socket must go through the same reader. A payload or a
    header that does not fit the buffer is read straight into a ``bytearray`` of its own.
    """

    BUFFER = 1 << 18  # 256 KiB: a batch of 32 Ki int64 tokens and its header, in one call

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(self.BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # the unread bytes are _buf[_start:_end]
        self._end = 0

    def _fill(self, n: int) -> None:
        """Make ``n <= BUFFER`` unread bytes available at ``_start``."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start + n > self.BUFFER:  # move the unread tail to the front
            tail = self._view[self._start : self._end].tobytes()
            self._view[: len(tail)] = tail
            self._start, self._end = 0, len(tail)
        while self._end - self._start < n:
            k = self.sock.recv_into(self._view[self._end :])
            if k == 0:
                raise ProtocolError("connection closed by peer")
            self._end += k

    def _read(self, n: int) -> bytearray:
        """The next ``n`` bytes of the stream, as a new ``bytearray``."""
        if n <= self.BUFFER:
            self._fill(n)
            out = bytearray(self._view[self._start : self._start + n])
            self._start += n
        else:
            out = bytearray(n)
            have = self._end - self._start
            out[:have] = self._view[self._start : self._end]
            self._start = self._end
            _recv_into(self.sock, memoryview(out)[have:])
        return out

    def recv(self, max_payload: int) -> tuple[Kind, dict[str, Any], bytearray]:
        """Receive one frame: (kind, header, payload), as :func:`recv`.

        Raises:
            ProtocolError: the peer closed, the kind is unknown, a length exceeds its bound, or
                the header is not a JSON object.
        """
        self._fill(_PREFIX.size)
        kind, hlen, plen = _parse(self._view[self._start : self._start + _PREFIX.size], max_payload)
        self._start += _PREFIX.size
        if hlen <= self.BUFFER:  # decoded where it lies
            self._fill(hlen)
            header = _header(self._view[self._start : self._start + hlen])
            self._start += hlen
        else:
            header = _header(self._read(hlen))
        payload = self._read(plen) if plen else bytearray()
        return kind, header, payload
