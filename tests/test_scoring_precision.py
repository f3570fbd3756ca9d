"""Scoring that fits and probes exact in any precision: blocks, autocast, wrappers, staging."""

import math
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from prism_challenge.audit.blindprobe import blind_probes, compare
from prism_challenge.intake.bundle import BundleError, load_bundle
from prism_challenge.intake.spec import SCORING_AUTOCAST
from prism_challenge.evaluator import instrument
from prism_challenge.evaluator.instrument import (
    AUTOCAST_DTYPES, PROBE_TOLERANCE_NATS, ContractError, autocast_dtype, measure, position_logprobs,
    positions_logprobs, probe_precision, score_batch, target_logprobs)
from prism_challenge.evaluator.staging import Staging
from prism_challenge.evaluator.statedict import cpu_state, uncompiled
from prism_challenge.audit.heldout import score_rows


def _direct_nats(logits, tokens, v):
    """The independent path: float64 log_softmax of the whole batch, one gather, one sum."""
    lp = torch.log_softmax(logits[:, :-1, :v].double(), dim=-1)
    return float(-lp.gather(-1, tokens[:, 1:].unsqueeze(-1)).sum())


class Fixed(nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, tokens):
        return self.logits.clone()


@pytest.mark.parametrize("block_bytes", [1 << 30, 3 * 40 * 4 * 7, 40 * 4 * 5, 1])
def test_blocked_scoring_equals_the_direct_float64_computation(monkeypatch, block_bytes):
    # several rows per block, a row split into position blocks, one position per block
    monkeypatch.setattr(instrument, "SCORE_BLOCK_BYTES", block_bytes)
    torch.manual_seed(0)
    b, t, v = 5, 9, 40
    logits = torch.randn(b, t, v + 3) * 4  # V' > V: the extra columns are sliced off
    tokens = torch.randint(0, v, (b, t))
    nats = score_batch(Fixed(logits), tokens, v)
    direct = _direct_nats(logits, tokens, v)
    # float32 terms (the instrument's precision) summed in float64: each term within a few float32
    # ulps of the float64 value (1e-12 relative is out of reach of float32 terms: see the next test
    # for the blocks against the whole batch, which agree bit for bit)
    assert abs(nats - direct) <= b * (t - 1) * 4 * 2.0**-24 * (1 + abs(direct) / (b * (t - 1)))
    assert abs(nats - direct) / direct < 1e-6


def test_blocks_change_memory_not_figures(monkeypatch):
    # the instrument's float32 log-probabilities are bit for bit the same in any blocking, and the
    # float64 sum of the blocked values equals the direct float64 sum of the same float32 values
    torch.manual_seed(1)
    b, t, v = 4, 17, 50
    logits, tokens = torch.randn(b, t, v) * 3, torch.randint(0, v, (b, t))
    whole = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    for block_bytes in (1 << 30, 16 * v * 4, 3 * v * 4, 1):
        monkeypatch.setattr(instrument, "SCORE_BLOCK_BYTES", block_bytes)
        lp = target_logprobs(logits, tokens, v)
        assert torch.equal(lp, whole), block_bytes
        total = measure(Fixed(logits), tokens, v).nats
        assert total == float(-whole.double().sum())
        assert math.isclose(total, math.fsum(-float(x) for x in whole.flatten()), rel_tol=1e-12)
        points = ((0, 0), (3, 15), (2, 7), (3, 14), (0, 0))
        for row, pos in points:  # the blind probe's values are the scored ones
            assert float(position_logprobs(logits, row, pos, v)[tokens[row, pos + 1]]) == float(whole[row, pos])
        at_once = positions_logprobs(logits, points, v)  # each block computed once, points in order
        full = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        assert len(at_once) == len(points)
        assert all(torch.equal(lp, full[row, pos]) for lp, (row, pos) in zip(at_once, points))
    with pytest.raises(ValueError, match=r"position \(0, 16\) is outside"):
        positions_logprobs(logits, [(1, 2), (0, t - 1)], v)  # the last position has no target


