"""Process isolation for the submission's process tree: a sandbox prefix, limits, a guard.

``strict`` puts ``torchrun`` and every rank in a sandbox built from Linux namespaces:

* **network**: an empty network namespace; only loopback is up (torchrun's local rendezvous and
  gloo work, nothing outside the sandbox is reachable, not even the host's loopback);
* **filesystem**: an allow-list. The sandbox starts from an empty root (a tmpfs, read-only once
  built) and sees only: read-only, ``/usr`` and ``/bin``, ``/sbin``, ``/lib*`` (binds, or the
  merged-usr links), a few files of ``/etc`` (:data:`ETC_FILES`: ``ld.so.cache``, ``passwd``,
  ``group``, ``nsswitch.conf``, ``hosts``...; not ``/etc`` as a whole, which holds host
  configuration and secrets), the device and topology trees of ``/sys`` (:data:`SYS_TREES`), the
  interpreter (``sys.prefix``, ``sys.base_prefix``, ``sys.exec_prefix``) and every entry of its
  ``sys.path`` (site-packages, the editable source dir of this package) and ``$LD_LIBRARY_PATH``,
  the bundle and the feeder socket's directory; read-write, the run's artifacts directory and a
  private ``/tmp`` (a host ``tmp_dir`` bound there, or a size-capped tmpfs); a minimal ``/dev``
  (null, zero, full, random, urandom, tty) with a private, size-capped ``/dev/shm`` and the GPU
  nodes (``/dev/nvidia*``, ``/dev/dri``) where present; a new ``/proc``. Each path is bound at
  its own place, alone: where the interpreter lives under ``/root`` (pyenv, say) only that
  directory is there, not the rest of ``/root``. Everything else of the host (the data and its raw
  sources, other runs, the harness checkout but its ``src``, ``/home``, ``/var``, ``/srv``...)
  does not exist in the sandbox. A ``hidden`` path (data directory, token caches, salts, ...)
  that lies inside one of those trees is covered by an empty tmpfs (a file: by an empty file of
  mode 000), so it cannot be read;
* **processes**: a new pid namespace (the tree is killed with its init), a new session, a new
  ``/proc``, IPC and UTS namespaces, and death with the parent;
* **identity**: when PRISM runs as root, the submission runs as a dedicated unprivileged uid
  (:func:`pick_sandbox_uid`) with no capabilities and ``no_new_privs``. The directories above
  each bound path are made afresh (mode 0755) on the empty root, so the uid reaches a path below
  ``/root`` (mode 0700 on the host) and sees nothing else there.

Backends: Debian's ``bubblewrap`` (``bwrap``) when it works, else ``unshare(1)`` from util-linux
plus a small init (:mod:`prism_challenge.evaluator.sandbox_init`, run with ``python -I -S``) that
builds the same view with ``mount(2)``/``mount_setattr(2)`` on an empty tmpfs, makes it the root
with ``pivot_root(2)`` (the old root is detached), brings loopback up and drops privileges. Both
render one plan (:func:`_plan`), so they show the same view. :func:`available_backend`
probes by actually running a sandbox; ``strict`` with neither working raises
:class:`IsolationError` (fail closed).

What contains what (measured on Linux 6.x as root; see ``tests/test_isolation.py``):

* **fork bomb**: ``RLIMIT_NPROC`` counts every task (process or thread) of the sandbox uid; the
  kernel refuses the next ``fork`` with ``EAGAIN``. The kernel exempts uid 0 from that limit
  whatever its capabilities, so it only holds because the submission runs as its own non-root uid
  (as root) or as the invoking user (not root: then the limit counts all that user's tasks, so
  PRISM leaves it off unless asked). :class:`Guard` also counts the sandbox's tasks and reports
  ``process limit`` when they reach it, so the parent kills the tree instead of waiting.
* **memory bomb**: ``RLIMIT_AS`` per process (the allocation fails: ``MemoryError`` or torch's
  ``can't allocate memory``). It is per process, so the worst case is the limit times the
  process count; CUDA reserves huge virtual ranges, so leave it off (``None``) on GPUs.
* **disk**: ``RLIMIT_FSIZE`` per file (Python ignores ``SIGXFSZ``: the write fails with
  ``EFBIG``), size-capped tmpfs for ``/tmp`` and ``/dev/shm``, and :class:`Guard`'s quota on the
  artifacts directory (and a host ``tmp_dir``), polled by the parent.
* **time**: the parent's watch loop; :meth:`Guard.kill` and killing the sandbox's init take the
  whole tree down (a pid namespace dies with its init, and setsid() cannot escape it).
"""

