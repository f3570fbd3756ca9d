"""The sandbox proves itself: escape probes run inside it before PRISM trusts it with work.

:func:`run_probes` starts one child through the real launcher (:class:`~prism_challenge.evaluator.jail.Jail`,
strict) and tries, from inside, each of :data:`PROBES`:

* ``host file``: read a canary file the self-test wrote on the host (mode 0644, in a folder the
  sandbox does not bind: only the sandbox's view can stop the read);
* ``network``: connect to a TCP listener the parent opened on every host address (the host's
  loopback and each non-loopback IPv4 address): the sandbox's loopback is its own;
* ``write outside``: create a file in a host folder of mode 0777 that is not the child's
  artifacts folder;
* ``privilege``: any effective capability, ``setuid(0)`` from a non-root uid, or mounting a tmpfs;
* ``denied system call``: the kernel-call filter not in force (``Seccomp:`` of
  ``/proc/self/status`` is not 2), or ``unshare(CLONE_NEWUSER)`` succeeding.

Each probe is judged twice where the parent can see it: the probe's own report, and the host's
side (the file written outside exists, the listener took a connection). Any success refuses the
host (:class:`SelfTestFailed`, naming the probes); so does a probe child that did not run.
:func:`require` runs before ``prism serve`` takes work (always) and before ``prism eval`` (once
per host, PRISM version, kernel, sandbox backend and filter: a pass is cached in
``selftest/`` of PRISM's cache folder, ``$PRISM_CACHE_DIR`` or the user cache directory). The
model is codejail-service, which runs its own escape tests at start.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import textwrap
from pathlib import Path

from prism_challenge import scratch

PROBES = ("host file", "network", "write outside", "privilege", "denied system call")
PROBE_TIMEOUT_S = 60.0
CLONE_NEWUSER = 0x10000000

_CODE = textwrap.dedent('''
    import ctypes, json, os, socket, sys
    arg = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def host_file():
        try:
            with open(arg["canary"]) as f:
                return f.read() == arg["token"]
        except OSError:
            return False
    def network():
        for addr in arg["addrs"]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect((addr, arg["port"]))
                return True
            except OSError:
                pass
            finally:
                s.close()
        return False
    def write_outside():
        try:
            with open(arg["outside"], "w") as f:
                f.write(arg["token"])
            return True
        except OSError:
            return False
    def privilege():
        with open("/proc/self/status") as f:
            caps = [l.split()[1] for l in f if l.startswith("CapEff:")]
        if caps and int(caps[0], 16):
            return True
        if os.getuid() != 0:
            try:
                os.setuid(0)
                return True
            except OSError:
                pass
        point = os.path.join(arg["artifacts"], "mnt")
        os.makedirs(point, exist_ok=True)
        if libc.mount(b"none", point.encode(), b"tmpfs", 0, None) == 0:
            libc.umount2(point.encode(), 2)
            return True
        return False
    def denied_system_call():
        with open("/proc/self/status") as f:
            mode = [l.split()[1] for l in f if l.startswith("Seccomp:")]
        if mode != ["2"]:
            return True
        return libc.syscall(ctypes.c_long(arg["unshare"]), ctypes.c_long(arg["newuser"])) == 0
    out = {"host file": host_file(), "network": network(), "write outside": write_outside(),
           "privilege": privilege(), "denied system call": denied_system_call()}
    print(json.dumps(out))
''')


class SelfTestFailed(RuntimeError):
    """The sandbox let a probe out, or could not run the probes: this host cannot confine
    submissions. ``probes``: the names of :data:`PROBES` that got out (empty: it did not run)."""

    def __init__(self, message: str, probes: list[str]):
        super().__init__(message)
        self.probes = probes


def _host_addresses() -> list[str]:
    """127.0.0.1 and the host's non-loopback IPv4 addresses (as far as its name resolves)."""
    found = ["127.0.0.1"]
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            addr = info[4][0]
            if addr not in found and not addr.startswith("127."):
                found.append(addr)
    except OSError:
        pass
    return found


def _unshare_number() -> int:
    from prism_challenge.evaluator.seccompfilter import syscall_number

    return syscall_number("unshare")


