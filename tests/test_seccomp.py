"""The kernel-call filter (``evaluator/seccompfilter.py``), exercised inside the real sandbox.

Each denied call is attempted by ``tests/seccomp_probe.py`` (a harness-side probe, standard
library only) with arguments the kernel itself rejects with another errno (a bad flag, fd -1, a
NULL pointer): ``EPERM`` can then only come from the filter, and the same probe run outside the
sandbox shows the kernel's own answer for each.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_challenge.evaluator import isolation, seccompfilter
from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.jail import Jail

pyseccomp = pytest.importorskip("pyseccomp")

ROOT = os.geteuid() == 0
WORKING = [b for b in isolation.BACKENDS if isolation.probe(b)[0]] if sys.platform == "linux" else []
PROBE = (Path(__file__).parent / "seccomp_probe.py").read_text()
ARCH = pyseccomp.system_arch()
NEG = -1
CLONE_THREAD = 0x00010000  # without CLONE_SIGHAND: EINVAL before anything is made
ARGS = {
    "unshare": [0x1], "setns": [NEG, 0], "ptrace": [3, 0x7FFFFFFF, 0, 0], "process_vm_readv": [0, 0, 0, 0, 0, 1],
    "process_vm_writev": [0, 0, 0, 0, 0, 1], "kcmp": [0x7FFFFFFF, 0x7FFFFFFF, 99, 0, 0], "bpf": [9999, 0, 0],
    "io_uring_setup": [0, 0], "io_uring_enter": [NEG, 0, 0, 0, 0, 0], "io_uring_register": [NEG, 0, 0, 0],
    "keyctl": [9999, 0, 0, 0, 0], "add_key": [0, 0, 0, 0, 0], "request_key": [0, 0, 0, 0],
    "perf_event_open": [0, 0, NEG, NEG, 0], "userfaultfd": [0xFFFF], "lookup_dcookie": [0, 0, 0],
    "fanotify_init": [0xFFFFFFFF, 0], "mount": [0, 0, 0, 0, 0], "umount2": [0, 0xFFFF], "pivot_root": [0, 0],
    "chroot": [0], "move_mount": [NEG, 0, NEG, 0, 0xFFFFFFFF], "open_tree": [NEG, 0, 0xFFFFFFFF],
    "fsopen": [0, 0xFFFF], "fsconfig": [NEG, 99, 0, 0, 0], "fsmount": [NEG, 0xFFFF, 0], "fspick": [NEG, 0, 0xFFFFFFFF],
    "mount_setattr": [NEG, 0, 0xFFFFFFFF, 0, 0], "init_module": [0, 0, 0], "finit_module": [NEG, 0, 0],
    "delete_module": [0, 0], "kexec_load": [0, 0, 0, 0xFFFFFFFF], "kexec_file_load": [NEG, NEG, 0, 0, 0xFFFFFFFF],
    "reboot": [0, 0, 0, 0], "swapon": [0, 0], "swapoff": [0], "acct": [1], "quotactl": [0xFFFFFFFF, 0, 0, 0],
    "settimeofday": [1, 1], "clock_settime": [0, 1], "clock_adjtime": [0, 1], "adjtimex": [1], "iopl": [99],
    "ioperm": [0x10000, 1, 1], "open_by_handle_at": [NEG, 1, 0], "name_to_handle_at": [NEG, 0, 0, 0, 0xFFFFFFFF],
    "syslog": [99, 0, 0], "vhangup": [], "sethostname": [0, 99999], "setdomainname": [0, 99999], "uselib": [1],
    "fadvise64": [NEG, 0, 4096, 4], "fadvise64_64": [NEG, 0, 4096, 4], "cachestat": [NEG, 0, 0, 0],
    "process_madvise": [NEG, 0, 0, 21, 0], "io_setup": [0, 0],
}


def nr(name: str) -> int:
    return pyseccomp.resolve_syscall(ARCH, name)


def denied_calls() -> dict[str, tuple[list[int], str]]:
    """label -> ([number, args...], the errno the filter gives)."""
    calls = {n: ([nr(n), *ARGS[n]], "EPERM") for n in seccompfilter.DENIED if nr(n) >= 0}
    for name, flag in seccompfilter.CLONE_NEW_FLAGS.items():
        calls[f"clone {name}"] = ([nr("clone"), flag | CLONE_THREAD, 0, 0, 0, 0], "EPERM")
    calls["clone3"] = ([nr("clone3"), 0, 0], "ENOSYS")
    for name, request in seccompfilter.DENIED_IOCTLS.items():
        calls[f"ioctl {name}"] = ([nr("ioctl"), NEG, request, 0], "EPERM")
    calls["socket AF_VSOCK"] = ([nr("socket"), seccompfilter.AF_VSOCK, 1, 0], "EPERM")
    for advice in ("MADV_COLD", "MADV_PAGEOUT"):  # an unaligned address: the kernel's EINVAL
        calls[f"madvise {advice}"] = ([nr("madvise"), 1, 4096, seccompfilter.PAGE_CACHE[advice]], "EPERM")
    for name in ("preadv2", "pwritev2"):  # fd -1: the kernel's EBADF
        calls[f"{name} RWF_NOWAIT"] = ([nr(name), NEG, 0, 0, 0, 0, seccompfilter.PAGE_CACHE["RWF_NOWAIT"]], "EPERM")
    return calls


CALLS = denied_calls()


@pytest.fixture(params=WORKING or [None], ids=lambda b: str(b))
def backend(request, monkeypatch):
    if request.param is None:
        pytest.skip("no working sandbox backend (install bubblewrap, or allow unshare)")
    monkeypatch.setenv(isolation.ENV_BACKEND, request.param)
    return request.param


def in_jail(tmp_path: Path, argv: list[str]):
    """Run ``argv`` through the real launcher (a strict :class:`Jail`), the way every child is."""
    (tmp_path / "bundle").mkdir(exist_ok=True)
    (tmp_path / "art").mkdir(exist_ok=True)
    jail = Jail.open("strict", bundle_dir=tmp_path / "bundle", hidden=[], limits=Limits(), threads=1, audit=False)
    try:
        return jail.run(argv, timeout_s=120, writable=[tmp_path / "art"], cwd=tmp_path / "art")
    finally:
        jail.close()


def probe_argv() -> list[str]:
    return [sys.executable, "-I", "-S", "-c", PROBE, json.dumps({k: v[0] for k, v in CALLS.items()})]


def test_the_list_covers_what_the_issue_names():
    named = {"unshare", "setns", "ptrace", "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl",
             "perf_event_open", "mount", "init_module", "finit_module", "delete_module"}
    assert named <= set(seccompfilter.DENIED)
    assert "clone" not in seccompfilter.DENIED  # threads and fork: only its namespace flags are denied
    assert len(seccompfilter.program()) % 8 == 0 and len(seccompfilter.program()) > 8 * len(CALLS)


def test_each_denied_call_fails_inside_the_sandbox(tmp_path, backend):
    done = in_jail(tmp_path, probe_argv())
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.decode().splitlines()[-1])
    assert got == {label: want for label, (_, want) in CALLS.items()}


@pytest.mark.skipif(not ROOT, reason="as root the kernel's own privilege checks pass, so its errno shows")
def test_outside_the_filter_the_kernel_answers_otherwise():
    """The independent path: the same calls with no filter get the kernel's own errno, never
    the filter's, so the errno inside the sandbox is the filter's doing."""
    res = subprocess.run(probe_argv(), capture_output=True, text=True, start_new_session=True, timeout=60)
    got = json.loads(res.stdout.splitlines()[-1])
    same = [label for label, (_, want) in CALLS.items() if got[label] == want]
    assert same == []


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the x32 ABI is x86-64's")
def test_another_abi_is_killed_not_run(tmp_path, backend):
    """x32's ``unshare`` (``__X32_SYSCALL_BIT | 272``) would dodge a filter of x86-64 numbers:
    libseccomp's bad-architecture action kills the process (SIGSYS: 128 + 31)."""
    code = ("import ctypes; l = ctypes.CDLL(None); l.syscall.restype = ctypes.c_long; "
            "l.syscall(ctypes.c_long(0x40000000 | 272), ctypes.c_long(1)); print('survived')")
    done = in_jail(tmp_path, [sys.executable, "-I", "-S", "-c", code])
    assert done.returncode == 128 + 31 and b"survived" not in done.stdout


