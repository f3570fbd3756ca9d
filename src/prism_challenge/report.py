"""Console reports: the summary table of a scored run and the one-line failure."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def print_failure(console: Console, failure, run_dir: Path | None = None) -> None:
    """One clear line naming the stage and reason, then any detail (traceback tail, findings)."""
    # soft_wrap: the reason stays one line, whatever the terminal width (grep-able, copy-able)
    console.print(f"[bold red]prism eval failed[/] at stage [bold]{failure.stage}[/]: {escape(failure.message)}",
                  highlight=False, soft_wrap=True)
    if failure.detail:
        console.print(failure.detail, markup=False, highlight=False, soft_wrap=True)
    if run_dir is not None:
        console.print(f"run manifest: {run_dir / 'prism_run_manifest.v2.json'}", markup=False)


def print_summary(console: Console, outcome) -> None:
    """The short summary table of a scored run."""
    m = outcome.manifest
    s, st, c = m["score"], m["stream"], m["compute"]
    t = Table(title="PRISM scored run", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    rows = [
        ("prequential_bpb", f"{s['prequential_bpb']:.6f}"),
        ("total bits", f"{s['total_bits']:,.1f}"),
        ("bytes scored", f"{s['bytes']:,}"),
        ("targets scored", f"{s['targets']:,}"),
        ("tokens consumed", f"{st['tokens']:,}"),
        ("batches", f"{st['batches']:,}"),
        ("stop reason", st["stop_reason"]),
        ("parameters", f"{m['model']['parameter_count']:,}" if m["model"]["parameter_count"] is not None else "-"),
        ("tokenizer", f"{m['tokenizer']['name']} (V={m['tokenizer']['vocab_size']})"),
        ("device / world size", f"{c['device']} / {c['world_size']}"),
        ("wall time", f"{m['timing']['wall_s']:.1f} s"),
        ("non-finite batches", str(s["nonfinite_batches"])),
        *_verdict_rows(m.get("verdict")),
        ("isolation", _isolation(m.get("isolation"))),
        ("run manifest", str(outcome.run_dir / "prism_run_manifest.v2.json")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def _fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _verdict_rows(v) -> list[tuple[str, str]]:
    if not v:
        return []
    ho = v.get("heldout") or {}
    rows = [
        ("tail bpb (last 10%)", _fmt(v["tail_bpb"])),
        ("held-out val bpb (trained / twin)",
         f"{_fmt(ho.get('val_bpb_trained'))} / {_fmt(ho.get('val_bpb_twin'))}" if ho else f"- ({v.get('heldout_error')})"),
        ("heldout_delta", _fmt(ho.get("heldout_delta")) if ho else "-"),
        ("memorization gap", _fmt(v.get("memorization_gap"))),
        ("anti-cheat x memorization", f"{v['anti_cheat_multiplier']:g} x {v['memorization_penalty']:g}"),
        ("final_score", _fmt(v["final_score"], ".6f")),
    ]
    if v.get("flags"):
        rows.append(("flags", ", ".join(v["flags"])))
    return rows


def _isolation(iso) -> str:
    if not iso:
        return "-"
    if not iso.get("isolated"):
        return "NONE (not tamper-resistant)"
    return f"strict ({iso.get('backend')})"