def test_float64_sums_of_float32_terms_agree_with_float64_log_softmax_to_1e12_on_float64_logits():
    # with float64 logits the instrument's float32 cast is the only rounding: against a float64
    # log_softmax of float32-representable logits the two sums agree to float32 rounding per term
    torch.manual_seed(2)
    logits = (torch.randn(3, 6, 30) * 2).float().double()
    tokens = torch.randint(0, 30, (3, 6))
    lp32 = target_logprobs(logits, tokens, 30).double()
    direct = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert float((lp32 - direct).abs().max()) < 4e-6  # float32 log_softmax against float64
    # the float64 sum itself is exact to 1e-12 relative: the same terms summed by math.fsum
    assert math.isclose(float(lp32.sum()), math.fsum(float(x) for x in lp32.flatten()), rel_tol=1e-12)


def test_the_float64_sum_of_the_blocks_matches_a_float64_log_softmax_of_float64_logits_within_1e12(monkeypatch):
    # the sum itself: uniform logits make every float32 term the same number, float32(ln 64); the
    # blocked float64 sum is then exact to 1e-12 and within float32's half ulp of the float64 value
    monkeypatch.setattr(instrument, "SCORE_BLOCK_BYTES", 7 * 64 * 4)
    b, t, v = 6, 11, 64
    logits = torch.zeros(b, t, v)
    tokens = torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(3))
    nats = score_batch(Fixed(logits), tokens, v)
    direct = _direct_nats(logits.double(), tokens, v)
    assert direct == pytest.approx(b * (t - 1) * math.log(v), rel=1e-15)
    assert abs(nats - direct) / direct < 1e-7  # float32 log(64) is within half an ulp: 2**-24 relative
    exact32 = float(torch.tensor(math.log(v), dtype=torch.float32))
    assert abs(nats - b * (t - 1) * exact32) / nats < 1e-12  # the float64 sum adds no error of its own


class CausalMix(nn.Module):
    """A small causal model: embedding, causal mean over the past, two linear layers."""

    def __init__(self, v, d=16):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, v)

    def body(self, tokens):
        x = self.emb(tokens)
        x = x.cumsum(1) / torch.arange(1, tokens.shape[1] + 1, device=tokens.device).view(1, -1, 1)
        return self.head(torch.tanh(self.mid(x)))

    def forward(self, tokens):
        return self.body(tokens)


class Bf16Inside(CausalMix):
    """bf16 autocast inside its own forward: bf16 logits."""

    def forward(self, tokens):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.body(tokens)


class PeekBf16(Bf16Inside):
    """Reads the next token, in bf16: a bonus of 0.5 on its logit."""

    def forward(self, tokens):
        out = super().forward(tokens)
        nxt = torch.roll(tokens, -1, dims=1).unsqueeze(-1)
        return out.scatter_add(-1, nxt, torch.full(nxt.shape, 0.5, dtype=out.dtype))


class OffsetPeek(CausalMix):
    """The cheat a logit-relative tolerance let through: a huge offset on every logit (the scored
    distribution does not change) widens ``1e-4 * max|logit|`` to 10 nats; a bonus of 3 nats on
    the next token's logit then passed the old probe."""

    def forward(self, tokens):
        out = super().forward(tokens).double() + 1e5
        nxt = torch.roll(tokens, -1, dims=1).unsqueeze(-1)
        return out.scatter_add(-1, nxt, torch.full(nxt.shape, 3.0, dtype=out.dtype)).float()


@pytest.mark.parametrize("model_cls, autocast", [(Bf16Inside, None), (CausalMix, torch.bfloat16),
                                                 (CausalMix, torch.float16), (CausalMix, None)])
def test_an_honest_model_passes_every_probe_in_any_precision(model_cls, autocast):
    torch.manual_seed(4)
    model, v = model_cls(97), 97
    tokens = torch.randint(0, v, (6, 40))
    plain = measure(model, tokens, v, autocast=autocast)
    for k in (1, 7, 20, 39):
        for row in range(6):
            probed = measure(model, tokens, v, (k, 1 + 13 * row, row), autocast=autocast)
            assert probed.nats == plain.nats and torch.equal(probed.logprobs, plain.logprobs)
    expect = torch.bfloat16 if model_cls is Bf16Inside else (autocast or torch.float32)
    assert plain.precision == expect