def run_probes() -> list[str]:
    """Run :data:`PROBES` in a strict sandbox; the names of those that got out, in order.

    Raises:
        SelfTestFailed: the probe child did not run to its report (names no probe).
        IsolationError: no strict sandbox can be started here at all.
    """
    from prism_challenge.evaluator.isolation import Limits
    from prism_challenge.evaluator.jail import Jail

    base = scratch.mkdtemp("prism-selftest-")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        base.chmod(0o755)
        for name in ("bundle", "artifacts", "outside"):
            (base / name).mkdir()
        (base / "outside").chmod(0o777)
        token = os.urandom(16).hex()
        canary = base / "canary.txt"
        canary.write_text(token)
        canary.chmod(0o644)
        listener.bind(("0.0.0.0", 0))
        listener.listen(8)
        listener.setblocking(False)
        arg = {"canary": str(canary), "token": token, "addrs": _host_addresses(), "port": listener.getsockname()[1],
               "outside": str(base / "outside" / "escaped.txt"), "artifacts": str(base / "artifacts"),
               "unshare": _unshare_number(), "newuser": CLONE_NEWUSER}
        jail = Jail.open("strict", bundle_dir=base / "bundle", hidden=[], limits=Limits(), threads=1, audit=False)
        try:
            done = jail.run([sys.executable, "-I", "-S", "-c", _CODE, json.dumps(arg)], timeout_s=PROBE_TIMEOUT_S,
                            writable=[base / "artifacts"], cwd=base / "artifacts")
        finally:
            jail.close()
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip()[-500:]
            raise SelfTestFailed(f"the sandbox self-test's probe child did not run ({done.failure}): {tail}", [])
        seen = json.loads(done.stdout.decode().strip().splitlines()[-1])
        seen["write outside"] = seen["write outside"] or (base / "outside" / "escaped.txt").exists()
        seen["network"] = seen["network"] or _accepted(listener)
        return [name for name in PROBES if seen.get(name)]
    finally:
        listener.close()
        shutil.rmtree(base, ignore_errors=True)


def _accepted(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, OSError):
        return False
    conn.close()
    return True


def cache_key() -> str:
    """SHA-256 (hex) of what a pass holds for: host name, PRISM version, kernel release, sandbox
    backend, effective uid and the filter (:func:`~prism_challenge.evaluator.seccompfilter.fingerprint`)."""
    from prism_challenge import __version__
    from prism_challenge.evaluator import seccompfilter
    from prism_challenge.evaluator.isolation import available_backend

    parts = [socket.gethostname(), __version__, os.uname().release, str(available_backend()), str(os.geteuid()),
             seccompfilter.fingerprint()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _cache_file() -> Path:
    from prism_challenge.data.builtin import default_cache_root

    return default_cache_root() / "selftest" / f"{cache_key()}.json"


def require(*, cached: bool) -> None:
    """Refuse to go on unless the sandbox holds: run :func:`run_probes` (with ``cached``, not when
    this host, version, kernel, backend and filter passed before) and raise if any probe got out.

    Raises:
        SelfTestFailed: the message names each probe that got out, or says the probes did not run.
        IsolationError: no strict sandbox can be started here.
    """
    path = _cache_file() if cached else None
    if path is not None and path.is_file():
        return
    escaped = run_probes()
    if escaped:
        raise SelfTestFailed(f"the sandbox self-test failed: the probe{'s' if len(escaped) > 1 else ''} "
                             f"{', '.join(repr(n) for n in escaped)} got out of the sandbox; this host cannot "
                             "confine submissions (see docs/threat-model.md, Self-test)", escaped)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"passed": list(PROBES)}) + "\n")


def refusal(command: str, *, cached: bool) -> str | None:
    """The line ``command`` (``prism eval``, ``prism serve``) prints to refuse this host, or
    ``None`` when :func:`require` passes. A host with no strict sandbox at all is left to the
    run's own refusal (``None``: the run fails closed, naming how to install one)."""
    from prism_challenge.evaluator.isolation import IsolationError
    from prism_challenge.evaluator.seccompfilter import SeccompUnavailable

    try:
        require(cached=cached)
    except (SelfTestFailed, SeccompUnavailable) as exc:
        return f"{command}: {exc}"
    except IsolationError:
        return None
    return None