from __future__ import annotations
import functools
import glob
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_challenge import scratch
from prism_challenge.evaluator import sabotage
from prism_challenge.evaluator.mountplan import PROBE_TIMEOUT_S, _default_readable, _plan, _traversable, _under
from prism_challenge.evaluator.sandboxargv import BACKENDS, _prefix
from prism_challenge.evaluator.sandboxerror import IsolationError
from prism_challenge.evaluator.sandboxwatch import QuotaExceeded, check_quota, kill_uid, pick_sandbox_uid, tasks_of_uid

MODES = ("strict", "none")
ENV_BACKEND = "PRISM_ISOLATION_BACKEND"  # force "bwrap" or "unshare" (tests, debugging)
DEFAULT_TMP_BYTES = 512 << 20  # private /tmp tmpfs
DEFAULT_SHM_BYTES = 1 << 30  # private /dev/shm tmpfs

__all__ = [
    "BACKENDS",
    "MODES",
    "Guard",
    "IsolationError",
    "Limits",
    "available_backend",
    "limits_preexec",
    "probe",
    "sandbox_prefix",
]


@dataclass(frozen=True)
class Limits:
    """Resource limits of every process in the sandbox (``None``: not limited).

    Attributes:
        address_space_bytes: ``RLIMIT_AS`` per process, bytes (leave ``None`` on CUDA).
        max_processes: ``RLIMIT_NPROC``: tasks (processes and threads) of the sandbox uid.
        max_file_bytes: ``RLIMIT_FSIZE``: largest file a process may write, bytes (the runner's
            stdout/stderr log included).
        max_open_files: ``RLIMIT_NOFILE`` per process.
        memory_bytes: a cgroup v2 ``memory.max`` for each jailed process tree, bytes, independent
            of ``RLIMIT_AS`` (set on CUDA, where no address-space cap can be); ``None``: the
            address-space cap's value (:meth:`cgroup_bytes`).
    """

    address_space_bytes: int | None = None
    max_processes: int | None = None
    max_file_bytes: int | None = None
    max_open_files: int | None = None
    memory_bytes: int | None = None

    def cgroup_bytes(self) -> int | None:
        """The ``memory.max`` a jailed tree's cgroup gets: :attr:`memory_bytes`, else
        :attr:`address_space_bytes` (the cgroup holds the same bytes instead), else ``None``."""
        return self.memory_bytes if self.memory_bytes is not None else self.address_space_bytes

    def rlimits(self) -> list[tuple[int, int]]:
        """``[(resource.RLIMIT_*, value)]`` of the limits that are set (plus no core dumps)."""
        out = [(resource.RLIMIT_CORE, 0)]
        for res, value in (
            (resource.RLIMIT_AS, self.address_space_bytes),
            (resource.RLIMIT_NPROC, self.max_processes),
            (resource.RLIMIT_FSIZE, self.max_file_bytes),
            (resource.RLIMIT_NOFILE, self.max_open_files),
        ):
            if value is not None:
                if value < 1:
                    raise ValueError(f"resource limit {res}: {value} must be positive")
                out.append((res, int(value)))
        return out


def _gpu_devices() -> list[str]:
    return sorted(p for p in glob.glob("/dev/nvidia*") + glob.glob("/dev/dri") if os.path.exists(p))


