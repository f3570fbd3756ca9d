"""Data-plane throughput on the shared FineWeb-Edu sample: prepare, token-cache build, cached read.

    python bench/data_plane.py [--source ../shared/data] [--workers 2] [--seconds 2]

Prints:
* prepare: MB of UTF-8 text per second (read, partition, dedup, shard, hash);
* cache build: MB of text per second tokenized into the token cache (gpt2 and bytes), with the
  tokenizer already loaded, for ``--workers`` threads (goal: >= 10 MB/s on 2 cores);
* cache open: seconds to open and verify the cache (sha256 of every array);
* cached read: tokens per second yielded by ``train_stream`` (the cache's compact chunks), looping over the
  cache for ``--seconds`` (goal: >= 50 M tokens/s).

MB = 10**6 bytes. Nothing here is asserted; the figures are for the closing note of a change.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from prism_challenge.data.cache import build_token_cache, open_token_cache, token_cache_dir  # noqa: E402
from prism_challenge.data.prepare import prepare  # noqa: E402
from prism_challenge.data.stream import train_stream  # noqa: E402
from prism_challenge.tokenizers import reference_tokenizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--workers", type=int, default=2, help="tokenizer threads for the cache build")
    ap.add_argument("--seconds", type=float, default=2.0, help="how long to loop over the cached stream")
    ap.add_argument("--chunk-tokens", type=int, default=1 << 20)
    args = ap.parse_args()
    if not args.source.exists():
        print(f"{args.source}: absent; pass --source with FineWeb-Edu jsonl/parquet files", file=sys.stderr)
        return 2
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    print(f"source {args.source}  cpus {cpus}  workers {args.workers}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        m = prepare([args.source], tmp / "data", salt_file=tmp / "salt").manifest
        dt = time.perf_counter() - t
        read = m.data["utf8_bytes_read"]
        print(f"prepare        {read / 1e6:8.2f} MB text, {m.data['documents_read']:,} docs in {dt:6.2f} s "
              f"= {read / 1e6 / dt:8.1f} MB/s")
        train_bytes = m.utf8_bytes("train")
        for name in ("gpt2", "bytes"):
            tok = reference_tokenizer(name)
            tok.encode("warm up")  # load the BPE tables outside the timing
            tok.byte_lengths()
            path = token_cache_dir(m, tok, tmp / "cache")
            t = time.perf_counter()
            cache = build_token_cache(m, tok, path, workers=args.workers)
            dt = time.perf_counter() - t
            print(f"cache build    {name:5s} {train_bytes / 1e6:8.2f} MB text -> {cache.n_tokens:,} tokens in "
                  f"{dt:6.2f} s = {train_bytes / 1e6 / dt:8.1f} MB/s  ({args.workers} threads)")
            t = time.perf_counter()
            open_token_cache(path)
            dt = time.perf_counter() - t
            size = sum(f.stat().st_size for f in path.iterdir())
            print(f"cache open     {name:5s} verify {size / 1e6:8.2f} MB of arrays in {dt:6.3f} s")
            tokens = passes = 0
            t = time.perf_counter()
            while True:
                for chunk in train_stream(m, tok, cache_root=tmp / "cache", chunk_tokens=args.chunk_tokens,
                                          progress=False) if passes == 0 else cache.chunks(args.chunk_tokens):
                    tokens += chunk.ids.shape[0]
                passes += 1
                if time.perf_counter() - t >= args.seconds:
                    break
            dt = time.perf_counter() - t
            print(f"cached read    {name:5s} {tokens:,} tokens ({passes} passes, first incl. open+verify) in "
                  f"{dt:6.2f} s = {tokens / dt / 1e6:8.1f} M tokens/s  (chunks of {args.chunk_tokens:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
