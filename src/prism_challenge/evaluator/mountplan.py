"""The sandbox's filesystem view: one mount plan, an allow-list on an empty root.

:func:`_plan` lists the mount operations, in order, that build the view the module docstring of
:mod:`~prism_challenge.evaluator.isolation` describes: the system trees, a few files of ``/etc``
(:data:`ETC_FILES`), the device and topology trees of ``/sys`` (:data:`SYS_TREES`), the
interpreter and its ``sys.path`` (:func:`_default_readable`), the run's own directories, and
``hidden`` paths covered. Both backends render this one plan
(:mod:`~prism_challenge.evaluator.sandboxargv`), so they show the same view.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prism_challenge import scratch
from prism_challenge.evaluator.sandboxerror import IsolationError

HIDDEN_TMPFS_BYTES = 4096
PROBE_TIMEOUT_S = 20.0

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
