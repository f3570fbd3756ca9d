"""The reading routes: a submission, its curve and manifest, a hotkey (its findings and
suspension), the leaderboard, the weights (both without suspended hotkeys)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Path, Request

from prism_challenge.score.crown import welch_p
from prism_challenge.data.refcodes import CODECS, against_best
from prism_challenge.service import findings as fnd
from prism_challenge.service.errors import ApiError
from prism_challenge.service.queries import hotkey_of, latest_run, scored_entries
from prism_challenge.service.routes.auth import check_token
from prism_challenge.service.weights import leaderboard, weights

router = APIRouter(tags=["reading"])
MAX_CURVE_POINTS = 500
SubmissionId = Path(..., ge=1, le=2**62, description="the submission's id")


def _submission(request: Request, sid: int):
    row = request.app.state.store.submission(sid)
    if row is None:
        raise ApiError(404, "not-found", f"submission {sid}: no such submission", rule="prism:unknown-id")
    return row


def _iso(ts) -> str | None:
    return ts.isoformat() if ts is not None else None


def _rule_of(manifest: dict | None) -> str | None:
    """The first blocking gate finding's rule of a failed run (``None`` when none names one)."""
    findings = ((manifest or {}).get("gates") or {}).get("findings") or []
    return next((f["rule"] for f in findings if f.get("blocking")), None)


def _scores(manifest: dict | None) -> dict | None:
    v = (manifest or {}).get("verdict")
    if not v:
        return None
    held = v.get("heldout") or {}
    return {"prequential_bpb": v["prequential_bpb"], "final_score": v["final_score"], "tail_bpb": v["tail_bpb"],
            "heldout_delta": held.get("heldout_delta"), "val_bpb_trained": held.get("val_bpb_trained"),
            "anti_cheat_multiplier": v["anti_cheat_multiplier"], "memorization_penalty": v["memorization_penalty"],
            "flags": v["flags"], "reference_codes": _reference(v["prequential_bpb"], manifest.get("reference_codes"))}


def _reference(bpb: float, record: dict | None) -> dict | None:
    """The run's reference code lengths (:mod:`prism_challenge.data.refcodes`): ``bytes``, ``codes``
    (compressor: bpb on the same scored bytes), the ``best`` of them and ``bpb_minus_best``;
    ``None`` for a manifest without them."""
    if not record:
        return None
    best, diff = against_best(bpb, record)
    return {"bytes": record["bytes"], "codes": {n: record[n] for n in CODECS}, "best": best, "bpb_minus_best": diff}


def submission_view(request: Request, sid: int) -> dict:
    """The JSON of ``GET /v1/submissions/{id}`` (also the submission page's data)."""
    store = request.app.state.store
    row = _submission(request, sid)
    run = latest_run(store, sid)
    manifest = run.manifest if run is not None else None
    failure = None
    if row.error_stage is not None:
        failure = {"stage": row.error_stage, "kind": row.error_kind, "message": row.error_message,
                   "rule": _rule_of(manifest)}
    runs = store.runs_of(sid)
    ended = {r.run_index for r in runs}  # a seed is shown once its run ended, not its attempt
    return {
        "id": row.id, "hotkey": hotkey_of(store, row), "status": row.status, "profile": row.profile,
        "created_at": _iso(row.created_at), "updated_at": _iso(row.updated_at), "finished_at": _iso(row.finished_at),
        "attempts": row.attempts, "max_attempts": row.max_attempts, "bundle_sha256": row.bundle_sha256,
        "source_sha256": row.source_sha256, "family_sha256": row.family_sha256, "variant_of": row.variant_of,
        "failure": failure, "scores": _scores(manifest) if row.status == "completed" else None,
        "finding": _finding(request, sid), "runs_wanted": row.runs_wanted, "runs": run_views(runs),
        "history": [{"number": a.number, "run": a.run_index, "started_at": _iso(a.started_at),
                     "finished_at": _iso(a.finished_at), "outcome": a.outcome, "failure_stage": a.failure_stage,
                     "failure_kind": a.failure_kind, "seed": a.seed if a.run_index in ended else None}
                    for a in store.attempts(sid)],
    }


