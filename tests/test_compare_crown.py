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
from prism_challenge.research.compare import crown, group_runs, load_runs
from prism_challenge.manifest.run_manifest import MANIFEST_NAME

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


def test_the_html_report_has_the_crown_table(runs):
    from prism_challenge.research.compare_report import html_report

    groups = group_runs(load_runs(sorted(runs.iterdir())))
    page = html_report(groups, [], None)
    t, df, se = welch_by_hand(ALPHA, BETA)
    diff, half = statistics.mean(ALPHA) - statistics.mean(BETA), stats.t.ppf(0.975, df) * se
    assert "<h3>Bundles by the crown rule</h3>" in page and "p &lt; 0.01" in page
    row = page[page.index("<td>alpha</td>", page.index("Bundles by the crown rule")):]
    assert row.startswith(f"<td>alpha</td><td>3</td><td>{statistics.mean(ALPHA):.6f} ± {statistics.stdev(ALPHA):.6f}"
                          f"</td><td>{stats.t.cdf(t, df):.3g}</td><td>{diff:+.6f} [{diff - half:+.6f}, {diff + half:+.6f}]")


def test_the_plot_names_runs_by_bundle_and_seed_and_bands_each_bundle(runs):
    from prism_challenge.research.compare_report import legend_names
    from prism_challenge.research.plots import RunCurve, group_band

    groups = group_runs(load_runs(sorted(runs.iterdir())))
    names = sorted(legend_names(groups, 0.01).values())
    assert names == ["alpha · seed 1", "alpha · seed 2", "alpha · seed 3",
                     "beta · seed 1", "beta · seed 2", "beta · seed 3", "gamma · seed 7"]
    # the band by hand: three curves on one byte schedule, one shorter (its end bounds the band)
    a = RunCurve("a", [10, 100, 1000], [0.0] * 3, [4.0, 3.0, 2.0])
    b = RunCurve("b", [10, 100, 1000], [0.0] * 3, [5.0, 3.5, 2.5])
    c = RunCurve("c", [10, 100], [0.0] * 2, [6.0, 4.0])
    x, mean, std = group_band([a, b, c])
    assert x.tolist() == [10.0, 100.0]
    assert mean.tolist() == pytest.approx([5.0, 3.5])
    assert std.tolist() == pytest.approx([1.0, 0.5])  # sample std of (4, 5, 6) and (3, 3.5, 4)
    # between two points the curves are interpolated in log bytes: halfway (in log) is the mean of the ends
    d = RunCurve("d", [10, 1000], [0.0] * 2, [4.0, 2.0])
    x, mean, _ = group_band([RunCurve("e", [10, 100, 1000], [0.0] * 3, [4.0, 3.0, 2.0]), d])
    assert mean.tolist() == pytest.approx([4.0, 3.0, 2.0])


def test_a_narrow_console_cuts_no_name_and_prints_no_python_dict(tmp_path, capsys, monkeypatch):
    """At 80 columns the per-run table names runs by bundle and seed, never cut inside a word, with
    each run's directory below; the budgets read as words (issue 30's frictions)."""
    for i, bpb in enumerate(ALPHA):
        d = run(tmp_path, "tiny-1m", i + 1, bpb, i)
        d.rename(tmp_path / f"20261206-03193{i}-tiny-1m-d544fde8")
    run(tmp_path, "gamma", 7, 0.5, 20, tokens=1000)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines() if "token_budget" in line or "loop_stopped" in line) <= 80
    assert sum("token_budget" in line.split() for line in out.splitlines()) >= 3  # the stop column whole
    for i in range(3):  # each run named by bundle and seed, its directory on a line of its own
        assert f"  tiny-1m · seed {i + 1}: 20261206-03193{i}-tiny-1m-d544fde8 (train FLOPs " in out
    assert "budgets: token_budget 4,000" in out.replace("\n", " ") and "{'token_budget'" not in out


def test_a_second_variant_of_one_bundle_name_says_what_sets_it_apart(tmp_path, capsys, monkeypatch):
    """Two runs of ``alpha``: the second with ``--heldout-bytes 50000`` and 1 thread (the same
    bundle, so the same sha256): it is ``alpha#2``, and the report names those two settings."""
    first = run(tmp_path, "alpha", 1, 1.0, 0)
    other = run(tmp_path, "alpha", 2, 0.9, 5)
    base = json.loads((first / MANIFEST_NAME).read_text())
    base["profile"]["overridden"] = ["seq_len", "token_budget"]
    (first / MANIFEST_NAME).write_text(json.dumps(base))
    m = json.loads((other / MANIFEST_NAME).read_text())
    m["verdict"]["heldout"]["max_bytes"] = 50000
    m["profile"]["overridden"] = ["heldout_bytes", "seed", "seq_len", "token_budget"]  # the seed's: no setting
    m["config"]["threads"] = 1
    (other / MANIFEST_NAME).write_text(json.dumps(m))
    (group,) = group_runs(load_runs([first, other]))
    rows = crown(group)
    second = next(r for r in rows if r.label == "alpha#2")
    assert second.namesake == "alpha" and second.differs == (
        'options over the profile: ["seq_len", "token_budget"] -> ["heldout_bytes", "seq_len", "token_budget"]',
        f"held-out bytes: {base['verdict']['heldout']['max_bytes']} -> 50000",
        f"config.threads: {base['config']['threads']} -> 1",
    )
    assert next(r for r in rows if r.label == "alpha").namesake is None
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"  alpha#2 is alpha with other settings: {'; '.join(second.differs)}" in out
