"""Bounded output: what a child that runs submitted code prints costs the parent a fixed amount.

``Popen.communicate()`` keeps every byte a child prints in the parent's memory: a bundle that
printed 3 GB in ``build_model`` grew ``prism check`` to 6 GB. Every child that runs submitted
code (the parameter child, the ranks, the held-out, re-scoring and blind-probe children, the
CUDA check) is read through :class:`Drain` instead: a thread reads the pipe in chunks and keeps
only the last :data:`TAIL_BYTES` (the prints) or :data:`RESULT_BYTES` (the harness's one-line
reply on stdout: the children move the submission's prints to stderr first), counting every
byte it drops; the ranks' drain also writes the first :data:`LOG_BYTES` to their log file, then
a line saying how many bytes were dropped, then the tail. The parent holds at most a cap and a
chunk per stream (and a copy of the tail at the end), whatever the child prints
(``bench/print_flood.py`` measures it).
"""

from __future__ import annotations

import os
import select
import subprocess
import threading
from collections import deque
from dataclasses import dataclass
from collections.abc import Callable
from typing import IO, Any

TAIL_BYTES = 1 << 20
"""The last bytes of a child's prints (its stderr, the ranks' log) the parent keeps in memory."""
RESULT_BYTES = 64 << 20
"""The last bytes of a bounded child's stdout the parent keeps: the harness's one JSON reply (a
blind probe's carries whole log-probability vectors, several MB); the submission's prints go to
stderr, so only a submission that wrote to the reply's descriptor itself comes near it."""
LOG_BYTES = 16 << 20
"""The first bytes of the ranks' output written to their log file (``logs/runner.log``)."""
LINE_BYTES = 8 << 10
"""The longest line a :class:`Watch` reads."""
CHUNK_BYTES = 1 << 16
"""One read from a child's pipe."""
GRACE_S = 5.0
"""How long the parent waits, after the child ended, for a pipe a grandchild still holds open."""


def dropped_note(dropped: int, total: int) -> str:
    """The line that says output was dropped: ``dropped`` of ``total`` bytes (the first ones)."""
    return (f"[prism: the child printed {total:,} bytes; the first {dropped:,} were dropped, "
            f"the last {total - dropped:,} follow]")


def gap_note(dropped: int, total: int) -> str:
    """The line a capped log file holds where ``dropped`` bytes of ``total`` were left out."""
    return f"[prism: {dropped:,} bytes of output dropped here; the child printed {total:,} bytes]"


@dataclass(frozen=True)
class Captured:
    """What a :class:`Drain` kept: ``tail`` (the last bytes, at most its cap) of ``total`` bytes read."""

    tail: bytes
    total: int

    @property
    def dropped(self) -> int:
        """Bytes read and not kept (the first ``total - len(tail)``)."""
        return self.total - len(self.tail)

    @property
    def note(self) -> str:
        """:func:`dropped_note` when bytes were dropped, else ``""``."""
        return dropped_note(self.dropped, self.total) if self.dropped else ""

    def text(self, lines: int) -> str:
        """The last ``lines`` lines of the tail, decoded, after :attr:`note` when bytes were dropped."""
        body = "\n".join(self.tail.decode(errors="replace").rstrip().splitlines()[-lines:])
        return f"{self.note}\n{body}" if self.dropped else body


