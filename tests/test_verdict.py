"""The verdict's pure functions, against values worked out by hand."""

import itertools
import math
from pathlib import Path

import pytest

from prism_challenge.evaluator.feeder import StepRecord
from prism_challenge.profiles import ProfileError, load_profile
from prism_challenge.score.scoring import curve
from prism_challenge.score.verdict import (
    Policy,
    VerdictError,
    anomaly,
    build_verdict,
    final_score,
    memorization,
    rank,
    tail_bpb,
)

LN2 = math.log(2)


# -- tail_bpb ---------------------------------------------------------------------------------
def test_tail_counts_the_straddling_step_pro_rata():
    steps = [(10.0, 40), (20.0, 40), (30.0, 20)]  # bytes (0,40] (40,80] (80,100]
    # last 10 bytes = (90, 100]: half of step 3 -> 15 nats over 10 bytes
    assert tail_bpb(steps, 0.1) == pytest.approx(15 / LN2 / 10, rel=1e-12)
    # last 30 bytes = (70, 100]: step 3 whole (30) + 10/40 of step 2 (5) -> 35 nats over 30 bytes
    assert tail_bpb(steps, 0.3) == pytest.approx(35 / LN2 / 30, rel=1e-12)
    # the tail boundary on a step boundary: exactly step 3
    assert tail_bpb(steps, 0.2) == pytest.approx(30 / LN2 / 20, rel=1e-12)


def test_tail_of_everything_is_the_prequential_bpb():
    steps = [(10.0, 40), (20.0, 40), (30.0, 20)]
    assert tail_bpb(steps, 1.0) == pytest.approx(60 / LN2 / 100, rel=1e-12)


def test_zero_byte_steps_count_whole_inside_the_tail_only():
    # (0,40] (40,100] then an end-of-text-only step at 100 (inside (90,100])
    steps = [(10.0, 40), (20.0, 60), (3.0, 0)]
    assert tail_bpb(steps, 0.1) == pytest.approx((20 * 10 / 60 + 3) / LN2 / 10, rel=1e-12)
    # a zero-byte step exactly at the boundary (position 90) is outside (90, 100]
    steps = [(10.0, 90), (3.0, 0), (20.0, 10)]
    assert tail_bpb(steps, 0.1) == pytest.approx(20 / LN2 / 10, rel=1e-12)


def test_tail_accepts_step_records_dicts_and_the_manifest_curve():
    recs = [StepRecord(0, 10.0, 40, 40), StepRecord(1, 20.0, 50, 40), StepRecord(2, 30.0, 25, 20)]
    expected = 15 / LN2 / 10
    assert tail_bpb(recs) == pytest.approx(expected, rel=1e-12)
    assert tail_bpb([{"nats": r.nats, "bytes": r.bytes} for r in recs]) == pytest.approx(expected, rel=1e-12)
    assert tail_bpb(curve(recs)) == pytest.approx(expected, rel=1e-12)


def test_tail_refuses_bad_input():
    with pytest.raises(VerdictError, match="fraction"):
        tail_bpb([(1.0, 1)], 0.0)
    with pytest.raises(VerdictError, match="fraction"):
        tail_bpb([(1.0, 1)], 1.5)
    with pytest.raises(VerdictError, match="no bytes"):
        tail_bpb([(1.0, 0)])
    with pytest.raises(VerdictError, match="not finite"):
        tail_bpb([(math.inf, 10)])


# -- memorization -----------------------------------------------------------------------------
def test_memorization_gap_and_penalty():
    assert memorization(3.0, 2.0, 0.5) == (1.0, 0.5, True)
    gap, mult, flagged = memorization(2.25, 2.0, 0.5)
    assert (gap, mult, flagged) == (0.25, 1.0, False)
    assert memorization(2.5, 2.0, 0.5) == (0.5, 1.0, False)  # at the threshold: not above it
    assert memorization(1.5, 2.0, 0.5) == (-0.5, 1.0, False)  # better on val than the tail: fine
    assert memorization(2.25, 2.0, threshold=0.125, penalty=0.25) == (0.25, 0.25, True)


