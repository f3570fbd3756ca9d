"""The token cache and the train / held-out streams."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixtures_data import SALT_HEX, make_rows, read_split_rows, write_parquet, write_salt

from prism_challenge.data.cache import (
    TokenCacheError,
    build_token_cache,
    ensure_token_cache,
    open_token_cache,
    token_cache_dir,
)
from prism_challenge.data.manifest import DataError
from prism_challenge.data.prepare import prepare
from prism_challenge.data.stream import heldout_stream, iter_token_chunks, train_stream
from prism_challenge.tokenizers import reference_tokenizer

ROWS = make_rows(700, seed=3, words=(1, 300))
for _k in range(0, 700, 50):  # special-token text is plain text to both paths
    ROWS[_k]["text"] += " <|endoftext|> and <|fim_prefix|> stay text"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("cache")
    src = write_parquet(base / "in.parquet", ROWS)
    return prepare(src, base / "d", salt_file=write_salt(base / "salt", SALT_HEX), shard_docs=90).manifest


def _cat(chunks):
    chunks = list(chunks)
    return np.concatenate([c.ids for c in chunks]), np.concatenate([c.nbytes for c in chunks])


def _expected_stream(tok, texts):
    """The stream by the definition: EOT, then each document's tokens and an EOT."""
    table = tok.token_bytes_table()
    ids = [tok.eot_token]
    for t in texts:
        ids += tok.encode(t) + [tok.eot_token]
    return np.array(ids), np.array([len(table[i]) for i in ids])


@pytest.mark.parametrize("name", ["gpt2", "bytes"])
def test_cached_stream_equals_direct_stream(data, tmp_path, name):
    tok = reference_tokenizer(name)
    ids, nb = _cat(train_stream(data, tok, cache_root=tmp_path, chunk_tokens=1000, progress=False))
    d_ids, d_nb = _cat(iter_token_chunks(data, tok))
    # the cache hands out its compact dtypes (the feeder widens the rows it cuts)
    assert ids.dtype == np.uint16 and nb.dtype == np.uint8
    assert np.array_equal(ids, d_ids) and np.array_equal(nb, d_nb)
    texts = [r["text"] for r in read_split_rows(data, "train")]
    assert sum("<|endoftext|>" in t for t in texts) >= 10
    e_ids, e_nb = _expected_stream(tok, texts)
    assert np.array_equal(ids, e_ids) and np.array_equal(nb, e_nb)
    assert int((ids == tok.eot_token).sum()) == len(texts) + 1
    assert int(nb.sum()) == data.utf8_bytes("train") == sum(len(t.encode()) for t in texts)


def test_cache_layout(data, tmp_path):
    tok = reference_tokenizer("gpt2")
    cache = ensure_token_cache(data, tok, cache_root=tmp_path)
    assert cache.path == tmp_path / "tokens" / f"{data.sha256}-gpt2-{tok.sha256[:12]}"
    assert cache.path == token_cache_dir(data, tok, tmp_path)
    ids = np.load(cache.path / "ids.npy", mmap_mode="r")
    nbytes = np.load(cache.path / "nbytes.npy", mmap_mode="r")
    offsets = np.load(cache.path / "offsets.npy")
    assert ids.dtype == np.uint16 and nbytes.dtype == np.uint8 and offsets.dtype == np.int64
    texts = [r["text"] for r in read_split_rows(data, "train")]
    assert offsets.shape == (len(texts) + 1,) and offsets[0] == 1 and offsets[-1] == ids.shape[0]
    assert ids[0] == tok.eot_token
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        assert ids[offsets[i] : offsets[i + 1] - 1].tolist() == tok.encode(texts[i])
        assert ids[offsets[i + 1] - 1] == tok.eot_token
        assert cache.document(i).tolist() == tok.encode(texts[i])
    meta = json.loads((cache.path / "meta.json").read_text())
    assert meta["manifest_sha256"] == data.sha256 and meta["tokenizer"]["sha256"] == tok.sha256
    assert meta["tokens"] == ids.shape[0] == cache.n_tokens
    assert meta["utf8_bytes"] == int(nbytes.sum(dtype=np.int64)) == data.utf8_bytes("train")


