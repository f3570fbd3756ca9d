"""bundle.py: prism.yaml, entrypoints, intake rules with stable rule ids."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from prism_challenge.bundle import (
    ALLOWED_SUFFIXES,
    BundleError,
    IntakeLimits,
    check_tree,
    extract_zip,
    load_bundle,
    open_bundle,
    read_spec,
)

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
    assert ALLOWED_SUFFIXES == {".py", ".yaml", ".yml", ".json", ".md", ".txt"}
