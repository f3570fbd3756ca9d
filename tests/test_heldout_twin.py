"""The held-out twin is the model as it scored batch 0 (issue 26's red team, finding F1).

The twin once took the *trained* model's dtypes. A loop that changed a tensor's dtype after batch
0 then made the twin "init values cast to later dtypes", a model that never scored anything, and a
forward that amplifies the rounding made that twin as bad as it liked: ``heldout_delta`` 81.29
against 0.027 for the same run without the cast, at no cost to the stream. The twin now takes the
dtypes of the audit's snapshot of step 0 (:func:`prism_challenge.audit.auditstage.twin_dtypes`).
"""

from __future__ import annotations

import pytest
import torch

from prism_challenge.audit.auditstage import AUDIT_DIR, twin_dtypes
from prism_challenge.evaluator.snapfile import snapshot_dtypes, write_snapshot
from prism_challenge.evaluator.snapshots import snapshot_name
from prism_challenge.pipeline import EvalOptions, evaluate

from helpers import write_bundle

ARCH = """
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)
        self.register_buffer("c", torch.tensor(1.0001))  # float32 as built
        self.register_buffer("r", torch.tensor(10001))  # an integer: no dtype to follow

    def forward(self, tokens):
        gap = (self.c.float() - self.r.float() / 10000.0).abs() * 1e6  # 0 at init in float32
        return self.head(self.emb(tokens)) * (1.0 + gap)


def build_model(ctx):
    return TinyLM(ctx.vocab_size)
"""

LOOP = """
import torch
import torch.nn.functional as F


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = True
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if first:
            first = False
            with torch.no_grad():
                {change}
                model.r.fill_(10000)
"""


def test_twin_dtypes_are_those_of_the_step_0_snapshot(tmp_path):
    assert twin_dtypes(tmp_path) is None  # no audit: the twin keeps build_model's dtypes
    (tmp_path / AUDIT_DIR).mkdir(parents=True)
    state = {"w": torch.ones(2, 3, dtype=torch.bfloat16), "c": torch.tensor(1.0), "n": torch.tensor(3)}
    write_snapshot(state, tmp_path / AUDIT_DIR / snapshot_name(0))
    want = {"w": "torch.bfloat16", "c": "torch.float32", "n": "torch.int64"}
    assert snapshot_dtypes(tmp_path / AUDIT_DIR / snapshot_name(0)) == want
    assert twin_dtypes(tmp_path) == want
    (tmp_path / AUDIT_DIR / snapshot_name(0)).write_bytes(b"not a snapshot")
    assert twin_dtypes(tmp_path) is None


def _run(tmp_path, name, change):
    bundle = write_bundle(tmp_path / name, ARCH, LOOP.replace("{change}", change))
    o = evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / f"run-{name}"), device="cpu", threads=1,
                             seq_len=64, token_budget=2048, heldout_bytes=20_000))
    assert o.failure is None, o.failure
    return o.manifest


@pytest.mark.slow
def test_a_dtype_changed_after_batch_0_does_not_reach_the_twin(tmp_path):
    attack = _run(tmp_path, "attack", "model.c = torch.ones((), dtype=torch.bfloat16, device=batch.tokens.device)")
    control = _run(tmp_path, "control", "model.c.fill_(1.0)")
    a, c = attack["verdict"]["heldout"], control["verdict"]["heldout"]
    assert attack["score"]["prequential_bpb"] == control["score"]["prequential_bpb"]  # the same stream
    assert attack["audit"]["passed"] and control["audit"]["passed"]
    # the twin is build_model's module in the dtypes that scored batch 0 (float32 in both): the
    # same model, so the same nats to the last bit; before the fix the attack's twin was cast to
    # bf16, its gap 100 and its logits x101 (val_bpb_twin 85.57 against 4.31)
    assert a["batch_nats_twin"] == c["batch_nats_twin"]
    assert a["val_bpb_twin"] == c["val_bpb_twin"] < 10
