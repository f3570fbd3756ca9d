"""Temporary folders that go with their process, however it ends (issue 27).

Every temporary folder PRISM makes (the frozen bundle copy, the feeder socket's folder, the
parameter child's work folder, the intake's extraction, a service attempt's bundle and run
directory, ...) is made inside one *owner folder*: ``<base>/<name>`` holding a lock file
(:data:`LOCK_NAME`) on which the owning process holds an exclusive ``flock(2)`` for the folder's
life. The kernel drops the lock when the process ends, however it ends (SIGKILL included), so
:func:`sweep` tells a dead owner's folder from a live one's without trusting PIDs (a PID is
reused and a check of it races; a lock is neither): it removes exactly the folders whose lock it
can take, while holding it. A live run's folder is never removed by a concurrent sweep.

Owner folders:

- a process's own (:func:`current` when no attempt runs): ``<tempdir>/prism-run-<pid>-<hex>``,
  made on first use, after a :func:`sweep` of the ``prism-run-*`` folders that killed processes
  left there (a SIGKILLed ``prism eval``); removed at the process's exit;
- a service attempt's (:func:`attempt`): ``<work dir>/<attempt token>``, the process's current
  owner folder while the attempt runs (one attempt per Ray actor process), removed when it ends;
  the attempt's start and the dispatcher's reconcile sweep the work dir
  (:func:`prism_challenge.service.recovery.reconcile`).

A folder is made under a hidden name (:data:`NEW_PREFIX`), locked, then renamed into place, so a
sweep never sees an owner folder without its lock. Owner folders are mode ``0711``: a sandbox
that runs as its own uid reaches the bundle copy inside, but cannot list the folder.

This module imports nothing of PRISM's (the bundle intake and the sandbox use it).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".owner.lock"
"""The lock file of an owner folder (its first line: the owner's PID, for people)."""
RUN_PREFIX = "prism-run-"
"""The name of a process's own owner folder under the temp directory."""
NEW_PREFIX = ".prism-new-"
"""An owner folder being made (locked, then renamed into place)."""
NEW_STALE_S = 60.0
"""A :data:`NEW_PREFIX` folder with no lock file this old was left by a creator that died
between ``mkdir`` and its lock (microseconds apart); :func:`sweep` removes it."""
FOLDER_MODE = 0o711


class ScratchError(OSError):
    """An owner folder cannot be made (its base is not a directory of this user, or a live
    owner holds the name)."""


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a directory tree, read-only directories included (a frozen bundle copy is
    ``0555``): write bits are restored first, so an owner who is not root can delete it.
    Missing paths are ignored."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            try:
                os.chmod(os.path.join(dirpath, d), 0o755, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    try:
        os.chmod(path, 0o755)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


class Owned:
    """An owner folder this process holds (its lock taken); :meth:`close` removes it.

    Attributes:
        path: the folder.
        pid: the process that made it (only that process removes it: a forked child does not).
    """

    def __init__(self, path: Path, fd: int):
        self.path, self._fd, self.pid = path, fd, os.getpid()

    def mkdtemp(self, prefix: str) -> Path:
        """A fresh folder ``<path>/<prefix><random>`` (``tempfile.mkdtemp``: mode 0700), owned by the caller."""
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.path))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the folder is gone, the lock dropped)."""
        return self._fd < 0

    def close(self) -> None:
        """Remove the folder and everything in it, then drop the lock (idempotent; a no-op in a
        forked child)."""
        if self._fd < 0 or os.getpid() != self.pid:
            return
        remove_tree(self.path)
        os.close(self._fd)
        self._fd = -1


def _own_base(base: Path) -> Path:
    """``base``, made if missing (mode 0711); a base that is not a directory of this user (a
    squatted name in a shared ``/tmp``) is refused.

    Raises:
        ScratchError: not a directory, or owned by another user.
    """
    base.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ScratchError(f"{base}: not a directory of this user (uid {os.geteuid()}); "
                           "temporary folders are made only in a base folder this user owns")
    return base


def create(base: str | os.PathLike[str], name: str, *, own_base: bool = True) -> Owned:
    """Make and lock the owner folder ``<base>/<name>`` (module docstring). ``own_base``: make
    ``base`` and check it is this user's (:func:`_own_base`; not for the temp directory itself).

    Raises:
        ScratchError: see :func:`_own_base`; ``name`` is held by a live owner.
    """
    base = Path(base)
    if own_base and base != Path(tempfile.gettempdir()):
        _own_base(base)
    new = Path(tempfile.mkdtemp(prefix=NEW_PREFIX, dir=base))
    fd = os.open(new / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a file no one else has opened yet: never waits
    os.write(fd, f"{os.getpid()}\n".encode())
    os.chmod(new, FOLDER_MODE)
    try:
        os.rename(new, base / name)  # an empty leftover of the same name is replaced; a full one refuses
    except OSError as exc:
        remove_tree(new)
        os.close(fd)
        raise ScratchError(f"{base / name}: cannot be made ({exc.strerror}): a live owner holds it") from None
    return Owned(base / name, fd)


def _dead_owner(path: str) -> int | None:
    """The fd of ``path``'s lock file, locked by this call (its owner is dead), or ``None``
    (a live owner holds it, or there is no lock file)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep(base: str | os.PathLike[str], prefix: str = "") -> list[Path]:
    """Remove the owner folders in ``base`` whose owner is dead (their lock can be taken), and
    :data:`NEW_PREFIX` folders left with no lock (older than :data:`NEW_STALE_S`). Only folders
    named ``prefix*`` and of this user are looked at; anything else (no lock file: not an owner
    folder) is left. A missing ``base`` is nothing to sweep.

    Returns:
        the folders removed.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        fresh = entry.name.startswith(NEW_PREFIX)
        if not (fresh or entry.name.startswith(prefix)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if fresh and time.time() - st.st_mtime <= NEW_STALE_S:
            continue  # its maker may be between the lock file's creation and its lock
        fd = _dead_owner(entry.path)
        if fd is None and not (fresh and not os.path.lexists(os.path.join(entry.path, LOCK_NAME))):
            continue  # a live owner, or not an owner folder
        try:
            remove_tree(entry.path)
            removed.append(Path(entry.path))
        finally:
            if fd is not None:
                os.close(fd)
    return removed


_lock = threading.Lock()
_attempts: list[Owned] = []  # the attempts running in this process, innermost last
_own: Owned | None = None  # this process's own folder under the temp directory


def own() -> Owned:
    """This process's own owner folder under ``tempfile.gettempdir()``, made on first use after
    a :func:`sweep` of dead processes' ``prism-run-*`` folders there; removed at exit.

    Raises:
        ScratchError: the folder cannot be made.
    """
    global _own
    with _lock:
        if _own is None or _own.closed or _own.pid != os.getpid():
            base = tempfile.gettempdir()
            sweep(base, RUN_PREFIX)
            _own = create(base, f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
            atexit.register(_own.close)
        return _own


def made() -> Owned | None:
    """This process's own folder if :func:`own` made it (and it is not closed), else ``None``."""
    return _own if _own is not None and not _own.closed and _own.pid == os.getpid() else None


