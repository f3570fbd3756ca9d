"""Where documents come from: local files, the pinned FineWeb-Edu repository, or a list in memory.

A :class:`Source` yields :class:`SourceBatch` es: Arrow tables with non-null string ``id`` and
``text`` columns and whichever other FineWeb-Edu columns (:data:`~prism_challenge.data.shards.COLUMN_TYPES`)
the source has, cast to their fixed types. Unknown columns are dropped (their names are recorded).
Batches are produced lazily, so a consumer that stops early reads no further: for parquet,
row groups are read one at a time, in order, and only while they are needed.

FineWeb-Edu is read from the Hugging Face Hub through ``huggingface_hub.HfFileSystem`` at a pinned
commit; :func:`mirror_repo` points the same reading code at a local directory laid out like the
Hub repo (the repo tree itself, or a ``huggingface_hub`` cache folder with ``refs/`` and
``snapshots/``).
"""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prism_challenge.data.manifest import DataError, sha256_file
from prism_challenge.data.shards import COLUMN_TYPES, REQUIRED_COLUMNS

FINEWEB_EDU_REPO = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_REVISION = "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9"
FINEWEB_EDU_LICENSE = "ODC-By-1.0"
FINEWEB_EDU_SUBSET = "sample-10BT"
BATCH_ROWS = 1024
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst")

_SHA_RE = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class SourceBatch:
    """Consecutive documents of one source file.

    Attributes:
        table: ``id`` and ``text`` (string, non-null) first, then known columns the file has.
        origin: the file's name as the MANIFEST records it (a basename, or a path in the repo).
        first_row: 1-based row (parquet) or line (jsonl) number of the batch's first document.
    """

    table: pa.Table
    origin: str
    first_row: int


@dataclass
class Source:
    """A stream of documents and what the MANIFEST says about where they came from.

    Attributes:
        kind: ``files``, ``fineweb-edu`` or ``builtin``.
        batches: a function returning a fresh iterator of :class:`SourceBatch`.
        info: the MANIFEST's ``source`` entry (self-describing, JSON-serializable).
        dataset, subset, revision, license: the MANIFEST's top-level fields (None when unknown).
        file_info: per origin, extra facts recorded next to its document count (e.g. sha256).
        dropped_columns: names of unknown columns seen and dropped (filled while reading).
    """

    kind: str
    batches: Callable[[], Iterator[SourceBatch]]
    info: dict[str, Any]
    dataset: str | None = None
    subset: str | None = None
    revision: str | None = None
    license: str | None = None
    file_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped_columns: set[str] = field(default_factory=set)


# ---------------------------------------------------------------------------------------------
# Parquet


def _first_null(arr: pa.ChunkedArray) -> int:
    mask = pc.is_null(arr).to_numpy(zero_copy_only=False)
    return int(mask.argmax())


def conform_table(table: pa.Table, origin: str, first_row: int, dropped: set[str]) -> pa.Table:
    """Select and cast the known columns of ``table`` (``id``, ``text`` first).

    Raises:
        DataError: ``id`` or ``text`` is missing or null (file and row named), or a column
            cannot be cast to its FineWeb-Edu type.
    """
    names = table.column_names
    for req in REQUIRED_COLUMNS:
        if req not in names:
            raise DataError(f"{origin}: no {req!r} column (need 'id' and 'text'; has {', '.join(names)})")
    dropped.update(n for n in names if n not in COLUMN_TYPES)
    arrays, fields = [], []
    for name, typ in COLUMN_TYPES.items():
        if name not in names:
            continue
        col = table.column(name)
        if col.type != typ:
            try:
                col = pc.cast(col, typ)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise DataError(f"{origin}: column {name!r} of type {table.schema.field(name).type} "
                                f"cannot be read as {typ} ({exc})") from None
        if name in REQUIRED_COLUMNS and col.null_count:
            raise DataError(f"{origin}: row {first_row + _first_null(col)}: {name!r} is null")
        arrays.append(col)
        fields.append(pa.field(name, typ))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def parquet_columns(schema_names: Sequence[str]) -> list[str]:
    """The columns of a parquet file that are worth reading (the known ones it has)."""
    return [c for c in schema_names if c in COLUMN_TYPES]


