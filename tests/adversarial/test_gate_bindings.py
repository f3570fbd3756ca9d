"""The gate refuses binding an interpreter-facing dunder in any binding form (gates/bindings.py):
a red team passed ``prism check`` with ``import torch as __builtins__`` (every later function of
the module then resolved ``sys``, ``os``, ``ctypes`` in torch's namespace) and with
``from helper import X as __name__`` / ``__package__`` / ``__path__`` / ``__spec__``."""

from __future__ import annotations

import pytest
from gatekit import EXAMPLE, arch, line_of, write_bundle

from prism_challenge.gates import run_gates

RULE = "prism:no-monkeypatch"


@pytest.mark.parametrize(
    ("top", "needle", "name"),
    [
        ("import torch as __builtins__", "import torch as", "__builtins__"),
        ("import math as __loader__", "import math as", "__loader__"),
        ("from torch import nn as __name__", "nn as __name__", "__name__"),
        ("from torch import nn as __package__", "nn as __package__", "__package__"),
        ("from torch import nn as __spec__", "nn as __spec__", "__spec__"),
        ("try:\n    pass\nexcept ValueError as __builtins__:\n    pass", "except ValueError", "__builtins__"),
        ("def helper():\n    global __builtins__\n    return 0", "global __builtins__", "__builtins__"),
        ("def helper(__builtins__=None):\n    return 0", "def helper(", "__builtins__"),
        ("def __getattr__(name):\n    return 0", "def __getattr__", "__getattr__"),
        ("class __Hidden__:\n    pass", "class __Hidden__", "__Hidden__"),
        ("def helper(x):\n    match x:\n        case [*__path__]:\n            return 0", "case [*__path__]", "__path__"),
        ("def helper(x):\n    match x:\n        case {**__dict__}:\n            return 0", "case {**__dict__}", "__dict__"),
    ],
)
def test_binding_a_dunder_is_refused_in_every_form(tmp_path, top, needle, name):
    src = arch(top=top)
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src, "training.py": (EXAMPLE / "training.py").read_text()}),
                       check_params=False)
    try:
        hits = [f for f in report.findings if f.blocking and f.rule == RULE and f"binds '{name}'" in f.message]
        assert hits, report.findings
        assert hits[0].file == "architecture.py" and hits[0].line == line_of(src, needle)
    finally:
        report.cleanup()


def test_the_ordinary_dunders_still_pass(tmp_path):
    src = arch(top='__all__ = ["build_model"]\n__version__ = "1"\n\n\nclass Box:\n    def __init__(self, v):\n'
                   '        self.v = v\n\n    def __len__(self):\n        return 1')
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src, "training.py": (EXAMPLE / "training.py").read_text()}),
                       check_params=False)
    try:
        assert [f for f in report.findings if f.blocking] == []
    finally:
        report.cleanup()