def test_scoring_autocast_changes_the_forward_precision():
    torch.manual_seed(5)
    model, tokens = CausalMix(97), torch.randint(0, 97, (4, 30))
    fp32, bf16 = measure(model, tokens, 97), measure(model, tokens, 97, autocast=torch.bfloat16)
    assert fp32.precision == torch.float32 and bf16.precision == torch.bfloat16
    assert fp32.nats != bf16.nats and abs(fp32.nats - bf16.nats) / fp32.nats < 0.05  # bf16 rounding, same model


@pytest.mark.parametrize("model_cls, k", [(PeekBf16, 1), (PeekBf16, 25), (OffsetPeek, 10)])
def test_a_model_reading_the_next_token_is_caught_in_any_precision(model_cls, k):
    torch.manual_seed(6)
    model, tokens = model_cls(97), torch.randint(0, 97, (3, 30))
    honest = measure(CausalMix(97), tokens, 97).nats
    assert measure(model, tokens, 97).nats < honest  # it would pay off unprobed
    with pytest.raises(ContractError, match=f"not causal: its logits at positions < {k} changed"):
        measure(model, tokens, 97, (k, 5, 1))


def test_the_old_logit_relative_rule_let_the_offset_cheat_through():
    # the figures behind OffsetPeek's docstring: under the former rule (|diff| <= 1e-4 * max|logit|
    # on the row's logits) the probe passed with a 3-nat bonus on every next token
    torch.manual_seed(6)
    model, tokens = OffsetPeek(97), torch.randint(0, 97, (3, 30))
    with torch.no_grad():
        ref = model(tokens)[1:2, :10]
        changed = tokens[1:2].clone()
        changed[:, 10:] = (changed[:, 10:] + 5) % 97
        other = model(changed)[:, :10]
    assert float((other - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    assert measure(CausalMix(97), tokens, 97).nats - measure(model, tokens, 97).nats > 50


def test_probe_tolerances_and_precision():
    assert probe_precision(torch.float32, None) == torch.float32
    assert probe_precision(torch.float32, torch.bfloat16) == torch.bfloat16
    assert probe_precision(torch.float16, torch.bfloat16) == torch.bfloat16
    assert probe_precision(torch.float64) == torch.float64 and probe_precision() == torch.float64
    assert PROBE_TOLERANCE_NATS[torch.bfloat16] == torch.finfo(torch.bfloat16).eps
    assert PROBE_TOLERANCE_NATS[torch.float16] == torch.finfo(torch.float16).eps
    assert PROBE_TOLERANCE_NATS[torch.float32] == 1e-4
    assert tuple(AUTOCAST_DTYPES) == SCORING_AUTOCAST  # one list of names
    assert autocast_dtype(None) is None and autocast_dtype("fp32") is None
    assert autocast_dtype("bf16") is torch.bfloat16 and autocast_dtype("fp16") is torch.float16
    with pytest.raises(ValueError, match="scoring_autocast must be one of fp32, bf16, fp16"):
        autocast_dtype("int8")


def _bundle(tmp_path, yaml_text):
    (tmp_path / "architecture.py").write_text("def build_model(ctx):\n    pass\n")
    (tmp_path / "training.py").write_text("def train(ctx):\n    pass\n")
    (tmp_path / "prism.yaml").write_text(yaml_text)
    return tmp_path


@pytest.mark.parametrize("value, expect", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), (None, None)])
def test_prism_yaml_declares_the_scoring_autocast(tmp_path, value, expect):
    # not declared: None, and the run's profile chooses (scoringprecision.scoring_autocast)
    text = "tokenizer: bytes\n" + (f"scoring_autocast: {value}\n" if value else "")
    assert load_bundle(_bundle(tmp_path, text)).scoring_autocast == expect