def test_cache_is_built_once(data, tmp_path):
    tok = reference_tokenizer("bytes")
    first = ensure_token_cache(data, tok, cache_root=tmp_path)
    stamp = (first.path / "ids.npy").stat().st_ino, (first.path / "ids.npy").stat().st_mtime_ns
    again = ensure_token_cache(data, tok, cache_root=tmp_path)
    assert ((again.path / "ids.npy").stat().st_ino, (again.path / "ids.npy").stat().st_mtime_ns) == stamp
    assert [p.name for p in (tmp_path / "tokens").iterdir()] == [first.path.name]  # no temporary leftovers


def test_workers_do_not_change_the_cache(data, tmp_path):
    tok = reference_tokenizer("gpt2")
    one = build_token_cache(data, tok, tmp_path / "one", workers=1)
    three = build_token_cache(data, tok, tmp_path / "three", workers=3)
    assert one.meta["arrays"] == three.meta["arrays"]
    assert np.array_equal(one.ids, three.ids)


def test_corrupt_cache_is_named_and_rebuilt(data, tmp_path):
    tok = reference_tokenizer("gpt2")
    cache = ensure_token_cache(data, tok, cache_root=tmp_path)
    good = np.array(cache.ids)
    path = cache.path / "ids.npy"
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(TokenCacheError, match=f"{path}: sha256 .* does not match meta.json"):
        open_token_cache(cache.path)
    rebuilt = ensure_token_cache(data, tok, cache_root=tmp_path)
    assert np.array_equal(rebuilt.ids, good)
    (rebuilt.path / "nbytes.npy").unlink()
    with pytest.raises(TokenCacheError, match="nbytes.npy"):
        open_token_cache(rebuilt.path)
    assert np.array_equal(ensure_token_cache(data, tok, cache_root=tmp_path).ids, good)


def test_stale_cache_is_rebuilt(data, tmp_path):
    tok = reference_tokenizer("bytes")
    cache = ensure_token_cache(data, tok, cache_root=tmp_path)
    meta_path = cache.path / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format"] = 0
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(TokenCacheError, match="stale"):
        open_token_cache(cache.path, expect={"format": 1})
    again = ensure_token_cache(data, tok, cache_root=tmp_path)
    assert again.meta["format"] == 1
    assert np.array_equal(again.ids, cache.ids)


def test_build_verifies_shards(data, tmp_path):
    shard = data.shard_paths("train")[1]
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(DataError, match=str(shard)):
            train_stream(data, reference_tokenizer("bytes"), cache_root=tmp_path, progress=False)
        assert not (tmp_path / "tokens").exists() or not any((tmp_path / "tokens").iterdir())
    finally:
        shard.write_bytes(original)


def test_chunk_sizes_do_not_change_the_stream(data, tmp_path):
    tok = reference_tokenizer("gpt2")
    ref = _cat(train_stream(data, tok, cache_root=tmp_path, progress=False))
    for size in (1, 777, 10**9):
        chunks = list(train_stream(data, tok, cache_root=tmp_path, chunk_tokens=size, progress=False))
        assert all(len(c.ids) <= size for c in chunks)
        got = _cat(chunks)
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])


def test_progress_callback_reaches_totals(data, tmp_path):
    calls = []
    train_stream(data, reference_tokenizer("bytes"), cache_root=tmp_path, progress=lambda d, b: calls.append((d, b)))
    assert calls[-1] == (data.documents("train"), data.utf8_bytes("train"))
    assert calls == sorted(calls)


