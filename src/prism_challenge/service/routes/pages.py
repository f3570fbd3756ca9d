"""The service's web pages, rendered on the server (Jinja2, autoescaped; no JavaScript): the
leaderboard (``/``), a submission with its learning-curve plot (``/submissions/{id}``, the PNG
at ``/submissions/{id}/curve.png`` drawn by :mod:`prism_challenge.research.plots`, the comparison
plots), a hotkey's findings and suspension (``/hotkeys/{hotkey}``) and "how to submit"
(``/how-to-submit``). They show the JSON routes' data
(:func:`~prism_challenge.service.routes.read.board`,
:func:`~prism_challenge.service.routes.read.submission_view`,
:func:`~prism_challenge.service.routes.read.hotkey_view`)."""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict
from importlib import resources

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates

from prism_challenge.service.client import scored_bpbs
from prism_challenge.service.errors import ApiError
from prism_challenge.service.queries import latest_run, scored_runs
from prism_challenge.service.routes.read import SubmissionId, board, hotkey_view, submission_view

router = APIRouter(tags=["pages"], include_in_schema=False)
templates = Jinja2Templates(directory=str(resources.files("prism_challenge") / "templates" / "service"))
_PLOT_LOCK = threading.Lock()  # matplotlib promises no thread safety: one figure at a time
PLOTS_KEPT = 64
"""Rendered PNGs kept in memory per app (``app.state.plots``), by run id (a run is written once,
so its plot never changes)."""


def _page(request: Request, name: str, **context) -> HTMLResponse:
    state = request.app.state
    return templates.TemplateResponse(request, name, {"profile": state.profile, **context})


@router.get("/", response_class=HTMLResponse)
def leaderboard_page(request: Request) -> HTMLResponse:
    """The leaderboard."""
    return _page(request, "leaderboard.html", entries=board(request), significance_p=request.app.state.significance_p)


def error_page(request: Request, exc: ApiError) -> HTMLResponse:
    """``exc`` as a page (its status, code and message) for a browser, not the JSON body."""
    return templates.TemplateResponse(request, "error.html", {"profile": request.app.state.profile,
                                      "status": exc.status, "error": exc.body()["error"]}, status_code=exc.status)


@router.get("/submissions/{sid}", response_class=HTMLResponse)
def submission_page(request: Request, sid: int = SubmissionId) -> HTMLResponse:
    """A submission: status, failure, scores, its learning curve and attempts (an unknown id:
    a 404 page). A submission of several runs (confirmation, ``runs_wanted`` > 1) also lists
    each run with its seed, and the mean and sample std of their bpb (the leaderboard's figures);
    the scores table is then the last scored run's."""
    try:
        view = submission_view(request, sid)
    except ApiError as exc:
        return error_page(request, exc)
    run = latest_run(request.app.state.store, sid)
    has_curve = bool(run is not None and (run.manifest.get("curve") or {}).get("nats_per_target"))
    bpbs = scored_bpbs(view)
    over_runs = ({"n": len(bpbs), "mean": statistics.fmean(bpbs), "std": statistics.stdev(bpbs)}
                 if len(bpbs) > 1 else None)
    return _page(request, "submission.html", s=view, has_curve=has_curve, hk=hotkey_view(request, view["hotkey"]),
                 over_runs=over_runs)


@router.get("/hotkeys/{hotkey}", response_class=HTMLResponse)
def hotkey_page(request: Request, hotkey: str = Path(..., min_length=1, max_length=64)) -> HTMLResponse:
    """A hotkey: whether it is suspended and why (each finding's run, batch and figures)."""
    return _page(request, "hotkey.html", hk=hotkey_view(request, hotkey))


@router.get("/submissions/{sid}/curve.png")
def curve_png(request: Request, sid: int = SubmissionId) -> Response:
    """The learning curves as PNG: every scored run of the submission (its first run and its
    confirmation runs, each named by its run and revealed seed), per-batch (thin) and cumulative
    (thick) bpb against bytes, and with two runs or more their mean with a band of ±1 sample std
    (:func:`~prism_challenge.research.plots.group_band`)."""
    from prism_challenge.research.plots import PlotError, figure_bytes, learning_curve_figure, run_curve

    submission_view(request, sid)  # 404 for an unknown id
    runs = scored_runs(request.app.state.store, sid) or [r for r in [latest_run(request.app.state.store, sid)] if r]
    try:
        if not runs:
            raise PlotError("no run")
        key = tuple(r.id for r in runs)
        with _PLOT_LOCK:
            _plots: OrderedDict[tuple[int, ...], bytes] = request.app.state.plots
            png = _plots.get(key)
            if png is None:
                curves = [run_curve(r.manifest, f"run {r.run_index + 1} · seed {r.seed if r.seed is not None else '?'}")
                          for r in runs]
                png = figure_bytes(learning_curve_figure(curves, title=f"submission #{sid}",
                                                         colour_by=["runs"] * len(curves)), "png")
                _plots[key] = png
                while len(_plots) > PLOTS_KEPT:
                    _plots.popitem(last=False)
            _plots.move_to_end(key)
    except PlotError:
        raise ApiError(404, "no-curve", f"submission {sid}: no scored batch to plot", rule="prism:no-run") from None
    return Response(png, media_type="image/png", headers={"Cache-Control": "max-age=60"})


@router.get("/how-to-submit", response_class=HTMLResponse)
def howto_page(request: Request) -> HTMLResponse:
    """How to make a key, check a bundle and submit it; the wire format."""
    s = request.app.state.settings
    window = f"{s.rate_window_s / 3600:g} h" if s.rate_window_s >= 3600 else f"{s.rate_window_s:g} s"
    return _page(request, "howto.html", base_url=str(request.base_url).rstrip("/"), max_body=s.max_body_bytes,
                 window=s.signature_window_s, rate_limit=s.rate_limit, rate_window=window, ss58_prefix=s.ss58_prefix)


__all__ = ["error_page", "router"]
