"""Bundle intake: locate a submission's two scripts and hash what will run.

A bundle is a directory (or a ``.zip`` of one, see :func:`extract_zip`) holding ``architecture.py`` (exposing ``build_model(ctx)``) and
``training.py`` (exposing ``train(ctx)``). An optional ``prism.yaml`` may declare::

    architecture:
      entrypoint: architecture.py:build_model   # or a mapping {file:, symbol:}
    training:
      entrypoint: training.py:train
    tokenizer: gpt2                              # or "bytes"
    scoring_autocast: bf16                       # or "fp16", "fp32" (no autocast); default: the profile's

Declared names are honoured exactly. The two entrypoints must be distinct files.

Intake rules (:func:`check_tree`, :func:`extract_zip`) refuse a bundle before the gates read
its source: only UTF-8 text files of the bundle's kinds (``.py``, ``.md``, ``.txt``,
``prism.yaml``; no NUL byte, no ``__pycache__``: see :mod:`prism_challenge.intake.bundlefiles`), ``.py``
paths made of identifiers, no top-level module or code folder named like a module importable
from elsewhere, no symlinks or special files, a cap on member count and on total source size,
and for archives no absolute or parent-relative member names, nothing resolving outside the
target, no duplicates and no zip bombs. A refusal is a :class:`BundleError` whose ``rule`` is a
stable id such as ``prism:zip-symlink``.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import stat
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from prism_challenge import scratch
from prism_challenge.intake.bundlefiles import (  # ALLOWED_SUFFIXES: re-exported
    ALLOWED_SUFFIXES,  # noqa: F401
    BYTECODE_DIR,
    Problem,
    kind_problem,
    module_name_problem,
    name_problem,
    shadow_problem,
    text_problem,
)

SPEC_FILE = "prism.yaml"
DEFAULT_ARCHITECTURE = ("architecture.py", "build_model")
DEFAULT_TRAINING = ("training.py", "train")
DEFAULT_TOKENIZER = "gpt2"
SCORING_AUTOCAST = ("fp32", "bf16", "fp16")
"""``scoring_autocast`` values: the dtype the harness's scoring forwards run under
``torch.autocast`` (stream, probes, held-out, audit); ``fp32`` is no autocast. Not declared: the
profile's ``[scoring] autocast`` (``EvalOptions.scoring_autocast``)."""
DEFAULT_SCORING_AUTOCAST = None


SKIPPED_DIRS = frozenset({BYTECODE_DIR})
"""Directory names :func:`hash_tree` and the copy helpers skip; :func:`check_tree` refuses them
(``prism:bytecode``), so a bundle that passed intake has none."""


class BundleError(ValueError):
    """A bundle cannot be read: the message names the file and the rule broken.

    Attributes:
        rule: stable rule id (``prism:...``) of the broken intake rule; ``prism:bundle`` when the
            raiser did not name one.
        line: 1-based line of the problem in the file the message names (``prism.yaml``), or 0.
    """

    def __init__(self, message: str, rule: str = "prism:bundle", line: int = 0) -> None:
        super().__init__(message)
        self.rule = rule
        self.line = line


@dataclass(frozen=True)
class IntakeLimits:
    """Limits applied at intake, before any source is read.

    Attributes:
        max_files: most regular files (zip: members, directories included) in a bundle.
        max_source_bytes: cap on the summed size of all bundle files in bytes (default 512 KiB:
            large literal tables are a way to smuggle pretrained knowledge).
        max_archive_bytes: cap on the summed *declared* uncompressed size of a zip's members.
        max_ratio: largest uncompressed/compressed size ratio of one zip member ...
        ratio_floor_bytes: ... checked for members whose uncompressed size exceeds this.
    """

    max_files: int = 256
    max_source_bytes: int = 512 * 1024
    max_archive_bytes: int = 4 * 1024 * 1024
    max_ratio: float = 100.0
    ratio_floor_bytes: int = 1024


