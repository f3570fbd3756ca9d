"""A bundle that prints hundreds of MB in build_model and in train: every child that runs it (the
parameter child, the ranks, the held-out child, the re-scoring and blind-probe children) is read
through the bounded drain, the run still scores, and the ranks' log is capped."""

from __future__ import annotations

import json
import shutil

import pytest

from prism_challenge.evaluator import jail as jail_module
from prism_challenge.evaluator.jailchild import Finished
from prism_challenge.evaluator.outputcap import LOG_BYTES, TAIL_BYTES, gap_note
from prism_challenge.pipeline import EvalOptions, evaluate

from helpers import EXAMPLE

pytestmark = pytest.mark.slow

MB = 1 << 20
FLOOD_MB = 300
FLOOD = f"""

_example_build_model = build_model


def build_model(ctx):
    for _ in range({FLOOD_MB}):
        print("x" * ({MB} - 1))  # 300 MiB on stdout, each time the model is built
    return _example_build_model(ctx)
"""
TRAIN_FLOOD = f"""

_example_train = train


def train(ctx):
    for _ in range({FLOOD_MB}):
        print("y" * ({MB} - 1))
    _example_train(ctx)
"""


def test_a_bundle_printing_300_mb_in_every_child_still_scores_with_bounded_output(tmp_path, monkeypatch):
    root = tmp_path / "bundle"
    shutil.copytree(EXAMPLE, root)
    (root / "architecture.py").write_text((EXAMPLE / "architecture.py").read_text() + FLOOD)
    (root / "training.py").write_text((EXAMPLE / "training.py").read_text() + TRAIN_FLOOD)
    seen: list[Finished] = []
    finish = jail_module.Jail.finish

    def recording(self, started, **kw):
        done = finish(self, started, **kw)
        seen.append(done)
        return done

    monkeypatch.setattr(jail_module.Jail, "finish", recording)
    outcome = evaluate(EvalOptions(bundle=str(root), out_dir=str(tmp_path / "run"), device="cpu", threads=1,
                                   token_budget=4_000, heldout_bytes=10_000))
    assert outcome.failure is None, outcome.failure
    assert outcome.manifest["audit"]["passed"] and outcome.manifest["audit"]["blind_probes"] > 0
    replies = [json.loads(done.stdout.decode().splitlines()[-1]) for done in seen]
    kinds = [("parameters" if "count" in r else "audit" if "jobs" in r else "heldout" if "parameter_count" in r
              else "?") for r in replies]
    # the parameter child, the re-scoring and blind-probe children, the held-out children (twin and
    # trained, then its blind probes)
    assert sorted(set(kinds)) == ["audit", "heldout", "parameters"] and len(kinds) >= 5, kinds
    assert outcome.manifest["verdict"]["heldout"]["blind_probes"] > 0
    for done in seen:  # each built the model at least once: 300 MiB printed, at most a tail kept
        assert done.returncode == 0 and len(done.stderr) == TAIL_BYTES
        assert done.stderr_dropped >= FLOOD_MB * MB - TAIL_BYTES and done.stdout_dropped == 0
    log = outcome.run_dir / "logs" / "runner.log"
    text = log.read_bytes()
    # the ranks printed 600 MiB (build_model, then train): the log holds its head, a note, its tail
    assert len(text) <= LOG_BYTES + TAIL_BYTES + 200
    note = text[text.index(b"[prism: "):].split(b"\n")[0].decode()
    dropped, total = (int(w.replace(",", "")) for w in (note.split()[1], note.split()[-2]))
    assert note == gap_note(dropped, total) and total >= 2 * FLOOD_MB * MB
    assert dropped == total - LOG_BYTES - TAIL_BYTES