def test_memorization_nonfinite_val_is_flagged_and_bad_policy_refused():
    gap, mult, flagged = memorization(math.nan, 2.0, 0.1)
    assert gap == math.inf and mult == 0.5 and flagged
    with pytest.raises(VerdictError):
        memorization(2.0, math.inf, 0.1)
    with pytest.raises(VerdictError):
        memorization(2.0, 1.0, 0.1, penalty=1.5)
    with pytest.raises(VerdictError):
        memorization(2.0, 1.0, threshold=-0.1)


# -- anomaly ----------------------------------------------------------------------------------
def test_anomaly_is_half_of_ln_v():
    half = 0.5 * math.log(257)  # 2.7745...
    assert anomaly(2.77, 257) == (0.0, True)
    assert anomaly(2.78, 257) == (1.0, False)
    assert anomaly(math.log(257), 257) == (1.0, False)
    assert anomaly(half * 0.999, 257) == (0.0, True)
    assert anomaly(math.nan, 257) == (1.0, False)
    # gpt2: half of ln 50257 = 5.412...
    assert anomaly(5.40, 50257) == (0.0, True)
    assert anomaly(5.42, 50257) == (1.0, False)
    assert anomaly(3.0, 257, ratio=0.6) == (0.0, True)  # 0.6 * ln 257 = 3.329
    with pytest.raises(VerdictError):
        anomaly(1.0, 1)
    with pytest.raises(VerdictError):
        anomaly(1.0, 257, ratio=0.0)


# -- final score ------------------------------------------------------------------------------
def test_final_score_formula():
    assert final_score(1.0, 1.0, 1.0) == 0.5
    assert final_score(3.0, 1.0, 0.5) == 0.125
    assert final_score(0.0, 1.0, 1.0) == 1.0
    assert final_score(2.0, 0.0, 1.0) == 0.0
    for bad in ((-0.1, 1, 1), (math.nan, 1, 1), (math.inf, 1, 1), (1.0, 1.5, 1), (1.0, 1, -0.5)):
        with pytest.raises(VerdictError):
            final_score(*bad)


# -- ranking ----------------------------------------------------------------------------------
def E(name, bpb, delta, t):
    return {"id": name, "prequential_bpb": bpb, "heldout_delta": delta, "submitted_at": t}


def names(entries):
    return [e["id"] for e in entries]


def R(name, bpbs, t, **kw):
    """An entry with several runs (seed repeats); its prequential_bpb is the first run's."""
    return {"id": name, "prequential_bpb": bpbs[0], "bpbs": bpbs, "heldout_delta": 0.0, "submitted_at": t, **kw}


def test_single_runs_rank_by_bpb_and_the_heldout_delta_no_longer_reorders():
    a, b, c = E("A", 1.000, 0.1, 1), E("B", 1.008, 0.5, 2), E("C", 1.016, 9.0, 3)
    # before issue 29, B passed A within 0.01 bpb on its delta; no entry is confirmed (one run
    # each): no test is possible and the lowest mean leads, the rest by mean
    assert names(rank([c, b, a])) == ["A", "B", "C"]


def test_the_crown_stays_with_the_earlier_of_two_copies_and_goes_to_a_clearly_better_model():
    first = R("first", (1.010, 1.000, 1.004), 1)
    copy = R("copy", (0.998, 1.002, 1.001), 2)  # lower mean by luck: one-sided Welch p = 0.136
    assert names(rank([copy, first])) == ["first", "copy"]
    better = R("better", (0.905, 0.899, 0.910), 3)
    assert names(rank([copy, first, better])) == ["better", "copy", "first"]
    # a single far lower run (not confirmed) does not take the crown; it is placed by its mean
    assert names(rank([copy, first, E("lucky", 0.5, 0.0, 0)])) == ["first", "lucky", "copy"]
    # p = 0.0071: below the default 0.01, not below a stricter 0.005
    assert names(rank([first, R("closer", (0.990, 0.985, 0.988), 4)], significance_p=0.005)) == ["first", "closer"]
    assert names(rank([first, R("closer", (0.990, 0.985, 0.988), 4)])) == ["closer", "first"]


