"""``prism compare`` output: the console tables, the plot file and the one-file HTML report."""

from __future__ import annotations

import argparse
import base64
import html
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from prism_challenge.compare import (
    CompareError,
    Group,
    Run,
    find_runs,
    group_runs,
    load_runs,
    seed_repeats,
    variant,
    warnings,
)
from prism_challenge.flops import flops_text

HEADERS = ("#", "run", "score↑", "bpb↓", "Δ held-out", "train FLOPs", "flags", "seed", "tokenizer", "bytes", "stop")
CONSOLE_HIDDEN = ("tokenizer", "bytes")  # in the group's key line, and in the HTML report
LEGEND = ("score↑: final_score, higher is better (the score); bpb↓: prequential_bpb, lower is better "
          "(ranked on it first); Δ held-out: heldout_delta (bpb); train FLOPs: compute.training_flops_estimate "
          "(3 x the scoring forward's FLOPs, counted by the audit; information, not ranked)")


def key_text(group: Group) -> str:
    """The group's comparability key, one ``field: value`` after another (shas shortened)."""
    def short(v: Any) -> str:
        return v[:12] if isinstance(v, str) and len(v) == 64 else str(v)

    return "; ".join(f"{k}: {short(v)}" for k, v in group.key.items())


def rows(group: Group) -> list[tuple[str, ...]]:
    """The table rows of a ranked group (strings, in :data:`HEADERS` order)."""
    out = []
    for i, r in enumerate(group.runs, 1):
        m, v = r.manifest, r.manifest.get("verdict") or {}
        delta = (v.get("heldout") or {}).get("heldout_delta")
        fs = v.get("final_score")
        out.append((str(i), r.label, "-" if fs is None else f"{fs:.6f}", f"{m['score']['prequential_bpb']:.6f}",
                    "-" if delta is None else f"{delta:.4f}",
                    flops_text((m.get("compute") or {}).get("training_flops_estimate")),
                    ", ".join(v.get("flags", [])) or "-",
                    str(m.get("seed")), (m.get("tokenizer") or {}).get("name", "?"), f"{m['score']['bytes']:,}",
                    (m.get("stream") or {}).get("stop_reason", "?")))
    return out


def _pm(f: dict[str, Any], spec: str) -> str:
    return format(f["mean"], spec) + ("" if f["std"] is None else " ± " + format(f["std"], spec))


def repeat_rows(group: Group) -> list[tuple[str, ...]]:
    """Seed-repeat rows: bundle, n, mean ± std of final_score and prequential_bpb, seeds."""
    return [(r["bundle"], str(r["n"]), _pm(r["final_score"], ".6f"), _pm(r["prequential_bpb"], ".6f"),
             ", ".join(map(str, r["seeds"]))) for r in seed_repeats(group)]


REPEAT_HEADERS = ("bundle", "n", "final_score mean ± std", "prequential_bpb mean ± std", "seeds")


