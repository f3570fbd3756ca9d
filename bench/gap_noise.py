"""The memorization gap's noise on honest runs, and what a memorizing bundle does to it.

Runs ``prism eval`` (the library call, CPU, strict isolation, the audit off unless
``--audited-batches``: it does not change the gap) on honest bundles at
two or three stream lengths (byte budgets, so every tokenizer covers the same text):

* ``examples/tiny-1m`` (GPT-2 tokens, 4 x 256 per batch),
* the ``prism init`` template (GPT-2 tokens, 8 x 128 per batch),
* ``bench/bundles/bigram`` (bytes, 8 x 256 per batch),

and a memorizing bundle (``bench/bundles/memorizer``: the bigram plus a table of the train
stream's text around its last 10 %, written here into ``tail_text.py`` from the train split:
a cheat that embeds the stream's text) at two strengths: ``ALPHA`` 6 nats (blatant) and 0.3
nats (a gap of a few tenths of a bpb, like the 1-in-6 peek of issue 15 that the fixed 0.5 bpb
let through).

Printed per run: the tail's and the val side's units, tail and val bpb, the gap, ``se_tail``,
``se_val``, ``se_gap``, ``gap / se_gap``, the threshold (``max(floor, z * se_gap)``), flagged,
the rule (:mod:`prism_challenge.score.gapnoise`), the lag-1 autocorrelation of the per-batch
residuals ``y_i / x_i - R`` on each side (consecutive batches of one document are correlated),
``se(block 4) / se(block 1)`` of the val side (about 1 when the correlation does not
matter), and the tail's own SE over the val side's per-byte bound (``own/b``: the honest range
behind :data:`prism_challenge.score.gapnoise.TAIL_CAP`). Then the share of honest runs flagged (goal 0), the largest honest ``gap / se`` and
gap, and the memorizers' ``gap / se``.

Data: ``--data`` names a prepared data directory, or FineWeb-Edu JSON lines (files or a folder,
e.g. ``../shared/data``), prepared once into ``--work``; without it the embedded corpus.

Usage: ``python bench/gap_noise.py [--data ../shared/data] [--lengths 40000,160000]``
(about 10 minutes on 2 cores at the defaults).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from prism_challenge import EvalOptions, evaluate  # noqa: E402
from prism_challenge.score.gapnoise import per_byte_variance, ratio_se, tail_units  # noqa: E402
from prism_challenge.manifest.run_manifest import load_run_manifest  # noqa: E402
from prism_challenge.score.verdict import _steps  # noqa: E402

LN2 = math.log(2.0)
BENCH_BUNDLES = REPO / "bench" / "bundles"
MEMORY_MARGIN = 0.15  # the table covers the stream's text from (0.9 - margin) L to (1 + margin) L bytes


def data_dir(arg: str | None, work: Path) -> str | None:
    """A prepared data directory: ``arg`` itself, or ``arg``'s JSON lines prepared under ``work``."""
    if arg is None:
        return None
    src = Path(arg)
    if (src / "MANIFEST.json").exists() or any(src.glob("MANIFEST*")):
        return str(src)
    from prism_challenge.data.prepare import prepare

    files = sorted(src.glob("*.jsonl")) if src.is_dir() else [src]
    out = work / "data"
    if not out.exists():
        prepare([str(f) for f in files], out, salt_file=work / "data.salt")
    return str(out)


def memorizer(work: Path, data: str | None, length: int, alpha: float) -> Path:
    """The memorizing bundle with ``tail_text.py`` holding the train stream around its tail."""
    from prism_challenge.data.builtin import ensure_builtin
    from prism_challenge.data.manifest import load_manifest
    from prism_challenge.data.stream import iter_token_chunks
    from prism_challenge.tokenizers import reference_tokenizer

    lo, hi = (0.9 - MEMORY_MARGIN) * length, (1 + MEMORY_MARGIN) * length
    ids: list[int] = []
    seen = 0
    for chunk in iter_token_chunks(load_manifest(data or ensure_builtin()), reference_tokenizer("bytes")):
        for tok, nb in zip(chunk.ids.tolist(), chunk.nbytes.tolist()):
            seen += nb
            if lo <= seen <= hi:
                ids.append(int(tok))
        if seen > hi:
            break
    root = work / f"memorizer-{length}-{alpha:g}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(BENCH_BUNDLES / "memorizer", root)
    shutil.copy(BENCH_BUNDLES / "bigram" / "training.py", root / "training.py")
    (root / "tail_text.py").write_text(f'"""The train stream near its tail (bench/gap_noise.py)."""\n\nALPHA = {alpha!r}\n'
                                       f"IDS = {ids!r}\n")
    return root


def lag1(resid: list[float]) -> float | None:
    """The lag-1 autocorrelation of a series (``None`` below 3 points)."""
    if len(resid) < 3:
        return None
    m = sum(resid) / len(resid)
    den = sum((r - m) ** 2 for r in resid)
    return sum((a - m) * (b - m) for a, b in zip(resid, resid[1:])) / den if den else None


def residuals(nats: list[float], nbytes: list[float]) -> list[float]:
    """``y_i / x_i - R`` (bpb) of the units with bytes."""
    r = math.fsum(nats) / LN2 / math.fsum(nbytes)
    return [n / LN2 / b - r for n, b in zip(nats, nbytes) if b > 0]


