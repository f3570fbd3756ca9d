import math

import pytest
import torch
from torch import nn

from prism_challenge.evaluator.instrument import ContractError, charge, score_batch


class Const(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.v = v

    def forward(self, tokens):
        return torch.zeros(tokens.shape[0], tokens.shape[1], self.v)


def test_uniform_logits_cost_log_v_per_target():
    tokens = torch.randint(0, 257, (3, 11))
    nats = score_batch(Const(257), tokens, 257)
    assert nats == pytest.approx(3 * 10 * math.log(257), rel=1e-6)


def test_extra_logit_columns_are_sliced_off():
    # V' = 300 > V = 257: only the first V columns form the distribution.
    tokens = torch.randint(0, 257, (2, 5))
    assert score_batch(Const(300), tokens, 257) == pytest.approx(2 * 4 * math.log(257), rel=1e-6)


def test_hand_computed_two_token_distribution():
    class Fixed(nn.Module):
        def forward(self, tokens):
            # p = softmax([ln 3, 0, 0]) = [3/5, 1/5, 1/5] at every position
            logits = torch.zeros(tokens.shape[0], tokens.shape[1], 3)
            logits[..., 0] = math.log(3)
            return logits

    tokens = torch.tensor([[0, 0, 1, 2]])
    expected = -(math.log(3 / 5) + math.log(1 / 5) + math.log(1 / 5))
    assert score_batch(Fixed(), tokens, 3) == pytest.approx(expected, rel=1e-6)


def test_targets_are_never_reduced_modulo_output_size():
    tokens = torch.tensor([[0, 5, 6]])
    with pytest.raises(ContractError, match=r"shape \[1, 3, 2\].*V'>=257"):
        score_batch(Const(2), tokens, 257)


@pytest.mark.parametrize(
    "out, needle",
    [
        (lambda t: (torch.zeros(*t.shape, 9),), "returned tuple"),
        (lambda t: torch.zeros(t.shape[0], t.shape[1], 9, dtype=torch.int64), "dtype torch.int64"),
        (lambda t: torch.zeros(t.shape[0] * t.shape[1], 9), r"shape \[6, 9\]"),
    ],
)
def test_bad_outputs_are_contract_errors(out, needle):
    class M(nn.Module):
        def forward(self, tokens):
            return out(tokens)

    with pytest.raises(ContractError, match=needle):
        score_batch(M(), torch.zeros(2, 3, dtype=torch.int64), 9)


def test_dropout_model_is_scored_in_eval_mode_and_mode_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Dropout(0.9), nn.Linear(8, 20))
    model.train()
    model[2].eval()  # mixed modes must come back exactly as they were
    tokens = torch.randint(0, 20, (4, 9))
    with torch.no_grad():
        ref = -torch.log_softmax(model[2](model[0](tokens)), -1)[:, :-1].gather(-1, tokens[:, 1:, None]).double().sum()
    a = score_batch(model, tokens, 20)
    b = score_batch(model, tokens, 20)
    assert a == b == pytest.approx(float(ref), rel=1e-9)
    assert [m.training for m in model] == [True, True, False] and model.training


def test_scoring_keeps_no_graph():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    score_batch(model, torch.randint(0, 10, (2, 4)), 10)
    assert all(p.grad is None for p in model.parameters())


def test_nonfinite_charge():
    assert charge(12.5, 10, 257) == (12.5, True)
    nats, finite = charge(float("nan"), 10, 257)
    assert not finite and nats == pytest.approx(2 * math.log(257) * 10)
    assert charge(float("inf"), 3, 50257)[0] / 3 / math.log(2) == pytest.approx(2 * math.log2(50257))


class Causal(nn.Module):
    """Embedding + causal running mean: position t sees tokens 0..t only."""

    def __init__(self, v):
        super().__init__()
        self.emb = nn.Embedding(v, 6)
        self.head = nn.Linear(6, v)

    def forward(self, tokens):
        x = self.emb(tokens).cumsum(1) / torch.arange(1, tokens.shape[1] + 1).view(1, -1, 1)
        return self.head(x)


