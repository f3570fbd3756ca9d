"""End to end through the real torchrun: ``prism eval`` on small bundles (seconds each)."""

import gzip
import hashlib
import json
import lzma
import math
import os
import re
import stat
import time
from pathlib import Path

import pytest
import torch
import zstandard

from prism_challenge.intake.bundle import load_bundle
from prism_challenge.cli import main
from prism_challenge.pipeline import EvalFailure, EvalOptions, evaluate
from prism_challenge.evaluator.seeding import force_seeds
from prism_challenge.manifest.run_manifest import MANIFEST_NAME

from helpers import EXAMPLE, IMPORT_OS_LOOP, LOOP, REPO, SHARED, UNIFORM_ARCH, write_bundle

pytestmark = pytest.mark.slow


def run(tmp_path, bundle, **kw):
    kw.setdefault("run_gates", False)
    kw.setdefault("heldout_bytes", 0)  # the held-out stage has tests of its own
    return evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / "run"), device="cpu", **kw))


def test_seed_training_is_the_shared_copy_byte_for_byte():
    shared = SHARED / "seed" / "training.py"
    if not shared.is_file():
        pytest.skip(f"{shared} is absent (a fresh clone has no ../shared)")
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(EXAMPLE / "training.py") == digest(shared)


def test_uniform_model_scores_log2v_per_target(tmp_path):
    bundle = write_bundle(tmp_path / "b", UNIFORM_ARCH, batch=3, seq_len=33)
    o = run(tmp_path, bundle, token_budget=1000, seq_len=64)
    assert o.failure is None, o.failure
    s, st = o.manifest["score"], o.manifest["stream"]
    assert st["targets"] == st["tokens"] - 1 == 999
    assert s["prequential_bpb"] == pytest.approx(math.log2(257) * s["targets"] / s["bytes"], rel=1e-6)
    # bytes tokenizer: every target is one byte except end-of-text (0 bytes)
    assert s["bytes"] <= s["targets"]


def test_two_logit_model_fails_with_the_shape_error(tmp_path):
    arch = UNIFORM_ARCH.replace("Uniform(ctx.vocab_size)", "Uniform(2)")
    o = run(tmp_path, write_bundle(tmp_path / "b", arch), token_budget=500)
    assert o.failure is not None and o.failure.stage == "contract"
    assert "[2, 16, 2]" in o.failure.message and "V'>=257" in o.failure.message
    m = json.loads((o.run_dir / MANIFEST_NAME).read_text())
    assert m["status"] == "failed" and m["score"] is None


def test_exception_in_submitted_code_reports_traceback_tail(tmp_path):
    loop = """
    def train(ctx):
        model = ctx.build_model()
        for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
            raise ValueError("miner bug at step %d" % batch.step)
    """
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, loop), token_budget=500)
    assert o.failure.stage == "train" and "ValueError: miner bug at step 0" in o.failure.message
    assert "training.py" in o.failure.detail


def test_loop_that_never_iterates_fails_clearly(tmp_path):
    loop = "def train(ctx):\n    ctx.build_model()\n"
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, loop), token_budget=500)
    assert o.failure.stage == "contract" and "never iterated" in o.failure.message


def test_swallowed_contract_error_still_fails_the_run(tmp_path):
    loop = """
    def train(ctx):
        model = ctx.build_model()
        try:
            for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8, tokenizer=ctx.reference_tokenizer("gpt2")):
                pass
        except Exception:
            pass
    """
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, loop), token_budget=500)
    assert o.failure.stage == "contract"
    assert "iter_train_batches(tokenizer='gpt2') differs from the bundle's tokenizer 'bytes'" in o.failure.message
    # the bundle's own tokenizer by name (a new user's first guess) is the bundle's tokenizer
    by_name = run(tmp_path / "n", write_bundle(tmp_path / "bn", UNIFORM_ARCH, loop.replace(
        'tokenizer=ctx.reference_tokenizer("gpt2")', 'tokenizer="bytes"')),
        token_budget=500)
    assert by_name.failure is None, by_name.failure


