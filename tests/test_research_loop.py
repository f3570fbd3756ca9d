"""The researcher's loop end to end: byte budgets, seed repeats, compiled modules, the console."""

import io
import json
import re
import statistics
from pathlib import Path

import pytest

from rich.console import Console

from prism_challenge.cli import main
from prism_challenge.pipeline import EvalOptions, evaluate
from prism_challenge.research.report import print_summary
from prism_challenge.manifest.run_manifest import MANIFEST_NAME

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


BIGRAM = """
import torch
from torch import nn


class Bigram(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.table = nn.Embedding(v, v)

    def forward(self, tokens):
        return self.table(tokens)


def build_model(ctx):
    return Bigram(ctx.vocab_size)
"""

SGD_LOOP = """
import torch
import torch.nn.functional as F


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    scored = {wrap}
    opt = torch.optim.SGD(model.parameters(), lr={lr})
    for batch in ctx.iter_train_batches(scored, batch_size=2, seq_len=32):
        logits = scored(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    {after}
"""


def bigram_bundle(root, lr=1.0, wrap="model", after="pass"):
    return write_bundle(root, BIGRAM, SGD_LOOP.format(lr=lr, wrap=wrap, after=after))


def test_a_compiled_module_gets_heldout_figures(tmp_path):
    # torch.compile wraps the module in an OptimizedModule whose state names start "_orig_mod.";
    # the held-out process builds build_model's module and must load the trained state
    bundle = bigram_bundle(tmp_path / "b", wrap='torch.compile(model, backend="eager")')
    o = _run(tmp_path, bundle, "run", token_budget=2000, heldout_bytes=20_000, run_gates=True)
    assert o.failure is None, o.failure
    v = o.manifest["verdict"]
    assert v["heldout_error"] is None and "heldout_unavailable" not in v["flags"]
    ho = v["heldout"]
    assert ho["heldout_delta"] == pytest.approx(ho["val_bpb_twin"] - ho["val_bpb_trained"], abs=1e-12)
    assert ho["val_bpb_trained"] < ho["val_bpb_twin"]  # lr 1.0 on a bigram table learns
    # the console summary at 80 columns: the score and its direction, the full paths
    buf = io.StringIO()
    print_summary(Console(file=buf, width=80), o)
    text = buf.getvalue()
    assert len(str(o.run_dir / MANIFEST_NAME)) > 60
    assert f"run manifest: {o.run_dir / MANIFEST_NAME}\n" in text
    assert f"loop output (print) and the launcher's log: {o.run_dir / 'logs' / 'runner.log'}\n" in text
    assert "score: final_score, higher is better; ranked by prequential_bpb, lower is better" in text
    assert f"final_score (higher is better)    │ {v['final_score']:.6f}" in text


def test_a_heldout_failure_is_one_line_with_a_hint(tmp_path):
    # a buffer added by the loop is not in build_model's module: the state does not load
    bundle = bigram_bundle(tmp_path / "b", after='model.register_buffer("extra", torch.zeros(1))')
    o = _run(tmp_path, bundle, "run", token_budget=2000, heldout_bytes=20_000)
    assert o.failure is None, o.failure
    err = o.manifest["verdict"]["heldout_error"]
    log = o.run_dir / "logs" / "heldout.log"
    assert "\n" not in err and err.startswith("load: ")
    assert "hint: the trained state does not load into build_model(ctx)'s module" in err
    assert err.endswith(f"(full error: {log})")
    assert 'Unexpected key(s) in state_dict: "extra"' in log.read_text()


