"""The gate never crashes: too-deep sources and any failure inside it are prism:too-complex."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from prism_challenge.cli import main
from prism_challenge.gates import run_gates
from prism_challenge.gates.complexity import MAX_DEPTH, TOO_COMPLEX, deepest
from prism_challenge.gates.parsing import parse_source
from prism_challenge.gates.sandbox import Checker

sys.path.insert(0, str(Path(__file__).resolve().parent / "adversarial"))
from gatekit import arch, line_of, write_bundle  # noqa: E402

CHAIN = "\n\ndef chain(a):\n    return a" + ".b" * 1500 + "\n"
PARENS = "\n\nX = " + "(" * 1500 + "1" + ")" * 1500 + "\n"
DEEP = {"attribute-chain": CHAIN, "nested-parentheses": PARENS}


def deep_bundle(tmp_path: Path, extra: str) -> tuple[Path, int]:
    """The clean bundle with ``extra`` appended to architecture.py; the line of its deep part."""
    src = arch() + extra
    root = write_bundle(tmp_path / "b", {"architecture.py": src})
    return root, line_of(src, "return a.b" if extra is CHAIN else "X = ((")


@pytest.mark.parametrize("kind", sorted(DEEP))
def test_deep_source_is_too_complex_through_the_api(tmp_path, kind):
    root, line = deep_bundle(tmp_path, DEEP[kind])
    report = run_gates(root, check_params=False)
    assert [(f.rule, f.file, f.line, f.blocking) for f in report.findings] == [
        (TOO_COMPLEX, "architecture.py", line, True)
    ]
    assert report.findings[0].message.startswith("too complex for the gate to check: ")
    assert report.blocking and report.param_count is None


@pytest.mark.parametrize("kind", sorted(DEEP))
def test_deep_source_is_too_complex_through_the_cli(tmp_path, kind, capsys):
    root, line = deep_bundle(tmp_path, DEEP[kind])
    assert main(["check", str(root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(f["rule"], f["file"], f["line"]) for f in report["findings"]] == [(TOO_COMPLEX, "architecture.py", line)]
    assert report["blocking"] is True
    assert main(["check", str(root)]) == 1  # the table too, without a traceback
    out = capsys.readouterr().out
    assert TOO_COMPLEX in out and "BLOCKED: 1 blocking finding(s)" in out and "Traceback" not in out


def test_the_nesting_limit_is_checked_without_recursion():
    text = "x = a" + ".b" * (MAX_DEPTH + 50) + "\n"
    _, tree, (f,) = parse_source("m.py", text.encode())
    assert tree is None and (f.rule, f.line) == (TOO_COMPLEX, 1)
    assert f"nested {MAX_DEPTH + 54} levels deep (at most {MAX_DEPTH})" in f.message
    depth, line = deepest(__import__("ast").parse("a = 1\nb = (c.d)\n"))
    assert (depth, line) == (5, 2)  # Module > Assign > Attribute > Name > Load


def test_any_failure_while_checking_is_a_finding_at_the_node_being_checked(tmp_path, monkeypatch):
    src = arch(body="y = model.emb")
    target = src.count("\n", 0, src.index("y = model.emb")) + 1

    def boom(self, node):
        if node.attr == "emb":
            raise RecursionError("maximum recursion depth exceeded")
        return original(self, node)

    original = Checker._on_Attribute
    monkeypatch.setattr(Checker, "_on_Attribute", boom)
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    (f,) = [f for f in report.findings if f.rule == TOO_COMPLEX]
    assert (f.file, f.line) == ("architecture.py", target)
    assert f.message == "too complex for the gate to check: RecursionError: maximum recursion depth exceeded"


def test_a_refused_file_does_not_make_its_importers_fail_too(tmp_path):
    root, _ = deep_bundle(tmp_path, CHAIN)  # training.py imports build_model from it
    report = run_gates(root, check_params=False)
    assert [f.file for f in report.findings] == ["architecture.py"]


@pytest.mark.slow
def test_prism_eval_fails_at_the_gate_with_one_clear_line(tmp_path, capsys):
    root, line = deep_bundle(tmp_path, CHAIN)
    code = main(["eval", str(root), "--isolation", "none", "--device", "cpu", "--no-progress",
                 "--out", str(tmp_path / "run"), "--token-budget", "100"])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 1
    assert "prism eval failed at stage gates: 1 blocking finding(s)" in text
    assert f"architecture.py:{line}:0: {TOO_COMPLEX}: too complex for the gate to check" in text
    assert "Traceback" not in text
    assert not (tmp_path / "run").exists()
