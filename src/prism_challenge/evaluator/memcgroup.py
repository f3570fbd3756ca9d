"""The memory of a jailed process tree: the host's RAM, and a cgroup v2 ``memory.max`` for the tree.

:class:`MemoryCgroup` holds a jailed tree's memory where the host lets PRISM make a group (the
:class:`~prism_challenge.evaluator.jail.Jail` falls back to ``RLIMIT_AS`` elsewhere);
:func:`host_memory_bytes` is the ceiling no memory limit goes above
(:func:`~prism_challenge.evaluator.jail.default_memory_limit`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def host_memory_bytes() -> int | None:
    """``MemTotal`` of ``/proc/meminfo`` in bytes, or ``None`` when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemoryCgroup:
    """A cgroup v2 with ``memory.max`` for one jailed process tree, where the host allows it.

    :meth:`create` returns ``None`` unless ``/sys/fs/cgroup`` is a cgroup2 mount whose
    ``memory`` controller this process may use and a child group can be made; the jail then
    falls back to ``RLIMIT_AS``. The child enters the group in ``preexec_fn`` (before ``exec``),
    so the whole tree is charged from its first allocation.
    """

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit

    @classmethod
    def create(cls, limit: int, root: Path | None = None,
               proc_cgroup: str = "/proc/self/cgroup") -> MemoryCgroup | None:
        """A fresh group holding at most ``limit`` bytes, or ``None`` (not available here).
        ``root``: the cgroup2 mount (default :data:`CGROUP_ROOT`); ``proc_cgroup``: where this
        process's group is read (``0::/path``) (both stand-ins in tests)."""
        root = CGROUP_ROOT if root is None else root
        try:
            if not (root / "cgroup.controllers").is_file():
                return None
            own = Path(open(proc_cgroup).read().strip().split("::", 1)[1].splitlines()[0])
            parent = root / own.relative_to("/")
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                return None
            path = parent / f"prism-{os.getpid()}-{time.monotonic_ns()}"
            path.mkdir()
            (path / "memory.max").write_text(str(int(limit)))
            (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
            return cls(path, limit)
        except (OSError, ValueError, IndexError):
            return None

    def enter(self) -> None:
        """Move the calling process into the group (called in the child before ``exec``)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for memory."""
        try:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def remove(self) -> None:
        """Remove the group (after its processes ended)."""
        try:
            self.path.rmdir()
        except OSError:
            pass