def _chown_for(uid: int, gid: int, writable: Iterable[str], tmp_dir: str | None, socket_dir: str | None) -> None:
    for p in list(writable) + ([tmp_dir] if tmp_dir else []):
        os.chown(p, uid, gid)
        os.chmod(p, 0o700)
    if socket_dir:
        st = os.stat(socket_dir)
        if not _traversable(socket_dir, uid, gid):
            os.chmod(socket_dir, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
        for entry in os.scandir(socket_dir):
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                os.chown(entry.path, uid, gid)


def sandbox_prefix(
    mode: str,
    *,
    writable: Sequence[Path | str],
    hidden: Sequence[Path | str],
    tmp_dir: Path | str | None,
    socket_dir: Path | str | None,
    bundle_dir: Path | str | None,
    readable: Sequence[Path | str] | None = None,
    limits: Limits | None = None,
    uid: int | None = None,
    backend: str | None = None,
    tmp_bytes: int = DEFAULT_TMP_BYTES,
    shm_bytes: int = DEFAULT_SHM_BYTES,
) -> list[str]:
    """The argv prefix that runs a command in the sandbox (``[]`` for mode ``"none"``).

    Put it before ``python -m torch.distributed.run ...``. For ``strict`` see the module
    docstring for what the sandbox allows. Side effects (strict, as root): the ``writable``
    directories and ``tmp_dir`` are chowned to the sandbox uid (mode 0700), every Unix socket
    already in ``socket_dir`` is chowned to it (so create the feeder socket first), and
    ``socket_dir`` gets ``o+x`` if the uid could not traverse it. The sandbox sees:

    * ``writable`` (read-write, e.g. the artifacts directory), ``tmp_dir`` at ``/tmp``
      (read-write; ``None``: a tmpfs of ``tmp_bytes``), a private ``/dev/shm`` of ``shm_bytes``;
    * ``bundle_dir`` and ``socket_dir`` read-only (connecting to a socket needs no write access
      to its directory), the interpreter and ``sys.path`` (``readable``, default: this
      interpreter's prefixes, the ``sys.path`` it starts with, this package's source dir and
      ``$LD_LIBRARY_PATH``), the system trees, the files of :data:`ETC_FILES`, :data:`SYS_TREES`,
      a minimal ``/dev`` with the GPU nodes, a new ``/proc``; nothing else of the host exists;
    * ``hidden``: inside one of those trees, directories as empty tmpfs (mode 000), files as an
      empty file of mode 000; reading either fails (``EACCES``) once capabilities are dropped.
      Paths that do not exist, or are outside every bound tree (absent anyway), are skipped.

    Args:
        mode: ``"strict"`` or ``"none"``.
        limits: rlimits applied inside the sandbox, right before the uid drop and ``exec``.
        uid: the sandbox uid (root only); default :func:`pick_sandbox_uid`. Not root: the
            sandbox keeps the invoking uid (bubblewrap or ``unshare --user`` map it).
        backend: ``"bwrap"`` or ``"unshare"``; default :func:`available_backend`.

    Raises:
        IsolationError: unknown mode; strict with no working backend (the message says to
            install bubblewrap or pass ``--isolation none``); a hidden path that contains a
            writable path, the bundle or the socket directory.
    """
    if mode == "none":
        return []
    if mode != "strict":
        raise IsolationError(f"isolation mode {mode!r}: expected one of {', '.join(MODES)}")
    if sabotage.active():  # the trusted parent switched confinement off (tests only): no sandbox
        return []
    backend = backend or available_backend()
    if backend is None:
        raise IsolationError(
            "strict isolation needs a working sandbox and none was found: install bubblewrap "
            "(apt-get install bubblewrap) or make unshare(1) work (user namespaces), or run with "
            "--isolation none for local work (the run is then not isolated)"
        )
    root = os.geteuid() == 0
    if root and uid is None:
        uid = pick_sandbox_uid()
    if not root:
        uid = None
    gid = uid

    def norm(p: Path | str | None) -> str | None:
        return None if p is None else os.path.realpath(os.fspath(p))

    w = [norm(p) for p in writable]
    h = [norm(p) for p in hidden]
    r = _default_readable() if readable is None else [norm(p) for p in readable]
    r = [p for p in r if os.path.exists(p)]  # nothing to bind for a path that does not exist
    t, s, bdir = norm(tmp_dir), norm(socket_dir), norm(bundle_dir)
    if t is not None and any(_under(p, "/tmp") for p in r):
        raise IsolationError(
            f"tmp_dir {t}: a host directory at /tmp would cover the interpreter or package paths under "
            "/tmp that the sandbox binds; pass tmp_dir=None (a private tmpfs) or install outside /tmp"
        )
    for p in w + ([t] if t else []) + ([s] if s else []) + ([bdir] if bdir else []):
        if not os.path.isdir(p):
            raise IsolationError(f"{p}: not a directory (the sandbox binds it)")
    plan = _plan(writable=w, hidden=h, tmp_dir=t, socket_dir=s, bundle_dir=bdir, readable=r,
                 tmp_bytes=tmp_bytes, shm_bytes=shm_bytes, devices=_gpu_devices())
    if uid is not None:
        _chown_for(uid, gid, w, t, s)
    return _prefix(backend, plan, uid=uid, gid=gid, limits=limits)


# -------------------------------------------------------------------------------------------
# Probing
# -------------------------------------------------------------------------------------------
def probe(backend: str) -> tuple[bool, str]:
    """Run ``python -S -c pass`` in a strict sandbox of ``backend``; (works, reason if not).

    The probe uses the real flags (network, pid, mount namespaces, read-only root, the uid drop
    as root), so a backend that passes it can run the real command.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="prism-probe-", dir=scratch.root()) as d:
        wdir = Path(d) / "w"
        wdir.mkdir()
        try:
            argv = sandbox_prefix("strict", writable=[wdir], hidden=[], tmp_dir=None, socket_dir=None,
                                  bundle_dir=None, backend=backend)
        except (IsolationError, OSError) as exc:
            return False, str(exc)
        code = "import os; open(os.path.join(%r, 'ok'), 'w').write('1')" % str(wdir)
        try:
            res = subprocess.run(argv + [sys.executable, "-S", "-c", code], capture_output=True,
                                 timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, str(exc)
        if res.returncode != 0 or not (wdir / "ok").is_file():
            return False, (res.stderr.decode(errors="replace").strip().splitlines() or [f"exit {res.returncode}"])[-1]
    return True, ""


@functools.lru_cache(maxsize=None)
def _probe_cached(backend: str) -> tuple[bool, str]:
    return probe(backend)


def available_backend() -> str | None:
    """The first working sandbox backend, ``"bwrap"`` then ``"unshare"``; ``None`` if neither.

    Each backend is probed once per process by running a real sandbox (:func:`probe`).
    ``$PRISM_ISOLATION_BACKEND`` (``bwrap`` or ``unshare``) restricts the choice to one backend.
    """
    forced = os.environ.get(ENV_BACKEND)
    order = [forced] if forced in BACKENDS else list(BACKENDS)
    for backend in order:
        if shutil.which("bwrap" if backend == "bwrap" else "unshare") and _probe_cached(backend)[0]:
            return backend
    return None


# -------------------------------------------------------------------------------------------
# Limits for a plain subprocess (mode "none", or the held-out process)
# -------------------------------------------------------------------------------------------
def limits_preexec(
    *,
    address_space_bytes: int | None = None,
    max_processes: int | None = None,
    max_file_bytes: int | None = None,
    max_open_files: int | None = None,
    die_with_parent: bool = True,
) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that sets rlimits in the child.

    Sets ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` (soft = hard, so
    the child cannot raise them), ``RLIMIT_CORE = 0``, and with ``die_with_parent`` a
    ``PR_SET_PDEATHSIG`` of ``SIGKILL`` (the child dies when the thread that started it exits).
    ``RLIMIT_NPROC`` has no effect on a process of uid 0 (the kernel exempts it); in strict mode
    prefer ``sandbox_prefix(limits=...)``, which sets the same limits after the uid drop.
    ``preexec_fn`` runs between fork and exec: with other threads running (the feeder) it is
    only safe because it calls nothing but ``setrlimit`` and ``prctl``.

    Raises:
        ValueError: a non-positive limit.
    """
    limits = Limits(address_space_bytes, max_processes, max_file_bytes, max_open_files).rlimits()
    parent = os.getpid()

    def _apply() -> None:
        for res, value in limits:
            resource.setrlimit(res, (value, value))
        if die_with_parent:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(137)

    return _apply


class Guard:
    """The parent's periodic checks on a running sandbox: disk quota and process count.

    Call :meth:`check` from the watch loop (it does the work at most every ``interval_s``); a
    non-``None`` reason means: kill the tree (:meth:`kill`, then the launcher's own kill) and
    record the reason. :meth:`summary` is what goes in the run manifest.

    Args:
        paths: directories under the quota (the artifacts directory, a host ``tmp_dir``).
        quota_bytes: most bytes those paths may use together (``None``: no quota).
        max_entries: most files and directories they may hold (``None``: no limit).
        uid: the sandbox uid (count and kill by uid), or ``None``.
        max_processes: the ``RLIMIT_NPROC`` of the sandbox; reaching it is reported.
    """

    def __init__(
        self,
        paths: Sequence[Path | str],
        *,
        quota_bytes: int | None,
        max_entries: int | None = None,
        uid: int | None = None,
        max_processes: int | None = None,
        interval_s: float = 0.5,
    ):
        self.paths = [Path(p) for p in paths]
        self.quota_bytes, self.max_entries = quota_bytes, max_entries
        self.uid, self.max_processes = uid, max_processes
        self.interval_s = interval_s
        self._next = 0.0
        self.peak_bytes = 0
        self.peak_tasks = 0
        self.reason: str | None = None

    def check(self, now: float | None = None) -> str | None:
        """Run the checks if ``interval_s`` passed; the first violation found, else ``None``."""
        now = time.monotonic() if now is None else now
        if self.reason is not None or now < self._next:
            return self.reason
        self._next = now + self.interval_s
        try:
            used = check_quota(self.paths, self.quota_bytes, self.max_entries)
            self.peak_bytes = max(self.peak_bytes, used)
        except QuotaExceeded as exc:
            self.reason = f"quota: {exc}"
            return self.reason
        if self.uid is not None and self.max_processes is not None:
            _, tasks = tasks_of_uid(self.uid)
            self.peak_tasks = max(self.peak_tasks, tasks)
            if tasks >= self.max_processes:
                self.reason = (
                    f"process limit: the sandbox reached {tasks} tasks (limit {self.max_processes}); "
                    "a fork bomb was contained and stopped"
                )
        return self.reason

    def kill(self) -> int:
        """Kill every process of the sandbox uid (no-op without one); returns the count."""
        return kill_uid(self.uid) if self.uid is not None else 0

    def summary(self) -> dict[str, Any]:
        """``{"uid", "quota_bytes", "peak_bytes", "max_processes", "peak_tasks", "reason"}``."""
        return {
            "uid": self.uid,
            "quota_bytes": self.quota_bytes,
            "peak_bytes": self.peak_bytes,
            "max_processes": self.max_processes,
            "peak_tasks": self.peak_tasks,
            "reason": self.reason,
        }


def _main(argv: list[str]) -> int:
    """``python -m prism_challenge.evaluator.isolation``: print the backend and probe results."""
    for backend in BACKENDS:
        ok, why = probe(backend) if shutil.which("bwrap" if backend == "bwrap" else "unshare") else (False, "not installed")
        print(f"{backend}: {'works' if ok else 'unavailable: ' + why}")
    print(f"available_backend: {available_backend()}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
