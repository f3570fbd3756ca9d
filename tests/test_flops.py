"""What a run spent (issue 29, part 6): forward FLOPs counted by hand against FlopCounterMode's,
the manifest's compute figures, the schema, the console and compare views."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prism_challenge.score.flops import (
    TRAINING_FLOPS_FACTOR,
    checked,
    count_forward_flops,
    flops_text,
    run_spent,
    shape_counts,
    shape_of,
    spent,
)
from prism_challenge.manifest.results import SCHEMA_PATH

from helpers import LOOP, write_bundle


class OneLinear(nn.Module):
    """One-hot ids [B, T] -> one Linear(IN, OUT): 2 * B * T * IN * OUT FLOPs (one multiply-add each)."""

    IN, OUT = 8, 5

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(self.IN, self.OUT)

    def forward(self, tokens):
        return self.lin(F.one_hot(tokens % self.IN, self.IN).float())


class Attention(nn.Module):
    """One head of width D over the one-hot ids: SDPA's two batched matmuls, q @ k^T and p @ v,
    2 * B * H * T * T * D FLOPs each (torch counts full attention, the causal mask ignored)."""

    D = 8

    def forward(self, tokens):
        q = F.one_hot(tokens % self.D, self.D).float().unsqueeze(1)  # [B, 1, T, D]
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)


def test_a_linear_layer_counts_2_b_t_in_out_per_shape():
    tokens = torch.randint(0, 50, (3, 7))
    got = count_forward_flops(OneLinear(), tokens, [(3, 7), (2, 5), (4, 9)], None)
    assert got == {"3x7": 2 * 3 * 7 * 8 * 5, "2x5": 2 * 2 * 5 * 8 * 5, "4x9": 2 * 4 * 9 * 8 * 5}
    # at the scoring precision (bf16 autocast) the count is of the same matmuls
    assert count_forward_flops(OneLinear(), tokens, [(3, 7)], torch.bfloat16) == {"3x7": 1680}


def test_cpu_fused_attention_is_counted_as_torch_counts_the_flash_kernel():
    got = count_forward_flops(Attention(), torch.randint(0, 50, (3, 7)), [(3, 7)], None)
    assert got == {"3x7": 2 * (2 * 3 * 1 * 7 * 7 * 8)}


def test_the_count_restores_modes_and_leaves_the_weights():
    m = OneLinear().train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    count_forward_flops(m, torch.randint(0, 50, (2, 4)), [(2, 4)], None)
    assert m.training and all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_shapes_counts_and_the_training_estimate():
    counts = shape_counts([[(4, 256)], [(4, 256)], [(2, 256)], [(1, 110)]])
    assert counts == {"1x110": 1, "2x256": 1, "4x256": 2}
    assert shape_of("4x256") == (4, 256)
    for bad in ("4", "0x3", "ax3", "4x"):
        with pytest.raises(ValueError, match="expected 'BxT'"):
            shape_of(bad)
    fwd = {"1x110": 11, "2x256": 20, "4x256": 40}
    rec = spent(fwd, counts, stream_wall_s=2.5, run_wall_s=9.0, world_size=2, count_s=0.1)
    assert rec["training_flops_estimate"] == 3 * (11 + 20 + 2 * 40) == TRAINING_FLOPS_FACTOR * 111
    assert rec["device_seconds"] == 5.0 and rec["run_wall_s"] == 9.0 and rec["flops_error"] is None
    missing = spent({"4x256": 40}, counts, stream_wall_s=None, run_wall_s=1.0, world_size=1)
    assert missing["training_flops_estimate"] is None and missing["device_seconds"] is None
    assert missing["flops_error"] == "a scored batch shape has no FLOP count"


@pytest.mark.parametrize("reply,error", [
    (None, "sent no FLOP count"),
    ({"flops": {"2x4": True}, "seconds": 0.1}, "malformed"),
    ({"flops": {"2x4": -1}}, "malformed"),
    ({"flops": {"2x4": 1.5}}, "malformed"),
    ({"flops": {"2x4": 3, "9x9": 1}}, "malformed"),
    ({"flops": {}}, "malformed"),
    ({"error": "RuntimeError: no", "seconds": 0.2}, "failed under the FLOP counter: RuntimeError: no"),
])
def test_a_malformed_or_failed_count_is_recorded_as_none(reply, error):
    flops, _, why = checked(reply, ["2x4"])
    assert flops is None and error in why


def test_run_spent_names_why_there_is_no_count():
    steps = [SimpleNamespace(shapes=[(2, 4)])]
    assert run_spent(None, steps, stream_wall_s=1.0, run_wall_s=2.0, world_size=1)["flops_error"].startswith(
        "no audit ran")
    failed = SimpleNamespace(flops=None, error="timeout: x", mismatch=None)
    assert "did not complete: timeout: x" in run_spent(failed, steps, stream_wall_s=1.0, run_wall_s=2.0,
                                                        world_size=1)["flops_error"]
    ok = SimpleNamespace(flops={"flops": {"2x4": 10}, "seconds": 0.5})
    rec = run_spent(ok, steps * 3, stream_wall_s=1.0, run_wall_s=2.0, world_size=1)
    assert rec["training_flops_estimate"] == 90 and rec["flops_count_s"] == 0.5


def test_the_schema_declares_the_compute_figures():
    props = json.loads(SCHEMA_PATH.read_text())["$defs"]["Compute"]["properties"]
    for k in ("forward_flops_per_batch", "batches_per_shape", "training_flops_estimate", "stream_wall_s",
              "run_wall_s", "device_seconds", "flops_count_s", "flops_method", "flops_error"):
        assert k in props
    for k in ("forward_flops_per_batch", "batches_per_shape"):
        assert props[k]["anyOf"][0]["patternProperties"] == {"^[1-9][0-9]*x[1-9][0-9]*$": {"minimum": 0,
                                                                                           "type": "integer"}}


def test_flops_text():
    assert (flops_text(124703174160), flops_text(None), flops_text(950)) == ("1.25e11", "-", "950")


# -- a real run ------------------------------------------------------------------------------------
EMB_HEAD = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.emb = nn.Embedding(v, 4)
        self.pad = nn.Linear(4, 4)
        self.head = nn.Linear(4, v)
        self.lean = False  # a plain attribute: not in the state_dict, so never in a snapshot

    def forward(self, tokens):
        h = self.emb(tokens)
        if not self.lean:
            h = h + 0.0 * self.pad(h)  # a matmul that leaves the logits bitwise the same
        return self.head(h)


def build_model(ctx):
    return M(ctx.vocab_size)
"""

