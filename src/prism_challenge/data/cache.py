"""The token cache: a split tokenized once into memory-mapped ``.npy`` arrays.

One cache per (data MANIFEST sha256, tokenizer name, tokenizer sha256), in
``<cache root>/tokens/<manifest sha256>-<tokenizer name>-<tokenizer sha256[:12]>/``
(the train split; other splits get a ``-<split>`` suffix):

* ``ids.npy``: the whole stream of :mod:`~prism_challenge.data.stream`, leading end-of-text
  included: ``EOT doc_1 EOT doc_2 EOT ...``; ``uint16`` when V <= 65536, else ``uint32``.
* ``nbytes.npy``: the UTF-8 byte length of each token of ``ids`` (``uint8``; end-of-text 0).
* ``offsets.npy``: ``int64 [documents + 1]``; document ``i`` is ``ids[offsets[i]:offsets[i+1]-1]``
  (followed by its end-of-text), ``offsets[0] == 1`` and ``offsets[-1] == len(ids)``.
* ``meta.json``: format version, the key above, counts, and for each array its dtype, shape and
  the sha256 of its data bytes (the ``.npy`` payload after the header).

The cache is built from shards verified against the MANIFEST, in a temporary sibling folder,
and renamed into place. Opening it checks every array's dtype, shape and sha256 against
``meta.json`` (hashing runs at about 1-2 GB/s per array, the arrays in parallel), that the token
byte lengths add up to the split's UTF-8 bytes and the offsets to its documents; a cache that
fails any check is stale and is rebuilt by :func:`ensure_token_cache`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from prism_challenge import scratch
from prism_challenge.data.manifest import DataError, DataManifest
from prism_challenge.data.progress import ProgressFn
from prism_challenge.data.shards import iter_texts
from prism_challenge.tokenizers import ReferenceTokenizer

CACHE_FORMAT = 1
META_NAME = "meta.json"
_HEADER_BYTES = 128  # fixed .npy header room, so arrays can be streamed before their length is known
_BATCH_DOCS = 64
_BATCH_BYTES = 1 << 20


class TokenCacheError(DataError):
    """A token cache is missing, incomplete, or fails its checksum (named)."""


def ids_dtype(vocab_size: int) -> np.dtype:
    """Storage dtype of token ids: ``uint16`` when ``vocab_size <= 65536``, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def token_cache_dir(manifest: DataManifest, tokenizer: ReferenceTokenizer, cache_root: Path | None = None,
                    split: str = "train") -> Path:
    """The folder of the cache of ``split`` of ``manifest`` under ``tokenizer``."""
    if cache_root is None:
        from prism_challenge.data.builtin import default_cache_root

        cache_root = default_cache_root()
    name = f"{manifest.sha256}-{tokenizer.name}-{tokenizer.sha256[:12]}"
    if split != "train":
        name += f"-{split}"
    return Path(cache_root) / "tokens" / name


class _NpyWriter:
    """Appends a 1-D array to a ``.npy`` file whose length is only known at the end."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.f: IO[bytes] = open(path, "wb")
        self.f.write(b"\0" * _HEADER_BYTES)
        self.n = 0
        self.sha = hashlib.sha256()

    def append(self, arr: np.ndarray) -> None:
        data = np.ascontiguousarray(arr, dtype=self.dtype).tobytes()
        self.f.write(data)
        self.sha.update(data)
        self.n += arr.shape[0]

    def close(self) -> dict[str, Any]:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.n,)}
        text = repr(header).encode("latin1")
        pad = _HEADER_BYTES - 10 - len(text) - 1
        if pad < 0:  # pragma: no cover - 128 bytes hold any 1-D shape
            raise TokenCacheError(f"{self.path}: .npy header too long")
        self.f.seek(0)
        self.f.write(b"\x93NUMPY\x01\x00" + (len(text) + pad + 1).to_bytes(2, "little") + text + b" " * pad + b"\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": [self.n], "sha256": self.sha.hexdigest()}


def _payload_sha256(arr: np.ndarray) -> str:
    h = hashlib.sha256()
    flat = arr.reshape(-1).view(np.uint8)
    step = 64 << 20
    for start in range(0, flat.shape[0], step):
        h.update(flat[start : start + step])
    return h.hexdigest()


@dataclass(frozen=True)
class TokenCache:
    """An opened token cache (arrays memory-mapped read-only).

    Attributes:
        path: the cache folder.
        ids: ``[tokens]`` token ids of the whole stream (uint16 or uint32).
        nbytes: ``[tokens]`` uint8 UTF-8 byte length of each token.
        offsets: ``[documents + 1]`` int64 document starts in ``ids`` (see the module doc).
        meta: the parsed ``meta.json``.
    """

    path: Path
    ids: np.ndarray
    nbytes: np.ndarray
    offsets: np.ndarray
    meta: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        """Tokens in the stream, end-of-text tokens included."""
        return int(self.ids.shape[0])

    @property
    def n_documents(self) -> int:
        """Documents in the stream."""
        return int(self.offsets.shape[0]) - 1

    @property
    def utf8_bytes(self) -> int:
        """UTF-8 bytes the stream stands for (the sum of ``nbytes``)."""
        return int(self.meta["utf8_bytes"])

    def document(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (no end-of-text), a read-only view."""
        return self.ids[self.offsets[i] : self.offsets[i + 1] - 1]

    def chunks(self, chunk_tokens: int = 1 << 20, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """The stream from token ``start`` to ``stop`` as ``TokenChunk`` s of ``chunk_tokens``
        tokens (the last may be shorter): in-memory copies in the cache's compact dtypes (ids
        ``uint16``/``uint32``, byte lengths ``uint8``), so a consumer that cuts batches moves 3
        bytes per token, not 16; it widens the rows it cuts to int64 itself."""
        from prism_challenge.data.stream import TokenChunk

        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        stop = self.n_tokens if stop is None else min(stop, self.n_tokens)
        for a in range(start, stop, chunk_tokens):
            b = min(a + chunk_tokens, stop)
            yield TokenChunk(np.array(self.ids[a:b]), np.array(self.nbytes[a:b]))


def _expected_meta(manifest: DataManifest, tokenizer: ReferenceTokenizer, split: str) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "manifest_sha256": manifest.sha256,
        "split": split,
        "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
                      "eot_token": tokenizer.eot_token},
        "documents": manifest.documents(split),
        "utf8_bytes": manifest.utf8_bytes(split),
    }


