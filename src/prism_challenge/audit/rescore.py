"""The audit after the stream: audited batches scored again from their weight snapshots, and
blind probes with real text, each in fresh sandboxed processes (:mod:`~prism_challenge.evaluator.auditplan`).

For every audited step the trusted side holds each rank's slice ``[B, T]`` of the batch, the nats
each rank recorded for it, and rank 0's snapshot of the scored module's state as it stood when
the batch was scored. Two kinds of child, started through the run's
:class:`~prism_challenge.evaluator.jail.Jail` with the run's own context values
(:func:`prism_challenge.evaluator.interface.run_context`; ``ctx.artifacts_dir`` the run's path,
an empty folder then), rebuild the model with ``build_model`` under the forced seed for each
slice and load the snapshot:

* the **re-scoring** child scores the slice as the instrument did
  (:func:`~prism_challenge.evaluator.instrument.measure`): its nats must equal the record
  (:func:`~prism_challenge.evaluator.auditplan.within`); a difference zeroes the run. State kept
  outside the ``state_dict`` (a Python attribute the loop switches) is not in the snapshot, so a
  model whose record depended on it is caught.
* the **blind probe** child, a separate fresh process, is shown for each slice a batch of the
  same shape ``[B, T]`` in which every row ``b`` keeps its tokens before a keyed position
  ``k_b`` and continues with real held-out text (the val split: never in the train stream, no
  true future token of any row). Its log-probabilities at ``(b, k_b - 1)`` must give the true
  token ``tokens[b, k_b]`` the nats the re-scoring gave it, within
  :data:`~prism_challenge.evaluator.instrument.PROBE_TOLERANCE_NATS`. A model that reads a later
  token (from the snapshot's state or not) is caught here.

The children are ``python -m prism_challenge.audit.rescore_child --stdin`` (:mod:`~prism_challenge.audit.rescore_child`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.evaluator.auditplan import within
from prism_challenge.evaluator.freshdir import empty_folders
from prism_challenge.evaluator.pagecache import cache_note, empty_page_cache
from prism_challenge.evaluator.snapfile import SnapshotFeed
from prism_challenge.audit.heldout_wire import _frame, _pack_batches

BLIND_PASSES = 1
"""Blind probe batches per audited slice, each with its own keyed positions: a model that reads the
future at a fraction ``q`` of the positions escapes them with probability about
``(1 - q)^(BLIND_PASSES * B * A)`` (``B`` rows per slice, ``A`` audited batches). Each pass costs
one forward per audited batch, as much as the re-scoring's: the cost goal buys more audited
batches with one pass than more passes (:mod:`~prism_challenge.evaluator.auditplan`)."""
STDERR_TAIL_LINES = 15


class AuditError(RuntimeError):
    """The audit could not run to its end; the message says why (``stage: reason``).

    ``by_submission`` is set when the child that ran submitted code failed of its own doing
    (:data:`SUBMITTED_STAGES`, an audit-hook refusal, or a crash without a reply), as opposed to
    a timeout or a harness/protocol fault: :func:`run_audit` then tries once more, and a second
    failure is the submission refusing its audit (:data:`REFUSED`)."""

    def __init__(self, message: str, *, by_submission: bool = False) -> None:
        super().__init__(message)
        self.by_submission = by_submission


SUBMITTED_STAGES = ("import", "build", "load", "score", "contract")
"""The prefixes of a child's own error report (:func:`prism_challenge.audit.heldout_child.submission_failure`)
that name an exception raised while the child ran submitted code: importing the bundle,
``build_model``, ``load_state_dict``, the forward (``contract``: the instrument's ContractError).
The main run ran the same code on the same weights and batch without failing."""

HANG_FACTOR = 20.0
"""How many times the run's own seconds per batch (times the child's jobs) a retried child of one
snapshot may take beyond the audit's whole limit before it counts as a hang (:func:`hang_limit`)."""

