"""prism data prepare / info / cache from the command line, and the builtin corpus."""

from __future__ import annotations

import argparse
import hashlib
import json

import pytest
from fixtures_data import SALT_HEX, expected_split, make_hub_tree, make_rows, write_jsonl, write_salt

from prism_challenge.data.builtin import BUILTIN_SALT, ensure_builtin
from prism_challenge.data.cli import add_data_parser, main
from prism_challenge.data.manifest import load_manifest
from prism_challenge.data.partition import split_of


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_add_data_parser_registers_subcommands(tmp_path):
    parser = argparse.ArgumentParser(prog="prism")
    sub = parser.add_subparsers(dest="command")
    add_data_parser(sub)
    args = parser.parse_args(["data", "prepare", "--source", "a.jsonl", "b.parquet", "--out", str(tmp_path), "--max-bytes", "5M"])
    assert args.source == ["a.jsonl", "b.parquet"] and args.max_bytes == 5_000_000 and callable(args.func)
    args = parser.parse_args(["data", "info", str(tmp_path)])
    assert args.func.__name__ == "cmd_info"
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "prepare", "--source", "x", "--out", "y", "--max-docs", "1", "--max-bytes", "2"])


def test_prepare_info_cache_roundtrip(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))
    rows = make_rows(300, seed=5, duplicates=4)
    src = write_jsonl(tmp_path / "in.jsonl.gz", rows)
    out = tmp_path / "d"
    code, stdout, err = run(["data", "prepare", "--source", str(src), "--out", str(out), "--no-progress",
                             "--license", "ODC-By-1.0"], capsys)
    assert code == 0, err
    m = load_manifest(out)
    assert f"MANIFEST sha256 {m.sha256}" in stdout and "salt created" in stdout
    salt = bytes.fromhex((tmp_path / "d.salt").read_text().strip())
    assert m.data["salt_sha256"] == hashlib.sha256(salt).hexdigest() and m.data["license"] == "ODC-By-1.0"
    assert m.data["duplicates_dropped"] == 4

    code, stdout, err = run(["data", "info", str(out), "--shards", "--salt-file", str(tmp_path / "d.salt")], capsys)
    assert code == 0, err
    assert m.sha256[:40] in stdout.replace("\n", "").replace(" ", "").replace("│", "")
    for split in ("train", "val", "test"):
        assert f"{m.documents(split):,}" in stdout
    assert "matches salt_sha256" in stdout and "FAILED" not in stdout

    shard = m.shard_paths("val")[0]
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    code, stdout, err = run(["data", "info", str(out)], capsys)
    assert code == 1 and "FAILED" in stdout
    assert err.strip() == f"prism data info: error: {shard}: sha256 {hashlib.sha256(raw).hexdigest()} does not match MANIFEST.json ({m.data['splits']['val']['shards'][0]['sha256']})"

    code, stdout, err = run(["data", "cache", str(out), "--tokenizer", "bytes", "--no-progress"], capsys)
    assert code == 0, err
    assert f"{m.utf8_bytes('train'):,} bytes (verified)" in stdout


def test_prepare_fineweb_from_mirror_cli(tmp_path, capsys):
    mirror = make_hub_tree(tmp_path / "hub", [make_rows(40, seed=7), make_rows(40, seed=8)])
    salt = write_salt(tmp_path / "s.salt", SALT_HEX)
    code, _, err = run(["data", "prepare", "--source", "fineweb-edu", "--hub-mirror", str(mirror), "--out",
                        str(tmp_path / "d"), "--max-docs", "50", "--salt-file", str(salt), "--no-progress"], capsys)
    assert code == 0, err
    m = load_manifest(tmp_path / "d")
    assert m.data["documents_read"] == 50 and m.data["subset"] == "sample-10BT"
    ids = [r["id"] for r in make_rows(40, seed=7) + make_rows(40, seed=8)][:50]
    assert m.documents("val") == sum(expected_split(SALT_HEX, i) == "val" for i in ids)
    code, _, err = run(["data", "prepare", "--source", "fineweb-edu", "--hub-mirror", str(mirror), "--out",
                        str(tmp_path / "e"), "--revision", "main", "--no-progress"], capsys)
    assert code == 1 and "moving name" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ('{"id": "a", "text": "x"}\n{oops}\n', "bad.jsonl:2: invalid JSON"),
        ('{"id": "a"}\n', "bad.jsonl:1: missing field 'text'"),
        ('{"text": "a"}\n', "bad.jsonl:1: missing field 'id'"),
    ],
)
def test_prepare_errors_are_one_line(tmp_path, capsys, lines, expected):
    (tmp_path / "bad.jsonl").write_text(lines)
    code, _, err = run(["data", "prepare", "--source", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "d"),
                        "--no-progress"], capsys)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("prism data prepare: error: ") and expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no directory, no stray salt


def test_info_on_missing_dir(tmp_path, capsys):
    code, _, err = run(["data", "info", str(tmp_path / "nope")], capsys)
    assert code == 1 and "MANIFEST not found" in err


def test_builtin_corpus_is_partitioned_with_the_public_salt(tmp_path):
    root = ensure_builtin(tmp_path)
    m = load_manifest(root)
    assert m.data["salt_sha256"] == hashlib.sha256(BUILTIN_SALT).hexdigest() and m.data["salt_public"] is True
    assert root.parent == tmp_path / "data" and not list((tmp_path / "data").glob(".*"))
    import pyarrow.parquet as pq

    for split in ("train", "val", "test"):
        ids = [i for p in m.shard_paths(split) for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]
        assert ids and all(split_of(BUILTIN_SALT, i) == split for i in ids)
        assert len(ids) == m.documents(split)
    assert m.data["documents_read"] == sum(m.documents(s) for s in ("train", "val", "test")) + m.data["duplicates_dropped"]
    # cached: the second call does not rebuild; a corrupt shard is rebuilt
    before = (root / "MANIFEST.json").stat().st_mtime_ns
    assert ensure_builtin(tmp_path) == root and (root / "MANIFEST.json").stat().st_mtime_ns == before
    shard = m.shard_paths("test")[0]
    shard.write_bytes(b"corrupt")
    assert ensure_builtin(tmp_path) == root
    load_manifest(root).verify_all()
    assert json.loads((root / "MANIFEST.json").read_text())["splits"] == m.data["splits"]
