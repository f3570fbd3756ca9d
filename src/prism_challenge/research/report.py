"""Console reports: the summary table of a scored run, the one-line failure, seed statistics."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from prism_challenge.terminal import printable
from prism_challenge.terminal import shown as escape  # printable, then markup-escaped
from rich.table import Table

from prism_challenge.evaluator.single import FAILED as SINGLE_AGENT_FAILED
from prism_challenge.score.flops import flops_text


def print_failure(console: Console, failure, run_dir: Path | None = None) -> None:
    """One clear line naming the stage and reason, then any detail (traceback tail, findings)."""
    # soft_wrap: the reason stays one line, whatever the terminal width (grep-able, copy-able)
    console.print(f"[bold red]prism eval failed[/] at stage [bold]{failure.stage}[/]: {escape(failure.message)}",
                  highlight=False, soft_wrap=True)
    detail = strip_launcher_dump(failure.detail or "")
    if detail:
        console.print(printable(detail), markup=False, highlight=False, soft_wrap=True)
    if run_dir is not None:
        console.print(f"loop output (print) and the launcher's log: {run_dir / 'logs' / 'runner.log'}",
                      markup=False, highlight=False, soft_wrap=True)
        console.print(f"run manifest: {run_dir / 'prism_run_manifest.v2.json'}", markup=False,
                      highlight=False, soft_wrap=True)


C10D_HOSTNAME_WARNING = "[c10d] The hostname of the client socket cannot be retrieved"


def strip_launcher_dump(text: str) -> str:
    """``text`` without torchrun's own failure report (its ``failed (exitcode ...)`` line, its
    ``ChildFailedError`` traceback and the ``Failures: ... Root Cause ... error_file`` block
    between two ``====`` rules: they stay in the run's log), without the single-rank agent's
    one line of the same kind (:data:`~prism_challenge.evaluator.single.FAILED`) and without
    c10d's hostname warning (the sandbox has no resolvable hostname)."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        starts = ("torch/distributed/elastic/" in line and "exitcode" in line) or (
            line.startswith("Traceback") and i + 1 < len(lines) and "<frozen runpy>" in lines[i + 1])
        if starts:
            bars = 0
            while i < len(lines) and bars < 2:
                bars += lines[i].startswith("====")
                i += 1
            continue
        if C10D_HOSTNAME_WARNING not in line and not line.startswith(SINGLE_AGENT_FAILED):
            out.append(line)
        i += 1
    return "\n".join(out).strip()


SCORE_LINE = "score: final_score, higher is better; ranked by prequential_bpb, lower is better (prism compare)"


