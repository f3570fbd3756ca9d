"""World size 2 on CPU with gloo, through the real torchrun (issue: multi-process runs)."""

import pytest

from prism_challenge.cli import main
from prism_challenge.pipeline import EvalOptions, evaluate

from helpers import EXAMPLE, write_bundle

pytestmark = pytest.mark.slow

SEED_LOOP = (EXAMPLE / "training.py").read_text()
ARCH = (EXAMPLE / "architecture.py").read_text()


def run(tmp_path, bundle, name="run", **kw):
    kw.setdefault("run_gates", False)
    kw.setdefault("seq_len", 64)
    kw.setdefault("heldout_bytes", 0)
    return evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / name), device="cpu", threads=1, **kw))


def test_seed_at_world_size_2_matches_world_size_1_with_double_batch(tmp_path):
    two = run(tmp_path, EXAMPLE, "n2", nproc=2, step_budget=3)
    assert two.failure is None, two.failure
    digests = two.manifest["model"]["state_sha256_per_rank"]
    assert len(digests) == 2 and digests["0"] == digests["1"]  # parameters identical across ranks
    single = write_bundle(tmp_path / "b8", ARCH, SEED_LOOP.replace("LOCAL_BATCH = 4", "LOCAL_BATCH = 8"), tokenizer="gpt2")
    one = run(tmp_path, single, "n1", nproc=1, step_budget=3)
    assert one.failure is None, one.failure
    s2, s1 = two.manifest["score"], one.manifest["score"]
    assert s2["targets"] == s1["targets"] == 3 * 8 * 63
    assert s2["bytes"] == s1["bytes"]
    assert s2["prequential_bpb"] == pytest.approx(s1["prequential_bpb"], rel=1e-4)
    assert two.manifest["compute"]["world_size"] == 2 and set(two.manifest["compute"]["peak_rss_bytes"]) == {"0", "1"}


LEAVE_EARLY = SEED_LOOP.replace(
    "        tokens = batch.tokens\n",
    "        if ctx.rank == 1 and batch.step == 1:\n            break\n        tokens = batch.tokens\n",
)


def test_rank_that_leaves_the_loop_early_fails_fast(tmp_path):
    assert LEAVE_EARLY != SEED_LOOP
    bundle = write_bundle(tmp_path / "b", ARCH, LEAVE_EARLY, tokenizer="gpt2")
    o = run(tmp_path, bundle, nproc=2, step_budget=6, wall_clock_budget=300, rank_timeout=8)
    assert o.failure is not None and o.failure.stage == "contract"
    assert "rank 1 left ctx.iter_train_batches after 2 batch(es)" in o.failure.message
    assert o.manifest["timing"]["wall_s"] < 120  # the rank timeout, not the wall-clock watchdog


def rank_1_edits_ln_f(edit: str) -> str:
    """The seed's loop, where rank 1 alone applies ``model.ln_f.weight.<edit>`` after training."""
    return SEED_LOOP.replace(
        "    if ctx.rank == 0 and ctx.artifacts_dir:",
        f"    if ctx.rank == 1:\n        with torch.no_grad():\n            model.ln_f.weight.{edit}\n"
        "    if ctx.rank == 0 and ctx.artifacts_dir:",
    )


DRIFT = rank_1_edits_ln_f("add_(1.0)")


def test_ranks_that_drift_apart_are_caught(tmp_path):
    assert DRIFT != SEED_LOOP
    o = run(tmp_path, write_bundle(tmp_path / "b", ARCH, DRIFT, tokenizer="gpt2"), nproc=2, step_budget=2)
    assert o.failure is not None and o.failure.stage == "consistency"
    import importlib.util, types
    spec = importlib.util.spec_from_file_location("example_arch", EXAMPLE / "architecture.py")
    arch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arch)
    n = len(arch.build_model(types.SimpleNamespace(vocab_size=50257, max_seq_len=64)).state_dict())
    assert f"rank(s) [1] disagree with rank 0 in 1 of {n} tensors: ln_f.weight (" in o.failure.message
    assert o.failure.kind == "submission" and o.failure.cause == ""  # 1.0 on every weight: the loop's doing


ULP = rank_1_edits_ln_f("mul_(1 + 2e-7)")


def test_ranks_that_differ_in_the_last_bits_only_are_drift_and_retryable_not_the_submissions_fault(tmp_path):
    # one or two ulps on one tensor: what a CPU reduction that rounds differently in one rank leaves
    assert ULP != SEED_LOOP
    o = run(tmp_path, write_bundle(tmp_path / "b", ARCH, ULP, tokenizer="gpt2"), nproc=2, step_budget=2)
    assert o.failure is not None and o.failure.stage == "consistency" and o.failure.cause == "drift"
    assert o.failure.kind == "infrastructure" and "in their last bits only" in o.failure.message
    assert "ln_f.weight" in o.failure.message
    rel = float(o.failure.message.split("moments within ")[1].split(" ")[0])
    assert 1e-7 < rel < 3e-7  # the weights are ~1 (LayerNorm), nudged by 2e-7 relative


@pytest.mark.parametrize("argv, needle", [(["--nproc", "9"], "between 1 and 8"), (["--nproc", "0"], "between 1 and 8"),
                                          (["--nnodes", "2"], "single node")])
def test_bad_layouts_are_refused_before_anything_runs(tmp_path, capsys, argv, needle):
    out = tmp_path / "never"
    assert main(["eval", str(EXAMPLE), "--out", str(out), *argv]) == 2  # a bad command line exits 2 (docs/researcher.md: exit codes)
    assert needle in capsys.readouterr().err
    assert not out.exists()
