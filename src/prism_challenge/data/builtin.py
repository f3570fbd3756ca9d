"""The embedded default corpus: real English text that every Python install has, offline.

Documents:
* ``pydoc-topic:<name>``: each topic of the standard library's documentation
  (``pydoc_data.topics``, about 0.47 MB);
* ``docstring:<module>``: the docstrings of one standard-library module (module, classes and
  functions, in source order), read with :mod:`ast` without importing anything.

Documents are put in a fixed pseudo-random order (by the sha256 of their id) so the stream mixes
both kinds, and written as a data directory (``MANIFEST.json``, ``train/`` and ``heldout/``
shards) under the user's cache directory on first use, through the same partition and shard code
as ``prism data prepare``. The directory is built in a temporary sibling and renamed into place,
so an interrupted build leaves nothing half-written. The text depends on the Python version, so
the directory name and the MANIFEST record it.

The builtin partition salt is public and fixed (:data:`BUILTIN_SALT`): the corpus and the code
are public anyway, so a secret would hide nothing, and a fixed salt makes the default corpus, and
its MANIFEST sha256, the same on every machine with the same Python version.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import platformdirs

from prism_challenge.data.manifest import DataError, DataManifest, load_manifest
from prism_challenge.data.prepare import build_partitioned_dir
from prism_challenge.data.sources import Source, documents_source

CORPUS_VERSION = 2
BUILTIN_SALT = hashlib.sha256(b"prism-challenge builtin corpus: public partition salt").digest()
MIN_BYTES = 1_000_000
TARGET_BYTES = 2_500_000  # enough for several default runs; about 3 s to build
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "__pycache__"}


def _pydoc_topics() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield f"pydoc-topic:{name}", text


def _module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                parts.append(doc)
    return "\n\n".join(parts)


def _stdlib_docstrings() -> Iterator[tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            text = _module_docstrings(path)
            if text:
                mod = path.relative_to(stdlib).with_suffix("").as_posix().replace("/", ".")
                yield f"docstring:{mod}", text


def builtin_documents(target_bytes: int = TARGET_BYTES) -> list[tuple[str, str]]:
    """(id, text) of the default corpus in stream order, about ``target_bytes`` UTF-8 bytes.

    Raises:
        DataError: this Python install has less than 1 MB of documentation text.
    """
    docs: list[tuple[str, str]] = []
    total = 0
    for source in (_pydoc_topics(), _stdlib_docstrings()):
        for doc_id, text in source:
            docs.append((doc_id, text))
            total += len(text.encode("utf-8"))
            if total >= target_bytes:
                break
        if total >= target_bytes:
            break
    if total < MIN_BYTES:
        raise DataError(
            f"the embedded default corpus found only {total} bytes of documentation text in this "
            f"Python install (needs {MIN_BYTES}); pass --data DIR with a prepared data directory"
        )
    docs.sort(key=lambda d: hashlib.sha256(d[0].encode()).digest())
    return docs


def builtin_dir_name() -> str:
    """Folder name of the default corpus for this Python version and corpus version."""
    impl = sys.implementation.name
    v = sys.version_info
    return f"builtin-v{CORPUS_VERSION}-{impl}{v.major}.{v.minor}.{v.micro}"


def build_data_dir(out: Path, docs: list[tuple[str, str]], source: dict) -> None:
    """Write ``docs`` (``(id, text)`` pairs, in stream order) as the train split of a data
    directory at ``out``, unpartitioned (no held-out splits, no salt).

    ``source`` is recorded as the MANIFEST's ``source``; its ``dataset`` and ``license`` keys,
    when present, also fill the top-level fields. Exact duplicate texts are kept once.

    Raises:
        DataError: ``out`` exists, or ``docs`` is empty.
    """
    src = documents_source(docs, source, dataset=source.get("dataset"), license=source.get("license"))
    build_partitioned_dir(src, out, salt=None)


def builtin_source() -> Source:
    """The default corpus as a :class:`~prism_challenge.data.sources.Source`.

    Raises:
        DataError: this Python install has too little documentation text.
    """
    docs = builtin_documents()
    info = {
        "kind": "builtin",
        "description": "Python standard-library documentation (pydoc_data.topics) and module docstrings",
        "python": sys.version.split()[0],
        "corpus_version": CORPUS_VERSION,
    }
    return documents_source(docs, info, dataset="builtin", revision=builtin_dir_name(), license="PSF-2.0")


def default_cache_root() -> Path:
    """Where PRISM caches data: ``$PRISM_CACHE_DIR`` or the platform's user cache directory."""
    env = os.environ.get("PRISM_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("prism-challenge"))


def ensure_builtin(cache_root: Path | None = None) -> Path:
    """Return the default corpus's data directory, building it atomically on first use.

    The corpus is partitioned with the public :data:`BUILTIN_SALT` into train / val / test.
    A cached copy whose shards fail verification is removed and rebuilt.

    Raises:
        DataError: the corpus cannot be built (too little text) or the cached copy is corrupt
            and cannot be rebuilt.
    """
    root = (cache_root or default_cache_root()) / "data"
    final = root / builtin_dir_name()
    if final.is_dir():
        try:
            load_manifest(final).verify_all()
            return final
        except DataError:
            shutil.rmtree(final, ignore_errors=True)  # stale or corrupt: rebuild below
    root.mkdir(parents=True, exist_ok=True)
    try:
        build_partitioned_dir(builtin_source(), final, salt=BUILTIN_SALT, extra={"salt_public": True})
    except DataError:
        if not final.is_dir():  # else: lost a race to a concurrent builder, theirs is as good
            raise
    return final


def builtin_manifest(cache_root: Path | None = None) -> DataManifest:
    """The default corpus's loaded MANIFEST (building the corpus on first use, see :func:`ensure_builtin`)."""
    return load_manifest(ensure_builtin(cache_root))
