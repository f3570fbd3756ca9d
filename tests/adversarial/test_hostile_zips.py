"""Hostile archives and directories: each intake rule refuses the bundle with its rule id.

Intake refusals are :class:`BundleError` (``prism check`` exits 2), raised before any source
is read; nothing may be left on disk afterwards.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import warnings
import zipfile
from pathlib import Path

import pytest
from gatekit import EXAMPLE, SEED_TRAINING, arch

from prism_challenge import scratch as own_folder
from prism_challenge.intake.bundle import BundleError
from prism_challenge.intake.refusal import IntakeLimits
from prism_challenge.intake.ziparchive import extract_zip
from prism_challenge.gates import INTAKE_RULES, run_gates

CLEAN = {"architecture.py": arch(), "training.py": SEED_TRAINING}


def make_zip(path: Path, members: list[tuple], method=zipfile.ZIP_DEFLATED) -> Path:
    """members: (name, data) or (ZipInfo, data) tuples, written in order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns on duplicate names
        with zipfile.ZipFile(path, "w", method) as zf:
            for name, data in members:
                zf.writestr(name, data)
    return path


def special(name: str, kind: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3  # unix
    info.external_attr = (kind | 0o777) << 16
    return info


def clean_members() -> list[tuple[str, str]]:
    return list(CLEAN.items())


ZIP_CASES = [
    ("absolute", [("/architecture.py", arch())], "prism:zip-absolute-path", "/architecture.py"),
    ("drive-letter", [("C:/evil.py", "x = 1\n")], "prism:zip-absolute-path", "C:/evil.py"),
    ("backslash-root", [("\\evil.py", "x = 1\n")], "prism:zip-absolute-path", "\\evil.py"),
    ("parent", [("../evil.py", "x = 1\n")], "prism:zip-parent-path", "../evil.py"),
    ("nested-parent", [("a/../../evil.py", "x = 1\n")], "prism:zip-parent-path", "a/../../evil.py"),
    ("windows-traversal", [("..\\..\\evil.py", "x = 1\n")], "prism:zip-escape", "..\\..\\evil.py"),
    ("symlink", [(special("architecture.py", stat.S_IFLNK), "/etc/passwd")], "prism:symlink", "architecture.py"),
    ("fifo", [(special("pipe.txt", stat.S_IFIFO), "")], "prism:special-file", "pipe.txt"),
    ("duplicate", [("architecture.py", arch()), ("architecture.py", "import os\n")], "prism:zip-duplicate", "architecture.py"),
    ("ratio-bomb", [("notes.txt", b"\0" * 300_000)], "prism:zip-ratio", "notes.txt"),
    ("size-bomb", [("notes.txt", b"\0" * (5 << 20))], "prism:zip-too-large", None),
    ("too-many", [(f"m{i}.txt", "x") for i in range(300)], "prism:too-many-files", None),
    ("weights", [("weights.bin", b"\x01\x02")], "prism:bad-suffix", "weights.bin"),
    ("pyc", [("__pycache__/architecture.cpython-311.pyc", b"\x00")], "prism:bytecode", "__pycache__/architecture.cpython-311.pyc"),
    ("pycache-dir", [("__pycache__/", b"")], "prism:bytecode", "__pycache__/"),
    ("sourceless-pyc", [("helpers.pyc", b"\x00")], "prism:bytecode", "helpers.pyc"),
    ("elf-as-txt", [("lib.txt", b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 56)], "prism:binary-file", "lib.txt"),
    ("latin1-py", [("helpers.py", "NAME = 'caf\u00e9'\n".encode("latin-1"))], "prism:not-utf8", "helpers.py line 1"),
    ("json", [("config.json", "{}")], "prism:bad-suffix", "config.json"),
    ("no-suffix", [("Makefile", "all:\n")], "prism:bad-suffix", "Makefile"),
    ("nested-zip", [("inner.zip", b"PK\x05\x06" + b"\0" * 18)], "prism:bad-suffix", "inner.zip"),
]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A private temp directory for the test, with a fresh owner folder of this process in it
    (:func:`prism_challenge.scratch.own`), closed at the end: what the gates extract goes there."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setattr(own_folder, "_own", None)
    yield base
    owned = own_folder.made()
    if owned is not None and base in owned.path.parents:
        owned.close()


@pytest.mark.parametrize("members,rule,named", [c[1:] for c in ZIP_CASES], ids=[c[0] for c in ZIP_CASES])
def test_hostile_zip_is_refused(tmp_path, scratch, members, rule, named):
    z = make_zip(tmp_path / "b.zip", clean_members()[:1] + members if rule != "prism:zip-duplicate" else members)
    with pytest.raises(BundleError) as err:
        run_gates(z, check_params=False)
    assert err.value.rule == rule
    assert rule in INTAKE_RULES
    if named:
        assert named in str(err.value)
    owned = own_folder.made()  # the process's owner folder, made under the test's temp directory
    assert owned is not None and owned.path.parent == scratch
    assert sorted(p.name for p in owned.path.iterdir()) == [own_folder.LOCK_NAME]  # nothing extracted is left
    assert not (tmp_path / "evil.py").exists() and not Path("/evil.py").exists()


def test_source_cap_counts_stored_members(tmp_path):
    big = "x = 1\n" * (100_000)  # 600 kB, stored (ratio 1) so only the source cap can refuse it
    z = make_zip(tmp_path / "b.zip", [*clean_members(), ("table.py", big)], zipfile.ZIP_STORED)
    with pytest.raises(BundleError) as err:
        run_gates(z, check_params=False)
    assert err.value.rule == "prism:source-too-large"
    assert "table.py" in str(err.value)


def test_encrypted_member_is_refused(tmp_path):
    z = make_zip(tmp_path / "b.zip", [("architecture.py", arch())])
    data = bytearray(z.read_bytes())
    for sig, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # set "encrypted" in both headers
        at = data.index(sig) + flag_at
        data[at] |= 0x1
    z.write_bytes(bytes(data))
    with pytest.raises(BundleError) as err:
        run_gates(z, check_params=False)
    assert err.value.rule == "prism:bad-zip"


def test_not_a_zip_and_missing_path(tmp_path):
    bad = tmp_path / "b.zip"
    bad.write_bytes(b"this is not an archive")
    with pytest.raises(BundleError) as err:
        run_gates(bad, check_params=False)
    assert err.value.rule == "prism:bad-zip"
    with pytest.raises(BundleError) as err:
        run_gates(tmp_path / "nope", check_params=False)
    assert err.value.rule == "prism:bundle-unreadable"


def test_limits_are_configurable(tmp_path):
    z = make_zip(tmp_path / "b.zip", clean_members())
    with pytest.raises(BundleError) as err:
        extract_zip(z, tmp_path / "out", IntakeLimits(max_files=1))
    assert err.value.rule == "prism:too-many-files"


# --- directory bundles ---------------------------------------------------------------------


def _dir_bundle(tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    root.mkdir()
    for rel, text in CLEAN.items():
        (root / rel).write_text(text)
    return root


def test_directory_symlink_file_is_refused(tmp_path):
    root = _dir_bundle(tmp_path)
    (root / "architecture.py").unlink()
    (root / "architecture.py").symlink_to(EXAMPLE / "architecture.py")
    with pytest.raises(BundleError) as err:
        run_gates(root, check_params=False)
    assert (err.value.rule, "architecture.py" in str(err.value)) == ("prism:symlink", True)


def test_directory_symlink_dir_is_refused(tmp_path):
    root = _dir_bundle(tmp_path)
    (root / "lib").symlink_to(EXAMPLE)
    with pytest.raises(BundleError) as err:
        run_gates(root, check_params=False)
    assert err.value.rule == "prism:symlink"


def test_directory_fifo_is_refused(tmp_path):
    root = _dir_bundle(tmp_path)
    os.mkfifo(root / "pipe.txt")
    with pytest.raises(BundleError) as err:
        run_gates(root, check_params=False)
    assert err.value.rule == "prism:special-file"


def test_directory_bad_suffix_and_size(tmp_path):
    root = _dir_bundle(tmp_path)
    (root / "weights.pt").write_bytes(b"\0")
    with pytest.raises(BundleError) as err:
        run_gates(root, check_params=False)
    assert (err.value.rule, "weights.pt" in str(err.value)) == ("prism:bad-suffix", True)
    (root / "weights.pt").unlink()
    (root / "table.py").write_text("T = [" + "1, " * 200_000 + "]\n")
    with pytest.raises(BundleError) as err:
        run_gates(root, check_params=False)
    assert err.value.rule == "prism:source-too-large"


def test_directory_pycache_is_refused_with_a_hint(tmp_path):
    root = _dir_bundle(tmp_path)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "architecture.cpython-311.pyc").write_bytes(b"\0\1\2")
    with pytest.raises(BundleError) as err:
        run_gates(root, check_params=False)
    assert err.value.rule == "prism:bytecode"
    assert str(err.value) == (
        "__pycache__/: bytecode is not accepted, a bundle is source only: delete the __pycache__ folders "
        "(find BUNDLE -name __pycache__ -prune -exec rm -r {} +; PYTHONDONTWRITEBYTECODE=1 stops "
        "Python writing them)"
    )
    shutil.rmtree(root / "__pycache__")
    assert run_gates(root, check_params=False).findings == []


# --- clean archives ------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "tiny-1m/"])
def test_clean_zip_passes_and_is_cleaned_up(tmp_path, scratch, prefix):
    members = [(prefix + p.name, p.read_bytes()) for p in sorted(EXAMPLE.iterdir()) if p.is_file()]
    if prefix:
        members.insert(0, (prefix, b""))  # the folder entry itself
    z = make_zip(tmp_path / "b.zip", members)
    report = run_gates(z, check_params=False)
    assert report.findings == []
    assert report.extracted_dir is not None and report.extracted_dir.parent == own_folder.made().path
    assert own_folder.made().path.parent == scratch
    assert report.bundle.root == (report.extracted_dir / prefix).resolve()
    assert (report.bundle.root / "architecture.py").read_bytes() == (EXAMPLE / "architecture.py").read_bytes()
    plain = run_gates(EXAMPLE, check_params=False)
    assert report.bundle.sha256 == plain.bundle.sha256
    plain.cleanup()
    report.cleanup()
    assert sorted(p.name for p in own_folder.made().path.iterdir()) == [own_folder.LOCK_NAME]


def test_zip_with_unreadable_spec_leaves_nothing(tmp_path, scratch):
    z = make_zip(tmp_path / "b.zip", [*clean_members(), ("prism.yaml", "architecture: [1, 2]\n")])
    report = run_gates(z, check_params=False)
    assert report.bundle is None
    assert [(f.rule, f.file) for f in report.findings] == [("prism:spec", "prism.yaml")]
    owned = own_folder.made()  # the zip was extracted under the test's temp directory, and removed
    assert owned is not None and owned.path.parent == scratch
    assert sorted(p.name for p in owned.path.iterdir()) == [own_folder.LOCK_NAME]
