"""Held-out evaluation: twin vs trained on the val prefix, in a bounded (optionally sandboxed) child.

The expected figures are computed here independently: the val documents are read from the
shards with pyarrow, the stream ``EOT doc EOT doc ...`` is built by hand under the whole-document
byte budget, and a bigram model's code length is summed over consecutive token pairs (a bigram's
loss does not depend on where rows are cut).
"""

import json
import math
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from prism_challenge.data.builtin import default_cache_root, ensure_builtin
from prism_challenge.data.manifest import load_manifest
from prism_challenge.evaluator import isolation
from prism_challenge.evaluator.seeding import force_seeds
from prism_challenge.evaluator.jail import Jail
from prism_challenge.audit.heldout import HeldoutError, blind_probes, heldout_cuts, run_heldout

from helpers import UNIFORM_ARCH

pytestmark = pytest.mark.slow

LN2 = math.log(2)
V = 257
EOT = 256
SEED = 1234
KEY = b"h" * 32  # the run's secret: draws the blind probes
MAX_BYTES = 12_000

BIGRAM_ARCH = """
import torch
from torch import nn


class Bigram(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.emb = nn.Embedding(v, v)
        nn.init.normal_(self.emb.weight, std=0.01)

    def forward(self, tokens):
        return self.emb(tokens)


def build_model(ctx):
    return Bigram(ctx.vocab_size)
"""


@pytest.fixture(scope="module")
def data_dir():
    return ensure_builtin()


def write_arch(root, source):
    root.mkdir(parents=True, exist_ok=True)
    (root / "architecture.py").write_text(textwrap.dedent(source))
    return root


def config(bundle, state, data_dir, **kw):
    c = {
        "bundle_root": str(bundle), "architecture": ["architecture", "build_model"], "seed": SEED, "threads": 1,
        "vocab_size": V, "tokenizer": "bytes", "sequence_length": 64, "max_parameters": 1_000_000,
        "device": "cpu", "state_path": str(state), "data_dir": str(data_dir), "split": "val",
        "max_bytes": MAX_BYTES, "batch_size": 4, "seq_len": 48,
    }
    c.update(kw)
    return c


def val_stream(data_dir, max_bytes):
    """(ids, bytes) of the val prefix, built from the shards directly (whole documents only)."""
    m = load_manifest(data_dir)
    texts = []
    for s in m.data["splits"]["val"]["shards"]:
        texts += pq.read_table(m.root / s["path"], columns=["text"]).column("text").to_pylist()
    ids, total = [EOT], 0
    for t in texts:
        b = t.encode("utf-8")
        if total + len(b) > max_bytes:
            break
        total += len(b)
        ids += list(b) + [EOT]
        if total >= max_bytes:
            break
    return np.array(ids), total


def bigram_nats(weight, ids):
    """Sum over consecutive pairs of -log softmax(W[prev])[next] (float32 softmax, float64 sum)."""
    logp = torch.log_softmax(weight[torch.from_numpy(ids[:-1])].float(), dim=-1)
    return float(-logp.gather(1, torch.from_numpy(ids[1:]).unsqueeze(1)).double().sum())


def twin_weight():
    """Bigram.__init__'s draws under the forced seed."""
    force_seeds(SEED)
    emb = torch.nn.Embedding(V, V)
    torch.nn.init.normal_(emb.weight, std=0.01)
    return emb.weight.detach()


