"""Parquet shards of documents (``id``, ``text``, other columns kept), zstd-compressed.

Columns follow the FineWeb / FineWeb-Edu schema. ``id`` and ``text`` come first; the other known
columns (:data:`COLUMN_TYPES`) are kept when the source has them, with fixed Arrow types so every
shard of a data directory has the same schema. Shards are written without wall-clock metadata,
so the same documents give the same bytes (and the same sha256) on every run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prism_challenge.data.manifest import sha256_file

ROW_GROUP_SIZE = 1024

# FineWeb(-Edu) columns a data directory keeps, in shard order, with their Arrow types.
COLUMN_TYPES: dict[str, pa.DataType] = {
    "id": pa.string(),
    "text": pa.string(),
    "dump": pa.string(),
    "url": pa.string(),
    "file_path": pa.string(),
    "language": pa.string(),
    "language_score": pa.float64(),
    "token_count": pa.int64(),
    "score": pa.float64(),
    "int_score": pa.int64(),
}
REQUIRED_COLUMNS = ("id", "text")


def shard_schema(columns: list[str]) -> pa.Schema:
    """Arrow schema of shards holding ``columns`` (known names, put in canonical order)."""
    return pa.schema([(c, COLUMN_TYPES[c]) for c in COLUMN_TYPES if c in columns])


def text_bytes(table: pa.Table) -> int:
    """UTF-8 bytes of the ``text`` column of ``table`` (nulls count 0)."""
    import pyarrow.compute as pc

    if table.num_rows == 0:
        return 0
    total = pc.sum(pc.binary_length(table.column("text"))).as_py()
    return int(total or 0)


def write_table_shard(path: Path, table: pa.Table) -> dict[str, Any]:
    """Write ``table`` (columns in shard order) as one zstd parquet shard at ``path``.

    Returns:
        The shard's MANIFEST entry without ``path``: ``{"sha256", "documents", "utf8_bytes"}``
        (documents = rows, utf8_bytes = UTF-8 bytes of ``text``).
    """
    table = table.combine_chunks()  # the bytes written must not depend on how rows were batched
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", row_group_size=ROW_GROUP_SIZE)
    return {"sha256": sha256_file(path), "documents": table.num_rows, "utf8_bytes": text_bytes(table)}


def write_shard(path: Path, ids: list[str], texts: list[str], extra: dict[str, list] | None = None) -> dict[str, Any]:
    """Write one shard and return its MANIFEST entry (path relative to the data dir is set by
    the caller): ``{"sha256", "documents", "utf8_bytes"}``.

    Parquet is written without wall-clock metadata, so the same documents give the same bytes.
    """
    columns: dict[str, Any] = {"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string())}
    for name, values in (extra or {}).items():
        columns[name] = pa.array(values, COLUMN_TYPES.get(name))
    return write_table_shard(path, pa.table(columns))


def iter_texts(paths: list[Path], batch_rows: int = 256) -> Iterator[list[str]]:
    """Documents' texts from shards, in order, ``batch_rows`` at a time."""
    for path in paths:
        pf = pq.ParquetFile(path)
        for rb in pf.iter_batches(batch_size=batch_rows, columns=["text"]):
            yield rb.column(0).to_pylist()


def iter_documents(paths: list[Path], batch_rows: int = 256) -> Iterator[tuple[list[str], list[str]]]:
    """``(ids, texts)`` of the documents in shards, in order, ``batch_rows`` at a time."""
    for path in paths:
        pf = pq.ParquetFile(path)
        for rb in pf.iter_batches(batch_size=batch_rows, columns=["id", "text"]):
            yield rb.column(0).to_pylist(), rb.column(1).to_pylist()
