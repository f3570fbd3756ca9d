"""``prism compare``'s crown table: bundles as groups of seed runs, ranked by the crown rule, with
Welch's p and the difference in mean bpb with its 95 % interval computed here by hand; a short
run ranked below the full ones. Runs are the manifest of a real ``prism eval``
(tests/data/scored_manifest.v2.json) with their bundle, seed, bpb and stop edited."""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import pytest
from scipy import stats

from prism_challenge.cli import main
from prism_challenge.compare import crown, group_runs, load_runs
from prism_challenge.run_manifest import MANIFEST_NAME

SCORED = json.loads((Path(__file__).parent / "data" / "scored_manifest.v2.json").read_text())
ALPHA = (1.010, 1.000, 1.004)  # the earlier bundle
BETA = (0.905, 0.899, 0.910)  # a later one, clearly better


def run(root: Path, bundle: str, seed: int, bpb: float, minute: int, *, tokens: int | None = None) -> Path:
    """A run directory: the fixture's manifest as bundle ``bundle`` on ``seed`` at ``bpb``; with
    ``tokens``, a loop that stopped after that many tokens of its 4000-token budget."""
    m = copy.deepcopy(SCORED)
    m["bundle"]["path"], m["bundle"]["sha256"] = f"/bundles/{bundle}", f"{ord(bundle[0]):064x}"
    m["seed"], m["created_at"] = seed, f"2026-12-01T13:{minute:02d}:00+00:00"
    m["score"]["prequential_bpb"] = m["verdict"]["prequential_bpb"] = bpb
    m["verdict"]["final_score"] = 1 / (1 + bpb)
    if tokens is not None:
        m["stream"].update(stop_reason="loop_stopped", tokens=tokens)
    d = root / f"{bundle}-{seed}"
    d.mkdir(parents=True)
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    return d


@pytest.fixture
def runs(tmp_path):
    for i, bpb in enumerate(ALPHA):
        run(tmp_path, "alpha", i + 1, bpb, i)
    for i, bpb in enumerate(BETA):
        run(tmp_path, "beta", i + 1, bpb, 10 + i)
    run(tmp_path, "gamma", 7, 0.5, 20, tokens=1000)  # far lower, but stopped at 25 % of its budget
    return tmp_path


def welch_by_hand(a, b):
    """t, Welch-Satterthwaite df and se of ``mean(a) - mean(b)`` from the formulas."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return (statistics.mean(a) - statistics.mean(b)) / se, df, se


def test_crown_ranks_bundles_and_compares_each_with_the_first(runs):
    (group,) = group_runs(load_runs(sorted(runs.iterdir())))
    rows = crown(group)
    assert [(r.label, r.ranked.place, r.ranked.n, r.ranked.short) for r in rows] == [
        ("beta", 1, 3, False), ("alpha", 2, 3, False), ("gamma", 3, 1, True)]
    t, df, se = welch_by_hand(ALPHA, BETA)
    d = rows[1].vs_leader
    # p that alpha's mean is the lower: the t distribution's lower tail at alpha - beta's t (~1)
    assert rows[1].ranked.p == pytest.approx(stats.t.cdf(t, df), rel=1e-9) and d.p == rows[1].ranked.p
    half = stats.t.ppf(0.975, df) * se
    diff = statistics.mean(ALPHA) - statistics.mean(BETA)  # +0.100 bpb
    assert (d.diff, d.low, d.high, d.df) == pytest.approx((diff, diff - half, diff + half, df), rel=1e-9)
    assert rows[0].vs_leader is None and rows[2].vs_leader is None  # the leader; a tier of its own
    # the per-run table ranks the short run last whatever its bpb
    assert [r.label for r in group.runs][-1] == "gamma-7"


def test_prism_compare_prints_the_test(runs, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["compare", str(runs)]) == 0
    out = capsys.readouterr().out
    t, df, se = welch_by_hand(ALPHA, BETA)
    diff, half = statistics.mean(ALPHA) - statistics.mean(BETA), stats.t.ppf(0.975, df) * se
    assert "bundles by the crown rule" in out and "p < 0.01" in out
    line = next(x for x in out.splitlines() if " alpha " in x and "[" in x)  # the crown table's row
    assert f"{stats.t.cdf(t, df):.3g}" in line
    assert f"{diff:+.6f} [{diff - half:+.6f}, {diff + half:+.6f}]" in line
    assert f"{statistics.mean(ALPHA):.6f} ± {statistics.stdev(ALPHA):.6f}" in line
    assert next(x for x in out.splitlines() if " gamma " in x).split()[:2] == ["3", "short"]
    assert "short" in next(x for x in out.splitlines() if " gamma-7 " in x).split()  # the per-run table's flags
    # a level at which beta's p (1.09e-5 against alpha) is not significant: alpha, earlier, keeps #1
    assert main(["compare", str(runs), "--significance-p", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert next(x for x in out.splitlines() if " alpha " in x and "[" not in x and "±" in x
                and x.split()[0].isdigit()).split()[0] == "1"
    beta = next(x for x in out.splitlines() if " beta " in x and "[" in x)
    assert beta.split()[0] == "2" and f" {stats.t.sf(t, df):.3g} " in beta and "p < 1e-05" in out
    assert main(["compare", str(runs), "--significance-p", "1.5"]) == 2
    assert "--significance-p 1.5: must be in (0, 1)" in capsys.readouterr().err
