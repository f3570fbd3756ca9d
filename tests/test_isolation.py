"""The sandbox primitives, exercised by running small programs inside the real sandbox.

Every test that needs a sandbox runs once per working backend (bubblewrap, unshare) and is
skipped, with the reason, when none works on this machine.
"""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from prism_challenge.evaluator import isolation, mountplan, sandboxargv, sandboxwatch
from prism_challenge.evaluator.isolation import (
    Guard,
    IsolationError,
    Limits,
    limits_preexec,
    sandbox_prefix,
)
from prism_challenge.evaluator.sandboxwatch import QuotaExceeded, artifacts_usage, check_quota, pick_sandbox_uid, tasks_of_uid

ROOT = os.geteuid() == 0
WORKING = [b for b in isolation.BACKENDS if isolation.probe(b)[0]] if sys.platform == "linux" else []


@pytest.fixture(params=WORKING or [None], ids=lambda b: str(b))
def backend(request):
    if request.param is None:
        pytest.skip("no working sandbox backend (install bubblewrap, or allow unshare)")
    return request.param


@pytest.fixture
def layout(tmp_path):
    """Directories of one sandbox: writable, bundle (ro), socket dir, outside (a sibling of the
    bundle, under the host's /tmp); ``base``, a world-readable tree outside /tmp that the sandbox
    binds read-only (``readable``) and in it a hidden dir and a hidden file next to a visible
    file, so that only the hiding keeps them closed; ``unbound``, a world-readable tree outside
    every bound path (as the raw data in /work/shared/data is), which must be absent."""
    d = {name: tmp_path / name for name in ("w", "bundle", "sock", "outside")}
    for p in d.values():
        p.mkdir()
    var_tmp = "/var/tmp" if os.path.isdir("/var/tmp") else None
    base = Path(tempfile.mkdtemp(prefix="prism-test-iso-", dir=var_tmp))
    unbound = Path(tempfile.mkdtemp(prefix="prism-test-iso-unbound-", dir=var_tmp))
    for p in (base, unbound):
        p.chmod(0o755)
    d["base"], d["unbound"] = base, unbound
    d["hidden"] = base / "data"
    d["hidden"].mkdir(mode=0o755)
    (d["hidden"] / "secret.txt").write_text("the held-out text")
    d["hidden_file"] = base / "salt.hex"
    d["hidden_file"].write_text("5a" * 32)
    d["visible_file"] = base / "public.txt"
    d["visible_file"].write_text("public")
    d["raw"] = unbound / "train.jsonl"
    d["raw"].write_text('{"text": "the raw train text"}\n')
    for f in (d["hidden"] / "secret.txt", d["hidden_file"], d["visible_file"], d["raw"]):
        f.chmod(0o644)
    (d["bundle"] / "architecture.py").write_text("x = 1\n")
    (d["outside"] / "data.txt").write_text("outside")
    yield d
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(unbound, ignore_errors=True)


def prefix_for(layout, backend, **kw):
    kw.setdefault("uid", pick_sandbox_uid() if ROOT else None)
    kw.setdefault("readable", mountplan._default_readable() + [str(layout["base"])])
    uid = kw["uid"]
    pre = sandbox_prefix(
        "strict",
        writable=[layout["w"]],
        hidden=[layout["hidden"], layout["hidden_file"]],
        tmp_dir=None,
        socket_dir=layout["sock"],
        bundle_dir=layout["bundle"],
        backend=backend,
        **kw,
    )
    return pre, uid


