"""The audit's cost: its share of a scored run's time, and what it adds to every batch.

* **share**: ``prism eval`` on the example (``examples/tiny-1m``, CPU) at 20k and 200k tokens;
  printed: the run's wall time, the audit's (``audit.wall_s``, the whole stage: the probes' text
  tokenized, the re-scoring child, then the blind-probe child, one after the other on an emptied
  folder, and the inputs written for ``prism verify``), its share, the schedule, and the audited
  batches: actual, expected, and re-derived from the manifest's ``run_secret``. Goal (issues 15
  and 25): at most 10 % at 200k tokens. With ``--baseline`` each size also runs
  with ``audited_batches=0``: the headline is then the whole command's wall time against the
  unaudited run's, with the stream times beside it (the snapshots rank 0 sends and the feeder
  writes, and the answers).
* **per batch**: rank 0 copies the scored module's ``state_dict`` before every scoring forward
  (the audit's snapshot, kept until the feeder's answer); printed: the copy's median time on the
  example's model. The answer is a frame of its own, read before the loop gets the batch: one
  round trip per batch (red team, issue 25: riding on the next batch's frame, a loop that stalled
  after its last batch kept that snapshot from the audit). Measured against a client process on
  this 2-core machine: 204 us median, 410 us p90 per batch in an earlier measurement; 74 us more
  than the pipelined record in the red team's (400 batches, a fake rank, tests running beside).

How the share scales: the audit costs about 5 s whatever ``A`` (the first child's start, which only
the tokenizing of the probes' text overlaps: interpreter, ``import torch``, the bundle, about 3 s
on 2 cores; the blind probe child starts as a spare while the re-scoring child works,
``Jail.warm``; each child's reading of its snapshots; the inputs written for ``prism verify``),
plus per audited batch one build and load of the model and one forward in each child and the
instrument's scoring in the re-scoring child (the example: about 0.35 s re-scoring, 0.3 s per
blind pass; ``auditplan``'s docstring derives ``A = 4`` with one pass from these). The stream
costs per batch one scoring forward and the loop's training step (the example: about 1 s). The
schedule is harmonic (batch 0, then batch ``k`` with probability ``min(1, A / k)``), so a run of
``N`` batches audits ``E(N) = 1 + sum_{k<N} min(1, A / k) ~ A (1 + ln(N / A))`` batches on average
(20.1 at ``N = 197``, ``A = 4``); the share is ``(5 s + E(N) * (2 forward + scoring)) / (N *
step)``: it falls as ``ln(N) / N`` with the run's length; model size scales both the
forward and the step, so it leaves the share nearly unchanged (a larger model makes the constant
part matter less; one whose backward dominates its step makes the share smaller). Snapshots add
``A * 4 * parameters`` bytes sent and written.

* **at scale** (``--params 100M``): ``bench/bundles/gpt100m`` (99.6M parameters, 381 MiB of
  state, bytes, 2 rows of 128 tokens a batch: a few seconds a step on 2 CPU cores), a few batches
  (``--tokens``, default 3,000: 12 batches, about 9 audited), each run in a fresh process, with
  and without the audit. Printed per run: the whole command's wall time, the stream's, the audit
  stage's (``audit.wall_s``), the snapshots' bytes on disk, the parent's peak RSS, and **the
  snapshot's cost on the rank's critical path**: the time between the records of batches ``j``
  and ``j + 1`` after an audited batch ``j``, less the median of that time after unaudited
  batches (the feeder's record times, :class:`~prism_challenge.control.BatchScored` events: what
  the snapshot made the loop wait, measured from outside, so the same code measures a tree from
  before the change: ``PYTHONPATH=<old src>``).

Usage: ``python bench/audit_cost.py [--sizes 20000,200000] [--baseline] [--isolation none]``,
``python bench/audit_cost.py --params 100M [--tokens 3000] [--baseline] [--isolation none]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-1m"
SCALE_BUNDLES = {"100M": ROOT / "bench" / "bundles" / "gpt100m"}


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
                "batches": m["stream"]["batches"], "passed": audit.get("passed"),
                "schedule": audit.get("schedule"), "secret": m.get("run_secret")}


def copy_cost(repeats: int = 50) -> None:
    """What rank 0 adds to every batch: the copy of the scored module's ``state_dict`` before the
    scoring forward (:meth:`prism_challenge.evaluator.runner.Runtime._state_before`), on the
    example's model, in a child process with the ranks' compute environment (threads, malloc
    thresholds: a rank reuses the copy's heap memory batch after batch)."""
    from prism_challenge.evaluator.launcher import compute_env

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        subprocess.run([sys.executable, __file__, "--copy-cost"], env={**os.environ, **compute_env(2)}, check=True)
        return
    from prism_challenge.intake.bundle import load_bundle
    from prism_challenge.evaluator.interface import PrismContext
    from prism_challenge.tokenizers import reference_tokenizer

    sys.path.insert(0, str(EXAMPLE))
    import architecture

    vocab = reference_tokenizer(load_bundle(EXAMPLE).tokenizer).vocab_size
    model = architecture.build_model(PrismContext(seed=1, vocab_size=vocab, sequence_length=256,
                                                  max_parameters=10**9))
    state = model.state_dict()
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy = {k: v.detach().clone() for k, v in state.items()}
        times.append(time.perf_counter() - t0)
        del copy
    print(f"rank 0's copy of the example's state_dict before each batch ({nbytes / 2**20:.1f} MiB): "
          f"median {statistics.median(times) * 1e3:.2f} ms")


def scale_run(bundle: Path, tokens: int, isolation: str, audited: int | None) -> dict:
    """One scored run of ``bundle`` in this process (call it in a fresh one): the manifest's
    times, each record's arrival (``time.monotonic``), the snapshots' bytes and the peak RSS."""
    import resource

    import threading

    from prism_challenge.control import RunControl
    from prism_challenge.events import BatchScored, StageStarted
    from prism_challenge.pipeline import EvalOptions, evaluate

    arrivals: list[float] = []
    stage = {"now": "start"}
    peaks: dict[str, int] = {}
    done = threading.Event()

    def seen(event) -> None:
        if isinstance(event, BatchScored):
            arrivals.append(time.monotonic())
        elif isinstance(event, StageStarted):
            stage["now"] = event.stage

    def sample() -> None:  # the parent's resident memory by stage, every 50 ms
        while not done.wait(0.05):
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            peaks[stage["now"]] = max(peaks.get(stage["now"], 0), rss)

    threading.Thread(target=sample, daemon=True).start()

    with tempfile.TemporaryDirectory() as tmp:
        kw = {} if audited is None else {"audited_batches": audited}
        out = evaluate(EvalOptions(bundle=str(bundle), token_budget=tokens, device="cpu", isolation=isolation,
                                   heldout_bytes=2_000, out_dir=str(Path(tmp) / "run"), **kw),
                       RunControl(on_progress=seen))
        done.set()
        if out.failure is not None:
            raise SystemExit(f"the run failed: {out.failure}")
        m = out.manifest
        audit = m.get("audit") or {}
        snaps = [p for p in (out.run_dir / "model" / "audit").glob("step-*") if p.suffix != ".npz"]
        return {"wall": m["timing"]["wall_s"], "stream": m["timing"]["release_to_last_record_s"],
                "audit": audit.get("wall_s", 0.0), "audited": [b["step"] for b in audit.get("batches", [])],
                "passed": audit.get("passed"), "error": audit.get("error"), "arrivals": arrivals,
                "disk": sum(p.stat().st_size for p in snaps), "files": len(snaps),
                "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peaks": peaks}


def critical_path(arrivals: list[float], audited: list[int]) -> tuple[float, float, list[float]]:
    """(median gap between records after an unaudited batch, median extra after an audited one,
    each extra): gap ``j`` = arrival of record ``j + 1`` less that of record ``j`` (the loop's
    step on batch ``j`` plus the harness's work until batch ``j + 1`` is scored); extra ``j`` =
    gap ``j`` less the unaudited median, for each audited ``j`` with a next record. Batch 0's
    gap is left out of both (the first step pays one-off costs: allocator, optimizer state)."""
    gaps = {j: arrivals[j + 1] - arrivals[j] for j in range(1, len(arrivals) - 1)}
    plain = [g for j, g in gaps.items() if j not in audited]
    base = statistics.median(plain) if plain else float("nan")
    extra = [gaps[j] - base for j in audited if j in gaps]
    return base, (statistics.median(extra) if extra else float("nan")), extra


def pipeline_cost(params: str) -> None:
    """The trusted side's work on one snapshot of the ``params`` bundle's model, alone, in this
    process (no socket, no run beside it): the frames as the feeder gets them, then (before
    issue 26) each rebuilt into a tensor (``statedict.rebuild``: two copies), ``torch.save`` of
    the whole state and a second pass to hash the file, on the reader's thread while the rank
    waited; (now) each frame written and hashed as it arrives (``SnapshotStore``). Also the
    sha256 and write throughputs the projection uses."""
    import hashlib

    import torch

    from prism_challenge.evaluator.snapshots import AuditedStep, SnapshotStore, file_sha256
    from prism_challenge.evaluator.statedict import frames, rebuild

    sys.path.insert(0, str(SCALE_BUNDLES[params]))
    import architecture

    state = {k: v.detach().clone() for k, v in architecture.build_model(
        type("Ctx", (), {"vocab_size": 257})).state_dict().items()}
    wire = [(head, bytearray(payload)) for head, payload in frames(state)]  # as FrameReader hands them over
    nbytes = sum(len(p) for _, p in wire)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        rebuilt = dict(rebuild(head, payload) for head, payload in wire)
        torch.save(rebuilt, Path(tmp) / "old.pt")
        file_sha256(Path(tmp) / "old.pt")
        old = time.perf_counter() - t0
        del rebuilt
        store = SnapshotStore(Path(tmp), 1 << 40)
        t0 = time.perf_counter()
        store.expect(0)
        for head, payload in wire:
            store.add({**head, "step": 0}, payload)
        store.end({"step": 0, "tensors": len(wire)}, AuditedStep(0))
        new = time.perf_counter() - t0
        block = bytes(64 << 20)
        t0 = time.perf_counter()
        h = hashlib.sha256()
        for _ in range(8):
            h.update(block)
        sha = 512 / (time.perf_counter() - t0)
    print(f"{params}: one snapshot, {nbytes / 2**20:.0f} MiB, on the trusted side: before (rebuild, torch.save, "
          f"hash the file) {old:.2f} s; now (written and hashed as the frames arrive) {new:.2f} s; "
          f"sha256 {sha:.0f} MiB/s", flush=True)


def scale(params: str, tokens: int, isolation: str, baseline: bool, audited_batches: int | None) -> None:
    """``--params``: the runs at scale, each in a fresh process (its own peak RSS), printed."""
    import json

    pipeline_cost(params)
    bundle = SCALE_BUNDLES[params]
    for audited in ([audited_batches, 0] if baseline else [audited_batches]):
        cmd = [sys.executable, __file__, "--scale-child", str(bundle), str(tokens), isolation, str(audited)]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        base, extra, each = critical_path(r["arrivals"], r["audited"])
        label = "unaudited" if audited == 0 else f"audited (A = {audited or 'default'})"
        print(f"{params} ({bundle.name}), {tokens} tokens, {label}: whole command {r['wall']:.1f} s, stream "
              f"{r['stream']:.1f} s ({len(r['arrivals'])} batches, median gap {base:.2f} s), audit stage "
              f"{r['audit']:.1f} s ({len(r['audited'])} audited, passed {r['passed']}"
              f"{', ' + r['error'] if r['error'] else ''}), "
              f"snapshots on disk {r['disk'] / 2**20:.0f} MiB in {r['files']} files, parent peak RSS "
              f"{r['rss'] / 2**20:.0f} MiB (by stage: "
              f"{', '.join(f'{k} {v / 2**20:.0f}' for k, v in r.get('peaks', {}).items())})", flush=True)
        if audited != 0:
            print(f"  snapshot on the rank's critical path: median {extra:+.2f} s per audited batch "
                  f"(each: {', '.join(f'{e:+.2f}' for e in each)})", flush=True)


def rank_wait(state_mib: int, step_s: float, batches: int, audited: int) -> dict:
    """The rank's wait in ``next()`` with a loop whose step leaves the host's CPU free (a GPU
    step, emulated by ``time.sleep(step_s)``): the real feeder (snapshots to a temporary audit
    folder) and the real runner's stream in this process, a model whose ``state_dict`` holds
    ``state_mib`` MiB (a cheap forward beside a buffer). Returns each ``next()``'s seconds and the
    audited batches. Runs against whichever tree ``PYTHONPATH`` names (before or after)."""
    import socket
    import threading

    import numpy as np
    import torch
    from torch import nn

    from prism_challenge.data.stream import TokenChunk
    from prism_challenge.evaluator import protocol
    from prism_challenge.evaluator.auditplan import drawn_steps
    from prism_challenge.evaluator.feeder import Feeder
    from prism_challenge.evaluator.protocol import Kind
    from prism_challenge.evaluator.runner import Runtime

    class Ballast(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(257, 8), nn.Linear(8, 257)
            self.register_buffer("ballast", torch.ones(state_mib << 18))

        def forward(self, x):
            return self.head(self.emb(x))

    ids = np.random.default_rng(0).integers(0, 257, batches * 127 + 1).astype(np.int64)
    key = b"b" * 32
    with tempfile.TemporaryDirectory() as tmp:
        config = {"vocab_size": 257, "seed": 1, "tokenizer": "bytes", "device": "cpu", "audit": True,
                  "max_parameters": 10**10, "sequence_length": 128}
        f = Feeder(str(Path(tmp) / "f.sock"), iter([TokenChunk(ids, np.ones_like(ids))]), config, vocab_size=257,
                   audit_dir=Path(tmp) / "audit", probe_key=key, audited_batches=audited,
                   max_state_bytes=(state_mib + 64) << 21)
        f.start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(f.socket_path)
        protocol.send(sock, Kind.HELLO, {"rank": 0, "local_rank": 0, "world_size": 1, "pid": os.getpid(),
                                         "token": f.token})
        reader = protocol.FrameReader(sock)
        kind, cfg, _ = reader.recv(0)
        runtime = Runtime(reader, cfg, 0)
        model = Ballast()
        stream = runtime._stream(model, 1, 128)
        waits = []
        while True:
            t0 = time.perf_counter()
            batch = next(stream, None)
            waits.append(time.perf_counter() - t0)
            if batch is None:
                break
            time.sleep(step_s)
        protocol.send(sock, Kind.DONE, {})
        threading.Event().wait(0.5)
        f.finish()
        return {"waits": waits, "audited": drawn_steps(key, len(waits) - 1, audited)}


def rank_wait_report(label: str, r: dict, step_s: float) -> None:
    """Print :func:`rank_wait`'s figures: the median wait after an unaudited batch, and the extra
    wait per audited batch (every ``next()``'s wait less that median, summed, over the count)."""
    waits, audited = r["waits"], set(r["audited"])
    plain = [w for j, w in enumerate(waits[1:-1], start=1) if j not in audited and j - 1 not in audited]
    base = statistics.median(plain) if plain else 0.0
    extra = sum(w - base for w in waits[1:-1]) / max(1, len(audited & set(range(1, len(waits) - 1))))
    print(f"{label}: a {step_s:.1f} s step that leaves the CPU free, {len(waits) - 1} batches, "
          f"{len(audited)} audited: next() waits {base * 1e3:.0f} ms after unaudited batches, "
          f"{extra:+.2f} s per audited batch on the rank's critical path", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--rank-wait-child"]:
        import json

        mib, step, n, a = sys.argv[2:6]
        print(json.dumps(rank_wait(int(mib), float(step), int(n), int(a))))
        return
    if sys.argv[1:2] == ["--scale-child"]:
        import json

        bundle, tokens, isolation, audited = sys.argv[2:6]
        r = scale_run(Path(bundle), int(tokens), isolation, None if audited == "None" else int(audited))
        print(json.dumps(r))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", choices=sorted(SCALE_BUNDLES), help="the audit at scale (see the docstring)")
    p.add_argument("--tokens", type=int, default=3_000, help="--params: the token budget")
    p.add_argument("--rank-wait", metavar="OLD_SRC", help="the rank's wait per audited batch with a step that "
                   "leaves the CPU free, this tree against the src folder OLD_SRC (a tree from before)")
    p.add_argument("--step", type=float, default=2.0, help="--rank-wait: the step's seconds")
    p.add_argument("--audited", type=int, default=None, help="--params: the schedule's A (default: the harness's)")
    p.add_argument("--sizes", default="20000,200000")
    p.add_argument("--baseline", action="store_true", help="also run each size without the audit")
    p.add_argument("--isolation", default="strict", choices=("strict", "none"))
    p.add_argument("--copy-cost", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_wait:
        import json

        here = str(ROOT / "src")
        for label, src in (("before", args.rank_wait), ("now", here)):
            cmd = [sys.executable, __file__, "--rank-wait-child", "381", str(args.step), "12", "4"]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": src}).stdout
            rank_wait_report(f"{label}, 381 MiB of state", json.loads(out.strip().splitlines()[-1]), args.step)
        return
    if args.params:
        scale(args.params, args.tokens, args.isolation, args.baseline, args.audited)
        return
    copy_cost()
    if args.copy_cost:
        return
    from prism_challenge.evaluator.auditplan import AUDITED_BATCHES, drawn_steps, expected_audits

    print(f"schedule: harmonic, A = {AUDITED_BATCHES} (batch 0, then batch k with probability min(1, A/k))")
    for tokens in (int(s) for s in args.sizes.split(",") if s):
        r = share(tokens, args.isolation, None)
        a = (r["schedule"] or {}).get("audited_batches", AUDITED_BATCHES)
        rederived = len(drawn_steps(bytes.fromhex(r["secret"]), r["batches"], a)) if r["secret"] else None
        line = (f"example, {tokens} tokens: run {r['wall']:.1f} s, audit {r['audit']:.1f} s = "
                f"{100 * r['audit'] / r['wall']:.1f} % of the run ({r['audited']} of {r['batches']} batches audited, "
                f"expected E({r['batches']}) = {expected_audits(r['batches'], a):.1f}, re-derived from run_secret "
                f"{rederived}; passed {r['passed']})")
        if args.baseline:
            b = share(tokens, args.isolation, 0)
            line += (f"; whole run {r['wall']:.1f} s vs {b['wall']:.1f} s unaudited ({r['wall'] / b['wall']:.3f}x), "
                     f"stream {r['stream']:.1f} s vs {b['stream']:.1f} s ({r['stream'] / b['stream']:.3f}x)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
