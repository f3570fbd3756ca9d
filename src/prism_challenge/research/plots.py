"""Learning-curve plots of scored runs: bits per byte against bytes scored (matplotlib, Agg).

Reusable by a service page: :func:`run_curve` turns a run manifest into a :class:`RunCurve`,
:func:`learning_curve_figure` draws any number of them on one :class:`~matplotlib.figure.Figure`
and :func:`figure_bytes` renders it as PNG or SVG bytes. Figures are built with
``matplotlib.figure.Figure`` and rendered by the Agg canvas, never through ``pyplot``: no global
backend is chosen and nothing is shown.

For each run two lines share one colour: the per-batch bpb (thin) and the cumulative
prequential bpb (thick), whose last point is the run's ``prequential_bpb``. Runs of one variant
(seed repeats, ``colour_by``) share a colour, and two or more of them get a band: their mean
cumulative bpb with ±1 sample std (:func:`group_band`). :func:`compute_figure` draws each run's
``prequential_bpb`` against its estimated training FLOPs (:func:`compute_point`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

LN2 = math.log(2.0)
FORMATS = ("png", "svg")


class PlotError(ValueError):
    """A curve that cannot be drawn, or an output format other than PNG or SVG."""


@dataclass(frozen=True)
class RunCurve:
    """One run's learning curve.

    Attributes:
        label: the legend's name of the run.
        cumulative_bytes: bytes scored up to and including each batch (x axis).
        batch_bpb: bits per byte of each batch alone (``nan`` for a batch of zero bytes).
        cumulative_bpb: prequential bpb of the stream up to each batch:
            ``sum(nats[:i+1]) / ln 2 / cumulative_bytes[i]``.
    """

    label: str
    cumulative_bytes: list[int]
    batch_bpb: list[float]
    cumulative_bpb: list[float]


def run_curve(manifest: Mapping[str, Any], label: str) -> RunCurve:
    """The curve of a run manifest (its ``curve``: nats per target, cumulative targets and bytes).

    A batch's nats are ``nats_per_target * targets`` (targets: the difference of the cumulative
    counts), its bpb ``nats / ln 2 / bytes``.

    Raises:
        PlotError: the manifest has no curve, or its lists differ in length.
    """
    c = manifest.get("curve") or {}
    per, cum_t, cum_b = c.get("nats_per_target") or [], c.get("cumulative_targets") or [], c.get("cumulative_bytes") or []
    if not per or not len(per) == len(cum_t) == len(cum_b):
        raise PlotError(f"{label}: the manifest has no learning curve (no batch was scored)")
    batch, cumulative = [], []
    nats_total, pt, pb = 0.0, 0, 0
    for npt, t, b in zip(per, cum_t, cum_b):
        nats = float(npt) * (t - pt)
        nats_total += nats
        batch.append(nats / LN2 / (b - pb) if b > pb else math.nan)
        cumulative.append(nats_total / LN2 / b if b else math.nan)
        pt, pb = t, b
    return RunCurve(label, [int(b) for b in cum_b], batch, cumulative)


def _canvas(colour_by: Sequence[str] | None, n: int, what: str, legend_rows: int) -> tuple[Figure, Any, list[str], list[str]]:
    """A 9-inch-wide figure (taller by a legend of ``legend_rows`` rows) with one axes, the colour
    key of each of ``n`` items (default: one each) and the keys in first-seen order.

    Raises:
        PlotError: ``colour_by`` of another length than ``n``.
    """
    keys = list(colour_by) if colour_by is not None else [str(i) for i in range(n)]
    if len(keys) != n:
        raise PlotError(f"colour_by has {len(keys)} keys for {n} {what}")
    fig = Figure(figsize=(9, 5.6 + 0.22 * legend_rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(), keys, list(dict.fromkeys(keys))


def learning_curve_figure(curves: Sequence[RunCurve], title: str = "PRISM learning curves",
                          colour_by: Sequence[str] | None = None) -> Figure:
    """Bits per byte against bytes scored for every run: per-batch (thin) and cumulative (thick).

    Args:
        curves: the runs.
        title: the axes' title.
        colour_by: one key per curve; curves with one key share a colour (e.g. the seed repeats
            of one variant), each seed with its own dash pattern. Default: a colour per curve.

    Raises:
        PlotError: no curves, or ``colour_by`` of another length.
    """
    if not curves:
        raise PlotError("no run to plot")
    fig, ax, keys, order = _canvas(colour_by, len(curves), "curves", legend_rows=(len(curves) + 3) // 2)
    colours, seen = [], {}
    styles = ("-", "--", ":", "-.")
    for k in keys:
        seen[k] = seen.get(k, -1) + 1
        colours.append((f"C{order.index(k) % 10}", styles[seen[k] % len(styles)]))
    for curve, (colour, style) in zip(curves, colours):
        ax.plot(curve.cumulative_bytes, curve.batch_bpb, color=colour, linewidth=0.8, alpha=0.35)
        ax.plot(curve.cumulative_bytes, curve.cumulative_bpb, color=colour, linewidth=2.2, linestyle=style,
                marker="o" if len(curve.cumulative_bytes) == 1 else None,  # one batch: a point, not nothing
                label=f"{curve.label}  ({curve.cumulative_bpb[-1]:.4f})")
    banded = False
    for k in order:
        members = [c for c, key in zip(curves, keys) if key == k]
        if len(members) >= 2:
            x, mean, std = group_band(members)
            colour = f"C{order.index(k) % 10}"
            ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.15, linewidth=0)
            ax.plot(x, mean, color=colour, linewidth=1.2, alpha=0.9)
            banded = True
    ax.set_xscale("log")
    ax.set_xlabel("bytes scored (UTF-8, log scale)")
    ax.set_ylabel("bits per byte (lower is better)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.plot([], [], color="0.4", linewidth=2.2, label="thick: cumulative prequential bpb")
    ax.plot([], [], color="0.4", linewidth=0.8, alpha=0.5, label="thin: per-batch bpb")
    if banded:
        ax.fill_between([], [], [], color="0.4", alpha=0.2, label="band: seed repeats' mean ± 1 std (cumulative)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize="small")
    return fig


def group_band(curves: Sequence[RunCurve]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, mean, std)`` of the cumulative bpb of ``n >= 2`` runs of one variant (seed repeats),
    each ``[P]``: ``x`` the first run's byte counts up to the shortest run's end; every run's
    curve linearly interpolated in ``log x`` onto it; ``std`` the sample std (``ddof=1``).

    Raises:
        PlotError: fewer than two curves.
    """
    if len(curves) < 2:
        raise PlotError("a band needs two runs or more")
    end = min(c.cumulative_bytes[-1] for c in curves)
    x = np.array([b for b in curves[0].cumulative_bytes if 0 < b <= end], dtype=np.float64)
    ys = np.stack([np.interp(np.log(x), np.log(np.asarray(c.cumulative_bytes, dtype=np.float64)),
                             np.asarray(c.cumulative_bpb, dtype=np.float64)) for c in curves])
    return x, ys.mean(axis=0), ys.std(axis=0, ddof=1)


