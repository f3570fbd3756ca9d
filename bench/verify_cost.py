"""What ``prism verify`` costs against the run it verifies, with and without ``--reexecute``.

``prism eval`` of the example (``examples/tiny-1m``, CPU, one thread) at ``--tokens`` tokens into
a temporary directory (signed by a throwaway user key: ``XDG_CONFIG_HOME`` points there), then
``prism verify --json`` on it, then ``prism verify --reexecute --json``; printed: the run's wall
time, each verify's wall time and its ratio to the run's, and each stage's seconds (the
certificate, hashes, score, verdict and draws stages are the manifest's arithmetic: milliseconds;
the re-scoring's children and the re-execution are the cost). Two re-executions' bpb are
printed beside the run's (they must be equal to the last bit).

Usage: ``python bench/verify_cost.py [--tokens 20000] [--isolation strict|none]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prism(*args: str, env: dict[str, str]) -> tuple[float, dict]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "prism_challenge.cli", *args], capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    try:
        return wall, json.loads(p.stdout)
    except (ValueError, IndexError):
        sys.exit(f"prism {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--isolation", choices=("strict", "none"), default="strict")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prism-verify-cost-") as tmp:
        env = {**os.environ, "XDG_CONFIG_HOME": str(Path(tmp) / "config"),
               "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")] if p)}
        run = Path(tmp) / "run"
        t_run, summary = prism("eval", str(ROOT / "examples" / "tiny-1m"), "--out", str(run), "--device", "cpu",
                               "--threads", "1", "--token-budget", str(args.tokens), "--isolation", args.isolation,
                               "--json", env=env)
        bpb = json.loads((run / "prism_run_manifest.v2.json").read_text())["score"]["prequential_bpb"]
        print(f"run: {args.tokens} tokens, {t_run:.1f} s, {bpb!r} bpb")
        for label, extra in (("verify", []), ("verify --reexecute", ["--reexecute"]),
                             ("verify --reexecute (again)", ["--reexecute"])):
            wall, out = prism("verify", str(run), "--json", "--isolation", args.isolation, *extra, env=env)
            if not out.get("verified"):
                sys.exit(f"{label}: {out}")
            stages = ", ".join(f"{k} {v:.2f} s" for k, v in out["seconds"].items())
            again = out.get("reexecuted")
            print(f"{label}: {wall:.1f} s = {wall / t_run:.2f} x the run ({stages})"
                  + (f"; re-executed bpb {again['prequential_bpb']!r}" if again else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
