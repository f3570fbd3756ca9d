"""The audit's schedule: which batches of the stream are re-scored from a snapshot of the weights.

The trusted side (the feeder) decides, batch by batch, whether a batch is **audited**. The rank
learns it only from the answer to that batch's loss record, which the feeder puts in the header
of the frame that follows the record (the next BATCH, or END): after the record has left the
rank. Rank 0 copies the scored module's ``state_dict`` before each scoring forward (before any
submitted code ran on the batch, so before the loop could train on it) and keeps the copy until
that answer; for an audited batch it sends it: the weights that scored the batch, and nothing
the forward could have stored in them from the batch itself. After the stream, fresh sandboxed processes rebuild the
model, load each snapshot and score its batch again (:mod:`prism_challenge.rescore`).

**Schedule.** Batch 0 is always audited; every later batch ``k`` is audited when
``u_k < rate``, with ``u_k = HMAC-SHA256(key, "audit:k")`` read as a number in ``[0, 1)`` (the
key is the run's secret probe key, never shown to the sandbox). The rate is fixed once, when the
first batch is cut, from the number of batches the budgets let the stream have
(:func:`expected_batches`): ``rate = min(1, (A - 1) / (N - 1))`` for ``A =``
:data:`AUDITED_BATCHES`, so a run of ``N`` batches audits ``A`` of them on average (``1 +
Binomial(N - 1, rate)``: about ``A +- sqrt(A)``). The stream runs on at the same rate past the
estimate; a stream cut short (a wall-clock budget) audits fewer. Each batch is drawn on its own,
not ``A`` batches without replacement: the rank learns whether a batch was audited from the
answer to its record (it must send that batch's snapshot), so with a fixed count it would know
when the audits were spent and cheat on the rest of the stream; independent draws tell it
nothing about the batches to come.

**Why A.** A cheat active on a fraction ``f`` of the batches escapes when no audited batch is one
of them: drawn independently at the rate, ``P(escape) = (1 - rate)^(f (N - 1)) <= exp(-f (A -
1))`` (:func:`catch_probability` gives the bound's complement); batch 0 is audited besides, so
a cheat active from the first batch is always caught. ``A`` is the largest count that keeps the audit
within issue 15's cost goal, at most 10 % of the run at 200k tokens of the example on 2 CPU cores
(``bench/audit_cost.py`` prints the measured share). The audit costs about ``s = 5`` s whatever
``A`` (the first child's start, which only the tokenizing of the probes' text overlaps; each
child's reading of its snapshots; the inputs written for ``prism verify``) plus per audited batch
``c = 0.35 + 0.3 p`` s (a build, load, forward and scoring in the re-scoring child, one forward
per blind pass ``p`` in the blind child), against about 210 s for the unaudited run (197
batches): ``(s + A c) / (210 + s + A c) <= 0.10`` gives ``A <= 16`` at ``p = 2`` and ``A <= 23``
at ``p = 1``. A state switch active on a tenth of the batches gains more than a peek at one
position in 64 and is caught only by the re-scoring, so the budget goes to ``A``:
:data:`~prism_challenge.rescore.BLIND_PASSES` ``= 1`` and ``A = 20`` (measured: 8 % of the run;
one standard deviation of the count, ``sqrt(A)``, is about 1.3 % of the run).
At ``A = 20``: ``f = 1/2`` is caught with probability at least 0.99993, ``f = 1/4`` with 0.991,
``f = 1/10`` with 0.85; a cheat that gains on a tenth of the batches gains a tenth as
much. The blind probes look at ``B`` positions per audited batch, ``B A`` in all: a peek at one
position in 6 escapes them with probability ``(5/6)^(4 * 20) = 5e-7`` at ``B = 4``.
"""

from __future__ import annotations

import hashlib
import hmac
import math

AUDITED_BATCHES = 20
"""``A``: the audited batches of a run, on average (batch 0 among them)."""

RESCORE_RTOL: dict[str, float] = {"cpu": 1e-6, "cuda": 1e-5}
"""The re-scoring's tolerance by device type, relative, on a batch's total nats: a record passes
when ``|recorded - rescored| <= rtol * |rescored|`` (equal values always pass). The fresh process
runs the same kernels on the same shapes with the same forced thread count and deterministic
algorithms, so an eager model matches to the last bit (the example does, on CPU); the margin only
absorbs a loop that scores a ``torch.compile``'d wrapper of the module (fused kernels round
differently from the eager ones the audit runs). On CUDA, cuBLAS and the fused attention kernels
are run-to-run deterministic under the forced flags, but a compiled wrapper's Triton kernels are
not bitwise those of eager mode: ``1e-5``. Either bounds what a record could gain unnoticed to
``rtol`` of its loss."""


