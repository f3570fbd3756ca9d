"""Mixed precision, scored as it ran (issue 26, items 1, 5 and 8).

* the harness's scoring forward runs under the autocast and attention kernels the harness sets,
  never those of the loop it runs inside (``evaluator/scoringstate.py``);
* a snapshot or trained state is loaded in its own dtypes (``statedict.load_scored_state``);
* the scoring precision comes from the bundle's ``prism.yaml``, else the profile (``prism-v2``:
  bf16), and the manifest records it;
* ``prism verify`` refuses a CUDA run on a machine without CUDA, naming the run's device;
* end to end: the example with its model cast to bf16, and the example inside
  ``torch.autocast``, score with their audit passed (the example's variants, ``bench/variants.py``), their held-out
  scores the trained model's own dtypes, and ``prism verify`` passes on both.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from prism_challenge.intake.bundle import Bundle
from prism_challenge.intake.spec import Entrypoint
from prism_challenge.evaluator.instrument import measure
from prism_challenge.evaluator.scoringstate import SDPA_BACKENDS, scoring_state
from prism_challenge.evaluator.statedict import StateError, cast_unsaved_buffers, in_dtypes_of, load_scored_state
from prism_challenge.options import EvalOptions, OptionsError
from prism_challenge.profiles import ProfileError, load_profile
from prism_challenge.score.scoringprecision import scoring_autocast, scoring_record

from helpers import EXAMPLE, REPO

sys.path.insert(0, str(REPO / "bench"))
from variants import write_variant  # noqa: E402

V = 300


def example_module(path=EXAMPLE / "architecture.py"):
    spec = importlib.util.spec_from_file_location(f"prism_example_arch_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_model(seed=0, v=V):
    torch.manual_seed(seed)
    ctx = SimpleNamespace(vocab_size=v, max_seq_len=64, sequence_length=64)
    return example_module().build_model(ctx)


def _state():
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            [b.name for b in torch.nn.attention._cur_sdpa_kernel_backends()], torch._C._get_sdp_priority_order())


# -- the harness's ambient state -----------------------------------------------------------------
@pytest.mark.parametrize("ambient", ["autocast bf16", "autocast fp16", "sdpa math", "both"])
def test_the_loops_autocast_and_sdpa_kernel_do_not_change_the_scored_nats(ambient):
    model, tokens = example_model(), torch.randint(0, V, (3, 64), generator=torch.Generator().manual_seed(1))
    plain = measure(model, tokens, V)
    with torch.no_grad():  # the same forward without the harness's state: the loop's context does change it
        bare = model(tokens)
    contexts = {
        "autocast bf16": [torch.autocast("cpu", dtype=torch.bfloat16)],
        "autocast fp16": [torch.autocast("cpu", dtype=torch.float16)],
        "sdpa math": [sdpa_kernel(SDPBackend.MATH)],
        "both": [torch.autocast("cpu", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH)],
    }[ambient]
    before = _state()
    for c in contexts:
        c.__enter__()
    try:
        inside = _state()
        with torch.no_grad():
            loops = model(tokens)
        assert not torch.equal(loops.float(), bare)  # what the scoring forward inherited before issue 26
        scored = measure(model, tokens, V, (20, 7, 1))  # with a causality probe: its rerun too
        assert scored.nats == plain.nats and torch.equal(scored.logprobs, plain.logprobs)
        assert scored.precision == torch.float32
        bf16 = measure(model, tokens, V, autocast=torch.bfloat16)  # the run's autocast, whatever the loop's
        assert _state() == inside  # the loop's state is given back
    finally:
        for c in reversed(contexts):
            c.__exit__(None, None, None)
    assert _state() == before
    assert bf16.nats == measure(model, tokens, V, autocast=torch.bfloat16).nats != plain.nats
    assert bf16.precision == torch.bfloat16


def test_scoring_state_pins_the_kernels_and_restores_the_callers_order():
    # torch's own default flags and order: a loop that never picks a kernel sees no change
    default = (torch.nn.attention._cur_sdpa_kernel_backends(), torch._C._get_sdp_priority_order())
    with scoring_state("cpu", None):
        assert (torch.nn.attention._cur_sdpa_kernel_backends(), torch._C._get_sdp_priority_order()) == default
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        outside = _state()
        with scoring_state("cpu", None):
            enabled, order = torch.nn.attention._cur_sdpa_kernel_backends(), torch._C._get_sdp_priority_order()
            assert set(enabled) == set(SDPA_BACKENDS)
            assert order == [int(b) for b in SDPA_BACKENDS]  # flash, efficient, math, cudnn, overrideable
            assert not torch.is_autocast_enabled("cpu")
        with scoring_state("cpu", torch.float16):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        assert _state() == outside


def test_the_loops_autocast_cache_does_not_reach_the_scoring_forward():
    # a loop inside one long torch.autocast: its forward caches bf16 casts of the weights, its
    # optimizer then changes the weights in place; the scoring forward (bf16 autocast, as under
    # prism-v2) must cast the weights as they are now, as a fresh process does
    model, tokens = example_model(), torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens).float().mean().backward()  # populates the autocast cache (leaf weights that need grad)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05)
        scored = measure(model, tokens, V, autocast=torch.bfloat16)
    fresh = example_model(seed=5)
    fresh.load_state_dict(model.state_dict())
    assert scored.nats == measure(fresh, tokens, V, autocast=torch.bfloat16).nats


# -- snapshots in their own dtypes ---------------------------------------------------------------
class Rope(nn.Module):
    """A linear layer and a cache ``build_model`` makes again (``persistent=False``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.linspace(0, 1, 4), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def test_a_bf16_state_is_loaded_in_bf16_and_its_unsaved_buffers_follow():
    trained = Rope().to(torch.bfloat16)
    with torch.no_grad():
        trained.lin.weight.add_(0.01)
    sd = {k: v.clone() for k, v in trained.state_dict().items()}
    fresh = Rope()
    load_scored_state(fresh, sd)
    assert fresh.lin.weight.dtype == torch.bfloat16 and torch.equal(fresh.lin.weight, trained.lin.weight)
    assert isinstance(fresh.lin.weight, nn.Parameter) and fresh.lin.weight.requires_grad
    assert fresh.count.dtype == torch.int64
    assert fresh.cache.dtype == torch.bfloat16 and torch.equal(fresh.cache, trained.cache)  # as .to(bf16) made it
    x = torch.randn(2, 4).to(torch.bfloat16)
    assert torch.equal(fresh.lin(x), trained.lin(x))
    old = Rope()
    old.load_state_dict(sd)  # the former load: bf16 values copied into float32 parameters
    assert old.lin.weight.dtype == torch.float32 and not torch.equal(old.lin(x.float()), trained.lin(x).float())


def test_a_model_built_in_bf16_keeps_its_float32_unsaved_buffers():
    # build_model itself makes bf16 weights and a float32 table (as Llama-style code keeps its
    # rotary frequencies): nothing was cast, so the re-built table stays float32, as in the stream
    class Built(Rope):
        def __init__(self):
            super().__init__()
            self.lin.to(torch.bfloat16)

    fresh = Built()
    load_scored_state(fresh, {k: v.clone() for k, v in Built().state_dict().items()})
    assert fresh.lin.weight.dtype == torch.bfloat16 and fresh.cache.dtype == torch.float32


def test_mixed_dtypes_leave_the_unsaved_buffers_as_built():
    m = Rope()
    m.lin.to(torch.bfloat16)  # a model cast in parts: the bias and weight bf16, nothing says the cache was
    fresh = Rope()
    load_scored_state(fresh, {**m.state_dict(), "count": torch.zeros((), dtype=torch.float16)})
    assert fresh.cache.dtype == torch.float32


def test_a_state_of_another_shape_or_name_or_kind_is_refused():
    sd = Rope().state_dict()
    with pytest.raises(RuntimeError, match="size mismatch for lin.weight"):
        load_scored_state(Rope(), {**sd, "lin.weight": torch.zeros(5, 4, dtype=torch.bfloat16)})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_scored_state(Rope(), {**sd, "extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="Missing key"):
        load_scored_state(Rope(), {k: v for k, v in sd.items() if k != "count"})
    with pytest.raises(StateError, match="not a state_dict of named tensors"):
        load_scored_state(Rope(), [1, 2])


def test_the_twin_takes_the_trained_dtypes():
    trained = Rope().to(torch.bfloat16).state_dict()
    twin = Rope()
    want = twin.lin.weight.detach().to(torch.bfloat16)
    in_dtypes_of(twin, trained)
    assert twin.lin.weight.dtype == torch.bfloat16 and torch.equal(twin.lin.weight, want)
    assert twin.cache.dtype == torch.bfloat16 and twin.count.dtype == torch.int64
    keep = Rope()
    cast_unsaved_buffers(keep, {}, {})  # nothing to go by: as built
    assert keep.cache.dtype == torch.float32


# -- the scoring precision: profile, bundle, manifest --------------------------------------------
def test_profiles_state_their_scoring_precision():
    assert load_profile("local").options["scoring_autocast"] == "fp32" == EvalOptions(bundle="x").scoring_autocast
    assert load_profile("prism-v2").options["scoring_autocast"] == "bf16"
    with pytest.raises(OptionsError, match="scoring_autocast = 'tf32': must be one of fp32, bf16, fp16"):
        EvalOptions(bundle="x", scoring_autocast="tf32")


def test_a_bad_profile_scoring_precision_is_named(tmp_path):
    text = (REPO / "src/prism_challenge/profiles/local.toml").read_text()
    text = text.replace('autocast = "fp32"', 'autocast = "tf32"')
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(ProfileError, match=r"p.toml: \[scoring\] autocast = 'tf32': must be one of"):
        load_profile(str(tmp_path / "p.toml"))


@pytest.mark.parametrize("declared, profile, expect", [
    (None, "fp32", ("fp32", "profile")), (None, "bf16", ("bf16", "profile")),
    ("fp32", "bf16", ("fp32", "bundle")), ("bf16", "fp32", ("bf16", "bundle"))])
def test_the_bundles_declared_autocast_wins_over_the_profiles(declared, profile, expect):
    ep = Entrypoint("architecture.py", "build_model")
    bundle = Bundle(REPO, ep, Entrypoint("training.py", "train"), "gpt2", {}, declared)
    opts = EvalOptions(bundle="x", scoring_autocast=profile)
    assert scoring_autocast(opts, bundle) == expect
    assert scoring_record(opts, bundle) == {"scoring_autocast": expect[0], "scoring_autocast_source": expect[1],
                                            "scoring_sdpa": ["flash_attention", "efficient_attention", "math",
                                                             "cudnn_attention", "overrideable"]}


# -- prism verify of a CUDA run without CUDA -----------------------------------------------------
def test_verify_refuses_a_cuda_run_without_cuda_naming_the_device(monkeypatch):
    from prism_challenge.manifest import verify_audit

    monkeypatch.setattr(verify_audit, "_cuda", lambda: False)
    m = {"compute": {"device": "cuda", "device_name": "NVIDIA H200", "torch_version": "2.11.0+cu128",
                     "gpu": {"compute_capability": "9.0"}}, "config": {"scoring_autocast": "bf16"}}
    with pytest.raises(ValueError) as err:
        verify_audit.rescoring_device(m)
    assert str(err.value).startswith("the run was made on CUDA (NVIDIA H200, compute capability 9.0, torch "
                                     "2.11.0+cu128) and this machine has no CUDA device")
    assert "verify it on a machine with CUDA" in str(err.value)
    monkeypatch.setattr(verify_audit, "_cuda", lambda: True)
    assert verify_audit.rescoring_device(m) == "cuda"
    assert verify_audit.rescoring_device({"compute": {"device": "cpu"}}) == "cpu"


# -- end to end ----------------------------------------------------------------------------------
def _eval(bundle, out_dir, scoring="fp32"):
    from prism_challenge.pipeline import evaluate

    o = evaluate(EvalOptions(bundle=str(bundle), out_dir=str(out_dir), device="cpu", threads=1, token_budget=6000,
                             heldout_bytes=12_000, scoring_autocast=scoring))
    assert o.failure is None, o.failure
    return o.manifest


def _heldout_again(run_dir, m, *, assign):
    """The trained state's held-out nats per batch, scored here from the run's kept state: in its
    own dtypes (``assign``) or copied into float32 parameters (the former load)."""
    from prism_challenge.audit.heldout import heldout_cuts, score_rows
    from prism_challenge.pipeline.finish import HELDOUT_BATCH

    h = m["verdict"]["heldout"]
    sd = torch.load(next((run_dir / "model").glob("*.pt")), map_location="cpu", weights_only=True)
    ctx = SimpleNamespace(vocab_size=m["tokenizer"]["vocab_size"], max_seq_len=m["config"]["sequence_length"])
    model = example_module().build_model(ctx)
    if assign:
        load_scored_state(model, sd)
    else:
        model.load_state_dict(sd)
    cuts = heldout_cuts(m["data"]["dir"], m["tokenizer"]["name"], max_bytes=h["max_bytes"],
                        batch_size=HELDOUT_BATCH, seq_len=m["audit"]["shape"][1])
    threads = torch.get_num_threads()
    torch.set_num_threads(m["config"]["threads"])  # the held-out child's, for the same kernels
    try:
        autocast = {"fp32": None, "bf16": torch.bfloat16}[m["config"]["scoring_autocast"]]
        return sd, score_rows(model, [c.tokens for c in cuts], ctx.vocab_size, "cpu", autocast=autocast)["batch_nats"]
    finally:
        torch.set_num_threads(threads)


def _verifies(run_dir, capsys):
    from prism_challenge.cli import main as prism

    assert prism(["verify", str(run_dir), "--json"]) == 0, capsys.readouterr()
    assert json.loads(capsys.readouterr().out)["verified"] is True


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype, scoring", [
    ("bf16-cast", torch.bfloat16, "fp32"), ("autocast-loop", torch.float32, "fp32"),
    ("autocast-loop", torch.float32, "bf16")])  # bf16: prism-v2's scoring precision, inside the loop's autocast
def test_a_mixed_precision_loop_scores_with_its_audit_passed_and_verifies(tmp_path, capsys, name, dtype, scoring):
    from prism_challenge.cli import main as prism

    run_dir = tmp_path / "run"
    m = _eval(write_variant(name, tmp_path / name), run_dir, scoring)
    v, audit = m["verdict"], m["audit"]
    assert v["flags"] == [] and v["final_score"] > 0 and v["heldout_error"] is None, (v["flags"], v["heldout_error"])
    assert audit["passed"] and audit["mismatch"] is None and audit["error"] is None and len(audit["batches"]) >= 5
    assert m["config"]["scoring_autocast"] == scoring and m["config"]["scoring_autocast_source"] == "profile"
    # held-out scored the trained model in its own dtypes (under the run's scoring autocast): equal,
    # batch for batch, to the kept state scored here so, and (bf16) not to that state copied into
    # float32 parameters
    sd, again = _heldout_again(run_dir, m, assign=True)
    assert {t.dtype for t in sd.values() if t.is_floating_point()} == {dtype}
    assert again == v["heldout"]["batch_nats_trained"]
    if dtype is torch.bfloat16:
        assert _heldout_again(run_dir, m, assign=False)[1] != again
    _verifies(run_dir, capsys)
    if scoring != "fp32":
        return
    # the same run said to have been made on CUDA, on this machine without CUDA: refused, exit 2
    if not torch.cuda.is_available():
        path = run_dir / "prism_run_manifest.v2.json"
        edited = json.loads(path.read_text())
        edited["compute"]["device"] = "cuda"
        path.write_text(json.dumps(edited))
        assert prism(["verify", str(run_dir), "--json"]) == 2
        out = json.loads(capsys.readouterr().out)
        assert out["verified"] is False and "the run was made on CUDA" in out["error"]
