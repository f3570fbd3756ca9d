"""GPU smoke bench: the example, a bf16 bundle and the harness against the bare loop on one device.

Three parts, each through the real ``prism eval`` (strict isolation, one rank), printing tokens
per second and, for the third, the ratios against the bare loop:

1. **example**: ``examples/tiny-1m`` at ``--nproc 1`` on the device under strict isolation:
   prints the GPU stack the sandbox saw (the manifest's ``compute.gpu``), the peak allocated and
   reserved device memory, and tokens per second over the stream;
2. **bf16**: ``bench/bundles/bf16``, a small GPT whose forward and training step run under
   ``torch.autocast(device, bfloat16)``, with the held-out stage on;
3. **overhead**: ``bench/overhead.py``'s bundles (the example, and ``bench/bundles/trivial``
   unless ``--overhead-cases`` names fewer) against the bare loop (``bench/bare_loop.py``) on the
   same device: tokens per second of both and the ratios (whole command -> last batch, and the
   steady stream).

Every run is honest, so every run must come out clean (:func:`honest_problems`): scored, no flag
(but ``heldout_unavailable`` where the held-out stage is off on purpose), the audit passed,
``final_score`` above 0. A run zeroed by its audit is a failure of the part, not a pass.

Each part runs under its own limit (``--part-timeout``, and never past ``--deadline`` seconds
from the start): a command past it is ended with its whole process group and the part fails,
said so. A part that would start past the deadline is skipped and fails. Exit status 0 when every
part passed, 1 otherwise; ``--json PATH`` writes each part's outcome and figures. On a machine
without CUDA, ``--device cpu --quick`` runs the same parts with small budgets (a few minutes on 2
cores), so the script is checked end to end where no GPU is. Usage: ``python bench/gpu_smoke.py
[--device cuda] [--quick] [--deadline 450] [--part-timeout 240] [--only example,bf16,overhead]
[--overhead-cases example,trivial] [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounded import run_bounded  # noqa: E402
from overhead import BenchFailure, cut_batches, run_bare, run_harness  # noqa: E402

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
DISABLED_HELDOUT_FLAG = "heldout_unavailable"
"""The one flag an honest run may carry: the held-out stage was off (``--heldout-bytes 0``)."""


def prism_eval(bundle: Path, device: str, *, tokens: int, seq_len: int, heldout_bytes: int, threads: int,
               timeout_s: float | None = None) -> dict:
    """One ``prism eval`` (strict isolation, one rank) in its own process group, ended past
    ``timeout_s``; its manifest, with ``_wall_s`` (the command's whole time), ``_output`` (its
    last lines) and ``_heldout_bytes`` added. A run that left no manifest reads as failed at
    stage ``none`` (or ``timeout`` when it was ended at its limit), with its last line of output."""
    with tempfile.TemporaryDirectory(prefix="prism-smoke-") as d:
        out = Path(d) / "run"
        cmd = [sys.executable, "-m", "prism_challenge.cli", "eval", str(bundle), "--device", device, "--nproc", "1",
               "--isolation", "strict", "--token-budget", str(tokens), "--seq-len", str(seq_len), "--threads",
               str(threads), "--heldout-bytes", str(heldout_bytes), "--quiet", "--out", str(out)]
        t0 = time.time()
        proc = run_bounded(cmd, timeout_s)
        try:
            manifest = json.loads((out / "prism_run_manifest.v2.json").read_text())
        except OSError:
            stage = "timeout" if proc.timed_out else "none"
            last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            manifest = {"status": "failed", "failure": {"stage": stage, "message": f"no manifest: {last[0][:400]}"}}
        manifest["_wall_s"] = time.time() - t0
        manifest["_output"] = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        manifest["_heldout_bytes"] = heldout_bytes
        return manifest


def honest_problems(m: dict) -> list[str]:
    """What is wrong with the manifest ``m`` of an honest run (empty: nothing): not scored, any
    flag (``heldout_unavailable`` admitted only when ``m["_heldout_bytes"]`` is 0), an audit that
    did not pass or is absent, a ``final_score`` that is not above 0."""
    if m.get("status") != "scored":
        f = m.get("failure") or {}
        return [f"not scored: stage {f.get('stage')}: {f.get('message')}"]
    v, audit = m.get("verdict") or {}, m.get("audit") or {}
    admitted = {DISABLED_HELDOUT_FLAG} if m.get("_heldout_bytes") == 0 else set()
    problems = [f"flag {f}" for f in v.get("flags") or [] if f not in admitted]
    if audit.get("passed") is not True:
        problems.append(f"audit not passed: error {audit.get('error')!r}, mismatch {audit.get('mismatch')!r}")
    if not (v.get("final_score") or 0) > 0:
        problems.append(f"final_score {v.get('final_score')}")
    if m.get("_heldout_bytes") and v.get("heldout_error"):
        problems.append(f"heldout_error {v.get('heldout_error')}")
    return problems


def run_record(m: dict) -> dict:
    """The figures of one run worth keeping (score, flags, audit, held-out, speed, GPU stack)."""
    v, audit, g = m.get("verdict") or {}, m.get("audit") or {}, (m.get("compute") or {}).get("gpu") or {}
    return {"status": m.get("status"), "failure": m.get("failure"), "final_score": v.get("final_score"),
            "prequential_bpb": (m.get("score") or {}).get("prequential_bpb"), "flags": v.get("flags"),
            "audit_passed": audit.get("passed"), "audit_error": audit.get("error"),
            "audit_mismatch": audit.get("mismatch"), "heldout_error": v.get("heldout_error"),
            "heldout_delta": (v.get("heldout") or {}).get("heldout_delta"),
            "tokens": (m.get("stream") or {}).get("tokens"), "tokens_per_s": stream_rate(m),
            "wall_s": round(m.get("_wall_s", 0.0), 2), "gpu": g or None, "problems": honest_problems(m),
            "output_tail": m.get("_output") if m.get("status") != "scored" else None}


def stream_rate(m: dict) -> float | None:
    """Tokens per second over the scored stream (first batch -> last record)."""
    t = m.get("timing") or {}
    first, last = t.get("launch_to_first_batch_s"), t.get("launch_to_last_record_s")
    tokens = (m.get("stream") or {}).get("tokens")
    return tokens / (last - first) if tokens and first is not None and last and last > first else None


def part_example(a: argparse.Namespace, size, limit: float) -> dict:
    """The example on the device, held-out off, within ``limit`` seconds: its :func:`run_record`."""
    m = prism_eval(EXAMPLE, a.device, tokens=size("example_tokens"), seq_len=size("seq_len"), heldout_bytes=0,
                   threads=a.threads, timeout_s=limit)
    rec = run_record(m)
    if m.get("status") == "scored":
        print(f"[example] scored: prequential_bpb {rec['prequential_bpb']:.4f}, {rec['tokens']:,} tokens, "
              f"{rec['tokens_per_s'] or 0:,.0f} tokens/s over the stream, command {rec['wall_s']:.1f} s, "
              f"isolation {m['isolation']['mode']} ({m['isolation']['backend']}), uid {m['isolation']['uid']}")
        g = rec["gpu"] or {}
        print(f"[example] gpu stack: {json.dumps({k: v for k, v in g.items() if not k.startswith('peak')})}")
        print(f"[example] peak device bytes: allocated {g.get('peak_allocated_bytes')}, "
              f"reserved {g.get('peak_reserved_bytes')}")
    return rec


def part_bf16(a: argparse.Namespace, size, limit: float) -> dict:
    """The bf16-autocast bundle with the held-out stage, within ``limit`` seconds: its :func:`run_record`."""
    m = prism_eval(BF16, a.device, tokens=size("bf16_tokens"), seq_len=size("seq_len"),
                   heldout_bytes=size("bf16_heldout"), threads=a.threads, timeout_s=limit)
    rec = run_record(m)
    if m.get("status") == "scored":
        print(f"[bf16] scored: prequential_bpb {rec['prequential_bpb']:.4f}, {rec['tokens_per_s'] or 0:,.0f} "
              f"tokens/s; stream causality probes passed ({m['stream']['batches']} batches); held-out "
              f"heldout_delta {rec['heldout_delta']}, flags {rec['flags']}, final_score {rec['final_score']}, "
              f"audit passed {rec['audit_passed']}")
    return rec


def overhead_case(a: argparse.Namespace, size, case: tuple, deadline: float) -> dict:
    """One bundle against the bare loop, ``repeats`` runs of each, every command within the part's limit."""
    name, bundle, tokens, batch, seq_len, vocab = case
    h, b = [], []
    with tempfile.TemporaryDirectory() as d:
        npz = Path(d) / "batches.npz"
        cut_batches(str(bundle), tokens, batch, seq_len, npz)
        for _ in range(a.repeats or size("repeats")):
            h.append(run_harness(str(bundle), tokens, seq_len, a.threads, "strict", device=a.device,
                                 timeout_s=deadline - time.monotonic()))
            b.append(run_bare(str(bundle), npz, vocab, seq_len, a.threads, device=a.device,
                              timeout_s=deadline - time.monotonic()))
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    hw, bt, hs, bs = med(h, "whole"), med(b, "total"), med(h, "stream"), med(b, "stream")
    print(f"[overhead] {name}, {tokens:,} tokens, {a.device}: harness {tokens / hs:,.0f} tokens/s over the stream "
          f"({tokens / hw:,.0f} over the whole command), bare {tokens / bs:,.0f} tokens/s ({tokens / bt:,.0f} "
          f"over its whole process)")
    print(f"[overhead] {name}: throughput ratio (bare time / harness time) whole {bt / hw:.3f}, "
          f"steady stream {bs / hs:.3f}; bpb {h[0]['bpb']:.6f}")
    problems = [f"harness run: flag {f}" for x in h for f in x["flags"] if f != DISABLED_HELDOUT_FLAG]
    problems += ["harness run: audit not passed" for x in h if x["audit_passed"] is not True]
    return {"tokens": tokens, "harness_tokens_per_s": tokens / hs, "bare_tokens_per_s": tokens / bs,
            "ratio_stream": bs / hs, "ratio_whole": bt / hw, "problems": problems}