def iter_parquet(
    file: str | Path | IO[bytes], origin: str, dropped: set[str], batch_rows: int = BATCH_ROWS
) -> Iterator[SourceBatch]:
    """Documents of one parquet file (a path or an open binary file, e.g. from fsspec).

    Row groups are read one at a time, only the known columns, and only as far as the consumer
    iterates.

    Raises:
        DataError: the file is not parquet, or lacks ``id`` / ``text`` (see :func:`conform_table`).
    """
    try:
        pf = pq.ParquetFile(file)
    except Exception as exc:  # ArrowInvalid, OSError, or the remote filesystem's errors
        raise DataError(f"{origin}: not a readable parquet file ({exc})") from None
    names = pf.schema_arrow.names
    for req in REQUIRED_COLUMNS:
        if req not in names:
            raise DataError(f"{origin}: no {req!r} column (need 'id' and 'text'; has {', '.join(names)})")
    dropped.update(n for n in names if n not in COLUMN_TYPES)
    columns = parquet_columns(names)
    row = 1
    for rg in range(pf.num_row_groups):
        try:
            table = pf.read_row_group(rg, columns=columns)
        except Exception as exc:  # ArrowInvalid, OSError, or the remote filesystem's errors
            raise DataError(f"{origin}: row group {rg} cannot be read ({exc})") from None
        for start in range(0, table.num_rows, batch_rows):
            part = table.slice(start, batch_rows)
            yield SourceBatch(conform_table(part, origin, row, dropped), origin, row)
            row += part.num_rows


# ---------------------------------------------------------------------------------------------
# JSON lines


def _open_lines(path: Path) -> IO[bytes]:
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


def _column_array(values: list[Any], typ: pa.DataType, name: str, origin: str, lines: list[int]) -> pa.Array:
    try:
        return pa.array(values, typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, UnicodeError):
        pass
    for value, line in zip(values, lines):  # find the culprit to name it
        try:
            pa.array([value], typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, UnicodeError):
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise DataError(f"{origin}:{line}: field {name!r}: {shown} is not a valid {typ}") from None
    raise DataError(f"{origin}: field {name!r} cannot be read as {typ}")  # pragma: no cover


