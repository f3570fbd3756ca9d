"""``prism compare`` output: the console tables, the plot file and the one-file HTML report."""

from __future__ import annotations

import argparse
import base64
import html
import json
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from prism_challenge.research.compare import (
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
from prism_challenge.score.crown import DEFAULT_SIGNIFICANCE_P
from prism_challenge.data.refcodes import CODECS, against_best
from prism_challenge.score.flops import flops_text
from prism_challenge.terminal import printable

HEADERS = ("#", "run", "score↑", "bpb↓", "Δ held-out", "train FLOPs", "flags", "seed", "tokenizer", "bytes", "stop",
           *CODECS, "bpb − best ref")
# in the group's key line and its reference line (:func:`reference_lines`), and in the HTML report
CONSOLE_HIDDEN = ("tokenizer", "bytes", *CODECS, "bpb − best ref")
LEGEND = ("score↑: final_score, higher is better (the score); bpb↓: prequential_bpb, lower is better "
          "(ranked on it first); Δ held-out: heldout_delta (bpb); train FLOPs: compute.training_flops_estimate "
          "(3 x the scoring forward's FLOPs, counted by the audit; information, not ranked); reference codes: the "
          "bits per byte of " + ", ".join(CODECS) + " on the same scored bytes; bpb − best: the model's bpb minus "
          "the best of them (negative: the model codes the text in fewer bits than every one)")


def key_text(group: Group) -> str:
    """The group's comparability key, one ``field: value`` after another (shas shortened)."""
    def short(v: Any) -> str:
        if isinstance(v, dict):  # budgets: "token_budget 20,000", never a Python dict
            return ", ".join(f"{k} {short(x)}" for k, x in v.items()) or "none"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return v[:12] if isinstance(v, str) and len(v) == 64 else str(v)

    return "; ".join(f"{k}: {short(v)}" for k, v in group.key.items())


def reference_cells(bpb: float, record: dict[str, Any] | None) -> tuple[str, ...]:
    """The reference-code cells of a row: one per compressor, and ``bpb`` minus the best
    (``+1.6857 xz-9e``); ``-`` in each without a record."""
    if not record:
        return ("-",) * (len(CODECS) + 1)
    best, diff = against_best(bpb, record)
    return (*(f"{record[n]:.4f}" for n in CODECS), f"{diff:+.4f} {best}")


def reference_lines(group: Group) -> list[str]:
    """The console's reference lines of a group: one per distinct ``reference_codes`` record
    (runs on the same bytes share one), its codes and each of its runs' bpb minus the best, e.g.
    ``reference codes of the same 67,892 scored bytes (bpb): zstd-19 2.4558 · xz-9e 2.4279 ·
    gzip-9 2.5919; bpb − xz-9e: tiny +1.6857``."""
    by: dict[str, list[Run]] = {}
    for r in group.runs:
        record = r.manifest.get("reference_codes")
        if record:
            by.setdefault(json.dumps(record, sort_keys=True), []).append(r)
    out = []
    for key, runs in by.items():
        record = json.loads(key)
        best = against_best(0.0, record)[0]
        diffs = ", ".join(f"{r.label} {against_best(r.manifest['score']['prequential_bpb'], record)[1]:+.4f}"
                          for r in runs)
        out.append(f"reference codes of the same {record['bytes']:,} scored bytes (bpb): "
                   + " · ".join(f"{n} {record[n]:.4f}" for n in CODECS) + f"; bpb − {best}: {diffs}")
    return out


def rows(group: Group) -> list[tuple[str, ...]]:
    """The table rows of a ranked group (strings, in :data:`HEADERS` order)."""
    out = []
    for i, r in enumerate(group.runs, 1):
        m, v = r.manifest, r.manifest.get("verdict") or {}
        delta = (v.get("heldout") or {}).get("heldout_delta")
        fs = v.get("final_score")
        bpb = m["score"]["prequential_bpb"]
        out.append((str(i), r.label, "-" if fs is None else f"{fs:.6f}", f"{bpb:.6f}",
                    "-" if delta is None else f"{delta:.4f}",
                    flops_text((m.get("compute") or {}).get("training_flops_estimate")),
                    ", ".join(r.entry()["flags"]) or "-",
                    str(m.get("seed")), (m.get("tokenizer") or {}).get("name", "?"), f"{m['score']['bytes']:,}",
                    (m.get("stream") or {}).get("stop_reason", "?"), *reference_cells(bpb, m.get("reference_codes"))))
    return out


def _pm(f: dict[str, Any], spec: str) -> str:
    return format(f["mean"], spec) + ("" if f["std"] is None else " ± " + format(f["std"], spec))


def repeat_rows(group: Group) -> list[tuple[str, ...]]:
    """Seed-repeat rows: bundle, n, mean ± std of final_score and prequential_bpb, seeds."""
    return [(r["bundle"], str(r["n"]), _pm(r["final_score"], ".6f"), _pm(r["prequential_bpb"], ".6f"),
             ", ".join(map(str, r["seeds"]))) for r in seed_repeats(group)]


REPEAT_HEADERS = ("bundle", "n", "final_score mean ± std", "prequential_bpb mean ± std", "seeds")
CROWN_HEADERS = ("#", "bundle", "n", "bpb mean ± std", "p vs #1", "Δ mean vs #1 [95 % CI]", "seeds")
CROWN_NOTE = ("crown rule (prism_challenge.score.crown): a later bundle takes #1 only if its mean bpb is lower by a "
              "one-sided Welch t-test at p < {p} (with fewer than 2 runs on either side, the lowest mean leads); "
              "the rest by mean; p and Δ need 2+ runs on both sides")


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


def namesake_lines(rows_: Sequence[CrownRow]) -> list[str]:
    """One line per ``#N`` variant of the crown table: what sets it apart from the first variant
    of its bundle's name (or that only settings not listed here do)."""
    return [f"{r.label} is {r.namesake} with other settings: "
            + ("; ".join(r.differs) if r.differs else "none listed here differs (see the manifests)")
            for r in rows_ if r.namesake is not None]


def crown_shown(rows_: Sequence[CrownRow]) -> bool:
    """The crown table is printed when it compares something: two variants, or seed repeats."""
    return len(rows_) > 1 or any(r.ranked.n > 1 for r in rows_)


def _width(cells: Sequence[tuple[str, ...]], shown: Sequence[int]) -> int:
    """Columns a table of ``cells`` needs with no cell folded (one space each side of a cell)."""
    return sum(2 + max([len(HEADERS[i])] + [len(r[i]) for r in cells]) for i in shown)


def print_report(console, groups: Sequence[Group], failed: Sequence[Run], p: float = DEFAULT_SIGNIFICANCE_P) -> None:
    """The console report: warnings, then per group its key, ranked table, seed repeats and the
    crown table of its bundles (significance level ``p``)."""
    from rich import box
    from prism_challenge.terminal import shown as escape  # printable, then markup-escaped
    from rich.table import Table

    for w in warnings(groups):
        console.print(f"[bold yellow]WARNING[/] {escape(w)}", highlight=False, soft_wrap=True)
    console.print(LEGEND, highlight=False, soft_wrap=True)
    for n, g in enumerate(groups, 1):
        t = Table(title=f"group {n}, ranked as the challenge ranks (prism_challenge.score.verdict.rank)",
                  caption=escape(key_text(g)), caption_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
        shown = [i for i, h in enumerate(HEADERS) if h not in CONSOLE_HIDDEN]
        cells = rows(g)
        names = None
        if _width(cells, shown) > console.width:  # a narrow console: short names; directories, FLOPs below
            short, flops = legend_names([g], p), HEADERS.index("train FLOPs")
            names = [(short[id(r)], f"{r.label} (train FLOPs {c[flops]})") for r, c in zip(g.runs, cells)]
            cells = [(c[0], name, *c[2:]) for c, (name, _) in zip(cells, names)]
            shown = [i for i in shown if i != flops]
        for i in shown:
            h = HEADERS[i]
            # a run's name and its stop reason are never cut mid-word; flags wrap at their commas
            widest = max((len(r[i]) for r in cells), default=0)
            t.add_column(h, overflow="fold", no_wrap=h in ("#", "score↑", "bpb↓", "Δ held-out", "train FLOPs", "seed"),
                         min_width=widest if h == "stop" or (h == "run" and names is None) else None)
        for row in cells:
            t.add_row(*(escape(row[i]) for i in shown))
        console.print(t)
        for name, label in names or ():
            console.print(printable(f"  {name}: {label}"), markup=False, highlight=False, soft_wrap=True)
        for line in reference_lines(g):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
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
            for line in namesake_lines(crowned):
                console.print(printable(f"  {line}"), markup=False, highlight=False, soft_wrap=True)
    for r in failed:
        f = r.manifest.get("failure") or {}
        console.print(printable(f"not ranked (failed at stage {f.get('stage')}): {r.label}: {f.get('message')}"),
                      markup=False, highlight=False, soft_wrap=True)


def _table_html(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table>"


def html_report(groups: Sequence[Group], failed: Sequence[Run], plot_svg: bytes | None,
                p: float = DEFAULT_SIGNIFICANCE_P, compute_svg: bytes | None = None) -> str:
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
        crowned = crown(g, p)
        if crown_shown(crowned):
            parts.append("<h3>Bundles by the crown rule</h3><p class='note'>" + html.escape(CROWN_NOTE.format(p=p))
                         + "</p>" + _table_html(CROWN_HEADERS, crown_rows(crowned))
                         + "".join(f"<p class='note'>{html.escape(x)}</p>" for x in namesake_lines(crowned)))
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
                       "(prism_challenge.score.verdict.rank), grouping runs that are not comparable (another profile, "
                       "data MANIFEST, tokenizer basis, budgets or world size), summarising seed repeats, and ranking "
                       "bundles by the crown rule: one-sided Welch p against the first, and the difference in mean "
                       "bpb with its 95 % interval.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, folders of runs, or globs (prism-runs/*)")
    p.add_argument("--plot", metavar="FILE", help="write the learning curves (bpb against bytes scored): .png or .svg")
    p.add_argument("--plot-compute", metavar="FILE",
                   help="write prequential bpb against the estimated training FLOPs of each run: .png or .svg")
    p.add_argument("--html", metavar="FILE", help="write one HTML file with the tables and the plots")
    p.add_argument("--significance-p", type=float, default=DEFAULT_SIGNIFICANCE_P, metavar="P",
                   help=f"the crown rule's level (one-sided Welch t-test), in (0, 1); default {DEFAULT_SIGNIFICANCE_P}")
    p.set_defaults(func=cmd_compare)


def legend_names(groups: Sequence[Group], p: float) -> dict[int, str]:
    """A short legend name per run (keyed by ``id(run)``): its bundle's label in the crown table
    and its seed, ``"tiny-1m · seed 1234"`` (``#2``... when a bundle and seed repeat), never the
    timestamped run directory."""
    names: dict[int, str] = {}
    for g in groups:
        for row in crown(g, p):
            for r in row.runs:
                name = f"{row.label} · seed {r.manifest.get('seed')}"
                n = sum(1 for v in names.values() if v == name or v.startswith(name + " #"))
                names[id(r)] = name if n == 0 else f"{name} #{n + 1}"
    return names


def cmd_compare(args: argparse.Namespace) -> int:
    """Run ``prism compare``; returns 0, or 2 for run directories or a plot name that cannot be used."""
    from rich.console import Console

    from prism_challenge.research.plots import PlotError, figure_bytes, learning_curve_figure, run_curve, save_figure

    console, err = Console(), Console(stderr=True)
    try:
        if not 0.0 < args.significance_p < 1.0:
            raise CompareError(f"--significance-p {args.significance_p}: must be in (0, 1)")
        for flag, name in (("--plot", args.plot), ("--plot-compute", getattr(args, "plot_compute", None))):
            if name and Path(name).suffix.lower() not in (".png", ".svg"):
                raise PlotError(f"{flag} {name}: the file name must end in .png or .svg")
        runs = load_runs(find_runs(args.runs))
        groups = group_runs(runs)
        failed = [r for r in runs if not r.scored]
        print_report(console, groups, failed, args.significance_p)
        shown = [r for g in groups for r in g.runs]
        names = legend_names(groups, args.significance_p)
        fig = learning_curve_figure([run_curve(r.manifest, names[id(r)]) for r in shown],
                                    colour_by=[variant(r.manifest) for r in shown]) if shown else None
        if args.plot and fig is not None:
            console.print(f"plot: {save_figure(fig, args.plot)}", markup=False, highlight=False, soft_wrap=True)
        cfig = _compute_plot(shown, getattr(args, "plot_compute", None), console)
        if args.html:
            Path(args.html).write_text(html_report(groups, failed, figure_bytes(fig, "svg") if fig else None,
                                                  args.significance_p, figure_bytes(cfig, "svg") if cfig else None))
            console.print(f"report: {args.html}", markup=False, highlight=False, soft_wrap=True)
    except (CompareError, PlotError, OSError) as exc:
        from prism_challenge.terminal import shown as escape  # printable, then markup-escaped

        err.print(f"[bold red]prism compare[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    return 0


def _compute_plot(shown: Sequence[Run], path: str | None, console: Any) -> Any:
    """The bpb-against-training-FLOPs figure of the runs that have a FLOP estimate (``None``:
    none has), written to ``path`` when given.

    Raises:
        PlotError: ``path`` given and no run to draw, or a suffix other than ``.png`` or ``.svg``.
    """
    from prism_challenge.research.plots import PlotError, compute_figure, compute_point, save_figure

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
