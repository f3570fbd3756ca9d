"""GPU smoke bench: what a session lent a GPU host runs in one call of at most 8 minutes.

Three parts, each through the real ``prism eval`` (strict isolation, one rank), printing tokens
per second and, for the third, the ratios against the bare loop:

1. **example**: ``examples/tiny-1m`` at ``--nproc 1`` on the device under strict isolation: it
   must score; prints the GPU stack the sandbox saw (the manifest's ``compute.gpu``), the peak
   allocated and reserved device memory, and tokens per second over the stream;
2. **bf16**: ``bench/bundles/bf16``, a small GPT whose forward and training step run under
   ``torch.autocast(device, bfloat16)``, with the held-out stage on: it must pass every probe
   (the stream's causality probes: else the run fails at stage ``contract``; the held-out blind
   probe: else the ``heldout_contract`` flag zeroes it);
3. **overhead**: ``bench/overhead.py``'s two bundles (the example and ``bench/bundles/trivial``)
   against the bare loop (``bench/bare_loop.py``) on the same device: tokens per second of both
   and the ratios (whole command -> last batch, and the steady stream).

Exit status 0 when every part passed, 1 otherwise; a part that would start past ``--deadline``
seconds is skipped and said so. On a machine without CUDA, ``--device cpu --quick`` runs the
same parts with small budgets (a few minutes on 2 cores), so the script is checked end to end
where no GPU is. Usage: ``python bench/gpu_smoke.py [--device cuda] [--quick] [--deadline 450]
[--only example|bf16|overhead]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import cut_batches, run_bare, run_harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-1m"
BF16 = ROOT / "bench" / "bundles" / "bf16"
TRIVIAL = ROOT / "bench" / "bundles" / "trivial"
# (full, quick) budgets: quick is the CPU check of the script itself
SIZES = {
    "example_tokens": (200_000, 4_096), "bf16_tokens": (163_840, 640), "bf16_heldout": (200_000, 20_000),
    "overhead_example": (100_000, 4_096), "overhead_trivial": (1_000_000, 65_536), "repeats": (2, 1),
    "seq_len": (256, 64),
}


def prism_eval(bundle: Path, device: str, *, tokens: int, seq_len: int, heldout_bytes: int, threads: int) -> dict:
    """One ``prism eval`` (strict isolation, one rank) in its own process; its manifest, with
    ``_wall_s`` (the command's whole time) and ``_output`` (its last lines) added."""
    with tempfile.TemporaryDirectory(prefix="prism-smoke-") as d:
        out = Path(d) / "run"
        cmd = [sys.executable, "-m", "prism_challenge.cli", "eval", str(bundle), "--device", device, "--nproc", "1",
               "--isolation", "strict", "--token-budget", str(tokens), "--seq-len", str(seq_len), "--threads",
               str(threads), "--heldout-bytes", str(heldout_bytes), "--quiet", "--out", str(out)]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        try:
            manifest = json.loads((out / "prism_run_manifest.v2.json").read_text())
        except OSError:
            manifest = {"status": "failed", "failure": {"stage": "none", "message": "no manifest"}}
        manifest["_wall_s"] = time.time() - t0
        manifest["_output"] = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        return manifest


def stream_rate(m: dict) -> float | None:
    """Tokens per second over the scored stream (first batch -> last record)."""
    t = m.get("timing") or {}
    first, last = t.get("launch_to_first_batch_s"), t.get("launch_to_last_record_s")
    tokens = (m.get("stream") or {}).get("tokens")
    return tokens / (last - first) if tokens and first is not None and last and last > first else None


def failure_line(m: dict) -> str:
    f = m.get("failure") or {}
    return f"FAILED at stage {f.get('stage')}: {f.get('message')}\n{m.get('_output', '')}"


def part_example(a: argparse.Namespace, size) -> bool:
    m = prism_eval(EXAMPLE, a.device, tokens=size("example_tokens"), seq_len=size("seq_len"), heldout_bytes=0,
                   threads=a.threads)
    if m.get("status") != "scored":
        print(f"[example] {failure_line(m)}")
        return False
    g = (m.get("compute") or {}).get("gpu") or {}
    print(f"[example] scored: prequential_bpb {m['score']['prequential_bpb']:.4f}, {m['stream']['tokens']:,} tokens, "
          f"{stream_rate(m) or 0:,.0f} tokens/s over the stream, command {m['_wall_s']:.1f} s, "
          f"isolation {m['isolation']['mode']} ({m['isolation']['backend']}), uid {m['isolation']['uid']}")
    print(f"[example] gpu stack: {json.dumps({k: v for k, v in g.items() if not k.startswith('peak')})}")
    print(f"[example] peak device bytes: allocated {g.get('peak_allocated_bytes')}, reserved {g.get('peak_reserved_bytes')}")
    return True


def part_bf16(a: argparse.Namespace, size) -> bool:
    m = prism_eval(BF16, a.device, tokens=size("bf16_tokens"), seq_len=size("seq_len"),
                   heldout_bytes=size("bf16_heldout"), threads=a.threads)
    if m.get("status") != "scored":
        print(f"[bf16] stream probes: {failure_line(m)}")
        return False
    v = m.get("verdict") or {}
    flags = v.get("flags") or []
    heldout_ok = "heldout_contract" not in flags and v.get("heldout") is not None
    print(f"[bf16] scored: prequential_bpb {m['score']['prequential_bpb']:.4f}, {stream_rate(m) or 0:,.0f} tokens/s; "
          f"stream causality probes passed ({m['stream']['batches']} batches)")
    delta = (v.get("heldout") or {}).get("heldout_delta")
    print(f"[bf16] held-out blind probe {'passed' if heldout_ok else 'FAILED'}: heldout_delta "
          f"{delta}, flags {flags}, final_score {v.get('final_score')}"
          f"{'' if heldout_ok else ', error: ' + str(v.get('heldout_error'))}")
    return heldout_ok


def part_overhead(a: argparse.Namespace, size, deadline: float) -> bool:
    cases = [("example (tiny-1m, gpt2)", EXAMPLE, size("overhead_example"), 4, 256, 50257),
             ("trivial (bytes, 8x1024)", TRIVIAL, size("overhead_trivial"), 8, 1024, 257)]
    for name, bundle, tokens, batch, seq_len, vocab in cases:
        if time.monotonic() > deadline:
            print(f"[overhead] {name}: skipped (past the deadline)")
            return False
        with tempfile.TemporaryDirectory() as d:
            npz = Path(d) / "batches.npz"
            cut_batches(str(bundle), tokens, batch, seq_len, npz)
            h, b = [], []
            for _ in range(size("repeats")):
                h.append(run_harness(str(bundle), tokens, seq_len, a.threads, "strict", device=a.device))
                b.append(run_bare(str(bundle), npz, vocab, seq_len, a.threads, device=a.device))
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        hw, bt, hs, bs = med(h, "whole"), med(b, "total"), med(h, "stream"), med(b, "stream")
        print(f"[overhead] {name}, {tokens:,} tokens, {a.device}: harness {tokens / hs:,.0f} tokens/s over the stream "
              f"({tokens / hw:,.0f} over the whole command), bare {tokens / bs:,.0f} tokens/s ({tokens / bt:,.0f} "
              f"over its whole process)")
        print(f"[overhead] {name}: throughput ratio (bare time / harness time) whole {bt / hw:.3f}, "
              f"steady stream {bs / hs:.3f}; bpb {h[0]['bpb']:.6f}")
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="small budgets (the CPU check of this script)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deadline", type=float, default=450.0, help="seconds after which no part starts")
    p.add_argument("--only", choices=["example", "bf16", "overhead"], help="run one part")
    a = p.parse_args()
    size = lambda key: SIZES[key][1 if a.quick else 0]  # noqa: E731
    t0 = time.monotonic()
    deadline = t0 + a.deadline
    results = {}
    for name, part in (("example", part_example), ("bf16", part_bf16)):
        if a.only not in (None, name):
            continue
        if time.monotonic() > deadline:
            print(f"[{name}] skipped (past the deadline of {a.deadline:g} s)")
            results[name] = False
            continue
        results[name] = part(a, size)
    if a.only in (None, "overhead"):
        results["overhead"] = part_overhead(a, size, deadline)
    verdicts = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in results.items())
    print(f"== gpu smoke on {a.device}{' (quick)' if a.quick else ''}: {verdicts} in {time.monotonic() - t0:.0f} s")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