def test_seeds_report_the_mean_and_sample_std_of_the_kept_runs(tmp_path, capsys):
    bundle = bigram_bundle(tmp_path / "b")
    out = tmp_path / "seeds"
    code = main(["eval", str(bundle), "--seeds", "1234,1,2", "--token-budget", "2000", "--heldout-bytes", "20000",
                 "--out", str(out), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    agg = report["aggregate"]
    manifests = [json.loads((out / f"seed-{s}" / MANIFEST_NAME).read_text()) for s in (1234, 1, 2)]
    bpb = [m["score"]["prequential_bpb"] for m in manifests]
    fs = [m["verdict"]["final_score"] for m in manifests]
    assert [m["seed"] for m in manifests] == [1234, 1, 2] and len(set(bpb)) == 3
    assert agg["n"] == 3 and agg["std"] == "sample standard deviation (ddof=1)"
    assert agg["prequential_bpb"] == {"values": bpb, "mean": statistics.mean(bpb), "std": statistics.stdev(bpb)}
    assert agg["final_score"] == {"values": fs, "mean": statistics.mean(fs), "std": statistics.stdev(fs)}
    left = ["heldout_bytes", "token_budget"]  # the fields set otherwise than in the profile `local`
    assert [m["profile"]["overridden"] for m in manifests] == [left, ["heldout_bytes", "seed", "token_budget"]] + [
        ["heldout_bytes", "seed", "token_budget"]]
    # prism compare groups the three as seed repeats of one bundle: mean ± std
    assert main(["compare", str(out)]) == 0
    text = capsys.readouterr().out
    assert "seed repeats" in text
    assert f"{statistics.mean(bpb):.6f} ± {statistics.stdev(bpb):.6f}" in text
    assert f"{statistics.mean(fs):.6f} ± {statistics.stdev(fs):.6f}" in text


def test_compare_ranks_as_the_challenge_and_warns_on_other_data(tmp_path, capsys):
    import shutil
    import xml.etree.ElementTree as ET

    from prism_challenge.score.verdict import rank

    dirs = []
    for lr in (0.0, 1.0, 4.0):  # three real runs of different learning rates
        o = _run(tmp_path, bigram_bundle(tmp_path / f"b{lr}", lr=lr), f"lr{lr}", token_budget=2000,
                 heldout_bytes=20_000)
        assert o.failure is None, o.failure
        dirs.append(o.run_dir)
    manifests = [json.loads((d / MANIFEST_NAME).read_text()) for d in dirs]
    expected = rank([{"id": str(d), "prequential_bpb": m["score"]["prequential_bpb"],
                      "heldout_delta": m["verdict"]["heldout"]["heldout_delta"], "submitted_at": m["created_at"],
                      "final_score": m["verdict"]["final_score"], "flags": m["verdict"]["flags"],
                      "anti_cheat_multiplier": m["verdict"]["anti_cheat_multiplier"],
                      "memorization_penalty": m["verdict"]["memorization_penalty"]} for d, m in zip(dirs, manifests)])
    order = [Path(e["id"]).name for e in expected]
    assert len(set(m["score"]["prequential_bpb"] for m in manifests)) == 3
    # a fourth run: a real run's manifest, edited to another data MANIFEST
    other = tmp_path / "other-data"
    shutil.copytree(dirs[1], other)
    edited = json.loads((other / MANIFEST_NAME).read_text())
    edited["data"]["manifest_sha256"] = "0" * 64
    (other / MANIFEST_NAME).write_text(json.dumps(edited))
    png, svg, page = tmp_path / "c.png", tmp_path / "c.svg", tmp_path / "c.html"
    assert main(["compare", str(tmp_path / "lr*"), str(other), "--plot", str(png), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "WARNING 2 groups of runs that are not comparable" in out
    assert f"data differs: group 1: \"{manifests[0]['data']['manifest_sha256']}\" | group 2: \"{'0' * 64}\"" in out
    positions = [out.index(f" {name} ") for name in order]
    assert positions == sorted(positions) and out.index("other-data") > positions[-1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["compare", *map(str, dirs), "--plot", str(svg)]) == 0
    assert "WARNING" not in capsys.readouterr().out
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    text = page.read_text()
    assert text.count("<svg") == 1 and "WARNING: data differs" in text
    # a bigram table is a look-up, no matmul: 0 FLOPs counted, so no point of bpb against FLOPs (log scale)
    assert [m["compute"]["training_flops_estimate"] for m in manifests] == [0, 0, 0]
    assert "bpb against training FLOPs" not in text
    assert [text.index(f"<td>{name}</td>") for name in order] == sorted(text.index(f"<td>{n}</td>") for n in order)


def test_gate_refusal_names_the_check_command_that_reproduces_it(tmp_path, capsys):
    bundle = bigram_bundle(tmp_path / "b")  # no process group, no DDP: blocks at --nproc 2 only
    assert main(["eval", str(bundle), "--nproc", "2", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert f"3 blocking finding(s); `prism check {bundle} --nproc 2` lists them" in err
    assert not (tmp_path / "run").exists()
    assert main(["check", str(bundle), "--nproc", "2"]) == 1
    assert main(["check", str(bundle)]) == 0  # the advisories at one process are shown, never blocking
    out = capsys.readouterr().out
    rules = sorted(set(re.findall(r"prism:ddp-[a-z0-9-]+", out)))
    assert rules == ["prism:ddp-destroy", "prism:ddp-init", "prism:ddp-wrap"]  # no sampler is asked for


def test_init_writes_a_bundle_that_passes_check_and_scores_at_two_processes(tmp_path, capsys):
    bundle = tmp_path / "mine"
    assert main(["init", str(bundle), "--tokenizer", "bytes"]) == 0
    assert sorted(p.name for p in bundle.iterdir()) == ["README.md", "architecture.py", "prism.yaml", "training.py"]
    assert "tokenizer: bytes" in (bundle / "prism.yaml").read_text()
    assert main(["check", str(bundle), "--nproc", "2"]) == 0
    capsys.readouterr()
    assert main(["eval", str(bundle), "--nproc", "2", "--token-budget", "3000", "--heldout-bytes", "20000",
                 "--out", str(tmp_path / "run"), "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    m = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert out["world_size"] == m["compute"]["world_size"] == 2 and out["status"] == "scored"
    assert m["gates"]["findings"] == [] and m["verdict"]["heldout"] is not None
    assert out["prequential_bpb"] == m["score"]["prequential_bpb"]
    assert main(["init", str(bundle)]) == 2  # not over an existing bundle


def test_a_run_that_leaves_its_profile_says_which_fields(tmp_path, capsys):
    from prism_challenge.data.builtin import ensure_builtin

    bundle = bigram_bundle(tmp_path / "b")
    code = main(["eval", str(bundle), "--profile", "prism-v2", "--data", str(ensure_builtin()), "--device", "cpu",
                 "--token-budget", "500", "--heldout-bytes", "0", "--out", str(tmp_path / "run"), "--json", "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    m = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    p = m["profile"]
    assert out["profile"] == p and p["name"] == "prism-v2"
    # --token-budget replaced the profile's byte budget; the embedded corpus is not the pinned FineWeb-Edu
    assert p["overridden"] == ["byte_budget", "data", "device", "heldout_bytes", "token_budget"]
    assert p["data_mismatch"][0] == "source: profile 'fineweb-edu', data 'builtin'"
    assert m["budgets"] == {"token_budget": 500, "byte_budget": None, "step_budget": None,
                            "wall_clock_budget_s": 1200.0}
    assert m["config"]["sequence_length"] == 512 and m["stream"]["stop_reason"] == "token_budget"