def run_in(prefix, code, timeout=120, cwd=None):
    """Run ``code`` in the sandbox; it prints one JSON object on its last stdout line."""
    res = subprocess.run(prefix + [sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


TRY = """
import json, os, socket, sys
out = {}
def attempt(name, fn):
    try:
        r = fn()
        out[name] = "ok" if r is None else r
    except OSError as exc:
        out[name] = errno_name(exc)
    except ValueError as exc:
        out[name] = "ValueError"
def errno_name(exc):
    import errno
    return errno.errorcode.get(exc.errno, str(exc)) if exc.errno else type(exc).__name__
"""


def wait_until(predicate, deadline_s=20.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# -- identity, namespaces ---------------------------------------------------------------------
def test_sandbox_identity_and_namespaces(layout, backend):
    pre, uid = prefix_for(layout, backend)
    r = run_in(pre, """
        import json, os, socket
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "groups": os.getgroups(),
                          "capeff": status["CapEff"].strip(), "nnp": status["NoNewPrivs"].strip(),
                          "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                          "ifaces": [n for _, n in socket.if_nameindex()],
                          "sid_is_me": os.getsid(0) == os.getpid() or os.getsid(0) != os.getsid(1)}))
    """)
    if ROOT:
        assert r["uid"] == r["euid"] == uid and r["groups"] == []
    assert int(r["capeff"], 16) == 0 and r["nnp"] == "1"
    assert r["ifaces"] == ["lo"]  # an empty network namespace: loopback only
    assert max(r["pids"]) < 50  # a new pid namespace: the host's processes are not there


# -- network ----------------------------------------------------------------------------------
def test_no_network_not_even_the_hosts_loopback(layout, backend):
    host = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    host.bind(("127.0.0.1", 0))
    host.listen(4)
    port = host.getsockname()[1]
    try:
        # control: reachable from outside the sandbox
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        host.accept()[0].close()
        pre, _ = prefix_for(layout, backend)
        r = run_in(pre, TRY + f"""
attempt("host_loopback", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=5).close())
attempt("internet", lambda: socket.create_connection(("1.1.1.1", 53), timeout=5).close())
attempt("dns", lambda: socket.getaddrinfo("example.com", 80) and None)
def own_loopback():
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    socket.create_connection(srv.getsockname(), timeout=5).close()
    srv.accept()[0].close()
attempt("own_loopback", own_loopback)
print(json.dumps(out))
""")
        host.setblocking(False)
        with pytest.raises(BlockingIOError):
            host.accept()  # nobody from the sandbox got through
    finally:
        host.close()
    assert r["host_loopback"] == "ECONNREFUSED"  # the sandbox's 127.0.0.1 is its own
    assert r["internet"] in ("ENETUNREACH", "EHOSTUNREACH", "ECONNREFUSED", "TimeoutError")
    assert r["dns"] != "ok"
    assert r["own_loopback"] == "ok"  # torchrun's rendezvous and gloo need this


# -- filesystem -------------------------------------------------------------------------------
REPO = Path(isolation.__file__).resolve().parents[3]  # the harness checkout (src/prism_challenge/...)
SRC = Path(isolation.__file__).resolve().parents[2]


def test_filesystem_view(layout, backend, tmp_path):
    pre, uid = prefix_for(layout, backend)
    w, b, h, hf, outside, vf = (str(layout[k]) for k in ("w", "bundle", "hidden", "hidden_file", "outside",
                                                         "visible_file"))
    r = run_in(pre, TRY + f"""
attempt("read_visible", lambda: open({vf!r}).read())
attempt("read_hidden_file_in_dir", lambda: open({h!r} + "/secret.txt").read())
attempt("list_hidden_dir", lambda: os.listdir({h!r}))
attempt("read_hidden_file", lambda: open({hf!r}).read())
attempt("read_outside", lambda: open({outside!r} + "/data.txt").read())
attempt("read_bundle", lambda: open({b!r} + "/architecture.py").read())
attempt("write_writable", lambda: open({w!r} + "/out.txt", "w").write("hello") and None)
attempt("write_bundle", lambda: open({b!r} + "/evil.py", "w").close())
attempt("write_src", lambda: open({str(SRC)!r} + "/evil.txt", "w").close())
attempt("write_root", lambda: open("/evil.txt", "w").close())
attempt("write_etc", lambda: open("/etc/evil.txt", "w").close())
attempt("write_usr", lambda: open("/usr/evil.txt", "w").close())
attempt("write_outside", lambda: open({outside!r} + "/evil.txt", "w").close())
attempt("write_tmp", lambda: open("/tmp/scratch.txt", "w").write("x") and None)
attempt("write_shm", lambda: open("/dev/shm/scratch", "w").write("x") and None)
attempt("chmod_bundle", lambda: os.chmod({b!r}, 0o777))
attempt("read_shadow", lambda: open("/etc/shadow").read(1))
print(json.dumps(out))
""")
    assert r["read_visible"] == "public"  # the control: same place, same mode, not hidden
    assert r["read_hidden_file_in_dir"] in ("EACCES", "ENOENT")
    assert r["list_hidden_dir"] in ("EACCES", [])
    assert r["read_hidden_file"] == "EACCES"
    assert r["read_outside"] == "ENOENT"  # the host's /tmp is not there: a private /tmp
    assert r["read_bundle"] == "x = 1\n"
    assert r["write_writable"] == "ok" and (layout["w"] / "out.txt").read_text() == "hello"
    for key in ("write_bundle", "write_src", "write_root", "write_etc", "write_usr"):
        assert r[key] in ("EROFS", "EACCES"), key
    assert r["write_outside"] == "ENOENT"
    assert r["write_tmp"] == "ok" and r["write_shm"] == "ok"
    assert r["chmod_bundle"] in ("EROFS", "EPERM")
    assert not (layout["bundle"] / "evil.py").exists() and not (layout["outside"] / "evil.txt").exists()
    assert not os.path.exists("/tmp/scratch.txt") or open("/tmp/scratch.txt").read() != "x"
    assert (layout["hidden"] / "secret.txt").read_text() == "the held-out text"  # untouched on the host
    assert r["read_shadow"] == "ENOENT"  # /etc is an allow-list of files


def test_only_the_allow_list_is_there(layout, backend):
    """An empty root with the system trees, a few /etc files, the interpreter, sys.path, the
    bundle, the socket dir and the artifacts: the rest of the host is absent (ENOENT)."""
    other_run = layout["w"].parent / "other-run"  # another run's files, beside this one's
    (other_run / "artifacts").mkdir(parents=True)
    (other_run / "prism_run_manifest.v2.json").write_text("{}")
    pre, _ = prefix_for(layout, backend)
    shared = REPO.parent / "shared"
    controls = {"raw": layout["raw"], "unbound_dir": layout["unbound"], "bundle_sibling": layout["outside"],
                "other_run": other_run / "prism_run_manifest.v2.json", "repo_pyproject": REPO / "pyproject.toml",
                "repo_tests": REPO / "tests"}
    for name, path in controls.items():  # there on the host
        assert path.exists(), name
    probes = {name: str(p) for name, p in controls.items()}
    probes.update({"repo_git": str(REPO / ".git"), "shared": str(shared), "shared_data": str(shared / "data"),
                   "root_home": "/root/.bashrc", "root_pyenv_shims": "/root/.pyenv/shims", "home": "/home",
                   "srv": "/srv", "mnt": "/mnt", "opt": "/opt", "var_lib": "/var/lib", "run": "/run",
                   "boot": "/boot", "shadow": "/etc/shadow", "etc_pip": "/etc/pip.conf",
                   "sys_firmware": "/sys/firmware", "dev_disk": "/dev/vda"})
    tmp_parent = str(layout["w"].parent.parent)  # other tests' directories are there on the host
    r = run_in(pre, TRY + f"""
import glob
for name, path in {probes!r}.items():
    attempt(name, lambda p=path: os.stat(p) and None)
attempt("glob_jsonl", lambda: sorted(glob.glob({str(shared / "data")!r} + "/*.jsonl")))
for d in ("/", "/etc", "/var", "/var/tmp", {str(REPO)!r}, {str(layout["w"].parent)!r}, {tmp_parent!r}):
    attempt("ls:" + d, lambda d=d: sorted(os.listdir(d)))
print(json.dumps(out))
""")
    for name in probes:
        assert r[name] == "ENOENT", (name, r[name])
    assert r["glob_jsonl"] == []
    allowed = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "sys", "dev", "proc", "tmp"}
    needed = mountplan._default_readable() + [str(layout["base"])]
    allowed |= {Path(p).parts[1] for p in needed if len(Path(p).parts) > 1}
    assert set(r["ls:/"]) <= allowed, set(r["ls:/"]) - allowed
    assert set(r["ls:/etc"]) <= set(mountplan.ETC_FILES) | {f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    assert r["ls:/var"] == ["tmp"] and r["ls:/var/tmp"] == [layout["base"].name]  # only the bound tree
    # the checkout: only the package's src dir (and the interpreter's venv, when it lives inside)
    venv = Path(sys.prefix).resolve()
    inside = [venv.relative_to(REPO).parts[0]] if venv.is_relative_to(REPO) else []
    assert sorted(r[f"ls:{REPO}"]) == sorted([SRC.name, *inside])
    # the bundle's parent holds only what is bound there (bundle, socket dir, artifacts)
    assert set(r[f"ls:{layout['w'].parent}"]) == {"w", "bundle", "sock"}
    assert r[f"ls:{tmp_parent}"] == [layout["w"].parent.name]


def test_the_working_directory_is_kept_where_the_sandbox_has_it(layout, backend):
    """The launcher runs torchrun in the artifacts dir (mode 0700, the sandbox uid's): both
    backends enter it, after the uid drop; a directory the sandbox lacks gives /."""
    pre, _ = prefix_for(layout, backend)
    code = "import json, os; print(json.dumps({'cwd': os.getcwd()}))"
    assert run_in(pre, code, cwd=layout["w"]) == {"cwd": str(layout["w"])}
    assert run_in(pre, code, cwd=layout["unbound"]) == {"cwd": "/"}


@pytest.mark.slow
def test_the_interpreter_torch_and_the_package_import_inside(layout, backend):
    pre, _ = prefix_for(layout, backend, readable=None)  # the default: interpreter and sys.path
    r = run_in(pre, """
        import json, os, sys, torch, prism_challenge, numpy
        from prism_challenge.evaluator import launcher
        print(json.dumps({"torch": torch.__file__, "pkg": prism_challenge.__file__, "prefix": sys.prefix,
                          "base": sys.base_prefix, "t": float(torch.ones(3).sum())}))
    """)
    import prism_challenge
    import torch

    assert r["torch"] == torch.__file__ and r["pkg"] == prism_challenge.__file__
    assert r["prefix"] == sys.prefix and r["base"] == sys.base_prefix and r["t"] == 3.0


@pytest.fixture
def standin_device():
    """A character device the minimal /dev lacks, usable by the sandbox uid, to stand in for
    /dev/nvidia*: as root, a fresh node (the null device's numbers, mode 0666) in the host's /dev."""
    if ROOT:
        path = f"/dev/prism-iso-test-{os.getpid()}"
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            os.chmod(path, 0o666)
        except OSError as exc:
            pytest.skip(f"cannot make a device node in /dev: {exc}")
        yield path
        os.unlink(path)
        return
    dev = next((p for p in ("/dev/fuse", "/dev/net/tun", "/dev/vsock")
                if os.path.exists(p) and os.stat(p).st_mode & 0o006 == 0o006), None)
    if dev is None:
        pytest.skip("no world-usable character device to stand in for /dev/nvidia*")
    yield dev


def test_gpu_device_nodes_are_bound_when_present(layout, backend, monkeypatch, standin_device):
    """/dev/nvidia* (here: a stand-in) is bound read-write and usable: the device's bind keeps its
    own flags, not the nodev of the sandbox's /dev; the host's other devices are not there."""
    dev = standin_device
    monkeypatch.setattr(isolation, "_gpu_devices", lambda: [dev])
    pre, _ = prefix_for(layout, backend)
    r = run_in(pre, TRY + f"""
import stat
attempt("chr", lambda: stat.S_ISCHR(os.stat({dev!r}).st_mode))
attempt("write", lambda: os.write(os.open({dev!r}, os.O_RDWR), b"x"))
attempt("kmsg", lambda: os.stat("/dev/kmsg") and None)
attempt("vda", lambda: os.stat("/dev/vda") and None)
print(json.dumps(out))
""")
    assert r == {"chr": True, "write": 1, "kmsg": "ENOENT", "vda": "ENOENT"}


def test_plan_is_an_allow_list():
    """The plan starts from nothing: no bind of "/" or of /etc, /home, /var, /srv, /work as a whole."""
    readable = mountplan._default_readable()
    plan = mountplan._plan(writable=[], hidden=[], tmp_dir=None, socket_dir=None, bundle_dir=None,
                           readable=readable, tmp_bytes=1 << 20, shm_bytes=1 << 20, devices=["/dev/nvidia0"])
    binds = [op[2] for op in plan.ops if op[0] == "bind"]
    assert "/" not in binds and "/etc" not in binds
    for p in ("/home", "/var", "/srv", "/mnt", "/opt", "/root", "/work", str(REPO)):
        assert p not in binds, p
    assert ("devbind", "/dev/nvidia0", "/dev/nvidia0") in plan.ops
    assert plan.ops[-1] == ("remount_ro", "/")
    argv = sandboxargv._render_bwrap(plan)
    assert "--dev-bind" in argv and argv[-2:] == ["--remount-ro", "/"]
    assert ["--ro-bind", "/", "/"] not in [argv[i:i + 3] for i in range(len(argv))]


def test_hidden_path_containing_a_needed_path_is_refused(layout, backend):
    with pytest.raises(IsolationError, match="contains"):
        sandbox_prefix("strict", writable=[layout["w"]], hidden=[layout["w"].parent], tmp_dir=None,
                       socket_dir=None, bundle_dir=None, backend=backend)


# -- the feeder socket ------------------------------------------------------------------------
def test_feeder_socket_reachable_other_sockets_not(layout, backend):
    feeder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    feeder.bind(str(layout["sock"] / "feeder.sock"))
    feeder.listen(1)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(layout["bundle"] / "other.sock"))  # visible (read-only) but not the sandbox's
    other.listen(1)
    try:
        pre, _ = prefix_for(layout, backend)
        r = run_in(pre, TRY + f"""
def talk(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"HELLO")
    s.close()
attempt("feeder", lambda: talk({str(layout["sock"] / "feeder.sock")!r}))
attempt("other", lambda: talk({str(layout["bundle"] / "other.sock")!r}))
attempt("create_in_socket_dir", lambda: open({str(layout["sock"])!r} + "/x", "w").close())
print(json.dumps(out))
""")
        conn, _ = feeder.accept()
        assert conn.recv(5) == b"HELLO"
        conn.close()
    finally:
        feeder.close()
        other.close()
    assert r["feeder"] == "ok"
    assert r["create_in_socket_dir"] in ("EROFS", "EACCES")
    if ROOT:
        assert r["other"] == "EACCES"  # a root-owned socket is closed to the sandbox uid


# -- limits -----------------------------------------------------------------------------------
def test_rlimits_inside(layout, backend):
    limits = Limits(address_space_bytes=3 << 30, max_processes=200, max_file_bytes=1 << 20, max_open_files=64)
    pre, _ = prefix_for(layout, backend, limits=limits)
    w = str(layout["w"])
    r = run_in(pre, TRY + f"""
import resource
out["limits"] = [resource.getrlimit(x) for x in (resource.RLIMIT_AS, resource.RLIMIT_NPROC,
                                                   resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE)]
def big():
    b = bytearray(4 << 30)
try:
    big(); out["memory"] = "ok"
except MemoryError:
    out["memory"] = "MemoryError"
attempt("big_file", lambda: open({w!r} + "/big", "wb").write(b"x" * (2 << 20)) and None)
attempt("small_file", lambda: open({w!r} + "/small", "wb").write(b"x" * 1000) and None)
def many():
    fs = [open("/dev/null") for _ in range(100)]
attempt("many_files", many)
attempt("raise_limit", lambda: resource.setrlimit(resource.RLIMIT_AS, (-1, -1)))
print(json.dumps(out))
""")
    assert r["limits"] == [[3 << 30] * 2, [200] * 2, [1 << 20] * 2, [64] * 2]
    assert r["memory"] == "MemoryError"
    assert r["big_file"] == "EFBIG" and os.path.getsize(layout["w"] / "big") == 1 << 20
    assert r["small_file"] == "ok"
    assert r["many_files"] == "EMFILE"
    assert r["raise_limit"] != "ok"


FORK_BOMB = """
import errno, json, os, sys, time
n = 0
err = None
while n < 10000:
    try:
        pid = os.fork()
    except OSError as exc:
        err = errno.errorcode[exc.errno]
        break
    if pid == 0:
        time.sleep(1000)
        os._exit(0)
    n += 1
print(json.dumps({"forked": n, "error": err}), flush=True)
if len(sys.argv) > 1:
    time.sleep(1000)
"""


@pytest.mark.skipif(not ROOT, reason="RLIMIT_NPROC only holds for a dedicated uid, which needs root")
def test_fork_bomb_is_contained_and_the_tree_dies_with_the_sandbox(layout, backend):
    pre, uid = prefix_for(layout, backend, limits=Limits(max_processes=40))
    r = run_in(pre, FORK_BOMB)
    assert r["error"] == "EAGAIN" and 0 < r["forked"] < 40
    # the sandbox's init exited: every forked child went with it
    assert wait_until(lambda: tasks_of_uid(uid) == (0, 0)), tasks_of_uid(uid)


@pytest.mark.skipif(not ROOT, reason="counting a sandbox by uid needs a dedicated uid (root)")
def test_guard_reports_the_process_limit_and_kills_the_tree(layout, backend):
    pre, uid = prefix_for(layout, backend, limits=Limits(max_processes=30))
    proc = subprocess.Popen(pre + [sys.executable, "-c", FORK_BOMB, "stay"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert json.loads(line)["error"] == "EAGAIN"
        guard = Guard([layout["w"]], quota_bytes=None, uid=uid, max_processes=30, interval_s=0.0)
        assert wait_until(lambda: guard.check() is not None)
        assert guard.check().startswith("process limit: the sandbox reached 30 tasks")
        assert guard.summary()["peak_tasks"] == 30
        guard.kill()
        assert wait_until(lambda: tasks_of_uid(uid) == (0, 0))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_killing_the_sandbox_kills_every_process_in_it(layout, backend):
    pre, uid = prefix_for(layout, backend)
    w = layout["w"]
    code = f"""
import os, subprocess, sys, time
# a grandchild in its own session: killpg on the launcher's group cannot reach it
subprocess.Popen([sys.executable, "-c", "import os, time; open({str(w)!r} + '/pid', 'w').write(str(os.getpid())); time.sleep(1000)"],
                 start_new_session=True)
time.sleep(1000)
"""
    proc = subprocess.Popen(pre + [sys.executable, "-c", code], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: (w / "pid").exists() and (w / "pid").read_text() != "")
        if ROOT:
            assert tasks_of_uid(uid)[0] >= 2
        proc.kill()  # SIGKILL to the outermost process only
        proc.wait()
        if ROOT:
            assert wait_until(lambda: tasks_of_uid(uid) == (0, 0)), tasks_of_uid(uid)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_torchrun_standalone_with_gloo_works_inside(layout, backend):
    script = layout["bundle"] / "ddp.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        if dist.get_rank() == 0:
            open(os.path.join(sys.argv[1], "sum.txt"), "w").write(str(int(t.item())))
        dist.destroy_process_group()
    """))
    pre, _ = prefix_for(layout, backend, limits=Limits(max_processes=512))
    res = subprocess.run(pre + [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                                "--nproc-per-node=2", str(script), str(layout["w"])],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (layout["w"] / "sum.txt").read_text() == "3"  # 1 + 2


# -- fail closed, modes -----------------------------------------------------------------------
def test_strict_fails_closed_without_a_backend(monkeypatch, layout):
    monkeypatch.setattr(isolation, "_probe_cached", lambda backend: (False, "disabled by the test"))
    assert isolation.available_backend() is None
    with pytest.raises(IsolationError) as exc:
        sandbox_prefix("strict", writable=[layout["w"]], hidden=[], tmp_dir=None, socket_dir=None, bundle_dir=None)
    assert "bubblewrap" in str(exc.value) and "--isolation none" in str(exc.value)
    assert sandbox_prefix("none", writable=[layout["w"]], hidden=[], tmp_dir=None, socket_dir=None,
                          bundle_dir=None) == []
    with pytest.raises(IsolationError, match="isolation mode"):
        sandbox_prefix("lax", writable=[], hidden=[], tmp_dir=None, socket_dir=None, bundle_dir=None)


def test_available_backend_honours_the_forced_backend(monkeypatch):
    monkeypatch.setenv(isolation.ENV_BACKEND, "unshare")
    assert isolation.available_backend() == ("unshare" if "unshare" in WORKING else None)
    monkeypatch.setenv(isolation.ENV_BACKEND, "bwrap")
    assert isolation.available_backend() == ("bwrap" if "bwrap" in WORKING else None)


def test_tmp_dir_is_bound_at_tmp(layout, backend, tmp_path):
    if Path(sys.prefix).resolve().is_relative_to("/tmp"):
        with pytest.raises(IsolationError, match="tmp_dir"):
            sandbox_prefix("strict", writable=[layout["w"]], hidden=[], tmp_dir=tmp_path, socket_dir=None,
                           bundle_dir=None, backend=backend)
        return
    host_tmp = tmp_path / "private-tmp"
    host_tmp.mkdir()
    pre = sandbox_prefix("strict", writable=[layout["w"]], hidden=[], tmp_dir=host_tmp, socket_dir=None,
                         bundle_dir=None, backend=backend)
    r = run_in(pre, TRY + """
attempt("write", lambda: open("/tmp/t.txt", "w").write("in tmp") and None)
out["tmpdir"] = os.environ.get("TMPDIR")
print(json.dumps(out))
""")
    assert r == {"write": "ok", "tmpdir": "/tmp"}
    assert (host_tmp / "t.txt").read_text() == "in tmp"


# -- plain-subprocess limits ------------------------------------------------------------------
def test_limits_preexec_sets_hard_limits():
    fn = limits_preexec(address_space_bytes=2 << 30, max_processes=300, max_file_bytes=4096, max_open_files=50)
    code = ("import json, resource\n"
            "r = [resource.getrlimit(x) for x in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE,"
            " resource.RLIMIT_NOFILE, resource.RLIMIT_CORE)]\n"
            "try:\n    bytearray(3 << 30); m = 'ok'\nexcept MemoryError:\n    m = 'MemoryError'\n"
            "print(json.dumps([r, m]))")
    res = subprocess.run([sys.executable, "-c", code], preexec_fn=fn, capture_output=True, text=True, timeout=60)
    limits, mem = json.loads(res.stdout)
    assert limits == [[2 << 30] * 2, [300] * 2, [4096] * 2, [50] * 2, [0, 0]]
    assert mem == "MemoryError"
    with pytest.raises(ValueError):
        limits_preexec(max_open_files=0)


# -- quota ------------------------------------------------------------------------------------
def test_artifacts_usage_matches_du(tmp_path):
    d = tmp_path / "a"
    (d / "sub").mkdir(parents=True)
    (d / "f1").write_bytes(b"x" * 10_000)
    (d / "sub" / "f2").write_bytes(b"y" * 123_456)
    os.link(d / "f1", d / "sub" / "hard")  # counted once
    os.symlink("/etc/passwd", d / "link")  # not followed
    with open(d / "sparse", "wb") as f:
        f.seek(50 << 20)
        f.write(b"z")
    du = subprocess.run(["du", "-s", "-B1", str(d)], capture_output=True, text=True, check=True)
    assert artifacts_usage(d) == int(du.stdout.split()[0])
    assert artifacts_usage(tmp_path / "missing") == 0


def test_quota_and_guard(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "f").write_bytes(os.urandom(200_000))
    used = artifacts_usage(d)
    assert check_quota([d], used) == used
    with pytest.raises(QuotaExceeded, match=f"uses {used} bytes, over its quota of {used - 1} bytes"):
        check_quota([d], used - 1)
    for i in range(5):
        (d / f"n{i}").touch()
    with pytest.raises(QuotaExceeded, match="holds 6 files"):
        check_quota([d], None, max_entries=5)
    g = Guard([d], quota_bytes=used + 8192 * 2, interval_s=0.0)
    assert g.check() is None and g.summary()["peak_bytes"] == artifacts_usage(d)
    (d / "g").write_bytes(os.urandom(300_000))
    assert g.check().startswith("quota: the artifacts directory uses")
    assert g.summary()["reason"] == g.reason


def test_pick_sandbox_uid_is_unused_and_in_range():
    uid = pick_sandbox_uid(seed=7)
    assert sandboxwatch.SANDBOX_UID_MIN <= uid < sandboxwatch.SANDBOX_UID_MIN + sandboxwatch.SANDBOX_UID_SPAN
    assert tasks_of_uid(uid) == (0, 0)
    with pytest.raises(ValueError):
        sandboxwatch.kill_uid(0)


def test_an_empty_pythonpath_entry_never_binds_the_whole_host(monkeypatch):
    """``PYTHONPATH=src:`` (a trailing colon) puts the cwd on the interpreter's path, ``/`` for
    the path probe: the sandbox bound the whole host read-only, then found no stdlib in it."""
    from prism_challenge.evaluator.mountplan import _default_readable

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src") + os.pathsep)
    readable = _default_readable()
    assert "/" not in readable and readable  # and the interpreter's own paths are still there
    assert os.path.realpath(sys.prefix) in readable