def run_views(runs) -> list[dict]:
    """A submission's ended runs (``Store.runs_of``), first first: ``{"run", "seed", "status",
    "prequential_bpb", "final_score", "created_at"}``. A run row exists only once its run has
    ended, so its secret seed is shown only then (a run still under way is in no list with its seed)."""
    return [{"run": r.run_index, "seed": r.seed, "status": r.status, "prequential_bpb": r.prequential_bpb,
             "final_score": r.final_score, "created_at": _iso(r.created_at)} for r in runs]


def _finding(request: Request, sid: int) -> dict | None:
    f = fnd.finding_of_submission(request.app.state.store, sid)
    state = request.app.state
    return None if f is None else fnd.finding_view(f, state.clock(), state.settings.suspension_s)


def counted_entries(request: Request, *, provisional: bool = False) -> tuple[list, frozenset[str]]:
    """The scored entries under the service's profile that the leaderboard and the weights count
    (:class:`prism_challenge.service.findings.Standing`), and the hotkeys suspended now;
    ``provisional``: with the entries whose confirmation runs are to come (the leaderboard's,
    never the weights')."""
    state = request.app.state
    st = fnd.standing(state.store, state.clock(), state.settings.suspension_s)
    entries = [e for e in scored_entries(state.store, state.profile.name, provisional=provisional)
               if st.counts(e.hotkey, e.submitted_at)]
    return entries, st.suspended


def hotkey_view(request: Request, hotkey: str) -> dict:
    """The JSON of ``GET /v1/hotkeys/{hotkey}`` (also the hotkey page's data): its suspension
    (``suspended``, ``until``: ISO UTC or ``None``, ``reason``) and every finding against it."""
    state = request.app.state
    now, period = state.clock(), state.settings.suspension_s
    s = fnd.suspension(state.store, hotkey, now, period)
    return {"hotkey": hotkey, "suspended": s.suspended, "until": _iso(s.until) if s.suspended else None,
            "suspension_s": period, "reason": fnd.describe(s.findings[0]) if s.suspended else None,
            "findings": [fnd.finding_view(f, now, period) for f in fnd.findings(state.store, hotkey)]}


@router.get("/v1/hotkeys/{hotkey}", summary="a hotkey: its findings and whether it is suspended")
def get_hotkey(request: Request, hotkey: str = Path(..., min_length=1, max_length=64)) -> dict:
    """Every finding against the hotkey (a run the audit caught) and its suspension (read-only;
    an unknown hotkey has none)."""
    return hotkey_view(request, hotkey)


@router.get("/v1/submissions/{sid}", summary="a submission: status, failure (stage, kind, rule), scores")
def get_submission(request: Request, sid: int = SubmissionId) -> dict:
    """The submission's state, its failure if any and its scores once completed (with the
    reference compressors' code lengths of the same scored bytes, ``scores.reference_codes``)."""
    return submission_view(request, sid)


def sample_indices(n: int, most: int = MAX_CURVE_POINTS) -> list[int]:
    """At most ``most`` indices of ``0..n-1``, evenly spread, the first and the last kept:
    ``round(i * (n - 1) / (most - 1))`` for ``i = 0..most-1`` (all of them when ``n <= most``)."""
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def curve_points(manifest: dict) -> tuple[list[dict], int]:
    """The run's learning curve as ``[{"batch", "bytes", "batch_bpb", "cumulative_bpb"}]``
    (at most :data:`MAX_CURVE_POINTS`, :func:`sample_indices`) and the number of batches.
    Per-batch and cumulative bpb as :func:`prism_challenge.research.plots.run_curve` defines them
    (``nan`` -> ``None``).

    Raises:
        prism_challenge.research.plots.PlotError: the manifest has no curve.
    """
    from prism_challenge.research.plots import run_curve

    curve = run_curve(manifest, "run")
    n = len(curve.cumulative_bytes)

    def num(x: float) -> float | None:
        return None if math.isnan(x) else x

    return [{"batch": i, "bytes": curve.cumulative_bytes[i], "batch_bpb": num(curve.batch_bpb[i]),
             "cumulative_bpb": num(curve.cumulative_bpb[i])} for i in sample_indices(n)], n


