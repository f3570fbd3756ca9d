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
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_challenge import scratch
from prism_challenge.evaluator import sabotage, seccompfilter

MODES = ("strict", "none")
BACKENDS = ("bwrap", "unshare")
ENV_BACKEND = "PRISM_ISOLATION_BACKEND"  # force "bwrap" or "unshare" (tests, debugging)
ENV_CWD = "PRISM_SANDBOX_CWD"  # the caller's working directory, from outside bwrap to its init

SANDBOX_UID_MIN = 200_000  # dedicated uids for sandboxes (no passwd entry needed)
SANDBOX_UID_SPAN = 50_000
DEFAULT_TMP_BYTES = 512 << 20  # private /tmp tmpfs
DEFAULT_SHM_BYTES = 1 << 30  # private /dev/shm tmpfs
HIDDEN_TMPFS_BYTES = 4096
PROBE_TIMEOUT_S = 20.0

__all__ = [
    "BACKENDS",
    "MODES",
    "Guard",
    "IsolationError",
    "Limits",
    "QuotaExceeded",
    "artifacts_usage",
    "available_backend",
    "check_quota",
    "kill_uid",
    "limits_preexec",
    "pick_sandbox_uid",
    "probe",
    "sandbox_prefix",
    "tasks_of_uid",
]


class IsolationError(RuntimeError):
    """Strict isolation was requested but cannot be provided (no working backend, bad paths)."""


class QuotaExceeded(RuntimeError):
    """The artifacts directory (plus a host tmp dir) holds more than its quota."""


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


# The unshare backend's init: an ordinary module file of this package, run by path.
_HELPER = Path(__file__).with_name("sandbox_init.py")


