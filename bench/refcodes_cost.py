"""What the reference code lengths cost (:mod:`prism_challenge.data.refcodes`).

For each prefix size (default: the example run's 67,892 bytes, ``prism eval examples/tiny-1m
--token-budget 20000``, and 1 MB) of the train split of ``--data`` (default: the embedded corpus,
1.95 MB of train text), printed: the time to read the text, each compressor's time alone and
its bpb, the whole uncached :func:`~prism_challenge.data.refcodes.reference_codes` (the three on
threads of their own) and a second, cached call; with the ratios threaded / serial and cached /
computed, and the MB/s of the whole.

    python bench/refcodes_cost.py [--data DIR] [--bytes 67892,1000000]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from prism_challenge.data.builtin import builtin_manifest
from prism_challenge.data.manifest import load_manifest
from prism_challenge.data.refcodes import CODECS, reference_codes, scored_text


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def measure(manifest, nbytes: int) -> None:
    """Print one size's figures (see the module doc)."""
    text, t_read = _timed(lambda: scored_text(manifest, nbytes))
    serial = 0.0
    print(f"{nbytes:,} bytes: read {t_read:.3f} s")
    for name, codec in CODECS.items():
        out, t = _timed(lambda codec=codec: codec(text))
        serial += t
        print(f"  {name:8s} {8 * len(out) / nbytes:.4f} bpb  {t:.3f} s")
    root = Path(tempfile.mkdtemp(prefix="refcodes-bench-"))
    try:
        _, t_all = _timed(lambda: reference_codes(manifest, nbytes, cache_root=root))
        _, t_hit = _timed(lambda: reference_codes(manifest, nbytes, cache_root=root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"  reference_codes, uncached: {t_all:.3f} s ({nbytes / 1e6 / t_all:.2f} MB/s; threaded / serial "
          f"{t_all / (t_read + serial):.2f}); cached: {t_hit * 1e3:.2f} ms ({t_hit / t_all:.4f} x)")


def main() -> None:
    """Run the measurement (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="a data directory (default: the embedded corpus)")
    p.add_argument("--bytes", default="67892,1000000", help="comma-separated prefix sizes")
    args = p.parse_args()
    manifest = load_manifest(args.data) if args.data else builtin_manifest()
    for n in (int(x) for x in args.bytes.split(",")):
        measure(manifest, n)


if __name__ == "__main__":
    main()
