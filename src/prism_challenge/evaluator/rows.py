"""Rows of the train stream: overlapping rows cut from the token chunks, under a token budget.

Rows: ``seq_len`` tokens each; consecutive rows overlap by one token, so row ``i`` of the stream
covers tokens ``[i*(T-1), i*(T-1)+T)`` and every token after the first is a target exactly once.
When fewer than ``T`` tokens remain, the last ``n >= 2`` tokens form one final, shorter row
(world size 1 only: a single row cannot be split across ranks). The feeder
(:class:`~prism_challenge.evaluator.feeder.Feeder`) cuts its batches here; the held-out
evaluation cuts its rows with the same :class:`RowAssembler`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from prism_challenge.data.stream import TokenChunk


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

    Tokenization then overlaps the ranks' own work (the feeder starts it once the gates passed,
    while the ranks import the bundle and build the model). An exception in the source is
    re-raised in the consumer.
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