def one_run(name: str, bundle: Path, data: str | None, length: int, work: Path, heldout: int, audit: int) -> dict:
    """Score ``bundle`` at a byte budget of ``length``; the verdict's gap figures."""
    out = work / f"run-{name}-{length}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    res = evaluate(EvalOptions(bundle=str(bundle), data_dir=data, out_dir=str(out), byte_budget=length,
                               heldout_bytes=heldout, device="cpu", threads=2, audited_batches=audit))
    if res.failure is not None:
        raise SystemExit(f"{name} at {length} bytes failed: {res.failure}")
    m = load_run_manifest(out)
    v, ho = m["verdict"], m["verdict"]["heldout"]
    t_n, t_b = tail_units(_steps(m["curve"]), v["tail_fraction"])
    v_n, v_b = ho["batch_nats_trained"], ho["batch_bytes"]
    noise = v["memorization_noise"]
    se1, se4 = ratio_se(v_n, v_b), ratio_se(v_n, v_b, block=4)
    own, s2_v = ratio_se(t_n, t_b), per_byte_variance(v_n, v_b)
    bound = math.sqrt(s2_v / math.fsum(t_b)) if s2_v else None
    return {"name": name, "length": length, "tail": v["tail_bpb"], "val": ho["val_bpb_trained"],
            "gap": v["memorization_gap"], "noise": noise, "flagged": v["memorization_flagged"],
            "rho_tail": lag1(residuals(t_n, t_b)), "rho_val": lag1(residuals(v_n, v_b)),
            "block4": se4 / se1 if se1 and se4 else None, "own_over_bound": own / bound if own and bound else None,
            "wall_s": time.monotonic() - t0}


def fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def show(r: dict) -> None:
    n = r["noise"]
    print(f"{r['name']:<16} {r['length']:>7} {n['tail_units']:>4} {n['val_units']:>4} {r['tail']:7.4f} "
          f"{r['val']:7.4f} {r['gap']:+8.4f} {fmt(n['se_tail_bpb'])} {fmt(n['se_val_bpb'])} "
          f"{fmt(n['se_gap_bpb'])} {fmt(n['gap_over_se'], '+7.2f'):>7} {n['threshold_bpb']:.4f} "
          f"{'FLAGGED' if r['flagged'] else 'ok':<7} {fmt(r['rho_tail'], '+.2f'):>5} {fmt(r['rho_val'], '+.2f'):>5} "
          f"{fmt(r['block4'], '.2f'):>5} {fmt(r['own_over_bound'], '.2f'):>5} {r['wall_s']:5.0f}s  {n['rule']}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the honest and memorizing bundles and print the table and the summary."""
    p = argparse.ArgumentParser(prog="bench/gap_noise.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a prepared data directory, or JSON lines to prepare (default: embedded corpus)")
    p.add_argument("--lengths", default="40000,160000", help="byte budgets, comma-separated")
    p.add_argument("--heldout-bytes", type=int, default=60_000)
    p.add_argument("--audited-batches", type=int, default=0,
                   help="the audit's A (default 0: the audit does not change the gap and costs time here)")
    p.add_argument("--work", help="working folder (default: a temporary one, removed)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = None if args.work else tempfile.mkdtemp(prefix="gap-noise-")
    work = Path(args.work or tmp)
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = data_dir(args.data, work)
        from prism_challenge.research.scaffold import write_bundle

        template = work / "template"
        if not template.exists():
            write_bundle(template, "gpt2")
        honest = {"tiny-1m": REPO / "examples" / "tiny-1m", "init-template": template, "bytes-bigram": BENCH_BUNDLES / "bigram"}
        print(f"data: {data or 'embedded corpus'}; held-out bytes {args.heldout_bytes}; z and floor: the policy's")
        print(f"{'bundle':<16} {'bytes':>7} {'nT':>4} {'nV':>4} {'tail':>7} {'val':>7} {'gap':>8} {'se_tail':>6} "
              f"{'se_val':>6} {'se_gap':>6} {'gap/se':>7} {'thresh':>6} {'verdict':<7} {'rhoT':>5} {'rhoV':>5} "
              f"{'blk4':>5} {'own/b':>5} {'wall':>6}  rule")
        runs = []
        for length in lengths:
            for name, bundle in honest.items():
                runs.append(one_run(name, bundle, data, length, work, args.heldout_bytes, args.audited_batches))
                show(runs[-1])
        cheats = []
        for alpha in (6.0, 0.3):
            length = lengths[-1]
            cheats.append(one_run(f"memorizer-a{alpha:g}", memorizer(work, data, length, alpha), data, length, work,
                                  args.heldout_bytes, args.audited_batches))
            show(cheats[-1])
        flagged = sum(r["flagged"] for r in runs)
        zs = [r["noise"]["gap_over_se"] for r in runs if r["noise"]["gap_over_se"] is not None]
        print(f"\nhonest runs flagged: {flagged} of {len(runs)} (goal 0); largest honest gap/se "
              f"{max(zs):+.2f}, largest honest gap {max(r['gap'] for r in runs):+.4f} bpb; "
              f"honest gap/se: {' '.join(f'{z:+.2f}' for z in zs)}")
        for c in cheats:
            print(f"{c['name']}: gap {c['gap']:+.4f} bpb, gap/se {fmt(c['noise']['gap_over_se'], '+.1f')}, "
                  f"threshold {c['noise']['threshold_bpb']:.4f}: {'flagged' if c['flagged'] else 'NOT FLAGGED'}"
                  f"{' (the old fixed 0.5 bpb would not flag it)' if c['gap'] <= 0.5 else ''}")
        return 0 if flagged == 0 and all(c["flagged"] for c in cheats) else 1
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