# the plain SGD loop, which first makes its own model skip a matmul (in its own process). The
# count is made in the audit's child, on the model build_model builds there with the scored
# weights: the loop's switch never reaches it (and the ranks cannot import torch.utils.flop_counter)
HOSTILE_LOOP = LOOP.format(lr=0.1, batch=2, seq_len=16).replace(
    "    model = ctx.build_model().to(ctx.device)",
    "    model = ctx.build_model().to(ctx.device)\n"
    "    model.lean = True", 1)


def _hand(b, t, v):
    """The forward's matmuls: pad (4 -> 4) and head (4 -> V), 2 FLOPs per multiply-add; the
    embedding look-up is not a matmul."""
    return 2 * b * t * 4 * 4 + 2 * b * t * 4 * v


@pytest.mark.slow
def test_a_real_run_records_the_hand_counted_flops_whatever_its_loop_does(tmp_path):
    from rich.console import Console

    from prism_challenge.pipeline import EvalOptions, evaluate
    from prism_challenge.research.report import print_summary
    from prism_challenge.manifest.results import RunManifest

    bundle = write_bundle(tmp_path / "b", EMB_HEAD, HOSTILE_LOOP)
    o = evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / "run"), device="cpu", token_budget=2000,
                             run_gates=False, heldout_bytes=0))
    assert o.failure is None, o.failure
    m = o.manifest
    c, t, v = m["compute"], m["timing"], m["tokenizer"]["vocab_size"]
    assert c["flops_error"] is None and m["audit"]["passed"]
    counts = c["batches_per_shape"]
    assert sum(counts.values()) == m["stream"]["batches"]  # one rank
    assert sum(b * (t_ - 1) * n for (b, t_), n in ((shape_of(k), n) for k, n in counts.items())) == \
        m["stream"]["targets"]
    assert "2x16" in counts
    assert c["forward_flops_per_batch"] == {k: _hand(*shape_of(k), v) for k in counts}
    assert c["training_flops_estimate"] == 3 * sum(_hand(*shape_of(k), v) * n for k, n in counts.items())
    assert c["stream_wall_s"] == t["release_to_last_record_s"] > 0
    assert c["device_seconds"] == c["stream_wall_s"] and c["run_wall_s"] == t["wall_s"]
    assert 0 < c["flops_count_s"] < t["heldout_s"]
    assert "FlopCounterMode" in c["flops_method"] and "Kaplan" in c["flops_method"]
    RunManifest.model_validate(m)
    bad = json.loads(json.dumps(m))
    bad["compute"]["forward_flops_per_batch"] = {"2 by 16": 1}
    with pytest.raises(ValueError, match="2 by 16"):
        RunManifest.model_validate(bad)
    console = Console(record=True, width=200)
    print_summary(console, o)
    row = next(line for line in console.export_text().splitlines() if "training FLOPs (estimate)" in line)
    assert f"│ {flops_text(c['training_flops_estimate'])} (3 x the scoring forward's" in row
    assert f"; {c['device_seconds']:.1f} device-seconds" in row