def open_token_cache(path: Path, *, expect: dict[str, Any] | None = None, verify: bool = True) -> TokenCache:
    """Open the cache at ``path``.

    Args:
        expect: fields ``meta.json`` must hold (e.g. the MANIFEST sha256 and tokenizer).
        verify: hash every array and check the totals (see the module doc); without it only
            ``meta.json``, dtypes and shapes are checked.

    Raises:
        TokenCacheError: the folder or a file is missing, ``meta.json`` differs from ``expect``,
            or an array's dtype, shape, sha256 or totals disagree with it (the file named).
    """
    path = Path(path)
    meta_path = path / META_NAME
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise TokenCacheError(f"{meta_path}: token cache not found") from None
    except (OSError, ValueError) as exc:
        raise TokenCacheError(f"{meta_path}: unreadable ({exc})") from None
    for key, value in (expect or {}).items():
        if meta.get(key) != value:
            raise TokenCacheError(f"{meta_path}: {key} is {meta.get(key)!r}, expected {value!r} (stale cache)")
    arrays: dict[str, np.ndarray] = {}
    try:
        for name in ("ids", "nbytes", "offsets"):
            spec = meta["arrays"][name]
            file = path / spec["file"]
            try:
                arr = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise TokenCacheError(f"{file}: unreadable ({exc})") from None
            if arr.dtype.str != spec["dtype"] or list(arr.shape) != spec["shape"]:
                raise TokenCacheError(f"{file}: dtype/shape {arr.dtype.str}{list(arr.shape)} do not match "
                                      f"{META_NAME} ({spec['dtype']}{spec['shape']})")
            arrays[name] = arr
    except (KeyError, TypeError):
        raise TokenCacheError(f"{meta_path}: malformed") from None
    if verify:
        names = list(arrays)
        with ThreadPoolExecutor(len(names)) as ex:
            digests = dict(zip(names, ex.map(lambda n: _payload_sha256(arrays[n]), names)))
        for name in names:
            if digests[name] != meta["arrays"][name]["sha256"]:
                raise TokenCacheError(f"{path / meta['arrays'][name]['file']}: sha256 {digests[name]} does not match "
                                      f"{META_NAME} ({meta['arrays'][name]['sha256']})")
        ids, nb, off = arrays["ids"], arrays["nbytes"], arrays["offsets"]
        total = int(np.sum(nb, dtype=np.int64))
        if total != meta["utf8_bytes"] or off.shape[0] != meta["documents"] + 1 or ids.shape != nb.shape or (
            off.shape[0] and (off[0] != 1 or off[-1] != ids.shape[0])
        ):
            raise TokenCacheError(f"{path}: arrays disagree with {META_NAME} (bytes, documents or offsets)")
    return TokenCache(path, arrays["ids"], arrays["nbytes"], arrays["offsets"], meta)


