"""The two streaming passes of :func:`prism_challenge.data.prepare.prepare` (see its module doc).

:func:`stage_source` reads the source up to the limits and stages each document, uncompressed,
in its split's file, remembering each text's BLAKE2b-128 digest with the smallest id seen for
it; :func:`write_shards` copies each split's staged documents in source order into zstd parquet
shards, keeping a text only with its winning id (exact duplicates kept once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prism_challenge.data.manifest import SPLIT_DIRS
from prism_challenge.data.partition import split_key, split_of_key
from prism_challenge.data.shards import COLUMN_TYPES, write_table_shard

_STAGE_SCHEMA = pa.schema([pa.field(n, t) for n, t in COLUMN_TYPES.items()] + [pa.field("_dig", pa.binary(16))])


class _ShardWriter:
    """Cuts a split's documents into shards ``<dir>/00000.parquet``, ``00001``, ..."""

    def __init__(self, root: Path, folder: str, shard_bytes: int, shard_docs: int):
        self.root, self.folder = root, folder
        self.shard_bytes, self.shard_docs = shard_bytes, shard_docs
        self.parts: list[pa.Table] = []
        self.docs = 0
        self.bytes = 0
        self.entries: list[dict[str, Any]] = []

    def add(self, table: pa.Table) -> None:
        lengths = pc.binary_length(table.column("text")).to_numpy(zero_copy_only=False).astype(np.int64)
        start, n = 0, table.num_rows
        while start < n:
            room = self.shard_docs - self.docs
            cum = self.bytes + np.cumsum(lengths[start : start + room])
            full = np.flatnonzero(cum >= self.shard_bytes)
            take = int(full[0]) + 1 if full.size else min(room, n - start)
            self.parts.append(table.slice(start, take))
            self.docs += take
            self.bytes += int(lengths[start : start + take].sum())
            start += take
            if self.docs >= self.shard_docs or self.bytes >= self.shard_bytes:
                self.flush()

    def flush(self) -> None:
        if not self.docs:
            return
        rel = f"{self.folder}/{len(self.entries):05d}.parquet"
        entry = write_table_shard(self.root / rel, pa.concat_tables(self.parts))
        self.entries.append({"path": rel, **entry})
        self.parts, self.docs, self.bytes = [], 0, 0

    def close(self) -> list[dict[str, Any]]:
        self.flush()
        return self.entries


def _stage_table(table: pa.Table, digests: list[bytes]) -> pa.Table:
    n = table.num_rows
    arrays = [table.column(name) if name in table.column_names else pa.nulls(n, typ) for name, typ in COLUMN_TYPES.items()]
    arrays.append(pa.array(digests, pa.binary(16)))
    return pa.Table.from_arrays(arrays, schema=_STAGE_SCHEMA)


def stage_source(source, stage, splits, salt, max_docs, max_bytes, progress) -> tuple[dict, dict, set, int, int]:
    """Pass 1: read ``source`` in order, up to the limits, and stage each document in its split's
    file under ``stage``; ``(winners, documents read per origin, columns present, documents read,
    UTF-8 bytes read)``, ``winners`` mapping each text's digest to the smallest id seen for it."""
    writers = {s: pq.ParquetWriter(stage / f"{s}.parquet", _STAGE_SCHEMA, compression="none") for s in splits}
    winners: dict[bytes, str | None] = {}
    per_origin: dict[str, int] = {}
    present: set[str] = set()
    docs_read = bytes_read = 0
    batches = source.batches()
    try:
        for batch in batches:
            table = batch.table
            n = table.num_rows
            lengths = pc.binary_length(table.column("text")).to_numpy(zero_copy_only=False).astype(np.int64)
            cut = n
            if max_docs is not None:
                cut = min(cut, max_docs - docs_read)
            if max_bytes is not None:  # stop before the document that would exceed the budget,
                cum = np.cumsum(lengths[:cut])  # or right after the one that meets it exactly
                rem = max_bytes - bytes_read
                cut = min(int(np.searchsorted(cum, rem, side="right")), int(np.searchsorted(cum, rem, side="left")) + 1)
            if cut < n:
                table, lengths = table.slice(0, cut), lengths[:cut]
            if cut:
                present.update(table.column_names)
                _stage_rows(table, salt, splits, writers, winners)
                docs_read += cut
                bytes_read += int(lengths.sum())
                per_origin[batch.origin] = per_origin.get(batch.origin, 0) + cut
                if progress is not None:
                    progress(docs_read, bytes_read)
            if cut < n or (max_docs is not None and docs_read >= max_docs) or (
                max_bytes is not None and bytes_read >= max_bytes
            ):
                break  # read no further (no more row groups, no more files)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # stop reading the source (closes open files)
        for w in writers.values():
            w.close()
    return winners, per_origin, present, docs_read, bytes_read


def _stage_rows(table: pa.Table, salt: bytes | None, splits: Sequence[str], writers: dict[str, Any],
                winners: dict[bytes, str | None]) -> None:
    """Stage one batch's documents: each text's digest kept with its smallest id in ``winners``,
    each row written to its split's staging file (all to ``train`` without a salt)."""
    ids = table.column("id").to_pylist()
    texts = pc.cast(table.column("text"), pa.binary()).to_pylist()
    digests = [hashlib.blake2b(t, digest_size=16).digest() for t in texts]
    for d, i in zip(digests, ids):
        w = winners.get(d)
        if w is None or i < w:
            winners[d] = i
    staged = _stage_table(table, digests)
    if salt is None:
        writers["train"].write_table(staged)
    else:
        names = np.array([split_of_key(split_key(salt, i)) for i in ids])
        for s in splits:
            mask = names == s
            if mask.any():
                writers[s].write_table(staged.filter(pa.array(mask)))


def write_shards(tmp, stage, splits, winners, columns, shard_bytes, shard_docs) -> tuple[dict[str, Any], int]:
    """Pass 2: per split, the staged documents copied in source order into shards under ``tmp``,
    a text kept only with its winning id (then ``winners[digest]`` is cleared); ``(split
    entries, documents kept)``."""
    split_entries: dict[str, Any] = {}
    kept = 0
    for s in splits:
        writer = _ShardWriter(tmp, SPLIT_DIRS[s], shard_bytes, shard_docs)
        pf = pq.ParquetFile(stage / f"{s}.parquet")
        for rb in pf.iter_batches(batch_size=4096):
            ids = rb.column(0).to_pylist()
            digests = rb.column(rb.num_columns - 1).to_pylist()
            keep = np.zeros(len(ids), dtype=bool)
            for k, (i, d) in enumerate(zip(ids, digests)):
                if winners.get(d) == i:
                    keep[k] = True
                    winners[d] = None  # emitted: later copies (same id and text) are duplicates
            if keep.any():
                writer.add(pa.Table.from_batches([rb]).filter(pa.array(keep)).select(columns))
        pf.close()
        shards = writer.close()
        split_entries[s] = {
            "documents": sum(e["documents"] for e in shards),
            "utf8_bytes": sum(e["utf8_bytes"] for e in shards),
            "shards": shards,
        }
        kept += split_entries[s]["documents"]
    return split_entries, kept
