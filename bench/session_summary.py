"""The GPU session's summary (``bench/gpu_session.sh``): standard library only, so that it runs
even where PRISM or its wheels do not import.

Reads, for each phase ``NAME`` of :data:`ORDER`, ``WORK/NAME.rc`` (``"<exit status> <seconds>
<limit>"``, written by the session script; absent: the phase did not run), ``WORK/NAME.json``
(the phase's own result) and ``WORK/NAME.note`` (a line the script left), and writes
``OUT/summary.json``: ``{"ok", "dry_run", "device", "phases": [{"name", "status", "rc",
"seconds", "limit_s", "problems", "result"}]}``. A phase's status is its result's (``ok`` or
``failed``); without a result, ``timeout`` for exit status 124 or 137, ``crashed`` for another,
``skipped`` when it did not run (the note says why). ``ok`` is true when every phase asked for
(all, or those named by ``--only``) is ``ok``. Prints one table row per phase.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = ("wheels", "facts", "children", "probes", "smoke", "bigmodel")
STATUSES = ("ok", "failed", "timeout", "crashed", "skipped")
NOT_ASKED = "not asked for"
"""How the session's note of a phase left out by ``--only`` begins."""


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def _smoke_status(result: dict) -> tuple[str, list[str]]:
    problems = [f"{name}: {p}" for name, part in (result.get("parts") or {}).items() for p in part.get("problems", [])]
    return ("failed" if problems or not result.get("parts") else "ok"), problems


def phase_record(work: Path, name: str) -> dict:
    """One phase's row of the summary (see the module docstring)."""
    rc_line, note = _read(work / f"{name}.rc"), _read(work / f"{name}.note")
    raw = _read(work / f"{name}.json")
    result = json.loads(raw) if raw else None
    rec = {"name": name, "rc": None, "seconds": None, "limit_s": None, "note": note, "problems": [], "result": result}
    if rc_line is None:
        rec["status"] = "skipped"
        return rec
    rc, seconds, limit = rc_line.split()
    rec.update(rc=int(rc), seconds=float(seconds), limit_s=float(limit))
    if result is not None and name == "smoke":
        rec["status"], rec["problems"] = _smoke_status(result)
    elif result is not None:
        rec["status"], rec["problems"] = result.get("status", "failed"), result.get("problems", [])
    elif name == "wheels":
        rec["status"] = "ok" if rec["rc"] == 0 else "failed"
    else:
        rec["status"] = "timeout" if rec["rc"] in (124, 137) else "crashed"
    if rec["status"] == "ok" and rec["rc"] not in (0, None):
        rec["status"], rec["problems"] = "failed", [*rec["problems"], f"exit status {rec['rc']}"]
    return rec


def headline(rec: dict) -> str:
    """The row's figures: what the phase measured, in a few words."""
    r = rec.get("result") or {}
    if rec["status"] == "skipped":
        return rec.get("note") or ""
    if rec["name"] == "facts":
        t = r.get("torch") or {}
        return (f"torch {t.get('version')}, cuda {t.get('cuda_available')}, {t.get('name')} {t.get('capability')}, "
                f"python {r.get('python')}")
    if rec["name"] in ("children", "probes"):
        runs = {k: v for k, v in r.items() if isinstance(v, dict) and "final_score" in v}
        return "; ".join(f"{k} score {v['final_score']} audit {v['audit_passed']}" for k, v in runs.items())
    if rec["name"] == "smoke":
        o = ((r.get("parts") or {}).get("overhead") or {}).get("example") or {}
        if not o:
            return ""
        return f"example ratio {o['ratio_stream']:.3f} ({o['harness_tokens_per_s']:,.0f} vs bare {o['bare_tokens_per_s']:,.0f} tok/s)"
    if rec["name"] == "bigmodel":
        return "; ".join(f"{p} {r[p]['harness_tokens_per_s']:,.0f} vs bare {r[p]['bare_tokens_per_s']:,.0f} tok/s, "
                         f"ratio {r[p]['ratio_stream']:.3f}" for p in ("fp32", "bf16") if p in r)
    return rec.get("note") or ""


def summarize(work: Path, out: Path, dry_run: bool, device: str) -> int:
    """Write ``out/summary.json`` and print the table; 0 when every phase is ``ok``."""
    phases = [phase_record(work, name) for name in ORDER]
    asked = [p for p in phases if not (p["note"] or "").startswith(NOT_ASKED)]
    ok = bool(asked) and all(p["status"] == "ok" for p in asked)
    (out / "summary.json").write_text(json.dumps({"ok": ok, "dry_run": dry_run, "device": device, "phases": phases},
                                                 indent=1, default=str))
    print(f"\n== GPU session{' (dry run, cpu)' if dry_run else ''}: {'all phases ok' if ok else 'NOT all ok'}")
    print(f"{'phase':<10} {'status':<8} {'seconds':>8} {'limit':>6}  figures / problems")
    for p in phases:
        secs = "" if p["seconds"] is None else f"{p['seconds']:.0f}"
        lim = "" if p["limit_s"] is None else f"{p['limit_s']:.0f}"
        print(f"{p['name']:<10} {p['status']:<8} {secs:>8} {lim:>6}  {headline(p)[:150]}")
        for problem in p["problems"][:6]:
            print(f"{'':<36}! {' '.join(str(problem).split())[:200]}")
    return 0 if ok else 1


if __name__ == "__main__":  # python bench/session_summary.py WORK OUT DRY(0|1) DEVICE
    sys.exit(summarize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]))
