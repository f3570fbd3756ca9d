"""The locked data plane: data directories, their MANIFEST, and the token streams.

A data directory holds ``MANIFEST.json`` and one folder of parquet shards per split
(``train/``; held-out splits under ``heldout/val/`` and ``heldout/test/``). The trusted side alone
reads it; submitted code only ever sees batches handed out by the feeder.

Modules: :mod:`.manifest` (MANIFEST, verification), :mod:`.partition` (secret-salted split),
:mod:`.sources` (local files, FineWeb-Edu on the Hub), :mod:`.prepare` (building a directory),
:mod:`.shards` (parquet), :mod:`.builtin` (offline default corpus), :mod:`.cache` (token cache),
:mod:`.stream` (train and held-out token streams), :mod:`.cli` (``prism data``).

The names below are importable from this package; submodules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataError": "manifest",
    "DataManifest": "manifest",
    "load_manifest": "manifest",
    "split_of": "partition",
    "salt_commitment": "partition",
    "prepare": "prepare",
    "PrepareResult": "prepare",
    "build_partitioned_dir": "prepare",
    "ensure_builtin": "builtin",
    "TokenCache": "cache",
    "TokenCacheError": "cache",
    "ensure_token_cache": "cache",
    "open_token_cache": "cache",
    "token_cache_dir": "cache",
    "TokenChunk": "stream",
    "iter_token_chunks": "stream",
    "train_stream": "stream",
    "heldout_stream": "stream",
    "verify_split": "stream",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
