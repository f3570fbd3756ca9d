"""The audit's cost: its share of a scored run's time, and the per-batch round trip it adds.

* **share**: ``prism eval`` on the example (``examples/tiny-1m``, CPU) at 20k and 200k tokens;
  printed: the run's wall time, the audit's (``audit.wall_s``: the re-scoring and blind-probe
  children, side by side), its share, and the audited batches. Goal (issue 15): at most 10 % at
  200k tokens. With ``--baseline`` each size also runs with ``audited_batches=0``, and the stream
  times are compared (the snapshots rank 0 sends and the feeder writes, and the answers).
* **round trip**: the time a rank waits, after sending a record, for the feeder's answer
  (audited or not) before its loop may train: a client process against an in-process feeder,
  1000 batches of 8 x 1024 tokens, median and 90th percentile in microseconds.

How the share scales: the audit costs two process starts (interpreter, ``import torch``, the
bundle; a few seconds, constant) plus, per audited batch, one build and load of the model and
one scoring forward in each child (the two children run at once). The stream costs per batch one
scoring forward and the loop's training step. So at ``N`` batches the share falls as
``(start + A * forward) / (N * step)``: linear in ``A``, inversely in ``N``; model size scales
both the forward and the step, so it leaves the share nearly unchanged (a larger model makes
the constant start matter less). Snapshots add ``A * 4 * parameters`` bytes sent and written.

Usage: ``python bench/audit_cost.py [--sizes 20000,200000] [--baseline] [--isolation none]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-1m"


def share(tokens: int, isolation: str, audited: int | None) -> dict:
    """One scored run of the example: wall, stream and audit seconds."""
    from prism_challenge.pipeline import EvalOptions, evaluate

    with tempfile.TemporaryDirectory() as tmp:
        kw = {} if audited is None else {"audited_batches": audited}
        out = evaluate(EvalOptions(bundle=str(EXAMPLE), token_budget=tokens, device="cpu", isolation=isolation,
                                   out_dir=str(Path(tmp) / "run"), **kw))
        if out.failure is not None:
            raise SystemExit(f"the run failed: {out.failure}")
        m = out.manifest
        audit = m.get("audit") or {}
        return {"wall": m["timing"]["wall_s"], "stream": m["timing"]["release_to_last_record_s"],
                "audit": audit.get("wall_s", 0.0), "audited": len(audit.get("batches", [])),
                "batches": m["stream"]["batches"], "passed": audit.get("passed")}


def client(path: str, token: str, n: int) -> None:
    """The rank's side of the round trip (run in a child process)."""
    from prism_challenge.evaluator import protocol
    from prism_challenge.evaluator.protocol import Kind

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    protocol.send(sock, Kind.HELLO, {"rank": 0, "local_rank": 0, "world_size": 1, "pid": os.getpid(), "token": token})
    reader = protocol.FrameReader(sock)
    reader.recv(0)
    request = {"batch_size": 8, "seq_len": 1024}
    protocol.send(sock, Kind.NEXT, request)
    waits = []
    for step in range(n):
        kind, _, _ = reader.recv(1 << 24)
        if kind != Kind.BATCH:
            break
        t0 = time.perf_counter()
        protocol.send_small(sock, (Kind.RECORD, {"step": step, "nats": 1.0}), (Kind.NEXT, request))
        kind, header = reader.recv_exact()
        waits.append(time.perf_counter() - t0)
        if header.get("audit"):
            protocol.send(sock, Kind.SNAPSHOT_END, {"step": step, "tensors": 0})
    protocol.send(sock, Kind.DONE, {})
    us = sorted(w * 1e6 for w in waits[50:])
    print(f"round trip (record sent -> answer read), {len(us)} batches: median {statistics.median(us):.0f} us, "
          f"p90 {us[int(0.9 * len(us))]:.0f} us")


def round_trip(n: int = 1000) -> None:
    """An in-process feeder serving ``n`` batches to a client process; the client prints."""
    from prism_challenge.data.stream import TokenChunk
    from prism_challenge.evaluator.feeder import Feeder

    ids = np.random.default_rng(0).integers(0, 257, 8 * 1023 * (n + 2) + 1)
    chunks = iter([TokenChunk(ids, np.ones_like(ids))])
    with tempfile.TemporaryDirectory() as tmp:
        f = Feeder(str(Path(tmp) / "f.sock"), chunks, {"seed": 1}, vocab_size=257, audit_dir=Path(tmp) / "a",
                   step_budget=n, probe_key=b"k" * 32, stream_bytes=len(ids))
        f.start()
        subprocess.run([sys.executable, __file__, "--client", f.socket_path, f.token, str(n)], check=True)
        f.finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="20000,200000")
    p.add_argument("--baseline", action="store_true", help="also run each size without the audit")
    p.add_argument("--isolation", default="strict", choices=("strict", "none"))
    p.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client(args.client[0], args.client[1], int(args.client[2]))
        return
    round_trip()
    for tokens in (int(s) for s in args.sizes.split(",")):
        r = share(tokens, args.isolation, None)
        line = (f"example, {tokens} tokens: run {r['wall']:.1f} s, audit {r['audit']:.1f} s = "
                f"{100 * r['audit'] / r['wall']:.1f} % of the run ({r['audited']} of {r['batches']} batches audited, "
                f"passed {r['passed']})")
        if args.baseline:
            b = share(tokens, args.isolation, 0)
            line += f"; stream {r['stream']:.1f} s vs {b['stream']:.1f} s unaudited ({r['stream'] / b['stream']:.3f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
