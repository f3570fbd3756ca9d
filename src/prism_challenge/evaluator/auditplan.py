"""The audit's schedule: which batches of the stream are re-scored from a snapshot of the weights.

The trusted side (the feeder) decides, batch by batch, whether a batch is **audited**. The rank
learns it only from the answer to that batch's loss record, an ANSWER frame the feeder sends as
soon as the record arrives: after the record has left the rank. The rank reads it before it asks
for the next batch and before the loop gets this one (one round trip per batch; the answer used
to ride on the next BATCH, read only when the loop asked again, so a loop that stalled after its
last batch kept that batch's snapshot from the audit: red team, issue 25). Rank 0 copies the scored module's ``state_dict`` before each scoring forward (before any
submitted code ran on the batch, so before the loop could train on it) and keeps the copy until
that answer; for an audited batch it sends it: the weights that scored the batch, and nothing
the forward could have stored in them from the batch itself. It sends it on a thread of its own
while the loop trains on the batch (:mod:`~prism_challenge.evaluator.snapsend`), and its request
for the next batch follows the snapshot, so the feeder holds the snapshot, written and hashed,
before batch ``k + 1`` exists for the rank. After the stream, fresh sandboxed processes rebuild the
model, load each snapshot and score its batch again (:mod:`prism_challenge.audit.rescore`).

**Schedule: harmonic, keyed on the run's secret.** Batch 0 is always audited; every later
batch ``k`` is audited when ``u_k < r_k``, ``r_k = min(1, A / k)`` (:func:`rate_at`), with ``u_k
= HMAC-SHA256(key, "audit:k")`` read as a number in ``[0, 1)`` (:func:`audit_draw`). The key is
the run's secret (:func:`prism_challenge.pipeline.start.run_secret`): 32 bytes from :mod:`secrets`,
drawn after intake, never shown to the sandbox, revealed in the manifest (``run_secret``) once
the run has ended, so anyone can re-derive the draws (:func:`drawn_steps`) and nobody can
compute them before. The rate depends on the step alone, never on a budget: the audits follow
the stream's real length, whether the loop runs to its budget or stops at batch 40. The manifest
records it as ``audit.schedule = {"rule": "harmonic", "audited_batches": A}``.

**The bound.** Let the loop stop after ``n`` batches (any ``n``, chosen by the loop) and cheat
on a set ``S`` of ``f n`` of them. It escapes when no batch of ``S`` is audited:
``P(escape) = prod_{k in S} (1 - r_k) <= exp(-sum_{k in S} r_k)`` (``1 - x <= e^-x``). The rates
decrease with ``k``, so the sum is smallest, and the escape likeliest, for the last ``f n``
batches, ``k = n - f n, ..., n - 1``; there ``sum A / k >= A * integral_{n - fn}^{n} dx / x =
A ln(n / (n - f n))`` (``1/k >= integral_k^{k+1} dx / x``; a rate capped at 1 only makes the
escape impossible), so ``P(escape) <= exp(-A ln(1 / (1 - f))) = (1 - f)^A`` (:func:`escape_bound`),
the same ``A`` at 10 batches as at 50,000. **Against an adaptive loop.** The loop chooses, batch
by batch, whether to cheat and whether to stop, from everything it saw: the batches, the
answers to its earlier records. The draw ``u_k`` is a keyed function of ``k`` under a secret the
loop never sees, so given everything before batch ``k`` it is still uniform and independent of
the loop's choice at ``k`` (it learns ``u_k < r_k`` only after batch ``k``'s record has left).
Write ``C_k`` for "the loop cheats at ``k``": ``M_j = prod_{k < j, C_k} (1 - r_k)^{-1} * 1[no
cheat before j audited]`` is a martingale with ``M_0 = 1``, so at the (random) stop ``n``,
``E[1[escape] / prod_{k in S}(1 - r_k)] = 1``; every stop and every set with ``|S| >= f n``
has ``prod_{k in S}(1 - r_k) <= (1 - f)^A`` by the paragraph above, hence ``P(escape) <= (1 -
f)^A`` for any adaptive strategy.

**Cost.** The expected audits of a stream of ``n`` batches are ``E(n) = 1 + sum_{k=1}^{n-1}
min(1, A / k) ~ A (1 + ln(n / A))`` (:func:`expected_audits`): at the example's 197 batches and
``A = 4``, ``E = 20.1``. The audit costs about ``s = 5`` s whatever ``A`` (the first child's start,
which only the tokenizing of the probes' text overlaps; each child's reading of its snapshots;
the inputs written for ``prism verify``) plus per audited batch ``c = 0.35 + 0.3 p`` s (a build,
load, forward and scoring in the re-scoring child, one forward per blind pass ``p`` in the
blind child: :data:`~prism_challenge.audit.rescore.BLIND_PASSES` ``= 1``), against about 210 s for
the unaudited run (200k tokens of ``examples/tiny-1m`` on 2 CPU cores, 197 batches). Share
``(s + E c) / (210 + s + E c)``: ``A = 3``: ``E = 16.1``, 6.9 %; ``A = 4``: 20.1, 7.9 %; ``A =
5``: 23.9, 8.9 %; ``A = 6``: 27.5, 9.8 %; ``A = 8``: 34.1, 11.5 %; ``A = 12``: 46.1, 14.3 %.
The goal (issue 25) is at most 10 %; the count varies from run to run (standard deviation about
``sqrt(sum r_k (1 - r_k))``, 3.4 batches at ``A = 4``: 1 % of the run), so :data:`AUDITED_BATCHES`
is the largest ``A`` whose predicted share stays under 8.5 %: ``A = 4`` (``bench/audit_cost.py``
prints the schedule, the expected and actual count and the measured share; measured at 200k
tokens: audit 9.2 s of a 115.5 s run, 7.9 %, 19 of 197 batches audited). At ``A = 4`` a cheat on
``f = 1/2`` of the batches it took escapes with probability at most ``0.0625``, ``f = 1/4``:
``0.316``, ``f = 1/10``: ``0.656``, at every length; a cheat active at batch 0 is always caught;
the blind probes look at ``B`` positions per audited batch besides.

**Why not a fixed count, why not a reservoir.** A fixed count ``A`` drawn once for the budget's
length (the schedule before issue 25: ``rate = (A - 1) / (N - 1)``) lets a loop that stops at
batch 40 of 646 face 2 to 4 audits; it escaped a third of the time. Drawn without replacement,
the rank would also know when the audits were spent (it must send each audited batch's
snapshot, so it learns which were drawn) and cheat on the rest. A reservoir (keep a uniform
sample of ``A`` snapshots, chosen at the end) needs every batch's snapshot to stay
replaceable: rank 0 would have to send, or be told to send, snapshots it may later drop, and
the answer it gets tells it which batches are still in the reservoir; and with adaptive
stopping the reservoir's sample is uniform only over the batches the loop chose to take, which
the loop can time against what it learned. Independent keyed draws at a rate that decays as
``A / k`` tell the rank nothing about the batches to come, and cost ``O(A log n)``.
"""

