"""The instrument's blocked scoring against the whole-batch computation it replaced.

Each mode runs in its own process (so peak RSS is its own): ``whole`` is the former
``log_softmax(logits[:, :-1].float()).gather(...)`` over the batch (a second ``[B, T, V]`` float32
tensor beside the logits), ``blocks`` is :func:`prism_challenge.evaluator.instrument.target_logprobs`
(float32 blocks of at most ``SCORE_BLOCK_BYTES``). Prints seconds per batch (median), peak RSS
above the logits, and the ratios blocks / whole; checks the two give the same nats bit for bit.
Usage: ``python bench/scoring_blocks.py [--batch 8] [--seq-len 256] [--vocab 50257] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _one(mode: str, b: int, t: int, v: int, repeats: int) -> dict:
    import torch

    from prism_challenge.evaluator.instrument import target_logprobs

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=gen)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times, nats = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        if mode == "whole":
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1))
        else:
            lp = target_logprobs(logits, tokens, v)
        nats = float(-lp.double().sum())
        times.append(time.perf_counter() - t0)
        del lp
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"s": statistics.median(times), "extra_rss": peak - base, "nats": nats, "logits_bytes": logits.numel() * 4}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mode", choices=["whole", "blocks"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode:
        print(json.dumps(_one(a.mode, a.batch, a.seq_len, a.vocab, a.repeats)))
        return
    out = {}
    for mode in ("whole", "blocks"):
        cmd = [sys.executable, __file__, "--mode", mode, "--batch", str(a.batch), "--seq-len", str(a.seq_len),
               "--vocab", str(a.vocab), "--repeats", str(a.repeats)]
        out[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    w, k = out["whole"], out["blocks"]
    print(f"batch {a.batch} x {a.seq_len}, V {a.vocab}: logits {w['logits_bytes'] / 2**20:.0f} MiB float32")
    for name, r in out.items():
        print(f"  {name:6s}  {r['s'] * 1000:8.1f} ms/batch   peak RSS above the logits {r['extra_rss'] / 2**20:7.0f} MiB")
    print(f"  time ratio blocks/whole {k['s'] / w['s']:.3f}   memory ratio {k['extra_rss'] / max(1, w['extra_rss']):.3f}"
          f"   same nats: {k['nats'] == w['nats']}")


if __name__ == "__main__":
    main()
