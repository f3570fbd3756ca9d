"""bundle.py: prism.yaml, entrypoints, intake rules with stable rule ids."""

from __future__ import annotations

import os
import stat
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest

from prism_challenge import scratch as own_folder
from prism_challenge.intake.bundle import BundleError, load_bundle, open_bundle
from prism_challenge.intake.bundlefiles import ALLOWED_SUFFIXES
from prism_challenge.intake.readable import private_path, readable_copy
from prism_challenge.intake.refusal import IntakeLimits
from prism_challenge.intake.spec import read_spec
from prism_challenge.intake.tree import check_tree
from prism_challenge.intake.ziparchive import extract_zip
from prism_challenge.intake.frozen import remove_tree

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-1m"


def spec(tmp_path: Path, text: str):
    (tmp_path / "prism.yaml").write_text(text)
    return read_spec(tmp_path)


def test_defaults_and_declared_names(tmp_path):
    arch, train, tok = read_spec(tmp_path)
    assert (arch.file, arch.symbol, train.file, train.symbol, tok) == (
        "architecture.py", "build_model", "training.py", "train", "gpt2",
    )  # fmt: skip
    arch, train, tok = spec(
        tmp_path,
        "architecture:\n  entrypoint: pkg/net.py:make\ntraining:\n  entrypoint: {file: loop.py, symbol: go}\ntokenizer: bytes\n",
    )
    assert (arch.file, arch.symbol, arch.module) == ("pkg/net.py", "make", "pkg.net")
    assert (train.file, train.symbol, tok) == ("loop.py", "go", "bytes")


@pytest.mark.parametrize(
    "text,needle",
    [
        ("architecture: [1\n", "not valid YAML"),
        ("- a\n", "top level must be a mapping"),
        ("weights: x.bin\n", "unknown field"),
        ("architecture:\n  entrypoint: training.py:train\n", "distinct files"),
        ("architecture:\n  entrypoint: /etc/x.py:f\n", "inside the bundle"),
        ("architecture:\n  entrypoint: ../x.py:f\n", "inside the bundle"),
        ("architecture:\n  entrypoint: my-net.py:f\n", "not an importable module path"),
        ("architecture:\n  entrypoint: net.py:not-a-name\n", "not an identifier"),
        ("tokenizer: 3\n", "'tokenizer' must be a string"),
    ],
)
def test_spec_errors_name_the_field_and_rule(tmp_path, text, needle):
    with pytest.raises(BundleError) as err:
        spec(tmp_path, text)
    assert err.value.rule == "prism:spec"
    assert needle in str(err.value) and "prism.yaml" in str(err.value)


def test_load_bundle_rules(tmp_path):
    with pytest.raises(BundleError) as err:
        load_bundle(tmp_path / "nope")
    assert err.value.rule == "prism:bundle-unreadable"
    (tmp_path / "architecture.py").write_text("x = 1\n")
    with pytest.raises(BundleError) as err:
        load_bundle(tmp_path)
    assert err.value.rule == "prism:missing-entrypoint" and "training.py" in str(err.value)
    b = load_bundle(EXAMPLE)
    assert sorted(b.file_hashes) == sorted(p.name for p in EXAMPLE.iterdir() if p.is_file())


def test_bundle_error_default_rule():
    assert BundleError("x").rule == "prism:bundle"
    assert isinstance(BundleError("x", "prism:spec"), ValueError)


def test_open_bundle_directory_and_zip(tmp_path):
    root, extracted = open_bundle(EXAMPLE)
    assert (root, extracted) == (EXAMPLE.resolve(), None)
    z = tmp_path / "b.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for p in EXAMPLE.iterdir():
            zf.write(p, p.name)
    out = tmp_path / "out"
    out.mkdir()
    root, extracted = extract_zip(z, out)
    assert root == out.resolve() and extracted == out
    assert (root / "training.py").read_bytes() == (EXAMPLE / "training.py").read_bytes()
    with pytest.raises(BundleError) as err:
        extract_zip(z, out)  # members already exist: never overwritten
    assert err.value.rule == "prism:bundle-unreadable"