from __future__ import annotations

import hashlib
import hmac
import math

AUDITED_BATCHES = 4
"""``A`` of the harmonic schedule: batch ``k >= 1`` is audited with probability ``min(1, A / k)``;
a cheat on a fraction ``f`` of the batches taken escapes with probability at most ``(1 - f)^A``
(the module docstring derives ``A = 4`` from the cost goal)."""

SCHEDULE_RULE = "harmonic"
"""The manifest's ``audit.schedule.rule``: :func:`rate_at`'s schedule."""

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


def expected_audits(batches: int, audited: int = AUDITED_BATCHES) -> float:
    """``E(n) = sum_{k < n} rate_at(k, A)``: the expected audited batches of a stream of ``n =
    batches`` batches (``1 + sum_{k=1}^{n-1} min(1, A / k) ~ A (1 + ln(n / A))``; 0 for ``n <= 0``)."""
    return math.fsum(rate_at(k, audited) for k in range(max(0, batches)))


def escape_bound(f: float, audited: int = AUDITED_BATCHES) -> float:
    """``(1 - f)^A``: the most probable escape, at any stop ``n``, of a cheat on a fraction ``f``
    (``0 <= f <= 1``) of the ``n`` batches the loop took (the module docstring's bound, also
    against an adaptive loop).

    Raises:
        ValueError: ``f`` outside ``[0, 1]``.
    """
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"f = {f}: the cheating fraction must be in [0, 1]")
    return (1.0 - f) ** max(0, audited)


def catch_probability(f: float, audited: int = AUDITED_BATCHES) -> float:
    """``1 - (1 - f)^A``: a lower bound, at every stream length and stop, on the chance that the
    audited batches include one of a cheat active on a fraction ``f`` of the batches taken
    (:func:`escape_bound`'s complement)."""
    return 1.0 - escape_bound(f, audited)


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
