"""A jailed child's handles and its end: what :class:`~prism_challenge.evaluator.jail.Jail` hands back.

:class:`Started` is a child started with pipes, to be fed later; :class:`Finished` is one that
ended (exit status, the kept tails of its output, why it failed). :func:`stream_input` feeds a
child's stdin block by block on a thread, :func:`kill_group` kills its whole session, and
:func:`_folder_ids` and :func:`_spare_key` say which spare child a later run may take.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prism_challenge.evaluator.memcgroup import MemoryCgroup
from prism_challenge.evaluator.outputcap import Captured


@dataclass(frozen=True)
class Finished:
    """A jailed child that ended: exit status (negative: the signal), output, and why it failed.

    Attributes:
        returncode: the exit status, ``-N`` for signal ``N``.
        stdout, stderr: the last bytes it wrote (:mod:`~prism_challenge.evaluator.outputcap`: at
            most ``RESULT_BYTES`` and ``TAIL_BYTES``).
        timed_out: the deadline passed and the group was killed.
        failure: :func:`diagnose`'s line, or ``None`` for exit status 0.
        refusal: the audit hook's parsed refusal, when it stopped the child.
        stdout_dropped, stderr_dropped: the bytes written before the kept ones, not kept.
    """

    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    failure: str | None
    refusal: dict[str, Any] | None
    stdout_dropped: int = 0
    stderr_dropped: int = 0

    @property
    def stderr_note(self) -> str:
        """:func:`~prism_challenge.evaluator.outputcap.dropped_note` for stderr, or ``""`` when nothing was dropped."""
        return Captured(self.stderr, len(self.stderr) + self.stderr_dropped).note

    def stderr_tail(self, lines: int) -> str:
        """The last ``lines`` lines of stderr, after a line saying how many bytes were dropped, if any."""
        return Captured(self.stderr, len(self.stderr) + self.stderr_dropped).text(lines)


@dataclass(frozen=True)
class Started:
    """A child :meth:`Jail.start` started with pipes: its process, its memory cgroup (if any)
    and the ``(device, inode)`` of each writable folder it was given (:func:`_folder_ids`)."""

    proc: subprocess.Popen
    group: MemoryCgroup | None
    folders: tuple = ()


def _folder_ids(folders: Sequence[str | os.PathLike[str]]) -> tuple:
    """``(device, inode)`` per folder (``None`` for one that is missing): the sandbox binds the
    folder a path names when the child starts, so a spare whose path now names another folder
    (renamed aside and made again) would write to the old one: :meth:`Jail.run` drops it."""
    out = []
    for f in folders:
        try:
            st = os.stat(f)
            out.append((st.st_dev, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def _spare_key(argv: Sequence[str], writable: Sequence[str | os.PathLike[str]], env: dict[str, str] | None,
               cwd: str | os.PathLike[str] | None) -> tuple:
    return tuple(argv), tuple(map(str, writable)), tuple(sorted((env or {}).items())), None if cwd is None else str(cwd)


class _Streamer(threading.Thread):
    """Writes an iterable's blocks to a child's stdin, then closes it (:func:`stream_input`)."""

    def __init__(self, pipe: Any, blocks: Iterable[bytes]):
        super().__init__(name="prism-jail-stdin", daemon=True)
        self.pipe, self.blocks, self.error = pipe, blocks, None

    def run(self) -> None:
        try:
            for block in self.blocks:
                self.pipe.write(block)
        except (BrokenPipeError, ConnectionResetError, ValueError):
            pass  # the child stopped reading (it ended, or was killed): its outcome says why
        except OSError as exc:
            self.error = exc
        finally:
            try:
                self.pipe.close()
            except OSError:
                pass


def stream_input(proc: subprocess.Popen, blocks: Iterable[bytes]) -> _Streamer:
    """Start writing ``blocks`` to ``proc``'s stdin on a thread (taken from ``proc``: nothing
    else writes to it); the thread's ``error`` holds an ``OSError`` the iterable raised."""
    pipe, proc.stdin = proc.stdin, None
    streamer = _Streamer(pipe, blocks)
    streamer.start()
    return streamer


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (its session: the sandbox's init takes its pid
    namespace with it), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