@dataclass(frozen=True)
class Entrypoint:
    """A ``file:symbol`` pair inside the bundle (``file`` relative to the bundle root)."""

    file: str
    symbol: str

    @property
    def module(self) -> str:
        """Import name of the file (its path without ``.py``, dots for separators)."""
        return self.file[: -len(".py")].replace("/", ".")


@dataclass(frozen=True)
class Bundle:
    """A located bundle: its root, entrypoints, tokenizer and the sha256 of every file.

    ``file_hashes`` maps each bundle-relative path to its sha256 hex digest; ``sha256`` is the
    digest of the sorted ``path\\0digest\\n`` lines, so it changes when any file changes.
    """

    root: Path
    architecture: Entrypoint
    training: Entrypoint
    tokenizer: str
    file_hashes: dict[str, str] = field(default_factory=dict)
    scoring_autocast: str | None = DEFAULT_SCORING_AUTOCAST  # None: not declared (the profile's applies)

    @property
    def sha256(self) -> str:
        """Digest of the whole bundle (hex), from the per-file digests."""
        h = hashlib.sha256()
        for rel in sorted(self.file_hashes):
            h.update(f"{rel}\0{self.file_hashes[rel]}\n".encode())
        return h.hexdigest()


def _spec_error(message: str, line: int = 0) -> BundleError:
    return BundleError(message, rule="prism:spec", line=line)