ARCH_LINEAR = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.emb = nn.Embedding(v, 4)
        self.head = nn.Linear(4, v)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def build_model(ctx):
    return M(ctx.vocab_size)
"""

RESEED_LOOP = """
import torch
from architecture import build_model


def train(ctx):
    torch.manual_seed(999)  # an attempt to choose the initial weights
    model = build_model(ctx)
    torch.manual_seed(7)
    twin = ctx.build_model()
    with torch.no_grad():
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    torch.save({"sum": float(model.head.weight.double().sum()), "same": same}, ctx.artifacts_dir + "/init.pt")
    for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
        break
"""


def test_forced_seed_is_reapplied_before_build_model(tmp_path):
    bundle = write_bundle(tmp_path / "b", ARCH_LINEAR, RESEED_LOOP)
    o = run(tmp_path, bundle, token_budget=200, seed=4321)
    assert o.failure is None, o.failure
    got = torch.load(o.run_dir / "artifacts" / "init.pt")
    import importlib.util

    spec = importlib.util.spec_from_file_location("arch_ref", bundle / "architecture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Ctx:
        vocab_size = 257

    force_seeds(4321)
    ref = mod.build_model(Ctx())
    assert got["same"] is True
    assert got["sum"] == float(ref.head.weight.double().sum())
    assert o.manifest["stream"]["stop_reason"] == "loop_stopped"


def test_planted_run_manifest_is_discarded(tmp_path):
    loop = """
    def train(ctx):
        model = ctx.build_model()
        with open(ctx.artifacts_dir + "/prism_run_manifest.v2.json", "w") as f:
            f.write('{"schema": "prism.run.v2", "score": {"prequential_bpb": 0.0}}')
        for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=8):
            pass
    """
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, loop), token_budget=300)
    assert o.failure is None
    assert o.manifest["discarded_files"] == ["prism_run_manifest.v2.json"]
    assert not (o.run_dir / "artifacts" / MANIFEST_NAME).exists()
    assert json.loads((o.run_dir / MANIFEST_NAME).read_text())["score"]["prequential_bpb"] > 5


def test_example_acceptance_and_bitwise_reproducibility(tmp_path, capsys):
    code = main(["eval", str(EXAMPLE), "--token-budget", "20000", "--out", str(tmp_path / "a"), "--no-progress"])
    assert code == 0
    m = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    s, st, curve = m["score"], m["stream"], m["curve"]["nats_per_target"]
    assert m["status"] == "scored" and st["stop_reason"] == "token_budget"
    assert s["prequential_bpb"] == s["total_bits"] / s["bytes"]
    assert s["total_bits"] == pytest.approx(s["total_nats"] / math.log(2), rel=1e-15)
    assert st["targets"] == st["tokens"] - 1 == 19999
    last_quarter = curve[-max(1, len(curve) // 4):]
    assert sum(last_quarter) / len(last_quarter) < curve[0]
    assert "prequential_bpb" in capsys.readouterr().out
    assert m["profile"]["name"] == "local" and m["profile"]["overridden"] == []  # 20000 is local's budget
    # the reference compressors' code lengths of the scored bytes, from a text built here
    text = b"".join(t.encode("utf-8") for t in _train_texts(m["data"]["dir"]))[: s["bytes"]]
    assert m["reference_codes"] == {
        "bytes": s["bytes"], "text_sha256": hashlib.sha256(text).hexdigest(),
        "zstd-19": 8 * len(zstandard.ZstdCompressor(level=19).compress(text)) / s["bytes"],
        "xz-9e": 8 * len(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME)) / s["bytes"],
        "gzip-9": 8 * len(gzip.compress(text, compresslevel=9)) / s["bytes"]}
    # the profile `local` with --json: the same run, identical to the last bit; stdout is one JSON object
    assert main(["eval", str(EXAMPLE), "--profile", "local", "--json", "--out", str(tmp_path / "b")]) == 0
    out = json.loads(capsys.readouterr().out)
    m2 = json.loads((tmp_path / "b" / MANIFEST_NAME).read_text())
    assert out["manifest"] == str(tmp_path / "b" / MANIFEST_NAME) and out["status"] == "scored"
    assert out["prequential_bpb"] == m2["score"]["prequential_bpb"] == s["prequential_bpb"]
    assert out["final_score"] == m2["verdict"]["final_score"] == m["verdict"]["final_score"]
    assert m2["curve"] == m["curve"] and m2["reference_codes"] == m["reference_codes"]
    assert m2["profile"]["sha256"] == hashlib.sha256(
        (REPO / "src/prism_challenge/profiles/local.toml").read_bytes()).hexdigest()
    # torchrun was started before the gates and released once they passed
    t = m["timing"]  # the gates ran while torchrun started
    assert 0 < t["gates_s"] <= t["launch_to_release_s"] <= t["gates_s"] + 0.5
    assert t["launch_to_last_record_s"] == pytest.approx(t["launch_to_release_s"] + t["release_to_last_record_s"])


def _train_texts(data_dir: str) -> list[str]:
    """The train split's documents in MANIFEST order, read with pyarrow directly."""
    import pyarrow.parquet as pq

    root = Path(data_dir)
    shards = json.loads((root / "MANIFEST.json").read_text())["splits"]["train"]["shards"]
    return [t for sh in shards for t in pq.read_table(root / sh["path"], columns=["text"]).column(0).to_pylist()]


