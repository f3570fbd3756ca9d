"""The page cache emptied before a blind probe child (``evaluator/pagecache.py``): the kernel
drops a page this process read (checked with a non-blocking read, outside any sandbox), and the
audit empties it after the last child before the blind probe child and before its feed."""
import os
import sys
import time
from pathlib import Path

import pytest

from prism_challenge.evaluator import pagecache
from prism_challenge.evaluator.pagecache import EMPTIED, cache_note, empty_page_cache

sys.path.insert(0, str(Path(__file__).parent))
from test_rescore import _RecordingJail  # noqa: E402


def _cached(path: Path, offset: int) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="drop_caches needs root")
def test_a_page_read_before_is_not_cached_after(tmp_path):
    f = tmp_path / "pages"
    f.write_bytes(os.urandom(64 * 4096))
    os.sync()  # clean pages: the only kind the kernel drops
    with open(f, "rb") as fh:
        fh.seek(10 * 4096)
        fh.read(1)
    assert _cached(f, 10 * 4096)
    assert empty_page_cache() is None
    assert not _cached(f, 10 * 4096)


def test_without_root_or_a_writable_knob_it_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(pagecache.os, "geteuid", lambda: 1000)
    assert empty_page_cache() == "not emptied: the harness is not root (/proc/sys/vm/drop_caches needs it)"
    monkeypatch.setattr(pagecache.os, "geteuid", lambda: 0)
    assert empty_page_cache(tmp_path / "absent" / "drop_caches") == (
        f"not emptied: {tmp_path / 'absent' / 'drop_caches'}: No such file or directory")
    assert (cache_note([]), cache_note([None, None]), cache_note([None, "not emptied: x"])) == (
        None, EMPTIED, "not emptied: x")


def test_the_audit_empties_it_after_the_child_before_a_blind_probe_child_and_before_its_feed(monkeypatch):
    from prism_challenge.audit import rescore

    events = []
    monkeypatch.setattr(rescore, "empty_folders", lambda folders: events.append(("empty", tuple(folders))))
    tasks = [("rescore", 2, lambda: b"r0:2"), ("blind", 2, lambda: b"b0:2"), ("blind", 1, lambda: b"b1:1")]
    rescore._run_tasks(_RecordingJail(events), tasks, deadline=time.monotonic() + 60, writable=["/art"],
                       before_blind=lambda: events.append(("cache",)))
    assert events == [
        ("empty", ("/art",)), ("start", "c0"), ("start", "c1"), ("feed", "c0", "r0:2"),
        ("empty", ("/art",)), ("cache",), ("start", "c2"), ("feed", "c1", "b0:2"),
        ("empty", ("/art",)), ("cache",), ("feed", "c2", "b1:1"),
    ]  # each blind probe child: fed only after the one before ended, and the cache emptied
