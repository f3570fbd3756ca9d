"""The cyclic collector in the harness's children (:mod:`prism_challenge.evaluator.childgc`):
paused over a child's start, back (with the start's objects frozen) before the bundle's first
line, also when the audit hook is off; the parent's pause freezes nothing. Each case runs in a
fresh interpreter: ``gc.freeze`` and an armed audit hook cannot be undone in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.jail import Jail
from prism_challenge.gates.param_parent import measure_parameters

from helpers import write_bundle

STATES = """
import gc, json, os, tempfile
from prism_challenge.evaluator import childgc
seen = {"start": [gc.isenabled(), gc.get_freeze_count()]}
childgc.resume()  # never paused: nothing to undo
seen["resume unpaused"] = [gc.isenabled(), gc.get_freeze_count()]
with childgc.paused():
    seen["in paused()"] = [gc.isenabled(), gc.get_freeze_count()]
seen["after paused()"] = [gc.isenabled(), gc.get_freeze_count()]
childgc.pause()
seen["paused"] = [gc.isenabled(), gc.get_freeze_count()]
os.environ["PRISM_AUDIT_HOOKS"] = "off"  # arm() returns at once, and still resumes
from prism_challenge.evaluator.audit import arm
arm(tempfile.gettempdir(), [])
seen["armed, hook off"] = [gc.isenabled(), gc.get_freeze_count() > 0]
print(json.dumps(seen))
"""


def test_pause_resume_and_paused_in_a_fresh_interpreter() -> None:
    done = subprocess.run([sys.executable, "-c", STATES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen == {
        "start": [True, 0],
        "resume unpaused": [True, 0],  # a process that never paused is left as it is
        "in paused()": [False, 0],
        "after paused()": [True, 0],  # the parent's pause freezes nothing
        "paused": [False, 0],
        "armed, hook off": [True, True],  # back on, the start's objects frozen
    }


GC_ARCH = """
import gc
import torch


def build_model(ctx):
    raise RuntimeError(f"GCSTATE {gc.isenabled()} {gc.get_freeze_count() > 100000}")
"""


def test_the_parameter_childs_bundle_code_runs_with_the_collector_on(tmp_path: Path) -> None:
    # the audit hook is off (the jail's audit=False) so that the bundle may import gc; the
    # collector must be back all the same, with the child's start (torch: >100,000 objects) frozen
    root = write_bundle(tmp_path / "b", GC_ARCH)
    jail = Jail.open("none", bundle_dir=root, hidden=[], limits=Limits(), threads=1, audit=False)
    try:
        got = measure_parameters(root, "architecture", "build_model", vocab_size=257, seq_len=8,
                                 max_parameters=10**6, jail=jail)
    finally:
        jail.close()
    assert got.kind == "build"
    assert "GCSTATE True True" in got.error, got.error
