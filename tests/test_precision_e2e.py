"""Probes in bf16 and in lockstep, end to end through prism eval (issue 14, items 3 and 5)."""

import pytest

from prism_challenge.pipeline import EvalOptions, evaluate
from prism_challenge.evaluator import feedbatch

from helpers import write_bundle

pytestmark = pytest.mark.slow

BF16_ARCH = """
import torch
from torch import nn


class Bf16LM(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.emb = nn.Embedding(v, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, v)

    def forward(self, tokens):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled={inside}):
            x = self.emb(tokens)
            x = x.cumsum(1) / torch.arange(1, tokens.shape[1] + 1, device=tokens.device).view(1, -1, 1)
            out = self.head(torch.tanh(self.mid(x)))
        {peek}
        return out


def build_model(ctx):
    return Bf16LM(ctx.vocab_size)
"""

PEEK = ("nxt = torch.roll(tokens, -1, dims=1).unsqueeze(-1)\n"
        "        out = out.scatter_add(-1, nxt, torch.full(nxt.shape, 2.0, dtype=out.dtype))")

BF16_LOOP = """
import torch
import torch.nn.functional as F


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        tokens = batch.tokens
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def _run(tmp_path, bundle, name="run", **kw):
    kw.setdefault("seq_len", 64)
    return evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / name), device="cpu", threads=1, **kw))


@pytest.mark.parametrize("inside, declared", [(True, None), (False, "bf16")])
def test_a_bf16_model_passes_every_probe_stream_and_heldout(tmp_path, inside, declared):
    # autocast in its own forward and training step, or none but scoring_autocast: bf16 declared
    bundle = write_bundle(tmp_path / "b", BF16_ARCH.format(inside=inside, peek="pass"), BF16_LOOP)
    if declared:
        (bundle / "prism.yaml").write_text(f"tokenizer: bytes\nscoring_autocast: {declared}\n")
    o = _run(tmp_path, bundle, token_budget=6000, heldout_bytes=20_000, run_gates=True)
    assert o.failure is None, o.failure
    m = o.manifest
    assert m["stream"]["batches"] > feedbatch.PROBE_FIRST  # the first batches are always probed
    v = m["verdict"]
    assert v["heldout_error"] is None and v["flags"] == [], (v["heldout_error"], v["flags"])
    assert v["heldout"]["blind_probes"] > 0 and v["final_score"] > 0
    assert m["config"]["scoring_autocast"] == (declared or "fp32")


def test_a_bf16_model_that_reads_the_next_token_is_still_caught(tmp_path):
    bundle = write_bundle(tmp_path / "b", BF16_ARCH.format(inside=True, peek=PEEK), BF16_LOOP)
    o = _run(tmp_path, bundle, token_budget=6000, heldout_bytes=0)
    assert o.failure is not None and o.failure.stage == "contract", o.failure
    assert "the model is not causal" in o.failure.message and "bfloat16 tolerance" in o.failure.message


ALL_REDUCE_ARCH = """
import torch
import torch.distributed as dist
from torch import nn


class Sharded(nn.Module):
    # a collective in every forward, as tensor- and expert-parallel models have
    def __init__(self, v):
        super().__init__()
        self.emb = nn.Embedding(v, 16)
        self.head = nn.Linear(16, v)

    def forward(self, tokens):
        x = self.emb(tokens)
        if dist.is_initialized():
            ones = torch.ones(1, device=tokens.device)
            dist.all_reduce(ones)
            x = x * (ones / dist.get_world_size())
        x = x.cumsum(1) / torch.arange(1, tokens.shape[1] + 1, device=tokens.device).view(1, -1, 1)
        return self.head(x)


def build_model(ctx):
    return Sharded(ctx.vocab_size)
"""

DDP_LOOP = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


def train(ctx):
    dist.init_process_group("gloo")
    model = DistributedDataParallel(ctx.build_model().to(ctx.device))  # the wrapper is the scored module
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=32):
        tokens = batch.tokens
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
"""


def test_a_collective_inside_forward_scores_at_nproc_2_with_probes_on(tmp_path):
    # probes drawn per step on every rank: each rank runs the probe's forward on the same steps, so
    # the all_reduce inside forward stays matched; the DDP wrapper's state reaches the held-out stage
    bundle = write_bundle(tmp_path / "b", ALL_REDUCE_ARCH, DDP_LOOP)
    o = _run(tmp_path, bundle, nproc=2, step_budget=40, heldout_bytes=20_000, run_gates=True, seq_len=32,
             rank_timeout=60)
    assert o.failure is None, o.failure
    m = o.manifest
    assert m["stream"]["batches"] == 40 and m["compute"]["world_size"] == 2
    digests = m["model"]["state_sha256_per_rank"]
    assert digests["0"] == digests["1"]
    v = m["verdict"]
    assert v["heldout_error"] is None and v["flags"] == [], (v["heldout_error"], v["flags"])
    assert v["heldout"]["val_bpb_trained"] < v["heldout"]["val_bpb_twin"]
