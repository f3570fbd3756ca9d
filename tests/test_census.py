"""The tensor census: what a forward reads from outside itself, counted against the parameter cap."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from prism_challenge.evaluator.census import TensorCensus, unique_elements
from prism_challenge.evaluator.instrument import score_batch
from prism_challenge.evaluator.interface import PrismContext
from prism_challenge.gates.param_count import count_unique_elements

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-1m"


def census_of(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    c = TensorCensus()
    with torch.no_grad(), c:
        out = model(tokens)
    return out, unique_elements(c.tensors(exclude=tokens))


HIDDEN: dict[str, torch.Tensor] = {}  # weights nothing in the model refers to


class HiddenTable(nn.Module):
    def __init__(self, v: int = 257, d: int = 64):
        super().__init__()
        HIDDEN["w"], HIDDEN["h"] = torch.randn(v, d), torch.randn(d, v)
        self.bias = nn.Parameter(torch.zeros(v))

    def forward(self, tokens):
        mask = torch.ones(tokens.shape[1], tokens.shape[1]).tril()  # made during the forward: not charged
        return mask[: tokens.shape[1], : tokens.shape[1]].sum() * 0 + HIDDEN["w"][tokens] @ HIDDEN["h"] + self.bias


def test_the_census_sees_weights_nothing_in_the_model_refers_to():
    model, tokens = HiddenTable(), torch.randint(0, 257, (2, 16))
    assert count_unique_elements(model)[0] == 257  # only the bias is reachable from the model
    _, read = census_of(model, tokens)
    assert read == 257 * 64 + 64 * 257 + 257  # 33,153: w, h and the bias, not the tokens nor the mask


def test_a_complex_table_read_as_float32_pays_for_every_float():
    table = torch.randn(100, 8, dtype=torch.complex64)  # 800 complex = 1,600 float32 numbers

    class AsReal(nn.Module):
        def forward(self, tokens):
            return torch.view_as_real(table)[tokens].reshape(*tokens.shape, 16)

    assert census_of(AsReal(), torch.randint(0, 100, (1, 4)))[1] == 1600
    wide = torch.randn(1000, dtype=torch.float64)  # read as 2,000 float32

    class Reinterpreted(nn.Module):
        def forward(self, tokens):
            return wide.view(torch.float32)[: tokens.numel()].reshape(*tokens.shape, 1).expand(*tokens.shape, 4)

    assert census_of(Reinterpreted(), torch.randint(0, 4, (1, 4)))[1] == 2000


def test_a_tensor_built_from_python_numbers_in_a_reused_block_is_charged():
    hidden = [float(i) for i in range(65536)]  # weights kept as Python numbers

    class Rebuilt(nn.Module):
        def forward(self, tokens):
            scratch = torch.ones(65536)  # produced, then freed: its block is free for the next tensor
            del scratch
            w = torch.tensor(hidden)  # not produced by an operator of this forward: charged
            return w[: tokens.numel()].reshape(*tokens.shape, 1).expand(*tokens.shape, 4)

    assert census_of(Rebuilt(), torch.randint(0, 4, (1, 4)))[1] == 65536


def test_a_view_of_a_weight_is_charged_for_the_whole_weight_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Parameter(torch.randn(257, 8))

        def forward(self, tokens):  # the head is the embedding's transpose: one storage
            return self.emb[tokens] @ self.emb.t() + self.emb[:1, :1].sum()

    model, tokens = Tied(), torch.randint(0, 257, (1, 4))
    assert census_of(model, tokens)[1] == 257 * 8


def test_the_census_leaves_the_logits_bitwise_unchanged_on_the_example():
    spec = importlib.util.spec_from_file_location("tiny_arch", EXAMPLE / "architecture.py")
    arch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arch)
    torch.manual_seed(0)
    ctx = PrismContext(seed=0, vocab_size=50257, sequence_length=64, max_parameters=10**9, device="cpu",
                       artifacts_dir="")
    model = arch.build_model(ctx).eval()
    tokens = torch.randint(0, 50257, (2, 64))
    with torch.no_grad():
        plain = model(tokens)
    traced, read = census_of(model, tokens)
    assert torch.equal(plain, traced)
    assert read == count_unique_elements(model)[0]  # an honest model reads exactly what it registers
    # and the recorded loss is the same number with or without a census
    assert score_batch(model, tokens, 50257) == score_batch(model, tokens, 50257, census=TensorCensus())
