"""The feeder: the trusted side of the stream. It cuts rows, serves batches, records losses.

The parent process runs one :class:`Feeder`. Each rank's runner connects to its Unix socket and
asks for batches one at a time. Step ``k``'s global batch is the next ``world_size * batch_size``
rows of the one challenge-ordered stream, cut into contiguous per-rank slices; a rank gets step
``k + 1`` only after the feeder holds its loss record for step ``k``. The feeder alone knows how
many targets and UTF-8 bytes each batch covers: the runner reports nats and nothing else.

The runner asks for batch ``k + 1`` in the same write as the record of batch ``k``, so the batch
travels while the loop trains on ``k`` and waits in the socket, outside the submission's memory,
until the loop's next ``next()`` reads it and scores it. A served batch counts only once its record
arrives (``taken``): a loop that stops early leaves its last served batch unscored and uncounted.
Each rank has a writer thread, so a rank that never reads its last batch cannot block the reader.

Rows: ``seq_len`` tokens each; consecutive rows overlap by one token, so row ``i`` of the stream
covers tokens ``[i*(T-1), i*(T-1)+T)`` and every token after the first is a target exactly once.
When fewer than ``T`` tokens remain, the last ``n >= 2`` tokens form one final, shorter row
(world size 1 only: a single row cannot be split across ranks).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.data.stream import TokenChunk
from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.auditplan import AUDITED_BATCHES, is_audited
from prism_challenge.evaluator.donereport import clean_done
from prism_challenge.evaluator.instrument import charge
from prism_challenge.evaluator.protocol import Kind, ProtocolError
from prism_challenge.evaluator.snapshots import AuditedStep, SnapshotStore
from prism_challenge.evaluator.statedict import StateError, drift_only, rebuild
from prism_challenge.failures import DRIFT

LN2 = math.log(2.0)
PROBE_FIRST = 2  # the first batches are always probed for causality
PROBE_RATE = 1 / 16  # and this share of the rest, at random
DRAIN_WAIT_S = 5.0  # a rank's request may find its previous batch still leaving the writer thread


@dataclass
class Cut:
    """A block of rows cut from the stream.

    Attributes:
        tokens: ``[R, T]`` int64 token ids (consecutive rows share one token).
        target_bytes: ``[R]`` int64 UTF-8 bytes of each row's targets (positions ``1..T-1``).
    """

    tokens: np.ndarray
    target_bytes: np.ndarray


def prefetch(chunks: Iterator[TokenChunk], depth: int = 8) -> Iterator[TokenChunk]:
    """Pull ``chunks`` on a background thread, up to ``depth`` ahead (trusted side only).

    Tokenization then overlaps the launch of torchrun and the model's work. An exception in the
    source is re-raised in the consumer.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = object()

    def _pump() -> None:
        try:
            for chunk in chunks:
                q.put(chunk)
            q.put(stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            q.put(exc)

    threading.Thread(target=_pump, name="prism-feeder-prefetch", daemon=True).start()

    def _drain() -> Iterator[TokenChunk]:
        while True:
            item = q.get()
            if item is stop:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    return _drain()


class RowAssembler:
    """Cuts overlapping rows from a token stream, honouring a token budget.

    The budget counts stream tokens handed out (the leading token included): the stream is
    truncated to its first ``token_budget`` tokens.
    """

    def __init__(self, chunks: Iterator[TokenChunk], token_budget: int | None = None):
        self._chunks = chunks
        # the buffer keeps the chunks' own (compact) dtypes; only cut rows are widened to int64
        self._ids: np.ndarray = np.zeros(0, dtype=np.uint8)
        self._nbytes: np.ndarray = np.zeros(0, dtype=np.uint8)
        self._pos = 0  # buffer index of the next row's first token
        self._base = 0  # stream index of the buffer's first token
        self._budget = token_budget
        self._served_any = False
        self.budget_hit = False  # the budget, not the stream's end, stopped the stream

    @property
    def tokens_consumed(self) -> int:
        """Stream tokens handed out so far (the token shared by two rows counted once)."""
        return self._base + self._pos + 1 if self._served_any else 0

    def _fill(self, need: int) -> int:
        """Make ``need`` tokens available from the cursor if the stream and budget allow.

        Returns the number of tokens available from the cursor.
        """
        limit = None if self._budget is None else self._budget - self._base
        while len(self._ids) - self._pos < need and (limit is None or len(self._ids) < limit):
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            keep = self._pos
            ids, nbytes = np.asarray(chunk.ids), np.asarray(chunk.nbytes)
            if ids.dtype.kind not in "iu" or nbytes.dtype.kind not in "iu" or ids.shape != nbytes.shape:
                raise TypeError(f"token chunk: ids {ids.dtype}{list(ids.shape)} and nbytes "
                                f"{nbytes.dtype}{list(nbytes.shape)} must be integer arrays of one length")
            if keep == len(self._ids):  # nothing left over: take the chunk as it is
                self._ids, self._nbytes = ids, nbytes
            else:
                self._ids = np.concatenate([self._ids[keep:], ids])
                self._nbytes = np.concatenate([self._nbytes[keep:], nbytes])
            self._base += keep
            self._pos = 0
            if limit is not None:
                limit -= keep
        if limit is not None and len(self._ids) >= limit:
            self._ids, self._nbytes = self._ids[:limit], self._nbytes[:limit]
            self.budget_hit = True
        return len(self._ids) - self._pos

    def cut(self, rows: int, seq_len: int, allow_short_row: bool = True) -> Cut | None:
        """Cut up to ``rows`` rows of ``seq_len`` tokens; ``None`` when no target is left.

        Fewer rows come back at the end of the stream; with ``allow_short_row`` one final row of
        ``2 <= n < seq_len`` tokens comes back when no full row is left.
        """
        stride = seq_len - 1
        avail = self._fill(rows * stride + 1)
        if avail < 2:
            return None
        full = min(rows, (avail - 1) // stride)
        if full == 0:
            if not allow_short_row:
                return None
            full, seq_len, stride = 1, avail, avail - 1
        start = self._pos
        span = self._ids[start : start + full * stride + 1]
        tokens = np.empty((full, seq_len), dtype=np.int64)  # row i is span[i*stride : i*stride + seq_len]
        tokens[:, :stride] = span[:-1].reshape(full, stride)
        tokens[:, stride] = span[stride::stride]
        tb = self._nbytes[start + 1 : start + 1 + full * stride].reshape(full, stride).sum(axis=1, dtype=np.int64)
        self._pos += full * stride
        self._served_any = True
        return Cut(tokens, tb)


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


@dataclass
class StepRecord:
    """The loss of one global step, summed over ranks (float64)."""

    step: int
    nats: float
    targets: int
    bytes: int
    finite: bool = True
    ranks_reported: int = 0
    shapes: list[tuple[int, int]] = field(default_factory=list)  # (rows, seq_len) of each rank's slice


class SnapshotDiskError(Exception):
    """The trusted side could not write an audited batch's snapshot. Its failure stage says whose
    fault: ``resources`` (the submission's) when the run's snapshots outgrew the float32 size of
    a model at the parameter cap (:meth:`SnapshotStore.outgrew_fp32`: a loop could otherwise fill
    the disk on purpose, once it saw a cheated batch audited, to earn a retry under a new
    secret), else ``storage`` (the host's, retried)."""

    def __init__(self, step: int | None, exc: OSError, outgrown: bool):
        self.stage = "resources" if outgrown else "storage"
        why = (": its snapshots carry more than 4 bytes per element of a model at the parameter cap" if outgrown
               else "")
        super().__init__(f"the snapshot of audited batch {step} cannot be written: {exc}{why}")


@dataclass
class FeederResult:
    """What the trusted side measured. Counts are summed over ranks; nats in float64."""

    steps: list[StepRecord] = field(default_factory=list)
    tokens_consumed: int = 0
    stop_reason: str = ""
    error: dict[str, Any] | None = None
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    nonfinite_batches: int = 0
    ready_at: float | None = None  # every rank's HELLO accepted (prism eval: the feeder is made once the gates passed)
    first_batch_at: float | None = None
    last_record_at: float | None = None
    state: dict[str, Any] = field(default_factory=dict)  # rank 0's scored model (name -> tensor)
    shape: tuple[int, int] | None = None  # (batch_size, seq_len) the loop asked for
    audits: dict[int, AuditedStep] = field(default_factory=dict)  # the audited steps (auditplan)


class FeederFailure(RuntimeError):
    """The run failed on the trusted side's terms: ``stage`` and ``message`` say why."""

    def __init__(self, stage: str, message: str, tb: str = ""):
        super().__init__(f"{stage}: {message}")
        self.stage, self.message, self.traceback = stage, message, tb


class Feeder:
    """Serves the stream to ``world_size`` runners over a Unix socket and records their losses.

    Args:
        socket_path: where to listen (must be short: Unix socket paths hold ~107 bytes).
        chunks: the train token stream.
        config: the run configuration sent to every runner (seed, tokenizer, ...).
        world_size: number of ranks expected.
        vocab_size: ``V``, for the non-finite charge of ``2 * ln V`` nats per target.
        token_budget, step_budget: stream limits (``None``: none).
        byte_budget: UTF-8 bytes; no batch is cut once the batches cut so far cover at least
            this many target bytes (the stream stops at the first batch boundary at or past it:
            stop reason ``byte_budget``). ``None``: none.
        wall_clock_budget: seconds after :meth:`release` after which no new step is served.
        on_record: called (under the feeder lock) with each completed :class:`StepRecord`.
        max_state_bytes: most bytes of rank 0's scored ``state_dict`` the feeder accepts.
        probe_key: the run's secret (:func:`prism_challenge.pipeline.run_secret`), which fixes
            which batches are probed for causality and how (HMAC-SHA256 of the key and the step,
            the same on every rank) and which are audited (the harmonic schedule,
            :func:`~prism_challenge.evaluator.auditplan.is_audited`); ``None``: a fresh key from
            :func:`secrets.token_bytes` (never anything guessable). Never sent to the ranks.
        audit_dir: where rank 0's snapshots of the audited batches are written (``None``: no
            batch is audited).
        audited_batches: ``A`` of the harmonic schedule (batch 0, then batch ``k`` with
            probability ``min(1, A / k)``).
        server: a socket already listening at ``socket_path`` (:func:`protocol.listen`), which
            the feeder then owns; ``None``: the feeder makes it.
        token: the token every rank's HELLO must carry (``None``: a fresh
            :func:`secrets.token_hex`); given with ``server`` when the ranks were launched first.
    """

    def __init__(
        self,
        socket_path: str,
        chunks: Iterator[TokenChunk],
        config: dict[str, Any],
        *,
        world_size: int = 1,
        vocab_size: int,
        token_budget: int | None = None,
        byte_budget: int | None = None,
        step_budget: int | None = None,
        wall_clock_budget: float | None = None,
        on_record: Callable[[StepRecord], None] | None = None,
        max_state_bytes: int = 8 << 30,
        probe_key: bytes | None = None,
        audit_dir: os.PathLike[str] | str | None = None,
        audited_batches: int = AUDITED_BATCHES,
        server: socket.socket | None = None,
        token: str | None = None,
    ):
        self.socket_path = socket_path
        self.token = token if token is not None else secrets.token_hex(16)
        self.config = config
        self.world_size = world_size
        self.vocab_size = vocab_size
        self.step_budget = step_budget
        self.byte_budget = byte_budget
        self._bytes_cut = 0  # target bytes of every batch cut so far (the byte budget counts these)
        self.wall_clock_budget = wall_clock_budget
        self.on_record = on_record
        self.max_state_bytes = max_state_bytes
        self.assembler = RowAssembler(prefetch(chunks), token_budget)
        self.result = FeederResult()
        self._lock = threading.Lock()
        self._cuts: dict[int, list[Cut | None]] = {}
        self._fetched: dict[int, int] = {}
        self._consumed: dict[int, int] = {}  # step -> stream tokens handed out once it is cut
        self._records: dict[int, StepRecord] = {}
        self._ranks: dict[int, RankState] = {}
        self._threads: list[threading.Thread] = []
        self._readers: list[threading.Thread] = []  # one per connected rank
        self._t0 = time.monotonic()
        self._shape: tuple[int, int] | None = None
        self.failed = threading.Event()
        self.wake = threading.Event()  # set on a failure, a DONE or a closed connection: the parent looks now
        self._probe_key = probe_key if probe_key is not None else secrets.token_bytes(32)
        self.audit_dir = None if audit_dir is None or audited_batches <= 0 else audit_dir
        self.audited_batches = audited_batches
        self._max_seq_len = int(config.get("sequence_length") or 1 << 30)
        self.stopping = threading.Event()  # set by the parent before it kills the tree
        self.released = threading.Event()  # CONFIG goes out only once the parent releases the run
        self.released_at: float | None = None
        self._server = server if server is not None else protocol.listen(socket_path, world_size)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, release: bool = True) -> None:
        """Start accepting runners (in a background thread).

        With ``release=False`` runners connect and wait without their configuration until
        :meth:`release`: torchrun and the ranks can start (interpreter, ``import torch``) while the
        parent still runs the static gates, and nothing of the bundle is imported before the
        gates pass, because the configuration names the bundle.
        """
        t = threading.Thread(target=self._accept_loop, name="prism-feeder-accept", daemon=True)
        t.start()
        self._threads.append(t)
        if release:
            self.release()

    def release(self) -> None:
        """Send every connected and future runner its configuration; the wall clock starts now."""
        self._t0 = self.released_at = time.monotonic()
        self.released.set()

    def close(self) -> None:
        """Stop serving: close every connection and the listening socket (runners still waiting
        for their configuration get none)."""
        self.stopping.set()
        self.released.set()
        for st in list(self._ranks.values()):
            st.outbox.put(None)
            try:
                st.sock.close()
            except OSError:
                pass
        try:
            self._server.close()
        except OSError:
            pass
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass

    def fail(self, stage: str, message: str, tb: str = "", rank: int | None = None, origin: str = "harness",
             cause: str = "") -> None:
        """Record the first failure of the run (later ones are ignored). ``origin``: ``"runner"``
        for an ERROR frame a rank sent (its stage is the untrusted side's word), else ``"harness"``;
        ``cause``: the harness's own refinement of the stage (:mod:`prism_challenge.failures`)."""
        with self._lock:
            if self.result.error is None:
                self.result.error = {"stage": stage, "message": message, "traceback": tb, "rank": rank,
                                     "origin": origin, "cause": cause if origin == "harness" else ""}
                self.result.stop_reason = "failed"
        self.failed.set()
        self.wake.set()

    def all_done(self) -> bool:
        """True once every rank reported DONE."""
        with self._lock:
            return len(self.result.done) == self.world_size

    # -- serving -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while len(self._ranks) < self.world_size:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), name="prism-feeder-rank", daemon=True)
            t.start()
            self._threads.append(t)
            self._readers.append(t)

    def _serve(self, conn: socket.socket) -> None:
        st: RankState | None = None
        try:
            reader = protocol.FrameReader(conn)
            kind, hello, _ = reader.recv(max_payload=0)
            if kind != Kind.HELLO or hello.get("token") != self.token:
                conn.close()
                return
            rank = hello.get("rank")
            if not isinstance(rank, int) or not 0 <= rank < self.world_size:
                conn.close()
                return
            with self._lock:
                if rank in self._ranks:
                    conn.close()
                    return
                st = self._ranks[rank] = RankState(rank, conn, int(hello.get("pid") or 0))
                if rank == 0 and self.audit_dir is not None:
                    st.snapshots = SnapshotStore(Path(self.audit_dir), self.max_state_bytes)
                if len(self._ranks) == self.world_size:
                    self.result.ready_at = time.monotonic()
            writer = threading.Thread(target=self._write, args=(st,), name="prism-feeder-writer", daemon=True)
            writer.start()
            self._threads.append(writer)
            self.released.wait()
            if self.stopping.is_set():  # refused before the run started (close() may have missed us)
                st.outbox.put(None)
                conn.close()
                return
            st.last_active = time.monotonic()
            self._send(st, Kind.CONFIG, self.config)
            while True:
                # rank 0's state frames: never more than the state bytes it has left (the payload is
                # allocated before it arrives)
                limit = min(protocol.MAX_STATE_TENSOR_BYTES, max(self.max_state_bytes - st.state_bytes,
                                                                  st.snapshots.room() if st.snapshots else 0, 0)) if st.rank == 0 else 0
                kind, header, payload = reader.recv(max_payload=limit)
                st.last_active = time.monotonic()
                if kind == Kind.NEXT:
                    self._on_next(st, header)
                elif kind == Kind.RECORD:
                    self._on_record(st, header)
                elif kind == Kind.ERROR:
                    self.fail(
                        str(header.get("stage", "train"))[:64],
                        str(header.get("message", ""))[:4000],
                        str(header.get("traceback", ""))[:20000],
                        rank=st.rank,
                        origin="runner",
                    )
                elif kind == Kind.EVENT:
                    event = header.get("event")
                    if event == "end" and st.end_sent:
                        st.ended = True
                    elif event == "left" and not st.ended:
                        st.left = True
                        if self.world_size > 1:
                            self._check_lockstep()
                elif kind == Kind.STATE and st.rank == 0:
                    self._on_state(st, header, payload)
                elif kind in (Kind.SNAPSHOT, Kind.SNAPSHOT_END) and st.snapshots is not None:
                    self._on_snapshot(st, kind, header, payload)
                elif kind == Kind.DONE:
                    self._on_done(st, header)
                    return
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame from rank {st.rank}")
        except ProtocolError as exc:
            if st is not None and st.done is None and not self.failed.is_set() and not self.stopping.is_set():
                self.fail("runner", f"rank {st.rank}: {exc}", rank=st.rank)
        except SnapshotDiskError as exc:
            self.fail(exc.stage, str(exc))
        except OSError:
            pass
        except Exception as exc:  # noqa: BLE001 - a trusted-side fault (data, tokenizer) fails the run
            self.fail("data", f"{type(exc).__name__}: {exc}")
            try:
                conn.close()
            except OSError:
                pass
        finally:
            self.wake.set()  # a rank's connection ended: the parent looks at the tree now

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

    def _on_next(self, st: RankState, header: dict[str, Any]) -> None:
        if st.pending is not None:
            raise ProtocolError(
                f"rank {st.rank} asked for batch {st.step} before reporting the loss of batch {st.pending['step']}"
            )
        if st.end_sent:
            raise ProtocolError(f"rank {st.rank} asked for a batch after the end of the stream")
        # one batch in flight per rank: a record of batch k proves batch k was read, so the
        # previous batch has left (or is just leaving) the writer thread; a rank that records
        # batches it never read would make the trusted side queue the stream in memory
        if not st.drained.wait(DRAIN_WAIT_S):
            raise ProtocolError(f"rank {st.rank} asked for batch {st.step} while batch {st.step - 1} was still unread")
        try:
            b, t = int(header["batch_size"]), int(header["seq_len"])
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(Infinity)
            raise ProtocolError("NEXT needs integer batch_size and seq_len") from None
        if not (b >= 1 and 2 <= t <= self._max_seq_len and b * t <= protocol.MAX_BATCH_TOKENS):
            raise ProtocolError(f"rank {st.rank} asked for batches of {b} x {t} tokens: batch_size must be >= 1, "
                                f"seq_len in 2..{self._max_seq_len}, at most {protocol.MAX_BATCH_TOKENS} tokens")
        with self._lock:
            if self._shape is None:
                self._shape = self.result.shape = (b, t)
            elif self._shape != (b, t):
                raise ProtocolError(f"rank {st.rank} changed the batch shape from {self._shape} to {(b, t)}")
        with self._lock:
            piece = self._piece(st, b, t)
        if piece is None:
            st.end_sent = True
            self._send(st, Kind.END, {"reason": self.result.stop_reason})
            return
        tokens, nbytes = piece
        st.pending = {"step": st.step, "targets": int(tokens.shape[0] * (tokens.shape[1] - 1)), "bytes": int(nbytes),
                      "shape": (int(tokens.shape[0]), int(tokens.shape[1]))}
        if self.result.first_batch_at is None:
            self.result.first_batch_at = time.monotonic()
        header = {"step": st.step, "rows": int(tokens.shape[0]), "seq_len": int(tokens.shape[1])}
        probe = self._probe(st.step, int(tokens.shape[0]), int(tokens.shape[1]))
        if probe is not None:
            header["probe"] = probe
        if self._audited(st.step):  # kept by the trusted side: the audit scores this slice again
            with self._lock:
                self.result.audits.setdefault(st.step, AuditedStep(st.step)).pieces[st.rank] = tokens.copy()
        self._send(st, Kind.BATCH, header, memoryview(tokens).cast("B"))
        st.step += 1

    def _probe(self, step: int, rows: int, seq_len: int) -> list[int] | None:
        """Whether to probe this step's batches for causality, and how: ``[k, shift, row]`` or ``None``.

        The first ``PROBE_FIRST`` steps and a ``PROBE_RATE`` share of the others, drawn from
        ``HMAC-SHA256(probe_key, "step")`` (the run's secret, which the submission never sees).
        The draw depends on the step alone, never on the rank: every rank probes the same steps
        (so each runs the same number of forwards, and a collective inside ``forward`` stays
        matched), with the same ``k`` and ``shift``; ``row`` is the same fraction of each rank's
        ``rows``.
        """
        if seq_len < 2:
            return None
        digest = hmac.new(self._probe_key, f"{step}".encode(), hashlib.sha256).digest()
        draw = [int.from_bytes(digest[i : i + 8], "big") / 2.0**64 for i in range(0, 32, 8)]
        if not (step < PROBE_FIRST or draw[0] < PROBE_RATE):
            return None
        return [1 + int(draw[1] * (seq_len - 1)), 1 + int(draw[2] * (self.vocab_size - 1)), int(draw[3] * rows)]

    def _piece(self, st: RankState, b: int, t: int) -> tuple[np.ndarray, int] | None:
        """This rank's slice of the global batch of its next step (caller holds the lock)."""
        step = st.step
        if step not in self._cuts:
            cut = self._next_cut(step, b, t)
            if cut is None:
                self._cuts[step] = [None] * self.world_size
            else:
                rows = cut.tokens.shape[0]
                bounds = [rows * r // self.world_size for r in range(self.world_size + 1)]
                self._cuts[step] = [
                    Cut(cut.tokens[bounds[r] : bounds[r + 1]], cut.target_bytes[bounds[r] : bounds[r + 1]])
                    for r in range(self.world_size)
                ]
            self._fetched[step] = 0
        piece = self._cuts[step][st.rank]
        self._fetched[step] += 1
        if self._fetched[step] == self.world_size:
            del self._cuts[step], self._fetched[step]
        if piece is None:
            return None
        return piece.tokens, int(piece.target_bytes.sum())

    def _next_cut(self, step: int, b: int, t: int) -> Cut | None:
        r = self.result
        if r.stop_reason:
            return None
        if self.step_budget is not None and step >= self.step_budget:
            r.stop_reason = "step_budget"
            return None
        if self.byte_budget is not None and self._bytes_cut >= self.byte_budget:
            r.stop_reason = "byte_budget"
            return None
        if self.wall_clock_budget is not None and time.monotonic() - self._t0 >= self.wall_clock_budget:
            r.stop_reason = "wall_clock_budget"
            return None
        n = self.world_size
        cut = self.assembler.cut(n * b, t, allow_short_row=(n == 1))
        if cut is None or cut.tokens.shape[0] < n:
            r.stop_reason = "token_budget" if self.assembler.budget_hit else "stream_exhausted"
            return None
        self._consumed[step] = self.assembler.tokens_consumed
        self._bytes_cut += int(cut.target_bytes.sum())
        return cut

    def _audited(self, step: int) -> bool:
        """Whether ``step`` is audited: the harmonic schedule keyed on the run's secret
        (:func:`~prism_challenge.evaluator.auditplan.is_audited`: step 0 always, step ``k`` with
        probability ``min(1, A / k)``), whatever the budgets: the audits follow the stream's
        real length."""
        return self.audit_dir is not None and is_audited(self._probe_key, step, self.audited_batches)

    def _on_record(self, st: RankState, header: dict[str, Any]) -> None:
        pending = st.pending
        if pending is None or header.get("step") != pending["step"]:
            raise ProtocolError(f"rank {st.rank} sent a loss record for a batch it was not given")
        nats = header.get("nats")
        if not isinstance(nats, (int, float)) or isinstance(nats, bool):
            nats = math.nan  # missing or not a number: charged as non-finite
        elif isinstance(nats, int) and abs(nats) > 2**1023:  # JSON's integers are unbounded, float's are not:
            nats = math.inf if nats > 0 else -math.inf  # charged as non-finite, not an OverflowError read as "data"
        if nats < 0:
            raise ProtocolError(f"rank {st.rank} reported a negative code length ({nats} nats) for batch {pending['step']}")
        audited = self._audited(pending["step"])
        if audited:
            with self._lock:
                self.result.audits[pending["step"]].recorded[st.rank] = float(nats) if math.isfinite(nats) else None
            if st.snapshots is not None:
                try:
                    st.snapshots.expect(pending["step"])
                except StateError as exc:
                    raise ProtocolError(str(exc)) from None
        if self.audit_dir is not None:
            # at once, in a frame of its own, after the record arrived: the rank reads it (and sends an
            # audited batch's snapshot) before it asks for the next batch and before the loop runs any
            # code on this one. Riding on the next BATCH, it was read only when the loop asked again:
            # a loop that peeked on its last batch and then never asked (stopped as stalled, scored)
            # kept that batch's snapshot from the audit (red team, issue 25)
            self._send(st, Kind.ANSWER, {"audited": [pending["step"], audited]})
        nats, finite = charge(float(nats), pending["targets"], self.vocab_size)
        st.pending = None
        st.taken += 1
        with self._lock:
            rec = self._records.setdefault(pending["step"], StepRecord(pending["step"], 0.0, 0, 0))
            rec.nats += float(nats)
            rec.targets += pending["targets"]
            rec.bytes += pending["bytes"]
            rec.finite &= finite
            rec.ranks_reported += 1
            rec.shapes.append(pending["shape"])
            if not finite:
                self.result.nonfinite_batches += 1
            self.result.last_record_at = time.monotonic()
            if rec.ranks_reported == self.world_size:
                self.result.steps.append(rec)
                self.result.tokens_consumed = self._consumed.pop(rec.step)
                del self._records[rec.step]
                if self.on_record is not None:
                    self.on_record(rec)
        if self.world_size > 1:
            self._check_lockstep()

    def _on_state(self, st: RankState, header: dict[str, Any], payload: bytearray) -> None:
        st.state_bytes += len(payload)
        if st.state_bytes > self.max_state_bytes:
            raise ProtocolError(f"the scored model's state exceeds {self.max_state_bytes} bytes")
        try:
            name, tensor = rebuild(header, payload)
        except StateError as exc:
            raise ProtocolError(str(exc)) from None
        if name in self.result.state:
            raise ProtocolError(f"state tensor {name!r} sent twice")
        self.result.state[name] = tensor

    def _on_snapshot(self, st: RankState, kind: Kind, header: dict[str, Any], payload: bytearray) -> None:
        store = st.snapshots
        assert store is not None
        try:
            if kind == Kind.SNAPSHOT:
                store.add(header, payload)
                return
            step = store.expected
            with self._lock:
                audited = self.result.audits.get(step) if step is not None else None
            if audited is None:
                raise StateError(f"a snapshot's end for batch {header.get('step')!r}, which was not audited")
            store.end(header, audited)
        except StateError as exc:
            raise ProtocolError(str(exc)) from None
        except OSError as exc:  # the trusted side's disk, never silent; whose fault: SnapshotDiskError
            raise SnapshotDiskError(store.expected, exc, store.outgrew_fp32()) from None

    def _on_done(self, st: RankState, header: dict[str, Any]) -> None:
        header = clean_done(header)  # the rank's word: known fields of the right types only
        with self._lock:
            st.done = header
            self.result.done[st.rank] = header
            if not st.ended and not self.result.stop_reason:
                self.result.stop_reason = "loop_stopped"
        self.wake.set()
        if self.world_size > 1:
            self._check_lockstep()
            self._check_states()

    def _check_lockstep(self) -> bool:
        """Fail when a rank left the stream while another rank went on (world size > 1).

        A rank that returned from ``train`` without reaching the end of the stream (``left``)
        after taking ``n`` batches is out of step with any rank that took batch ``n``.
        Returns True when the run was failed.
        """
        with self._lock:
            left = {r: s.taken for r, s in self._ranks.items() if (s.left or s.done is not None) and not s.ended}
            if not left:
                return False
            r, n = min(left.items(), key=lambda kv: kv[1])
            ahead = sorted(q for q, s in self._ranks.items() if s.taken > n)
        if not ahead:
            return False
        self.fail(
            "contract",
            f"rank {r} left ctx.iter_train_batches after {n} batch(es) while rank(s) {ahead} went on; "
            f"at world size {self.world_size} every rank must consume the same number of batches",
            rank=r,
        )
        return True

    def _check_states(self) -> None:
        """Once every rank is done, all reported state digests must agree.

        When they do not, but every differing tensor's moments agree to
        :data:`~prism_challenge.evaluator.statedict.DRIFT_RTOL` (:func:`drift_only`), the ranks
        differ in their last bits only: cause ``drift``, kind ``infrastructure`` (retried). A fresh
        CPU process computes some fp32 reductions to one of two last bits (issue 27: the first
        ``logsumexp`` after a matmul, about 1 process in 40 with 2 threads), so an honest DDP loop
        whose ranks each take a norm (gradient clipping) can split by an ulp; that is not the
        submission's fault. Anything larger is the submission's."""
        with self._lock:
            if len(self.result.done) < self.world_size:
                return
            # a digest that is neither a string nor absent (a JSON list: unhashable) agrees with no other rank's
            digests = {r: dg if isinstance(dg := d.get("state_sha256"), (str, type(None))) else ("malformed", r)
                       for r, d in self.result.done.items()}
        groups: dict[Any, list[int]] = {}
        for r, dg in sorted(digests.items()):
            groups.setdefault(dg, []).append(r)
        if len(groups) > 1:
            ref = groups.get(digests[0], [0])
            odd = sorted(r for r in digests if r not in ref)
            with self._lock:
                a, b = self.result.done[0], self.result.done[odd[0]]
                where = differing_tensors(a, b)
                drift, rel = _drift(a, b)
            if drift:
                self.fail("consistency", f"the ranks' final states differ in their last bits only: rank(s) {odd} "
                          f"against rank 0{where}, moments within {rel:.1e} of each other (numerical drift of the "
                          "CPU's kernels, not the submission's; a retry runs it again)", cause=DRIFT)
                return
            self.fail(
                "consistency",
                f"the scored model's state_dict differs across ranks: rank(s) {odd} disagree with rank 0"
                f"{where} (ranks must stay identical, e.g. through DDP)",
            )

    def check_stall(self, timeout: float, first_timeout: float | None = None) -> tuple[str, str, int] | None:
        """A rank silent for ``timeout`` s: stuck, or out of step with the others.

        Returns (stage, message, rank), or ``None``. World size 1: stage ``"stalled"`` once the
        rank took a batch and then sent nothing for ``timeout`` s (an endless loop in ``train``;
        the caller stops the run and scores what was scored). World size > 1, a failure in two
        cases: another rank already left the stream (the silent rank is most likely blocked in a
        collective the leaver never joins), or another rank is ahead of it (the silent rank hangs).
        A loop that never takes its first batch is :meth:`check_first_batch`'s.

        A rank's stall clock starts at its first loss record: before it, its first scoring
        forward may be compiling (a first ``torch.compile`` takes minutes on a large model), so
        a rank that has recorded nothing yet is held to ``first_timeout`` s instead (default
        ``timeout``; ``prism eval`` passes ``--idle-timeout``).
        """
        first = timeout if first_timeout is None else first_timeout
        now = time.monotonic()
        if self.world_size == 1:
            st = self._ranks.get(0)
            if st is None or st.done is not None or st.left or st.ended or not st.taken:
                return None
            quiet = now - st.last_active
            if quiet < timeout:
                return None
            return ("stalled", f"rank 0 made no progress for {quiet:.0f} s after taking {st.taken} batch(es)", 0)
        with self._lock:
            ranks = list(self._ranks.values())
        for st in ranks:
            limit = timeout if st.taken else first
            if st.done is not None or st.left or st.ended or now - st.last_active < limit:
                continue
            quiet = now - st.last_active
            leavers = [o for o in ranks if (o.left or o.done is not None) and not o.ended]
            if leavers:
                o = min(leavers, key=lambda x: x.taken)
                return (
                    "contract",
                    f"rank {o.rank} left ctx.iter_train_batches after {o.taken} batch(es) while rank {st.rank} "
                    f"was still iterating (silent for {quiet:.0f} s); at world size {self.world_size} every rank "
                    f"must consume the same number of batches",
                    o.rank,
                )
            if any(o is not st and (o.taken > st.taken or o.done is not None) for o in ranks):
                return (
                    "consistency",
                    f"rank {st.rank} made no progress for {quiet:.0f} s while other ranks were ahead (hung or out of step)",
                    st.rank,
                )
        return None

    def check_first_batch(self, timeout: float) -> str | None:
        """Why the run must fail when no batch was scored ``timeout`` s after the release, or
        ``None`` (before the release, and once any rank recorded a batch, finished or left).

        Nothing is scored and nothing is coming: the loop never reached
        ``ctx.iter_train_batches`` (an endless loop or a stopped process before it), or the
        model's first scoring forward never returned.
        """
        now = time.monotonic()
        with self._lock:
            ranks = list(self._ranks.values())
        if self.released_at is None or any(st.taken or st.done is not None or st.left or st.ended for st in ranks):
            return None
        waited = now - self.released_at
        if waited < timeout:
            return None
        if any(st.step for st in ranks):
            return (f"no batch was scored {waited:.0f} s after the start: the first batch was taken but the "
                    f"model's scoring forward on it has not returned")
        return (f"no batch was asked for {waited:.0f} s after the start: the loop never reached "
                f"ctx.iter_train_batches (an endless loop or a stopped process before it)")

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for every rank's reader to reach that rank's last frame.

        Call it once the ranks' processes are gone: frames they wrote before exiting (their
        DONE report, an ERROR) may still sit unread in the sockets, and :meth:`finish` closes them.
        """
        deadline = time.monotonic() + timeout
        for t in list(self._readers):
            t.join(max(0.0, deadline - time.monotonic()))

    def finish(self) -> FeederResult:
        """Close and return the result; steps some ranks did not report are dropped, and so are
        their audits (the audited steps are then exactly the drawn steps among the scored ones:
        ``auditplan.drawn_steps(key, len(steps), A)``)."""
        self.close()
        if not any(t.is_alive() for t in self._readers):  # a snapshot cut short: its partial file goes
            for st in list(self._ranks.values()):
                if st.snapshots is not None:
                    st.snapshots.abort()
        with self._lock:
            self.result.steps.sort(key=lambda s: s.step)
            scored = {s.step for s in self.result.steps}
            for step in [k for k in self.result.audits if k not in scored]:
                del self.result.audits[step]
            return self.result


def _drift(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    """:func:`~prism_challenge.evaluator.statedict.drift_only` on two ranks' DONE headers; False
    when either lacks its per-tensor digests or moments (a header is the rank's word: malformed
    entries are not drift)."""
    x, mx, y, my = a.get("state_tensors"), a.get("state_moments"), b.get("state_tensors"), b.get("state_moments")
    if not all(isinstance(v, dict) for v in (x, y, mx, my)):
        return False, float("inf")
    return drift_only(x, y, mx, my)


def differing_tensors(a: dict[str, Any], b: dict[str, Any], most: int = 5) -> str:
    """``" in tensors x, y (+N more) of M"``: the state entries whose digests differ between two
    ranks' DONE headers (``state_tensors``, name -> digest; entries only one rank has count as
    differing), or ``""`` when either header lacks them."""
    x, y = a.get("state_tensors"), b.get("state_tensors")
    if not isinstance(x, dict) or not isinstance(y, dict):
        return ""
    names = sorted(n for n in set(x) | set(y) if x.get(n) != y.get(n))
    more = f" (+{len(names) - most} more)" if len(names) > most else ""
    return f" in {len(names)} of {len(set(x) | set(y))} tensors: {', '.join(names[:most])}{more}"