def print_summary(console: Console, outcome) -> None:
    """The summary of a scored run: the ranked figures first (with their direction), the table,
    then the manifest and runner-log paths in full, outside the table, at any terminal width."""
    m = outcome.manifest
    s, st, c = m["score"], m["stream"], m["compute"]
    v = m.get("verdict") or {}
    t = Table(title="PRISM scored run", show_header=False)
    t.add_column("field", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold")
    rows = [
        ("final_score (higher is better)", _fmt(v.get("final_score"), ".6f")),
        ("prequential_bpb (lower is better)", f"{s['prequential_bpb']:.6f}"),
        ("reference codes, same bytes (bpb)", reference_text(m.get("reference_codes"), s["prequential_bpb"])),
        ("total bits", f"{s['total_bits']:,.1f}"),
        ("bytes scored", f"{s['bytes']:,}"),
        ("targets scored", f"{s['targets']:,}"),
        ("tokens consumed", f"{st['tokens']:,}"),
        ("batches", f"{st['batches']:,}"),
        ("stop reason", st["stop_reason"]),
        ("parameters", f"{m['model']['parameter_count']:,}" if m["model"]["parameter_count"] is not None else "-"),
        ("tokenizer", f"{m['tokenizer']['name']} (V={m['tokenizer']['vocab_size']})"),
        ("device / world size", f"{c['device']} / {c['world_size']}"),
        ("seed", str(m.get("seed"))),
        ("profile", _profile(m.get("profile"))),
        ("wall time", f"{m['timing']['wall_s']:.1f} s"),
        ("training FLOPs (estimate)", _spent(c)),
        ("non-finite batches", str(s["nonfinite_batches"])),
        *_verdict_rows(v),
        ("audit", _audit(m.get("audit"))),
        ("isolation", _isolation(m.get("isolation"))),
        ("run secret", _secret(m.get("run_secret"))),
        ("certificate", _certificate(m.get("certificate"))),
    ]
    for k, val in rows:
        t.add_row(k, escape(val))
    console.print(t)
    console.print(SCORE_LINE, highlight=False, soft_wrap=True)
    console.print(f"run manifest: {outcome.run_dir / 'prism_run_manifest.v2.json'}", markup=False,
                  highlight=False, soft_wrap=True)
    console.print(f"loop output (print) and the launcher's log: {outcome.run_dir / 'logs' / 'runner.log'}",
                  markup=False, highlight=False, soft_wrap=True)


def _profile(p) -> str:
    if not p:
        return "-"
    left = f", overridden: {', '.join(p['overridden'])}" if p.get("overridden") else ""
    return f"{p['name']} (sha256 {p['sha256'][:12]}){left}"


def summary_dict(outcome) -> dict[str, Any]:
    """The JSON summary of one run (``prism eval --json``): status, score, verdict figures, the
    settings that decide comparability, the revealed ``run_secret`` and the certificate's
    ``signing_key_id`` (``None`` when absent), the ``reference_codes`` record, and the run
    directory, manifest and log paths."""
    m = outcome.manifest
    s, v = m.get("score") or {}, m.get("verdict") or {}
    ho = v.get("heldout") or {}
    f = m.get("failure")
    return {
        "status": m.get("status"), "run_dir": str(outcome.run_dir),
        "manifest": str(outcome.run_dir / "prism_run_manifest.v2.json"),
        "log": str(outcome.run_dir / "logs" / "runner.log"),
        "score_field": "final_score", "score_direction": "higher is better",
        "rank_field": "prequential_bpb", "rank_direction": "lower is better",
        "final_score": v.get("final_score"), "prequential_bpb": s.get("prequential_bpb"),
        "heldout_delta": ho.get("heldout_delta"), "tail_bpb": v.get("tail_bpb"),
        "heldout_error": v.get("heldout_error"), "flags": v.get("flags", []),
        "bytes": s.get("bytes"), "tokens": (m.get("stream") or {}).get("tokens"),
        "reference_codes": m.get("reference_codes"),
        "stop_reason": (m.get("stream") or {}).get("stop_reason"), "seed": m.get("seed"),
        "bundle_sha256": (m.get("bundle") or {}).get("sha256"), "profile": m.get("profile"),
        "budgets": m.get("budgets"), "world_size": (m.get("compute") or {}).get("world_size"),
        "training_flops_estimate": (m.get("compute") or {}).get("training_flops_estimate"),
        "run_secret": m.get("run_secret"), "signing_key_id": (m.get("certificate") or {}).get("key_id"),
        "failure": None if f is None else {"stage": f["stage"], "message": f["message"], "kind": f.get("kind")},
    }


def seed_stats(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and sample standard deviation (``statistics.stdev``: ddof=1; ``None`` below 2 runs)
    of ``prequential_bpb`` and ``final_score`` over the scored runs; failed runs are listed."""
    kept = [r for r in summaries if r.get("status") == "scored"]
    out: dict[str, Any] = {"n": len(kept), "std": "sample standard deviation (ddof=1)",
                           "seeds": [r.get("seed") for r in kept],
                           "failed_seeds": [r.get("seed") for r in summaries if r.get("status") != "scored"],
                           "run_dirs": [r["run_dir"] for r in kept]}
    for key in ("prequential_bpb", "final_score"):
        values = [float(r[key]) for r in kept if isinstance(r.get(key), (int, float))]
        out[key] = {"values": values, "mean": statistics.mean(values) if values else None,
                    "std": statistics.stdev(values) if len(values) >= 2 else None}
    return out


def print_seed_stats(console: Console, stats: dict[str, Any]) -> None:
    """The seed repeats' table: each value, the mean and the sample std (ddof=1) with n."""
    t = Table(title=f"seed repeats: n = {stats['n']} scored runs (std: sample, ddof=1)")
    t.add_column("figure", no_wrap=True)
    t.add_column("mean", no_wrap=True)
    t.add_column("std (ddof=1)", no_wrap=True)
    t.add_column("values (seeds " + ", ".join(map(str, stats["seeds"])) + ")", overflow="fold")
    for key, label in (("final_score", "final_score (higher is better)"),
                       ("prequential_bpb", "prequential_bpb (lower is better)")):
        f = stats[key]
        t.add_row(label, _fmt(f["mean"], ".6f"), _fmt(f["std"], ".6f"), ", ".join(f"{x:.6f}" for x in f["values"]))
    console.print(t)
    if stats["failed_seeds"]:
        console.print(f"failed (not in the statistics): seeds {stats['failed_seeds']}", highlight=False)
    for d in stats["run_dirs"]:
        console.print(f"run: {d}", markup=False, highlight=False, soft_wrap=True)


def reference_text(record: dict[str, Any] | None, bpb: float | None) -> str:
    """The reference compressors' code lengths of the scored bytes and the model's distance to
    the best (:func:`~prism_challenge.data.refcodes.against_best`), e.g.
    ``zstd-19 2.4558 · xz-9e 2.4279 · gzip-9 2.5919; model +1.6857 vs xz-9e``; ``-`` without a
    record (a manifest before issue 29, or the codes could not be computed)."""
    from prism_challenge.data.refcodes import CODECS, against_best

    if not record:
        return "-"
    text = " · ".join(f"{name} {record[name]:.4f}" for name in CODECS)
    if bpb is None:
        return text
    best, diff = against_best(bpb, record)
    return f"{text}; model {diff:+.4f} vs {best}"


def _fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _verdict_rows(v: dict[str, Any]) -> list[tuple[str, str]]:
    if not v:
        return []
    ho = v.get("heldout") or {}
    rows = [
        ("tail bpb (last 10%)", _fmt(v["tail_bpb"])),
        ("held-out bpb (trained/untrained)",
         f"{_fmt(ho.get('val_bpb_trained'))} / {_fmt(ho.get('val_bpb_twin'))}" if ho else f"- ({v.get('heldout_error')})"),
        ("heldout_delta", _fmt(ho.get("heldout_delta")) if ho else "-"),
        ("memorization gap (threshold)", _gap(v)),
        ("anti-cheat x memorization", f"{v['anti_cheat_multiplier']:g} x {v['memorization_penalty']:g}"),
    ]
    if v.get("flags"):
        rows.append(("flags", ", ".join(v["flags"])))
    return rows


def _gap(v: dict[str, Any]) -> str:
    """The gap and the run's threshold: ``0.0123 (> 0.0968 = 4 x se 0.0242: flagged)``."""
    gap, noise = v.get("memorization_gap"), v.get("memorization_noise")
    if gap is None or not noise:
        return _fmt(gap)
    how = (f"{noise['z']:g} x se {_fmt(noise['se_gap_bpb'])}" if noise.get("se_gap_bpb") is not None
           and noise["threshold_bpb"] > noise["floor_bpb"] else "floor")
    return f"{_fmt(gap)} ({'>' if v.get('memorization_flagged') else '<='} {_fmt(noise['threshold_bpb'])} = {how})"


def _spent(c: dict[str, Any]) -> str:
    """The compute line: training FLOPs (3 x the counted forward's), device-seconds, or why no count."""
    if c.get("training_flops_estimate") is None:
        return "-" + (f" ({c['flops_error']})" if c.get("flops_error") else "")
    dev = c.get("device_seconds")
    return (f"{flops_text(c['training_flops_estimate'])} (3 x the scoring forward's, counted by the audit)"
            + ("" if dev is None else f"; {dev:.1f} device-seconds"))


def _audit(a) -> str:
    """The audit's line: what passed, or the first mismatch (or why it could not run)."""
    if not a:
        return "-"
    if a.get("passed"):
        return (f"passed: {len(a['batches'])} batches re-scored equal to their records, "
                f"{a['blind_probes']} blind probes" + (f" (probes skipped: {a['probe_skipped']})"
                                                       if a.get("probe_skipped") else ""))
    return f"FAILED: {a.get('mismatch') or a.get('error')}"


def _secret(secret: str | None) -> str:
    """The revealed run secret, shortened, with how to use it."""
    return "-" if not secret else f"{secret[:12]}... (run_secret in the manifest; --run-secret repeats this run)"


def _certificate(cert) -> str:
    """Who signed the manifest, and how to check it."""
    if not cert:
        return "- (unsigned)"
    return f"{cert.get('alg')}, key {cert.get('key_id')} (prism verify RUN_DIR checks it)"


def _isolation(iso) -> str:
    if not iso:
        return "-"
    if not iso.get("isolated"):
        return "NONE (not tamper-resistant)"
    return f"strict ({iso.get('backend')})"