def test_rank_is_independent_of_input_order():
    entries = [E("A", 1.000, 0.1, 5), E("B", 1.004, 0.3, 4), E("C", 1.009, 0.2, 3), E("D", 1.011, 0.9, 2),
               E("E", 1.013, None, 1), E("F", 1.030, 0.0, 0), E("G", 1.000, 0.1, 1),
               R("H", (1.02, 1.03, 1.025), 6), R("I", (1.000, 1.002, 1.001), 7)]
    expected = names(rank(entries))
    # H and I are the only confirmed entries: H (earlier) holds the crown, I beats it at p = 0.0058;
    # the rest by bpb (I's 1.001 is not first by mean: G and A are lower), G before A on time
    assert expected == ["I", "G", "A", "B", "C", "D", "E", "H", "F"]
    for perm in itertools.permutations(entries[:6]):
        assert names(rank([*perm, *entries[6:]])) == expected


def test_rank_time_breaks_ties_and_the_delta_does_not():
    entries = [E("late", 2.0, 0.5, 20), E("early", 2.0, 0.5, 10), E("nan", 2.0, math.nan, 0), E("none", 2.0, None, 1)]
    assert names(rank(entries)) == ["nan", "none", "early", "late"]


def test_rank_accepts_objects_and_refuses_bad_bpb():
    class Run:
        def __init__(self, bpb, delta, t):
            self.prequential_bpb, self.heldout_delta, self.submitted_at = bpb, delta, t

    r1, r2 = Run(1.5, 0.0, "2025-01-02T00:00:00Z"), Run(1.2, 0.0, "2025-01-01T00:00:00Z")
    assert rank([r1, r2]) == [r2, r1]
    with pytest.raises(VerdictError):
        rank([E("x", math.nan, 0.0, 0)])
    with pytest.raises(VerdictError, match="significance p"):
        rank([], significance_p=0.0)
    with pytest.raises(VerdictError, match="group '0'"):
        rank([{**E("x", 1.0, 0.0, 0), "bpbs": (1.0, math.inf)}])


# -- assembled verdict ------------------------------------------------------------------------
def test_build_verdict_honest_run():
    # first step 5.0 nats/target (above 0.5 ln 257); tail (last 10 of 100 bytes) = 1/2 of step 3
    steps = [StepRecord(0, 200.0, 40, 40), StepRecord(1, 100.0, 40, 40), StepRecord(2, 40.0, 20, 20)]
    bpb = 340 / LN2 / 100
    # two val batches of 5 bytes coded in 12 and 18 bits: 3.0 bpb, se = sqrt(2 * 18) / 10 = 0.6
    ho = {"val_bpb_twin": 8.0, "val_bpb_trained": 3.0, "heldout_delta": 5.0, "targets": 10, "bytes": 10,
          "batch_bytes": [5, 5], "batch_nats_trained": [12 * LN2, 18 * LN2]}
    v = build_verdict(bpb, steps, 257, ho)
    tail = 20 / LN2 / 10
    assert v.tail_bpb == pytest.approx(tail, rel=1e-12)
    assert v.first_batch_nats_per_target == 5.0
    assert not v.anomaly_flagged and v.anti_cheat_multiplier == 1.0
    assert v.memorization_gap == pytest.approx(3.0 - tail, rel=1e-12)  # 3.0 - 2.885 = 0.115
    # the tail is one unit (half of step 3): its se is the val side's per-byte variance over its
    # 10 bytes: s2 = (3^2 / 5 + 3^2 / 5) / 1 = 3.6 bits^2/byte, se_tail = sqrt(0.36) = 0.6
    noise = v.memorization_noise
    assert noise["rule"] == "tail_from_val" and (noise["tail_units"], noise["val_units"]) == (1, 2)
    assert noise["se_val_bpb"] == pytest.approx(0.6, rel=1e-12) and noise["se_tail_bpb"] == pytest.approx(0.6)
    assert v.memorization_se_bpb == pytest.approx(0.6 * math.sqrt(2), rel=1e-12)
    assert v.memorization_threshold == pytest.approx(4 * 0.6 * math.sqrt(2), rel=1e-12)
    assert noise["gap_over_se"] == pytest.approx((3.0 - tail) / (0.6 * math.sqrt(2)), rel=1e-12)
    assert not v.memorization_flagged and v.memorization_penalty == 1.0
    assert v.final_score == pytest.approx(1 / (1 + bpb), rel=1e-12)
    assert v.flags == [] and v.heldout_error is None
    d = v.to_dict()
    assert d["final_score"] == v.final_score and d["heldout"]["heldout_delta"] == 5.0