REFUSED = "refused: "
"""The prefix of ``audit.error`` when the audit failed twice of the submission's own doing
(red team, issue 25): a bundle that raises, or crashes its process, only where it is re-scored
(a plain attribute set by its loop tells a live model from one rebuilt from a snapshot) turned a
caught cheat into an audit that "could not run", which proved nothing and cost nothing. The
audit is tried again in fresh processes of one snapshot each (no more memory than the run held),
and a second failure of any kind (with its own time limit) is a refusal: the service records it as the finding
``audit_refused`` (:data:`prism_challenge.service.findings.PROVEN_CHEATS`). A timeout first is
tried again too, one snapshot per child, each under its own :func:`hang_limit` (the audit's
whole limit plus :data:`HANG_FACTOR` times the run's own seconds per batch): a child past it hung
of its own doing (a loop that busy-waits only where re-scored), a refusal; the whole retry past
its deadline with no child past its own (a host or model too slow for the audit's limit) stays a
plain ``audit.error``, and so does the jail failing to start a child."""


@dataclass
class Job:
    """One slice to score again: ``state`` indexes the snapshots, ``picks`` the ``(row, k)`` probed."""

    step: int
    rank: int
    state: int
    tokens: np.ndarray
    picks: list[tuple[int, int]]
    probe: np.ndarray | None = None


@dataclass
class AuditReport:
    """The audit's outcome (the manifest's ``audit`` section, :meth:`to_dict`).

    Attributes:
        batches: per audited step ``{step, snapshot_sha256, inputs_sha256, recorded_nats,
            rescored_nats, match}`` (nats per rank, ``None``: not finite).
        blind_probes: rows probed blind; ``probe_skipped`` says why none were.
        mismatch: the first record its re-scoring did not reproduce, or the first blind probe
            that failed, named; ``None`` when all passed.
        error: why the audit could not run (it zeroes the run like a mismatch).
        page_cache: whether the host's page cache was emptied before each blind probe child
            (:data:`~prism_challenge.evaluator.pagecache.EMPTIED`, or why not); ``None`` when no
            blind probe child ran.
    """

    batches: list[dict[str, Any]] = field(default_factory=list)
    blind_probes: int = 0
    probe_skipped: str | None = None
    mismatch: str | None = None
    error: str | None = None
    wall_s: float = 0.0
    page_cache: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    flops: Any = None  # the re-scoring child's FLOP count (prism_challenge.score.flops.child_count), not in to_dict

    @property
    def passed(self) -> bool:
        """No mismatch and no error."""
        return self.mismatch is None and self.error is None

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``audit`` section (``mismatch`` and ``error``, which can quote a child's
        own words, with control characters shown as escapes)."""
        from prism_challenge.terminal import printable

        return {**self.meta, "batches": self.batches, "blind_probes": self.blind_probes,
                "probe_skipped": self.probe_skipped, "mismatch": self.mismatch and printable(self.mismatch),
                "error": self.error and printable(self.error), "page_cache": self.page_cache,
                "passed": self.passed, "wall_s": self.wall_s}


def _draw(key: bytes, label: str) -> int:
    return int.from_bytes(hmac.new(key, label.encode(), hashlib.sha256).digest()[:8], "big")


def probe_batch(tokens: np.ndarray, filler: np.ndarray, key: bytes, step: int, rank: int, npass: int = 0
                ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The blind probe's input for one slice and its ``(row, k)`` picks.

    Row ``b`` keeps ``tokens[b, :k_b]`` and continues with ``T - k_b`` consecutive tokens of
    ``filler`` (held-out text) from a keyed offset; ``1 <= k_b < T`` keyed by ``(step, rank,
    npass, b)``. Consecutive rows overlap by one token, so a row probed at its last target
    (``k_b = T - 1``) has its true token as the next row's first: that next row is then filler
    only, and not probed.

    Raises:
        ValueError: ``filler`` is shorter than ``T``.
    """
    rows, t = tokens.shape
    if len(filler) < t:
        raise ValueError(f"the held-out text ({len(filler)} tokens) is shorter than a row ({t})")
    out = np.empty_like(tokens)
    picks: list[tuple[int, int]] = []
    for b in range(rows):
        k = 1 + _draw(key, f"audit-probe-k:{step}:{rank}:{npass}:{b}") % (t - 1)
        if picks and picks[-1] == (b - 1, t - 1):
            k = 0  # the previous row's true last token would be this row's first
        off = _draw(key, f"audit-probe-offset:{step}:{rank}:{npass}:{b}") % (len(filler) - (t - k) + 1)
        out[b, :k] = tokens[b, :k]
        out[b, k:] = filler[off : off + t - k]
        if k:
            picks.append((b, k))
    return out, picks


