"""Integration on the real FineWeb samples in ../shared/data (skipped when the folder is absent)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixtures_data import REPO_ROOT, SHARED_DATA

from prism_challenge.data.manifest import load_manifest
from prism_challenge.data.partition import split_of
from prism_challenge.data.prepare import prepare
from prism_challenge.data.stream import iter_token_chunks, train_stream
from prism_challenge.tokenizers import reference_tokenizer

pytestmark = [
    pytest.mark.shared_data,
    pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"{SHARED_DATA} is absent (a fresh clone has no ../shared)"),
]


def _source_docs():
    docs = []
    for path in sorted(SHARED_DATA.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            docs.extend(json.loads(line) for line in f if line.strip())
    return docs


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("shared")
    res = prepare([SHARED_DATA], base / "data", salt_file=base / "salt")
    return res


def test_manifest_counts_match_the_source_files(shared_dir):
    m = shared_dir.manifest
    docs = _source_docs()
    salt = bytes.fromhex(shared_dir.salt_file.read_text().strip())
    assert m.data["documents_read"] == len(docs) == 1661
    assert m.data["utf8_bytes_read"] == sum(len(d["text"].encode()) for d in docs) == 5_645_890
    unique: dict[str, dict] = {}
    for d in docs:
        if d["text"] not in unique or d["id"] < unique[d["text"]]["id"]:
            unique[d["text"]] = d
    assert m.data["duplicates_dropped"] == len(docs) - len(unique)
    for split in ("train", "val", "test"):
        members = [d for d in unique.values() if split_of(salt, d["id"]) == split]
        assert m.documents(split) == len(members)
        assert m.utf8_bytes(split) == sum(len(d["text"].encode()) for d in members)
    assert [f["documents_read"] for f in m.data["source"]["files"]] == [1000, 150, 511]
    m.verify_all()


def test_cached_stream_equals_direct_stream_on_shared_data(shared_dir, tmp_path):
    m = shared_dir.manifest
    tok = reference_tokenizer("gpt2")
    cached = list(train_stream(m, tok, cache_root=tmp_path, progress=False))
    direct = list(iter_token_chunks(m, tok))
    for attr in ("ids", "nbytes"):
        assert np.array_equal(np.concatenate([getattr(c, attr) for c in cached]),
                              np.concatenate([getattr(c, attr) for c in direct]))
    assert int(sum(c.nbytes.sum() for c in cached)) == m.utf8_bytes("train")


@pytest.mark.slow
def test_main_job_runs_on_prepared_shared_data(shared_dir, tmp_path):
    from prism_challenge.cli import main

    run_dir = tmp_path / "run"
    code = main(["eval", str(REPO_ROOT / "examples" / "tiny-1m"), "--data", str(shared_dir.manifest.root),
                 "--token-budget", "3000", "--out", str(run_dir)])
    assert code == 0
    run_manifest = json.loads((run_dir / "prism_run_manifest.v2.json").read_text())
    assert run_manifest["data"]["manifest_sha256"] == load_manifest(shared_dir.manifest.root).sha256