def _encode_batch(tokenizer: ReferenceTokenizer, lengths_table: np.ndarray, dtype: np.dtype,
                  texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids with an EOT after each text, their byte lengths, tokens per text + 1)."""
    eot = tokenizer.eot_token
    if tokenizer.name == "bytes":
        parts = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        sizes = np.fromiter((p.shape[0] + 1 for p in parts), dtype=np.int64, count=len(parts))
        ids = np.empty(int(sizes.sum()), dtype=dtype)
        pos = 0
        for p in parts:
            ids[pos : pos + p.shape[0]] = p
            pos += p.shape[0]
            ids[pos] = eot
            pos += 1
    else:
        flat: list[int] = []
        sizes = np.empty(len(texts), dtype=np.int64)
        for k, t in enumerate(texts):
            toks = tokenizer.encode(t)  # tiktoken releases the GIL while it encodes
            flat += toks
            flat.append(eot)
            sizes[k] = len(toks) + 1
        ids = np.array(flat, dtype=dtype)
    return ids, lengths_table[ids], sizes


def _text_batches(manifest: DataManifest, split: str) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for texts in iter_texts(manifest.shard_paths(split), batch_rows=_BATCH_DOCS):
        for t in texts:
            batch.append(t)
            size += len(t)
            if len(batch) >= _BATCH_DOCS or size >= _BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def default_workers() -> int:
    """Tokenizer threads for a cache build: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def build_token_cache(
    manifest: DataManifest,
    tokenizer: ReferenceTokenizer,
    path: Path,
    *,
    split: str = "train",
    workers: int | None = None,
    progress: ProgressFn | None = None,
    verify_shards: bool = True,
) -> TokenCache:
    """Tokenize ``split`` into a new cache at ``path`` (built in a temporary sibling, renamed).

    Args:
        workers: tokenizer threads (default :func:`default_workers`).
        progress: called with (documents, UTF-8 bytes) tokenized so far.
        verify_shards: verify the split's shards against the MANIFEST first.

    Raises:
        DataError: a shard fails verification (named) or ``path`` cannot be written.
    """
    path = Path(path)
    if verify_shards:
        manifest.verify(split)
    workers = workers or default_workers()
    dtype = ids_dtype(tokenizer.vocab_size)
    table = tokenizer.byte_lengths()
    if int(table.max()) > 255:  # pragma: no cover - no reference tokenizer has such a token
        raise TokenCacheError(f"tokenizer {tokenizer.name}: a token longer than 255 bytes")
    lengths_table = table.astype(np.uint8)
    tokenizer.encode("warm up")  # load the BPE tables once, before the threads start
    path.parent.mkdir(parents=True, exist_ok=True)
    stack = ExitStack()  # a builder killed midway leaves its folder to the next build's sweep
    tmp = stack.enter_context(scratch.staging(path.parent, path.name))
    writers: list[_NpyWriter] = []
    try:
        w_ids = _NpyWriter(tmp / "ids.npy", dtype)
        w_nb = _NpyWriter(tmp / "nbytes.npy", np.uint8)
        w_off = _NpyWriter(tmp / "offsets.npy", np.int64)
        writers += [w_ids, w_nb, w_off]
        w_ids.append(np.array([tokenizer.eot_token], dtype=dtype))
        w_nb.append(np.zeros(1, dtype=np.uint8))
        pos, docs, nbytes = 1, 0, 0
        w_off.append(np.array([pos], dtype=np.int64))
        with ThreadPoolExecutor(workers) as ex:
            pending: list[Any] = []

            def drain(keep: int) -> None:
                nonlocal pos, docs, nbytes
                while len(pending) > keep:
                    ids, nb, sizes = pending.pop(0).result()
                    w_ids.append(ids)
                    w_nb.append(nb)
                    ends = pos + np.cumsum(sizes)
                    w_off.append(ends)
                    pos = int(ends[-1])
                    docs += sizes.shape[0]
                    nbytes += int(nb.sum(dtype=np.int64))
                    if progress is not None:
                        progress(docs, nbytes)

            for texts in _text_batches(manifest, split):
                pending.append(ex.submit(_encode_batch, tokenizer, lengths_table, dtype, texts))
                drain(2 * workers)
            drain(0)
        meta = _expected_meta(manifest, tokenizer, split)
        if docs != meta["documents"] or nbytes != meta["utf8_bytes"]:
            raise DataError(f"{manifest.root}: split {split!r} holds {docs} documents / {nbytes} bytes, "
                            f"its MANIFEST says {meta['documents']} / {meta['utf8_bytes']}")
        meta["tokens"] = pos
        meta["arrays"] = {"ids": w_ids.close(), "nbytes": w_nb.close(), "offsets": w_off.close()}
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if path.exists():
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():  # else: a concurrent builder won; theirs is checked on open
                raise
    finally:
        for w in writers:
            w.f.close()
        stack.close()
    return open_token_cache(path, expect=_expected_meta(manifest, tokenizer, split))


def ensure_token_cache(
    manifest: DataManifest,
    tokenizer: ReferenceTokenizer,
    *,
    cache_root: Path | None = None,
    split: str = "train",
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> TokenCache:
    """The verified cache of ``split`` under ``tokenizer``, built (or rebuilt, when missing,
    stale or corrupt) on first use. See :func:`token_cache_dir` for where it lives.

    Raises:
        DataError: a shard fails verification while building (named), or writing fails.
    """
    path = token_cache_dir(manifest, tokenizer, cache_root, split)
    expect = _expected_meta(manifest, tokenizer, split)
    if path.is_dir():
        try:
            return open_token_cache(path, expect=expect)
        except TokenCacheError:
            pass  # stale or corrupt: rebuild
    return build_token_cache(manifest, tokenizer, path, split=split, workers=workers, progress=progress)