def inputs_digest(job_tokens: Sequence[np.ndarray]) -> str:
    """sha256 over the int64 bytes of a step's slices (rank order)."""
    h = hashlib.sha256()
    for t in job_tokens:
        h.update(np.ascontiguousarray(t, dtype=np.int64).tobytes())
    return h.hexdigest()


def plan(audits: dict[int, Any], world_size: int, filler: np.ndarray | None, key: bytes
         ) -> tuple[list[Job], list[Job], list[Path], list[str]]:
    """The jobs of the audited steps that are complete, their snapshot files, and what is missing.

    Returns ``(jobs, blind jobs, snapshot paths, problems)``: one re-scoring job per slice (its
    picks: every pass's), :data:`BLIND_PASSES` blind jobs per slice (``probe`` set; none without
    ``filler``); a problem names a step without its snapshot or without a slice or record of
    every rank (the run is then zeroed).
    """
    jobs, blind, paths, problems = [], [], [], []
    for step in sorted(audits):
        a = audits[step]
        if a.snapshot is None or len(a.pieces) < world_size or len(a.recorded) < world_size:
            what = "its weight snapshot" if a.snapshot is None else "a record of every rank"
            problems.append(f"audited batch {step}: {what} never arrived")
            continue
        paths.append(Path(a.snapshot))
        for r in range(world_size):
            passes = [] if filler is None else [probe_batch(a.pieces[r], filler, key, step, r, p)
                                                for p in range(BLIND_PASSES)]
            jobs.append(Job(step, r, len(paths) - 1, a.pieces[r], [pick for _, picks in passes for pick in picks]))
            blind += [Job(step, r, len(paths) - 1, a.pieces[r], picks, probe) for probe, picks in passes]
    return jobs, blind, paths, problems


def _groups(paths: list[Path], per_child: int | None = None) -> list[list[int]]:
    """Snapshot indices per child: ``per_child`` each (``None``: all in one child). A child
    holds one snapshot at a time whatever its count (:mod:`~prism_challenge.audit.rescore_child` reads
    the next only after the last job of the one before), so one child serves them all: one
    interpreter and device start-up per mode instead of one per snapshot."""
    n = len(paths)
    size = n if per_child is None else max(1, per_child)
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)] if n else []


CHILD_ARGV = (sys.executable, "-m", "prism_challenge.audit.rescore_child", "--stdin")


def child_argv(device: str = "cpu") -> list[str]:
    """The audit child's command for ``device``: on CUDA with ``--device cuda``, so that a
    spare starts CUDA in its prologue while it waits to be fed
    (:func:`prism_challenge.audit.rescore_child.start_device`); the spare's key is this argv."""
    return [*CHILD_ARGV, "--device", "cuda"] if str(device).startswith("cuda") else list(CHILD_ARGV)


def job_config(config: dict[str, Any], jobs: list[Job], group: list[int], mode: str, *, first: bool
               ) -> dict[str, Any]:
    """The config one ``mode`` child reads: ``config``, the mode and its ``jobs`` (``state``
    indexed within ``group``, the child's snapshots). ``flop_shapes`` stays only in the first
    re-scoring child's (``first``): the FLOPs are counted once per run (:mod:`~prism_challenge.score.flops`)."""
    index = {s: i for i, s in enumerate(group)}
    child = {**config, "mode": mode,
             "jobs": [{"step": j.step, "rank": j.rank, "state": index[j.state], "picks": j.picks} for j in jobs]}
    if mode != "rescore" or not first:
        child.pop("flop_shapes", None)
    return child