def test_build_verdict_zeroes_an_anomaly_and_penalizes_a_gap():
    steps = [StepRecord(0, 20.0, 10, 10), StepRecord(1, 1.0, 90, 90)]  # 2.0 nats/target at step 0
    bpb = 21 / LN2 / 100
    ho = {"val_bpb_twin": 8.0, "val_bpb_trained": 4.0, "heldout_delta": 4.0}
    v = build_verdict(bpb, steps, 257, ho, policy=Policy(gap_penalty=0.25))
    assert v.anomaly_flagged and v.anti_cheat_multiplier == 0.0
    assert v.memorization_flagged and v.memorization_penalty == 0.25
    assert v.final_score == 0.0 and v.flags == ["anomaly", "memorization"]


def test_build_verdict_without_heldout_flags_it_and_applies_no_penalty():
    steps = [StepRecord(0, 60.0, 10, 10)]
    v = build_verdict(60 / LN2 / 10, steps, 257, None, heldout_error="timeout: 600 s")
    assert v.flags == ["heldout_unavailable"] and v.heldout_error == "timeout: 600 s"
    assert v.memorization_gap is None and v.memorization_penalty == 1.0
    assert v.memorization_se_bpb is None and v.memorization_noise is None and v.memorization_threshold == 0.05
    assert v.final_score == pytest.approx(1 / (1 + 60 / LN2 / 10))
    with pytest.raises(VerdictError):
        build_verdict(1.0, [], 257, None)


def test_rank_puts_zeroed_runs_after_every_other_run():
    # a non-causal cheat (bpb 0.40, held-out probe failed: anti-cheat 0) must not lead the board
    cheat = {**E("cheat", 0.40, None, 0), "anti_cheat_multiplier": 0.0, "final_score": 0.0}
    smuggler = {**E("smuggler", 0.90, 2.0, 1), "final_score": 0.0}
    honest = [E("a", 4.65, 0.3, 2), E("b", 5.10, 0.1, 3)]
    assert names(rank([cheat, smuggler, *honest])) == ["a", "b", "cheat", "smuggler"]


def test_rank_puts_runs_the_heldout_does_not_back_after_clean_ones():
    # causal on held-out text but not in the stream: tail far below val (memorization flag, x0.5);
    # a loop that hung after its last batch: no trained state, so no held-out figures at all
    adapted = {**E("adapted", 0.08, 0.2, 0), "memorization_penalty": 0.5, "flags": ["memorization"]}
    hung = {**E("hung", 0.50, None, 1), "memorization_penalty": 1.0, "flags": ["heldout_unavailable"]}
    zeroed = {**E("zeroed", 0.01, None, 2), "anti_cheat_multiplier": 0.0, "final_score": 0.0}
    honest = [{**E("a", 4.65, 0.3, 3), "memorization_penalty": 1.0, "flags": []}, E("b", 5.10, 0.1, 4)]
    assert names(rank([zeroed, hung, adapted, *honest])) == ["a", "b", "adapted", "hung", "zeroed"]


def stream(tail_bpb_pairs, early=90):
    """``early`` steps of 1000 bytes at 5 nats per target, then 10 at the given bpb pairs."""
    steps = [StepRecord(i, 5000.0, 1000, 1000) for i in range(early)]
    for j, bpb in enumerate(tail_bpb_pairs * 5):
        steps.append(StepRecord(early + j, bpb * 1000 * LN2, 1000, 1000))
    return steps


def heldout(val_bpb, spread=0.06):
    """20 val batches of 500 bytes at ``val_bpb +- spread``."""
    bits = [(val_bpb + spread * (-1) ** i) * 500 for i in range(20)]
    return {"val_bpb_twin": 8.0, "val_bpb_trained": val_bpb, "heldout_delta": 8.0 - val_bpb,
            "batch_bytes": [500] * 20, "batch_nats_trained": [b * LN2 for b in bits]}


