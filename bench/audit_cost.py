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

Usage: ``python bench/audit_cost.py [--sizes 20000,200000] [--baseline] [--isolation none]``.
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
    from prism_challenge.bundle import load_bundle
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="20000,200000")
    p.add_argument("--baseline", action="store_true", help="also run each size without the audit")
    p.add_argument("--isolation", default="strict", choices=("strict", "none"))
    p.add_argument("--copy-cost", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
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
