"""What crosses the held-out boundary: the frames a trusted parent writes to a child's stdin.

Each frame is an 8-byte big-endian length and that many bytes; token batches travel as one
``np.savez`` archive of int64 arrays (never pickle). The held-out children
(:mod:`~prism_challenge.audit.heldout`) and the audit's re-scoring children
(:mod:`~prism_challenge.audit.rescore_child`) read their input this way. :class:`HeldoutError` is
the error either side of the held-out evaluation reports (``"<stage>: <reason>"``).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np


class HeldoutError(RuntimeError):
    """The held-out evaluation could not produce figures; the message says why (stage: reason)."""


def _read_exact(f: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise HeldoutError("protocol: stdin ended early")
        buf += chunk
    return bytes(buf)


def _read_frame(f: Any) -> bytes:
    (n,) = struct.unpack(">Q", _read_exact(f, 8))
    return _read_exact(f, n)


def _frame(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


def _pack_batches(batches: Sequence[np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{f"b{i:06d}": np.ascontiguousarray(b, dtype=np.int64) for i, b in enumerate(batches)})
    return buf.getvalue()


def _unpack_batches(data: bytes) -> list[np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return [z[k] for k in sorted(z.files)]
