"""The parameter cap's child as a spare (issue 28): on a host with a core to spare, ``prism eval``
starts it with the ranks, it imports torch while the static gates run, and the gate feeds it its
arguments on stdin. The count and the score are the same either way; a refused bundle ends the
spare unfed; the child refuses a stdin that is not its arguments.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import prism_challenge.pipeline.start as start
from prism_challenge.evaluator.jail import Jail
from prism_challenge.gates.param_parent import CHILD_ARGV_TAIL, spare_cores
from prism_challenge.pipeline import EvalFailure, EvalOptions, evaluate

from helpers import IMPORT_OS_LOOP, UNIFORM_ARCH, write_bundle


def test_the_child_refuses_a_stdin_that_is_not_a_json_list_of_strings() -> None:
    for line in (b"--root /tmp\n", b'{"root": "/tmp"}\n', b"[1, 2]\n"):
        done = subprocess.run([sys.executable, *CHILD_ARGV_TAIL], input=line, capture_output=True, timeout=120)
        assert done.returncode == 1
        assert b"stdin's first line must be a JSON list of strings" in done.stderr


def test_the_spare_needs_a_core_for_each_rank_the_parent_and_itself(monkeypatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(3)))
    assert spare_cores(1) and not spare_cores(2)


def _record(monkeypatch) -> list[tuple[str, object]]:
    """Every param child the jail starts, and when the static gates begin, in order."""
    events: list[tuple[str, object]] = []
    real_start, real_static = Jail.start, start.static_gates

    def started(self, argv, **kwargs):
        got = real_start(self, argv, **kwargs)
        if tuple(argv[1:]) == CHILD_ARGV_TAIL:
            events.append(("param child", got))
        return got

    def static(*args, **kwargs):
        events.append(("static gates", None))
        return real_static(*args, **kwargs)

    monkeypatch.setattr(Jail, "start", started)
    monkeypatch.setattr(start, "static_gates", static)
    return events


def _eval(bundle: Path, out: Path) -> dict:
    o = evaluate(EvalOptions(bundle=str(bundle), out_dir=str(out), device="cpu", isolation="strict",
                             token_budget=400, heldout_bytes=0, audited_batches=0))
    assert o.failure is None, o.failure
    return {"count": o.manifest["gates"]["parameter_count"], "bpb": o.manifest["score"]["prequential_bpb"]}


@pytest.mark.slow
def test_a_spare_gives_the_same_count_and_score_as_a_child_started_by_the_gate(tmp_path: Path, monkeypatch) -> None:
    bundle = write_bundle(tmp_path / "b", UNIFORM_ARCH)
    seen = {}
    for spare in (True, False):
        monkeypatch.setattr(start, "spare_cores", lambda nproc, spare=spare: spare)
        events = _record(monkeypatch)
        seen[spare] = _eval(bundle, tmp_path / f"run-{spare}")
        kinds = [kind for kind, _ in events]
        # one param child either way: with a spare it starts before the static gates and is fed
        assert kinds == (["param child", "static gates"] if spare else ["static gates", "param child"])
    assert seen[True] == seen[False]
    assert seen[True]["count"] == 1  # Uniform's one bias


@pytest.mark.slow
def test_a_refused_bundle_ends_the_spare_unfed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(start, "spare_cores", lambda nproc: True)
    events = _record(monkeypatch)
    bundle = write_bundle(tmp_path / "b", UNIFORM_ARCH, IMPORT_OS_LOOP)
    with pytest.raises(EvalFailure) as err:
        _eval(bundle, tmp_path / "run")
    assert err.value.stage == "gates"
    children = [got for kind, got in events if kind == "param child"]
    assert len(children) == 1, "no spare was started: the test does not exercise it"
    assert children[0].proc.wait(timeout=30) is not None  # killed with the launch's undo, never fed
    assert children[0].proc.returncode != 0