# the default SGD loop, first writing who started this rank (its parent's command line)
PARENT_LOOP = LOOP.format(lr=0.5, batch=2, seq_len=32).replace(
    "    model = ctx.build_model()",
    "    import os\n"
    "    with open(os.path.join(ctx.artifacts_dir, 'parent.txt'), 'wb') as f:\n"
    "        f.write(open(f'/proc/{os.getppid()}/cmdline', 'rb').read())\n"
    "    model = ctx.build_model()", 1)


def test_warm_and_cold_ranks_score_the_same_to_the_last_bit(tmp_path):
    # warm: one rank is the single-rank agent's child (started at once with torchrun's worker
    # environment); cold: the reference launch, torchrun's child
    bundle = write_bundle(tmp_path / "b", ARCH_LINEAR, PARENT_LOOP)
    # the loop reads its parent's /proc entry, which the audit hook refuses: the launcher alone is tested
    warm = run(tmp_path / "w", bundle, token_budget=3000, seq_len=64, audit_hooks=False)
    cold = run(tmp_path / "c", bundle, token_budget=3000, seq_len=64, warm_ranks=False, audit_hooks=False)
    assert warm.failure is None and cold.failure is None, (warm.failure, cold.failure)
    parent = lambda o: (Path(o.run_dir) / "artifacts" / "parent.txt").read_bytes().split(b"\0")  # noqa: E731
    assert parent(warm)[1:3] == [b"-m", b"prism_challenge.evaluator.single"]  # the single-rank agent
    assert parent(cold)[1:3] == [b"-m", b"prism_challenge.evaluator.agent"]  # torchrun's agent (torch.distributed.run)
    assert (warm.manifest["compute"]["warm_ranks"], cold.manifest["compute"]["warm_ranks"]) == (True, False)
    assert (warm.manifest["compute"]["launcher"], cold.manifest["compute"]["launcher"]) == ("single", "torchrun")
    assert warm.manifest["score"]["prequential_bpb"] == cold.manifest["score"]["prequential_bpb"]
    assert warm.manifest["curve"] == cold.manifest["curve"]
    assert warm.manifest["model"]["state_sha256"] == cold.manifest["model"]["state_sha256"]
    assert warm.manifest["curve"]["nats_per_target"][-1] < warm.manifest["curve"]["nats_per_target"][0]  # it trained


