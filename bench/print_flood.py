"""The parent's peak memory while a bundle prints gigabytes (issue 27: bounded output).

The example (``examples/tiny-1m``) with ``build_model`` and ``train`` each printing ``--gb`` GiB
(1 MiB lines) on stdout, so every child that runs submitted code floods its pipe: the parameter
child, the ranks (``build_model`` then ``train``), the re-scoring and blind-probe children and
the held-out children. Two measures, each in a fresh interpreter:

* ``check``: the parameter child alone, as ``prism check`` runs it (strict jail);
* ``eval``: ``prism eval`` on CPU (4k tokens, 10 kB held out), audit and held-out included.

Printed per measure: the parent's peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``), the bytes the
children printed (counted by the drains), and the ratio of the two. Goal: under 1 GiB whatever
is printed; before the bounded drains, ``communicate()`` held about 2 bytes per byte printed.

    python bench/print_flood.py [--gb 3] [--only check|eval]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-1m"
MB = 1 << 20

CHILD = r"""
import json, resource, shutil, sys, tempfile
from pathlib import Path
from prism_challenge.evaluator import jail as J

how, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
printed = []
finish = J.Jail.finish
def counting(self, started, **kw):
    done = finish(self, started, **kw)
    printed.append(len(done.stdout) + done.stdout_dropped + len(done.stderr) + done.stderr_dropped)
    return done
J.Jail.finish = counting
if how == "check":
    from prism_challenge.gates.param_parent import measure_parameters
    got = measure_parameters(root, "architecture", "build_model", vocab_size=50257, seq_len=256,
                             max_parameters=10**9, timeout_s=3600)
    ok, runlog = got.count is not None, 0
else:
    from prism_challenge.pipeline import EvalOptions, evaluate
    o = evaluate(EvalOptions(bundle=str(root), out_dir=str(out), device="cpu", threads=1, token_budget=4000,
                             heldout_bytes=10000, idle_timeout=3600))
    log = (out / "logs" / "runner.log").read_bytes()
    ok, runlog = o.failure is None, len(log)
    at = log.find(b"; the child printed ")  # the ranks' total, from the log's note (outputcap.gap_note)
    if at >= 0:
        printed.append(int(log[at:].split(b" ")[4].replace(b",", b"")))
print(json.dumps({"ok": ok, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "children": len(printed), "printed_bytes": sum(printed), "runner_log_bytes": runlog}))
"""


def flood_bundle(root: Path, gb: float) -> Path:
    """The example with ``build_model`` and ``train`` each printing ``gb`` GiB first."""
    shutil.copytree(EXAMPLE, root)
    lines = int(gb * 1024)
    for name, fn in (("architecture.py", "build_model"), ("training.py", "train")):
        src = (EXAMPLE / name).read_text()
        src += (f"\n\n_example_{fn} = {fn}\n\n\ndef {fn}(ctx):\n    for _ in range({lines}):\n"
                f"        print('x' * {MB - 1})\n    return _example_{fn}(ctx)\n")
        (root / name).write_text(src)
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0, help="GiB printed by build_model and by train, each")
    ap.add_argument("--only", choices=("check", "eval"), default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prism-bench-flood-") as tmp:
        root = flood_bundle(Path(tmp) / "bundle", args.gb)
        for how in ("check", "eval") if args.only is None else (args.only,):
            run = subprocess.run([sys.executable, "-c", CHILD, how, str(root), str(Path(tmp) / f"run-{how}")],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{how}: failed\n{run.stderr[-3000:]}")
                return 1
            got = json.loads(run.stdout.strip().splitlines()[-1])
            peak, printed = got["peak_rss_bytes"], got["printed_bytes"]
            print(f"{how}: ok={got['ok']} parent peak RSS {peak / MB:,.0f} MiB; the {got['children']} "
                  f"children (the ranks' tree counts as one) printed {printed / MB:,.0f} MiB "
                  f"(ratio {peak / max(printed, 1):.3f}); "
                  f"runner.log {got['runner_log_bytes'] / MB:,.1f} MiB; under 1 GiB: {peak < 1 << 30}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
