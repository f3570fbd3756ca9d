"""--source fineweb-edu: the Hub reading code, pointed at local directories laid out like the repo."""

from __future__ import annotations

import fsspec
import pyarrow.parquet as pq
import pytest
from fixtures_data import COMMIT, SALT_HEX, expected_kept, expected_split, make_hub_tree, make_rows, read_split_rows, write_salt

from prism_challenge.data.manifest import DataError
from prism_challenge.data.prepare import prepare
from prism_challenge.data.sources import (
    FINEWEB_EDU_REVISION,
    RepoView,
    hub_repo,
    list_subset_files,
    mirror_repo,
    subset_dir,
)

FILES = [make_rows(100, seed=10), make_rows(80, seed=11), make_rows(60, seed=12)]
ALL = [r for f in FILES for r in f]


class CountingFS:
    """A local filesystem that records which files are opened and how many bytes are read."""

    def __init__(self):
        self.fs = fsspec.filesystem("file")
        self.read: dict[str, int] = {}

    def glob(self, pattern):
        return self.fs.glob(pattern)

    def open(self, path, mode="rb"):
        f = self.fs.open(path, mode)
        self.read.setdefault(path, 0)
        counter = self

        class Wrapped:
            def __getattr__(self, name):
                return getattr(f, name)

            def read(self, n=-1):
                data = f.read(n)
                counter.read[path] += len(data)
                return data

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return Wrapped()


def _salt(tmp_path):
    return write_salt(tmp_path / "salt", SALT_HEX)


def test_default_pin_and_subsets():
    assert FINEWEB_EDU_REVISION == COMMIT
    assert subset_dir("sample-10BT") == "sample/10BT"
    assert subset_dir("sample-350BT") == "sample/350BT"
    assert subset_dir("CC-MAIN-2024-10") == "data/CC-MAIN-2024-10"
    with pytest.raises(DataError, match="unknown FineWeb-Edu subset"):
        subset_dir("10BT")


def test_real_hub_view_is_pinned_without_network():
    view = hub_repo()
    from huggingface_hub import HfFileSystem

    assert isinstance(view.fs, HfFileSystem)
    assert view.root == f"datasets/HuggingFaceFW/fineweb-edu@{COMMIT}"
    assert view.revision == COMMIT
    with pytest.raises(DataError, match="moving name.*--allow-unpinned"):
        hub_repo(revision="main")


def test_prepare_from_mirror_tree(tmp_path):
    mirror = make_hub_tree(tmp_path / "hub", FILES)
    out = tmp_path / "d"
    m = prepare("fineweb-edu", out, hub_mirror=mirror, salt_file=_salt(tmp_path)).manifest
    d = m.data
    assert (d["dataset"], d["subset"], d["revision"], d["license"]) == (
        "HuggingFaceFW/fineweb-edu", "sample-10BT", COMMIT, "ODC-By-1.0")
    assert d["source"]["kind"] == "fineweb-edu"
    assert [(f["path"], f["documents_read"]) for f in d["source"]["files"]] == [
        ("sample/10BT/000_00000.parquet", 100), ("sample/10BT/001_00000.parquet", 80),
        ("sample/10BT/002_00000.parquet", 60)]
    kept = expected_kept(ALL)
    got = {}
    for split in ("train", "val", "test"):
        for r in read_split_rows(m, split):
            got[r["id"]] = r
            assert split == expected_split(SALT_HEX, r["id"])
            assert r == kept[r["id"]]
    assert set(got) == set(kept)
    m.verify_all()


def test_only_needed_row_groups_and_files_are_read(tmp_path):
    big = [make_rows(200, seed=20, words=(1000, 1400)), make_rows(10, seed=21)]
    mirror = make_hub_tree(tmp_path / "hub", big, row_group_size=20)
    fs = CountingFS()
    view = RepoView(fs, mirror.as_posix(), COMMIT, str(mirror))
    m = prepare("fineweb-edu", tmp_path / "d", repo=view, max_docs=30, salt_file=_salt(tmp_path)).manifest
    assert m.data["documents_read"] == 30
    path = mirror / "sample/10BT/000_00000.parquet"
    assert list(fs.read) == [path.as_posix()]  # the other files were never opened
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 10
    rg = [meta.row_group(i) for i in (0, 1)]  # 30 rows: 2 row groups
    needed = sum(g.column(c).total_compressed_size for g in rg for c in range(g.num_columns))
    # the footer read (parquet readers fetch the last 64 KiB) plus the two row groups, not the rest
    assert needed < fs.read[path.as_posix()] <= needed + 65536 + 4096 < path.stat().st_size / 2


def test_max_bytes_crosses_files(tmp_path):
    mirror = make_hub_tree(tmp_path / "hub", FILES)
    sizes = [len(r["text"].encode()) for r in ALL]
    budget = sum(sizes[:130])
    m = prepare("fineweb-edu", tmp_path / "d", hub_mirror=mirror, max_bytes=budget, salt_file=_salt(tmp_path)).manifest
    assert m.data["documents_read"] == 130
    assert [f["documents_read"] for f in m.data["source"]["files"]] == [100, 30]


def test_unpinned_revision_needs_flag_and_resolves_through_refs(tmp_path):
    cache = tmp_path / "datasets--HuggingFaceFW--fineweb-edu"
    make_hub_tree(cache / "snapshots" / COMMIT, FILES[:1])
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(COMMIT)
    with pytest.raises(DataError, match="moving name"):
        prepare("fineweb-edu", tmp_path / "d", hub_mirror=cache, revision="main", salt_file=_salt(tmp_path))
    assert not (tmp_path / "d").exists()
    m = prepare("fineweb-edu", tmp_path / "d", hub_mirror=cache, revision="main", allow_unpinned=True,
                salt_file=_salt(tmp_path)).manifest
    assert m.data["revision"] == COMMIT
    other = "0" * 40
    with pytest.raises(DataError, match=f"no snapshot of commit {other}"):
        mirror_repo(cache, other)
    plain = make_hub_tree(tmp_path / "plain", FILES[:1])
    with pytest.raises(DataError, match="cannot resolve 'main'"):
        mirror_repo(plain, "main", allow_unpinned=True)
    assert mirror_repo(plain).revision == COMMIT


def test_subset_selection_and_missing_subset(tmp_path):
    mirror = make_hub_tree(tmp_path / "hub", FILES[:1])
    view = mirror_repo(mirror)
    assert [p.rsplit("/", 1)[-1] for p in list_subset_files(view, "sample-100BT")] == ["000_00000.parquet"]
    m = prepare("fineweb-edu", tmp_path / "d", hub_mirror=mirror, subset="sample-100BT", salt_file=_salt(tmp_path)).manifest
    assert m.data["subset"] == "sample-100BT" and m.data["documents_read"] == 5
    with pytest.raises(DataError, match="no parquet files in sample/350BT/"):
        prepare("fineweb-edu", tmp_path / "e", hub_mirror=mirror, subset="sample-350BT", salt_file=_salt(tmp_path))


def test_fineweb_options_only_for_fineweb(tmp_path):
    with pytest.raises(DataError, match="apply to --source fineweb-edu only"):
        prepare("builtin", tmp_path / "d", revision=COMMIT)