# the default SGD loop inside a gloo process group of its own: init, an all-reduce of every
# gradient (the identity at world size 1), a barrier, destroy
GROUP_LOOP = LOOP.format(lr=0.5, batch=2, seq_len=32).replace(
    "    model = ctx.build_model().to(ctx.device)",
    "    import torch.distributed as dist\n"
    "    dist.init_process_group('gloo')\n"
    "    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)\n"
    "    model = ctx.build_model().to(ctx.device)", 1).replace(
    "        opt.step()",
    "        for p in model.parameters():\n"
    "            dist.all_reduce(p.grad)\n"
    "        opt.step()\n"
    "    dist.barrier()\n"
    "    dist.destroy_process_group()", 1)


def test_a_process_group_at_world_size_one_runs_under_the_single_rank_agent(tmp_path):
    # no agent's store: the rank hosts its own at MASTER_PORT, inside the sandbox's loopback
    plain = run(tmp_path / "p", write_bundle(tmp_path / "pb", ARCH_LINEAR, LOOP.format(lr=0.5, batch=2, seq_len=32)),
                token_budget=3000, seq_len=64, isolation="strict")
    group = run(tmp_path / "g", write_bundle(tmp_path / "gb", ARCH_LINEAR, GROUP_LOOP), token_budget=3000, seq_len=64,
                isolation="strict")
    assert plain.failure is None and group.failure is None, (plain.failure, group.failure)
    assert group.manifest["compute"]["launcher"] == "single"
    assert group.manifest["score"]["prequential_bpb"] == plain.manifest["score"]["prequential_bpb"]
    assert group.manifest["curve"] == plain.manifest["curve"]
    assert group.manifest["model"]["state_sha256"] == plain.manifest["model"]["state_sha256"]


def _processes_with(needle: bytes) -> list[int]:
    """Pids whose environment holds ``needle`` (the runner's feeder socket path)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("isolation", ["strict", "none"])
@pytest.mark.parametrize("refusal", ["static", "parameter-cap"])
def test_gate_refusal_stops_the_early_launch_and_leaves_no_run_directory(tmp_path, isolation, refusal):
    if refusal == "static":  # refused by the AST gates
        bundle, needle, kw = write_bundle(tmp_path / "b", UNIFORM_ARCH, IMPORT_OS_LOOP), "training.py:2:", {}
    else:  # refused by the last gate, the parameter cap: 2,313 parameters > 1,000
        bundle, needle, kw = write_bundle(tmp_path / "b", ARCH_LINEAR), "prism:param-cap", {"max_parameters": 1000}
    with pytest.raises(EvalFailure) as err:
        run(tmp_path, bundle, run_gates=True, isolation=isolation, token_budget=500, **kw)
    assert err.value.stage == "gates" and needle in err.value.detail
    assert not (tmp_path / "run").exists()
    sock = str(tmp_path / "run" / "feeder.sock").encode()
    for _ in range(50):  # the tree is killed before evaluate() raises; /proc may lag a moment
        if not _processes_with(sock):
            break
        time.sleep(0.1)
    assert _processes_with(sock) == []


PEEK_ARCH = """
import torch
from torch import nn