def _jsonl_batch(rows: list[dict], lines: list[int], origin: str, dropped: set[str]) -> pa.Table:
    present: list[str] = []
    seen: set[str] = set()
    for obj in rows:
        for key in obj:
            if key not in seen:
                seen.add(key)
                if key in COLUMN_TYPES:
                    present.append(key)
                else:
                    dropped.add(key)
    arrays, fields = [], []
    for name, typ in COLUMN_TYPES.items():
        if name not in seen:
            continue
        values = [obj.get(name) for obj in rows]
        if typ == pa.float64() or typ == pa.int64():
            for value, line in zip(values, lines):
                if isinstance(value, bool) or not (value is None or isinstance(value, (int, float))):
                    raise DataError(f"{origin}:{line}: field {name!r} must be a number, got {type(value).__name__}")
                if typ == pa.int64() and isinstance(value, float):
                    if not value.is_integer():
                        raise DataError(f"{origin}:{line}: field {name!r} must be an integer, got {value!r}")
            if typ == pa.int64():
                values = [int(v) if isinstance(v, float) else v for v in values]
        elif typ == pa.string():
            for value, line in zip(values, lines):
                if value is not None and not isinstance(value, str):
                    raise DataError(f"{origin}:{line}: field {name!r} must be a string, got {type(value).__name__}")
        arrays.append(_column_array(values, typ, name, origin, lines))
        fields.append(pa.field(name, typ))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def iter_jsonl(path: Path, dropped: set[str], batch_rows: int = BATCH_ROWS, origin: str | None = None) -> Iterator[SourceBatch]:
    """Documents of a ``.jsonl``, ``.jsonl.gz`` or ``.jsonl.zst`` file, one JSON object a line.

    Blank lines are skipped. Line numbers in errors count from 1.

    Raises:
        DataError: the file cannot be read or decompressed, a line is not UTF-8 or not a JSON
            object, ``id`` or ``text`` is missing or not a string, or a known field has the wrong
            type; always naming the file and line.
    """
    path = Path(path)
    origin = origin or path.name
    rows: list[dict] = []
    lines: list[int] = []
    lineno = 0
    try:
        with _open_lines(path) as f:
            for raw in f:
                lineno += 1
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except UnicodeDecodeError:
                    raise DataError(f"{origin}:{lineno}: not valid UTF-8") from None
                except json.JSONDecodeError as exc:
                    raise DataError(f"{origin}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{origin}:{lineno}: expected a JSON object, got {type(obj).__name__}")
                for req in REQUIRED_COLUMNS:
                    value = obj.get(req)
                    if value is None:
                        raise DataError(f"{origin}:{lineno}: missing field {req!r}")
                    if not isinstance(value, str):
                        raise DataError(f"{origin}:{lineno}: field {req!r} must be a string, got {type(value).__name__}")
                rows.append(obj)
                lines.append(lineno)
                if len(rows) == batch_rows:
                    yield SourceBatch(_jsonl_batch(rows, lines, origin, dropped), origin, lines[0])
                    rows, lines = [], []
    except DataError:
        raise
    except (OSError, EOFError, ValueError) as exc:  # gzip / zstd / io errors
        where = f"{origin}:{lineno + 1}" if lineno else origin
        raise DataError(f"{where}: cannot read ({exc})") from None
    if rows:
        yield SourceBatch(_jsonl_batch(rows, lines, origin, dropped), origin, lines[0])


# ---------------------------------------------------------------------------------------------
# Local files


