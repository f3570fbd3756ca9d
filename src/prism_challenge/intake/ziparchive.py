"""A bundle given as a ``.zip``: every member checked against the intake rules, then extracted.

The hardening (no absolute or parent-relative member names, nothing resolving outside the
target, no symlinks or special files, no duplicates, no zip bombs) is :func:`extract_zip`'s; the
extracted root then passes :func:`~prism_challenge.intake.tree.check_tree`.
"""

from __future__ import annotations

import lzma
import os
import shutil
import stat
import zipfile
import zlib
from pathlib import Path

from prism_challenge import scratch
from prism_challenge.intake.bundlefiles import BYTECODE_DIR, name_problem, text_problem
from prism_challenge.intake.refusal import BundleError, IntakeLimits, _check_kind, _refuse
from prism_challenge.intake.spec import DEFAULT_ARCHITECTURE, SPEC_FILE
from prism_challenge.intake.tree import check_tree


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
