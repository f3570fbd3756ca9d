"""Findings and suspension (issue 25, item 5): a caught cheat has a cost.

**What counts.** A run counts as caught only when its manifest is ``scored``, its verdict was
zeroed for one of the flags of :data:`PROVEN_CHEATS`, and the manifest field that flag stands for
says why in the words of a proof (:func:`finding_of`; the first row that matches names the kind):

- ``audit.mismatch`` set (flag ``audit``): an audited batch whose re-scoring, from the weights
  that scored it in a fresh process, did not reproduce its record (``rescore``), or a blind probe
  of an audited batch that gave the true token other nats once its row went on with other text
  (``blind_probe``). :mod:`prism_challenge.audit.rescore` sets ``mismatch`` only for these two.
- ``audit.error`` starting ``refused: `` (flag ``audit``, kind ``audit_refused``): the audit's
  children failed of the submission's own doing (its exception or crash while re-scoring, an
  audit-hook refusal), twice, the second time in fresh processes of one snapshot each, on the
  weights and batches the run itself scored without failing (:data:`prism_challenge.audit.rescore.REFUSED`:
  a cheat that raises only where it is re-scored would otherwise trade its finding for a zero).
- ``verdict.heldout_error`` naming a causality failure (flag ``heldout_contract``): the trained
  model's predictions on held-out text moved when only later tokens changed (the in-process
  probe, ``heldout_causality``) or differed in the held-out blind probe
  (``heldout_blind_probe``).

**What never counts.** Every failed run (an ``infrastructure`` failure above all, and also a
``submission`` failure: it earned nothing, and its message comes from the bundle's own process);
an audit that could not run for any other reason (``audit.error`` without ``refused:``: a
timeout, the jail failing to start a child, a protocol problem, a snapshot that never arrived, a
failure of the submission's doing that a second try did not repeat): it zeroes the run but
proves no cheat; every other held-out error (a timeout, bad logits, an audit-hook refusal); the
``anomaly`` and ``memorization`` flags (statistical tests, not proofs).

**Suspension.** A hotkey with a finding that is not lifted is suspended while
``created_at + suspension_s > now`` (the settings' ``suspension_s``; ``None``: until an operator
lifts it). The period is applied when read, so a changed setting applies to standing findings
too. A suspended hotkey is left out of the leaderboard and the weights, and its submissions are
refused (403 ``suspended``). Its runs submitted before the finding stay out after a timed
suspension ends (:class:`Standing`: one may be the draw that escaped the audit); a lift
restores them.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update

from prism_challenge.audit.rescore import REFUSED
from prism_challenge.service.models import Finding, Submitter, storable

log = logging.getLogger("prism_challenge.service")


@dataclass(frozen=True)
class Caught:
    """One way a manifest proves a cheat: the verdict's ``flag``, the manifest ``field`` (dotted)
    that says why, and the ``prefix`` its text starts with (``""``: any text)."""

    kind: str
    flag: str
    field: str
    prefix: str


PROVEN_CHEATS: tuple[Caught, ...] = (
    Caught("blind_probe", "audit", "audit.mismatch", "blind probe of audited batch "),
    Caught("rescore", "audit", "audit.mismatch", ""),
    Caught("audit_refused", "audit", "audit.error", REFUSED),
    Caught("heldout_causality", "heldout_contract", "verdict.heldout_error", "contract: the model is not causal"),
    Caught("heldout_blind_probe", "heldout_contract", "verdict.heldout_error",
           "contract: the trained model is not causal"),
)
"""The flags and fields that make a finding, first match first (see the module's docstring):
``audit.mismatch`` is set by :func:`prism_challenge.audit.rescore.compare_rescore` and
:func:`~prism_challenge.audit.rescore.compare_blind` only; ``audit.error`` is a finding only with the
prefix :data:`prism_challenge.audit.rescore.REFUSED` (the submission's own failure, twice);
``verdict.heldout_error`` is a ``contract:`` error of :mod:`prism_challenge.audit.heldout` (flag
``heldout_contract``), of which only the two causality probes' count."""
KINDS = tuple(c.kind for c in PROVEN_CHEATS)

_NUM = r"(-?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan))"
_RESCORE = re.compile(r"audited batch (\d+)(?: \(rank (\d+)\))?: recorded (\S+) nats, re-scored (\S+) nats")
_BLIND = re.compile(r"blind probe of audited batch (\d+), row (\d+)(?: of rank (\d+))?: token \d+ cost " + _NUM
                    + r" nats when .*? and " + _NUM + " nats when")
_HELDOUT_BLIND = re.compile(r"held-out row (\d+) of batch (\d+) cost " + _NUM + r" nats when .*? and " + _NUM
                            + " nats in")


@dataclass(frozen=True)
class Facts:
    """What :func:`finding_of` read from a manifest (the columns of
    :class:`~prism_challenge.service.models.Finding` that come from it)."""

    kind: str
    step: int | None
    rank: int | None
    row: int | None
    recorded_nats: float | None
    rescored_nats: float | None
    message: str


def _field(manifest: dict[str, Any], dotted: str) -> Any:
    value: Any = manifest
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def finding_of(manifest: dict[str, Any]) -> Facts | None:
    """The finding a run manifest (its JSON object) proves, or ``None`` (the rule:
    :data:`PROVEN_CHEATS` and the module's docstring). Never raises for a malformed manifest:
    what cannot be read is no proof."""
    if not isinstance(manifest, dict) or manifest.get("status") != "scored":
        return None
    flags = _field(manifest, "verdict.flags") or []
    for c in PROVEN_CHEATS:
        text = _field(manifest, c.field)
        if c.flag in flags and isinstance(text, str) and text and text.startswith(c.prefix):
            return _facts(c.kind, text, manifest)
    return None


def _float(text: str | None) -> float | None:
    """``text`` as a finite float, else ``None`` (``None``, ``nan``, ``inf``: the manifest's
    non-finite figures)."""
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _number(value: Any) -> float | None:
    """A manifest's figure as a finite float, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


def _facts(kind: str, message: str, manifest: dict[str, Any]) -> Facts:
    """The step, place and figures of ``message`` (the manifest's own words, see
    :mod:`prism_challenge.audit.rescore` and :mod:`prism_challenge.audit.blindprobe`); a ``rescore``'s
    figures are the audited batch's exact ``recorded_nats`` and ``rescored_nats`` when the
    manifest lists the batch. Parts the text does not give stay ``None``."""
    step = rank = row = None
    recorded = rescored = None
    if kind == "rescore":
        if m := _RESCORE.search(message):
            step, rank, recorded, rescored = int(m[1]), _int(m[2]) or 0, _float(m[3]), _float(m[4])
        batches = [b for b in _field(manifest, "audit.batches") or [] if isinstance(b, dict)]
        batch = next((b for b in batches if (b.get("step") == step if step is not None else b.get("match") is False)),
                     None)
        if batch is not None:
            step, r = batch.get("step"), rank or 0
            pair = [batch.get("recorded_nats"), batch.get("rescored_nats")]
            if all(isinstance(v, list) and len(v) > r for v in pair):
                rank, recorded, rescored = r, _number(pair[0][r]), _number(pair[1][r])
    elif kind == "blind_probe" and (m := _BLIND.search(message)):
        step, row, rank, recorded, rescored = int(m[1]), int(m[2]), _int(m[3]) or 0, _float(m[4]), _float(m[5])
    elif kind == "heldout_blind_probe" and (m := _HELDOUT_BLIND.search(message)):
        row, step, recorded, rescored = int(m[1]), int(m[2]), _float(m[3]), _float(m[4])
    return Facts(kind, step, rank, row, recorded, rescored, storable(message) or "")


def record_finding(s: Any, sub: Any, attempt: Any, run: Any, manifest: dict[str, Any], now: datetime) -> None:
    """Record the finding ``manifest`` proves (:func:`finding_of`), if any, against submission
    ``sub``'s hotkey, for its ``attempt`` and ``run`` (rows of session ``s``), in the caller's
    transaction: the one that stores the run (:meth:`prism_challenge.service.store.Store.record`),
    so a run and its finding are written together, once (``findings.run_id`` is unique)."""
    facts = finding_of(manifest)
    if facts is None:
        return
    s.flush()  # the run's id
    hotkey = s.scalar(select(Submitter.hotkey).where(Submitter.id == sub.submitter_id))
    s.add(Finding(hotkey=hotkey, submission_id=sub.id, attempt_id=attempt.id, run_id=run.id, kind=facts.kind,
                  step=facts.step, rank=facts.rank, row=facts.row, recorded_nats=facts.recorded_nats,
                  rescored_nats=facts.rescored_nats, message=facts.message, created_at=now))
    log.warning("submission %d (hotkey %s): finding %s at batch %s", sub.id, hotkey, facts.kind, facts.step)


# -- suspension ------------------------------------------------------------------------------
def is_active(f: Finding, now: datetime, period_s: float | None) -> bool:
    """Whether finding ``f`` suspends its hotkey at ``now``: not lifted, and ``period_s`` is
    ``None`` or ``now < created_at + period_s``."""
    return f.lifted_at is None and (period_s is None or now < f.created_at + timedelta(seconds=period_s))


@dataclass(frozen=True)
class Suspension:
    """A hotkey's suspension: its ``findings`` that suspend it (newest first; empty: not
    suspended) and ``until`` (the latest end, UTC; ``None``: until an operator lifts it)."""

    hotkey: str
    findings: tuple[Finding, ...]
    until: datetime | None

    @property
    def suspended(self) -> bool:
        """Whether any finding suspends the hotkey."""
        return bool(self.findings)


def findings(store: Any, hotkey: str | None = None) -> list[Finding]:
    """Every finding (of ``hotkey`` when given), newest first (detached rows)."""
    with store.sessions() as s:
        q = select(Finding).order_by(Finding.id.desc())
        if hotkey is not None:
            q = q.where(Finding.hotkey == hotkey)
        return list(s.scalars(q))


def finding_of_submission(store: Any, submission_id: int) -> Finding | None:
    """The finding against submission ``submission_id``'s run, or ``None``."""
    with store.sessions() as s:
        return s.scalar(select(Finding).where(Finding.submission_id == submission_id))


def suspension(store: Any, hotkey: str, now: datetime, period_s: float | None) -> Suspension:
    """The suspension of ``hotkey`` at ``now`` (UTC) under ``period_s`` (seconds; ``None``: no end)."""
    with store.sessions() as s:
        rows = list(s.scalars(select(Finding).where(Finding.hotkey == hotkey, Finding.lifted_at.is_(None))
                              .order_by(Finding.id.desc())))
    active = tuple(f for f in rows if is_active(f, now, period_s))
    until = None
    if active and period_s is not None:
        until = max(f.created_at for f in active) + timedelta(seconds=period_s)
    return Suspension(hotkey, active, until)


def suspended_hotkeys(store: Any, now: datetime, period_s: float | None) -> frozenset[str]:
    """The hotkeys suspended at ``now`` (see :func:`suspension`)."""
    return standing(store, now, period_s).suspended


@dataclass(frozen=True)
class Standing:
    """Which runs the leaderboard and the weights may count: ``suspended``, the hotkeys suspended
    now; ``cutoff``, per hotkey with a finding not lifted, the latest such finding's time (UTC).
    A run submitted at or before its hotkey's cutoff never counts again, even once a timed
    suspension has ended: it was made by the hotkey before it was caught, and may be the draw
    that escaped the audit (a lottery's winning ticket). A lift restores them all."""

    suspended: frozenset[str]
    cutoff: dict[str, datetime]

    def counts(self, hotkey: str, submitted_at: datetime) -> bool:
        """Whether a run of ``hotkey`` submitted at ``submitted_at`` (UTC) counts."""
        cut = self.cutoff.get(hotkey)
        return hotkey not in self.suspended and (cut is None or submitted_at > cut)


def standing(store: Any, now: datetime, period_s: float | None) -> Standing:
    """The :class:`Standing` at ``now`` under ``period_s`` (seconds; ``None``: no end)."""
    with store.sessions() as s:
        rows = list(s.scalars(select(Finding).where(Finding.lifted_at.is_(None))))
    cutoff: dict[str, datetime] = {}
    for f in rows:
        cutoff[f.hotkey] = max(cutoff.get(f.hotkey, f.created_at), f.created_at)
    return Standing(frozenset(f.hotkey for f in rows if is_active(f, now, period_s)), cutoff)


def lift(store: Any, hotkey: str, *, by: str, reason: str | None, now: datetime) -> int:
    """Lift every finding of ``hotkey`` not lifted yet (the rows are kept, marked with ``now``,
    ``by`` and ``reason``); returns how many."""
    with store.sessions.begin() as s:
        return s.execute(update(Finding).where(Finding.hotkey == hotkey, Finding.lifted_at.is_(None))
                         .values(lifted_at=now, lifted_by=storable(by, 128), lift_reason=storable(reason))
                         .execution_options(synchronize_session=False)).rowcount


def finding_view(f: Finding, now: datetime | None = None, period_s: float | None = None) -> dict[str, Any]:
    """A finding as JSON (the API's, the pages' and ``prism findings list --json``'s);
    ``active`` when ``now`` is given (see :func:`is_active`)."""
    view = {"id": f.id, "hotkey": f.hotkey, "submission_id": f.submission_id, "attempt_id": f.attempt_id,
            "run_id": f.run_id, "kind": f.kind, "step": f.step, "rank": f.rank, "row": f.row,
            "recorded_nats": f.recorded_nats, "rescored_nats": f.rescored_nats, "message": f.message,
            "created_at": f.created_at.isoformat(),
            "lifted_at": f.lifted_at.isoformat() if f.lifted_at else None, "lifted_by": f.lifted_by,
            "lift_reason": f.lift_reason}
    if now is not None:
        view["active"] = is_active(f, now, period_s)
    return view


def describe(f: Finding) -> str:
    """One line on a finding: its kind, submission, run, batch and figures."""
    where = f"batch {f.step}" if f.step is not None else "no batch named"
    if f.rank:
        where += f" rank {f.rank}"
    if f.row is not None:
        where += f" row {f.row}"
    figures = ""
    if f.recorded_nats is not None or f.rescored_nats is not None:
        figures = f": recorded {f.recorded_nats!r} nats, re-scored {f.rescored_nats!r} nats"
    return f"finding {f.id} ({f.kind}) on submission {f.submission_id}, run {f.run_id}, {where}{figures}"


__all__ = ["Caught", "Facts", "KINDS", "PROVEN_CHEATS", "Standing", "Suspension", "describe", "finding_of", "finding_of_submission",
           "finding_view", "findings", "is_active", "lift", "record_finding", "standing", "suspended_hotkeys", "suspension"]