def expand_local_paths(paths: Sequence[str | Path]) -> list[Path]:
    """The source files named by ``paths``: files as given (in order), directories expanded to
    their supported files (recursively, sorted by relative path).

    Raises:
        DataError: a path does not exist, a file has an unsupported suffix, a directory holds no
            supported file, or two files share a base name (the MANIFEST names files by base name).
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(
                (f for f in p.rglob("*") if f.is_file() and f.name.endswith(LOCAL_SUFFIXES)),
                key=lambda f: f.relative_to(p).as_posix(),
            )
            if not found:
                raise DataError(f"{p}: no {', '.join(LOCAL_SUFFIXES)} files in this directory")
            files.extend(found)
        elif p.is_file():
            if not p.name.endswith(LOCAL_SUFFIXES):
                raise DataError(f"{p}: unsupported source file (use {', '.join(LOCAL_SUFFIXES)})")
            files.append(p)
        else:
            raise DataError(f"{p}: no such source file or directory")
    names: dict[str, Path] = {}
    for f in files:
        if f.name in names:
            raise DataError(f"{f}: same file name as {names[f.name]}; rename one")
        names[f.name] = f
    return files


def local_source(paths: Sequence[str | Path], *, dataset: str | None = None, license: str | None = None) -> Source:
    """A source reading local parquet / jsonl / jsonl.gz / jsonl.zst files in the FineWeb-Edu schema.

    Files are read in the order :func:`expand_local_paths` gives; rows in file order.

    Raises:
        DataError: see :func:`expand_local_paths`.
    """
    files = expand_local_paths(paths)
    src = Source(
        kind="files",
        batches=lambda: iter(()),
        info={"kind": "files"},
        dataset=dataset,
        license=license,
    )
    for f in files:
        src.file_info[f.name] = {"sha256": sha256_file(f), "size": f.stat().st_size}

    def batches() -> Iterator[SourceBatch]:
        for f in files:
            if f.name.endswith(".parquet"):
                yield from iter_parquet(f, f.name, src.dropped_columns)
            else:
                yield from iter_jsonl(f, src.dropped_columns)

    src.batches = batches
    return src


def documents_source(docs: Sequence[tuple[str, str]], info: dict[str, Any], *, dataset: str | None = None,
                     revision: str | None = None, license: str | None = None, origin: str = "documents") -> Source:
    """A source over ``(id, text)`` pairs held in memory (the builtin corpus uses it)."""

    def batches() -> Iterator[SourceBatch]:
        for start in range(0, len(docs), BATCH_ROWS):
            part = docs[start : start + BATCH_ROWS]
            table = pa.table({"id": pa.array([d[0] for d in part], pa.string()),
                              "text": pa.array([d[1] for d in part], pa.string())})
            yield SourceBatch(table, origin, start + 1)

    return Source(kind=info.get("kind", "documents"), batches=batches, info=dict(info), dataset=dataset,
                  revision=revision, license=license)


# ---------------------------------------------------------------------------------------------
# FineWeb-Edu on the Hub (or a local mirror of it)


@dataclass(frozen=True)
class RepoView:
    """A dataset repository at one commit, seen through an fsspec filesystem.

    Attributes:
        fs: the filesystem (``HfFileSystem`` for the Hub, a local one for a mirror).
        root: the repo root at the commit, as a path of ``fs``.
        revision: the commit (40 hex digits) recorded in the MANIFEST.
        location: where it is, for messages (``hf://datasets/...@sha`` or a local path).
    """

    fs: Any
    root: str
    revision: str
    location: str


def is_commit(revision: str) -> bool:
    """Whether ``revision`` is a full 40-hex-digit commit id (not a moving branch or tag name)."""
    return bool(_SHA_RE.fullmatch(revision))


def subset_dir(subset: str) -> str:
    """The folder of a FineWeb-Edu subset in the repo: ``sample-10BT`` -> ``sample/10BT``,
    ``CC-MAIN-2024-10`` -> ``data/CC-MAIN-2024-10``.

    Raises:
        DataError: not a subset name of either form.
    """
    m = re.fullmatch(r"sample-(\d+BT)", subset)
    if m:
        return f"sample/{m.group(1)}"
    if re.fullmatch(r"CC-MAIN-\d{4}-\d{2}", subset):
        return f"data/{subset}"
    raise DataError(f"unknown FineWeb-Edu subset {subset!r} (use sample-10BT, sample-100BT, sample-350BT or CC-MAIN-YYYY-WW)")


def _unpinned_error(revision: str) -> DataError:
    return DataError(
        f"revision {revision!r} is a moving name, not a commit: pass a 40-hex-digit commit "
        f"(default {FINEWEB_EDU_REVISION}) or --allow-unpinned to resolve it and record the commit"
    )


def hub_repo(
    repo_id: str = FINEWEB_EDU_REPO,
    revision: str = FINEWEB_EDU_REVISION,
    *,
    allow_unpinned: bool = False,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> RepoView:
    """The dataset ``repo_id`` on the Hugging Face Hub at a pinned commit, via ``HfFileSystem``.

    A commit id needs no network call here. A branch or tag name is resolved to its current
    commit with ``HfApi.dataset_info`` only when ``allow_unpinned`` is set.

    Raises:
        DataError: ``revision`` is not a commit and ``allow_unpinned`` is not set, or resolving
            it fails (network, unknown repo or revision).
    """
    from huggingface_hub import HfApi, HfFileSystem

    if not is_commit(revision):
        if not allow_unpinned:
            raise _unpinned_error(revision)
        try:
            sha = HfApi(endpoint=endpoint, token=token).dataset_info(repo_id, revision=revision).sha
        except Exception as exc:  # network errors, RepositoryNotFound, RevisionNotFound ...
            raise DataError(f"hf://datasets/{repo_id}: cannot resolve revision {revision!r} ({exc})") from None
        if not sha or not is_commit(sha):
            raise DataError(f"hf://datasets/{repo_id}: revision {revision!r} resolved to no commit")
        revision = sha
    fs = HfFileSystem(endpoint=endpoint, token=token)
    root = f"datasets/{repo_id}@{revision}"
    return RepoView(fs, root, revision, f"hf://{root}")


def mirror_repo(path: str | Path, revision: str = FINEWEB_EDU_REVISION, *, allow_unpinned: bool = False) -> RepoView:
    """A local directory laid out like the Hub repo, read with a local fsspec filesystem.

    Two layouts: a ``huggingface_hub`` cache folder (``refs/<branch>`` holding a commit,
    ``snapshots/<commit>/`` holding the repo tree), where branch names resolve through ``refs/``
    as on the Hub; or the repo tree itself, which is taken to be at ``revision`` (a commit).

    Raises:
        DataError: the directory or the commit's snapshot is missing, ``revision`` is a branch
            name without ``allow_unpinned``, or a plain tree is given a branch name.
    """
    import fsspec

    base = Path(path).resolve()
    if not base.is_dir():
        raise DataError(f"{path}: no such mirror directory")
    if (base / "snapshots").is_dir():
        if not is_commit(revision):
            if not allow_unpinned:
                raise _unpinned_error(revision)
            ref = base / "refs" / revision
            if not ref.is_file():
                raise DataError(f"{base}: mirror has no ref {revision!r} (refs/{revision})")
            revision = ref.read_text().strip()
            if not is_commit(revision):
                raise DataError(f"{ref}: does not hold a commit id")
        root = base / "snapshots" / revision
        if not root.is_dir():
            raise DataError(f"{base}: mirror holds no snapshot of commit {revision}")
    else:
        if not is_commit(revision):
            raise (_unpinned_error(revision) if not allow_unpinned else DataError(
                f"{base}: a plain mirror cannot resolve {revision!r}; give the commit it holds"))
        root = base
    return RepoView(fsspec.filesystem("file"), root.as_posix(), revision, str(root))


def list_subset_files(repo: RepoView, subset: str) -> list[str]:
    """Paths (in ``repo.fs``) of the subset's parquet files, sorted by name.

    Raises:
        DataError: the subset folder holds no parquet file.
    """
    folder = subset_dir(subset)
    try:
        found = repo.fs.glob(f"{repo.root}/{folder}/*.parquet")
    except FileNotFoundError:
        found = []
    except Exception as exc:  # network errors, unknown repo or revision
        raise DataError(f"{repo.location}: cannot list {folder}/ ({exc})") from None
    if not found:
        raise DataError(f"{repo.location}: no parquet files in {folder}/")
    return sorted(found, key=lambda p: p.rsplit("/", 1)[-1])


def fineweb_edu_source(repo: RepoView, subset: str = FINEWEB_EDU_SUBSET, *, repo_id: str = FINEWEB_EDU_REPO,
                       license: str = FINEWEB_EDU_LICENSE) -> Source:
    """A source reading a FineWeb-Edu subset's parquet files from ``repo``, in file-name order.

    The files are opened through ``repo.fs`` (remote reads are ranged: the footer, then each row
    group as it is needed); nothing is downloaded whole.

    Raises:
        DataError: unknown subset or no files (listing happens when the batches are iterated).
    """
    folder = subset_dir(subset)
    src = Source(
        kind="fineweb-edu",
        batches=lambda: iter(()),
        info={"kind": "fineweb-edu", "repo": f"datasets/{repo_id}", "folder": folder},
        dataset=repo_id,
        subset=subset,
        revision=repo.revision,
        license=license,
    )

    def batches() -> Iterator[SourceBatch]:
        for path in list_subset_files(repo, subset):
            origin = path[len(repo.root) + 1 :] if path.startswith(repo.root + "/") else path.rsplit("/", 1)[-1]
            try:
                f = repo.fs.open(path, "rb")
            except Exception as exc:  # fsspec / hub errors
                raise DataError(f"{repo.location}/{origin}: cannot open ({exc})") from None
            with f:
                yield from iter_parquet(f, origin, src.dropped_columns)

    src.batches = batches
    return src
