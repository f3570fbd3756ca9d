"""The data MANIFEST: what a data directory holds, with the sha256 of every shard.

``DIR/MANIFEST.json`` (schema ``prism.data.v1``)::

    {
      "schema": "prism.data.v1",
      "tool": {"name": "prism-challenge", "version": "0.1.0"},
      "source": {"kind": "fineweb-edu" | "files" | "builtin", ...},   # self-describing
      "dataset": "HuggingFaceFW/fineweb-edu", "subset": "sample-10BT",
      "revision": "87f09149...",      # the resolved commit (null for local files)
      "license": "ODC-By-1.0",
      "salt_sha256": "...",           # commitment to the secret partition salt (null: no partition)
      "partition": {"method": "...", "key": "id", "buckets": {"train": 0.95, "val": 0.025, "test": 0.025}},
      "documents_read": 1661, "utf8_bytes_read": 5645890,
      "duplicates_dropped": 0,        # exact duplicate texts (kept once: the smallest id)
      "columns": ["id", "text", ...],
      "splits": {
        "train": {"documents": 123, "utf8_bytes": 456789,
                  "shards": [{"path": "train/00000.parquet", "sha256": "...",
                              "documents": 123, "utf8_bytes": 456789}]},
        "val":   {... "shards": [{"path": "heldout/val/00000.parquet", ...}]},
        "test":  {... "shards": [{"path": "heldout/test/00000.parquet", ...}]}
      }
    }

Only ``schema`` and ``splits`` (with ``train``) are required; data directories written by older
code lack the partition fields. Shard paths are relative to the data directory, POSIX style.
``documents`` counts documents, ``utf8_bytes`` their UTF-8 text bytes. The sha256 of the MANIFEST
file itself identifies the data in a run manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "prism.data.v1"
MANIFEST_NAME = "MANIFEST.json"
# Where each split's shards live inside a data directory.
SPLIT_DIRS = {"train": "train", "val": "heldout/val", "test": "heldout/test"}


class DataError(RuntimeError):
    """The data directory is missing, malformed, or a shard fails verification (named)."""


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class DataManifest:
    """A loaded data MANIFEST.

    Attributes:
        root: the data directory.
        data: the parsed JSON.
        sha256: hex sha256 of the MANIFEST.json bytes.
    """

    root: Path
    data: dict[str, Any]
    sha256: str

    def split(self, name: str) -> dict[str, Any]:
        """The entry of split ``name``.

        Raises:
            DataError: the split is not in the MANIFEST.
        """
        try:
            return self.data["splits"][name]
        except KeyError:
            raise DataError(f"{self.root / MANIFEST_NAME}: no split {name!r}") from None

    @property
    def split_names(self) -> list[str]:
        """Names of the splits in the MANIFEST: ``train``, ``val``, ``test``, then any others."""
        names = list(self.data["splits"])
        known = [n for n in SPLIT_DIRS if n in names]
        return known + [n for n in names if n not in SPLIT_DIRS]

    def shards(self, split: str) -> list[dict[str, Any]]:
        """The MANIFEST entries of a split's shards, in stream order."""
        return list(self.split(split)["shards"])

    def shard_paths(self, split: str) -> list[Path]:
        """Absolute paths of a split's shards, in stream order."""
        return [self.root / s["path"] for s in self.split(split)["shards"]]

    def documents(self, split: str) -> int:
        """Number of documents in ``split`` (summed over its shards when not recorded)."""
        entry = self.split(split)
        if "documents" in entry:
            return int(entry["documents"])
        return sum(int(s.get("documents", 0)) for s in entry["shards"])

    def utf8_bytes(self, split: str) -> int:
        """UTF-8 bytes of text in ``split`` (summed over its shards when not recorded)."""
        entry = self.split(split)
        if "utf8_bytes" in entry:
            return int(entry["utf8_bytes"])
        return sum(int(s.get("utf8_bytes", 0)) for s in entry["shards"])

    @property
    def salt_sha256(self) -> str | None:
        """The partition salt's commitment (hex sha256), or None when not partitioned."""
        return self.data.get("salt_sha256")

    def check_salt(self, salt: bytes) -> None:
        """Check ``salt`` is the one this data directory was partitioned with.

        Raises:
            DataError: the MANIFEST has no salt commitment, or ``sha256(salt)`` differs from it.
        """
        recorded = self.salt_sha256
        if not recorded:
            raise DataError(f"{self.root / MANIFEST_NAME}: records no salt commitment")
        if hashlib.sha256(salt).hexdigest() != recorded:
            raise DataError(
                f"{self.root / MANIFEST_NAME}: the salt does not match salt_sha256 {recorded}"
            )

    def verify_shard(self, shard: dict[str, Any]) -> None:
        """Check one shard entry: the file exists and its sha256 matches.

        Raises:
            DataError: naming the shard's path, when it is missing or its sha256 differs.
        """
        path = self.root / shard["path"]
        if not path.is_file():
            raise DataError(f"{path}: shard listed in {MANIFEST_NAME} is missing")
        digest = sha256_file(path)
        if digest != shard["sha256"]:
            raise DataError(
                f"{path}: sha256 {digest} does not match {MANIFEST_NAME} ({shard['sha256']})"
            )

    def verify(self, split: str) -> None:
        """Check every shard of ``split`` exists and matches its recorded sha256.

        Reads every byte of the split once (about 1 GB/s).

        Raises:
            DataError: naming the first missing or mismatching shard.
        """
        for shard in self.split(split)["shards"]:
            self.verify_shard(shard)

    def verify_all(self) -> None:
        """Verify every shard of every split (see :meth:`verify`).

        Raises:
            DataError: naming the first missing or mismatching shard.
        """
        for name in self.split_names:
            self.verify(name)


def load_manifest(root: str | os.PathLike[str]) -> DataManifest:
    """Read and validate ``root/MANIFEST.json``.

    Raises:
        DataError: no such directory or file, invalid JSON, wrong schema, or a field missing.
    """
    root = Path(root)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{path}: data MANIFEST not found (is {root} a prepared data directory?)")
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise DataError(f"{path}: field 'schema' must be {SCHEMA!r}")
    splits = data.get("splits")
    if not isinstance(splits, dict) or "train" not in splits:
        raise DataError(f"{path}: field 'splits' must hold a 'train' split")
    for name, entry in splits.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            raise DataError(f"{path}: split {name!r} must have a 'shards' list")
        for i, shard in enumerate(entry["shards"]):
            if not isinstance(shard, dict) or not {"path", "sha256"} <= set(shard):
                raise DataError(f"{path}: splits.{name}.shards[{i}] needs 'path' and 'sha256'")
            if not isinstance(shard["path"], str) or not isinstance(shard["sha256"], str):
                raise DataError(f"{path}: splits.{name}.shards[{i}].path and .sha256 must be strings")
            rel = Path(shard["path"])
            if rel.is_absolute() or ".." in rel.parts:
                raise DataError(f"{path}: splits.{name}.shards[{i}].path must stay inside {root}")
    return DataManifest(root, data, hashlib.sha256(raw).hexdigest())


def manifest_bytes(data: dict[str, Any]) -> bytes:
    """The exact bytes :func:`write_manifest` writes for ``data`` (sorted keys, indent 2, newline)."""
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_manifest(root: Path, data: dict[str, Any]) -> None:
    """Write ``root/MANIFEST.json`` (sorted keys, trailing newline: byte-stable)."""
    (root / MANIFEST_NAME).write_bytes(manifest_bytes(data))
