"""Isolation overhead: the same scored re-execution with ``--isolation strict`` and ``none``.

For each bundle (the ones of ``bench/overhead.py``) it runs ``evaluate`` alternately in both
modes and prints the medians of

* launch -> last scored batch (``timing.launch_to_last_record_s``): includes the sandbox's setup
  (namespaces, mounts, the uid drop: tens of milliseconds) and interpreter start;
* the steady stream (first -> last batch), where the sandbox has no per-batch cost: the feeder
  socket is a bind-mounted Unix socket, the same system calls as without a sandbox;

and the ratio strict / none of each, plus the bare-loop ratio of ``bench/overhead.py`` when asked
(``--bare``). The held-out evaluation runs after the stream and is timed apart (``heldout.wall_s``).

Usage: ``python bench/isolation_overhead.py [--repeats 3] [--example-tokens 100000] [--bare]``
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import overhead  # noqa: E402
from prism_challenge.evaluator.isolation import available_backend  # noqa: E402


def main() -> None:
    p = overhead.bench_arguments(__doc__.split("\n")[0])
    p.add_argument("--bare", action="store_true", help="also time the bare loop (bench/overhead.py) per bundle")
    a = p.parse_args()
    print(f"sandbox backend: {available_backend()}")
    for name, bundle, tokens, batch, seq_len, vocab, repeats in overhead.bench_cases(a):
        res: dict[str, list[dict]] = {"strict": [], "none": []}
        for _ in range(repeats):
            for mode in ("strict", "none"):
                res[mode].append(overhead.run_harness(bundle, tokens, seq_len, a.threads, mode, heldout_bytes=200_000))
        med = {m: {k: statistics.median(r[k] for r in rs) for k in ("total", "stream")} for m, rs in res.items()}
        assert res["strict"][0]["bpb"] == res["none"][0]["bpb"], "isolation changed the score"
        s, n = med["strict"], med["none"]
        print(f"== {name}: {tokens:,} tokens, {repeats} repeats (medians), {a.threads} threads")
        print(f"   launch->last batch: strict {s['total']:.3f} s, none {n['total']:.3f} s, ratio {s['total'] / n['total']:.3f}")
        print(f"   steady stream:      strict {s['stream']:.3f} s, none {n['stream']:.3f} s, ratio {s['stream'] / n['stream']:.3f}")
        hs = [r["heldout"] for r in res["strict"] if r["heldout"] is not None]
        if hs:
            print(f"   held-out evaluation (after the stream, strict): {statistics.median(hs):.3f} s")
        if a.bare:
            with tempfile.TemporaryDirectory() as d:
                npz = Path(d) / "batches.npz"
                overhead.cut_batches(bundle, tokens, batch, seq_len, npz)
                bare = statistics.median(overhead.run_bare(bundle, npz, vocab, seq_len, a.threads)["total"]
                                         for _ in range(repeats))
            print(f"   vs bare loop: strict time ratio {s['total'] / bare:.3f}, none time ratio {n['total'] / bare:.3f}")


if __name__ == "__main__":
    main()