def _payloads(config: dict[str, Any], jobs: list[Job], paths: list[Path], mode: str,
              per_child: int | None = None, expect: Sequence[str | None] | None = None
              ) -> list[tuple[str, int, Any]]:
    """One ``(mode, jobs, payload maker)`` per ``mode`` child (:func:`_groups`): its jobs' count
    and a function that makes its :class:`~prism_challenge.evaluator.snapfile.SnapshotFeed` (the
    snapshots are read as they are fed, and checked against ``expect``, the sha256 per path,
    after the child ended)."""
    out = []
    for group in _groups(paths, per_child):
        mine = [j for j in jobs if j.state in group]
        if not mine:
            continue
        child = job_config(config, mine, group, mode, first=not out)
        batches = [j.tokens if mode == "rescore" else j.probe for j in mine]

        def payload(child=child, batches=batches, group=group) -> SnapshotFeed:
            head = _frame(json.dumps(child).encode()) + _frame(_pack_batches(batches))
            return SnapshotFeed(head, [paths[s] for s in group], [expect[s] for s in group] if expect else None)

        out.append((mode, len(mine), payload))
    return out


def _run_tasks(jail: Any, tasks: list[tuple[str, int, Any]], *, deadline: float, writable: Sequence[str],
               child_limit: Callable[[int], float] | None = None, device: str = "cpu",
               before_blind: Callable[[], None] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run one child per task, one at a time, the next one warming while one works (see
    :func:`run_both`); each mode's per-job results in task order. ``child_limit(jobs)``: the
    seconds one child of that many jobs may take (``None``: until ``deadline``); a child that
    runs past its own limit, before the deadline, hung of its own doing (``by_submission``).
    ``before_blind``: called once the child before a blind probe child has ended, right before
    that child is fed (:func:`run_audit` empties the page cache there).

    Raises:
        AuditError: as :func:`run_both`; ``hang: ...`` for a child past its own limit.
    """
    results: dict[str, list[dict[str, Any]]] = {"rescore": [], "blind": []}
    argv = child_argv(device)
    try:
        for i, (mode, count, payload) in enumerate(tasks):
            data = payload()
            empty_folders(writable)  # nothing another child left there (freshdir)
            if mode == "blind" and before_blind is not None:
                before_blind()  # nothing another child left in the page cache either (pagecache)
            left = deadline - time.monotonic()
            limit = child_limit(count) if child_limit is not None else None
            done = jail.run(argv, input=data, timeout_s=min(left, limit) if limit else left,
                            writable=writable, warm_next=i + 1 < len(tasks))
            if done.timed_out and limit is not None and limit < left:
                raise AuditError(f"hang: the {mode} process of one snapshot ({count} job(s)) ran past its own "
                                 f"limit of {limit:.0f} s", by_submission=True)
            reply = _reply(done, mode)
            changed = data.changed() if isinstance(data, SnapshotFeed) else []
            if changed:  # never the submission's doing: no jailed process can write the audit folder
                raise AuditError(f"audit: the snapshot {changed[0]} no longer hashes to the value bound when it was "
                                 f"written")
            got = reply.get("jobs")
            if not isinstance(got, list) or len(got) != count:
                raise AuditError(f"protocol: malformed reply from the {mode} process")
            results[mode] += got
    finally:
        jail.drop_spare(argv, writable=writable)  # an earlier child failed: never fed
    return results


def run_children(jail: Any, config: dict[str, Any], jobs: list[Job], paths: list[Path], *, mode: str,
                 deadline: float, writable: Sequence[str]) -> list[dict[str, Any]]:
    """The ``mode`` (``rescore`` or ``blind``) children over ``jobs``: their per-job results in
    job order (the folders are left as the last child left them).

    Raises:
        AuditError: as :func:`run_both`.
    """
    return _run_tasks(jail, _payloads(config, jobs, paths, mode), deadline=deadline, writable=writable,
                      device=str(config.get("device", "cpu")))[mode]


def run_both(jail: Any, config: dict[str, Any], jobs: list[Job], blind: list[Job], paths: list[Path], *,
             deadline: float, writable: Sequence[str], per_child: int | None = None,
             child_limit: Callable[[int], float] | None = None, expect: Sequence[str | None] | None = None,
             before_blind: Callable[[], None] | None = None
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The re-scoring children over ``jobs``, then the blind probe children over ``blind`` (if
    any): ``(rescored, blind or None)``, each list in job order.

    One child is fed at a time, with the ``writable`` folders emptied before each
    (:mod:`~prism_challenge.evaluator.freshdir`): side by side, a re-scoring child could leave
    the true rows in the shared ``ctx.artifacts_dir`` for a blind child beside it. The next child
    is started as a spare (:meth:`~prism_challenge.evaluator.jail.Jail.warm`) when one is fed: it
    imports torch and the harness, then waits for its stdin, so the start-ups (about 3 s each on
    2 cores) overlap the work instead of adding to it; it runs submitted code only once it is
    fed, after the one before it ended and the folders were emptied.

    Raises:
        AuditError: timeout, an audit-hook refusal, a crash, a malformed reply, the child's error
            (the re-scoring's first).
    """
    tasks = (_payloads(config, jobs, paths, "rescore", per_child, expect)
             + (_payloads(config, blind, paths, "blind", per_child, expect) if blind else []))
    results = _run_tasks(jail, tasks, deadline=deadline, writable=writable, child_limit=child_limit,
                         device=str(config.get("device", "cpu")), before_blind=before_blind)
    empty_folders(writable)
    return results["rescore"], (results["blind"] if blind else None)


def _reply(done: Any, mode: str) -> dict[str, Any]:
    if done.timed_out:
        raise AuditError(f"timeout: the {mode} process ran past the audit's time limit")
    if done.refusal is not None:
        raise AuditError(f"contract: {done.failure.partition(': ')[2]}", by_submission=True)
    tail = done.stderr_tail(STDERR_TAIL_LINES)  # after a note of the bytes dropped, if any (outputcap)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        reply = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):  # not JSON, a number too long, nested too deep
        reply = None
    if not isinstance(reply, dict):  # the child died while it ran submitted code, or before
        raise AuditError(f"{done.failure or 'crash: no result'} in the {mode} process\n{tail}".rstrip(),
                         by_submission=True)
    if not reply.get("ok"):
        error = str(reply.get("error") or f"{mode}: failed without a reason")
        raise AuditError(error, by_submission=error.partition(": ")[0] in SUBMITTED_STAGES)
    return reply


def _nats(v: Any) -> float | None:
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise AuditError("protocol: malformed nats in a reply")
    return float(v)


def compare_rescore(jobs: list[Job], audits: dict[int, Any], results: list[dict[str, Any]], device: str,
                    world_size: int, report: AuditReport) -> None:
    """Fill ``report.batches`` and the first record mismatch (:func:`~prism_challenge.evaluator.auditplan.within`)."""
    by_step: dict[int, dict[int, float | None]] = {}
    for job, res in zip(jobs, results):
        by_step.setdefault(job.step, {})[job.rank] = _nats(res.get("nats"))
    for step in sorted(by_step):
        a = audits[step]
        recorded = [a.recorded[r] for r in range(world_size)]
        rescored = [by_step[step].get(r) for r in range(world_size)]
        ok = all(within(x, y, device) for x, y in zip(recorded, rescored))
        report.batches.append({"step": step, "snapshot_sha256": a.sha256,
                               "inputs_sha256": inputs_digest([a.pieces[r] for r in range(world_size)]),
                               "recorded_nats": recorded, "rescored_nats": rescored, "match": ok})
        if not ok and report.mismatch is None:
            r = next(i for i, (x, y) in enumerate(zip(recorded, rescored)) if not within(x, y, device))
            report.mismatch = (f"audited batch {step}" + (f" (rank {r})" if world_size > 1 else "")
                               + f": recorded {recorded[r]!r} nats, re-scored {rescored[r]!r} nats from the weights "
                               f"that scored it, in a fresh process (the forward may depend only on the "
                               f"state_dict and the input)")


def compare_blind(jobs: list[Job], rescored: list[dict[str, Any]], blind_jobs: list[Job],
                  blind: list[dict[str, Any]], vocab_size: int, autocast: Any) -> tuple[int, str | None]:
    """(rows probed, the first failed probe named or ``None``): each blind job's log-probability
    of the true token against the re-scoring's nats of that ``(row, k)`` of its slice.

    Raises:
        AuditError: a malformed reply.
    """
    import torch

    from prism_challenge.audit.blindprobe import PRECISIONS
    from prism_challenge.evaluator.instrument import PROBE_TOLERANCE_NATS, probe_precision

    refs: dict[tuple[int, int], dict[tuple[int, int], Any]] = {}
    for job, full in zip(jobs, rescored):
        picked = full.get("picked")
        if not isinstance(picked, list) or len(picked) != len(job.picks):
            raise AuditError("protocol: malformed reply from the re-scoring process")
        refs[(job.step, job.rank)] = dict(zip(job.picks, picked))
    probed = 0
    for job, seen in zip(blind_jobs, blind):
        vectors, name = seen.get("logprobs"), seen.get("precision")
        if not (isinstance(vectors, list) and len(vectors) == len(job.picks) and name in PRECISIONS):
            raise AuditError("protocol: malformed reply from the blind probe process")
        picked = [refs[(job.step, job.rank)][pick] for pick in job.picks]
        tol = PROBE_TOLERANCE_NATS[probe_precision(getattr(torch, name), autocast)]
        for (row, k), ref, enc in zip(job.picks, picked, vectors):
            lp = np.frombuffer(base64.b64decode(enc), dtype=np.float32)
            if lp.shape != (vocab_size,):
                raise AuditError("protocol: malformed log-probabilities from the blind probe process")
            ref, got = _nats(ref), 0.0 - float(lp[int(job.tokens[row, k])])
            probed += 1
            if ref is None or not (math.isfinite(ref) and math.isfinite(got)):
                continue  # non-finite: charged 2 ln V per target already
            if not (ref == got or abs(ref - got) <= tol):
                return probed, (f"blind probe of audited batch {job.step}, row {row}" +
                                (f" of rank {job.rank}" if job.rank else "") +
                                f": token {k} cost {ref:.6g} nats when the model was shown the whole row and "
                                f"{got:.6g} nats when the row went on with other real text after token {k - 1} "
                                f"(over the {name} tolerance of {tol:.3g}; a prediction may use earlier tokens "
                                f"of its own row only)")
    return probed, None


def hang_limit(timeout_s: float, batch_s: float) -> Callable[[int], float]:
    """The seconds one retried child of ``jobs`` jobs (one snapshot) may take before it counts as
    a hang of the submission's doing: ``timeout_s + HANG_FACTOR * batch_s * jobs``, the whole
    audit's own limit for one snapshot's build, load and forwards, plus a margin over the run's
    own seconds per batch (``batch_s``, forward, backward and step: more than one forward)."""
    return lambda jobs: timeout_s + HANG_FACTOR * batch_s * jobs


def _run_or_retry(jail: Any, config: dict[str, Any], jobs: list[Job], blind_jobs: list[Job], paths: list[Path],
                  deadline: float, timeout_s: float, artifacts_dir: str, batch_s: float | None = None,
                  expect: Sequence[str | None] | None = None, before_blind: Callable[[], None] | None = None
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """:func:`run_both` before ``deadline``; when it fails of the submission's doing
    (``AuditError.by_submission``), once more with one snapshot per child and a fresh
    ``timeout_s`` (:data:`REFUSED`): a second failure of any kind, a timeout too, then follows a
    failure the submission caused, on inputs the run itself scored without failing. When the
    first try timed out and the run's seconds per batch ``batch_s`` are known, once more too,
    one snapshot per child, each child under its own :func:`hang_limit` and the whole under
    twice the largest: a child past its own limit is a hang (:data:`REFUSED`); the whole past its
    deadline (an honest model too slow for the audit's limit) stays a plain timeout.

    Raises:
        AuditError: the first failure when it is not the submission's; ``refused: <first>; again:
            <second>`` when the second try failed too (after a timeout first: of the submission's doing).
    """
    try:
        return run_both(jail, config, jobs, blind_jobs, paths, deadline=deadline, writable=[artifacts_dir],
                        expect=expect, before_blind=before_blind)
    except AuditError as first:
        timed_out = str(first).startswith("timeout:") and batch_s is not None and batch_s >= 0
        if not (first.by_submission or timed_out):
            raise
        limit = hang_limit(timeout_s, batch_s or 0.0) if timed_out else None
        most = max(sum(1 for j in [*jobs, *blind_jobs] if j.state == i) for i in range(len(paths)))
        retry_s = 2 * limit(most) if limit is not None else timeout_s
        try:
            return run_both(jail, config, jobs, blind_jobs, paths, deadline=time.monotonic() + retry_s,
                            writable=[artifacts_dir], per_child=1, child_limit=limit,
                            expect=expect, before_blind=before_blind)
        except AuditError as second:
            if timed_out and not first.by_submission and not second.by_submission:
                raise first from None  # the whole audit is too slow here, and no child hung: no proof
            raise AuditError(f"{REFUSED}{first}; again, one snapshot per fresh process: {second}") from None


def run_audit(config: dict[str, Any], audits: dict[int, Any], *, jail: Any, world_size: int, filler: np.ndarray | None,
              key: bytes, timeout_s: float, artifacts_dir: str, meta: dict[str, Any] | None = None,
              batch_s: float | None = None) -> AuditReport:
    """Re-score every audited batch and probe it blind; never raises for the submission's failures.

    Args:
        config: the model configuration (``pipeline.start.model_config``) plus ``context`` (the run's
            :class:`~prism_challenge.evaluator.interface.PrismContext` values but the rank),
            ``hidden`` and, optionally, ``flop_shapes`` (shape keys whose forward FLOPs the first
            re-scoring child counts: ``report.flops``, :mod:`~prism_challenge.score.flops`).
        audits: the feeder's :class:`~prism_challenge.evaluator.snapshots.AuditedStep` by step.
        filler: held-out token ids for the blind probes (``None``: no probe; say why in ``meta``).
        key: the run's secret key (the probed positions and the text's offsets).
        artifacts_dir: an empty folder at the run's ``ctx.artifacts_dir`` path (writable).
        batch_s: the run's own seconds per batch (``None``: unknown; a first timeout is then
            not tried again, :func:`_run_or_retry`).

    Returns:
        The report: ``mismatch`` or ``error`` set means the run is zeroed.
    """
    from prism_challenge.evaluator.instrument import autocast_dtype

    t0 = time.monotonic()
    report = AuditReport(meta=dict(meta or {}))
    jobs, blind_jobs, paths, problems = plan(audits, world_size, filler, key)
    if problems:
        report.error = problems[0]
    if not jobs:
        report.error = report.error or "no audited batch has a snapshot"
        report.wall_s = time.monotonic() - t0
        return report
    device = str(config.get("device", "cpu"))
    deadline = t0 + timeout_s
    emptied: list[str | None] = []  # one per blind probe child fed: None, or why the cache was not emptied
    try:
        digests = {Path(a.snapshot): a.sha256 for a in audits.values() if a.snapshot is not None}
        rescored, blind = _run_or_retry(jail, config, jobs, blind_jobs, paths, deadline, timeout_s, artifacts_dir,
                                        batch_s, [digests.get(p) for p in paths],
                                        before_blind=lambda: emptied.append(empty_page_cache()))
        report.flops = next((r["flops"] for r in rescored if isinstance(r, dict) and "flops" in r), None)
        compare_rescore(jobs, audits, rescored, device, world_size, report)
        if blind is not None and report.mismatch is None:
            report.blind_probes, report.mismatch = compare_blind(
                jobs, rescored, blind_jobs, blind, int(config["vocab_size"]),
                autocast_dtype(config.get("scoring_autocast")))
    except AuditError as exc:  # a refusal is named even beside a missing snapshot: it is the finding
        report.error = str(exc) if str(exc).startswith(REFUSED) else report.error or str(exc)
    except OSError as exc:  # the jail could not start a child, or a snapshot file is unreadable
        report.error = report.error or f"audit: {exc}"
    report.page_cache = cache_note(emptied)
    report.wall_s = time.monotonic() - t0
    return report
