"""``--profile-phases`` (issue 28, item 1): the rank's phase clock charges each lap to its phase,
and a real run writes every rank's phases and the parent's CPU time to logs/phases.json."""
import json

import pytest

from prism_challenge.evaluator import phases
from prism_challenge.evaluator.phases import PHASES, PhaseClock

from helpers import EXAMPLE


def test_laps_are_charged_to_their_phase(monkeypatch):
    ticks = iter([10.0, 10.5, 11.75, 12.0, 15.0])
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(ticks))
    clock = PhaseClock(True)  # 10.0
    clock.start()  # 10.5
    clock.lap("scoring")  # 11.75: 1.25 s
    clock.lap("loop")  # 12.0: 0.25 s
    clock.lap("scoring")  # 15.0: 3 s more
    report = clock.report()
    assert report["scoring"] == 4.25 and report["loop"] == 0.25
    assert all(report[p] == 0.0 for p in PHASES if p not in ("scoring", "loop"))
    off = PhaseClock(False)
    off.lap("scoring")  # no clock read at all: the iterator above is exhausted
    assert off.totals["scoring"] == 0.0


@pytest.mark.slow
def test_a_run_writes_the_phases_of_its_ranks(tmp_path):
    from prism_challenge.pipeline import EvalOptions, evaluate

    o = evaluate(EvalOptions(bundle=str(EXAMPLE), out_dir=str(tmp_path / "run"), token_budget=3000, seq_len=64,
                             heldout_bytes=0, run_gates=False, threads=1, profile_phases=True))
    assert o.failure is None, o.failure
    got = json.loads((tmp_path / "run" / "logs" / "phases.json").read_text())
    rank = got["ranks"]["0"]
    assert rank["batches"] == len(o.manifest["curve"]["nats_per_target"])
    assert set(PHASES) <= set(rank) and all(rank[p] >= 0 for p in PHASES)
    assert rank["scoring"] > 0 and rank["loop"] > 0 and rank["cpu_user_s"] > 0
    assert got["parent"]["wall_s"] > 0 and "report_wait" not in json.dumps(o.manifest)  # never in the manifest
