"""The store's side of dispatching at queue depths 1, 50 and 500 (no Ray, no evaluation), on
SQLite and on PostgreSQL (issue 18's benchmark).

For each backend and depth: a fresh SQLite file (a fresh PostgreSQL database when ``--postgres
URL`` or ``PRISM_TEST_POSTGRES_URL`` names a server whose role may create databases; else a
printed note) with DEPTH pending submissions; then the time of one claim
(the oldest ready submission -> running, a new attempt and fencing token) and of one fenced
result write (``Store.record``: the run and the final state in one transaction), median over
the queue drained. Also the submit rate (``Store.submit`` alone, not the HTTP intake or its
gates), and the claim at the head of the full queue (the first one, DEPTH rows pending). Prints
milliseconds and the ratio of each depth to depth 1. The dispatcher adds no wait of its own: an
accepted submission wakes it (``Dispatcher.wake``), so dispatch latency on an idle service is
one claim plus the Ray actor's creation (``bench/service_e2e.py``).
Usage: ``python bench/dispatch_queue.py [--depths 1,50,500] [--postgres URL]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prism_challenge.manifest.results import EvalResult, RunManifest
from prism_challenge.service.store import Store

ROOT = Path(__file__).resolve().parents[1]
SCORED = ROOT / "tests" / "data" / "scored_manifest.v2.json"
sys.path.insert(0, str(ROOT / "tests"))
from databases import POSTGRES_ENV, fresh_postgres  # noqa: E402 - the tests' fresh-database helper


def _measure(depth: int, url: str) -> dict:
    store = Store(url)
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
            "record_ms": 1e3 * statistics.median(writes), "head_ms": 1e3 * claims[0]}


def _table(name: str, rows: list[dict]) -> None:
    base = rows[0]
    print(f"-- {name}")
    print(f"{'depth':>6} {'submit/s':>9} {'claim ms':>9} {'x':>5} {'head ms':>8} {'record ms':>10} {'x':>5}")
    for r in rows:
        print(f"{r['depth']:>6} {r['submits_per_s']:>9.0f} {r['claim_ms']:>9.2f} {r['claim_ms'] / base['claim_ms']:>5.2f}"
              f" {r['head_ms']:>8.2f} {r['record_ms']:>10.2f} {r['record_ms'] / base['record_ms']:>5.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="1,50,500")
    p.add_argument("--postgres", default=os.environ.get(POSTGRES_ENV),
                   help=f"a PostgreSQL admin URL (default ${POSTGRES_ENV})")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        _table("sqlite", [_measure(d, f"sqlite:///{Path(tmp) / f'depth-{d}.sqlite3'}") for d in depths])
    if not args.postgres:
        print(f"-- postgresql: skipped (no --postgres URL, no ${POSTGRES_ENV})")
        return
    rows = []
    for d in depths:
        with contextlib.ExitStack() as stack:
            rows.append(_measure(d, stack.enter_context(fresh_postgres(args.postgres))))
    _table("postgresql", rows)


if __name__ == "__main__":
    main()
