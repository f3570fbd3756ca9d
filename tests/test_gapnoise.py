"""The gap's standard errors against values worked out by hand and by an independent formula."""

import math

import numpy as np
import pytest

from prism_challenge.score.gapnoise import GapNoiseError, gap_noise, per_byte_variance, ratio_se, tail_units
from prism_challenge.score.verdict import tail_bpb

LN2 = math.log(2)


def nats(bits):
    return [b * LN2 for b in bits]


def cochran_se(bits, nbytes):
    """Cochran's other form of the same estimate: (s_y^2 + R^2 s_x^2 - 2 R s_xy) / (n xbar^2)."""
    y, x = np.asarray(bits, float), np.asarray(nbytes, float)
    r = y.sum() / x.sum()
    s = np.cov(np.vstack([y, x]), ddof=1)
    return math.sqrt((s[0, 0] + r * r * s[1, 1] - 2 * r * s[0, 1]) / (len(y) * x.mean() ** 2))


def test_ratio_se_by_hand():
    # units of 10 bytes coded in 10 and 30 bits: R = 2 bpb, residuals -10 and +10 bits;
    # v = 2/1 * 200 / 20^2 = 1, se = 1 bpb
    assert ratio_se(nats([10, 30]), [10, 10]) == pytest.approx(1.0, rel=1e-12)
    # three units: R = 60/30 = 2; residuals 4-8 = -4, 26-20 = 6, 30-32 = -2 -> ss 56;
    # v = 3/2 * 56 / 30^2 = 0.09333, se = 0.30551
    assert ratio_se(nats([4, 26, 30]), [4, 10, 16]) == pytest.approx(math.sqrt(1.5 * 56 / 900), rel=1e-12)


def test_ratio_se_matches_cochrans_covariance_form():
    rng = np.random.default_rng(7)
    nbytes = rng.integers(500, 3000, size=37).astype(float)
    bits = nbytes * (2.0 + 0.1 * rng.standard_normal(37))
    assert ratio_se(nats(bits), nbytes) == pytest.approx(cochran_se(bits, nbytes), rel=1e-10)
    # blocks of 3 consecutive units: the same formula over the 13 sums (the last block holds one)
    yb = [bits[i:i + 3].sum() for i in range(0, 37, 3)]
    xb = [nbytes[i:i + 3].sum() for i in range(0, 37, 3)]
    assert ratio_se(nats(bits), nbytes, block=3) == pytest.approx(cochran_se(yb, xb), rel=1e-10)


def test_per_byte_variance_by_hand():
    # R = 2; residuals -4, 6, -2 over 4, 10, 16 bytes: (16/4 + 36/10 + 4/16) / 2 = 3.925
    assert per_byte_variance(nats([4, 26, 30]), [4, 10, 16]) == pytest.approx(3.925, rel=1e-12)
    assert per_byte_variance(nats([4]), [4]) is None


def test_too_few_units_give_no_se_and_bad_units_are_refused():
    assert ratio_se(nats([10]), [10]) is None
    assert ratio_se(nats([10, 3]), [10, 0]) is None  # one unit with bytes
    assert ratio_se([], []) is None
    for bad in (([1.0], [1, 2]), ([-1.0, 1.0], [1, 1]), ([math.nan, 1.0], [1, 1]), ([1.0, 1.0], [1, math.inf])):
        with pytest.raises(GapNoiseError):
            ratio_se(*bad)
    with pytest.raises(GapNoiseError, match="block"):
        ratio_se([1.0, 1.0], [1, 1], block=0)
    with pytest.raises(GapNoiseError, match="z"):
        gap_noise(([1.0, 2.0], [1, 1]), ([1.0, 2.0], [1, 1]), z=0.0)
    with pytest.raises(GapNoiseError, match="floor"):
        gap_noise(([1.0, 2.0], [1, 1]), ([1.0, 2.0], [1, 1]), floor=-0.1)


