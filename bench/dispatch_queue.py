"""The store's side of dispatching at queue depths 1, 50 and 500 (no Ray, no evaluation).

For each depth: a fresh SQLite file with DEPTH pending submissions; then the time of one claim
(the oldest ready submission -> running, a new attempt and fencing token) and of one fenced
result write (``Store.record``: the run and the final state in one transaction), median over
the queue drained. Also the submit rate (``Store.submit`` alone, not the HTTP intake or its
gates). Prints milliseconds and the ratio of each depth to depth 1.
Usage: ``python bench/dispatch_queue.py [--depths 1,50,500] [--url-dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from prism_challenge.results import EvalResult, RunManifest
from prism_challenge.service.store import Store

SCORED = Path(__file__).resolve().parents[1] / "tests" / "data" / "scored_manifest.v2.json"


def _measure(depth: int, root: Path) -> dict:
    store = Store(f"sqlite:///{root / f'depth-{depth}.sqlite3'}")
    result = EvalResult(status="scored", kind=None, failure=None, run_dir=None, manifest_path=None,
                        manifest=RunManifest.model_validate(json.loads(SCORED.read_text())))
    t0 = time.perf_counter()
    for _ in range(depth):
        store.submit("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", "ab" * 32)
    submit_s = time.perf_counter() - t0
    claims, writes = [], []
    for _ in range(depth):
        t = time.perf_counter()
        claim = store.claim(worker="bench")
        claims.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.record(claim.token, result)
        writes.append(time.perf_counter() - t)
    store.close()
    return {"depth": depth, "submits_per_s": depth / submit_s, "claim_ms": 1e3 * statistics.median(claims),
            "record_ms": 1e3 * statistics.median(writes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="1,50,500")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [_measure(int(d), Path(tmp)) for d in args.depths.split(",")]
    base = rows[0]
    print(f"{'depth':>6} {'submit/s':>9} {'claim ms':>9} {'x':>5} {'record ms':>10} {'x':>5}")
    for r in rows:
        print(f"{r['depth']:>6} {r['submits_per_s']:>9.0f} {r['claim_ms']:>9.2f} {r['claim_ms'] / base['claim_ms']:>5.2f}"
              f" {r['record_ms']:>10.2f} {r['record_ms'] / base['record_ms']:>5.2f}")


if __name__ == "__main__":
    main()