def _yaml_error(exc: yaml.YAMLError) -> BundleError:
    """One line for PyYAML's multi-line error: ``prism.yaml line N: not valid YAML: <problem>``."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return _spec_error(f"{SPEC_FILE}: not valid YAML: {' '.join(str(exc).split())}")
    line = mark.line + 1
    message = f"{SPEC_FILE} line {line}: not valid YAML: {' '.join(str(problem).split())}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None and context_mark.line != mark.line:
        message += f" ({' '.join(str(context).split())} from line {context_mark.line + 1})"
    return _spec_error(message, line)


def _parse_entrypoint(spec: object, default: tuple[str, str], where: str) -> Entrypoint:
    if spec is None:
        return Entrypoint(*default)
    if isinstance(spec, str):
        file, _, symbol = spec.partition(":")
        symbol = symbol or default[1]
    elif isinstance(spec, dict):
        file = spec.get("file", default[0])
        symbol = spec.get("symbol", default[1])
    else:
        raise _spec_error(f"{SPEC_FILE}: field '{where}' must be 'file.py:symbol' or a mapping")
    if not isinstance(file, str) or not isinstance(symbol, str):
        raise _spec_error(f"{SPEC_FILE}: field '{where}' must name a file and a symbol as strings")
    if not file.endswith(".py") or file.startswith("/") or ".." in Path(file).parts:
        raise _spec_error(
            f"{SPEC_FILE}: field '{where}' must name a .py file inside the bundle, got {file!r}"
        )
    if not all(part.isidentifier() for part in file[: -len(".py")].split("/")):
        raise _spec_error(
            f"{SPEC_FILE}: field '{where}' file {file!r} is not an importable module path"
        )
    if not symbol.isidentifier():
        raise _spec_error(f"{SPEC_FILE}: field '{where}' symbol {symbol!r} is not an identifier")
    return Entrypoint(file, symbol)


def read_spec(root: Path) -> tuple[Entrypoint, Entrypoint, str]:
    """Read ``prism.yaml`` (if any) and return (architecture, training, tokenizer name).

    Raises:
        BundleError: see :func:`read_spec_full`.
    """
    return read_spec_full(root)[:3]


def read_spec_full(root: Path) -> tuple[Entrypoint, Entrypoint, str, str | None]:
    """Read ``prism.yaml`` (if any): (architecture, training, tokenizer name, scoring autocast).

    ``scoring_autocast`` is one of :data:`SCORING_AUTOCAST`, or ``None`` when not declared (the
    run's profile then chooses, ``EvalOptions.scoring_autocast``).

    Raises:
        BundleError: (rule ``prism:spec``) malformed YAML (one line,
            ``prism.yaml line N: not valid YAML: <problem>``, with ``.line`` set), unknown
            fields, bad values, or both entrypoints in one file; the message names the field.
    """
    path = root / SPEC_FILE
    data: dict = {}
    if path.is_file():
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise _yaml_error(exc) from None
        except UnicodeDecodeError as exc:
            raise _spec_error(f"{SPEC_FILE}: not valid UTF-8 (byte {exc.start})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise _spec_error(f"{SPEC_FILE}: the top level must be a mapping")
        data = loaded
    unknown = set(data) - {"architecture", "training", "tokenizer", "scoring_autocast", "name", "description"}
    if unknown:
        raise _spec_error(f"{SPEC_FILE}: unknown field(s) {sorted(map(str, unknown))}")

    def _section(key: str) -> object:
        sec = data.get(key)
        if isinstance(sec, dict) and "entrypoint" in sec:
            return sec["entrypoint"]
        if sec is not None and not isinstance(sec, dict):
            raise _spec_error(f"{SPEC_FILE}: field '{key}' must be a mapping with 'entrypoint'")
        return None

    arch = _parse_entrypoint(_section("architecture"), DEFAULT_ARCHITECTURE, "architecture.entrypoint")
    train = _parse_entrypoint(_section("training"), DEFAULT_TRAINING, "training.entrypoint")
    tokenizer = data.get("tokenizer", DEFAULT_TOKENIZER)
    if not isinstance(tokenizer, str):
        raise _spec_error(f"{SPEC_FILE}: field 'tokenizer' must be a string")
    autocast = data.get("scoring_autocast", DEFAULT_SCORING_AUTOCAST)
    if autocast is not DEFAULT_SCORING_AUTOCAST and (not isinstance(autocast, str) or autocast not in SCORING_AUTOCAST):
        raise _spec_error(f"{SPEC_FILE}: field 'scoring_autocast' must be one of {', '.join(SCORING_AUTOCAST)} "
                          f"(the dtype of the harness's scoring forward under torch.autocast), got {autocast!r}")
    if arch.file == train.file:
        raise _spec_error(
            f"{SPEC_FILE}: architecture and training entrypoints must be distinct files "
            f"(both are {arch.file})"
        )
    return arch, train, tokenizer, autocast


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every regular file below ``root`` (bundle-relative POSIX paths).

    ``__pycache__`` folders are skipped: they are build output, not submission.
    """
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def check_tree(root: Path, limits: IntakeLimits = IntakeLimits()) -> int:
    """Apply the intake rules to a bundle directory; return the total size of its files (bytes).

    Every file is read (never through a symlink) and must be UTF-8 text of an allowed kind (see
    :mod:`prism_challenge.intake.bundlefiles`). A ``__pycache__`` folder is refused with a hint to
    delete it (``prism:bytecode``): nothing the gates did not read lies beside the bundle's
    code. Last, the top-level module and code-folder names are checked against the modules the
    interpreter finds elsewhere (one short probe interpreter).

    Raises:
        BundleError: the first broken rule, naming the bundle-relative path: ``prism:bad-name``,
            ``prism:symlink``, ``prism:special-file``, ``prism:bytecode``, ``prism:bad-suffix``,
            ``prism:module-name``, ``prism:too-many-files``, ``prism:source-too-large``,
            ``prism:bundle-unreadable`` (a file cannot be read), ``prism:binary-file`` (a NUL
            byte), ``prism:not-utf8`` (line and byte offset named) or ``prism:shadow-module``.
    """
    total = 0
    count = 0
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for d in sorted(dirnames):
            rel = (here / d).relative_to(root).as_posix()
            _refuse(name_problem(rel))
            if (here / d).is_symlink():
                raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink")
            if d == BYTECODE_DIR:
                _refuse(kind_problem(f"{rel}/"))
        dirnames.sort()
        for name in sorted(filenames):
            p = here / name
            rel = p.relative_to(root).as_posix()
            _refuse(name_problem(rel))
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink")
            if not stat.S_ISREG(st.st_mode):
                raise BundleError(f"{rel}: not a regular file", "prism:special-file")
            _check_kind(rel)
            _refuse(module_name_problem(rel))
            count += 1
            if count > limits.max_files:
                raise BundleError(
                    f"{rel}: more than {limits.max_files} files in the bundle",
                    "prism:too-many-files",
                )
            data = _read_regular(p, rel, limits.max_source_bytes - total + 1)
            total += len(data)
            if total > limits.max_source_bytes:
                raise BundleError(
                    f"{rel}: bundle files exceed {limits.max_source_bytes} bytes in total",
                    "prism:source-too-large",
                )
            _refuse(text_problem(rel, data))
            files.append(rel)
    _refuse(shadow_problem(files, root))
    return total


def _refuse(problem: Problem | None) -> None:
    """Raise ``problem`` (rule, message) as a :class:`BundleError`; nothing when ``None``."""
    if problem is not None:
        raise BundleError(problem[1], problem[0])


def _check_kind(rel: str) -> None:
    _refuse(kind_problem(rel))


def _member_path(name: str) -> str:
    """Validate one archive member name; return it normalized (POSIX, no trailing slash)."""
    if name.startswith(("/", "\\")) or (len(name) >= 2 and name[1] == ":" and name[0].isalpha()):
        raise BundleError(f"{name}: absolute member path", "prism:zip-absolute-path")
    parts = name.rstrip("/").split("/")
    if ".." in parts:
        raise BundleError(f"{name}: member path contains '..'", "prism:zip-parent-path")
    # What another extractor (or another OS) could make of the name: backslashes as separators.
    norm = os.path.normpath(name.replace("\\", "/")).replace(os.sep, "/")
    if norm == ".." or norm.startswith("../") or norm.startswith("/"):
        raise BundleError(f"{name}: member resolves outside the bundle", "prism:zip-escape")
    if "\\" in name or any(ord(c) < 32 for c in name):
        raise BundleError(
            f"{name}: member name has a backslash or control character", "prism:zip-escape"
        )
    return norm


def _check_members(zf: zipfile.ZipFile, limits: IntakeLimits) -> list[tuple[zipfile.ZipInfo, str]]:
    infos = zf.infolist()
    if len(infos) > limits.max_files:
        raise BundleError(
            f"{zf.filename}: {len(infos)} members, more than {limits.max_files}",
            "prism:too-many-files",
        )
    total = sum(i.file_size for i in infos)
    if total > limits.max_archive_bytes:
        raise BundleError(
            f"{zf.filename}: members declare {total} bytes, more than {limits.max_archive_bytes}",
            "prism:zip-too-large",
        )
    seen: set[str] = set()
    out: list[tuple[zipfile.ZipInfo, str]] = []
    declared = 0
    for info in infos:
        name = info.filename
        norm = _member_path(name)
        _refuse(name_problem(norm))
        mode = (info.external_attr >> 16) & 0xFFFF
        if stat.S_ISLNK(mode):
            raise BundleError(f"{name}: symlink member", "prism:symlink")
        if mode and stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise BundleError(f"{name}: member is not a regular file", "prism:special-file")
        if norm in seen:
            raise BundleError(f"{name}: duplicate member", "prism:zip-duplicate")
        seen.add(norm)
        if info.flag_bits & 0x1:
            raise BundleError(f"{name}: encrypted member", "prism:bad-zip")
        if info.is_dir():
            if BYTECODE_DIR in norm.split("/"):
                _check_kind(norm + "/")
            continue
        _check_kind(norm)
        if info.file_size > limits.ratio_floor_bytes:
            ratio = info.file_size / max(info.compress_size, 1)
            if ratio > limits.max_ratio:
                raise BundleError(
                    f"{name}: compression ratio {ratio:.0f} exceeds {limits.max_ratio:.0f}",
                    "prism:zip-ratio",
                )
        declared += info.file_size
        if declared > limits.max_source_bytes:
            raise BundleError(
                f"{name}: bundle files exceed {limits.max_source_bytes} bytes in total",
                "prism:source-too-large",
            )
        out.append((info, norm))
    return out


def extract_zip(
    path: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    limits: IntakeLimits = IntakeLimits(),
) -> tuple[Path, Path]:
    """Check every member of a zip against the intake rules, then extract it.

    All members are checked (from the central directory) before a byte is written; extraction
    then writes only regular files, with ``O_EXCL | O_NOFOLLOW``, counting the bytes actually
    inflated. If the archive holds neither ``prism.yaml`` nor ``architecture.py`` at its top
    but a single top-level folder, that folder is the bundle root (``zip -r b.zip mybundle/``).

    Args:
        path: the ``.zip`` file.
        dest: an existing empty directory to extract into; default a fresh
            ``scratch.mkdtemp("prism-bundle-")`` (:mod:`prism_challenge.scratch`), which the caller owns and removes.
        limits: intake limits.

    Returns:
        (bundle root, extraction directory); the root is the directory or a folder inside it.

    Raises:
        BundleError: ``prism:bundle-unreadable`` (cannot open), ``prism:bad-zip`` (not a zip,
            corrupt or encrypted), ``prism:too-many-files``, ``prism:zip-absolute-path``,
            ``prism:zip-parent-path``, ``prism:zip-escape``, ``prism:symlink``,
            ``prism:special-file``, ``prism:zip-duplicate``, ``prism:bytecode``,
            ``prism:bad-suffix``, ``prism:zip-ratio``, ``prism:zip-too-large``,
            ``prism:source-too-large``, ``prism:binary-file`` or ``prism:not-utf8``; the message
            names the member. Then every rule of :func:`check_tree` on the extracted root
            (paths relative to it). A directory this call created is removed first.
    """
    src = Path(path)
    try:
        zf = zipfile.ZipFile(src)
    except zipfile.BadZipFile as exc:
        raise BundleError(f"{src}: not a valid zip archive ({exc})", "prism:bad-zip") from None
    except OSError as exc:
        raise BundleError(f"{src}: cannot open ({exc.strerror})", "prism:bundle-unreadable") from None
    created = dest is None
    out = scratch.mkdtemp("prism-bundle-") if dest is None else Path(dest)
    if created:  # mkdtemp makes it 0700: a sandbox that runs as its own uid must read the bundle
        out.chmod(0o755)
    try:
        with zf:
            members = _check_members(zf, limits)
            target_root = out.resolve()
            for info, norm in members:
                target = target_root / norm
                if not target.resolve().is_relative_to(target_root):
                    raise BundleError(
                        f"{info.filename}: member resolves outside the bundle", "prism:zip-escape"
                    )
                target.parent.mkdir(parents=True, exist_ok=True)
                _extract_member(zf, info, target, limits)
        root = _bundle_root(out)
        check_tree(root, limits)
        return root, out
    except BundleError:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    except (zipfile.BadZipFile, NotImplementedError, RuntimeError, ValueError, EOFError) as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise BundleError(f"{src}: corrupt or unsupported zip ({exc})", "prism:bad-zip") from None
    except OSError as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise BundleError(
            f"{src}: cannot extract ({exc.strerror or exc})", "prism:bundle-unreadable"
        ) from None


def _extract_member(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, limits: IntakeLimits
) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(target, flags, 0o644)
    written = 0
    data = bytearray()
    with os.fdopen(fd, "wb") as out, zf.open(info) as member:
        while chunk := _read_member(member, info):
            written += len(chunk)
            if written > info.file_size or written > limits.max_archive_bytes:
                raise BundleError(
                    f"{info.filename}: inflates past its declared size", "prism:zip-too-large"
                )
            out.write(chunk)
            data += chunk
    _refuse(text_problem(info.filename, bytes(data)))  # the member as the archive names it (checked printable)


_CORRUPT_STREAM = (zlib.error, lzma.LZMAError, OSError, EOFError)
"""What the stdlib's decompressors raise on a garbled member (deflate: ``zlib.error``; bzip2:
``OSError("Invalid data stream")``; LZMA: ``LZMAError``; a cut stream: ``EOFError``)."""


def _read_member(member, info: zipfile.ZipInfo) -> bytes:
    """The next 64 KiB of ``member``; a decompression failure is the archive's fault.

    Raises:
        BundleError: ``prism:bad-zip`` naming the member.
    """
    try:
        return member.read(64 * 1024)
    except _CORRUPT_STREAM as exc:
        raise BundleError(f"{info.filename}: corrupt compressed data ({type(exc).__name__}: {exc})",
                          "prism:bad-zip") from None


def _bundle_root(out: Path) -> Path:
    entries = [p for p in out.iterdir()]
    if (out / SPEC_FILE).exists() or (out / DEFAULT_ARCHITECTURE[0]).exists():
        return out
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return out


NOT_A_BUNDLE = "a bundle is a directory or a .zip holding architecture.py and training.py"
"""What a bundle is, for the message that refuses a path that is not one."""

_OTHER_DIR = stat.S_IROTH | stat.S_IXOTH


def private_path(root: str | os.PathLike[str]) -> str | None:
    """The first path of a bundle directory that users other than its owner cannot read.

    A directory needs ``o+rx`` (list and enter), a file ``o+r``; ``__pycache__`` is skipped
    (bytecode is never imported). A sandbox that runs as its own unprivileged uid reads the
    bundle with exactly these "other" bits.

    Returns:
        the bundle-relative POSIX path (``"."`` for the directory itself), or ``None`` when
        everything is readable by others.
    """
    base = Path(root)
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        here = Path(dirpath)
        rel = here.relative_to(base).as_posix()
        if here.stat().st_mode & _OTHER_DIR != _OTHER_DIR:
            return rel
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            st = (here / name).lstat()
            if stat.S_ISREG(st.st_mode) and not st.st_mode & stat.S_IROTH:
                return (here / name).relative_to(base).as_posix()
    return None


def readable_copy(
    root: str | os.PathLike[str], limits: IntakeLimits = IntakeLimits()
) -> tuple[Path, Path]:
    """Copy a bundle directory, once, into a fresh world-readable temporary directory.

    For a sandbox that runs as its own uid (PRISM as root) when the bundle is private (see
    :func:`private_path`): directories are made 0755 and files 0644, the bundle-relative paths
    and contents are kept (so the bundle's sha256 is unchanged) and the copy keeps the folder's
    name. Files are read with ``O_NOFOLLOW`` and the intake limits hold while copying; the copy
    is checked again with :func:`check_tree`.

    Returns:
        (root of the copy, temporary directory): the caller owns the temporary directory and
        removes it (``shutil.rmtree``) when done with the bundle.

    Raises:
        BundleError: an intake rule (``prism:symlink``, ``prism:special-file``,
            ``prism:too-many-files``, ``prism:source-too-large``, ...) or
            ``prism:bundle-unreadable`` when a file cannot be read; nothing is left on disk.
    """
    src = Path(root)
    out = scratch.mkdtemp("prism-bundle-")
    try:
        out.chmod(0o755)
        dest = out / (src.name or "bundle")
        dest.mkdir()
        dest.chmod(0o755)
        count = total = 0
        # os.fwalk holds each directory open and opens its entries relative to it, checking that
        # a subdirectory it enters is the one it listed: a directory of the bundle swapped for a
        # symlink while this (root) process copies cannot redirect a read outside the bundle
        for dirpath, dirnames, filenames, dirfd in os.fwalk(src, follow_symlinks=False):
            here = Path(dirpath)
            there = dest / here.relative_to(src)
            kept = []
            for d in sorted(dirnames):
                if d in SKIPPED_DIRS:
                    continue
                if stat.S_ISLNK(os.stat(d, dir_fd=dirfd, follow_symlinks=False).st_mode):
                    rel = (here / d).relative_to(src).as_posix()
                    raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink")
                (there / d).mkdir()
                (there / d).chmod(0o755)
                kept.append(d)
            dirnames[:] = kept
            for name in sorted(filenames):
                rel = (here / name).relative_to(src).as_posix()
                count += 1
                if count > limits.max_files:
                    raise BundleError(
                        f"{rel}: more than {limits.max_files} files in the bundle", "prism:too-many-files"
                    )
                data = _read_regular(name, rel, limits.max_source_bytes - total + 1, dir_fd=dirfd)
                total += len(data)
                if total > limits.max_source_bytes:
                    raise BundleError(
                        f"{rel}: bundle files exceed {limits.max_source_bytes} bytes in total",
                        "prism:source-too-large",
                    )
                fd = os.open(there / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), 0o644)
                    f.write(data)
        check_tree(dest, limits)
        return dest, out
    except BundleError:
        shutil.rmtree(out, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(out, ignore_errors=True)
        where = exc.filename or src
        raise BundleError(
            f"{where}: cannot copy the bundle ({exc.strerror or exc})", "prism:bundle-unreadable"
        ) from None


def _read_regular(path: Path | str, rel: str, most: int, dir_fd: int | None = None) -> bytes:
    """The bytes of a regular file (``path`` relative to ``dir_fd`` when given), never through a
    symlink, at most ``most`` of them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink") from None
        raise BundleError(f"{rel}: cannot read ({exc.strerror or exc})", "prism:bundle-unreadable") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BundleError(f"{rel}: not a regular file", "prism:special-file")
        _check_kind(rel)
        return f.read(max(most, 0))


def open_bundle(
    path: str | os.PathLike[str],
    limits: IntakeLimits = IntakeLimits(),
    *,
    readable_by_others: bool = False,
) -> tuple[Path, Path | None]:
    """Intake a bundle directory or ``.zip``: apply the intake rules and return its root.

    Args:
        path: the bundle directory or ``.zip`` file.
        limits: intake limits.
        readable_by_others: the bundle must be readable by users other than its owner (a
            sandbox that runs as its own uid): a directory bundle that is not (see
            :func:`private_path`) is evaluated from a :func:`readable_copy`. Zip bundles are
            always extracted world-readable.

    Returns:
        (bundle root, extraction directory or ``None`` for a directory bundle used in place).
        For a zip (or a copied directory) the extraction directory is a fresh temporary
        directory owned by the caller, who removes it (``shutil.rmtree``) when done with it.

    Raises:
        BundleError: ``prism:bundle-unreadable`` when the path is neither a directory nor a
            file, or is a file that is neither a zip nor named ``.zip`` (the message says what
            a bundle is, see :data:`NOT_A_BUNDLE`); ``prism:bad-zip`` for a ``.zip`` file
            that is not a valid zip; or the broken intake rule (see :func:`check_tree` and
            :func:`extract_zip`).
    """
    p = Path(path)
    if p.is_dir():
        root = p.resolve()
        check_tree(root, limits)
        if readable_by_others and private_path(root) is not None:
            return readable_copy(root, limits)
        return root, None
    if p.is_file():
        if p.suffix.lower() != ".zip" and not zipfile.is_zipfile(p):
            raise BundleError(f"{path}: not a bundle: {NOT_A_BUNDLE}", "prism:bundle-unreadable")
        return extract_zip(p, None, limits)
    if p.exists():  # a device, a FIFO, a socket
        raise BundleError(f"{path}: not a bundle (not a regular file or a directory): {NOT_A_BUNDLE}",
                          "prism:bundle-unreadable")
    raise BundleError(f"{path}: no such bundle directory or .zip file", "prism:bundle-unreadable")


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Locate a bundle directory and check that both entrypoint files exist.

    Raises:
        BundleError: the path is not a directory (``prism:bundle-unreadable``), ``prism.yaml``
            is malformed (``prism:spec``), or an entrypoint file is missing
            (``prism:missing-entrypoint``, the file is named).
    """
    root = Path(path).resolve()
    if not root.is_dir():
        raise BundleError(f"{path}: not a bundle directory", "prism:bundle-unreadable")
    arch, train, tokenizer, autocast = read_spec_full(root)
    for ep, what in ((arch, "architecture"), (train, "training")):
        if not (root / ep.file).is_file():
            raise BundleError(
                f"{ep.file}: missing {what} entrypoint file in bundle {root}",
                "prism:missing-entrypoint",
            )
    return Bundle(root, arch, train, tokenizer, hash_tree(root), autocast)