def print_report(console, groups: Sequence[Group], failed: Sequence[Run]) -> None:
    """The console report: warnings, then per group its key, ranked table and seed repeats."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    for w in warnings(groups):
        console.print(f"[bold yellow]WARNING[/] {escape(w)}", highlight=False, soft_wrap=True)
    console.print(LEGEND, highlight=False, soft_wrap=True)
    for n, g in enumerate(groups, 1):
        t = Table(title=f"group {n}, ranked as the challenge ranks (prism_challenge.verdict.rank)",
                  caption=escape(key_text(g)), caption_justify="left", box=box.SIMPLE_HEAD)
        shown = [i for i, h in enumerate(HEADERS) if h not in CONSOLE_HIDDEN]
        for i in shown:
            h = HEADERS[i]
            t.add_column(h, overflow="fold", no_wrap=h in ("#", "score↑", "bpb↓", "Δ held-out", "train FLOPs", "seed"),
                         min_width=12 if h == "run" else None)
        for row in rows(g):
            t.add_row(*(escape(row[i]) for i in shown))
        console.print(t)
        reps = repeat_rows(g)
        if reps:
            rt = Table(title=f"group {n}: seed repeats (std: sample, ddof=1)", box=box.SIMPLE_HEAD)
            for h in REPEAT_HEADERS:
                rt.add_column(h, overflow="fold")
            for row in reps:
                rt.add_row(*map(escape, row))
            console.print(rt)
    for r in failed:
        f = r.manifest.get("failure") or {}
        console.print(f"not ranked (failed at stage {f.get('stage')}): {r.label}: {f.get('message')}",
                      markup=False, highlight=False, soft_wrap=True)


def _table_html(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table>"


def html_report(groups: Sequence[Group], failed: Sequence[Run], plot_svg: bytes | None,
                compute_svg: bytes | None = None) -> str:
    """One self-contained HTML file: warnings, each group's ranked table and seed repeats, failed
    runs, the learning-curve plot and the bpb-against-training-FLOPs plot as inline SVG
    (template: ``templates/compare.html``)."""
    parts = [f'<p class="warn">WARNING: {html.escape(w)}</p>' for w in warnings(groups)]
    parts.append(f"<p class='note'>{html.escape(LEGEND)}</p>")
    for n, g in enumerate(groups, 1):
        parts.append(f"<h2>Group {n}</h2><p class='key'>" + html.escape(key_text(g))
                     + "</p>" + _table_html(HEADERS, rows(g)))
        reps = repeat_rows(g)
        if reps:
            parts.append("<h3>Seed repeats (std: sample, ddof=1)</h3>" + _table_html(REPEAT_HEADERS, reps))
    if failed:
        parts.append("<h2>Not ranked (failed)</h2>" + _table_html(
            ("run", "stage", "message"),
            [(r.label, str((r.manifest.get("failure") or {}).get("stage")),
              str((r.manifest.get("failure") or {}).get("message"))) for r in failed]))
    if plot_svg:
        svg = plot_svg.decode("utf-8")
        parts.append("<h2>Learning curves</h2><div class='plot'>" + svg[svg.index("<svg"):] + "</div>")
    if compute_svg:
        svg = compute_svg.decode("utf-8")
        parts.append("<h2>bpb against training FLOPs</h2><div class='plot'>" + svg[svg.index("<svg"):] + "</div>")
    template = (resources.files("prism_challenge") / "templates" / "compare.html").read_text()
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return template.replace("{{generated}}", html.escape(stamp)).replace("{{body}}", "\n".join(parts))


def add_compare_parser(sub: Any) -> None:
    """Register ``prism compare`` on an argparse subparsers object."""
    p = sub.add_parser("compare", help="rank runs as the challenge does; warn on runs that are not comparable",
                       description="Rank run directories exactly as the challenge ranks them "
                       "(prism_challenge.verdict.rank), grouping runs that are not comparable (another profile, "
                       "data MANIFEST, tokenizer basis, budgets or world size) and summarising seed repeats.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, folders of runs, or globs (prism-runs/*)")
    p.add_argument("--plot", metavar="FILE", help="write the learning curves (bpb against bytes scored): .png or .svg")
    p.add_argument("--plot-compute", metavar="FILE",
                   help="write prequential bpb against the estimated training FLOPs of each run: .png or .svg")
    p.add_argument("--html", metavar="FILE", help="write one HTML file with the tables and the plots")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """Run ``prism compare``; returns 0, or 2 for run directories or a plot name that cannot be used."""
    from rich.console import Console

    from prism_challenge.plots import PlotError, figure_bytes, learning_curve_figure, run_curve, save_figure

    console, err = Console(), Console(stderr=True)
    try:
        for flag, name in (("--plot", args.plot), ("--plot-compute", getattr(args, "plot_compute", None))):
            if name and Path(name).suffix.lower() not in (".png", ".svg"):
                raise PlotError(f"{flag} {name}: the file name must end in .png or .svg")
        runs = load_runs(find_runs(args.runs))
        groups = group_runs(runs)
        failed = [r for r in runs if not r.scored]
        print_report(console, groups, failed)
        shown = [r for g in groups for r in g.runs]
        fig = learning_curve_figure([run_curve(r.manifest, r.label) for r in shown],
                                    colour_by=[variant(r.manifest) for r in shown]) if shown else None
        if args.plot and fig is not None:
            console.print(f"plot: {save_figure(fig, args.plot)}", markup=False, highlight=False, soft_wrap=True)
        cfig = _compute_plot(shown, getattr(args, "plot_compute", None), console)
        if args.html:
            Path(args.html).write_text(html_report(groups, failed, figure_bytes(fig, "svg") if fig else None,
                                                   figure_bytes(cfig, "svg") if cfig else None))
            console.print(f"report: {args.html}", markup=False, highlight=False, soft_wrap=True)
    except (CompareError, PlotError, OSError) as exc:
        from rich.markup import escape

        err.print(f"[bold red]prism compare[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    return 0


def _compute_plot(shown: Sequence[Run], path: str | None, console: Any) -> Any:
    """The bpb-against-training-FLOPs figure of the runs that have a FLOP estimate (``None``:
    none has), written to ``path`` when given.

    Raises:
        PlotError: ``path`` given and no run to draw, or a suffix other than ``.png`` or ``.svg``.
    """
    from prism_challenge.plots import PlotError, compute_figure, compute_point, save_figure

    pts = [(compute_point(r.manifest, r.label), variant(r.manifest)) for r in shown]
    pts = [(pt, k) for pt, k in pts if pt is not None]  # runs without a FLOP count are left out
    fig = compute_figure([pt for pt, _ in pts], colour_by=[k for _, k in pts]) if pts else None
    if path:
        if fig is None:
            raise PlotError(f"--plot-compute {path}: no scored run has a training FLOP estimate above 0 (a "
                            "manifest before issue 29, a count that failed, or a model without matmuls)")
        console.print(f"plot: {save_figure(fig, path, '--plot-compute')}", markup=False, highlight=False,
                      soft_wrap=True)
    return fig


def png_data_uri(png: bytes) -> str:
    """A ``data:image/png;base64,...`` URI (for pages that embed a PNG instead of SVG)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
