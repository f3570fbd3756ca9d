"""The crown rule (prism_challenge.score.crown): Welch's p against a hand computation, the crown's
cases (copies, a clearly better challenger, single runs), the short tier, the budget share."""

from __future__ import annotations

import itertools
import math

import pytest
from scipy import stats

from prism_challenge.score.crown import (
    CrownError,
    RunGroup,
    budget_share,
    is_short,
    rank_groups,
    welch_difference,
    welch_p,
)


def by_hand(a, b):
    """Welch's t and Welch-Satterthwaite df from the formulas, with plain sums."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = va / na + vb / nb
    df = se2 ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    return (ma - mb) / math.sqrt(se2), df, math.sqrt(se2)


def test_welch_p_is_the_t_distributions_lower_tail_at_the_hand_computed_t_and_df():
    a, b = [1.00, 1.02, 0.99], [1.05, 1.09, 1.04, 1.06]
    t, df, _ = by_hand(a, b)
    # means 1.003333 and 1.06; variances 2.3333e-4 and 4.6667e-4; se^2 = 7.7778e-5 + 1.16667e-4:
    # t = -0.056667 / 0.013944 = -4.0638; df = 3.7809e-8 / (3.0247e-9 + 4.5370e-9) = 5.000
    assert t == pytest.approx(-4.0638, abs=1e-4) and df == pytest.approx(5.0, abs=1e-3)
    assert welch_p(a, b) == pytest.approx(stats.t.cdf(t, df), rel=1e-10)
    # the other way round: the upper tail at -t
    assert welch_p(b, a) == pytest.approx(stats.t.sf(t, df), rel=1e-10)
    assert welch_p(a, b) + welch_p(b, a) == pytest.approx(1.0, abs=1e-12)
    assert 0.001 < welch_p(a, b) < 0.01


def test_welch_difference_has_the_welch_confidence_interval():
    a, b = [1.00, 1.02, 0.99], [1.05, 1.09, 1.04, 1.06]
    t, df, se = by_hand(a, b)
    d = welch_difference(a, b)
    half = stats.t.ppf(0.975, df) * se
    assert d.diff == pytest.approx(sum(a) / 3 - sum(b) / 4, rel=1e-12)
    assert (d.low, d.high) == pytest.approx((d.diff - half, d.diff + half), rel=1e-9)
    assert d.df == pytest.approx(df, rel=1e-9) and d.p == welch_p(a, b) and d.confidence == 0.95
    assert welch_difference([1.0], b) is None
    flat = welch_difference([1.0, 1.0], [1.5, 1.5])
    assert (flat.diff, flat.low, flat.high, flat.df, flat.p) == (-0.5, -0.5, -0.5, None, 0.0)


def test_welch_p_where_the_test_is_undefined():
    assert welch_p([0.5], [1.0, 1.1, 1.2]) == 1.0  # n < 2: no variance estimate, not significant
    assert welch_p([0.5, 0.6], [1.0]) == 1.0
    assert welch_p([0.1, 0.1, 0.1], [0.2, 0.2]) == 0.0  # zero variance in both: the difference is exact
    assert welch_p([0.2, 0.2], [0.2, 0.2, 0.2]) == 1.0  # copies of a deterministic model
    assert welch_p([0.3, 0.3], [0.2, 0.2]) == 1.0
    for bad in ([], [math.nan, 1.0], [1.0, math.inf]):
        with pytest.raises(CrownError, match="challenger"):
            welch_p(bad, [1.0, 1.1])


def keys(ranked):
    return [r.key for r in ranked]


def test_copies_of_one_model_keep_the_earlier_first_whatever_their_means():
    early = RunGroup("early", (1.010, 1.000, 1.004), order=0)
    late = RunGroup("late", (0.998, 1.002, 1.001), order=1)  # lower mean by luck: p = 0.136
    assert welch_p(late.bpbs, early.bpbs) > 0.01
    ranked = rank_groups([late, early])
    assert keys(ranked) == ["early", "late"] and ranked[0].leads and ranked[0].p is None
    assert ranked[1].p == pytest.approx(welch_p(late.bpbs, early.bpbs))
    assert ranked[0].mean == pytest.approx(1.014 / 3 + 2 / 3, rel=1e-12)
    m = 0.014 / 3  # the mean's excess over 1.0; deviations 0.010 - m, -m, 0.004 - m
    assert ranked[0].std == pytest.approx(math.sqrt(((0.010 - m) ** 2 + m ** 2 + (0.004 - m) ** 2) / 2), rel=1e-9)


def test_a_clearly_better_challenger_takes_the_crown():
    early = RunGroup("early", (1.010, 1.000, 1.004), order=0)
    better = RunGroup("better", (0.905, 0.899, 0.910), order=5)
    ranked = rank_groups([early, better])
    assert keys(ranked) == ["better", "early"] and ranked[0].leads
    assert ranked[1].p == pytest.approx(welch_p(early.bpbs, better.bpbs)) and ranked[1].p > 0.99
    # the crown passes along the replay: a third one, better than "better" only by luck, does not take it
    lucky = RunGroup("lucky", (0.900, 0.898, 0.903), order=9)
    assert keys(rank_groups([lucky, early, better])) == ["better", "lucky", "early"]


def test_single_runs_never_take_the_crown_from_a_confirmed_group():
    confirmed = RunGroup("confirmed", (1.00, 1.01, 1.02), order=3)
    provisional = RunGroup("provisional", (0.50,), order=0)  # earlier and far lower, but one run
    ranked = rank_groups([provisional, confirmed])
    assert keys(ranked) == ["confirmed", "provisional"]
    assert ranked[1].p is None and ranked[1].std is None and ranked[1].n == 1
    # no group confirmed (no confirmation runs): no test is possible and the lowest mean leads
    singles = [RunGroup("a", (1.2,), 0), RunGroup("b", (1.1,), 1), RunGroup("c", (1.1,), 2)]
    assert keys(rank_groups(singles)) == ["b", "c", "a"]


def test_places_below_the_first_are_by_mean_then_order():
    lead = RunGroup("lead", (1.00, 1.01, 0.99), order=0)
    rest = [RunGroup("x", (0.995, 1.0, 0.99), 1), RunGroup("y", (1.3, 1.2), 2), RunGroup("z", (0.995, 0.99, 1.0), 3),
            RunGroup("s", (1.1,), 4)]
    expected = ["lead", "x", "z", "s", "y"]
    for perm in itertools.permutations([lead, *rest]):
        ranked = rank_groups(perm)
        assert keys(ranked) == expected and [r.place for r in ranked] == [1, 2, 3, 4, 5]


def test_short_groups_rank_below_every_full_group_under_the_same_rule():
    full = RunGroup("full", (1.50, 1.52, 1.51), order=4)
    short = [RunGroup("short-early", (0.80, 0.82, 0.81), 0, short=True),
             RunGroup("short-late", (0.60, 0.61, 0.62), 1, short=True)]
    ranked = rank_groups([*short, full])
    assert keys(ranked) == ["full", "short-late", "short-early"]
    assert [r.leads for r in ranked] == [True, True, False] and [r.short for r in ranked] == [False, True, True]
    assert ranked[2].p == pytest.approx(welch_p(short[0].bpbs, short[1].bpbs))


def test_rank_groups_refuses_bad_input():
    with pytest.raises(CrownError, match="unique"):
        rank_groups([RunGroup("a", (1.0,), 0), RunGroup("a", (1.1,), 1)])
    with pytest.raises(CrownError, match="group 'b'"):
        rank_groups([RunGroup("b", (), 0)])
    with pytest.raises(CrownError, match="must be in"):
        rank_groups([], p=0.0)


def test_a_run_is_short_when_the_loop_stopped_under_99_percent_of_its_budget():
    budgets = {"token_budget": 4000, "byte_budget": None, "step_budget": None, "wall_clock_budget_s": 60}
    assert budget_share({"tokens": 3000, "bytes": 2900, "batches": 3}, budgets) == 0.75
    assert is_short("loop_stopped", 0.75) and not is_short("loop_stopped", 0.995)
    assert not is_short("token_budget", 0.5) and not is_short("stream_exhausted", None)
    # several budgets: the largest share (the first one reached ends the run)
    both = {"token_budget": 4000, "step_budget": 2}
    assert budget_share({"tokens": 3000, "batches": 2}, both) == 1.0
    # no countable budget: a loop that stopped is short
    assert budget_share({"tokens": 10}, {"wall_clock_budget_s": 60}) is None and is_short("loop_stopped", None)