def audit_draw(key: bytes, step: int) -> float:
    """``HMAC-SHA256(key, "audit:<step>")``'s first 8 bytes as a number in ``[0, 1)``."""
    digest = hmac.new(key, f"audit:{step}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def rate_at(step: int, audited: int = AUDITED_BATCHES) -> float:
    """The chance that batch ``step`` is audited under the harmonic schedule: 1 for ``step = 0``,
    ``min(1, A / step)`` after it (``A = audited``; 0 when ``A = 0``). It depends on the step
    alone, never on a budget, so the audits follow the run's real length: for any stop ``n`` and
    any set ``S`` of ``f n`` batches among the first ``n``, ``P(no batch of S audited) <= (1 -
    f)^A`` (the module docstring gives the proof)."""
    if audited <= 0:
        return 0.0
    return 1.0 if step <= 0 else min(1.0, audited / step)


def is_audited(key: bytes, step: int, audited: int = AUDITED_BATCHES) -> bool:
    """Whether batch ``step`` is audited: :func:`audit_draw` below :func:`rate_at` (step 0
    always, while ``A > 0``)."""
    rate = rate_at(step, audited)
    return rate >= 1.0 or (rate > 0.0 and audit_draw(key, step) < rate)


def drawn_steps(key: bytes, batches: int, audited: int = AUDITED_BATCHES) -> list[int]:
    """Every audited batch of a stream of ``batches`` batches, in order: what the feeder drew
    with the run's secret ``key``, re-derived (``prism verify`` compares it with the manifest)."""
    return [k for k in range(max(0, batches)) if is_audited(key, k, audited)]


def audit_rate(expected: int | None, audited: int = AUDITED_BATCHES) -> float:
    """The share of batches after the first that are audited: ``min(1, (A - 1) / (N - 1))`` for
    ``N = expected`` batches; 1.0 when ``N`` is unknown (``None``) or at most 1."""
    if expected is None or expected <= 1:
        return 1.0
    return min(1.0, max(0, audited - 1) / (expected - 1))


def expected_batches(*, rows_per_step: int, seq_len: int, step_budget: int | None, token_budget: int | None,
                     byte_budget: int | None, first_step_bytes: int, stream_bytes: int | None) -> int | None:
    """How many batches the stream can have, from the budgets (the smallest bound; ``None``: none).

    ``token_budget`` stream tokens make ``ceil((budget - 1) / (rows * (T - 1)))`` batches (rows
    overlap by one token); ``byte_budget`` and ``stream_bytes`` (the train split's UTF-8 bytes)
    are divided by the target bytes of the first batch (an estimate: text density varies).
    """
    bounds = []
    if step_budget is not None:
        bounds.append(step_budget)
    per_step = rows_per_step * (seq_len - 1)
    if token_budget is not None and per_step > 0:
        bounds.append(math.ceil(max(token_budget - 1, 1) / per_step))
    for total in (byte_budget, stream_bytes):
        if total is not None and first_step_bytes > 0:
            bounds.append(math.ceil(total / first_step_bytes))
    return max(1, min(bounds)) if bounds else None


def catch_probability(f: float, audited: int = AUDITED_BATCHES) -> float:
    """``1 - exp(-f (A - 1))``: a lower bound, for every stream length ``N``, on the chance that
    the batches audited after the first include one of a cheat active on a fraction ``f`` of
    them: each is drawn at ``rate = (A - 1) / (N - 1)``, so the escape is ``(1 - rate)^(f (N -
    1)) <= exp(-rate f (N - 1)) = exp(-f (A - 1))`` (``ln(1 - x) <= -x``), the limit of large
    ``N``; a cheat active at batch 0 is always caught."""
    return 1.0 - math.exp(-f * max(0, audited - 1))


def within(recorded: float | None, rescored: float | None, device: str) -> bool:
    """Whether a recorded batch loss (nats; ``None``: not finite) is reproduced by its re-scoring
    within :data:`RESCORE_RTOL` of ``device``'s type."""
    if recorded is None or rescored is None or not (math.isfinite(recorded) and math.isfinite(rescored)):
        fin = lambda v: v is not None and math.isfinite(v)  # noqa: E731
        return not fin(recorded) and not fin(rescored)
    if recorded == rescored:
        return True
    rtol = RESCORE_RTOL["cuda" if device.startswith("cuda") else "cpu"]
    return abs(recorded - rescored) <= rtol * abs(rescored)