def test_tail_units_weight_the_straddling_batch_by_its_overlap():
    steps = [(10.0, 40), (20.0, 40), (30.0, 20)]  # bytes (0,40] (40,80] (80,100]
    # the last 30 bytes (70, 100]: 10 of step 2's 40 bytes (w = 1/4), step 3 whole
    assert tail_units(steps, 0.3) == ([5.0, 30.0], [10.0, 20.0])
    # the last 10 bytes (90, 100]: half of step 3
    assert tail_units(steps, 0.1) == ([15.0], [10.0])
    # a zero-byte step inside the tail is a unit of 0 bytes (its nats count, as in tail_bpb)
    n, b = tail_units([(10.0, 40), (20.0, 60), (3.0, 0)], 0.1)
    assert n == [pytest.approx(20 * 10 / 60), 3.0] and b == [pytest.approx(10.0), 0.0]
    for f in (0.1, 0.3, 0.55, 1.0):
        n, b = tail_units(steps, f)
        assert math.fsum(n) / LN2 / math.fsum(b) == pytest.approx(tail_bpb(steps, f), rel=1e-12)


def test_gap_noise_combines_both_sides_and_applies_z_and_the_floor():
    tail = (nats([2060, 1940] * 5), [1000] * 10)  # 10 batches at 2.0 +- 0.06 bpb
    val = (nats([1180, 1120] * 10), [500] * 20)  # 20 batches at 2.3 +- 0.06 bpb
    # by hand: tail v = 10/9 * 10 * 60^2 / 10000^2 = 4e-4 (se 0.02);
    # val v = 20/19 * 20 * 30^2 / 10000^2 = 1.8947e-4 (se 0.013765)
    se_t, se_v = 0.02, math.sqrt(20 / 19 * 20 * 900 / 1e8)
    g = gap_noise(tail, val)
    assert g.se_tail_bpb == pytest.approx(se_t, rel=1e-12) and g.se_val_bpb == pytest.approx(se_v, rel=1e-12)
    assert g.se_gap_bpb == pytest.approx(math.hypot(se_t, se_v), rel=1e-12)  # 0.024279
    assert g.threshold_bpb == pytest.approx(4 * math.hypot(se_t, se_v), rel=1e-12)  # 0.0971 > floor 0.05
    assert (g.tail_units, g.val_units, g.rule, g.z, g.floor_bpb) == (10, 20, "measured", 4.0, 0.05)
    assert gap_noise(tail, val, floor=0.2).threshold_bpb == 0.2
    assert gap_noise(tail, val, z=3.0).threshold_bpb == pytest.approx(3 * math.hypot(se_t, se_v), rel=1e-12)
    assert gap_noise(tail, val, z=2.0).threshold_bpb == 0.05  # 2 * 0.02428 = 0.0486: the floor


def test_a_tail_spread_below_the_val_bound_is_raised_to_it():
    tail = (nats([2001, 1999] * 2), [1000] * 4)  # se 1/4000 * sqrt(4/3 * 4) = 0.000577
    val = (nats([1180, 1120] * 10), [500] * 20)  # s2 = 20 * 900 / 500 / 19 bits^2 per byte
    g = gap_noise(tail, val)
    bound = math.sqrt(20 * 900 / 500 / 19 / 4000)  # over the tail's 4000 bytes: 0.02176
    assert g.se_tail_bpb == pytest.approx(bound, rel=1e-12) and g.rule == "measured, tail raised to the val bound"


