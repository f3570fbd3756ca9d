"""The researcher's loop end to end: byte budgets, seed repeats, compiled modules, the console."""

import json
import statistics

import pytest

from prism_challenge.cli import main
from prism_challenge.evaluate import EvalOptions, evaluate
from prism_challenge.run_manifest import MANIFEST_NAME

from helpers import UNIFORM_ARCH, write_bundle

pytestmark = pytest.mark.slow


def _run(tmp_path, bundle, name, **kw):
    kw.setdefault("run_gates", False)
    kw.setdefault("heldout_bytes", 0)
    return evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / name), device="cpu", **kw))


def test_byte_budget_covers_the_same_text_with_either_tokenizer(tmp_path):
    budget = 3000
    runs = {}
    for tok in ("bytes", "gpt2"):
        bundle = write_bundle(tmp_path / tok, UNIFORM_ARCH, tokenizer=tok, batch=2, seq_len=32)
        o = _run(tmp_path, bundle, f"run-{tok}", byte_budget=budget, seq_len=64)
        assert o.failure is None, o.failure
        m = o.manifest
        cum = m["curve"]["cumulative_bytes"]
        # the stream stops at the first batch boundary at or past the budget
        assert m["stream"]["stop_reason"] == "byte_budget" and m["budgets"]["byte_budget"] == budget
        assert cum[-1] >= budget > cum[-2]
        assert m["score"]["bytes"] == cum[-1]
        runs[tok] = m
    # both cover the first ~3000 bytes: a batch of gpt2 rows covers ~4x the text of a bytes batch
    assert runs["bytes"]["stream"]["batches"] > runs["gpt2"]["stream"]["batches"]
    assert budget <= runs["gpt2"]["score"]["bytes"] < 2 * budget
