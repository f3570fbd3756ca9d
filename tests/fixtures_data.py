"""Small FineWeb-Edu-schema fixtures for the data-plane tests (no conftest magic: import it)."""

from __future__ import annotations

import gzip
import hashlib
import hmac
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

SALT_HEX = "5a" * 32
OTHER_SALT_HEX = "a5" * 32
COMMIT = "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9"

# The column order and Arrow types of the real FineWeb-Edu parquet files.
FINEWEB_EDU_SCHEMA = pa.schema(
    [
        ("text", pa.string()),
        ("id", pa.string()),
        ("dump", pa.string()),
        ("url", pa.string()),
        ("file_path", pa.string()),
        ("language", pa.string()),
        ("language_score", pa.float64()),
        ("token_count", pa.int64()),
        ("score", pa.float64()),
        ("int_score", pa.int64()),
    ]
)

_WORDS = (
    "the of and to in is was for on that with as by it from at be this are an or which his "
    "learning students energy water cells history climate school teacher river garden protein "
    "naïve café façade résumé Ελληνικά русский 日本語 中文 한국어 emoji 🙂🚀 ½ € — “quoted” ‘x’"
).split()


def make_text(rng: random.Random, words: int) -> str:
    """A pseudo-random paragraph mixing ASCII and multi-byte UTF-8 (2-, 3- and 4-byte chars)."""
    out = []
    for i in range(words):
        out.append(rng.choice(_WORDS))
        if i % 17 == 16:
            out.append("\n")
    return " ".join(out).replace(" \n ", "\n")


def make_rows(n: int, seed: int = 0, duplicates: int = 0, words: tuple[int, int] = (5, 120)) -> list[dict]:
    """``n`` FineWeb-Edu rows of ``words`` words each (a range); the last ``duplicates`` of them
    repeat earlier texts under new ids."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        uid = hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()
        text = make_text(rng, rng.randint(*words))
        if i >= n - duplicates:
            text = rows[rng.randrange(0, n - duplicates)]["text"]
        score = round(rng.uniform(2.5, 5.0), 4)
        rows.append(
            {
                "text": text,
                "id": f"<urn:uuid:{uid[:8]}-{uid[8:12]}-{uid[12:16]}-{uid[16:20]}-{uid[20:32]}>",
                "dump": "CC-MAIN-2024-10",
                "url": f"https://example.org/{seed}/{i}",
                "file_path": f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/segments/{i}.warc.gz",
                "language": "en",
                "language_score": round(rng.uniform(0.65, 1.0), 6),
                "token_count": rng.randint(10, 500),
                "score": score,
                "int_score": int(round(score)),
            }
        )
    return rows


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 64) -> Path:
    """Write rows with the real FineWeb-Edu schema (column order and types)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=FINEWEB_EDU_SCHEMA)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write rows as JSON lines; ``.gz`` and ``.zst`` suffixes compress."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)
    return path


def make_hub_tree(root: Path, files: list[list[dict]], row_group_size: int = 32) -> Path:
    """A directory laid out like the HuggingFaceFW/fineweb-edu repo: sample/10BT/NNN_00000.parquet."""
    (root / "README.md").parent.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("---\nlicense: odc-by\n---\n# FineWeb-Edu (test mirror)\n")
    for i, rows in enumerate(files):
        write_parquet(root / "sample" / "10BT" / f"{i:03d}_00000.parquet", rows, row_group_size)
    # another subset, to check only the requested folder is read
    write_parquet(root / "sample" / "100BT" / "000_00000.parquet", make_rows(5, seed=99), row_group_size)
    return root


def expected_split(salt_hex: str, doc_id: str) -> str:
    """The split, computed from the issue's definition (independent of the package)."""
    digest = hmac.new(bytes.fromhex(salt_hex), doc_id.encode("utf-8"), hashlib.sha256).digest()
    x = int.from_bytes(digest[:8], "big") / 2**64
    return "train" if x < 0.95 else ("val" if x < 0.975 else "test")


def expected_kept(rows: list[dict]) -> dict[str, dict]:
    """id -> row of the documents kept after exact-duplicate removal (smallest id per text)."""
    best: dict[str, dict] = {}
    for r in rows:
        cur = best.get(r["text"])
        if cur is None or r["id"] < cur["id"]:
            best[r["text"]] = r
    return {r["id"]: r for r in best.values()}


def write_salt(path: Path, salt_hex: str = SALT_HEX) -> Path:
    """A salt file holding ``salt_hex``."""
    path.write_text(salt_hex + "\n")
    path.chmod(0o600)
    return path


def read_split_rows(manifest, split: str) -> list[dict]:
    """All rows of a split's shards, in order, read with pyarrow directly."""
    rows: list[dict] = []
    for s in manifest.data["splits"][split]["shards"]:
        rows.extend(pq.read_table(manifest.root / s["path"]).to_pylist())
    return rows