class Drain:
    """A thread that reads ``stream`` to its end, keeping the last ``cap`` bytes (:class:`Captured`),
    and writing the first ``log_bytes`` to ``log`` (a binary file it closes) when one is given.

    Memory: at most ``cap + CHUNK_BYTES`` bytes held whatever the child writes (the oldest chunks
    are let go once the newer ones hold ``cap``), and one copy of the tail at the end.
    """

    def __init__(self, stream: IO[bytes], cap: int = TAIL_BYTES, *, log: IO[bytes] | None = None,
                 log_bytes: int = LOG_BYTES, name: str = "prism-drain", watch: Watch | None = None):
        self.watch = watch
        self.fd = stream.fileno()
        self.stream, self.cap, self.log, self.log_bytes = stream, cap, log, log_bytes
        self.log_failed = False
        self.chunks: deque[bytes] = deque()
        self.held = 0  # bytes in chunks
        self.watch_in = (0, 0)  # the stream offsets the watched line lies between
        self.total = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = select.poll()  # not select(): a service may hold descriptors past FD_SETSIZE
        poller.register(self.fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            while not self.stop.is_set():
                if not poller.poll(500):
                    continue
                chunk = os.read(self.fd, CHUNK_BYTES)
                if not chunk:
                    break
                if self.log is not None and self.total < self.log_bytes:
                    self._write(chunk[: self.log_bytes - self.total])
                if self.watch is not None and self.watch.line is None:
                    self.watch.feed(chunk)
                    if self.watch.line is not None:
                        self.watch_in = (self.total - LINE_BYTES, self.total + len(chunk))  # where it lies
                self.total += len(chunk)
                self.chunks.append(chunk)
                self.held += len(chunk)
                while self.held - len(self.chunks[0]) >= self.cap:  # the rest still holds the cap
                    self.held -= len(self.chunks.popleft())
        except (OSError, ValueError):
            pass  # the pipe was closed under us (the parent gave up on it)
        finally:
            self._close_log()

    def _close_log(self) -> None:
        if self.log is None:
            return
        try:
            if self.total > self.log_bytes:  # the head, a note for the gap, then the tail after the head
                tail = self._tail()
                start = self.total - len(tail)
                if start > self.log_bytes:
                    self._write(f"\n{gap_note(start - self.log_bytes, self.total)}\n".encode())
                    low, high = self.watch_in
                    if self.watch is not None and self.watch.line is not None and high > self.log_bytes \
                            and low < start:  # the line it must not lose may have fallen in the gap
                        self._write(self.watch.line + b"\n")
                self._write(tail[max(0, self.log_bytes - start):])
            self.log.close()
        except OSError:
            pass

    def _write(self, data: bytes) -> None:
        """Write to the log; a log that cannot be written (a full disk) is given up, the pipe is still drained."""
        if self.log is None or self.log_failed:
            return
        try:
            self.log.write(data)
        except (OSError, ValueError):
            self.log_failed = True

    def result(self, grace_s: float = GRACE_S) -> Captured:
        """Wait up to ``grace_s`` seconds for the end of the stream (a grandchild may hold it open),
        then stop reading; what was kept."""
        self.thread.join(grace_s)
        if self.thread.is_alive():
            self.stop.set()
            self.thread.join()
        try:
            self.stream.close()
        except OSError:
            pass
        return Captured(self._tail(), self.total)

    def _tail(self) -> bytes:
        """The last ``cap`` bytes read (fewer when fewer were read)."""
        kept = b"".join(self.chunks)
        return kept[len(kept) - self.cap:] if len(kept) > self.cap else kept


class Watch:
    """The first line of a stream that holds ``marker`` and that ``accept`` takes (the audit hook's
    refusal line: :func:`~prism_challenge.evaluator.audit.find_refusal` reads the first one), kept
    apart from the tail so that what a child prints after it cannot push it out. Lines longer
    than :data:`LINE_BYTES` are not read (a refusal line is a few hundred bytes)."""

    def __init__(self, marker: bytes, accept: Callable[[bytes], bool]):
        self.marker, self.accept = marker, accept
        self.line: bytes | None = None
        self.partial = b""

    def feed(self, chunk: bytes) -> None:
        """Scan ``chunk`` (the next bytes of the stream) until the line is found."""
        if self.line is not None:
            return
        data = self.partial + chunk
        head, _, rest = data.rpartition(b"\n")
        self.partial = rest if len(rest) <= LINE_BYTES else b""
        if self.marker not in head:
            return
        for line in head.split(b"\n"):
            if self.marker in line and len(line) <= LINE_BYTES and self.accept(line):
                self.line = line
                return


def refusal_watch() -> Watch:
    """A :class:`Watch` for the audit hook's refusal line (:data:`~prism_challenge.evaluator.audit.REFUSAL_TAG`,
    the first well-formed one, as :func:`~prism_challenge.evaluator.audit.find_refusal` reads it)."""
    from prism_challenge.evaluator.audit import REFUSAL_TAG, find_refusal

    return Watch(REFUSAL_TAG.encode(), lambda line: find_refusal(line.decode(errors="replace")) is not None)


def feed(proc: subprocess.Popen, data: bytes) -> threading.Thread | None:
    """Write ``data`` to ``proc``'s stdin on a thread, then close it (a child that stops reading or
    dies ends the write: the error is dropped, the child's exit says why)."""
    if proc.stdin is None:
        return None

    def write() -> None:
        try:
            if data:
                proc.stdin.write(data)
        except (OSError, ValueError):
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    thread = threading.Thread(target=write, name="prism-feed", daemon=True)
    thread.start()
    return thread


def drains(proc: subprocess.Popen, watch: Watch | None = None) -> tuple[Drain | None, Drain | None]:
    """A :class:`Drain` on ``proc``'s stdout (cap :data:`RESULT_BYTES`) and one on its stderr
    (cap :data:`TAIL_BYTES`, ``watch`` on it), for each that is a pipe."""
    out = Drain(proc.stdout, RESULT_BYTES, name="prism-drain-out") if proc.stdout is not None else None
    err = Drain(proc.stderr, TAIL_BYTES, name="prism-drain-err", watch=watch) if proc.stderr is not None else None
    return out, err


def collect(pair: tuple[Drain | None, Drain | None], grace_s: float = GRACE_S) -> tuple[Captured, Captured]:
    """The :class:`Captured` of each of :func:`drains`' pair (empty for a missing one)."""
    empty = Captured(b"", 0)
    return tuple(d.result(grace_s) if d is not None else empty for d in pair)  # type: ignore[return-value]


def log_drain(proc: subprocess.Popen, log: Any, watch: Watch | None = None) -> Drain:
    """A :class:`Drain` on ``proc``'s stdout (stderr joined to it) writing ``log`` (a path or a binary
    file), capped at :data:`LOG_BYTES` plus :data:`TAIL_BYTES`; the line ``watch`` finds is
    written after the gap's note when it fell in the gap."""
    return Drain(proc.stdout, TAIL_BYTES, log=open(log, "wb") if isinstance(log, (str, os.PathLike)) else log,
                 name="prism-drain-log", watch=watch)
