"""The feeder's checks on the ranks: in step with each other, identical at the end, not stalled.

:class:`RankChecks` (a base of :class:`~prism_challenge.evaluator.feeder.Feeder`) fails a run
whose ranks left the stream at different batches or ended with different states (numerical
drift told apart from a real difference), and tells the parent's watch loop when a rank went
silent or no batch was ever scored.
"""

from __future__ import annotations

import time
from typing import Any

from prism_challenge.evaluator.statedict import drift_only
from prism_challenge.failures import DRIFT


class RankChecks:
    """Lockstep, state agreement and stall checks (a base of
    :class:`~prism_challenge.evaluator.feeder.Feeder`)."""

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
