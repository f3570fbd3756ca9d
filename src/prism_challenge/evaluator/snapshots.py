"""The trusted side's record of the audited batches (:mod:`~prism_challenge.evaluator.auditplan`).

For each audited step the feeder keeps every rank's slice of the batch (token ids ``[B, T]``),
the nats each rank recorded for it, and rank 0's snapshot of the scored module's ``state_dict``
as it stood when the batch was scored. The snapshot arrives as SNAPSHOT frames (the raw-tensor
format of :mod:`~prism_challenge.evaluator.statedict`, never pickled), each written to
``<audit dir>/step-<step>.snap`` as it arrives (:mod:`~prism_challenge.evaluator.snapfile`); its
sha256, the sha256 of that file, is computed over the bytes as they are written. A tied weight
(two names, one storage) arrives once, then as an alias frame naming the first name, and is
stored once (:meth:`SnapshotStore.add`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.evaluator.snapfile import SnapshotWriter
from prism_challenge.evaluator.statedict import StateError, check_frame


def snapshot_name(step: int) -> str:
    """The snapshot file's name for ``step``."""
    return f"step-{step:06d}.snap"


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class AuditedStep:
    """One audited step.

    Attributes:
        step: the step (global batch index).
        pieces: rank -> that rank's slice ``[B, T]`` int64 as it was served.
        recorded: rank -> the nats that rank recorded (``None``: not finite).
        snapshot: the snapshot file, once complete.
        sha256: the snapshot file's sha256.
    """

    step: int
    pieces: dict[int, np.ndarray] = field(default_factory=dict)
    recorded: dict[int, float | None] = field(default_factory=dict)
    snapshot: Path | None = None
    sha256: str | None = None


