"""A subprocess under a wall-clock limit that ends with its whole process group.

``subprocess.run(timeout=...)`` kills only the direct child: a ``prism eval`` past its limit would
leave torchrun, its ranks and the sandboxed children running into the next part of a GPU session.
:func:`run_bounded` starts the command as the leader of a new process group and, past the limit,
sends SIGTERM to the group, then SIGKILL after ``grace_s``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

TIMED_OUT = 124
"""The return code reported for a command ended at its limit (as coreutils' ``timeout``)."""


@dataclass(frozen=True)
class Bounded:
    """What a bounded command left: its return code (:data:`TIMED_OUT` past the limit), its
    stdout and stderr as text, and whether it was ended at its limit."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_bounded(cmd: list[str], timeout_s: float | None, *, grace_s: float = 5.0, env: dict[str, str] | None = None,
                cwd: str | None = None) -> Bounded:
    """Run ``cmd`` (argv list) to its end or ``timeout_s`` seconds (``None``: no limit); the text
    it printed either way. Raises ``OSError`` when the command cannot start."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=None if timeout_s is None else max(timeout_s, 1.0))
        return Bounded(proc.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _signal_group(proc.pid, signal.SIGKILL)  # what the leader's end left behind in its group
        return Bounded(TIMED_OUT, out or "", (err or "") + f"\n[ended at its limit of {timeout_s:.0f} s]", True)