@pytest.fixture(scope="module")
def trained_state(data_dir, tmp_path_factory):
    """A bigram trained for 60 Adam steps on the first 100 kB of the train split."""
    m = load_manifest(data_dir)
    text = "\n".join(pq.read_table(m.shard_paths("train")[0], columns=["text"]).column("text").to_pylist())
    data = torch.tensor(list(text.encode("utf-8")[:100_000]))
    force_seeds(0)
    emb = torch.nn.Embedding(V, V)
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(emb(data[:-1]), data[1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("state") / "trained.pt"
    torch.save({"emb.weight": emb.weight.detach().clone()}, path)
    return path, emb.weight.detach().clone()


def test_twin_and_trained_match_an_independent_computation(tmp_path, data_dir, trained_state):
    state, weight = trained_state
    bundle = write_arch(tmp_path / "b", BIGRAM_ARCH)
    r = run_heldout(config(bundle, state, data_dir), timeout_s=300, memory_bytes=4 << 30)
    ids, nbytes = val_stream(data_dir, MAX_BYTES)
    assert 0 < nbytes <= MAX_BYTES and r["bytes"] == nbytes and r["targets"] == len(ids) - 1
    trained = bigram_nats(weight, ids) / LN2 / nbytes
    twin = bigram_nats(twin_weight(), ids) / LN2 / nbytes
    assert r["val_bpb_trained"] == pytest.approx(trained, rel=1e-7)
    assert r["val_bpb_twin"] == pytest.approx(twin, rel=1e-7)
    # a near-uniform init (std 0.01 logits) codes each target in about log2 V bits
    assert r["val_bpb_twin"] == pytest.approx(math.log2(V) * r["targets"] / nbytes, rel=1e-3)
    # the trained bigram learned: a positive delta of several bits per byte
    assert r["heldout_delta"] == pytest.approx(twin - trained, rel=1e-6) and r["heldout_delta"] > 2.0
    assert r["val_bpb_trained"] < 5.0
    assert r["nonfinite_batches_twin"] == r["nonfinite_batches_trained"] == 0
    assert r["parameter_count"] == V * V
    # per batch (the memorization gap's val units): the bigram's nats over each batch's rows, and
    # its bytes counted from its tokens (bytes tokenizer: every target but end-of-text is one byte)
    cuts = heldout_cuts(data_dir, "bytes", max_bytes=MAX_BYTES, batch_size=4, seq_len=48)
    assert r["batches"] == len(cuts) == len(r["batch_bytes"]) == len(r["batch_nats_trained"]) > 2
    assert r["batch_bytes"] == [int((c.tokens[:, 1:] != EOT).sum()) for c in cuts] and sum(r["batch_bytes"]) == nbytes
    twin_w = twin_weight()
    for c, got_trained, got_twin in zip(cuts, r["batch_nats_trained"], r["batch_nats_twin"]):
        assert got_trained == pytest.approx(sum(bigram_nats(weight, row) for row in c.tokens), rel=1e-6)
        assert got_twin == pytest.approx(sum(bigram_nats(twin_w, row) for row in c.tokens), rel=1e-6)
    assert math.fsum(r["batch_nats_trained"]) == r["nats_trained"]  # the total is their sum, taken here


def test_uniform_twin_is_exactly_log2v_per_target(tmp_path, data_dir):
    bundle = write_arch(tmp_path / "b", UNIFORM_ARCH)
    state = tmp_path / "state.pt"
    torch.save({"bias": torch.zeros(1)}, state)
    r = run_heldout(config(bundle, state, data_dir), timeout_s=300, memory_bytes=4 << 30)
    assert r["val_bpb_twin"] == pytest.approx(math.log2(V) * r["targets"] / r["bytes"], rel=1e-7)  # float32 log_softmax
    assert r["heldout_delta"] == 0.0
    # the bytes tokenizer: each target is one byte except end-of-text; the whole-document budget
    assert r["targets"] - r["bytes"] == len([c for c in heldout_cuts(data_dir, "bytes", max_bytes=MAX_BYTES,
                                                                     batch_size=4, seq_len=48)
                                             for t in c.tokens[:, 1:].ravel() if t == EOT])


def test_same_run_twice_gives_the_same_figures(tmp_path, data_dir, trained_state):
    bundle = write_arch(tmp_path / "b", BIGRAM_ARCH)
    cfg = config(bundle, trained_state[0], data_dir)
    a = run_heldout(cfg, timeout_s=300, memory_bytes=4 << 30)
    b = run_heldout(cfg, timeout_s=300, memory_bytes=4 << 30)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


def test_standalone_cli_prints_the_same_figures(tmp_path, data_dir, trained_state):
    bundle = write_arch(tmp_path / "b", BIGRAM_ARCH)
    cfg = config(bundle, trained_state[0], data_dir)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    res = subprocess.run([sys.executable, "-m", "prism_challenge.audit.heldout", str(tmp_path / "cfg.json")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    cli = json.loads(lines[0])
    ref = run_heldout(cfg, timeout_s=300, memory_bytes=4 << 30)
    for k in ("val_bpb_twin", "val_bpb_trained", "heldout_delta", "targets", "bytes", "batch_bytes",
              "batch_nats_twin", "batch_nats_trained"):
        assert cli[k] == ref[k], k


def test_planted_pickle_is_not_executed(tmp_path, data_dir):
    bundle = write_arch(tmp_path / "b", BIGRAM_ARCH)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps({"emb.weight": Evil()}))
    zipped = tmp_path / "zipped.pt"
    torch.save({"emb.weight": Evil()}, zipped)
    for state in (raw, zipped):
        with pytest.raises(HeldoutError, match="^load: "):
            run_heldout(config(bundle, state, data_dir), timeout_s=300, memory_bytes=4 << 30)
    assert not marker.exists()


def test_state_of_another_model_fails_at_load(tmp_path, data_dir):
    bundle = write_arch(tmp_path / "b", BIGRAM_ARCH)
    state = tmp_path / "state.pt"
    torch.save({"other.weight": torch.zeros(3)}, state)
    with pytest.raises(HeldoutError, match="^load: RuntimeError: Error.*state_dict"):
        run_heldout(config(bundle, state, data_dir), timeout_s=300, memory_bytes=4 << 30)


def test_parameter_cap_is_enforced(tmp_path, data_dir, trained_state):
    bundle = write_arch(tmp_path / "b", BIGRAM_ARCH)
    with pytest.raises(HeldoutError, match=f"^build: the model has {V * V} parameters, over the cap of 1000"):
        run_heldout(config(bundle, trained_state[0], data_dir, max_parameters=1000), timeout_s=300,
                    memory_bytes=4 << 30)


def test_submitted_prints_cannot_forge_the_result(tmp_path, data_dir, trained_state):
    forged = json.dumps({"ok": True, "twin": {"nats": 1e9, "targets": 1, "nonfinite_batches": 0},
                         "trained": {"nats": 0.0, "targets": 1, "nonfinite_batches": 0}, "targets": 1, "batches": 1})
    arch = BIGRAM_ARCH + f"\nprint({forged!r}, flush=True)\n"
    honest = run_heldout(config(write_arch(tmp_path / "h", BIGRAM_ARCH), trained_state[0], data_dir),
                         timeout_s=300, memory_bytes=4 << 30)
    r = run_heldout(config(write_arch(tmp_path / "b", arch), trained_state[0], data_dir), timeout_s=300,
                    memory_bytes=4 << 30)
    assert r["val_bpb_trained"] == honest["val_bpb_trained"] and r["heldout_delta"] == honest["heldout_delta"]


def test_timeout_kills_the_child(tmp_path, data_dir, trained_state):
    arch = BIGRAM_ARCH.replace("    return Bigram(ctx.vocab_size)", "    while True:\n        pass")
    with pytest.raises(HeldoutError, match=r"^timeout: the held-out evaluation ran past its limit of 5 s"):
        run_heldout(config(write_arch(tmp_path / "b", arch), trained_state[0], data_dir), timeout_s=5,
                    memory_bytes=4 << 30)


def test_memory_limit_stops_a_memory_bomb(tmp_path, data_dir, trained_state):
    arch = BIGRAM_ARCH.replace("    return Bigram(ctx.vocab_size)",
                               "    hog = [torch.ones(1 << 27) for _ in range(64)]  # 64 x 512 MiB\n"
                               "    return Bigram(ctx.vocab_size)")
    with pytest.raises(HeldoutError, match=r"^build: .*(allocate memory|MemoryError|out of memory)"):
        run_heldout(config(write_arch(tmp_path / "b", arch), trained_state[0], data_dir), timeout_s=300,
                    memory_bytes=3 << 30)


def test_missing_state_and_bad_data_dir_fail_clearly(tmp_path, data_dir):
    bundle = write_arch(tmp_path / "b", BIGRAM_ARCH)
    with pytest.raises(HeldoutError, match="^state: cannot read the trained state"):
        run_heldout(config(bundle, tmp_path / "nope.pt", data_dir), timeout_s=60, memory_bytes=4 << 30)
    with pytest.raises(HeldoutError, match="^data: "):
        run_heldout(config(bundle, tmp_path / "nope.pt", tmp_path), timeout_s=60, memory_bytes=4 << 30)


LEAK_PROBE = """
import os
VAL = {val!r}
try:
    with open(VAL, "rb") as f:
        f.read(1)
    LEAKED = "read " + VAL
except OSError as exc:
    LEAKED = None
"""


@pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")
def test_in_the_sandbox_the_child_cannot_read_the_data(tmp_path, data_dir, trained_state):
    val = str(load_manifest(data_dir).shard_paths("val")[0])
    arch = LEAK_PROBE.format(val=val) + BIGRAM_ARCH.replace(
        "def build_model(ctx):\n", "def build_model(ctx):\n    if LEAKED:\n        raise RuntimeError('LEAK: ' + LEAKED)\n")
    bundle = write_arch(tmp_path / "b", arch)
    cfg = config(bundle, trained_state[0], data_dir)
    # without the sandbox the audit hook alone stops the read, naming it (a contract failure)
    with pytest.raises(HeldoutError, match=r"contract: the runtime audit hook refused open\('.*'\) \[prism:audit-no-hidden-path\]"):
        run_heldout(cfg, timeout_s=300, jail=Jail("none", str(bundle), (str(data_dir), str(default_cache_root())),
                                                   isolation.Limits(), 1))
    jail = Jail.open("strict", bundle_dir=bundle, hidden=[str(data_dir), str(default_cache_root())],
                     limits=isolation.Limits(), threads=1)
    # in the run's jail (sandbox and hook): refused the same way; an honest bundle scores the same
    with pytest.raises(HeldoutError, match=r"contract: the runtime audit hook refused open"):
        run_heldout(cfg, timeout_s=300, jail=jail)
    honest_bundle = write_arch(tmp_path / "h", BIGRAM_ARCH)
    honest_jail = Jail.open("strict", bundle_dir=honest_bundle, hidden=[str(data_dir), str(default_cache_root())],
                            limits=isolation.Limits(), threads=1)
    r = run_heldout(config(honest_bundle, trained_state[0], data_dir), timeout_s=300, jail=honest_jail)
    honest = run_heldout(config(honest_bundle, trained_state[0], data_dir), timeout_s=300, memory_bytes=4 << 30)
    for k in ("val_bpb_twin", "val_bpb_trained", "heldout_delta", "targets", "bytes"):
        assert r[k] == honest[k], k


# reads the next token (a roll of the input) and answers the in-process probe (a batch of the
# same shape: one row starts as before, the others are shifted by a constant) from its cache:
# the in-process causality probe is fooled, the blind probe is not
REPLAY_ARCH = """
import torch
import torch.nn.functional as F
from torch import nn


class Peek(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.v = v
        self.alpha = nn.Parameter(torch.tensor(40.0))
        self.cache = None

    def forward(self, tokens):
        if not self.training and self.cache is not None:
            last, logits = self.cache
            if last.shape == tokens.shape:  # the probe: one row keeps its start, the others are shifted
                diff = (tokens - last) % self.v
                kept = diff[:, 0] == 0
                shifted = (diff == diff[:, :1]).all(dim=1) & ~kept
                if int(kept.sum()) == 1 and bool((kept | shifted).all()):
                    return logits.clone()
        out = F.one_hot(torch.roll(tokens, -1, dims=1), self.v).float() * self.alpha
        if not self.training:
            self.cache = (tokens.clone(), out.clone())
        return out


def build_model(ctx):
    return Peek(ctx.vocab_size)
"""


def test_a_model_that_replays_the_probe_is_caught_by_the_blind_probe(tmp_path, data_dir):
    bundle = write_arch(tmp_path / "b", REPLAY_ARCH)
    state = tmp_path / "state.pt"
    torch.save({"alpha": torch.tensor(40.0)}, state)
    with pytest.raises(HeldoutError) as err:
        run_heldout(config(bundle, state, data_dir), timeout_s=300, memory_bytes=4 << 30)
    msg = str(err.value)
    # the whole row: the next token was read (0 nats); the fresh process saw random tokens there
    assert msg.startswith("contract: the trained model is not causal on held-out text: its prediction of token ")
    assert "cost 0 nats when it was shown the whole batch and 40 nats in a separate process" in msg


def test_blind_probes_keep_the_prefix_and_go_on_with_other_held_out_text():
    batches = [np.arange(i * 100, i * 100 + 4 * 48, dtype=np.int64).reshape(4, 48) % V for i in range(20)]
    probes = blind_probes(batches, KEY, V)
    assert len(probes) == 8 and [p[0] for p in probes] == sorted({round(x) for x in np.linspace(0, 19, 8)})
    for b, row, k, probe in probes:
        assert 1 <= k < 48 and 0 <= row < 4 and probe.shape == (4, 48) and probe.dtype == np.int64  # like with like
        assert (probe[row, :k] == batches[b][row, :k]).all()  # the past is kept
        assert not (probe[row, k:] == batches[b][row, k:]).all()  # the future is not
        # real text: every other row, and the row from k on, come from one batch two or more away
        source = [j for j in range(20) if abs(j - b) > 1 and (np.delete(probe, row, axis=0)
                                                               == np.delete(batches[j], row, axis=0)).all()]
        assert len(source) == 1 and (probe[row, k:] == batches[source[0]][row, k:]).all()
    assert [p[:3] for p in blind_probes(batches, KEY, V)] == [p[:3] for p in probes]  # deterministic for a key


def test_the_parent_takes_per_batch_nats_only_and_sums_them_itself():
    from prism_challenge.audit.heldout_parent import _model_reply

    reply = {"nats": 1e9, "batch_nats": [1.5, 2.25, 0.125], "targets": 30, "nonfinite_batches": 0}
    got = _model_reply(reply, 3)
    assert got["nats"] == 3.875 and got["batch_nats"] == [1.5, 2.25, 0.125]  # the child's own total is not read
    for bad in ({**reply, "batch_nats": [1.5, 2.25]}, {**reply, "batch_nats": [1.5, -2.0, 0.1]},
                {**reply, "batch_nats": [1.5, math.inf, 0.1]}, {**reply, "batch_nats": [1.5, True, 0.1]},
                {k: v for k, v in reply.items() if k != "batch_nats"}):
        with pytest.raises((ValueError, KeyError)):
            _model_reply(bad, 3)