class Peek(Causal):
    """Adds a bonus to the logit of the NEXT token: the cheat the probe must catch."""

    def __init__(self, v, gate):
        super().__init__(v)
        self.gate = gate

    def forward(self, tokens):
        nxt = torch.roll(tokens, -1, dims=1)
        return super().forward(tokens).scatter_add(-1, nxt.unsqueeze(-1), torch.full((*tokens.shape, 1), self.gate))


@pytest.mark.parametrize("k", [1, 5, 11])
def test_causal_model_passes_every_probe_with_the_same_nats(k):
    torch.manual_seed(0)
    model, tokens = Causal(30), torch.randint(0, 30, (3, 12))
    assert score_batch(model, tokens, 30, probe=(k, 7)) == score_batch(model, tokens, 30)


@pytest.mark.parametrize("k", [1, 6, 11])
def test_model_reading_the_next_token_fails_the_probe(k):
    torch.manual_seed(0)
    tokens = torch.randint(0, 30, (2, 12))
    cheat = Peek(30, 5.0)
    honest_nats = score_batch(Causal(30), tokens, 30)
    torch.manual_seed(0)
    assert score_batch(Peek(30, 5.0), tokens, 30) < honest_nats  # the cheat would pay off unprobed
    with pytest.raises(ContractError, match=f"not causal: its logits at positions < {k} changed"):
        score_batch(cheat, tokens, 30, probe=(k, 3))


def test_probe_does_not_consume_the_rng():
    class Noisy(Causal):
        def forward(self, tokens):
            torch.rand(5)  # draws from the RNG without changing the logits
            return super().forward(tokens)

    torch.manual_seed(3)
    score_batch(Noisy(30), torch.randint(0, 30, (2, 8)), 30, probe=(4, 1))
    after_probe = torch.rand(1)
    torch.manual_seed(3)
    score_batch(Noisy(30), torch.randint(0, 30, (2, 8)), 30)
    assert torch.equal(after_probe, torch.rand(1))


def test_a_model_that_mixes_rows_fails_the_probe():
    class MixRows(Causal):
        def forward(self, tokens):
            out = super().forward(tokens)
            return out + out.roll(-1, dims=0) * 0.5  # row r sees row r+1: the stream's future

    torch.manual_seed(0)
    tokens = torch.randint(0, 30, (3, 10))
    with pytest.raises(ContractError, match="not causal"):
        score_batch(MixRows(30), tokens, 30, probe=(9, 1, 1))


def test_a_probe_of_any_row_matches_the_scored_forward_of_a_causal_model():
    torch.manual_seed(1)
    model, tokens = Causal(50), torch.randint(0, 50, (8, 33))
    for row in range(8):
        assert score_batch(model, tokens, 50, probe=(16, 5, row)) == score_batch(model, tokens, 50)


HUGE_PAGES_PROBE = """
import torch
from torch import nn
from prism_challenge.evaluator.instrument import score_batch
torch.manual_seed(0)
torch.set_num_threads(2)
model = nn.Sequential(nn.Embedding(50257, 32), nn.Linear(32, 50257))  # logits of 4*128*50257*4 B = 103 MB
opt = torch.optim.SGD(model.parameters(), lr=0.5)
scores = []
for step in range(3):  # train between scorings: freed blocks are reused (or not) by the allocator
    tokens = torch.randint(0, 50257, (4, 128))
    scores.append(score_batch(model, tokens, 50257))
    small = model[1](model[0](tokens[:, :16]))  # 8 MB of logits: a heap block under the 32 MiB threshold
    loss = model(tokens).logsumexp(-1).mean() + small.square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(repr(scores))
"""