def test_threads_fork_subprocess_and_sockets_still_work(tmp_path, backend):
    code = """
import json, os, socket, subprocess, threading
out = []
t = threading.Thread(target=lambda: out.append("thread")); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
out.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
out.append(subprocess.run(["/bin/sh", "-c", "exit 5"]).returncode)
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
c = socket.create_connection(s.getsockname()); a, _ = s.accept(); c.sendall(b"x"); out.append(a.recv(1).decode())
u1, u2 = socket.socketpair(); u1.sendall(b"y"); out.append(u2.recv(1).decode())
print(json.dumps(out))
"""
    done = in_jail(tmp_path, [sys.executable, "-I", "-S", "-c", code])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.decode().splitlines()[-1]) == ["thread", 7, 5, "x", "y"]


def test_the_program_is_in_every_strict_prefix_and_gone_in_sabotage_mode(monkeypatch):
    pre = isolation.sandbox_prefix("strict", writable=[], hidden=[], tmp_dir=None, socket_dir=None, bundle_dir=None,
                                   backend=WORKING[0] if WORKING else "bwrap")
    inner = json.loads(pre[[i for i, a in enumerate(pre) if a.endswith("sandbox_init.py")][-1] + 1])
    assert inner["seccomp"] == seccompfilter.spec_entry()
    monkeypatch.setenv("PRISM_SABOTAGE", "1")
    assert seccompfilter.spec_entry() is None and seccompfilter.fingerprint() == "off"
    assert isolation.sandbox_prefix("strict", writable=[], hidden=[], tmp_dir=None, socket_dir=None,
                                    bundle_dir=None) == []