def test_a_memorizing_run_is_flagged_at_a_gap_the_old_fixed_threshold_let_through():
    # a tail at 2.0 +- 0.06 bpb over 10 batches, val at 2.3 +- 0.06 over 20: gap 0.3 bpb.
    # se_tail = 0.02, se_val = sqrt(20/19 * 20 * 30^2) / 10^4 = 0.013765 (test_gapnoise's figures)
    steps = stream([2.06, 1.94])
    se = math.hypot(0.02, math.sqrt(20 / 19 * 20 * 900) / 1e4)  # 0.024279
    v = build_verdict(5.0, steps, 257, heldout(2.3))
    assert v.tail_bpb == pytest.approx(2.0, rel=1e-12) and v.memorization_gap == pytest.approx(0.3, rel=1e-9)
    assert v.memorization_se_bpb == pytest.approx(se, rel=1e-9)
    assert v.memorization_threshold == pytest.approx(4 * se, rel=1e-9)  # 0.0971
    assert v.memorization_noise["gap_over_se"] == pytest.approx(0.3 / se, rel=1e-9)  # 12.4
    assert v.memorization_flagged and v.memorization_penalty == 0.5 and v.flags == ["memorization"]
    assert memorization(2.3, v.tail_bpb, 0.5)[2] is False  # the old fixed 0.5 bpb let it through
    # an honest run of the same noise (val 2.05: the final weights a little worse than the tail
    # by chance, 2 se) is not flagged; nor is one better on val than on its tail
    for val in (2.05, 1.9):
        honest = build_verdict(5.0, steps, 257, heldout(val))
        assert not honest.memorization_flagged and honest.flags == []
    # the floor: tiny noise (+- 0.001 bpb) leaves 4 se far below 0.05, which then applies
    quiet = build_verdict(5.0, stream([2.001, 1.999]), 257, heldout(2.04, spread=0.001))
    assert quiet.memorization_threshold == 0.05 and not quiet.memorization_flagged
    assert build_verdict(5.0, stream([2.001, 1.999]), 257, heldout(2.06, spread=0.001)).memorization_flagged


def test_the_policy_sets_z_and_the_floor_and_older_profiles_are_told_what_changed(tmp_path):
    v = build_verdict(5.0, stream([2.06, 1.94]), 257, heldout(2.3), policy=Policy(gap_z=20.0, gap_floor_bpb=0.01))
    se = math.hypot(0.02, math.sqrt(20 / 19 * 20 * 900) / 1e4)
    assert v.memorization_threshold == pytest.approx(20 * se, rel=1e-9) and not v.memorization_flagged  # 0.486
    with pytest.raises(VerdictError, match="memorization noise: .*z"):
        build_verdict(5.0, stream([2.06, 1.94]), 257, heldout(2.3), policy=Policy(gap_z=0.0))
    with pytest.raises(VerdictError, match="memorization noise: 20 nats for 19 byte counts"):
        build_verdict(5.0, stream([2.06, 1.94]), 257, {**heldout(2.3), "batch_bytes": [500] * 19})
    old = tmp_path / "old.toml"
    local = (Path(__file__).resolve().parents[1] / "src/prism_challenge/profiles/local.toml").read_text()
    old.write_text(local.replace("gap_z = 4.0", "gap_threshold_bpb = 0.5"))
    with pytest.raises(ProfileError, match=r"\[policy\] gap_threshold_bpb: no longer a setting: .* gap_z"):
        load_profile(str(old))


