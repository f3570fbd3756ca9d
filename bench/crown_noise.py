"""The crown rule under measured seed noise: how often a copy displaces the original, and how
often a better model takes first place (issue 29, part 3).

For each noise level (the sample std of one bundle's bpb over seeds, measured with the
``prism init`` template at 68 kB, issue 29: 0.007 bpb at lr 3e-3, 0.041 at lr 1e-2, 0.012 at 1/10
of a production budget), ``--trials`` times:

* two copies of one model: an earlier group and a later group of ``K`` runs each, every run's
  bpb drawn from ``N(mu, std)``; the later displaces the earlier when the one-sided Welch p is
  below ``significance_p`` (:func:`prism_challenge.score.crown.rank_groups`'s rule). Printed: the
  **false-displacement rate** (goal: at most 1 %), with its binomial standard error; and the
  chance that one of ``m`` copies does (``1 - (1 - rate)^m``: the rate is per challenger);
* a model better by ``delta`` bpb (its runs from ``N(mu - delta, std)``): the **power**, the share
  of trials in which it takes first place.

Also for heavier tails than the normal: Student t with 3 degrees of freedom, scaled to the same
std (a seed that diverges now and then).

The draws are tested in bulk with the call :func:`prism_challenge.score.crown.welch_p` makes
(``scipy.stats.ttest_ind(equal_var=False, alternative="less")``, along an axis); the first
``--check`` trials of each level go through :func:`~prism_challenge.score.crown.rank_groups` itself and
must give the same crowns.

Usage: ``python bench/crown_noise.py [--trials 200000] [--k 3] [--seed 0]`` (about 30 s of CPU).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from prism_challenge.score.crown import DEFAULT_SIGNIFICANCE_P, RunGroup, rank_groups  # noqa: E402

NOISE = (("lr 3e-3", 0.007), ("lr 1e-2", 0.041), ("1/10 budget", 0.012))
DELTAS = (0.01, 0.02, 0.05, 0.1)
MU = 1.6  # bpb; the test does not depend on it


def draws(rng: np.random.Generator, shape: tuple[int, int], std: float, tails: str) -> np.ndarray:
    """Noise of sample std ``std``: normal, or Student t (3 df) scaled to the same std."""
    if tails == "normal":
        return rng.normal(0.0, std, shape)
    return rng.standard_t(3, shape) * std / math.sqrt(3.0)  # var of t_3 is 3


def displaced(challenger: np.ndarray, holder: np.ndarray, p: float) -> np.ndarray:
    """Per trial (row): the challenger takes the crown (one-sided Welch p < ``p``)."""
    pv = stats.ttest_ind(challenger, holder, axis=1, equal_var=False, alternative="less").pvalue
    return pv < p


def checked(challenger: np.ndarray, holder: np.ndarray, p: float, fast: np.ndarray) -> int:
    """Trials where :func:`rank_groups` disagrees with the bulk test (must be 0)."""
    bad = 0
    for c, h, f in zip(challenger, holder, fast):
        ranked = rank_groups([RunGroup("holder", tuple(h), 0), RunGroup("challenger", tuple(c), 1)], p)
        bad += (ranked[0].key == "challenger") != bool(f)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200_000)
    ap.add_argument("--k", type=int, default=3, help="runs per group (the confirmation's K)")
    ap.add_argument("--p", type=float, default=DEFAULT_SIGNIFICANCE_P, help="significance_p")
    ap.add_argument("--check", type=int, default=2000, help="trials per level checked through rank_groups")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    n, k = args.trials, args.k
    print(f"crown rule: K = {k} runs per group, one-sided Welch p < {args.p}, {n:,} trials per cell")
    print(f"{'noise':<12} {'tails':<7} {'std':>6} {'false displ.':>13} {'± se':>7} {'1 of 10':>8} {'1 of 100':>9}  "
          + "  ".join(f"power -{d:g}" for d in DELTAS))
    worst, mismatches = 0.0, 0
    for tails in ("normal", "t3"):
        for name, std in NOISE:
            holder = MU + draws(rng, (n, k), std, tails)
            copy = MU + draws(rng, (n, k), std, tails)
            fast = displaced(copy, holder, args.p)
            rate = float(fast.mean())
            worst = max(worst, rate) if tails == "normal" else worst
            mismatches += checked(copy[:args.check], holder[:args.check], args.p, fast[:args.check])
            se = math.sqrt(rate * (1 - rate) / n)
            power = [float(displaced(MU - d + draws(rng, (n, k), std, tails), holder, args.p).mean()) for d in DELTAS]
            print(f"{name:<12} {tails:<7} {std:>6.3f} {rate:>12.3%} {se:>7.3%} {1 - (1 - rate) ** 10:>8.1%} "
                  f"{1 - (1 - rate) ** 100:>9.1%}  " + "  ".join(f"{x:>10.1%}" for x in power))
    print(f"worst false-displacement rate (normal noise): {worst:.3%} (goal <= 1 %): "
          f"{'ok' if worst <= 0.01 else 'ABOVE THE GOAL'}")
    checks = args.check * 2 * len(NOISE)
    print(f"rank_groups vs the bulk test: {mismatches} disagreement(s) in {checks:,} checked trials")
    return 0 if worst <= 0.01 and mismatches == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