def _run_manifest(request: Request, sid: int) -> dict:
    _submission(request, sid)
    run = latest_run(request.app.state.store, sid)
    if run is None:
        raise ApiError(404, "no-run", f"submission {sid}: not evaluated yet (no run manifest)",
                       rule="prism:no-run")
    return run.manifest


@router.get("/v1/submissions/{sid}/curve", summary="the learning curve, at most 500 points (first and last kept)")
def get_curve(request: Request, sid: int = SubmissionId) -> dict:
    """Bits per byte against bytes scored, per batch and cumulative."""
    from prism_challenge.research.plots import PlotError

    try:
        points, batches = curve_points(_run_manifest(request, sid))
    except PlotError:
        raise ApiError(404, "no-curve", f"submission {sid}: its run scored no batch", rule="prism:no-run") from None
    return {"id": sid, "batches": batches, "points": points}


@router.get("/v1/submissions/{sid}/manifest", summary="the run manifest (prism_run_manifest.v2.json)")
def get_manifest(request: Request, sid: int = SubmissionId) -> dict:
    """The manifest of the submission's latest run (schema ``prism.run.v2``)."""
    return _run_manifest(request, sid)


def board(request: Request) -> list[dict]:
    """The leaderboard's entries (also the leaderboard page's)."""
    state = request.app.state
    counted, suspended = counted_entries(request, provisional=True)
    entries = leaderboard(counted, state.significance_p, excluded=suspended)
    return [{"rank": i + 1, "hotkey": e.hotkey, "submission_id": e.id, "prequential_bpb": e.prequential_bpb,
             "bpb_std": e.bpb_std, "runs": len(e.bpbs), "provisional": e.provisional,
             "p_vs_leader": _p_vs_leader(e, entries[0]) if i else None,
             "final_score": e.final_score, "heldout_delta": e.heldout_delta, "flags": list(e.flags),
             "variant_of": e.variant_of, "submitted_at": _iso(e.submitted_at)} for i, e in enumerate(entries)]


def _p_vs_leader(entry: Any, leader: Any) -> float | None:
    """The crown rule's one-sided Welch p that ``entry``'s mean bpb is lower than the leader's
    (:func:`~prism_challenge.score.crown.welch_p`), or ``None`` when either has fewer than 2 runs
    (the test is not defined)."""
    if len(entry.bpbs) < 2 or len(leader.bpbs) < 2:
        return None
    return welch_p(entry.bpbs, leader.bpbs)


@router.get("/v1/leaderboard", summary="one entry per hotkey (its best run), in verdict.rank order; suspended "
            "hotkeys left out")
def get_leaderboard(request: Request) -> dict:
    """The leaderboard under the service's profile."""
    return {"profile": request.app.state.profile.name, "entries": board(request)}


@router.get("/internal/v1/weights", summary="weights per hotkey, normalized (family-split or winner-takes-all)")
def get_weights(request: Request) -> dict:
    """Bearer token. The rule and its parameters are the service's settings; suspended hotkeys
    are paid nothing (:mod:`prism_challenge.service.findings`)."""
    state = request.app.state
    settings = state.settings
    check_token(request, settings.internal_token.get_secret_value() if settings.internal_token else None)
    store = state.store

    def owner_of(sid: int) -> str:
        return hotkey_of(store, store.submission(sid))

    counted, suspended = counted_entries(request)
    w = weights(counted, settings.weights_rule,
                family_share=settings.family_share, owner_of=owner_of, significance_p=state.significance_p,
                excluded=suspended)
    return {"profile": state.profile.name, "rule": settings.weights_rule, "family_share": settings.family_share,
            "weights": w}


__all__ = ["MAX_CURVE_POINTS", "board", "counted_entries", "curve_points", "hotkey_view", "router", "sample_indices",
           "submission_view"]
