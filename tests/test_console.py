"""Console output, seed statistics, learning curves and compare's grouping (no torchrun)."""

import math
import statistics

import pytest

from prism_challenge.research.compare import Group, Run, comparability, seed_repeats, warnings
from prism_challenge.research.plots import PlotError, figure_bytes, learning_curve_figure, run_curve, save_figure
from prism_challenge.research.report import seed_stats, strip_launcher_dump

TORCHRUN_DUMP = """step 1
E1201 10:05:12.332000 4 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
prism_challenge.evaluator.rank FAILED
------------------------------------------------------------
Root Cause (first observed failure):
  error_file: <N/A>
============================================================
after"""


def test_torchrun_dump_and_c10d_warning_are_stripped():
    text = "[W1201 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3\n" + TORCHRUN_DUMP
    assert strip_launcher_dump(text) == "step 1\nafter"
    assert strip_launcher_dump("Traceback (most recent call last):\n  File \"t.py\"\nValueError: x") == \
        "Traceback (most recent call last):\n  File \"t.py\"\nValueError: x"  # the loop's own traceback stays
    # the single-rank agent's one line of the same kind (evaluator/single.py writes it)
    assert strip_launcher_dump("step 1\nprism single-rank agent: rank 0 failed (exitcode: 1)\nafter") == "step 1\nafter"


def test_seed_stats_use_the_sample_std_and_skip_failed_runs():
    runs = [{"status": "scored", "seed": s, "prequential_bpb": b, "final_score": 1 / (1 + b), "run_dir": f"/r{s}"}
            for s, b in ((1, 4.0), (2, 4.5), (3, 3.25))] + [{"status": "failed", "seed": 4, "run_dir": None}]
    st = seed_stats(runs)
    assert st["n"] == 3 and st["failed_seeds"] == [4] and st["seeds"] == [1, 2, 3]
    assert st["prequential_bpb"]["mean"] == pytest.approx(11.75 / 3)
    dev = [4.0 - 11.75 / 3, 4.5 - 11.75 / 3, 3.25 - 11.75 / 3]
    assert st["prequential_bpb"]["std"] == pytest.approx(math.sqrt(sum(d * d for d in dev) / 2))
    assert st["final_score"]["std"] == statistics.stdev([0.2, 1 / 5.5, 1 / 4.25])


CURVE = {"nats_per_target": [5.0, 4.0, 3.0], "cumulative_targets": [10, 30, 60], "cumulative_bytes": [20, 50, 120]}


def test_run_curve_per_batch_and_cumulative_bpb():
    c = run_curve({"curve": CURVE}, "a")
    ln2 = math.log(2)
    assert c.cumulative_bytes == [20, 50, 120]
    assert c.batch_bpb == pytest.approx([50 / ln2 / 20, 80 / ln2 / 30, 90 / ln2 / 70])
    assert c.cumulative_bpb == pytest.approx([50 / ln2 / 20, 130 / ln2 / 50, 220 / ln2 / 120])
    with pytest.raises(PlotError, match="no learning curve"):
        run_curve({"curve": {"nats_per_target": []}}, "empty")


def test_figures_are_png_or_svg(tmp_path):
    fig = learning_curve_figure([run_curve({"curve": CURVE}, "a")])
    assert figure_bytes(fig, "png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in figure_bytes(fig, "svg")
    with pytest.raises(PlotError, match="must end in .png or .svg"):
        save_figure(fig, tmp_path / "x.jpg")


def _manifest(seed, bpb, *, data="d" * 64, world=1, sha="b" * 64):
    return {"status": "scored", "seed": seed, "bundle": {"sha256": sha, "path": "/x/mine"},
            "data": {"manifest_sha256": data}, "tokenizer": {"name": "gpt2"}, "budgets": {"token_budget": 100},
            "compute": {"world_size": world, "device": "cpu"}, "config": {"sequence_length": 256},
            "profile": {"name": "local", "sha256": "c" * 64, "overridden": ["seed"] if seed != 1234 else []},
            "score": {"prequential_bpb": bpb}, "verdict": {"final_score": 1 / (1 + bpb)}}


def test_seed_repeats_group_one_bundle_with_one_setting():
    runs = [Run(f"/r/{s}", _manifest(s, b), str(s)) for s, b in ((1234, 4.0), (1, 4.2), (2, 3.9))]
    other = Run("/r/o", _manifest(3, 3.0, sha="e" * 64), "o")  # another bundle: not a repeat of these
    (row,) = seed_repeats(Group(comparability(runs[0].manifest), [*runs, other]))
    assert row["n"] == 3 and row["seeds"] == [1234, 1, 2]
    assert row["prequential_bpb"]["mean"] == statistics.mean([4.0, 4.2, 3.9])
    assert row["prequential_bpb"]["std"] == statistics.stdev([4.0, 4.2, 3.9])


def test_warnings_name_every_field_that_differs():
    a, b = _manifest(1, 4.0), _manifest(1, 4.0, data="f" * 64, world=2)
    ws = warnings([Group(comparability(a)), Group(comparability(b))])
    assert ws[0] == "2 groups of runs that are not comparable; each is ranked on its own"
    assert [w.split(" differs")[0] for w in ws[1:]] == ["data", "world size"]
    assert comparability({**a, "budgets": {"byte_budget": 5}})["tokenizer basis"] == "bytes (any tokenizer)"


def test_a_one_batch_curve_is_drawn_as_a_point():
    """A run of one batch has one point per curve: drawn with a marker, not as an empty chart."""
    one = {"nats_per_target": [2.0], "cumulative_targets": [10], "cumulative_bytes": [40]}
    fig = learning_curve_figure([run_curve({"curve": one}, "one")])
    thick = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("one")]
    assert len(thick) == 1 and thick[0].get_marker() == "o"
    assert list(thick[0].get_xdata()) == [40] and list(thick[0].get_ydata()) == [2.0 * 10 / math.log(2) / 40]
