import math

import torch

from prism_challenge.evaluator.statedict import DRIFT_RTOL, drift_only, state_digests, state_moments


def _both(a, b):
    return drift_only(state_digests(a)[1], state_digests(b)[1], state_moments(a), state_moments(b))


def test_the_moments_are_float64_sums_computed_by_hand():
    state = {"w": torch.tensor([1.5, -2.25, 0.125]), "n": torch.tensor([3, 4]), "e": torch.zeros(0)}
    assert state_moments(state) == {"w": [1.5 - 2.25 + 0.125, 1.5 + 2.25 + 0.125]}  # no ints, no empties


def test_an_ulp_is_drift_a_step_of_training_is_not():
    w = torch.linspace(-1, 1, 1000)
    ulp = w.clone()
    ulp[10] = torch.nextafter(ulp[10], torch.tensor(2.0))
    ok, rel = _both({"w": w}, {"w": ulp})
    # one float32 ulp of -0.98 is 2**-24; sum |x| = 500.5 (linspace's exact sum of |x|, to 1e-4)
    assert ok and rel == (2 ** -24) / float(w.double().abs().sum())
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
    assert drift_only(dig, other, {"w": [4.0, 4.0]}, {"w": "forged"}) == (False, math.inf)  # malformed moments
    assert drift_only(dig, other, {"w": [4.0, 4.0]}, {}) == (False, math.inf)  # moments missing
