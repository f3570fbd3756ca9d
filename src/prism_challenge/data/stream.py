"""The train token stream: documents in the challenge's order, tokenized, end-of-text after each.

The stream starts at a document boundary: a leading end-of-text token is the context of the first
document's first token, so every token of every covered document is a scored target, and the
scored bytes equal the UTF-8 length of the documents covered. The stream is then
``doc_1 EOT doc_2 EOT ...``; each token carries its exact UTF-8 byte length (EOT: 0 bytes).

:func:`train_stream` reads the train split from the token cache (:mod:`~prism_challenge.data.cache`),
building it on first use; :func:`iter_token_chunks` tokenizes the shards directly. Both give the
same stream, token for token and byte for byte. :func:`heldout_stream` gives the same layout over
a held-out split, cut at a byte budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.data.manifest import DataError, DataManifest
from prism_challenge.data.shards import iter_texts
from prism_challenge.tokenizers import ReferenceTokenizer


@dataclass(frozen=True)
class TokenChunk:
    """A run of consecutive stream tokens.

    Attributes:
        ids: ``[n]`` token ids, an integer dtype (int64 from the tokenizer, ``uint16``/``uint32``
            from the token cache).
        nbytes: ``[n]`` UTF-8 byte length of each token (0 for end-of-text), an integer dtype
            (int64 from the tokenizer, ``uint8`` from the token cache).
    """

    ids: np.ndarray
    nbytes: np.ndarray


def iter_token_chunks(
    manifest: DataManifest, tokenizer: ReferenceTokenizer, split: str = "train", docs_per_chunk: int = 64
) -> Iterator[TokenChunk]:
    """Tokenize a split's documents lazily, in order, ``docs_per_chunk`` documents per chunk.

    The first chunk starts with the leading end-of-text token; an empty split yields nothing.
    This is the direct (uncached) path: it reads the shards without verifying them (see
    :func:`verify_split`).
    """
    eot = np.array([tokenizer.eot_token], dtype=np.int64)
    table = tokenizer.byte_lengths()
    first = True
    for texts in iter_texts(manifest.shard_paths(split), batch_rows=docs_per_chunk):
        pieces = [eot] if first else []
        first = False
        for ids in tokenizer.encode_documents(texts):
            pieces.append(ids)
            pieces.append(eot)
        ids = np.concatenate(pieces)
        yield TokenChunk(ids, table[ids])


def verify_split(manifest: DataManifest, split: str = "train") -> None:
    """Check every shard of ``split`` against the MANIFEST (call it before the first batch).

    Raises:
        DataError: naming the first missing or mismatching shard.
    """
    manifest.verify(split)


def train_stream(
    manifest: DataManifest,
    tokenizer: ReferenceTokenizer,
    *,
    cache_root: Path | None = None,
    chunk_tokens: int = 1 << 20,
    workers: int | None = None,
    progress: Any = "auto",
) -> Iterator[TokenChunk]:
    """The train split's token stream as the feeder reads it, from the token cache.

    The cache (under ``cache_root``, default :func:`~prism_challenge.data.builtin.default_cache_root`,
    in ``tokens/<manifest sha256>-<tokenizer name>-<tokenizer sha256[:12]>/``) is opened and
    verified, or built from the verified shards, before this returns. The stream is the one
    :func:`iter_token_chunks` gives, cut into chunks of ``chunk_tokens`` tokens (the cache's
    compact dtypes: see :meth:`~prism_challenge.data.cache.TokenCache.chunks`).

    Args:
        workers: tokenizer threads for a build.
        progress: ``"auto"`` (a progress bar on stderr when it is a terminal), True, False,
            or a ``progress(documents, utf8_bytes)`` callable.

    Raises:
        DataError: a train shard fails verification during a build (named), or the cache
            cannot be written.
    """
    from prism_challenge.data.cache import ensure_token_cache, token_cache_dir
    from prism_challenge.data.progress import progress_callback

    path = token_cache_dir(manifest, tokenizer, cache_root)
    with progress_callback(progress, f"tokenizing train ({tokenizer.name}) into {path.name[:16]}...",
                           total_bytes=manifest.utf8_bytes("train")) as cb:
        cache = ensure_token_cache(manifest, tokenizer, cache_root=cache_root, workers=workers, progress=cb)
    return cache.chunks(chunk_tokens)


def heldout_stream(
    manifest: DataManifest,
    tokenizer: ReferenceTokenizer,
    split: str = "val",
    max_bytes: int | None = None,
    *,
    docs_per_chunk: int = 64,
    verify: bool = True,
) -> Iterator[TokenChunk]:
    """A held-out split's token stream, in the train stream's layout, cut at a byte budget.

    The stream is ``EOT doc_1 EOT doc_2 EOT ...`` over the split's documents in MANIFEST order,
    whole documents only: documents are taken while their UTF-8 bytes total at most
    ``max_bytes``, stopping at the first one that would exceed it (or right after the total
    meets it exactly). So the scored bytes are the sum of the yielded ``nbytes`` and never exceed
    ``max_bytes``; ``None`` takes the whole split. A budget below the first document yields just
    the leading end-of-text. The shards that can hold a taken document are verified against the
    MANIFEST before this returns (unless ``verify`` is False); the others are not read.

    Raises:
        DataError: no such split, ``max_bytes`` is negative, or a shard fails verification (named).
    """
    if max_bytes is not None and max_bytes < 0:
        raise DataError(f"max_bytes must be at least 0, got {max_bytes}")
    shards = manifest.shards(split)
    needed = []
    before = 0
    for entry in shards:
        if max_bytes is not None and before >= max_bytes:
            break
        needed.append(entry)
        before += int(entry.get("utf8_bytes", 0))
    if verify:
        for entry in needed:
            manifest.verify_shard(entry)
    return _budgeted_chunks([manifest.root / e["path"] for e in needed], tokenizer, max_bytes, docs_per_chunk)


def _budgeted_chunks(paths: list[Path], tokenizer: ReferenceTokenizer, max_bytes: int | None,
                     docs_per_chunk: int) -> Iterator[TokenChunk]:
    eot = np.array([tokenizer.eot_token], dtype=np.int64)
    table = tokenizer.byte_lengths()
    first = True
    total = 0
    done = max_bytes == 0
    for texts in ([] if done else iter_texts(paths, batch_rows=docs_per_chunk)):
        if max_bytes is not None:
            k = 0
            for t in texts:
                n = len(t.encode("utf-8"))
                if total + n > max_bytes:
                    done = True
                    break
                total += n
                k += 1
                if total >= max_bytes:
                    done = True
                    break
            texts = texts[:k]
        pieces = [eot] if first else []
        for ids in tokenizer.encode_documents(texts):
            pieces.append(ids)
            pieces.append(eot)
        if pieces:
            first = False
            ids = np.concatenate(pieces)
            yield TokenChunk(ids, table[ids])
        if done:
            break
    if first:
        yield TokenChunk(eot.copy(), np.zeros(1, dtype=np.int64))
