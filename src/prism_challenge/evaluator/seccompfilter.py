"""The kernel-call filter of every sandboxed process (seccomp, built with libseccomp).

The trusted parent compiles one filter with libseccomp (through ``pyseccomp``, a ctypes binding
of the system's ``libseccomp.so.2`` with the API of libseccomp's own Python bindings) and exports
it as a BPF program (:func:`program`). The sandbox's init
(:mod:`~prism_challenge.evaluator.sandbox_init`) loads it with ``prctl(PR_SET_SECCOMP)`` as its
very last step, after its own mounts, the uid drop and ``no_new_privs``, right before it execs
the harness's command: every process of the sandbox (torchrun's agent, the warm ranks, the
ranks, the parameter, held-out, re-scoring and probe children, ``g++`` started by
``torch.compile``) runs under it, since a filter is inherited across ``fork`` and ``exec`` and
cannot be removed. No BPF is written here: libseccomp generates it.

What it denies (:data:`DENIED`, ``EPERM``: callers see "Operation not permitted" and take their
fallback) is the kernel's attack surface that neither torch nor the CUDA driver uses: creating
or entering namespaces (``unshare``, ``setns``, ``clone`` with any ``CLONE_NEW*`` flag),
reading or writing another process (``ptrace``, ``process_vm_readv``/``writev``, ``kcmp``),
``bpf``, ``io_uring``, the key store, ``perf_event_open``, ``userfaultfd``, every mount call
(old and new API), ``chroot``, module loading, ``kexec``, ``reboot``, swap, accounting, clock
setting, raw port I/O, ``open_by_handle_at``, the ``TIOCSTI``/``TIOCLINUX`` terminal injection
ioctls and ``AF_VSOCK`` sockets (a VM's channel to its hypervisor, which no network namespace
covers). It also denies what lets a process steer or read the host's **page cache** of files it
may only read (:data:`PAGE_CACHE`): two jailed children share that cache, so one that evicts
pages of the interpreter's install (``posix_fadvise(POSIX_FADV_DONTNEED)``) and one that tests
them without blocking (``preadv2(RWF_NOWAIT)``) had a channel of tens of kilobytes, and a
re-scoring child relayed the true rows to the blind probe child through it (red team rt19: the
probe passed a model that peeks at every target). Denied: ``fadvise64``, ``cachestat``,
``process_madvise``, Linux AIO (``io_setup``: its reads take ``RWF_NOWAIT`` too), ``madvise``
with ``MADV_COLD`` or ``MADV_PAGEOUT``, and ``preadv2``/``pwritev2`` with ``RWF_NOWAIT``. Left:
a child can still bring cold pages in by reading them, and another can tell which came in (a
fault maps the cached pages around the one touched); :mod:`~prism_challenge.evaluator.pagecache`
empties the cache before each blind probe child for that.

``clone3`` gets ``ENOSYS``: its flags sit in a struct a filter cannot read, and glibc
falls back to ``clone`` on ``ENOSYS``, whose flags the filter checks (Docker's default profile
does the same). System calls of another ABI (i386 ``int 0x80`` and x32 on x86-64) kill the
process (libseccomp's bad-architecture action), so the list cannot be bypassed by their numbers.

Why a deny-list and not an allow-list: the CUDA driver is closed and its set of system calls
changes with the driver version; an allow-list that missed one would break GPU runs on some
hosts only, and it cannot be checked on a host without the GPU. Everything not named here was
already reachable by any unprivileged process of the sandbox uid, inside namespaces that hide
the host; the list closes the calls that reach past those namespaces or widen the kernel's
attack surface.

Switched off only from the trusted side, by :mod:`~prism_challenge.evaluator.sabotage`
(``PRISM_SABOTAGE`` in the parent's environment, which the sandbox never passes on).
"""

from __future__ import annotations

import base64
import errno
import functools
import hashlib
import tempfile

DENIED = (
    # namespaces (clone is filtered by its flags only: threads and fork keep working)
    "unshare", "setns",
    # another process's memory and state
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    # kernel attack surface torch does not use
    "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
    "perf_event_open", "userfaultfd", "lookup_dcookie", "fanotify_init",
    # mounts, old and new API, and the root
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",
    # the host itself
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl",
    "ioperm", "open_by_handle_at", "name_to_handle_at", "syslog", "vhangup", "sethostname", "setdomainname",
    "uselib",
    # the page cache of files the child may only read (PAGE_CACHE)
    "fadvise64", "fadvise64_64", "cachestat", "process_madvise", "io_setup",
)
"""System calls that fail with ``EPERM`` whatever their arguments."""