def part_overhead(a: argparse.Namespace, size, limit: float) -> dict:
    """``--overhead-cases`` against the bare loop within ``limit`` seconds in all: each case's
    figures (:func:`overhead_case`) and the part's problems."""
    cases = {"example": ("example (tiny-1m, gpt2)", EXAMPLE, size("overhead_example"), 4, 256, 50257),
             "trivial": ("trivial (bytes, 8x1024)", TRIVIAL, size("overhead_trivial"), 8, 1024, 257)}
    deadline = time.monotonic() + limit
    out: dict = {"problems": []}
    for key in a.overhead_cases.split(","):
        try:
            out[key] = overhead_case(a, size, cases[key], deadline)
            out["problems"] += [f"{key}: {p}" for p in out[key]["problems"]]
        except BenchFailure as exc:
            out["problems"].append(f"{key}: {str(exc)[:600]}")
    return out


PARTS = {"example": part_example, "bf16": part_bf16, "overhead": part_overhead}


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="small budgets (the CPU check of this script)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deadline", type=float, default=450.0, help="seconds after which no part starts or runs")
    p.add_argument("--part-timeout", type=float, default=240.0, help="seconds each part may take at most")
    p.add_argument("--only", help="the parts to run, comma-separated, in this order (default: all)")
    p.add_argument("--overhead-cases", default="example,trivial", help="the overhead part's bundles, comma-separated")
    p.add_argument("--repeats", type=int, help="runs per side in the overhead part (default 2, quick 1)")
    p.add_argument("--json", help="write each part's outcome and figures to this file")
    a = p.parse_args()
    if any(c not in ("example", "trivial") for c in a.overhead_cases.split(",")):
        p.error(f"--overhead-cases: each of example, trivial; got {a.overhead_cases!r}")
    if a.only and any(c not in PARTS for c in a.only.split(",")):
        p.error(f"--only: each of {', '.join(PARTS)}; got {a.only!r}")
    return a


def main() -> int:
    a = arguments()
    size = lambda key: SIZES[key][1 if a.quick else 0]  # noqa: E731
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    for name in a.only.split(",") if a.only else PARTS:
        part = PARTS[name]
        left = t0 + a.deadline - time.monotonic()
        if left < 5:
            results[name] = {"problems": [f"skipped: past the deadline of {a.deadline:g} s"]}
        else:
            started = time.monotonic()
            results[name] = part(a, size, min(a.part_timeout, left))
            results[name]["part_s"] = round(time.monotonic() - started, 1)
        for problem in results[name]["problems"]:
            print(f"[{name}] FAILED: {problem}")
    verdicts = ", ".join(f"{k} {'FAILED' if v['problems'] else 'ok'}" for k, v in results.items())
    print(f"== gpu smoke on {a.device}{' (quick)' if a.quick else ''}: {verdicts} in {time.monotonic() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "quick": a.quick, "parts": results}, indent=1))
    return 0 if results and not any(v["problems"] for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
