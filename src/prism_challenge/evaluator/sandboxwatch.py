"""The sandbox's processes and disk, read from outside: its uid, its tasks, its folders' usage.

The parent picks a free dedicated uid for a sandbox (:func:`pick_sandbox_uid`), counts and kills
the tasks of that uid through ``/proc`` (:func:`tasks_of_uid`, :func:`kill_uid`) and measures
the disk its writable folders use (:func:`artifacts_usage`, :func:`check_quota`): what
:class:`~prism_challenge.evaluator.isolation.Guard` checks from its watch loop.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from prism_challenge.evaluator.sandboxerror import IsolationError

SANDBOX_UID_MIN = 200_000  # dedicated uids for sandboxes (no passwd entry needed)
SANDBOX_UID_SPAN = 50_000


class QuotaExceeded(RuntimeError):
    """The artifacts directory (plus a host tmp dir) holds more than its quota."""


# -------------------------------------------------------------------------------------------
# Identity
# -------------------------------------------------------------------------------------------
def _uids_in_use() -> set[int]:
    used: set[int] = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                used.add(os.stat(entry.path).st_uid)
            except OSError:
                pass
    return used


def pick_sandbox_uid(seed: int | None = None) -> int:
    """A dedicated unprivileged uid for one sandbox: no running process has it now.

    Uids ``SANDBOX_UID_MIN .. SANDBOX_UID_MIN + SANDBOX_UID_SPAN - 1`` (200000..249999), starting
    at ``seed`` (default: this process's pid) modulo the span, so concurrent harnesses rarely
    collide; no passwd entry is needed. The gid is the same number.

    Raises:
        IsolationError: every uid of the range is in use.
    """
    used = _uids_in_use()
    start = (os.getpid() if seed is None else seed) % SANDBOX_UID_SPAN
    for k in range(SANDBOX_UID_SPAN):
        uid = SANDBOX_UID_MIN + (start + k) % SANDBOX_UID_SPAN
        if uid not in used:
            return uid
    raise IsolationError("no free sandbox uid in 200000..249999")


# -------------------------------------------------------------------------------------------
# Quota and the parent's guard
# -------------------------------------------------------------------------------------------
def artifacts_usage(path: Path | str) -> int:
    """Disk space used below ``path``, in bytes: allocated blocks (``st_blocks * 512``).

    The same figure as ``du -s -B1 PATH``: directories included, each inode counted once (hard
    links), symlinks not followed (their own blocks count), sparse holes not counted. A missing
    path uses 0 bytes; entries that vanish during the walk are skipped.
    """
    return _usage(Path(path))[0]


def _usage(path: Path) -> tuple[int, int]:
    """(bytes, entries) below ``path``."""
    seen: set[tuple[int, int]] = set()
    total = entries = 0
    stack = [os.fspath(path)]
    first = True
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not first:
            entries += 1
        first = False
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            total += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            try:
                with os.scandir(p) as it:
                    stack.extend(e.path for e in it)
            except OSError:
                continue
    return total, entries


def check_quota(paths: Iterable[Path | str], quota_bytes: int | None, max_entries: int | None = None) -> int:
    """Raise if ``paths`` together use more than ``quota_bytes`` (or hold more entries).

    Returns:
        The bytes used (see :func:`artifacts_usage`).

    Raises:
        QuotaExceeded: naming the usage and the quota.
    """
    total = entries = 0
    for p in paths:
        b, n = _usage(Path(p))
        total += b
        entries += n
    if quota_bytes is not None and total > quota_bytes:
        raise QuotaExceeded(f"the artifacts directory uses {total} bytes, over its quota of {quota_bytes} bytes")
    if max_entries is not None and entries > max_entries:
        raise QuotaExceeded(f"the artifacts directory holds {entries} files, over its limit of {max_entries}")
    return total


def _proc_uid(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _threads(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tasks_of_uid(uid: int) -> tuple[int, int]:
    """(processes, tasks) whose owner is ``uid``; tasks count threads (what ``RLIMIT_NPROC`` counts)."""
    procs = tasks = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _proc_uid(entry.name) == uid:
            procs += 1
            tasks += _threads(entry.name)
    return procs, tasks


def _state(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def kill_uid(uid: int, rounds: int = 100) -> int:
    """SIGKILL every process owned by ``uid`` until none is alive (root only); returns the kills.

    Zombies (already dead, waiting for their parent outside the sandbox to reap them) are not
    waited for. Only meaningful for a dedicated sandbox uid (:func:`pick_sandbox_uid`).

    Raises:
        ValueError: ``uid`` is 0.
    """
    if uid == 0:
        raise ValueError("kill_uid(0) would kill the host")
    killed = 0
    for _ in range(rounds):
        pids = [e.name for e in os.scandir("/proc")
                if e.name.isdigit() and _proc_uid(e.name) == uid and _state(e.name) not in ("Z", "X", "?")]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    return killed