@pytest.mark.parametrize("value", ["bfloat16", "int8", "16", "[bf16]", "true"])
def test_a_bad_scoring_autocast_names_the_field(tmp_path, value):
    with pytest.raises(BundleError) as err:
        load_bundle(_bundle(tmp_path, f"scoring_autocast: {value}\n"))
    assert err.value.rule == "prism:spec"
    assert "prism.yaml: field 'scoring_autocast' must be one of fp32, bf16, fp16" in str(err.value)


def test_heldout_scoring_and_the_blind_probe_pass_a_bf16_model_like_with_like():
    # the held-out process's scored value and the fresh process's value (here: a second model
    # instance with the same weights, as the fresh process builds and loads it) agree bit for bit
    torch.manual_seed(7)
    v = 97
    trained = Bf16Inside(v)
    fresh = Bf16Inside(v)
    fresh.load_state_dict(trained.state_dict())
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, v, (4, 32)).astype(np.int64) for _ in range(5)]
    probes = blind_probes(batches, b"k" * 32, v)
    scored = score_rows(trained, batches, v, "cpu", picks=[p[:3] for p in probes])  # every batch probed
    from prism_challenge.audit.blindprobe import logprobs_at

    seen = [logprobs_at(fresh, p[3], p[1], p[2] - 1, v, "cpu") for p in probes]
    assert {name for _, name in seen} == {"bfloat16"}
    for (b, row, k, _), full, (lp, _) in zip(probes, scored["picked"], seen):
        assert full == 0.0 - float(np.frombuffer(lp, dtype=np.float32)[batches[b][row, k]])
    compare(probes, batches, scored["picked"], [lp.hex() for lp, _ in seen], [n for _, n in seen], v)


def test_the_blind_probe_catches_a_bf16_model_that_reads_the_next_token():
    from prism_challenge.audit.blindprobe import BlindProbeError, logprobs_at

    torch.manual_seed(8)
    v = 97
    cheat = PeekBf16(v)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, v, (4, 32)).astype(np.int64) for _ in range(3)]
    probes = blind_probes(batches, b"k" * 32, v)
    scored = score_rows(cheat, batches, v, "cpu", probe=False, picks=[p[:3] for p in probes])
    seen = [logprobs_at(cheat, p[3], p[1], p[2] - 1, v, "cpu") for p in probes]
    with pytest.raises(BlindProbeError, match="contract: the trained model is not causal on held-out text"):
        compare(probes, batches, scored["picked"], [lp.hex() for lp, _ in seen], [n for _, n in seen], v)


def test_staging_on_cpu_is_the_received_batch():
    ids = np.arange(12, dtype=np.int64) * 7919
    t = Staging("cpu").tokens(bytearray(ids.tobytes()), 3, 4)
    assert t.dtype == torch.int64 and t.shape == (3, 4) and t.tolist() == ids.reshape(3, 4).tolist()
    assert not Staging("cpu").pinned and (Staging("cuda:0").pinned == torch.cuda.is_available())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_on_cuda_copies_through_one_pinned_buffer():
    s = Staging("cuda:0")
    outs = []
    for i in range(3):
        ids = np.arange(i * 100, i * 100 + 24, dtype=np.int64)
        outs.append((s.tokens(bytearray(ids.tobytes()), 4, 6), ids))
    assert s._buffer.is_pinned()
    for t, ids in outs:  # the buffer's reuse did not overwrite a batch still on its way
        assert t.device.type == "cuda" and t.cpu().flatten().tolist() == ids.tolist()


@pytest.fixture
def one_rank_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_scored_state_is_taken_through_compile_and_ddp_wrappers(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(9)
    model = CausalMix(11)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = {
        "compiled": torch.compile(model, backend="eager"),
        "ddp": DDP(model),
        "compiled ddp": torch.compile(DDP(model), backend="eager"),
        "ddp of compiled": DDP(torch.compile(model, backend="eager")),
        "data parallel": nn.DataParallel(model),
    }
    for name, w in wrapped.items():
        assert any(k.startswith(("_orig_mod.", "module.")) for k in w.state_dict()), name  # the wrapper's names
        assert uncompiled(w) is model, name
        state = cpu_state(w)
        assert sorted(state) == sorted(want), name
        assert all(torch.equal(state[k], want[k]) for k in want), name
    assert uncompiled(model) is model