def _helper_argv(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-I", "-S", str(_HELPER), json.dumps(spec, separators=(",", ":")), "--"]


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
# The mount plan (one plan, rendered for bwrap or for the helper)
# -------------------------------------------------------------------------------------------
# The view is an allow-list: an empty root (tmpfs) with read-only binds of the system trees,
# a few files of /etc, the device and topology trees of /sys, the interpreter and sys.path,
# and the run's own directories. Everything else of the host is absent (ENOENT).
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # a dir or a merged-usr link
# /etc, file by file: what glibc, the dynamic linker and Python read. /etc as a whole would also
# show host configuration that can hold secrets (pip.conf, npmrc, gitconfig, ssh and database
# configs, machine-id), and hiding a deny-list (shadow, gshadow, ...) misses whatever is added
# later. passwd and group hold no secrets (the hashes are in shadow) and let getpwuid/getgrgid work.
ETC_FILES = (
    "ld.so.cache",  # the dynamic linker finds libraries in /usr/lib/<triplet> (libstdc++, libcuda)
    "passwd", "group", "nsswitch.conf",  # getpwuid/getgrgid and how lookups are done
    "hosts", "host.conf", "gai.conf",  # "localhost" for torchrun's rendezvous and gloo
    "localtime",  # time.localtime (a link into /usr/share/zoneinfo: its target is bound)
    "alternatives",  # symlinks only: /usr/bin/cc, c++, awk... resolve through it
)  # not nccl.conf: NCCL's settings are the jail's environment alone (evaluator/envpolicy.py)
# sysfs, the same subset flatpak exposes: CPU and NUMA topology (sysconf, OpenMP), PCI and GPU
# topology (CUDA, NVML, NCCL). Kernel state, no host files; read-only.
SYS_TREES = ("/sys/block", "/sys/bus", "/sys/class", "/sys/dev", "/sys/devices")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")  # the unshare backend's /dev
ROOT_TMPFS_BYTES = 1 << 20  # the unshare backend's empty root (directories and mount points only)


@dataclass
class _Plan:
    """Mount operations, in order, on an empty root:

    ``("tmpfs", path, size, mode)``, ``("dir", path, mode)``, ``("bind", src, dst, ro)``,
    ``("symlink", target, path)``, ``("dev", path)`` (a minimal /dev), ``("devbind", src, dst)``
    (a device node, read-write), ``("proc", path)`` (a new /proc), ``("remount_ro", path)``.
    """

    ops: list[tuple] = field(default_factory=list)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _traversable(path: str, uid: int, gid: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


@functools.lru_cache(maxsize=8)
def _interpreter_path(executable: str, pythonpath: str | None, pythonhome: str | None) -> tuple[str, ...]:
    """``sys.path`` of ``executable`` as it starts (what the sandboxed ranks get): site-packages,
    ``.pth`` entries (the editable src dir), ``$PYTHONPATH``. Not what a host program (pytest,
    say) inserted into its own ``sys.path`` at run time."""
    try:
        res = subprocess.run([executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, cwd="/",
                             stdin=subprocess.DEVNULL)
        return tuple(json.loads(res.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return tuple(sys.path)


def _default_readable() -> list[str]:
    """Paths the sandboxed interpreter needs: its prefixes, the executable, its ``sys.path``,
    the package's own source tree, ``$LD_LIBRARY_PATH``."""
    out = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    out += [p for p in _interpreter_path(sys.executable, os.environ.get("PYTHONPATH"), os.environ.get("PYTHONHOME"))
            if p and os.path.isabs(p)]
    import prism_challenge

    out.append(str(Path(prism_challenge.__file__).resolve().parents[1]))
    from prism_challenge.evaluator.envpolicy import ld_library_dirs, libcuda_dirs

    out += ld_library_dirs() + libcuda_dirs()
    seen, uniq = set(), []
    for p in out:
        rp = os.path.realpath(p)
        if rp == os.sep:  # an empty $PYTHONPATH entry reads as the cwd, "/" for the probe: never the whole host
            continue
        if os.path.exists(rp) and rp not in seen:
            seen.add(rp)
            uniq.append(rp)
    return uniq


def _system_view() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(link, target)] of top-level merged-usr links, [(src, dst)] read-only binds) of the system."""
    links: list[tuple[str, str]] = []
    binds: list[tuple[str, str]] = []
    for p in SYSTEM_TREES:
        if os.path.islink(p):
            links.append((p, os.readlink(p)))
        elif os.path.isdir(p):
            binds.append((p, p))
    py_etc = f"/etc/python{sys.version_info[0]}.{sys.version_info[1]}"  # Debian's sitecustomize
    for name in ETC_FILES + ((os.path.basename(py_etc),) if os.path.isdir(py_etc) else ()):
        dst = os.path.join("/etc", name)
        if os.path.exists(dst):
            binds.append((os.path.realpath(dst), dst))  # a link's target, at the link's place
    binds += [(p, p) for p in SYS_TREES if os.path.isdir(p) and not os.path.islink(p)]
    return links, binds


def _plan(
    *,
    writable: Sequence[str],
    hidden: Sequence[str],
    tmp_dir: str | None,
    socket_dir: str | None,
    bundle_dir: str | None,
    readable: Sequence[str],
    tmp_bytes: int,
    shm_bytes: int,
    devices: Sequence[str] = (),
) -> _Plan:
    needed: list[tuple[str, bool]] = [(p, True) for p in readable]
    if bundle_dir:
        needed.append((bundle_dir, True))
    if socket_dir:
        needed.append((socket_dir, True))
    needed += [(p, False) for p in writable]
    for h in hidden:
        for p, ro in needed:
            if ro is False or p in (bundle_dir, socket_dir):
                if _under(p, h):
                    raise IsolationError(f"hidden path {h} contains {p}, which the sandbox needs")

    def shown(p: str) -> bool:
        return not any(_under(p, h) for h in hidden)

    plan = _Plan()
    mounts: list[tuple[str, str | None]] = []  # (dst, src of a bind, else None), in mount order
    dirs: set[str] = {"/"}

    def parents(dst: str) -> None:
        """Create the directories above ``dst`` (mode 0755) where the host tree is not bound."""
        parts = Path(dst).parts
        for i in range(2, len(parts)):
            anc = str(Path(*parts[:i]))
            if anc in dirs:
                continue
            holder = max((m for m in mounts if _under(anc, m[0])), key=lambda m: len(m[0]), default=None)
            if holder is not None and holder[1] == holder[0]:
                return  # inside a bind of the same host path: the directories exist
            plan.ops.append(("dir", anc, 0o755))
            dirs.add(anc)

    def mount(op: tuple, dst: str, src: str | None = None) -> None:
        parents(dst)
        plan.ops.append(op)
        mounts.append((dst, src))
        dirs.add(dst)

    links, system = _system_view()
    for link, target in links:
        plan.ops.append(("symlink", target, link))
        dirs.add(link)
    for src, dst in system:
        if shown(dst) and shown(src):
            mount(("bind", src, dst, True), dst, dst if src == dst else src)
    mount(("dev", "/dev"), "/dev")
    for dev in devices:
        mount(("devbind", dev, dev), dev, dev)
    mount(("tmpfs", "/dev/shm", shm_bytes, 0o1777), "/dev/shm")
    mount(("proc", "/proc"), "/proc")
    if tmp_dir is not None:
        mount(("bind", tmp_dir, "/tmp", False), "/tmp", tmp_dir)
    else:
        mount(("tmpfs", "/tmp", tmp_bytes, 0o1777), "/tmp")

    binds = [(p, ro) for p, ro in needed if shown(p)]
    binds.sort(key=lambda b: (len(Path(b[0]).parts), b[0]))
    sys_dsts = [dst for src, dst in system if src == dst]
    # a read-only bind inside another read-only bind (or a system tree) shows the same files: drop it;
    # the bundle and the socket dir always get their own bind (the view must not depend on the rest)
    binds = [(p, ro) for p, ro in binds
             if not (ro and p not in (bundle_dir, socket_dir)
                     and (any(_under(p, d) for d in sys_dsts)
                          or any(q != p and qro and _under(p, q) for q, qro in binds)))]
    seen: set[str] = set()
    for p, ro in binds:
        if p not in seen:
            seen.add(p)
            mount(("bind", p, p, ro), p, p)

    for h in hidden:  # a hidden path inside a bound tree: covered
        if not os.path.lexists(h):
            continue
        holder = max((m for m in mounts if _under(h, m[0])), key=lambda m: len(m[0]), default=None)
        if holder is None or holder[1] != holder[0]:
            continue  # on the empty root, a tmpfs, or a bind of another host path: not there
        if os.path.isdir(h):
            plan.ops.append(("tmpfs", h, HIDDEN_TMPFS_BYTES, 0o000))
        else:
            plan.ops.append(("bind", _blank_file(), h, True))
    plan.ops.append(("remount_ro", "/"))
    return plan


def _blank_file() -> str:
    """An empty file of mode 000 owned by this uid, bound over hidden files (reads fail): in
    the current owner folder (:func:`prism_challenge.scratch.root`), which goes with the run."""
    try:
        f = scratch.root() / ".blank"
        if not f.is_file() or f.is_symlink() or f.stat().st_size:
            f.unlink(missing_ok=True)
            f.touch()
        os.chmod(f, 0)
    except OSError as exc:
        raise IsolationError(f"cannot prepare the blank file for hidden paths: {exc}") from None
    return str(f)


def _render_bwrap(plan: _Plan) -> list[str]:
    out: list[str] = []
    for op in plan.ops:
        kind = op[0]
        if kind == "tmpfs":
            out += ["--size", str(op[2]), "--perms", f"{op[3]:04o}", "--tmpfs", op[1]]
        elif kind == "dir":
            out += ["--perms", f"{op[2]:04o}", "--dir", op[1]]
        elif kind == "bind":
            out += ["--ro-bind" if op[3] else "--bind", op[1], op[2]]
        elif kind == "symlink":
            out += ["--symlink", op[1], op[2]]
        elif kind == "dev":
            out += ["--dev", op[1]]
        elif kind == "devbind":
            out += ["--dev-bind", op[1], op[2]]
        elif kind == "proc":
            out += ["--proc", op[1]]
        elif kind == "remount_ro":
            out += ["--remount-ro", op[1]]
        else:
            raise IsolationError(f"unknown mount op {kind!r}")
    return out


def _gpu_devices() -> list[str]:
    return sorted(p for p in glob.glob("/dev/nvidia*") + glob.glob("/dev/dri") if os.path.exists(p))


def _prefix(
    backend: str,
    plan: _Plan,
    *,
    uid: int | None,
    gid: int | None,
    limits: Limits | None,
) -> list[str]:
    root = os.geteuid() == 0
    spec: dict[str, Any] = {"setsid": True, "rlimits": limits.rlimits() if limits else []}
    try:  # loaded last, right before exec, by the inner init
        spec["seccomp"] = seccompfilter.spec_entry()
    except seccompfilter.SeccompUnavailable as exc:
        raise IsolationError(str(exc)) from None
    env = {"TMPDIR": "/tmp"}
    if uid is not None:
        spec["uid"], spec["gid"] = uid, (uid if gid is None else gid)
        env.update({"HOME": "/tmp", "USER": "prism", "LOGNAME": "prism"})
    spec["env"] = env
    if backend == "bwrap":
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise IsolationError("bwrap is not installed")
        argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if root:
            argv += ["--cap-drop", "ALL"]
            if uid is not None:
                argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
                spec["capbset"] = True
        argv += _render_bwrap(plan)  # bwrap starts from an empty root (a tmpfs) of its own
        argv.append("--")
        spec["cwd_env"] = ENV_CWD
        return _helper_argv({"pass_cwd": ENV_CWD}) + argv + _helper_argv(spec)
    if backend == "unshare":
        unshare = shutil.which("unshare")
        if unshare is None:
            raise IsolationError("unshare is not installed")
        outer = _helper_argv({"pdeathsig": os.getpid()})
        argv = [unshare]
        if not root:
            argv += ["--user", "--map-root-user"]
        argv += ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                 "--propagation", "private", "--"]
        inner = dict(spec)
        inner["mounts"] = plan.ops  # built on an empty tmpfs, then pivot_root into it
        inner["root_bytes"] = ROOT_TMPFS_BYTES
        inner["dev_nodes"] = list(DEV_NODES)
        inner["lo"] = True
        inner["init"] = True
        inner["capbset"] = True
        inner["dropcaps"] = True
        return outer + argv + _helper_argv(inner)
    raise IsolationError(f"unknown isolation backend {backend!r}; expected one of {', '.join(BACKENDS)}")


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