@pytest.mark.slow
@pytest.mark.skipif(not WORKING, reason="no working sandbox backend")
def test_an_honest_run_scores_the_same_to_the_last_bit_with_the_filter_on_and_off(tmp_path, monkeypatch):
    """The example at a small budget, strict isolation, with the filter, then with it switched
    off (in this trusted parent only): the same bits and bytes, the same curve."""
    from helpers import EXAMPLE

    from prism_challenge.pipeline import EvalOptions, evaluate

    program = seccompfilter.spec_entry
    handed = []

    def spy():
        handed.append(program())
        return handed[-1]

    def score(name):  # one thread: at two, the example's AdamW step differs in its last bits in about
        # 1 run in 15 with no sandbox at all (session 19's note), which would hide what the filter does
        o = evaluate(EvalOptions(bundle=str(EXAMPLE), out_dir=str(tmp_path / name), device="cpu", isolation="strict",
                                 token_budget=4000, heldout_bytes=0, threads=1))
        assert o.failure is None, o.failure
        return o.manifest["score"], o.manifest["curve"]

    monkeypatch.setattr(seccompfilter, "spec_entry", spy)
    on = score("on")
    assert handed and all(h == program() for h in handed)  # every sandbox of the run got the filter
    handed.clear()
    monkeypatch.setattr(seccompfilter, "spec_entry", lambda: handed.append(None))
    off = score("off")
    assert handed and on == off
    assert on[0]["prequential_bpb"] == off[0]["prequential_bpb"] and on[0]["total_bits"] == off[0]["total_bits"]


@pytest.mark.slow
@pytest.mark.skipif(not WORKING, reason="no working sandbox backend")
def test_torch_compile_builds_its_kernels_with_gcc_under_the_filter(tmp_path):
    """Inductor's C++ kernels: ``g++`` (which spawns ``cc1plus`` and ``as``) runs under the
    inherited filter; the compiled function gives the eager answer."""
    code = ("import torch; x = torch.arange(8.0); f = torch.compile(lambda t: (t * 2).sin().sum()); "
            "print(repr((f(x).item(), (x * 2).sin().sum().item())))")
    (tmp_path / "bundle").mkdir()
    (tmp_path / "art").mkdir()
    jail = Jail.open("strict", bundle_dir=tmp_path / "bundle", hidden=[], limits=Limits(), threads=1, audit=False)
    try:
        done = jail.run([sys.executable, "-c", code], timeout_s=600, writable=[tmp_path / "art"], cwd=tmp_path / "art",
                        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "art" / "inductor")})
    finally:
        jail.close()
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, eager = eval(done.stdout.decode().splitlines()[-1])
    assert compiled == pytest.approx(eager, rel=1e-6)
    assert list((tmp_path / "art" / "inductor").rglob("*.so"))  # a kernel was built by g++, not skipped


def test_the_page_cache_calls_are_refused_and_their_honest_neighbours_still_work(tmp_path, backend):
    """What a bundle's Python sees (red team rt19's channel): ``posix_fadvise`` and a
    ``RWF_NOWAIT`` read are refused, a plain ``preadv`` and ``madvise`` with
    ``MADV_WILLNEED``/``MADV_DONTNEED`` (what allocators and loaders use) still work."""
    code = """
import json, mmap, os, sys
out = {}
fd = os.open(sys.executable, os.O_RDONLY)
buf = bytearray(4)
for label, call in [("fadvise", lambda: os.posix_fadvise(fd, 0, 4096, os.POSIX_FADV_DONTNEED)),
                    ("nowait", lambda: os.preadv(fd, [buf], 0, os.RWF_NOWAIT)),
                    ("preadv", lambda: os.preadv(fd, [buf], 0))]:
    try:
        out[label] = call()
    except OSError as exc:
        out[label] = type(exc).__name__
m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_WILLNEED)
m.madvise(mmap.MADV_DONTNEED)
out["madvise"], out["head"] = "ok", bytes(m[:4]).hex()
print(json.dumps(out))
"""
    done = in_jail(tmp_path, [sys.executable, "-I", "-S", "-c", code])
    assert done.returncode == 0, done.stderr[-2000:]
    with open(sys.executable, "rb") as f:
        head = f.read(4).hex()  # the ELF magic, read here
    assert json.loads(done.stdout.decode().splitlines()[-1]) == {
        "fadvise": "PermissionError", "nowait": "PermissionError", "preadv": 4, "madvise": "ok", "head": head}