class SnapshotStore:
    """Writes the SNAPSHOT frames of one rank (rank 0) to files as they arrive, one audited step
    at a time (:class:`~prism_challenge.evaluator.snapfile.SnapshotWriter`): each tensor's bytes
    go to the file and into its sha256 the moment its frame is read, so no snapshot is ever held
    whole on the trusted side (one frame, one tensor, at a time), and the digest is known when
    the last byte is written. The file lives in the trusted side's audit folder, which no jailed
    process can write: the bytes hashed are the bytes the audit later feeds its children (who
    hash them again as they are fed, :mod:`~prism_challenge.audit.rescore`).

    Args:
        directory: where the files go (created on first use).
        max_bytes: most bytes of one snapshot's tensors.
    """

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = Path(directory), max_bytes
        self.expected: int | None = None  # the step whose snapshot is due (rank 0 was told it is audited)
        self._writer: SnapshotWriter | None = None
        self._names: dict[str, tuple[str, list[int]]] = {}  # this snapshot's names: dtype, shape
        self._aliases: set[str] = set()  # those of them sent as aliases
        self._bytes = 0
        self.taken = 0  # snapshots begun in this run
        self.total = 0  # tensor bytes received (and stored: an alias has none) in this run, all snapshots

    def outgrew_fp32(self) -> bool:
        """Whether this run's snapshots carry more than 4 bytes per element of a model at the
        parameter cap each (``max_bytes`` is 16 bytes per element: float64 and the like): a
        trusted disk that fills then was filled by the submission's choice of dtypes, not by
        what an honest model at the cap needs, which the operator provisions."""
        return self.total > self.taken * (self.max_bytes // 4)

    def expect(self, step: int) -> None:
        """Rank 0 was told that ``step`` is audited: its snapshot comes next.

        Raises:
            StateError: the previous snapshot never ended.
        """
        if self.expected is not None:
            raise StateError(f"the snapshot of audited batch {self.expected} did not end before batch {step}'s")
        self.expected, self._names, self._aliases, self._bytes = step, {}, set(), 0
        self.taken += 1

    def room(self) -> int:
        """Bytes the next SNAPSHOT frame may carry (0 when none is due)."""
        return 0 if self.expected is None else max(self.max_bytes - self._bytes, 0)

    def add(self, header: dict[str, Any], payload: bytearray) -> None:
        """One SNAPSHOT frame: checked, written and hashed now. A frame whose header names an
        ``alias`` (an earlier name of this snapshot: a tied weight) carries no payload and
        writes no tensor byte (:meth:`_alias`).

        Raises:
            StateError: none is due, another step's, a bad tensor, a name sent twice, too large,
                a malformed alias.
            OSError: the file cannot be written.
        """
        if self.expected is None or header.get("step") != self.expected:
            raise StateError(f"a snapshot tensor for batch {header.get('step')!r}, which was not audited now")
        self._bytes += len(payload) + len(str(header.get("name"))) + 64  # the index entry counts too
        self.total += len(payload)
        if self._bytes > self.max_bytes:
            raise StateError(f"the snapshot of batch {self.expected} exceeds {self.max_bytes} bytes")
        if "alias" in header:
            self._alias(header, payload)
            return
        name, dtype, shape = check_frame({k: header.get(k) for k in ("name", "dtype", "shape")}, payload)
        if name in self._names:
            raise StateError(f"snapshot tensor {name!r} of batch {self.expected} sent twice")
        self._names[name] = (dtype, shape)
        self._open().add(name, dtype, shape, payload)

    def _alias(self, header: dict[str, Any], payload: bytearray) -> None:
        """An alias frame: ``name`` is the tensor ``alias`` names, stored once. Believed as a claim
        about storage alone: the re-scoring loads both names from the one stored tensor, so an
        alias of a tensor that was not tied to it re-scores another model than the one that
        made the record, and the audit names the mismatch (the submission's).

        Raises:
            StateError: a payload, a name sent twice, an alias of a name this snapshot did not
                store before it (unknown, itself an alias, or the name itself: no chain, no
                cycle), or a dtype or shape that is not the stored tensor's.
        """
        name, of, dtype, shape = (header.get(k) for k in ("name", "alias", "dtype", "shape"))
        step = self.expected
        if payload or not isinstance(name, str) or not isinstance(of, str):
            raise StateError(f"snapshot tensor {str(name)[:200]!r} of batch {step}: a malformed alias frame "
                             f"(it names the earlier tensor in 'alias' and carries no bytes)")
        if name in self._names:
            raise StateError(f"snapshot tensor {name!r} of batch {step} sent twice")
        target = self._names.get(of)
        if target is None or of in self._aliases:
            raise StateError(f"snapshot tensor {name!r} of batch {step}: an alias of {of[:200]!r}, which this "
                             f"snapshot did not store before it")
        if target != (dtype, shape):
            raise StateError(f"snapshot tensor {name!r} of batch {step}: an alias of {of!r}, which is "
                             f"{target[0]} {target[1]}, not {str(dtype)[:40]} {str(shape)[:200]}")
        self._names[name] = target
        self._aliases.add(name)
        self._open().alias(name, of)

    def _open(self) -> SnapshotWriter:
        """The file of the snapshot due, created at its first tensor."""
        if self._writer is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = SnapshotWriter(self.directory / snapshot_name(self.expected))
        return self._writer

    def end(self, header: dict[str, Any], audited: AuditedStep) -> None:
        """The SNAPSHOT_END frame: close the file, fill ``audited.snapshot`` and ``sha256``.

        Raises:
            StateError: none is due, another step's, or a tensor count that differs.
            OSError: the file cannot be written.
        """
        step = self.expected
        if step is None or header.get("step") != step or header.get("tensors") != len(self._names):
            raise StateError(f"a malformed end of the snapshot of batch {header.get('step')!r}")
        writer, self._writer = self._open(), None  # a state with no tensor: an empty file of the format
        audited.sha256, audited.snapshot = writer.close(), writer.path
        self.expected, self._names, self._aliases, self._bytes = None, {}, set(), 0

    def abort(self) -> None:
        """Remove an unfinished snapshot's file (the run failed or the rank left mid-snapshot)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abort()