def test_check_tree_returns_total_size_and_honours_limits(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("hello\n")
    assert check_tree(tmp_path) == 6 + 6
    with pytest.raises(BundleError) as err:
        check_tree(tmp_path, IntakeLimits(max_source_bytes=10))
    assert err.value.rule == "prism:source-too-large"
    with pytest.raises(BundleError) as err:
        check_tree(tmp_path, IntakeLimits(max_files=1))
    assert err.value.rule == "prism:too-many-files"
    assert ALLOWED_SUFFIXES == {".py", ".md", ".txt"}


@pytest.mark.parametrize(
    "text,expected,line",
    [
        (
            "tokenizer: [unclosed\n",
            "prism.yaml line 2: not valid YAML: expected ',' or ']', but got '<stream end>' "
            "(while parsing a flow sequence from line 1)",
            2,
        ),
        ("a: b\n\tc: d\n", "prism.yaml line 2: not valid YAML: found character '\\t' that cannot start any token", 2),
        ("a: b: c\n", "prism.yaml line 1: not valid YAML: mapping values are not allowed here", 1),
    ],
)
def test_malformed_yaml_is_one_line_naming_the_line(tmp_path, text, expected, line):
    with pytest.raises(BundleError) as err:
        spec(tmp_path, text)
    assert str(err.value) == expected and "\n" not in str(err.value)
    assert (err.value.rule, err.value.line) == ("prism:spec", line)


def test_a_file_that_is_not_a_zip_is_refused_saying_what_a_bundle_is(tmp_path):
    py = EXAMPLE / "training.py"
    with pytest.raises(BundleError) as err:
        open_bundle(py)
    assert err.value.rule == "prism:bundle-unreadable"
    assert str(err.value) == (
        f"{py}: not a bundle: a bundle is a directory or a .zip holding architecture.py and training.py"
    )
    bad = tmp_path / "b.zip"  # named .zip but not one: still the zip rule
    bad.write_bytes(b"not an archive")
    with pytest.raises(BundleError) as err:
        open_bundle(bad)
    assert err.value.rule == "prism:bad-zip" and "not a valid zip archive" in str(err.value)


def test_a_device_or_a_missing_path_is_named_for_what_it_is(tmp_path):
    with pytest.raises(BundleError) as err:
        open_bundle("/dev/null")
    assert str(err.value) == ("/dev/null: not a bundle (not a regular file or a directory): a bundle is a "
                              "directory or a .zip holding architecture.py and training.py")
    with pytest.raises(BundleError) as err:
        open_bundle(tmp_path / "nope")
    assert str(err.value) == f"{tmp_path / 'nope'}: no such bundle directory or .zip file"


def _private_bundle(root: Path) -> Path:
    root.mkdir()
    for p in EXAMPLE.iterdir():
        (root / p.name).write_bytes(p.read_bytes())
        (root / p.name).chmod(0o600)
    (root / "sub").mkdir()
    (root / "sub" / "notes.txt").write_text("hi\n")
    root.chmod(0o700)
    return root


def test_a_private_directory_bundle_is_evaluated_from_a_readable_copy(tmp_path, monkeypatch):
    src = _private_bundle(tmp_path / "mine")
    assert private_path(src) == "."
    src.chmod(0o755)
    assert private_path(src) == "README.md"  # the first file (sorted) others cannot read
    src.chmod(0o700)
    assert open_bundle(src) == (src.resolve(), None)  # in place unless asked
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    root, copied = open_bundle(src, readable_by_others=True)
    assert copied is not None and root == copied / "mine" and private_path(root) is None
    modes = {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}
    assert modes == {".": 0o755, "sub": 0o755, "sub/notes.txt": 0o644,
                     **{p.name: 0o644 for p in EXAMPLE.iterdir()}}
    assert stat.S_IMODE(copied.stat().st_mode) == 0o755
    assert load_bundle(root).sha256 == load_bundle(src).sha256
    remove_tree(copied)  # the caller's to remove (the pipeline's ExitStack does)
    # a world-readable bundle is used in place
    for p in src.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    src.chmod(0o755)
    assert open_bundle(src, readable_by_others=True) == (src.resolve(), None)


def test_readable_copy_holds_the_intake_limits_and_leaves_nothing(tmp_path, monkeypatch):
    src = _private_bundle(tmp_path / "mine")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(own_folder, "_own", None)  # this process's owner folder made afresh under it
    (tmp_path / "tmp").mkdir()
    with pytest.raises(BundleError) as err:
        readable_copy(src, IntakeLimits(max_source_bytes=100))
    assert err.value.rule == "prism:source-too-large"
    assert str(err.value) == "README.md: bundle files exceed 100 bytes in total"
    with pytest.raises(BundleError) as err:
        readable_copy(src, IntakeLimits(max_files=2))
    assert err.value.rule == "prism:too-many-files"
    os.symlink("/etc/passwd", src / "sub" / "link.txt")  # planted after intake: never followed
    with pytest.raises(BundleError) as err:
        readable_copy(src)
    assert (err.value.rule, str(err.value)) == ("prism:symlink", "sub/link.txt: symlinks are not allowed in a bundle")
    owned = own_folder.made()  # the copies were made in it, and removed
    assert owned is not None and owned.path.parent == tmp_path / "tmp"
    assert sorted(p.name for p in owned.path.iterdir()) == [own_folder.LOCK_NAME]
    owned.close()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_readable_copy_cannot_be_redirected_by_a_directory_swapped_for_a_symlink(tmp_path, monkeypatch):
    # the owner swaps sub/ for a symlink to a root-only folder while root copies sub/: files are
    # opened relative to the directory already open, so the copy holds the bundle's own bytes
    import prism_challenge.intake.readable as bundle_mod

    src = _private_bundle(tmp_path / "mine")
    (src / "sub" / "zz.txt").write_text("mine\n")
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    (secret / "zz.txt").write_text("SECRET\n")
    real = bundle_mod._read_regular

    def swap_then_read(path, rel, most, dir_fd=None):
        if rel == "sub/notes.txt" and dir_fd is not None:  # sub/ is being copied (not checked): swap it
            (src / "sub").rename(src / "moved")
            os.symlink(secret, src / "sub")
        return real(path, rel, most, **({} if dir_fd is None else {"dir_fd": dir_fd}))

    monkeypatch.setattr(bundle_mod, "_read_regular", swap_then_read)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    root, copied = readable_copy(src)
    try:
        assert (root / "sub" / "zz.txt").read_text() == "mine\n"
        assert "SECRET" not in "".join(p.read_text() for p in root.rglob("*.txt"))
    finally:
        shutil.rmtree(copied)