# -- a scored run -----------------------------------------------------------------------------
@pytest.mark.slow
def test_an_honest_example_run_is_not_flagged_and_reports_the_measured_noise(tmp_path):
    from prism_challenge import EvalOptions, evaluate
    from prism_challenge.score.gapnoise import ratio_se
    from prism_challenge.manifest.run_manifest import load_run_manifest

    from helpers import EXAMPLE

    out = tmp_path / "run"
    res = evaluate(EvalOptions(bundle=str(EXAMPLE), out_dir=str(out), token_budget=20_000, heldout_bytes=60_000,
                               device="cpu", threads=1))
    assert res.failure is None, res.failure
    m = load_run_manifest(out)
    v, ho = m["verdict"], m["verdict"]["heldout"]
    assert not v["memorization_flagged"] and "memorization" not in v["flags"]
    # the val side: the trusted side's bytes per batch, the child's nats per batch
    assert sum(ho["batch_bytes"]) == ho["bytes"] and len(ho["batch_bytes"]) == ho["batches"] >= 2
    assert math.fsum(ho["batch_nats_trained"]) / LN2 / ho["bytes"] == pytest.approx(ho["val_bpb_trained"], rel=1e-12)
    noise = v["memorization_noise"]
    assert noise["se_val_bpb"] == pytest.approx(ratio_se(ho["batch_nats_trained"], ho["batch_bytes"]), rel=1e-12)
    assert noise["se_val_bpb"] > 0 and noise["se_tail_bpb"] > 0
    assert v["memorization_se_bpb"] == pytest.approx(math.hypot(noise["se_tail_bpb"], noise["se_val_bpb"]), rel=1e-12)
    assert v["memorization_threshold"] == max(0.05, 4 * v["memorization_se_bpb"]) == noise["threshold_bpb"]
    assert noise["gap_over_se"] == pytest.approx(v["memorization_gap"] / v["memorization_se_bpb"], rel=1e-12)
    assert noise["tail_units"] >= 2 and noise["val_units"] == ho["batches"]
    # the manifest alone gives the same verdict again (the curve stands in for the step records)
    again = build_verdict(m["score"]["prequential_bpb"], m["curve"], 50257, ho)
    assert again.memorization_noise == noise and again.memorization_threshold == v["memorization_threshold"]


def test_a_loop_that_stopped_before_its_budget_is_flagged_and_scored_the_same():
    steps = [StepRecord(0, 60.0, 10, 10)]
    bpb = 60 / LN2 / 10
    full = build_verdict(bpb, steps, 257, None, stop_reason="token_budget")
    short = build_verdict(bpb, steps, 257, None, stop_reason="loop_stopped", covered=0.995)  # not "short"
    assert full.flags == ["heldout_unavailable"] and short.flags == ["heldout_unavailable", "loop_stopped"]
    assert short.final_score == full.final_score == pytest.approx(1 / (1 + bpb))
    # the flag alone moves no run to another tier; "short" does (below)
    short_entry = {"id": "short", "prequential_bpb": 1.0, "flags": ["loop_stopped"], "submitted_at": 1}
    full_entry = {"id": "full", "prequential_bpb": 1.5, "flags": [], "submitted_at": 0}
    assert [e["id"] for e in rank([full_entry, short_entry])] == ["short", "full"]


def test_a_run_stopped_under_99_percent_of_its_budget_is_short_and_ranks_below_every_full_run():
    steps = [StepRecord(0, 60.0, 10, 10)]
    bpb = 60 / LN2 / 10
    short = build_verdict(bpb, steps, 257, None, stop_reason="loop_stopped", covered=0.75)
    nearly = build_verdict(bpb, steps, 257, None, stop_reason="loop_stopped", covered=0.995)
    assert short.flags == ["heldout_unavailable", "loop_stopped", "short"] and "short" not in nearly.flags
    assert short.final_score == nearly.final_score  # no figure changes: the ranking demotes it
    clean_short = {"id": "short", "prequential_bpb": 0.5, "flags": ["loop_stopped", "short"], "submitted_at": 0}
    clean = [{"id": "full", "prequential_bpb": 1.5, "flags": [], "submitted_at": 1}]
    flagged = {"id": "flagged", "prequential_bpb": 1.0, "flags": ["memorization"], "memorization_penalty": 0.5,
               "submitted_at": 2}
    flagged_short = {**flagged, "id": "flagged-short", "flags": ["memorization", "short"], "prequential_bpb": 0.9}
    zeroed = {"id": "zeroed", "prequential_bpb": 0.1, "final_score": 0.0, "submitted_at": 3}
    got = [e["id"] for e in rank([zeroed, flagged_short, flagged, clean_short, *clean])]
    assert got == ["full", "short", "flagged", "flagged-short", "zeroed"]