def current() -> Owned:
    """The owner folder new temporary folders go in: the running attempt's (:func:`attempt`),
    else the process's own (:func:`own`)."""
    with _lock:
        if _attempts:
            return _attempts[-1]
    return own()


def mkdtemp(prefix: str) -> Path:
    """A fresh temporary folder ``<current owner folder>/<prefix><random>`` (mode 0700): the
    caller removes it when done; if the process dies first, the owner folder goes with it."""
    return current().mkdtemp(prefix)


def root() -> Path:
    """The current owner folder (:func:`current`), for ``tempfile``'s ``dir=`` arguments."""
    return current().path


@contextmanager
def attempt(base: str | os.PathLike[str], name: str) -> Iterator[Owned]:
    """The owner folder ``<base>/<name>`` of one service attempt (``name``: its token), made
    after a :func:`sweep` of ``base`` (the folders of attempts whose process died) and current
    in this process until the block ends, then removed. One attempt per process: a Ray actor.
    The process's own folder (:func:`own`), if the attempt made it (a feeder socket whose path
    would be too long in the attempt's folder), is removed with it: an actor is killed, not
    exited, once its result is read.

    Raises:
        ScratchError: see :func:`create`.
    """
    sweep(base)
    owned = create(base, name)
    before = made()
    with _lock:
        _attempts.append(owned)
    try:
        yield owned
    finally:
        with _lock:
            _attempts.remove(owned)
        owned.close()
        mine = made()
        if mine is not None and mine is not before:
            mine.close()


@contextmanager
def staging(parent: str | os.PathLike[str], name: str) -> Iterator[Path]:
    """A fresh empty folder (mode 0700) to build ``<parent>/<name>`` in, then rename into place
    (a prepared data directory, a token cache): ``<parent>/.<name>.tmp-<hex>/d``, inside an owner
    folder that goes when the block ends, with ``d`` if it was not renamed away. A builder killed
    midway leaves its folder to the next build's :func:`sweep` of ``.<name>.tmp-*`` in ``parent``.

    Raises:
        OSError: ``parent`` cannot be written.
    """
    parent = Path(parent)
    prefix = f".{name}.tmp-"
    sweep(parent, prefix)
    owned = create(parent, prefix + secrets.token_hex(4), own_base=False)
    try:
        build = owned.path / "d"
        build.mkdir(mode=0o700)
        yield build
    finally:
        owned.close()


__all__ = ["FOLDER_MODE", "LOCK_NAME", "NEW_PREFIX", "Owned", "RUN_PREFIX", "ScratchError", "attempt", "create",
           "current", "made", "mkdtemp", "own", "remove_tree", "root", "staging", "sweep"]
