"""The audit's snapshot file: written one tensor at a time as the frames arrive, hashed as written.

Layout (``prism-snapshot-1``)::

    MAGIC (8 bytes)
    per tensor: zero padding to a multiple of ALIGN bytes, then its raw bytes (C order)
    index: UTF-8 JSON {"format": FORMAT, "tensors": [[name, dtype, shape, offset, nbytes], ...]}
    index length (8 bytes, little endian), MAGIC

An alias (a tied weight: two ``state_dict`` names, one storage, offset, shape, stride and
dtype) is stored once: its entry repeats the ``dtype``, ``shape``, ``offset`` and ``nbytes`` of
the entry stored before it (:meth:`SnapshotWriter.alias`), and :func:`read_snapshot` gives both
names one tensor object, which :func:`~prism_challenge.evaluator.statedict.load_scored_state`
ties again in the model. Entries whose bytes overlap in any other way are refused. A reader
that predates aliases reads such a file as two equal tensors (the tie lost, the values kept).

The index comes last, so the trusted side (:class:`SnapshotWriter`) can write each tensor the
moment its frame arrives, with nothing held back, and knows the file's sha256 when the last byte
is written: it hashes exactly the bytes it writes (no second pass over the file). ``torch.save``
needs the whole state first (its pickle leads the archive), and its reader unpickles: this
format is read with :func:`read_snapshot` (``torch.frombuffer`` over an allow-list of dtypes,
nothing unpickled), in the sandboxed children and in ``prism verify``. Offsets are multiples of
:data:`ALIGN` from the file's start, so every tensor is aligned for its dtype when the file is
read into an aligned buffer.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prism_challenge.evaluator.statedict import DTYPES, StateError, tensor_bytes

MAGIC = b"PRSNAP01"
FORMAT = "prism-snapshot-1"
ALIGN = 64
_TAIL = struct.Struct("<Q")
MAX_INDEX_BYTES = 64 << 20  # names and shapes of a few hundred thousand tensors


class SnapshotWriter:
    """Writes one snapshot file tensor by tensor, hashing the bytes as they are written.

    Args:
        path: the file (created, or truncated; parents must exist).

    The file is opened ``0o600`` and closed by :meth:`close` (the digest) or :meth:`abort`
    (removed). Raises ``OSError`` when the file cannot be written.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._f = open(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb", buffering=0)
        self._h = hashlib.sha256()
        self._pos = 0
        self._index: list[list[Any]] = []
        self._stored: dict[str, list[Any]] = {}  # name -> its index entry, for the tensors written
        self._write(MAGIC)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._h.update(view)
        while view:  # an unbuffered write may take part of it
            n = self._f.write(view)
            view = view[n:]
            self._pos += n

    def add(self, name: str, dtype: str, shape: list[int], payload: bytes | bytearray | memoryview) -> None:
        """One tensor's raw bytes (already checked against ``dtype`` and ``shape`` by the caller)."""
        pad = -self._pos % ALIGN
        if pad:
            self._write(bytes(pad))
        self._index.append([name, dtype, list(shape), self._pos, len(payload)])
        self._stored[name] = self._index[-1]
        self._write(payload)

    def alias(self, name: str, of: str) -> None:
        """An index entry for ``name`` over the bytes of ``of``, a tensor :meth:`add` wrote before
        (its dtype and shape: the caller checked that they are ``name``'s); no byte is written.

        Raises:
            StateError: ``of`` is not a tensor written to this file (an alias of an alias
                included, so no chain or cycle can be recorded).
        """
        target = self._stored.get(of)
        if target is None:
            raise StateError(f"snapshot tensor {name!r}: an alias of {of!r}, which this snapshot did not store before it")
        self._index.append([name, *target[1:]])

    @property
    def tensors(self) -> int:
        """Tensors written so far."""
        return len(self._index)

    def close(self) -> str:
        """Write the index and the trailer, close the file; its sha256 (hex)."""
        index = json.dumps({"format": FORMAT, "tensors": self._index}, separators=(",", ":")).encode()
        self._write(index)
        self._write(_TAIL.pack(len(index)) + MAGIC)
        self._f.close()
        return self._h.hexdigest()

    def abort(self) -> None:
        """Close and remove the unfinished file (best effort)."""
        try:
            self._f.close()
        finally:
            self.path.unlink(missing_ok=True)


def exact_view(t: torch.Tensor) -> tuple:
    """What makes two tensors exact aliases of each other: the same device, address (storage and
    offset), dtype, shape and stride. An empty tensor is never anyone's alias (its own id)."""
    if t.numel() == 0:
        return ("empty", id(t))
    return (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def write_snapshot(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> str:
    """Write ``state`` (name -> tensor; any device, copied to contiguous CPU) as a snapshot file;
    its sha256. An exact alias of an earlier entry (:func:`exact_view`: a tied weight) is stored
    once (:meth:`SnapshotWriter.alias`). For tests and tools: the feeder writes frames as they
    arrive (:class:`SnapshotWriter`).

    Raises:
        StateError: a dtype outside :data:`~prism_challenge.evaluator.statedict.DTYPES`.
    """
    w = SnapshotWriter(path)
    seen: dict[tuple, str] = {}
    try:
        for name, t in state.items():
            if str(t.dtype) not in DTYPES:
                raise StateError(f"state tensor {name!r} has dtype {t.dtype}, which the harness cannot store")
            view = exact_view(t)
            if view in seen:
                w.alias(name, seen[view])
                continue
            seen[view] = name
            t = t.detach().to("cpu").contiguous()
            w.add(name, str(t.dtype), list(t.shape), tensor_bytes(t))
    except BaseException:
        w.abort()
        raise
    return w.close()


def _index(data: np.ndarray) -> tuple[list[Any], int]:
    """The index entries of a snapshot held in ``data`` (uint8 ``[N]``) and where its data ends.

    Raises:
        StateError: not a snapshot file, or a malformed index.
    """
    n = len(data)
    tail = _TAIL.size + len(MAGIC)
    if n < len(MAGIC) + tail or bytes(data[: len(MAGIC)]) != MAGIC or bytes(data[n - len(MAGIC):]) != MAGIC:
        raise StateError(f"not a snapshot file ({FORMAT}: magic {MAGIC!r} at both ends)")
    (size,) = _TAIL.unpack(bytes(data[n - tail : n - len(MAGIC)]))
    if size > min(MAX_INDEX_BYTES, n - len(MAGIC) - tail):
        raise StateError("a snapshot file with a malformed index length")
    try:
        index = json.loads(bytes(data[n - tail - size : n - tail]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StateError("a snapshot file whose index is not JSON") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("tensors"), list):
        raise StateError(f"a snapshot file whose index is not {FORMAT}")
    return index["tensors"], n - tail - size


def read_snapshot(data: np.ndarray) -> dict[str, torch.Tensor]:
    """The tensors of a snapshot file held in ``data`` (a uint8 numpy array ``[N]``, the file's
    bytes), as views of it (no copy: they keep ``data`` alive; clone them with
    :func:`clone_state` to outlive it or to let the model write to them). Nothing is unpickled.
    An alias entry (the ``offset`` of an earlier entry, with its dtype, shape and size) is the
    same tensor object as that entry's.

    Raises:
        StateError: not a snapshot, a dtype outside the allow-list, a shape or size that
            disagrees, a tensor outside the data, a name twice, or entries whose bytes overlap
            without being exact aliases.
    """
    entries, end = _index(data)
    out: dict[str, torch.Tensor] = {}
    at: dict[int, tuple[str, str, list[int], int]] = {}  # offset -> the first stored entry there
    whole = torch.from_numpy(data)
    for e in entries:
        if not (isinstance(e, list) and len(e) == 5):
            raise StateError("a snapshot file with a malformed index entry")
        name, dtype, shape, offset, nbytes = e
        if not isinstance(name, str) or name in out or dtype not in DTYPES or not isinstance(shape, list) or not all(
                isinstance(s, int) and s >= 0 for s in shape):
            raise StateError(f"snapshot tensor {str(name)[:200]!r}: a malformed or repeated entry")
        dt = DTYPES[dtype]
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        size = numel * torch.empty((), dtype=dt).element_size()
        if not (isinstance(offset, int) and isinstance(nbytes, int) and nbytes == size and offset % ALIGN == 0
                and len(MAGIC) <= offset and offset + nbytes <= end):
            raise StateError(f"snapshot tensor {name!r}: {nbytes!r} bytes at {offset!r} for shape {shape} of {dtype}")
        first = at.get(offset) if nbytes else None
        if first is not None:
            if first[1:] != (dtype, shape, nbytes):
                raise StateError(f"snapshot tensor {name!r}: its bytes at {offset} are {first[0]!r}'s, of another "
                                 f"dtype or shape ({first[1]} {first[2]}): not an alias")
            out[name] = out[first[0]]
            continue
        if nbytes:
            at[offset] = (name, dtype, shape, nbytes)
        out[name] = (whole[offset : offset + nbytes].view(dt) if numel else torch.empty(0, dtype=dt)).reshape(shape)
    _disjoint(at)
    return out


def _disjoint(at: dict[int, tuple[str, str, list[int], int]]) -> None:
    """Raise ``StateError`` when two stored tensors' bytes overlap (``at``: offset -> name, dtype,
    shape, nbytes of each, aliases left out)."""
    last_end, last = 0, ""
    for offset in sorted(at):
        name, _, _, nbytes = at[offset]
        if offset < last_end:
            raise StateError(f"snapshot tensors {last!r} and {name!r} overlap without being aliases")
        last_end, last = offset + nbytes, name


def clone_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``state`` (name -> tensor) that keeps its aliases: names that are one tensor object
    in ``state`` are one (new) tensor object in the copy."""
    copies: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if id(t) not in copies:
            copies[id(t)] = t.clone()
        out[name] = copies[id(t)]
    return out


def snapshot_dtypes(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{name: dtype}`` of a snapshot file's tensors (``dtype`` a key of
    :data:`~prism_challenge.evaluator.statedict.DTYPES`, e.g. ``"torch.bfloat16"``), read from its
    index alone (the file is memory-mapped; no tensor is read).

    Raises:
        StateError: not a snapshot, or a malformed entry.
        OSError: the file cannot be read.
    """
    entries, _ = _index(np.memmap(path, dtype=np.uint8, mode="r"))
    out: dict[str, str] = {}
    for e in entries:
        if not (isinstance(e, list) and len(e) == 5 and isinstance(e[0], str) and e[1] in DTYPES):
            raise StateError("a snapshot file with a malformed index entry")
        out[e[0]] = e[1]
    return out


def read_snapshot_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """:func:`read_snapshot` of a file on disk (its tensors own a copy of the file's bytes).

    Raises:
        StateError: as :func:`read_snapshot`.
        OSError: the file cannot be read.
    """
    return read_snapshot(np.fromfile(path, dtype=np.uint8))


class SnapshotStream:
    """The snapshot frames of a child's stdin (``>Q`` length, then a snapshot file's bytes), read
    in order and only when a job needs the next one: a child that re-scores ``n`` snapshots holds
    one at a time (the one before is released when the next is read: the caller drops what it
    loaded before it asks again).

    Args:
        stream: a binary stream positioned at the first snapshot frame.
        uses: ``uses[i]``: how many jobs load snapshot ``i``.

    Attributes:
        held_max: the most snapshot buffers alive at once, counted when each is read (1 when the
            caller released each snapshot before asking for the next).
    """

    def __init__(self, stream: Any, uses: list[int]):
        self._stream, self._uses = stream, list(uses)
        self._index = -1
        self._data: np.ndarray | None = None
        self._alive: list[weakref.ref] = []
        self.held_max = 0

    def _read(self) -> np.ndarray:
        head = self._exact(np.empty(8, dtype=np.uint8))
        (n,) = struct.unpack(">Q", head.tobytes())
        return self._exact(np.empty(n, dtype=np.uint8))

    def _exact(self, buf: np.ndarray) -> np.ndarray:
        view, got = memoryview(buf).cast("B"), 0
        while got < len(view):
            k = self._stream.readinto(view[got:])
            if not k:
                raise EOFError("stdin ended inside a snapshot frame")
            got += k
        return buf

    def load(self, i: int) -> dict[str, torch.Tensor]:
        """Snapshot ``i``'s tensors: views of its buffer at its last use (:func:`read_snapshot`),
        copies before (a model may write to what it loaded). Reads forward to it first.

        Raises:
            StateError: ``i`` before the snapshot now held, past the last, used more often
                than ``uses`` says, or a malformed snapshot.
            EOFError: the stream ended early.
        """
        if not (self._index <= i < len(self._uses)) or self._uses[i] <= 0:
            raise StateError(f"snapshot {i} asked for out of order (holding {self._index} of {len(self._uses)})")
        while self._index < i:
            self._data = None  # released before the next is read
            self._index += 1
            self._alive = [r for r in self._alive if r() is not None]
            data = self._read()
            self._alive.append(weakref.ref(data))
            self.held_max = max(self.held_max, len(self._alive))
            self._data = data
        self._uses[i] -= 1
        tensors = read_snapshot(self._data)
        if self._uses[i] > 0:
            return clone_state(tensors)
        self._data = None  # the last use: the tensors alone keep the buffer
        return tensors


FEED_CHUNK_BYTES = 8 << 20
"""A snapshot file is fed to a child in reads of this many bytes (the parent never holds one whole)."""


class SnapshotFeed:
    """One audit child's stdin, streamed: ``head`` (its config and batches), then each snapshot
    file as a frame (``>Q`` length, then the bytes) in reads of :data:`FEED_CHUNK_BYTES`, each
    file hashed as it is read (:attr:`digests`): the parent holds no snapshot whole, and the
    bytes fed can be held to the sha256 bound when the file was written (:meth:`changed`).

    Args:
        head: the bytes before the first snapshot.
        files: the snapshot files, in the child's order.
        expected: per file, the sha256 it must have (``None``: not checked).

    Iterating raises ``OSError`` for a file that cannot be read or ends early.
    """

    def __init__(self, head: bytes, files: list[Path], expected: list[str | None] | None = None):
        self.head, self.files, self.expected = head, files, expected
        self.digests: list[str] = []

    def __iter__(self) -> Iterator[bytes]:
        yield self.head
        for path in self.files:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                yield struct.pack(">Q", size)
                left = size
                while left:
                    block = f.read(min(FEED_CHUNK_BYTES, left))
                    if not block:
                        raise OSError(f"{path}: the file ended {left} bytes early")
                    h.update(block)
                    left -= len(block)
                    yield block
            self.digests.append(h.hexdigest())

    def changed(self) -> list[str]:
        """The names of the files fed whose bytes did not hash to :attr:`expected`."""
        return [p.name for p, want, got in zip(self.files, self.expected or (), self.digests)
                if want is not None and want != got]
