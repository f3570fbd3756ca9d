"""Reference code lengths: what general-purpose compressors make of the text a run scored.

**The text.** The first ``nbytes`` bytes of the concatenation of the split's documents' UTF-8
bytes, in stream order (the MANIFEST's shard order, rows in order), with nothing between
documents, where ``nbytes`` is the run's ``score.bytes``. These are exactly the bytes the
prequential bpb counts: the stream is ``EOT doc_1 EOT doc_2 ...``
(:mod:`~prism_challenge.data.stream`), every token after the leading end-of-text is a target
once (:mod:`~prism_challenge.evaluator.feeder`), an end-of-text stands for 0 bytes and a
document's tokens stand for its UTF-8 bytes; so the scored targets of a run, a prefix of the
stream, stand for a prefix of that concatenation (the last document cut at a token boundary).
The text does not depend on the tokenizer.

**The codes** (:data:`CODECS`), each the length of one whole-text, one-shot compression:

* ``zstd-19``: ``zstandard.ZstdCompressor(level=19).compress(text)`` (one frame);
* ``xz-9e``: ``lzma.compress(text, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)``;
* ``gzip-9``: ``gzip.compress(text, compresslevel=9, mtime=0)``;

in bits per byte: ``8 * len(compressed) / nbytes``, the prequential bpb's denominator. Headers
and checksums are counted (a few bytes: nothing for a prefix of a megabyte).

**The cache.** One JSON file per (data MANIFEST sha256, split, ``nbytes``), in
``<cache root>/refcodes/<manifest sha256>-<split>-<nbytes>.json``, holding the codes, the text's
sha256, the compressor libraries' versions and the seconds the computation took (reading the text
included); a file whose key or versions differ is recomputed.
Everything here runs on the trusted side, from the locked shards: the submission chooses nothing
but how many bytes it was scored on.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import lzma
import math
import os
import platform
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

from prism_challenge.data.manifest import DataError, DataManifest
from prism_challenge.data.shards import iter_texts

CACHE_FORMAT = 1
CODECS: dict[str, Callable[[bytes], bytes]] = {
    "zstd-19": lambda text: zstandard.ZstdCompressor(level=19).compress(text),
    "xz-9e": lambda text: lzma.compress(text, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME),
    "gzip-9": lambda text: gzip.compress(text, compresslevel=9, mtime=0),
}
"""The reference compressors by name: text bytes in, compressed bytes out."""

log = logging.getLogger(__name__)


def library_versions() -> dict[str, str]:
    """The versions that decide the codes: ``zstandard`` and its libzstd, the zlib in use, and
    Python (whose ``lzma`` module is built against the system's liblzma)."""
    return {"zstandard": zstandard.__version__, "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
            "zlib": zlib.ZLIB_RUNTIME_VERSION, "python": platform.python_version()}


def scored_text(manifest: DataManifest, nbytes: int, split: str = "train") -> bytes:
    """The first ``nbytes`` bytes of the concatenation of ``split``'s documents' UTF-8 bytes, in
    stream order (see the module doc: the bytes a run scored on ``nbytes`` bytes).

    Raises:
        DataError: ``nbytes`` is negative or more than the split holds (both named).
    """
    if nbytes < 0:
        raise DataError(f"reference codes: nbytes must be at least 0, got {nbytes}")
    if nbytes == 0:
        return b""
    parts: list[bytes] = []
    have = 0
    for texts in iter_texts(manifest.shard_paths(split)):
        for t in texts:
            b = t.encode("utf-8")
            parts.append(b[: nbytes - have])
            have += len(parts[-1])
            if have == nbytes:
                return b"".join(parts)
    raise DataError(f"{manifest.root}: split {split!r} holds {have} UTF-8 bytes, fewer than the {nbytes} scored")


def code_lengths(text: bytes) -> dict[str, float]:
    """Bits per byte of each of :data:`CODECS` on ``text`` (``8 * compressed bytes / len(text)``),
    the three compressors on threads of their own (each releases the GIL while it works).

    Raises:
        ValueError: ``text`` is empty (no bits per byte).
    """
    if not text:
        raise ValueError("reference codes: no bytes to compress")
    sizes: dict[str, int] = {}

    def one(name: str) -> None:
        sizes[name] = len(CODECS[name](text))

    threads = [threading.Thread(target=one, args=(name,), name=f"prism-refcode-{name}") for name in CODECS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(sizes) != len(CODECS):  # a thread raised (its traceback went to stderr)
        raise RuntimeError(f"reference codes: {', '.join(sorted(set(CODECS) - set(sizes)))} failed")
    return {name: 8 * sizes[name] / len(text) for name in CODECS}


def against_best(bpb: float, record: dict[str, Any]) -> tuple[str, float]:
    """The best (lowest-bpb) code of a ``reference_codes`` record and ``bpb`` minus it, in bits
    per byte: negative when the model coded the scored text in fewer bits than every reference
    compressor (ties: the first of :data:`CODECS`)."""
    name = min(CODECS, key=lambda n: record[n])
    return name, bpb - record[name]


def cache_path(manifest: DataManifest, nbytes: int, cache_root: Path | None = None, split: str = "train") -> Path:
    """Where the codes of ``nbytes`` bytes of ``split`` are cached (see the module doc)."""
    if cache_root is None:
        from prism_challenge.data.builtin import default_cache_root

        cache_root = default_cache_root()
    return Path(cache_root) / "refcodes" / f"{manifest.sha256}-{split}-{nbytes}.json"


def _key(manifest: DataManifest, nbytes: int, split: str) -> dict[str, Any]:
    return {"format": CACHE_FORMAT, "manifest_sha256": manifest.sha256, "split": split, "bytes": nbytes,
            "libraries": library_versions()}


def _read_cache(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or any(cached.get(k) != v for k, v in key.items()):
        return None
    record = cached.get("record")
    ok = isinstance(record, dict) and record.get("bytes") == key["bytes"] and isinstance(
        record.get("text_sha256"), str) and all(
        isinstance(record.get(n), float) and math.isfinite(record[n]) for n in CODECS)
    return record if ok else None


def reference_codes(manifest: DataManifest, nbytes: int, *, cache_root: Path | None = None,
                    split: str = "train") -> dict[str, Any] | None:
    """The manifest's ``reference_codes`` record of a run scored on ``nbytes`` bytes of ``split``:
    ``{"bytes": nbytes, "text_sha256": sha256 of the text, "zstd-19": bpb, "xz-9e": bpb,
    "gzip-9": bpb}``, read from the cache (:func:`cache_path`) or computed and cached; ``None``
    when ``nbytes`` is 0.

    Raises:
        DataError: the split holds fewer bytes (named).
    """
    if nbytes == 0:
        return None
    path = cache_path(manifest, nbytes, cache_root, split)
    key = _key(manifest, nbytes, split)
    record = _read_cache(path, key)
    if record is not None:
        return record
    t0 = time.perf_counter()
    text = scored_text(manifest, nbytes, split)
    record = {"bytes": nbytes, "text_sha256": hashlib.sha256(text).hexdigest(), **code_lengths(text)}
    seconds = time.perf_counter() - t0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({**key, "seconds": seconds, "record": record}, f, indent=2)
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable cache costs a recomputation next time, nothing else
        log.warning("reference codes: cannot cache %s: %s", path, exc)
    return record


class Background:
    """:func:`reference_codes` on a daemon thread, started at once (the pipeline runs the audit
    and the held-out evaluation meanwhile); :meth:`result` waits for it. A run that is cancelled
    does not wait: the thread ends with the process, or caches its figures for the next run."""

    def __init__(self, manifest: DataManifest, nbytes: int, cache_root: Path | None = None):
        self._out: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, args=(manifest, nbytes, cache_root),
                                        name="prism-refcodes", daemon=True)
        self._thread.start()

    def _run(self, manifest: DataManifest, nbytes: int, cache_root: Path | None) -> None:
        try:
            self._out = reference_codes(manifest, nbytes, cache_root=cache_root)
        except (DataError, OSError, ValueError, RuntimeError) as exc:  # a figure beside the score, never the score
            log.warning("reference codes: not computed: %s", exc)

    def result(self, cancelled: Callable[[], bool] = lambda: False) -> dict[str, Any] | None:
        """The record (see :func:`reference_codes`), or ``None`` when it could not be computed
        (the reason logged) or ``cancelled()`` turned true while it waited (polled every 0.2 s)."""
        while self._thread.is_alive():
            if cancelled():
                return None
            self._thread.join(0.2)
        return self._out
