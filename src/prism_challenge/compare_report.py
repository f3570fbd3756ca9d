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
    CrownRow,
    Group,
    Run,
    find_runs,
    group_runs,
    crown,
    load_runs,
    seed_repeats,
    variant,
    warnings,
)
from prism_challenge.crown import DEFAULT_SIGNIFICANCE_P

HEADERS = ("#", "run", "score↑", "bpb↓", "Δ held-out", "flags", "seed", "tokenizer", "bytes", "stop")
CONSOLE_HIDDEN = ("tokenizer", "bytes")  # in the group's key line, and in the HTML report
LEGEND = ("score↑: final_score, higher is better (the score); bpb↓: prequential_bpb, lower is better "
          "(ranked on it first); Δ held-out: heldout_delta (bpb)")


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
                    "-" if delta is None else f"{delta:.4f}", ", ".join(r.entry()["flags"]) or "-",
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
CROWN_HEADERS = ("#", "bundle", "n", "bpb mean ± std", "p vs #1", "Δ mean vs #1 [95 % CI]", "seeds")
CROWN_NOTE = ("crown rule (prism_challenge.crown): a later bundle takes #1 only if its mean bpb is lower by a "
              "one-sided Welch t-test at p < {p}; the rest by mean; p and Δ need 2+ runs on both sides")


def crown_rows(rows_: Sequence[CrownRow]) -> list[tuple[str, ...]]:
    """The crown table's rows (strings, :data:`CROWN_HEADERS` order): Δ is ``mean - #1's mean``
    (bpb) with its Welch 95 % interval; ``-`` where no test is possible."""
    out = []
    for row in rows_:
        g, d = row.ranked, row.vs_leader
        place = f"{g.place}" + (" short" if g.short else "")
        diff = "-" if d is None else f"{d.diff:+.6f} [{d.low:+.6f}, {d.high:+.6f}]"
        out.append((place, row.label, str(g.n), f"{g.mean:.6f}" + ("" if g.std is None else f" ± {g.std:.6f}"),
                    "-" if g.p is None else f"{g.p:.3g}", diff,
                    ", ".join(str(r.manifest.get("seed")) for r in row.runs)))
    return out


def crown_shown(rows_: Sequence[CrownRow]) -> bool:
    """The crown table is printed when it compares something: two variants, or seed repeats."""
    return len(rows_) > 1 or any(r.ranked.n > 1 for r in rows_)


def print_report(console, groups: Sequence[Group], failed: Sequence[Run], p: float = DEFAULT_SIGNIFICANCE_P) -> None:
    """The console report: warnings, then per group its key, ranked table, seed repeats and the
    crown table of its bundles (significance level ``p``)."""
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
            t.add_column(h, overflow="fold", no_wrap=h in ("#", "score↑", "bpb↓", "Δ held-out", "seed"), min_width=12 if h == "run" else None)
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
        crowned = crown(g, p)
        if crown_shown(crowned):
            ct = Table(title=f"group {n}: bundles by the crown rule", caption=escape(CROWN_NOTE.format(p=p)),
                       caption_justify="left", box=box.SIMPLE_HEAD)
            for h in CROWN_HEADERS:
                ct.add_column(h, overflow="fold")
            for row in crown_rows(crowned):
                ct.add_row(*map(escape, row))
            console.print(ct)
    for r in failed:
        f = r.manifest.get("failure") or {}
        console.print(f"not ranked (failed at stage {f.get('stage')}): {r.label}: {f.get('message')}",
                      markup=False, highlight=False, soft_wrap=True)


