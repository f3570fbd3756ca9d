"""The service's content-addressed blob store and its safe zip intake, on real files."""

from __future__ import annotations

import hashlib
import io
import os
import sqlite3
import stat
import struct
import warnings
import zipfile

import pytest

from prism_challenge.service.archive import ArchiveError, extract_bundle
from prism_challenge.service.blobs import BlobCorrupt, BlobStore, default_root

ARCH = "import torch\n\n\ndef build_model(ctx):\n    return torch.nn.Linear(2, 2)\n"
TRAIN = "def train(ctx):\n    pass\n"


def _zip(members, method=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return buf.getvalue()


# -- blobs -----------------------------------------------------------------------------------
def test_a_blob_is_stored_under_its_sha256_once(tmp_path):
    blobs = BlobStore(tmp_path / "b")
    data = b"prism bundle bytes"
    sha = blobs.put(data)
    assert sha == hashlib.sha256(data).hexdigest()
    assert blobs.path(sha) == tmp_path / "b" / sha[:2] / sha[2:4] / sha
    assert blobs.get(sha) == data and sha in blobs
    assert blobs.put(data) == sha  # idempotent
    assert [p.name for p in (tmp_path / "b").rglob("*") if p.is_file()] == [sha]  # no temp file left


def test_an_absent_blob_is_a_key_error_naming_it(tmp_path):
    blobs = BlobStore(tmp_path)
    sha = "0" * 64
    assert sha not in blobs and "nonsense" not in blobs
    with pytest.raises(KeyError, match=sha):
        blobs.get(sha)
    with pytest.raises(ValueError, match="64 lower-case hex"):
        blobs.path("../../etc/passwd")


def test_a_blob_changed_on_disk_is_corrupt(tmp_path):
    blobs = BlobStore(tmp_path)
    sha = blobs.put(b"abc")
    blobs.path(sha).write_bytes(b"abd")
    with pytest.raises(BlobCorrupt, match=hashlib.sha256(b"abd").hexdigest()):
        blobs.get(sha)


def test_the_default_blob_root_is_under_the_user_data_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_root() == tmp_path / "prism-challenge" / "blobs"
    assert BlobStore().root == tmp_path / "prism-challenge" / "blobs"


# -- archive ---------------------------------------------------------------------------------
def test_a_single_top_level_folder_is_stripped(tmp_path):
    root = extract_bundle(_zip([("mine/architecture.py", ARCH), ("mine/training.py", TRAIN)]), tmp_path / "x")
    assert root == tmp_path / "x" / "mine"
    assert (root / "architecture.py").read_text() == ARCH
    assert stat.S_IMODE(os.stat(tmp_path / "x").st_mode) == 0o755


def _refused(data: bytes, dest, **kw) -> ArchiveError:
    with pytest.raises(ArchiveError) as info:
        extract_bundle(data, dest, **kw)
    assert list(dest.iterdir()) == []  # nothing left behind
    return info.value


@pytest.mark.parametrize("members, code, rule, names", [
    ([("../evil.py", "x")], "unsafe-path", "prism:zip-parent-path", "../evil.py"),
    ([("/abs.py", "x")], "unsafe-path", "prism:zip-absolute-path", "/abs.py"),
    ([("a\\..\\..\\b.py", "x")], "unsafe-path", "prism:zip-escape", "a\\..\\..\\b.py"),
    ([("architecture.py", ARCH), ("architecture.py", ARCH)], "duplicate-member", "prism:zip-duplicate",
     "architecture.py"),
    ([("model.bin", "x")], "bad-bundle", "prism:bad-suffix", "model.bin"),
])
def test_unsafe_members_are_refused_by_code(tmp_path, members, code, rule, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate it writes
        data = _zip(members)
    err = _refused(data, tmp_path / "o")
    assert (err.code, err.rule) == (code, rule)
    assert names in err.message


def test_a_symlink_member_is_refused(tmp_path):
    info = zipfile.ZipInfo("architecture.py")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    err = _refused(_zip([(info, "/etc/passwd")]), tmp_path / "o")
    assert (err.code, err.rule) == ("unsafe-member", "prism:symlink")


def test_not_a_zip(tmp_path):
    err = _refused(b"PK\x03\x04 but not really a zip", tmp_path / "o")
    assert err.code == "not-a-zip" and err.message.startswith("bundle.zip: not a valid zip archive")
    assert str(tmp_path) not in err.message  # the service's own paths are not told


def test_a_zip_bomb_by_ratio_and_by_total(tmp_path):
    bomb = _zip([("architecture.py", "#" * 2_000_000)])  # deflates ~1000:1
    err = _refused(bomb, tmp_path / "o")
    assert (err.code, err.rule) == ("zip-bomb", "prism:zip-ratio")
    stored = _zip([("architecture.py", "x = 1\n" * 1000)], zipfile.ZIP_STORED)  # ratio 1, 6000 bytes
    err = _refused(stored, tmp_path / "o2", max_bytes=5000)
    assert (err.code, err.rule) == ("zip-bomb", "prism:zip-too-large")


def test_a_member_lying_about_its_size_is_caught_while_reading(tmp_path):
    data = bytearray(_zip([("architecture.py", ARCH * 20), ("training.py", TRAIN)]))
    local, central = data.find(b"PK\x03\x04"), data.find(b"PK\x01\x02")
    struct.pack_into("<I", data, local + 22, 10)  # the uncompressed size, local header and directory
    struct.pack_into("<I", data, central + 24, 10)
    err = _refused(bytes(data), tmp_path / "o")
    assert err.code == "not-a-zip" and "Bad CRC-32 for file 'architecture.py'" in err.message


def test_too_many_files(tmp_path):
    err = _refused(_zip([(f"m{i}.py", "") for i in range(5)]), tmp_path / "o", max_files=4)
    assert (err.code, err.rule) == ("too-many-files", "prism:too-many-files")
    assert "5 members, more than 4" in err.message


def test_the_0002_migration_keeps_rows_made_under_0001(tmp_path):
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from prism_challenge.service.store import MIGRATIONS, Store

    url = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    engine = create_engine(url)  # a database left at revision 0001 by an earlier release
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as c:
        config.attributes["connection"] = c
        command.upgrade(config, "0001")
        c.exec_driver_sql("INSERT INTO submitters (id, hotkey, created_at) VALUES (1, 'hk', '2026-01-01 00:00:00')")
        c.exec_driver_sql("INSERT INTO submissions (id, submitter_id, bundle_sha256, status, attempts, max_attempts,"
                          " created_at, updated_at) VALUES (1, 1, 'ab', 'pending', 0, 3, '2026-01-01 00:00:00',"
                          " '2026-01-01 00:00:00')")
    engine.dispose()
    store = Store(url)
    row = store.submission(1)
    assert (row.bundle_sha256, row.source_sha256, row.profile, row.variant_of) == ("ab", None, None, None)
    sid = store.submit("hk", "cd", source_sha256="11" * 32, family_sha256="22" * 32, variant_of=1, profile="prism-v2")
    row = store.submission(sid)
    assert (row.source_sha256, row.family_sha256, row.variant_of, row.profile) == ("11" * 32, "22" * 32, 1, "prism-v2")
    store.close()
    con = sqlite3.connect(tmp_path / "db.sqlite3")
    assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("0006",)]
    indexes = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"ix_submissions_source_sha256", "ix_submissions_family_sha256", "ix_submissions_variant_of",
            "ix_submissions_profile"} <= indexes
    con.close()