# -- prism compare ---------------------------------------------------------------------------------
def _scored(seed, bpb, flops, sha):
    return {"schema": "prism.run.v2", "status": "scored", "seed": seed, "created_at": f"2026-01-0{seed}T00:00:00+00:00",
            "bundle": {"sha256": sha, "path": f"/x/{sha[:2]}"}, "data": {"manifest_sha256": "d" * 64},
            "tokenizer": {"name": "gpt2"}, "budgets": {"token_budget": 100},
            "compute": {"world_size": 1, "device": "cpu", "training_flops_estimate": flops},
            "config": {"sequence_length": 256}, "stream": {"stop_reason": "token_budget"},
            "score": {"prequential_bpb": bpb, "bytes": 300},
            "curve": {"nats_per_target": [5.0, 4.0], "cumulative_targets": [10, 30], "cumulative_bytes": [20, 50]},
            "verdict": {"final_score": 1 / (1 + bpb), "anti_cheat_multiplier": 1.0, "memorization_penalty": 1.0,
                        "flags": []}}


def test_compare_shows_the_training_flops_and_plots_bpb_against_them(tmp_path, capsys):
    import re

    from prism_challenge.cli import main
    from prism_challenge.research.plots import compute_figure, compute_point

    runs = {"big": _scored(1, 3.5, 124703174160, "a" * 64), "small": _scored(2, 4.0, 6_000_000, "b" * 64),
            "old": _scored(3, 4.5, None, "c" * 64)}  # a manifest from before issue 29: no figure
    for name, m in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "prism_run_manifest.v2.json").write_text(json.dumps(m))
    svg, page = tmp_path / "c.svg", tmp_path / "r.html"
    code = main(["compare", str(tmp_path / "big"), str(tmp_path / "small"), str(tmp_path / "old"),
                 "--plot-compute", str(svg), "--html", str(page)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "train FLOPs" in out and "1.25e11" in out and "6e06" in out
    text = page.read_text()
    assert "<td>1.25e11</td>" in text and "<td>6e06</td>" in text and "bpb against training FLOPs" in text
    # one marker per run with a figure, at (FLOPs, bpb): the old run is left out of the plot
    assert compute_point(runs["old"], "old") is None
    pts = [compute_point(runs[k], k) for k in ("big", "small")]
    fig = compute_figure(pts)
    offsets = sorted(tuple(c.get_offsets()[0]) for c in fig.axes[0].collections)
    assert offsets == [(6_000_000, 4.0), (124703174160, 3.5)]
    assert fig.axes[0].get_xscale() == "log"
    assert "<svg" in svg.read_text()
    assert main(["compare", str(tmp_path / "old"), "--plot-compute", str(tmp_path / "o.png")]) == 2
    assert "no scored run has a training FLOP estimate above 0" in capsys.readouterr().err


def test_the_feeder_records_each_ranks_slice_shape_of_every_scored_step(tmp_path):
    from test_feeder import FakeRunner, early, make_feeder, wait_done

    f = make_feeder(tmp_path, world_size=2)  # 1000 tokens in slices of up to 3 rows of 10
    r0, r1 = FakeRunner(f, 0), FakeRunner(f, 1)
    x0, x1, step, served = r0.next(3, 10), r1.next(3, 10), 0, []
    while x0 is not None and x1 is not None:
        served.append([x0.shape, x1.shape])
        early(r0, step, 1.0, 3, 10)
        early(r1, step, 1.0, 3, 10)
        x0, x1, step = r0.take(), r1.take(), step + 1
    for r in (r0, r1):
        protocol_done(r)
    assert wait_done(f)
    res = f.finish()
    assert res.error is None and len(res.steps) == len(served) == 19
    assert served[-1] == [(1, 10), (2, 10)]  # the last global batch: 3 rows split 1 | 2
    assert shape_counts(s.shapes for s in res.steps) == shape_counts(served) == {"1x10": 1, "2x10": 1, "3x10": 36}


def protocol_done(runner):
    from prism_challenge.evaluator import protocol
    from prism_challenge.evaluator.protocol import Kind

    protocol.send(runner.sock, Kind.DONE, {})


def test_only_the_first_rescoring_child_counts_the_flops():
    import numpy as np

    from prism_challenge.audit.rescore import Job, job_config

    jobs = [Job(step, 0, i, np.zeros((2, 4), dtype=np.int64), [(0, 1)]) for i, step in enumerate((0, 5, 9))]
    config = {"seed": 1, "flop_shapes": ["2x4"]}
    first = job_config(config, jobs[:1], [0], "rescore", first=True)
    assert first["flop_shapes"] == ["2x4"] and first["jobs"] == [{"step": 0, "rank": 0, "state": 0, "picks": [(0, 1)]}]
    later = job_config(config, jobs[1:], [1, 2], "rescore", first=False)
    assert "flop_shapes" not in later and [j["state"] for j in later["jobs"]] == [0, 1]
    assert "flop_shapes" not in job_config(config, jobs, [0, 1, 2], "blind", first=True)
    assert config["flop_shapes"] == ["2x4"]  # the run's config is left as it was
