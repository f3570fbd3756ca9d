"""prism data prepare: partition, dedup, shards, MANIFEST, salt, integrity, errors."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures_data import (
    OTHER_SALT_HEX,
    SALT_HEX,
    expected_kept,
    expected_split,
    make_rows,
    read_split_rows,
    write_jsonl,
    write_parquet,
    write_salt,
)

from prism_challenge.data.manifest import DataError, load_manifest
from prism_challenge.data.partition import (
    default_salt_path,
    load_or_create_salt,
    parse_salt,
    split_of,
    write_salt_file,
)
from prism_challenge.data.prepare import build_partitioned_dir, prepare
from prism_challenge.data.sources import documents_source

ROWS = make_rows(400, seed=1, duplicates=12)


@pytest.fixture()
def src(tmp_path: Path) -> Path:
    return write_parquet(tmp_path / "in" / "docs.parquet", ROWS)


def _prepare(src, out, salt_hex=SALT_HEX, **kw):
    salt = write_salt(out.parent / f"{out.name}.key", salt_hex)
    return prepare(src, out, salt_file=salt, **kw)


def test_split_of_matches_definition():
    salt = bytes.fromhex(SALT_HEX)
    ids = [f"doc-{i}" for i in range(20000)]
    got = [split_of(salt, i) for i in ids]
    assert got == [expected_split(SALT_HEX, i) for i in ids]
    counts = {s: got.count(s) for s in ("train", "val", "test")}
    # 20000 draws: 19000 / 500 / 500 expected, binomial sd about 31 / 22 / 22
    assert 18850 < counts["train"] < 19150
    assert 400 < counts["val"] < 600 and 400 < counts["test"] < 600


def test_partition_covers_unique_documents_disjointly(src, tmp_path):
    res = _prepare(src, tmp_path / "d", shard_docs=50)
    m = res.manifest
    kept = expected_kept(ROWS)
    seen: dict[str, str] = {}
    for split in ("train", "val", "test"):
        rows = read_split_rows(m, split)
        assert m.documents(split) == len(rows)
        assert m.utf8_bytes(split) == sum(len(r["text"].encode()) for r in rows)
        for r in rows:
            assert r["id"] not in seen, "splits overlap"
            seen[r["id"]] = split
            assert split == expected_split(SALT_HEX, r["id"])
            assert r == {k: kept[r["id"]][k] for k in r}  # every column as in the source
    assert set(seen) == set(kept)
    assert m.data["duplicates_dropped"] == len(ROWS) - len(kept) == 12
    assert m.data["documents_read"] == len(ROWS)
    assert m.data["utf8_bytes_read"] == sum(len(r["text"].encode()) for r in ROWS)
    assert {s for s in seen.values()} == {"train", "val", "test"}


def test_order_within_split_is_source_order(src, tmp_path):
    m = _prepare(src, tmp_path / "d", shard_docs=37).manifest
    position = {r["id"]: i for i, r in enumerate(ROWS)}
    for split in ("train", "val", "test"):
        ids = [r["id"] for r in read_split_rows(m, split)]
        assert [position[i] for i in ids] == sorted(position[i] for i in ids)


def test_layout_and_manifest_fields(src, tmp_path):
    out = tmp_path / "d"
    res = _prepare(src, out, shard_docs=100)
    m = res.manifest
    d = json.loads((out / "MANIFEST.json").read_text())
    assert d["schema"] == "prism.data.v1"
    assert d["tool"]["name"] == "prism-challenge"
    assert d["salt_sha256"] == hashlib.sha256(bytes.fromhex(SALT_HEX)).hexdigest()
    assert d["source"]["kind"] == "files"
    assert d["source"]["files"] == [
        {"path": "docs.parquet", "documents_read": 400, "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
         "size": src.stat().st_size}
    ]
    assert d["columns"] == ["id", "text", "dump", "url", "file_path", "language", "language_score",
                            "token_count", "score", "int_score"]
    prefix = {"train": "train/", "val": "heldout/val/", "test": "heldout/test/"}
    for split, entry in d["splits"].items():
        assert entry["documents"] == sum(s["documents"] for s in entry["shards"])
        for i, s in enumerate(entry["shards"]):
            assert s["path"] == f"{prefix[split]}{i:05d}.parquet"
            assert s["sha256"] == hashlib.sha256((out / s["path"]).read_bytes()).hexdigest()
            meta = pq.ParquetFile(out / s["path"]).metadata
            assert meta.num_rows == s["documents"]
            assert meta.row_group(0).column(0).compression == "ZSTD"
            assert pq.read_schema(out / s["path"]).names[:2] == ["id", "text"]
    assert len(d["splits"]["train"]["shards"]) == -(-d["splits"]["train"]["documents"] // 100)
    assert m.sha256 == hashlib.sha256((out / "MANIFEST.json").read_bytes()).hexdigest()
    assert not (out / "train" / "salt").exists() and not list(out.rglob("*salt*")) and not list(out.rglob(".*"))


def test_same_inputs_and_salt_give_identical_bytes(src, tmp_path):
    a = _prepare(src, tmp_path / "a", shard_docs=64).manifest
    b = _prepare(src, tmp_path / "b", shard_docs=64).manifest
    assert (a.root / "MANIFEST.json").read_bytes() == (b.root / "MANIFEST.json").read_bytes()
    assert a.sha256 == b.sha256
    for split in ("train", "val", "test"):
        for pa_, pb in zip(a.shard_paths(split), b.shard_paths(split)):
            assert pa_.read_bytes() == pb.read_bytes()


def test_another_salt_gives_another_partition(src, tmp_path):
    a = _prepare(src, tmp_path / "a").manifest
    b = _prepare(src, tmp_path / "b", salt_hex=OTHER_SALT_HEX).manifest
    held_a = {r["id"] for s in ("val", "test") for r in read_split_rows(a, s)}
    held_b = {r["id"] for s in ("val", "test") for r in read_split_rows(b, s)}
    assert held_a != held_b
    assert held_b == {i for i in expected_kept(ROWS) if expected_split(OTHER_SALT_HEX, i) != "train"}
    assert a.data["salt_sha256"] != b.data["salt_sha256"]


def test_formats_give_the_same_shards(tmp_path):
    rows = ROWS[:150]
    pq_file = write_parquet(tmp_path / "in" / "a.parquet", rows)
    outs = {}
    for name in ("a.parquet", "a.jsonl", "a.jsonl.gz", "a.jsonl.zst"):
        path = pq_file if name.endswith("parquet") else write_jsonl(tmp_path / "in" / name, rows)
        outs[name] = _prepare(path, tmp_path / name.replace(".", "_")).manifest
    ref = outs["a.parquet"].data["splits"]
    for m in outs.values():
        assert m.data["splits"] == ref


def test_several_files_and_folders_in_order(tmp_path):
    a, b = ROWS[:100], ROWS[100:180]
    write_jsonl(tmp_path / "in" / "sub" / "2.jsonl.gz", b)
    write_parquet(tmp_path / "in" / "1.parquet", a)
    m = _prepare([tmp_path / "in"], tmp_path / "d").manifest
    assert [f["path"] for f in m.data["source"]["files"]] == ["1.parquet", "2.jsonl.gz"]
    assert [f["documents_read"] for f in m.data["source"]["files"]] == [100, 80]
    position = {r["id"]: i for i, r in enumerate(a + b)}
    ids = [r["id"] for r in read_split_rows(m, "train")]
    assert [position[i] for i in ids] == sorted(position[i] for i in ids)


def test_minimal_schema_and_dropped_columns(tmp_path):
    rows = [{"id": f"x{i}", "text": f"document number {i}", "extra": [i]} for i in range(60)]
    m = _prepare(write_jsonl(tmp_path / "x.jsonl", rows), tmp_path / "d").manifest
    assert m.data["columns"] == ["id", "text"]
    assert m.data["source"]["columns_dropped"] == ["extra"]
    assert pq.read_schema(m.shard_paths("train")[0]).names == ["id", "text"]


def test_max_docs(src, tmp_path):
    m = _prepare(src, tmp_path / "d", max_docs=123).manifest
    assert m.data["documents_read"] == 123
    kept = expected_kept(ROWS[:123])
    assert sum(m.documents(s) for s in ("train", "val", "test")) == len(kept)


def test_max_bytes_takes_whole_documents_up_to_the_budget(src, tmp_path):
    sizes = [len(r["text"].encode()) for r in ROWS]
    budget = sum(sizes[:57]) + sizes[57] // 2  # falls inside document 57
    m = _prepare(src, tmp_path / "d", max_bytes=budget).manifest
    assert m.data["documents_read"] == 57
    assert m.data["utf8_bytes_read"] == sum(sizes[:57])
    exact = _prepare(src, tmp_path / "e", max_bytes=sum(sizes[:90])).manifest
    assert exact.data["documents_read"] == 90
    short = _prepare(src, tmp_path / "f", max_bytes=sum(sizes[:90]) - 1).manifest
    assert short.data["documents_read"] == 89


def test_max_bytes_stops_once_met_even_before_empty_documents(tmp_path):
    rows = [{"id": "a", "text": "abc"}, {"id": "b", "text": ""}, {"id": "c", "text": "de"}, {"id": "d", "text": "f"}]
    m = _prepare(write_jsonl(tmp_path / "e.jsonl", rows), tmp_path / "d", max_bytes=3).manifest
    assert (m.data["documents_read"], m.data["utf8_bytes_read"]) == (1, 3)
    m = _prepare(write_jsonl(tmp_path / "e.jsonl", rows), tmp_path / "d2", max_bytes=4).manifest
    assert (m.data["documents_read"], m.data["utf8_bytes_read"]) == (2, 3)  # "de" would cross 4


def test_exact_duplicate_rows_are_kept_once(tmp_path):
    rows = [{"id": f"r{i:02d}", "text": f"row {i}"} for i in range(40)]
    rows += [dict(rows[3]), dict(rows[7]), {"id": "a-first", "text": "row 12"}]
    m = _prepare(write_jsonl(tmp_path / "e.jsonl", rows), tmp_path / "d").manifest
    got = [r["id"] for s in ("train", "val", "test") for r in read_split_rows(m, s)]
    assert len(got) == 40
    assert set(got) == ({f"r{i:02d}" for i in range(40)} - {"r12"}) | {"a-first"}
    assert m.data["duplicates_dropped"] == 3


def test_salt_file_created_secret_and_outside(src, tmp_path):
    out = tmp_path / "d"
    res = prepare(src, out)
    assert res.salt_created and res.salt_file == default_salt_path(out) == tmp_path / "d.salt"
    assert stat.S_IMODE(os.stat(res.salt_file).st_mode) == 0o600
    salt = parse_salt(res.salt_file.read_text())
    assert res.manifest.data["salt_sha256"] == hashlib.sha256(salt).hexdigest()
    res.manifest.check_salt(salt)
    with pytest.raises(DataError, match="does not match"):
        res.manifest.check_salt(bytes(32))
    for r in read_split_rows(res.manifest, "val"):
        assert split_of(salt, r["id"]) == "val"
    # reused on a second prepare: same partition
    res2 = prepare(src, tmp_path / "d2", salt_file=res.salt_file)
    assert not res2.salt_created
    assert res2.manifest.data["splits"] == res.manifest.data["splits"]


def test_salt_file_inside_output_refused(src, tmp_path):
    with pytest.raises(DataError, match="must not be inside"):
        prepare(src, tmp_path / "d", salt_file=tmp_path / "d" / "train" / "salt")
    assert not (tmp_path / "d").exists()


def test_salt_helpers(tmp_path):
    p = tmp_path / "s"
    salt, created = load_or_create_salt(p)
    assert created and len(salt) == 32 and p.read_text() == salt.hex() + "\n"
    assert load_or_create_salt(p) == (salt, False)
    with pytest.raises(DataError, match="already exists"):
        write_salt_file(p, salt)
    (tmp_path / "bad").write_text("xyz\n")
    with pytest.raises(DataError, match="64 hex digits"):
        load_or_create_salt(tmp_path / "bad")


def test_existing_output_needs_force(src, tmp_path):
    out = tmp_path / "d"
    first = _prepare(src, out, max_docs=50).manifest
    with pytest.raises(DataError, match="already exists"):
        _prepare(src, out)
    second = _prepare(src, out, force=True).manifest
    assert second.data["documents_read"] == 400 != first.data["documents_read"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "d.key", "in"]


def test_interrupted_prepare_leaves_nothing(tmp_path):
    def batches():
        yield from documents_source([(f"i{k}", f"text {k}") for k in range(100)], {"kind": "t"}).batches()
        raise KeyboardInterrupt

    src = documents_source([], {"kind": "t"})
    src.batches = batches
    with pytest.raises(KeyboardInterrupt):
        build_partitioned_dir(src, tmp_path / "d", salt=bytes(32))
    assert list(tmp_path.iterdir()) == []


def test_no_train_documents_is_an_error(tmp_path):
    src = documents_source([], {"kind": "t"})
    with pytest.raises(DataError, match="no documents"):
        build_partitioned_dir(src, tmp_path / "d", salt=bytes(32))
    assert list(tmp_path.iterdir()) == []


def test_flipped_byte_in_any_shard_is_named(src, tmp_path):
    m = _prepare(src, tmp_path / "d", shard_docs=60).manifest
    shards = [(split, s) for split in ("train", "val", "test") for s in m.data["splits"][split]["shards"]]
    assert len(shards) >= 8
    for split, s in shards:
        path = m.root / s["path"]
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(DataError) as err:
            m.verify(split)
        assert str(path) in str(err.value) and "does not match" in str(err.value)
        with pytest.raises(DataError, match=s["path"]):
            m.verify_all()
        path.write_bytes(original)
    m.verify_all()
    victim = m.root / shards[-1][1]["path"]
    victim.unlink()
    with pytest.raises(DataError, match=f"{victim}: shard listed in MANIFEST.json is missing"):
        m.verify_all()


def test_manifest_validation(tmp_path):
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"schema": "prism.data.v1", "splits": {
        "train": {"shards": [{"path": "../x.parquet", "sha256": "0"}]}}}))
    with pytest.raises(DataError, match="must stay inside"):
        load_manifest(tmp_path)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"id": "a", "text": "ok"}\n{"id": "b", "text": \n', "bad.jsonl:2: invalid JSON"),
        ("bad.jsonl", '{"id": "a", "text": "ok"}\n\n{"id": "b"}\n', "bad.jsonl:3: missing field 'text'"),
        ("bad.jsonl", '{"text": "no id"}\n', "bad.jsonl:1: missing field 'id'"),
        ("bad.jsonl", '{"id": 5, "text": "x"}\n', "bad.jsonl:1: field 'id' must be a string"),
        ("bad.jsonl", '[1, 2]\n', "bad.jsonl:1: expected a JSON object"),
        ("bad.jsonl", '{"id": "a", "text": "x", "score": "high"}\n', "bad.jsonl:1: field 'score' must be a number"),
        ("bad.jsonl", '{"id": "a", "text": "x", "int_score": 2.5}\n', "bad.jsonl:1: field 'int_score' must be an integer"),
        ("bad.txt", "hello\n", "unsupported source file"),
    ],
)
def test_bad_sources_name_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _prepare(path, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_bad_utf8_and_bad_compression_named(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "\xff"}\n')
    with pytest.raises(DataError, match="u.jsonl:2: not valid UTF-8"):
        _prepare(p, tmp_path / "d")
    g = tmp_path / "g.jsonl.gz"
    g.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="g.jsonl.gz.*cannot read"):
        _prepare(g, tmp_path / "d")
    z = tmp_path / "z.parquet"
    z.write_bytes(b"PAR1 nope")
    with pytest.raises(DataError, match="z.parquet: not a readable parquet file"):
        _prepare(z, tmp_path / "d")


def test_parquet_without_id_or_with_null_text(tmp_path):
    import pyarrow as pa

    p = tmp_path / "noid.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), p)
    with pytest.raises(DataError, match="noid.parquet: no 'id' column"):
        _prepare(p, tmp_path / "d")
    q = tmp_path / "null.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["x", None, "z"]}), q)
    with pytest.raises(DataError, match="null.parquet: row 2: 'text' is null"):
        _prepare(q, tmp_path / "d")


def test_missing_source_and_duplicate_names(tmp_path):
    with pytest.raises(DataError, match="no such source"):
        _prepare(tmp_path / "nope.jsonl", tmp_path / "d")
    a = write_jsonl(tmp_path / "x" / "f.jsonl", ROWS[:5])
    b = write_jsonl(tmp_path / "y" / "f.jsonl", ROWS[5:10])
    with pytest.raises(DataError, match="same file name"):
        _prepare([a, b], tmp_path / "d")
