import json
import math

import pytest
import torch

from prism_challenge.evaluator.statedict import (
    DRIFT_RTOL,
    SIGNS_PERIOD,
    _signs,
    drift_only,
    state_digests,
    state_moments,
    tensors_header_bytes,
)


def _both(a, b):
    return drift_only(state_digests(a)[1], state_digests(b)[1], state_moments(a), state_moments(b))


def test_the_moments_are_float64_sums_computed_by_hand():
    assert _signs()[:3].tolist() == [1.0, -1.0, -1.0] and set(_signs().tolist()) == {1.0, -1.0}
    state = {"w": torch.tensor([1.5, -2.25, 0.125]), "n": torch.tensor([3, 4]), "e": torch.zeros(0)}
    assert state_moments(state) == {"w": [1.5 - 2.25 + 0.125, 1.5 + 2.25 + 0.125, 1.5**2 + 2.25**2 + 0.125**2,
                                          1.5 + 2.25 - 0.125]}  # no ints, no empties
    # the signs repeat with period SIGNS_PERIOD: ones over one period and three more elements
    ones = state_moments({"o": torch.ones(SIGNS_PERIOD + 3)})["o"]
    assert ones == [SIGNS_PERIOD + 3.0, SIGNS_PERIOD + 3.0, SIGNS_PERIOD + 3.0, float(_signs().sum()) + 1 - 1 - 1]


def test_an_ulp_is_drift_a_step_of_training_is_not():
    w = torch.linspace(-1, 1, 1000)
    ulp = w.clone()
    ulp[10] = torch.nextafter(ulp[10], torch.tensor(2.0))
    ok, rel = _both({"w": w}, {"w": ulp})
    # one float32 ulp of -0.98 is 2**-24: the signed sums differ by it, against the L2 norm of w
    # (sqrt(sum w**2) = 18.3; the plain sums' 2**-24 / sum |x| = 2**-24 / 500.5 is smaller)
    assert ok and rel == pytest.approx((2 ** -24) / math.sqrt(float((w.double() ** 2).sum())), rel=1e-9)
    assert not _both({"w": w}, {"w": w + 1e-3})[0]  # 1e-3 on each of 1000 elements: 2e-3 of sum |x|
    assert _both({"w": w}, {"w": w})  == (True, 0.0)  # nothing differs
    assert DRIFT_RTOL == 1e-4


def test_what_is_never_drift():
    w = torch.ones(4)
    assert not _both({"w": w, "i": torch.tensor([1])}, {"w": w, "i": torch.tensor([2])})[0]  # an integer differs
    assert not _both({"w": w}, {"w": w, "x": w})[0]  # a tensor only one rank has
    ok, rel = _both({"w": w}, {"w": torch.tensor([1.0, 1.0, 1.0, float("nan")])})
    assert not ok and math.isinf(rel)  # NaN
    dig = state_digests({"w": w})[1]
    other = state_digests({"w": w * 2})[1]
    mine = {"w": [4.0, 4.0, 4.0, 2.0]}
    assert drift_only(dig, other, mine, {"w": "forged"}) == (False, math.inf)  # malformed moments
    assert drift_only(dig, other, mine, {"w": [4.0, 4.0]}) == (False, math.inf)  # too few moments
    assert drift_only(dig, other, mine, {}) == (False, math.inf)  # moments missing


def test_ranks_that_trained_apart_are_not_drift_however_large_the_tensor():
    # a loop without DDP: each rank's weights move by its own data, 1e-3 of each weight with
    # mixed signs. Plain sums of such a difference cancel (about 1e-3 * sqrt(n) of sum |x| / n):
    # under DRIFT_RTOL for n = 2**20; the signed sum sees the relative L2 distance, 1e-3
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 20, generator=g)
    apart = w + 1e-3 * w.abs() * (torch.randint(0, 2, w.shape, generator=g) * 2 - 1)
    ma, mb = state_moments({"w": w})["w"], state_moments({"w": apart})["w"]
    assert max(abs(ma[0] - mb[0]), abs(ma[1] - mb[1])) / ma[1] < DRIFT_RTOL  # what the sums alone call drift
    ok, rel = _both({"w": w}, {"w": apart})
    l2 = float((apart.double() - w.double()).norm() / w.double().norm())
    assert not ok and l2 == pytest.approx(1e-3, rel=1e-3) and 0.2 * l2 < rel < 5 * l2
    # and an ulp on every weight of the same tensor is drift, at about 2**-24 of the norm
    ulps = torch.nextafter(w, torch.full_like(w, math.inf))
    ok, rel = _both({"w": w}, {"w": ulps})
    assert ok and rel < 1e-6


def test_the_header_bound_holds_for_non_ascii_names_and_the_longest_floats():
    names = [f"层{i}.权重" * 8 for i in range(50)] + ["emoji\U0001F600", "plain.weight"]
    worst = -2.2250738585072014e-308
    done = {"state_tensors": {k: "f" * 64 for k in names}, "state_moments": {k: [worst] * 4 for k in names}}
    size = len(json.dumps(done, separators=(",", ":")))
    assert size <= tensors_header_bytes(names) < size + 16 * len(names)
