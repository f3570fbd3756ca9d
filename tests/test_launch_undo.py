"""A bundle the gates refuse leaves none of the launch behind, not even the memory cgroup the
jail made for the early-launched torchrun tree: ``pipeline.start.launch`` puts the jail's kill and
close on the ExitStack that a refusal unwinds (found by the red team: before, only the stream
stage closed the jail, so on a host with a cgroup v2 memory controller every refused submission
left one ``prism-<pid>-<ns>`` group behind).

The host here has no cgroup v2, so :meth:`MemoryCgroup.create` hands out empty folders under
``tmp_path`` (``enter`` is a no-op: nothing is written in them, so ``remove``'s ``rmdir``
succeeds exactly when it is called).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_challenge.evaluator.memcgroup import MemoryCgroup
from prism_challenge.pipeline import EvalFailure, EvalOptions, evaluate

from helpers import IMPORT_OS_LOOP, UNIFORM_ARCH, write_bundle

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("isolation", ["strict", "none"])
def test_a_static_refusal_removes_the_torchrun_cgroup(tmp_path: Path, monkeypatch, isolation: str) -> None:
    groups = tmp_path / "cgroups"
    groups.mkdir()
    made: list[Path] = []

    def create(limit, root=None, proc_cgroup="/proc/self/cgroup"):
        path = groups / f"prism-{len(made)}"
        path.mkdir()
        made.append(path)
        return MemoryCgroup(path, limit)

    monkeypatch.setattr(MemoryCgroup, "create", classmethod(lambda cls, *a, **k: create(*a, **k)))
    monkeypatch.setattr(MemoryCgroup, "enter", lambda self: None)
    bundle = write_bundle(tmp_path / "b", UNIFORM_ARCH, IMPORT_OS_LOOP)
    with pytest.raises(EvalFailure) as err:
        evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / "run"), device="cpu", run_gates=True,
                             isolation=isolation, token_budget=500, heldout_bytes=0,
                             memory_limit_bytes=8 << 30))
    assert err.value.stage == "gates"
    assert not (tmp_path / "run").exists()  # the run directory went (the ExitStack)
    assert made, "the jail made no cgroup: the test does not exercise the leak"
    assert sorted(p.name for p in groups.iterdir()) == []  # ... and so must the torchrun tree's cgroup