def test_compute_env_allocator_settings_change_no_score_beyond_the_last_bits():
    # the ranks run with huge pages and glibc's fixed thresholds (launcher.compute_env). A bare
    # loop is not bit for bit reproducible from process to process on a CPU, whatever the
    # allocator: about 1 process in 40 trains to 5593.180262565613 nats at step 1 instead of
    # 5593.180260658264 (issue 27; the same with ASLR off, `setarch -R`). So this test asserts what
    # holds: under every allocator setting, and from process to process, the scores agree to 1e-9
    import os
    import subprocess
    import sys

    from prism_challenge.evaluator.launcher import compute_env

    env = compute_env(2)
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20) and int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 40
    allocator = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    base = {k: v for k, v in {**os.environ, **env}.items() if k not in allocator}
    variants = {"glibc defaults, 4 KiB pages": base, "huge pages only": {**base, "THP_MEM_ALLOC_ENABLE": "1"},
                "compute_env": {**os.environ, **env}, "compute_env, another process": {**os.environ, **env}}
    out = {name: subprocess.run([sys.executable, "-c", HUGE_PAGES_PROBE], env=e, check=True, capture_output=True,
                                text=True).stdout.strip() for name, e in variants.items()}
    scores = eval(out["compute_env"])  # noqa: S307 - our own probe's repr of a list of floats
    assert len(scores) == 3 and all(s > 0 for s in scores) and scores[2] != scores[0]  # it trained
    for name, got in out.items():
        assert eval(got) == pytest.approx(scores, rel=1e-9, abs=0), (name, out)  # noqa: S307


def test_non_finite_logits_are_charged_not_called_non_causal():
    class Diverged(nn.Module):
        def forward(self, tokens):
            return torch.full((tokens.shape[0], tokens.shape[1], 257), float("nan"))

    tokens = torch.randint(0, 257, (2, 16))
    nats = score_batch(Diverged(), tokens, 257, probe=(5, 3, 1))  # probed: no "not causal" error
    assert math.isnan(nats) and charge(nats, 30, 257) == (2 * math.log(257) * 30, False)


class _RewritesItsTargets(torch.nn.Module):
    """Writes the token it predicts into the harness's tensor before the targets are read (red
    team: 2.50 bpb against 7.71 honest, no flag)."""

    def __init__(self, v: int):
        super().__init__()
        self.v = v
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens):
        tokens[:, 1:] = 0
        out = torch.zeros(tokens.shape[0], tokens.shape[1], self.v)
        out[:, :, 0] = 60.0
        return out


def test_a_model_that_writes_its_input_is_scored_on_the_true_targets():
    v = 7
    tokens = torch.tensor([[1, 2, 3, 0, 4], [5, 6, 0, 1, 2]], dtype=torch.int64)
    truth = tokens.clone()
    nats = score_batch(_RewritesItsTargets(v), tokens, v, probe=(2, 1))
    lse = math.log(math.exp(60.0) + (v - 1))  # log-sum-exp of one logit of 60 and v - 1 zeros
    expected = sum(lse - (60.0 if int(t) == 0 else 0.0) for t in truth[:, 1:].flatten())
    assert nats == pytest.approx(expected, rel=1e-9)
    assert nats > 100  # 6 of the 8 targets are not 0: about 60 nats each


def test_the_heldout_rows_are_copied_before_the_model_sees_them():
    import numpy as np

    from prism_challenge.audit.heldout import score_rows

    rows = np.array([[1, 2, 3, 0, 4], [5, 6, 0, 1, 2]], dtype=np.int64)
    kept = rows.copy()
    got = score_rows(_RewritesItsTargets(7), [rows], 7, "cpu")
    assert np.array_equal(rows, kept)  # the trusted side's rows: untouched
    assert got["nats"] == pytest.approx(score_batch(_RewritesItsTargets(7), torch.from_numpy(kept.copy()), 7), rel=1e-12)