@dataclass(frozen=True)
class ComputePoint:
    """One run's score against its compute: ``training_flops`` (the manifest's
    ``compute.training_flops_estimate``, :mod:`~prism_challenge.score.flops`) and ``prequential_bpb``."""

    label: str
    training_flops: int
    prequential_bpb: float


def compute_point(manifest: Mapping[str, Any], label: str) -> ComputePoint | None:
    """The :class:`ComputePoint` of a scored run manifest, ``None`` without a FLOP estimate above 0
    (a run before issue 29, one whose count failed: ``compute.flops_error``, or a model without
    matmuls, which the log scale cannot place) or without a score."""
    flops = (manifest.get("compute") or {}).get("training_flops_estimate")
    bpb = (manifest.get("score") or {}).get("prequential_bpb")
    if not isinstance(flops, int) or flops <= 0 or not isinstance(bpb, (int, float)):
        return None
    return ComputePoint(label, flops, float(bpb))


def compute_figure(points: Sequence[ComputePoint], title: str = "PRISM: bits per byte against training compute",
                   colour_by: Sequence[str] | None = None) -> Figure:
    """Prequential bpb against estimated training FLOPs (log x), one marker per run; runs with
    one ``colour_by`` key (e.g. a variant's seed repeats) share a colour.

    Raises:
        PlotError: no points, or ``colour_by`` of another length.
    """
    if not points:
        raise PlotError("no run with a training FLOP estimate to plot")
    fig, ax, keys, order = _canvas(colour_by, len(points), "points", legend_rows=(len(points) + 1) // 2)
    for pt, k in zip(points, keys):
        ax.scatter([pt.training_flops], [pt.prequential_bpb], color=f"C{order.index(k) % 10}", s=36,
                   label=f"{pt.label}  ({pt.prequential_bpb:.4f})")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs, estimated (3 x the scoring forward's; log scale)")
    ax.set_ylabel("prequential bits per byte (lower is better)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize="small")
    return fig


def figure_bytes(fig: Figure, fmt: str) -> bytes:
    """``fig`` rendered as ``png`` or ``svg`` bytes.

    Raises:
        PlotError: another format.
    """
    if fmt not in FORMATS:
        raise PlotError(f"plot format {fmt!r}: must be one of {', '.join(FORMATS)}")
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    return buf.getvalue()


def save_figure(fig: Figure, path: str | Path, flag: str = "--plot") -> Path:
    """Write ``fig`` to ``path``, PNG or SVG by its suffix (``flag``: the option named in the error).

    Raises:
        PlotError: a suffix other than ``.png`` or ``.svg``.
    """
    p = Path(path)
    fmt = p.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise PlotError(f"{flag} {p}: the file name must end in .png or .svg")
    p.write_bytes(figure_bytes(fig, fmt))
    return p
