"""``prism check BUNDLE [--json]``: exit 0 clean, 1 blocked, 2 unreadable; table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from prism_challenge.gates.cli import add_check_parser

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-1m"


def check(argv: list[str], capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="prism")
    sub = parser.add_subparsers(dest="command", required=True)
    add_check_parser(sub)
    args = parser.parse_args(["check", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def hostile(tmp_path: Path) -> Path:
    root = tmp_path / "hostile"
    root.mkdir()
    (root / "architecture.py").write_text(
        (EXAMPLE / "architecture.py").read_text() + "\nimport socket\n"
    )
    (root / "training.py").write_text((EXAMPLE / "training.py").read_text())
    return root


def test_clean_bundle_exits_0_with_json(capsys):
    code, out = check([str(EXAMPLE), "--json", "--no-params"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["findings"] == [] and data["blocking"] is False
    assert data["bundle"]["architecture"] == "architecture.py:build_model"
    assert data["bundle"]["training"] == "training.py:train"
    assert data["param_count"] is None


def test_blocking_finding_exits_1_table_and_json(tmp_path, capsys):
    root = hostile(tmp_path)
    code, out = check([str(root), "--no-params"], capsys)
    assert code == 1
    assert "prism:no-network" in out and "BLOCKED" in out
    code, out = check([str(root), "--json", "--no-params"], capsys)
    assert code == 1
    (f,) = json.loads(out)["findings"]
    assert (f["rule"], f["file"], f["blocking"]) == ("prism:no-network", "architecture.py", True)
    assert f["line"] == len((root / "architecture.py").read_text().splitlines())


def test_advisory_only_exits_0_and_nproc_makes_it_block(tmp_path, capsys):
    root = hostile(tmp_path)
    (root / "architecture.py").write_text((EXAMPLE / "architecture.py").read_text())
    (root / "training.py").write_text(
        (EXAMPLE / "training.py").read_text().replace("dist.destroy_process_group()", "pass")
    )
    code, out = check([str(root), "--no-params"], capsys)
    assert code == 0 and "advisory" in out and "prism:ddp-destroy" in out
    code, _ = check([str(root), "--no-params", "--nproc", "4"], capsys)
    assert code == 1


def test_unreadable_bundle_exits_2(tmp_path, capsys):
    code, out = check([str(tmp_path / "missing")], capsys)
    assert code == 2 and "prism:bundle-unreadable" in out
    z = tmp_path / "evil.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("../evil.py", "x = 1\n")
    code, out = check([str(z), "--json"], capsys)
    assert code == 2
    data = json.loads(out)
    assert data["error"]["rule"] == "prism:zip-parent-path" and "../evil.py" in data["error"]["message"]
    code, out = check([str(EXAMPLE), "--nproc", "0"], capsys)
    assert code == 2


def test_launch_limits_block(capsys):
    code, out = check([str(EXAMPLE), "--json", "--no-params", "--nproc", "16", "--nnodes", "2"], capsys)
    assert code == 1
    rules = [(f["rule"], f["file"]) for f in json.loads(out)["findings"]]
    assert rules == [("prism:launch-limit", ""), ("prism:launch-limit", "")]


def test_param_cap_flag(capsys):
    code, out = check([str(EXAMPLE), "--json", "--max-parameters", "1000000"], capsys)
    assert code == 1
    data = json.loads(out)
    assert data["param_count"] == 1_020_420
    assert [f["rule"] for f in data["findings"]] == ["prism:param-cap"]


def test_check_example_exits_0_with_its_parameter_count():
    # its time is the benchmarks' to measure (bench/overhead.py prints the gates' seconds), not a test's
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, "-m", "prism_challenge.gates.cli", str(EXAMPLE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "1,020,420" in proc.stdout


def test_a_zip_bundle_is_named_as_given_never_by_its_temporary_extraction(tmp_path, capsys, monkeypatch):
    root = hostile(tmp_path)
    z = tmp_path / "some_bundle.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for p in sorted(root.iterdir()):
            zf.write(p, p.name)
    monkeypatch.chdir(tmp_path)
    code, out = check(["some_bundle.zip", "--no-params"], capsys)
    assert code == 1 and "prism-bundle-" not in out and "/tmp" not in out
    assert out.startswith("bundle some_bundle.zip  architecture architecture.py:build_model")
    assert "architecture.py:" in out and "prism:no-network" in out
    code, out = check(["some_bundle.zip", "--no-params", "--json"], capsys)
    data = json.loads(out)
    assert data["bundle"]["source"] == "some_bundle.zip"
    assert [(f["rule"], f["file"]) for f in data["findings"]] == [("prism:no-network", "architecture.py")]


def test_finding_messages_name_the_zip_not_the_extraction_path(tmp_path):
    from prism_challenge.gates.core import _unextracted
    from prism_challenge.gates.findings import Finding

    extracted = tmp_path / "prism-bundle-x"
    root = extracted / "mybundle"
    f = Finding("prism:build-error", "architecture.py", 3, 0, f"build_model(ctx): OSError: {root}/weights.txt: no")
    assert _unextracted(f, root, extracted, "b.zip").message == "build_model(ctx): OSError: b.zip:weights.txt: no"
    same = Finding("prism:build-error", "architecture.py", 3, 0, "ValueError: bad")
    assert _unextracted(same, root, extracted, "b.zip") is same


def test_a_file_that_is_not_a_bundle_exits_2_with_one_line(tmp_path, capsys):
    py = EXAMPLE / "training.py"
    code, out = check([str(py)], capsys)
    assert code == 2
    assert out == (
        f"cannot read bundle prism:bundle-unreadable: {py}: not a bundle: "
        "a bundle is a directory or a .zip holding architecture.py and training.py\n"
    )


def test_malformed_prism_yaml_is_one_finding_line_with_its_line_number(tmp_path, capsys):
    root = hostile(tmp_path)
    (root / "architecture.py").write_text((EXAMPLE / "architecture.py").read_text())
    (root / "prism.yaml").write_text("tokenizer: [unclosed\n")
    code, out = check([str(root), "--no-params", "--json"], capsys)
    assert code == 1
    (f,) = json.loads(out)["findings"]
    assert (f["rule"], f["file"], f["line"], f["blocking"]) == ("prism:spec", "prism.yaml", 2, True)
    assert f["message"] == (
        "prism.yaml line 2: not valid YAML: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence from line 1)"
    )


def test_the_header_breaks_between_its_parts_never_inside_one():
    from prism_challenge.gates.cli import _packed

    assert _packed(["bundle b", "architecture a.py:f", "tokenizer gpt2"], 30) == [
        "bundle b  architecture a.py:f", "tokenizer gpt2"]  # 8 + 2 + 19 = 29 fits, + 16 does not
    assert _packed(["x" * 40, "y"], 30) == ["x" * 40, "y"]  # too long for the width: a line of its own
    assert _packed(["a", "b", "c"], 7) == ["a  b  c"]