@pytest.mark.parametrize("name", ["gpt2", "bytes"])
def test_heldout_stream_budget(data, name):
    tok = reference_tokenizer(name)
    texts = [r["text"] for r in read_split_rows(data, "val")]
    sizes = [len(t.encode()) for t in texts]
    assert len(texts) >= 10
    whole = _cat(heldout_stream(data, tok, "val"))
    assert all(np.array_equal(a, b) for a, b in zip(whole, _expected_stream(tok, texts)))
    assert all(np.array_equal(a, b) for a, b in zip(whole, _cat(iter_token_chunks(data, tok, "val"))))
    for k, extra in ((5, 0), (5, 1), (6, -1), (len(texts), 10**6)):
        budget = sum(sizes[:k]) + extra
        taken = k if extra >= 0 else k - 1
        ids, nb = _cat(heldout_stream(data, tok, "val", max_bytes=budget, docs_per_chunk=3))
        e_ids, e_nb = _expected_stream(tok, texts[:taken])
        assert np.array_equal(ids, e_ids) and np.array_equal(nb, e_nb)
        assert int(nb.sum()) == sum(sizes[:taken]) <= budget
    ids, nb = _cat(heldout_stream(data, tok, "test", max_bytes=0))
    assert ids.tolist() == [tok.eot_token] and nb.tolist() == [0]
    ids, _ = _cat(heldout_stream(data, tok, "test", max_bytes=1))
    assert ids.tolist() == [tok.eot_token]


def test_heldout_stream_verifies_only_what_it_reads(data):
    tok = reference_tokenizer("bytes")
    shards = data.shard_paths("train")
    assert len(shards) >= 3
    first_bytes = data.shards("train")[0]["utf8_bytes"]
    victim = shards[-1]
    original = victim.read_bytes()
    try:
        victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        _cat(heldout_stream(data, tok, "train", max_bytes=first_bytes // 2))  # never reads the last shard
        with pytest.raises(DataError, match=str(victim)):
            heldout_stream(data, tok, "train")
    finally:
        victim.write_bytes(original)
    with pytest.raises(DataError, match="no split 'dev'"):
        heldout_stream(data, tok, "dev")


def test_cache_of_unpartitioned_builtin_style_dir(tmp_path):
    from prism_challenge.data.builtin import build_data_dir
    from prism_challenge.data.manifest import load_manifest

    docs = [(f"d{i}", f"text number {i} — ünïcödé {'x' * i}") for i in range(50)] + [("z", "text number 3 — ünïcödé xxx")]
    build_data_dir(tmp_path / "d", docs, {"kind": "test", "license": "CC0-1.0"})
    m = load_manifest(tmp_path / "d")
    assert list(m.data["splits"]) == ["train"] and m.data["salt_sha256"] is None and m.data["license"] == "CC0-1.0"
    assert m.documents("train") == 50 and m.data["duplicates_dropped"] == 1
    tok = reference_tokenizer("gpt2")
    got = _cat(train_stream(m, tok, cache_root=tmp_path / "c", progress=False))
    exp = _expected_stream(tok, [t for _, t in docs[:50]])
    assert np.array_equal(got[0], exp[0]) and np.array_equal(got[1], exp[1])


def test_heldout_budget_stops_once_met_even_before_empty_documents(tmp_path):
    from prism_challenge.data.builtin import build_data_dir
    from prism_challenge.data.manifest import load_manifest

    build_data_dir(tmp_path / "d", [("a", "abc"), ("b", ""), ("c", "de")], {"kind": "test"})
    m = load_manifest(tmp_path / "d")
    tok = reference_tokenizer("bytes")
    ids, nb = _cat(heldout_stream(m, tok, "train", max_bytes=3))
    assert ids.tolist() == [256, 97, 98, 99, 256] and nb.tolist() == [0, 1, 1, 1, 0]
    ids, _ = _cat(heldout_stream(m, tok, "train", max_bytes=4))
    assert ids.tolist() == [256, 97, 98, 99, 256, 256]  # the empty document fits; "de" would cross 4
