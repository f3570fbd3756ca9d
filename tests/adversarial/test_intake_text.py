"""Intake takes text only (issue 13 item 3): one test per rule, through the library
(``run_gates``, ``open_bundle``), ``prism check`` (exit 2 for an intake refusal) and ``prism eval``.

Red team: a bundle file was an ELF shared library named ``.txt`` that ``build_model`` loaded
through a torch API; a bundle folder without ``__init__.py`` named like an installed namespace
package (``tiktoken_ext``) merged with it, and the gate took that package's modules for the
bundle's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from gatekit import EXAMPLE, SEED_TRAINING, arch, write_bundle

from prism_challenge import cli
from prism_challenge.intake.bundle import BundleError, open_bundle
from prism_challenge.intake.bundlefiles import importable_elsewhere
from prism_challenge.gates import INTAKE_RULES, RULES, run_gates
from prism_challenge.gates.cli import add_check_parser

ELF = b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 8 + b"\x03\x00\x3e\x00"  # an x86-64 shared-object header
LATIN1 = "X = 1\nNAME = 'caf\u00e9'\n".encode("latin-1")  # the e-acute is byte 0xe9 at offset 17, line 2
KINDS = "a bundle holds only .py, .md and .txt files and prism.yaml"


def refused(root: Path) -> BundleError:
    with pytest.raises(BundleError) as err:
        run_gates(root, check_params=False)
    assert err.value.rule in INTAKE_RULES
    return err.value


def check(argv: list[str], capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="prism")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check", *argv])
    return args.func(args), capsys.readouterr().out


def zipped(root: Path, z: Path) -> Path:
    with zipfile.ZipFile(z, "w") as zf:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(root).as_posix())
    return z


# --- file content --------------------------------------------------------------------------


def test_an_elf_named_txt_is_refused_for_its_nul_byte(tmp_path):
    root = write_bundle(tmp_path / "b", {"lib.txt": ELF})
    err = refused(root)
    assert (err.rule, str(err)) == (
        "prism:binary-file", "lib.txt line 1: NUL byte at byte offset 7: a bundle holds text files only",
    )  # fmt: skip
    with pytest.raises(BundleError) as zerr:  # a zip: the member, named as the archive names it
        run_gates(zipped(root, tmp_path / "b.zip"), check_params=False)
    assert (zerr.value.rule, str(zerr.value)) == (err.rule, str(err))


def test_a_nul_byte_in_a_py_file_is_named_with_its_line(tmp_path):
    err = refused(write_bundle(tmp_path, {"helpers.py": b"A = 1\nB = '\x00'\n"}))
    assert (err.rule, str(err)) == (
        "prism:binary-file", "helpers.py line 2: NUL byte at byte offset 11: a bundle holds text files only",
    )  # fmt: skip


def test_a_latin1_py_is_refused_naming_line_and_byte(tmp_path):
    root = write_bundle(tmp_path / "b", {"helpers.py": LATIN1})
    err = refused(root)
    assert (err.rule, str(err)) == (
        "prism:not-utf8",
        "helpers.py line 2: not valid UTF-8 at byte offset 17 (byte 0xe9: invalid continuation byte): "
        "a bundle holds UTF-8 text only",
    )
    with pytest.raises(BundleError) as zerr:
        run_gates(zipped(root, tmp_path / "b.zip"), check_params=False)
    assert (zerr.value.rule, str(zerr.value)) == (err.rule, str(err))


def test_invalid_utf8_in_markdown_is_refused_too(tmp_path):
    err = refused(write_bundle(tmp_path, {"docs/NOTES.md": b"# notes\n\xff\xfe\n"}))
    assert (err.rule, str(err)) == (
        "prism:not-utf8",
        "docs/NOTES.md line 2: not valid UTF-8 at byte offset 8 (byte 0xff: invalid start byte): "
        "a bundle holds UTF-8 text only",
    )


# --- file kinds ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["libevil.so", "weights.bin", "model.pt", "config.json", "conf/extra.yaml", "Makefile"])
def test_other_file_kinds_are_refused(tmp_path, name):
    err = refused(write_bundle(tmp_path, {name: "text\n"}))
    suffix = Path(name).suffix or "(no suffix)"
    assert (err.rule, str(err)) == ("prism:bad-suffix", f"{name}: file kind {suffix!r} is not allowed: {KINDS}")


def test_prism_yml_is_refused_with_a_hint_since_only_prism_yaml_is_read(tmp_path):
    err = refused(write_bundle(tmp_path, {"prism.yml": "tokenizer: bytes\n"}))
    assert (err.rule, str(err)) == ("prism:bad-suffix", "prism.yml: PRISM reads its spec only from prism.yaml; rename the file")


def test_a_sourceless_pyc_is_refused_as_bytecode(tmp_path):
    err = refused(write_bundle(tmp_path, {"helpers.pyc": b"\xa7\r\r\n"}))
    assert err.rule == "prism:bytecode" and str(err).startswith("helpers.pyc: bytecode is not accepted")


def test_a_local_runs_pycache_is_refused_with_the_fix(tmp_path):
    root = write_bundle(tmp_path, {"helpers.py": "X = 1\n"})
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "__pycache__" / "helpers.cpython-311.pyc").write_bytes(b"\xa7\r\r\n")
    err = refused(root)
    assert err.rule == "prism:bytecode"
    assert str(err) == (
        "pkg/__pycache__/: bytecode is not accepted, a bundle is source only: delete the __pycache__ "
        "folders (find BUNDLE -name __pycache__ -prune -exec rm -r {} +; PYTHONDONTWRITEBYTECODE=1 "
        "stops Python writing them)"
    )


def test_names_that_are_not_utf8_or_hold_control_characters_are_refused(tmp_path):
    root = write_bundle(tmp_path / "b", {})
    (root / os.fsdecode(b"caf\xe9.txt")).write_text("x\n")
    err = refused(root)
    assert (err.rule, str(err)) == ("prism:bad-name", "'caf\\udce9.txt': the name is not valid UTF-8")
    (root / os.fsdecode(b"caf\xe9.txt")).unlink()
    (root / "two\nlines.md").write_text("x\n")
    err = refused(root)
    assert (err.rule, str(err)) == ("prism:bad-name", "'two\\nlines.md': the name holds a control or unprintable character")


def test_a_zip_member_name_with_an_unprintable_character_is_refused(tmp_path):
    z = tmp_path / "b.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("architecture.py", arch())
        zf.writestr("\u202egnp.md", "x\n")  # a right-to-left override: reads as "md.png" in a terminal
    with pytest.raises(BundleError) as err:
        run_gates(z, check_params=False)
    assert (err.value.rule, str(err.value)) == (
        "prism:bad-name", "'\\u202egnp.md': the name holds a control or unprintable character",
    )  # fmt: skip


@pytest.mark.parametrize("rel,bad", [("my-helpers.py", "my-helpers"), ("utils.v2/layers.py", "utils.v2"),
                                     ("\ufb01le.py", "\ufb01le")])  # the ligature: `import \ufb01le` reads `file`
def test_a_py_path_that_no_import_can_name_is_refused(tmp_path, rel, bad):
    err = refused(write_bundle(tmp_path, {rel: "X = 1\n"}))
    assert (err.rule, str(err)) == (
        "prism:module-name",
        f"{rel}: not an importable module path ({bad!r} is not a Python identifier in NFKC form): "
        "rename it, e.g. with underscores",
    )


# --- module names shadowing other modules ---------------------------------------------------


def test_a_stdlib_name_is_refused(tmp_path):
    err = refused(write_bundle(tmp_path, {"json.py": "X = 1\n"}))
    assert (err.rule, str(err)) == (
        "prism:shadow-module",
        "json.py: the bundle module 'json' clashes with the standard library module 'json' "
        "(an import of 'json' could load either): rename it",
    )


def test_a_dependency_name_is_refused_as_a_folder(tmp_path):
    err = refused(write_bundle(tmp_path, {"numpy/__init__.py": "X = 1\n"}))
    assert (err.rule, str(err)) == (
        "prism:shadow-module",
        "numpy/: the bundle folder 'numpy' clashes with the installed package 'numpy' "
        "(an import of 'numpy' could load either): rename it",
    )


def test_main_is_refused(tmp_path):
    err = refused(write_bundle(tmp_path, {"__main__.py": "X = 1\n"}))
    assert err.rule == "prism:shadow-module" and "the running program's main module '__main__'" in str(err)


def _namespace_site(tmp_path: Path) -> Path:
    """A site directory holding a namespace package (no __init__.py) whose module reads files,
    a regular package and a plain module: what an installed dependency can look like."""
    site = tmp_path / "site"
    (site / "prismns_demo").mkdir(parents=True)
    (site / "prismns_demo" / "fetch.py").write_text("def read(path):\n    return open(path).read()\n")
    (site / "prismpkg_demo").mkdir()
    (site / "prismpkg_demo" / "__init__.py").write_text("")
    (site / "prismmod_demo.py").write_text("")
    return site


def test_a_folder_named_like_an_installed_namespace_package_is_refused(tmp_path, monkeypatch):
    site = _namespace_site(tmp_path)
    root = write_bundle(tmp_path / "b", {"prismns_demo/mine.py": "X = 1\n"})
    assert run_gates(root, check_params=False).findings == []  # nothing of that name installed
    monkeypatch.setenv("PYTHONPATH", str(site))  # now the interpreter finds the namespace package
    err = refused(root)
    assert (err.rule, str(err)) == (
        "prism:shadow-module",
        "prismns_demo/: the bundle folder 'prismns_demo' clashes with the installed namespace package "
        "'prismns_demo' (an import of 'prismns_demo' could load either): rename it",
    )
    assert importable_elsewhere(["prismpkg_demo", "prismmod_demo", "prismnone_demo"], root) == {
        "prismpkg_demo": "the installed package 'prismpkg_demo'",
        "prismmod_demo": "the installed module 'prismmod_demo'",
    }


def test_the_red_teams_folder_named_like_tiktokens_namespace_package_is_refused(tmp_path):
    import importlib.util

    spec = importlib.util.find_spec("tiktoken_ext")  # tiktoken (a dependency) ships a PEP 420 package
    if spec is None or spec.loader is not None:
        pytest.skip("this tiktoken has no tiktoken_ext namespace package")
    err = refused(write_bundle(tmp_path, {"tiktoken_ext/mine.py": "X = 1\n"}))
    assert (err.rule, str(err)) == (
        "prism:shadow-module",
        "tiktoken_ext/: the bundle folder 'tiktoken_ext' clashes with the installed namespace package "
        "'tiktoken_ext' (an import of 'tiktoken_ext' could load either): rename it",
    )


def test_a_folder_with_only_documents_does_not_need_a_free_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(_namespace_site(tmp_path)))
    root = write_bundle(tmp_path / "b", {"prismns_demo/README.md": "no code here\n"})
    assert run_gates(root, check_params=False).findings == []


def test_the_answer_does_not_depend_on_the_current_directory_or_sys_path(tmp_path, monkeypatch):
    here = tmp_path / "cwd"
    here.mkdir()
    (here / "prismcwd_demo.py").write_text("")
    (here / "prismcwd_pkg").mkdir()
    monkeypatch.chdir(here)
    monkeypatch.syspath_prepend(str(here))
    monkeypatch.syspath_prepend("")
    root = write_bundle(tmp_path / "b", {"prismcwd_demo.py": "X = 1\n", "prismcwd_pkg/__init__.py": ""})
    assert importable_elsewhere(["prismcwd_demo", "prismcwd_pkg"], root) == {}
    assert run_gates(root, check_params=False).findings == []
    # the bundle itself on PYTHONPATH is not "elsewhere" either
    monkeypatch.setenv("PYTHONPATH", str(root))
    assert importable_elsewhere(["prismcwd_demo", "prismcwd_pkg"], root) == {}


def test_architecture_and_training_are_free_names_in_this_environment():
    # if something installed were named like them, every bundle would be refused: a finding
    assert importable_elsewhere(["architecture", "training"], EXAMPLE) == {}


# --- own modules: packages need __init__.py -------------------------------------------------


def test_importing_from_a_folder_without_init_is_refused_by_the_gate(tmp_path):
    src = arch(top="from mylib.util import scale")
    root = write_bundle(tmp_path, {"architecture.py": src, "mylib/util.py": "def scale(x):\n    return x\n"})
    report = run_gates(root, check_params=False)
    line = src.splitlines().index("from mylib.util import scale") + 1
    assert [(f.rule, f.file, f.line, f.col, f.message, f.blocking) for f in report.findings] == [(
        "prism:not-a-package", "architecture.py", line, 1,
        "import of 'mylib.util': 'mylib' is the bundle folder mylib/, which has no __init__.py: a folder "
        "without __init__.py is not a package of the bundle (add mylib/__init__.py)", True,
    )]  # fmt: skip
    (root / "mylib" / "__init__.py").write_text("")
    assert run_gates(root, check_params=False).findings == []


def test_a_subfolder_without_init_inside_a_package_is_refused(tmp_path):
    root = write_bundle(tmp_path, {
        "architecture.py": arch(top="import blocks"),
        "blocks/__init__.py": "from .extra import layer\n",
        "blocks/extra/layer.py": "import socket\n",  # never indexed: refused where it is imported
    })  # fmt: skip
    report = run_gates(root, check_params=False)
    assert [(f.rule, f.file, f.line) for f in report.findings] == [("prism:not-a-package", "blocks/__init__.py", 1)]
    assert report.findings[0].message.startswith("import of 'blocks.extra': 'blocks.extra' is the bundle folder blocks/extra/")


def test_an_entrypoint_in_a_folder_without_init_is_refused(tmp_path):
    root = write_bundle(tmp_path, {"prism.yaml": "architecture:\n  entrypoint: net/model.py:build_model\n",
                                   "net/model.py": arch()})
    report = run_gates(root, check_params=False)
    assert [(f.rule, f.file, f.message) for f in report.findings] == [(
        "prism:not-a-package", "prism.yaml",
        "the architecture entrypoint net/model.py: 'net' is the bundle folder net/, which has no __init__.py: "
        "a folder without __init__.py is not a package of the bundle (add net/__init__.py)",
    )]  # fmt: skip


def test_happy_paths_the_example_and_a_helper_package_pass(tmp_path):
    assert run_gates(EXAMPLE, check_params=False).findings == []
    src = arch(top="from helpers.blocks import Scale\nfrom helpers import blocks", body="model.scale = Scale()")
    root = write_bundle(tmp_path / "b", {
        "architecture.py": src,
        "helpers/__init__.py": "",
        "helpers/blocks.py": "from torch import nn\n\n\nclass Scale(nn.Module):\n    def forward(self, x):\n        return x\n",
        "README.md": "# my bundle\n", "notes/ideas.txt": "caf\u00e9 \u2014 UTF-8 is fine\n", "prism.yaml": "tokenizer: gpt2\n",
    })  # fmt: skip
    report = run_gates(root)
    assert report.findings == [] and report.param_count is not None
    assert sorted(report.bundle.file_hashes) == [
        "README.md", "architecture.py", "helpers/__init__.py", "helpers/blocks.py", "notes/ideas.txt", "prism.yaml",
        "training.py",
    ]  # fmt: skip
    root_, extracted = open_bundle(zipped(root, tmp_path / "b.zip"))
    try:
        assert run_gates(root_, check_params=False).findings == []
    finally:
        shutil.rmtree(extracted)


def test_every_new_rule_is_registered():
    for rule in ("prism:binary-file", "prism:not-utf8", "prism:bytecode", "prism:bad-name", "prism:module-name",
                 "prism:shadow-module"):
        assert rule in INTAKE_RULES
    assert "prism:not-a-package" in RULES and "prism:not-a-package" not in INTAKE_RULES


# --- the command line ------------------------------------------------------------------------


def test_prism_check_exits_2_with_one_line_per_intake_rule(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(_namespace_site(tmp_path)))
    cases = {
        "elf": ({"lib.txt": ELF}, "prism:binary-file: lib.txt line 1: NUL byte at byte offset 7"),
        "latin1": ({"helpers.py": LATIN1}, "prism:not-utf8: helpers.py line 2: not valid UTF-8 at byte offset 17"),
        "kind": ({"model.pt": "x"}, f"prism:bad-suffix: model.pt: file kind '.pt' is not allowed: {KINDS}"),
        "stdlib": ({"json.py": "X = 1\n"}, "prism:shadow-module: json.py: the bundle module 'json' clashes with the standard library module 'json'"),
        "dependency": ({"numpy/__init__.py": ""}, "prism:shadow-module: numpy/: the bundle folder 'numpy' clashes with the installed package 'numpy'"),
        "namespace": ({"prismns_demo/x.py": ""}, "prism:shadow-module: prismns_demo/: the bundle folder 'prismns_demo' clashes with the installed namespace package 'prismns_demo'"),
    }  # fmt: skip
    for name, (files, start) in cases.items():
        root = write_bundle(tmp_path / name, files)
        code, out = check([str(root)], capsys)
        assert code == 2, name
        assert out.startswith(f"cannot read bundle {start}") and out.count("\n") == 1, out
        code, out = check([str(root), "--json"], capsys)
        error = json.loads(out)["error"]
        assert code == 2 and f"{error['rule']}: {error['message']}".startswith(start)


def test_prism_check_exits_1_for_an_import_from_a_folder_without_init(tmp_path, capsys):
    root = write_bundle(tmp_path, {"architecture.py": arch(top="import mylib.util"), "mylib/util.py": "X = 1\n"})
    code, out = check([str(root), "--json", "--no-params"], capsys)
    assert code == 1
    assert [(f["rule"], f["file"]) for f in json.loads(out)["findings"]] == [("prism:not-a-package", "architecture.py")]


def test_prism_check_passes_the_example(capsys):
    code, out = check([str(EXAMPLE), "--no-params"], capsys)
    assert code == 0 and "PASS" in out


def test_prism_eval_fails_at_intake_with_one_clear_line(tmp_path, capsys):
    root = write_bundle(tmp_path / "b", {"lib.txt": ELF})
    code = cli.main(["eval", str(root), "--isolation", "none", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1
    failure = [line for line in err.splitlines() if line.startswith("prism eval failed")]
    assert failure == [
        "prism eval failed at stage intake: prism:binary-file: lib.txt line 1: NUL byte at byte offset 7: "
        "a bundle holds text files only"
    ]
    assert not (tmp_path / "run").exists() or list((tmp_path / "run").iterdir()) == []
    assert "Traceback" not in err
