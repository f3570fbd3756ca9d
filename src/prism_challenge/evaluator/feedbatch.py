"""The feeder's batches: a rank's request answered with its slice of the next global batch.

:class:`BatchServer` (a base of :class:`~prism_challenge.evaluator.feeder.Feeder`) checks a
rank's NEXT request (one batch in flight, one shape for the run), cuts step ``k``'s global batch
once (the next ``world_size * batch_size`` rows, :class:`~prism_challenge.evaluator.rows.RowAssembler`)
and hands each rank its contiguous slice, stops the stream at the first budget reached, and draws
from the run's secret which steps are probed for causality and which are audited.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import numpy as np

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.auditplan import is_audited
from prism_challenge.evaluator.feedlink import RankState
from prism_challenge.evaluator.protocol import Kind, ProtocolError
from prism_challenge.evaluator.rows import Cut
from prism_challenge.evaluator.snapshots import AuditedStep

PROBE_FIRST = 2  # the first batches are always probed for causality
PROBE_RATE = 1 / 16  # and this share of the rest, at random
DRAIN_WAIT_S = 5.0  # a rank's request may find its previous batch still leaving the writer thread


class BatchServer:
    """Serves the batches (a base of :class:`~prism_challenge.evaluator.feeder.Feeder`):
    :meth:`_on_next` answers a rank's NEXT frame with a BATCH (or the END of the stream)."""

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