class Peek(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.emb = nn.Embedding(v, 8)
        self.head = nn.Linear(8, v)
        self.gate = nn.Parameter(torch.full((1,), {gate}))

    def forward(self, tokens):
        nxt = torch.roll(tokens, -1, dims=1)
        logits = self.head(self.emb(tokens))
        bonus = (self.gate * 30.0).expand(tokens.shape[0], tokens.shape[1], 1)
        return logits.scatter_add(-1, nxt.unsqueeze(-1), bonus)


def build_model(ctx):
    return Peek(ctx.vocab_size)
"""


def test_model_that_reads_the_next_token_is_caught_by_the_causality_probe(tmp_path):
    o = run(tmp_path, write_bundle(tmp_path / "b", PEEK_ARCH.format(gate=1.0), lr=0.1), token_budget=2000)
    assert o.failure is not None and o.failure.stage == "contract"
    assert "not causal" in o.failure.message


def test_peek_that_starts_honest_is_zeroed_by_the_heldout_probe(tmp_path):
    # gate 0 at init: the first batches look causal; after training the held-out probe sees the peek
    bundle = write_bundle(tmp_path / "b", PEEK_ARCH.format(gate=0.0), lr=0.5, batch=2, seq_len=16)
    o = run(tmp_path, bundle, token_budget=600, step_budget=1, heldout_bytes=60000)
    v = o.manifest["verdict"]
    assert o.failure is None and "heldout_contract" in v["flags"], v
    assert v["final_score"] == 0.0 and "not causal" in v["heldout_error"]


ENV_LOOP = """
import os


def train(ctx):
    model = ctx.build_model()
    with open(ctx.artifacts_dir + "/env.txt", "w") as f:
        f.write("\\n".join(sorted(os.environ)))
    for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
        pass
"""


def test_strict_runs_see_no_secrets_of_the_operator_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, ENV_LOOP), token_budget=100)
    assert o.failure is None, o.failure
    names = (o.run_dir / "artifacts" / "env.txt").read_text().split()
    assert "PATH" in names and "HF_TOKEN" not in names and "AWS_SECRET_ACCESS_KEY" not in names
    # the compute environment (launcher.compute_env) reaches the ranks
    assert {"THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} <= set(names)


BIG_OWN_MODEL_LOOP = """
import torch


def train(ctx):
    ctx.build_model()
    model = torch.nn.Sequential(torch.nn.Embedding(ctx.vocab_size, 16), torch.nn.Linear(16, ctx.vocab_size))
    for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
        pass
"""

GROWING_MODEL_LOOP = """
import torch


def train(ctx):
    model = ctx.build_model()
    for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
        pass
    model.register_buffer("extra", torch.zeros(5000))
"""


@pytest.mark.parametrize("loop, needle", [(BIG_OWN_MODEL_LOOP, "holds 8,481 unique"),
                                          (GROWING_MODEL_LOOP, "ended with 5,001 unique")])
def test_the_scored_model_is_held_to_the_parameter_cap(tmp_path, loop, needle):
    # the gate measured build_model (1 parameter); the loop scores another model (257*16 + 16*257 + 257
    # = 8,481 elements) or grows it (1 + 5,000)
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, loop), token_budget=300, max_parameters=1000)
    assert o.failure is not None and o.failure.stage == "contract", o.failure
    assert needle in o.failure.message and "over the cap of 1,000" in o.failure.message
    assert not (o.run_dir / "model").exists()  # nothing of the oversized state was kept


HIDDEN_BANK_ARCH = """
import torch
from torch import nn


class Bank:
    def __init__(self, v, d):
        self.w = nn.Parameter(torch.randn(v, d) * 0.1)
        self.h = nn.Parameter(torch.randn(d, v) * 0.1)


class HiddenBank(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.bank = Bank(v, 64)  # a plain object: invisible to the module tree and its state_dict
        self.bias = nn.Parameter(torch.zeros(v))

    def forward(self, tokens):
        return self.bank.w[tokens] @ self.bank.h + self.bias


def build_model(ctx):
    return HiddenBank(ctx.vocab_size)
"""


def test_weights_held_in_a_plain_object_count_against_the_cap(tmp_path):
    # the parameter gate walks plain objects too: 257*64 + 64*257 + 257 = 33,153 > 5,000
    with pytest.raises(EvalFailure) as err:
        run(tmp_path, write_bundle(tmp_path / "b", HIDDEN_BANK_ARCH), token_budget=3000, max_parameters=5000,
            run_gates=True)
    assert err.value.stage == "gates" and "prism:param-cap" in err.value.detail and "33,153" in err.value.detail
    # without the gates, the runner refuses it when the stream starts
    o = run(tmp_path, write_bundle(tmp_path / "b2", HIDDEN_BANK_ARCH), token_budget=3000, max_parameters=5000)
    assert o.failure is not None and o.failure.stage == "contract", o.failure
    assert "the model holds 33,153 unique parameter and buffer elements" in o.failure.message


LAZY_GLOBAL_ARCH = """
import torch
from torch import nn

TABLE = {}


class Lazy(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.v = v
        self.bias = nn.Parameter(torch.zeros(v))

    def forward(self, tokens):
        if tokens.shape[1] > 8 and "w" not in TABLE:  # never in the parameter gate's [1, 8] forward
            TABLE["w"] = torch.randn(self.v, 64) * 0.1
            TABLE["h"] = torch.randn(64, self.v) * 0.1
        if "w" in TABLE:
            return TABLE["w"][tokens] @ TABLE["h"] + self.bias
        return torch.zeros(tokens.shape[0], tokens.shape[1], self.v) + self.bias


def build_model(ctx):
    return Lazy(ctx.vocab_size)
"""


def test_weights_nothing_in_the_model_refers_to_are_caught_by_the_census(tmp_path):
    # every gate passes (the table does not exist yet when the gate measures 257 elements); the
    # table is made inside batch 0's forward (not charged there), and batch 1, always probed, reads
    # it from outside: 257*64 + 64*257 + 257 = 33,153 > 5,000
    o = run(tmp_path, write_bundle(tmp_path / "b", LAZY_GLOBAL_ARCH), token_budget=3000, max_parameters=5000,
            run_gates=True)
    assert o.failure is not None and o.failure.stage == "contract", o.failure
    assert "batch 1: the scored forward read 33,153 unique tensor elements" in o.failure.message
    assert "over the cap of 5,000" in o.failure.message and "257 of them are reachable" in o.failure.message
    assert o.manifest["status"] == "failed" and o.manifest["score"] is None


def test_a_zip_bundle_is_scored_under_strict_isolation(tmp_path):
    # the zip is extracted to a private temp folder; the sandbox (its own uid when run as root)
    # must still read it, and the run scores the same as the directory it came from
    import zipfile

    src = write_bundle(tmp_path / "b", UNIFORM_ARCH)
    with zipfile.ZipFile(tmp_path / "b.zip", "w") as z:
        for f in sorted(src.iterdir()):
            z.write(f, f.name)
    o = run(tmp_path, tmp_path / "b.zip", token_budget=300, isolation="strict")
    assert o.failure is None, o.failure
    d = evaluate(EvalOptions(bundle=str(src), out_dir=str(tmp_path / "run2"), device="cpu", run_gates=False,
                             heldout_bytes=0, token_budget=300, isolation="strict"))
    assert o.manifest["score"]["prequential_bpb"] == d.manifest["score"]["prequential_bpb"]


STUCK_LOOP = """
def train(ctx):
    model = ctx.build_model()
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=16):
        while True:
            pass
"""


def test_a_single_rank_stuck_after_a_batch_is_stopped_and_scored(tmp_path):
    # the idle timeout also bounds the wait for the first batch: a margin for a loaded machine
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, STUCK_LOOP), token_budget=3000, idle_timeout=20)
    assert o.failure is None, o.failure
    st, s = o.manifest["stream"], o.manifest["score"]
    assert st["stop_reason"] == "stalled" and st["batches"] == 1 and st["targets"] == 30 == st["tokens"] - 1
    assert s["prequential_bpb"] == pytest.approx(math.log2(257) * s["targets"] / s["bytes"], rel=1e-6)


SPIN_BEFORE_LOOP = """
def train(ctx):
    model = ctx.build_model()
    n = 0
    while n >= 0:  # never reaches the stream
        n = n + 1
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=16):
        pass
"""


def test_a_loop_that_never_reaches_the_stream_fails_after_the_idle_timeout(tmp_path):
    t0 = time.monotonic()
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, SPIN_BEFORE_LOOP), token_budget=3000, idle_timeout=3)
    assert time.monotonic() - t0 < 60  # it used to wait forever (no wall-clock budget by default)
    assert o.failure is not None and o.failure.stage == "contract"
    assert re.match(r"no batch was asked for (?:[3-9]|[1-5][0-9]) s after the start: the loop never reached ctx\.iter_train_batches ",
                    o.failure.message), o.failure.message
    assert o.failure.message.endswith("[--idle-timeout 3 s]")
    assert o.manifest["status"] == "failed" and o.manifest["stream"]["batches"] == 0


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--nproc", "0"], "--nproc 0: must be between 1 and 8 processes on one node"),
        (["--nproc", "9"], "--nproc 9: must be between 1 and 8 processes on one node"),
        (["--out", "{full}"], "--out {full}: directory exists and is not empty (name a new or empty directory)"),
        (["--out", "{file}"], "--out {file}: exists and is not a directory"),
    ],
)
def test_a_bad_command_line_exits_2_with_one_line(tmp_path, capsys, argv, line):
    full, file = tmp_path / "full", tmp_path / "file"
    full.mkdir()
    (full / "keep").write_text("x")
    file.write_text("x")
    argv = [a.format(full=full, file=file) for a in argv]
    code = main(["eval", str(EXAMPLE), "--no-progress", "--token-budget", "100", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"prism eval failed at stage config: {line.format(full=full, file=file)}\n"
    assert (full / "keep").read_text() == "x" and sorted(p.name for p in full.iterdir()) == ["keep"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--wall-clock-budget", "inf"], "argument --wall-clock-budget: inf must be a positive finite number"),
        (["--seed", "99999999999999999999999"], "argument --seed: 99999999999999999999999 must be between 0 and "
                                                "9223372036854775807"),
        (["--seed", "-1"], "argument --seed: -1 must be between 0 and 9223372036854775807"),
        (["--threads", "1000"], "argument --threads: 1000 must be between 1 and 256"),
        (["--seq-len", "99999999999999999999"], "argument --seq-len: 99999999999999999999 must be between 2 and 16777216"),
        (["--heldout-bytes", "-1"], "argument --heldout-bytes: -1 must be between 0 and 1099511627776"),
    ],
)
def test_option_values_out_of_range_are_usage_errors(capsys, argv, message):
    # they used to reach the run: an overflow traceback in the rank, libgomp failing to start 1000
    # threads, a build error blamed on the bundle, "Infinity" in the manifest
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(EXAMPLE), "--no-progress", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == f"prism eval: error: {message}"


def test_a_wall_clock_budget_that_ends_before_any_batch_is_named_as_the_cause(tmp_path):
    o = run(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH), token_budget=3000, wall_clock_budget=1e-6)
    assert o.failure is not None and (o.failure.stage, o.failure.message) == (
        "budget", "no batch was scored before the wall-clock budget of 1e-06 s ran out (counted from the gates' release)")


def test_a_private_directory_bundle_is_scored_under_strict_isolation_as_root(tmp_path):
    # the sandbox runs as its own uid when PRISM is root: a 0700 bundle of 0600 files is
    # evaluated from a world-readable copy (removed after), with the same bundle sha256
    from prism_challenge.evaluator.isolation import available_backend

    if os.geteuid() != 0:
        pytest.skip("the sandbox uid differs from the bundle's owner only when run as root")
    if available_backend() is None:
        pytest.skip("no working sandbox backend (install bubblewrap, or allow unshare)")
    src = write_bundle(tmp_path / "mine", UNIFORM_ARCH)
    for p in src.iterdir():
        p.chmod(0o600)
    src.chmod(0o700)
    o = run(tmp_path, src, token_budget=200, isolation="strict")
    assert o.failure is None, o.failure
    assert o.manifest["bundle"]["path"] == str(src)
    assert o.manifest["bundle"]["sha256"] == load_bundle(src).sha256
    assert o.manifest["stream"]["targets"] == 199
    assert stat.S_IMODE(src.stat().st_mode) == 0o700  # the user's bundle is left as it was
