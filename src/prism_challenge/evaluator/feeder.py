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

The feeder's parts: the rows (:mod:`~prism_challenge.evaluator.rows`: how they are cut), the rank links
(:mod:`~prism_challenge.evaluator.feedlink`), the batches (:mod:`~prism_challenge.evaluator.feedbatch`),
rank 0's state and snapshots (:mod:`~prism_challenge.evaluator.feedstate`) and the checks on the
ranks (:mod:`~prism_challenge.evaluator.feedchecks`).
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_challenge.data.stream import TokenChunk
from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.auditplan import AUDITED_BATCHES
from prism_challenge.evaluator.donereport import clean_done
from prism_challenge.evaluator.feedbatch import BatchServer
from prism_challenge.evaluator.feedchecks import RankChecks
from prism_challenge.evaluator.feedlink import RankLink, RankState
from prism_challenge.evaluator.feedstate import SnapshotDiskError, StateReceiver
from prism_challenge.evaluator.instrument import charge
from prism_challenge.evaluator.protocol import Kind, ProtocolError
from prism_challenge.evaluator.rows import Cut, RowAssembler, prefetch
from prism_challenge.evaluator.snapshots import AuditedStep, SnapshotStore
from prism_challenge.evaluator.statedict import StateError

LN2 = math.log(2.0)


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


class Feeder(RankLink, BatchServer, StateReceiver, RankChecks):
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
        probe_key: the run's secret (:func:`prism_challenge.pipeline.start.run_secret`), which fixes
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