def _table_html(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table>"


def html_report(groups: Sequence[Group], failed: Sequence[Run], plot_svg: bytes | None,
                p: float = DEFAULT_SIGNIFICANCE_P) -> str:
    """One self-contained HTML file: warnings, each group's ranked table and seed repeats, failed
    runs, and the learning-curve plot as inline SVG (template: ``templates/compare.html``)."""
    parts = [f'<p class="warn">WARNING: {html.escape(w)}</p>' for w in warnings(groups)]
    parts.append(f"<p class='note'>{html.escape(LEGEND)}</p>")
    for n, g in enumerate(groups, 1):
        parts.append(f"<h2>Group {n}</h2><p class='key'>" + html.escape(key_text(g))
                     + "</p>" + _table_html(HEADERS, rows(g)))
        reps = repeat_rows(g)
        if reps:
            parts.append("<h3>Seed repeats (std: sample, ddof=1)</h3>" + _table_html(REPEAT_HEADERS, reps))
        crowned = crown(g, p)
        if crown_shown(crowned):
            parts.append("<h3>Bundles by the crown rule</h3><p class='note'>" + html.escape(CROWN_NOTE.format(p=p))
                         + "</p>" + _table_html(CROWN_HEADERS, crown_rows(crowned)))
    if failed:
        parts.append("<h2>Not ranked (failed)</h2>" + _table_html(
            ("run", "stage", "message"),
            [(r.label, str((r.manifest.get("failure") or {}).get("stage")),
              str((r.manifest.get("failure") or {}).get("message"))) for r in failed]))
    if plot_svg:
        svg = plot_svg.decode("utf-8")
        parts.append("<h2>Learning curves</h2><div class='plot'>" + svg[svg.index("<svg"):] + "</div>")
    template = (resources.files("prism_challenge") / "templates" / "compare.html").read_text()
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return template.replace("{{generated}}", html.escape(stamp)).replace("{{body}}", "\n".join(parts))


def add_compare_parser(sub: Any) -> None:
    """Register ``prism compare`` on an argparse subparsers object."""
    p = sub.add_parser("compare", help="rank runs as the challenge does; warn on runs that are not comparable",
                       description="Rank run directories exactly as the challenge ranks them "
                       "(prism_challenge.verdict.rank), grouping runs that are not comparable (another profile, "
                       "data MANIFEST, tokenizer basis, budgets or world size), summarising seed repeats, and ranking "
                       "bundles by the crown rule: one-sided Welch p against the first, and the difference in mean "
                       "bpb with its 95 % interval.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, folders of runs, or globs (prism-runs/*)")
    p.add_argument("--plot", metavar="FILE", help="write the learning curves (bpb against bytes scored): .png or .svg")
    p.add_argument("--html", metavar="FILE", help="write one HTML file with the tables and the plot")
    p.add_argument("--significance-p", type=float, default=DEFAULT_SIGNIFICANCE_P, metavar="P",
                   help=f"the crown rule's level (one-sided Welch t-test), in (0, 1); default {DEFAULT_SIGNIFICANCE_P}")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """Run ``prism compare``; returns 0, or 2 for run directories or a plot name that cannot be used."""
    from rich.console import Console

    from prism_challenge.plots import PlotError, figure_bytes, learning_curve_figure, run_curve, save_figure

    console, err = Console(), Console(stderr=True)
    try:
        if not 0.0 < args.significance_p < 1.0:
            raise CompareError(f"--significance-p {args.significance_p}: must be in (0, 1)")
        if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg"):
            raise PlotError(f"--plot {args.plot}: the file name must end in .png or .svg")
        runs = load_runs(find_runs(args.runs))
        groups = group_runs(runs)
        failed = [r for r in runs if not r.scored]
        print_report(console, groups, failed, args.significance_p)
        shown = [r for g in groups for r in g.runs]
        fig = learning_curve_figure([run_curve(r.manifest, r.label) for r in shown],
                                    colour_by=[variant(r.manifest) for r in shown]) if shown else None
        if args.plot and fig is not None:
            console.print(f"plot: {save_figure(fig, args.plot)}", markup=False, highlight=False, soft_wrap=True)
        if args.html:
            Path(args.html).write_text(html_report(groups, failed, figure_bytes(fig, "svg") if fig else None,
                                                  args.significance_p))
            console.print(f"report: {args.html}", markup=False, highlight=False, soft_wrap=True)
    except (CompareError, PlotError, OSError) as exc:
        from rich.markup import escape

        err.print(f"[bold red]prism compare[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    return 0


def png_data_uri(png: bytes) -> str:
    """A ``data:image/png;base64,...`` URI (for pages that embed a PNG instead of SVG)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