PAGE_CACHE = {"MADV_COLD": 20, "MADV_PAGEOUT": 21, "RWF_NOWAIT": 0x8}
"""``madvise(2)`` advice that moves file pages out of the cache, and the ``preadv2(2)`` /
``pwritev2(2)`` flag that reads the cache without blocking (``<asm-generic/mman-common.h>``,
``<linux/fs.h>``): each gets ``EPERM``."""

CLONE_NEW_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                   "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                   "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}
"""``clone(2)``'s namespace flags (``<linux/sched.h>``): a ``clone`` with any of them gets ``EPERM``."""

DENIED_IOCTLS = {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C}
"""``ioctl(2)`` requests that get ``EPERM`` (``<asm-generic/ioctls.h>``): typing into a terminal."""

AF_VSOCK = 40
"""``socket(2)`` family that gets ``EPERM`` (``<linux/socket.h>``)."""


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing, or it refused the filter."""


@functools.lru_cache(maxsize=1)
def program() -> bytes:
    """The filter as a BPF program (``struct sock_filter`` array, 8 bytes an instruction, for
    this machine's architecture), generated by libseccomp; computed once per process.

    Raises:
        SeccompUnavailable: ``pyseccomp`` or ``libseccomp.so.2`` cannot be loaded, or a system
            call of :data:`DENIED` is unknown to libseccomp here.
    """
    sc = _binding()
    eperm = sc.ERRNO(errno.EPERM)
    try:
        f = sc.SyscallFilter(sc.ALLOW)
        f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
        for name in DENIED:
            if sc.resolve_syscall(sc.system_arch(), name) < 0:
                continue  # not a system call on this architecture (iopl on arm64...): nothing to deny
            f.add_rule(eperm, name)
        for flag in CLONE_NEW_FLAGS.values():
            f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for request in DENIED_IOCTLS.values():
            f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
        f.add_rule(eperm, "socket", sc.Arg(0, sc.EQ, AF_VSOCK))
        for advice in ("MADV_COLD", "MADV_PAGEOUT"):
            f.add_rule(eperm, "madvise", sc.Arg(2, sc.EQ, PAGE_CACHE[advice]))
        for name in ("preadv2", "pwritev2"):  # flags: the sixth argument
            f.add_rule(eperm, name, sc.Arg(5, sc.MASKED_EQ, PAGE_CACHE["RWF_NOWAIT"], PAGE_CACHE["RWF_NOWAIT"]))
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            return out.read()
    except OSError as exc:
        raise SeccompUnavailable(f"libseccomp refused the kernel-call filter: {exc}") from None


def _binding():
    try:
        import pyseccomp
    except (ImportError, OSError) as exc:  # the binding raises when the library is missing
        raise SeccompUnavailable(
            f"the kernel-call filter needs libseccomp (libseccomp2) and pyseccomp: {exc}") from None
    return pyseccomp


def syscall_number(name: str) -> int:
    """``name``'s system call number on this machine's architecture (negative: none here).

    Raises:
        SeccompUnavailable: see :func:`program`.
    """
    sc = _binding()
    return sc.resolve_syscall(sc.system_arch(), name)


def spec_entry() -> str | None:
    """What the sandbox init's spec carries under ``"seccomp"``: the program, base64; ``None``
    in sabotage mode (:func:`~prism_challenge.evaluator.sabotage.active`).

    Raises:
        SeccompUnavailable: see :func:`program` (a strict sandbox then fails closed).
    """
    from prism_challenge.evaluator import sabotage

    if sabotage.active():
        return None
    return base64.b64encode(program()).decode("ascii")


def fingerprint() -> str:
    """SHA-256 of :func:`program` (hex), or ``"off"`` in sabotage mode: part of the self-test's
    cache key, so a changed filter is tested again."""
    entry = spec_entry()
    return "off" if entry is None else hashlib.sha256(entry.encode()).hexdigest()