def test_old_nonces_are_pruned_and_recent_ones_kept(tmp_path):
    from datetime import timedelta

    from prism_challenge.service.models import Nonce, utcnow
    from prism_challenge.service.queries import prune_nonces
    from prism_challenge.service.store import NonceReused, Store

    store = Store(f"sqlite:///{tmp_path / 'n.sqlite3'}")
    store.use_nonce("hk", "old", 1)
    with store.sessions.begin() as s:
        s.query(Nonce).filter(Nonce.nonce == "old").update({"created_at": utcnow() - timedelta(seconds=700)})
    store.use_nonce("hk", "new", 2)
    assert prune_nonces(store, utcnow() - timedelta(seconds=600)) == 1
    with pytest.raises(NonceReused):
        store.use_nonce("hk", "new", 2)
    store.use_nonce("hk", "old", 3)  # gone: a replay of it would carry a timestamp outside the window
    store.close()


def test_normalized_source_drops_comments_docstrings_and_layout_only():
    from prism_challenge.service.intake import normalized_python

    a = 'def f(x):\n    """Doc."""\n    return x + 1  # plus one\n\n\nclass C:\n    "only a docstring"\n'
    b = "# header\ndef f(x):\n\n    return (x +\n            1)\nclass C:\n    pass\n"
    assert normalized_python(a, "a.py") == normalized_python(b, "b.py") == (
        "def f(x):\n    return x + 1\n\nclass C:\n    pass")
    assert normalized_python("x = 'not a docstring'\ny = 1\n", "c.py") == "x = 'not a docstring'\ny = 1"
    assert normalized_python("def f(x):\n    return x + 2\n", "d.py") != normalized_python(b, "b.py")