def test_a_side_without_a_spread_borrows_the_other_sides_per_byte_variance_else_the_floor():
    val = (nats([1180, 1120] * 10), [500] * 20)
    s2_v = 20 * 900 / 500 / 19
    one = gap_noise((nats([3000]), [1500]), val)  # a tail of one batch
    assert one.rule == "tail_from_val" and one.tail_units == 1
    assert one.se_tail_bpb == pytest.approx(math.sqrt(s2_v / 1500), rel=1e-12)
    assert one.se_gap_bpb == pytest.approx(math.hypot(math.sqrt(s2_v / 1500), math.sqrt(20 / 19 * 18000 / 1e8)))
    tail = (nats([2060, 1940] * 5), [1000] * 10)
    s2_t = 10 * 3600 / 1000 / 9
    no_val = gap_noise(tail, (nats([1150]), [500]))  # one val batch
    assert no_val.rule == "val_from_tail" and no_val.se_val_bpb == pytest.approx(math.sqrt(s2_t / 500), rel=1e-12)
    neither = gap_noise((nats([3000]), [1500]), ([], []))
    assert neither.rule == "floor" and neither.se_gap_bpb is None and neither.threshold_bpb == 0.05
    assert neither.se_tail_bpb is None and neither.se_val_bpb is None


def test_a_tail_spread_a_loop_widened_is_capped_at_three_times_the_val_bound():
    # a cheat on every other tail batch (gain 0.6 bpb on half of 10 batches): gap 0.3 bpb and an
    # own se of 0.3 / sqrt(10 - 1) = 0.1: 4 se = 0.4 would let its gap through
    tail = (nats([1400, 2000] * 5), [1000] * 10)
    own = ratio_se(*tail)
    assert own == pytest.approx(math.sqrt(10 / 9 * 10 * 300 ** 2) / 1e4, rel=1e-12)  # 0.1
    val = (nats([1180, 1120] * 10), [500] * 20)
    bound = math.sqrt(20 * 900 / 500 / 19 / 10_000)  # 0.013765
    g = gap_noise(tail, val)
    assert g.se_tail_bpb == pytest.approx(3 * bound, rel=1e-12) and g.rule == "measured, tail capped at 3 x the val bound"
    assert g.threshold_bpb == pytest.approx(4 * math.hypot(3 * bound, math.sqrt(20 / 19 * 18000 / 1e8)), rel=1e-12)
    assert g.threshold_bpb < 0.3 < 4 * math.hypot(own, g.se_val_bpb)  # 0.174: the gap of 0.3 is flagged


def test_one_outlier_val_batch_does_not_hide_a_memorization_gap():
    # red team 9: a memorizer (tail 1.00 bpb, val 1.50) made confidently wrong on one val batch
    # (a causal per-row trigger: every probe passes) raised its val bpb by 0.15 and, unclamped,
    # its threshold from the 0.05 floor to 0.78 bpb: unflagged. Winsorized residuals keep it flagged.
    from prism_challenge.score.gapnoise import gap_noise
    from prism_challenge.score.verdict import memorization

    ln2, x = math.log(2), 8000
    tail = ([(1.00 + 0.03 * (-1) ** i) * x * ln2 for i in range(40)], [x] * 40)
    val_b = [x] * 25
    val_n = [(1.50 + 0.03 * (-1) ** i) * x * ln2 for i in range(25)]

    def flagged(nats):
        g = gap_noise(tail, (nats, val_b))
        return memorization(math.fsum(nats) / ln2 / sum(val_b), 1.00, g.threshold_bpb, 0.5)[2], g.threshold_bpb

    assert flagged(val_n) == (True, 0.05)
    outlier = list(val_n)
    outlier[7] += 0.15 * sum(val_b) * ln2  # one batch 3.75 bpb worse: the val mean +0.15 bpb
    is_flagged, threshold = flagged(outlier)
    # the other 24 residuals are (+-0.03 - 0.15) bits per byte around R (R holds the outlier),
    # so the median is about -0.15 x / sqrt(x) per sqrt byte and the MAD 0.03 sqrt(x): the
    # outlier's residual is clamped to about 3 * 1.4826 * 0.03 * 2 sqrt(x) over the median, and the
    # threshold stays a fraction of the 0.65 bpb gap (unclamped it was 0.759)
    assert is_flagged and threshold < 0.2, threshold
