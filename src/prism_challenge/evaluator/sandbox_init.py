"""The in-sandbox init of the ``unshare`` backend (standard library only).

Run by :mod:`prism_challenge.evaluator.isolation` as ``python -I -S sandbox_init.py SPEC --
argv...`` inside fresh namespaces made by ``unshare(1)``: no ``site``, nothing imported from the
bundle or the package, so it starts in about 10 ms. ``SPEC`` is a JSON object: ``mounts`` (the
operations that build the allow-listed view on an empty tmpfs, which then becomes the root by
``pivot_root``; the old root is detached), ``root_bytes``, ``dev_nodes`` (the device nodes of
the minimal ``/dev``), ``lo`` (bring loopback up),
``init`` (act as pid 1 of the new pid namespace, reaping orphans), ``setsid``, ``rlimits``,
``env``, ``uid``/``gid`` (drop to the sandbox identity), ``capbset``/``dropcaps`` (drop every
capability), ``chdir``, ``pdeathsig``, ``pass_cwd``/``cwd_env`` (bwrap's outer helper puts the
working directory in that variable; the inner one enters it once it runs as the sandbox uid).
It then sets ``no_new_privs``, loads ``seccomp`` (the kernel-call filter
:mod:`~prism_challenge.evaluator.seccompfilter` compiled) and execs ``argv``; any failure exits with status 126 and a
``prism-sandbox:`` line on stderr (fail closed).
"""
import ctypes, fcntl, json, os, resource, signal, socket, struct, sys
spec = json.loads(sys.argv[1])
argv = sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384

def die(msg):
    os.write(2, ("prism-sandbox: " + msg + "\n").encode())
    os._exit(126)

def b(s):
    return None if s is None else os.fsencode(s)

def mount(src, dst, fstype, flags, data=None):
    if libc.mount(b(src), b(dst), b(fstype), flags, b(data)) != 0:
        e = ctypes.get_errno()
        die("mount %s on %s: %s" % (src, dst, os.strerror(e)))

class MountAttr(ctypes.Structure):
    _fields_ = [("set", ctypes.c_uint64), ("clr", ctypes.c_uint64), ("prop", ctypes.c_uint64), ("userns", ctypes.c_uint64)]

def ro_recursive(path):
    # mount_setattr(2) (Linux 5.12+, syscall 442 on every architecture but alpha), AT_RECURSIVE
    attr = MountAttr(1, 0, 0, 0)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(442, -100, b(path), 0x8000, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        return
    e = ctypes.get_errno()
    if e not in (38, 22, 1):  # ENOSYS, EINVAL, EPERM: fall back to one remount per mount
        die("mount_setattr %s read-only: %s" % (path, os.strerror(e)))
    prefix = path.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        mp = row[4].encode().decode("unicode_escape")
        if mp != path and not mp.startswith(prefix):
            continue
        opts = row[5].split(",")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC)):
            if name in opts:
                flags |= bit
        if libc.mount(None, b(mp), None, flags, None) != 0:
            e = ctypes.get_errno()
            if e not in (2, 20):  # vanished or overmounted
                die("remount %s read-only: %s" % (mp, os.strerror(e)))

def mkdirs(path, mode=0o755):
    parts = [p for p in path.split("/") if p]
    cur = ""
    for p in parts:
        cur += "/" + p
        if not os.path.lexists(cur):
            os.mkdir(cur, mode)
            os.chmod(cur, mode)

# pivot_root(2) has no libc wrapper; its number by architecture (the generic table: 41)
PIVOT_ROOT = {"x86_64": 155, "i386": 217, "i686": 217, "s390x": 217, "ppc64le": 203, "ppc64": 203,
              "armv7l": 218, "armv6l": 218}.get(os.uname().machine, 41)
STAGE = "/tmp"  # where the new root is built (in this private mount namespace only)

def do_mounts(ops, root_bytes, dev_nodes):
    """Build the view on an empty tmpfs, then make it the root: nothing else of the host is left."""
    fds, isdir = {}, {}
    def hold(src):  # open every bind source before anything is covered
        if src not in fds:
            fds[src] = os.open(src, os.O_PATH | os.O_CLOEXEC)
            isdir[src] = os.path.isdir(src)
    for op in ops:
        if op[0] in ("bind", "devbind"):
            hold(op[1])
        elif op[0] == "dev":
            for name in dev_nodes:
                if os.path.exists("/dev/" + name):
                    hold("/dev/" + name)
    mount("tmpfs", STAGE, "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=755" % root_bytes)
    def at(path):
        return STAGE + path if path != "/" else STAGE
    def bind(src, dst):
        if isdir[src]:
            mkdirs(dst)
        elif not os.path.lexists(dst):
            mkdirs(os.path.dirname(dst))
            os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))
        mount("/proc/self/fd/%d" % fds[src], dst, None, MS_BIND | MS_REC)
    for op in ops:
        kind = op[0]
        if kind == "proc":
            mkdirs(at(op[1]))
            mount("proc", at(op[1]), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            for name in ("sys", "sysrq-trigger", "irq", "bus"):  # read-only, as bwrap does
                p = at(op[1]) + "/" + name
                if os.path.exists(p):
                    mount(p, p, None, MS_BIND | MS_REC)
                    ro_recursive(p)
        elif kind == "tmpfs":
            _, path, size, mode = op
            mkdirs(at(path))
            mount("tmpfs", at(path), "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=%o" % (size, mode))
        elif kind == "dir":
            mkdirs(at(op[1]))
            os.chmod(at(op[1]), op[2])
        elif kind == "symlink":
            mkdirs(os.path.dirname(at(op[2])))
            os.symlink(op[1], at(op[2]))
        elif kind == "dev":  # what bwrap's --dev makes: a few nodes, /dev/fd & co, pts and shm dirs
            dev = at(op[1])
            mkdirs(dev)
            mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NODEV, "size=65536,mode=755")
            for name in dev_nodes:
                if "/dev/" + name in fds:
                    bind("/dev/" + name, dev + "/" + name)
            for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                                 ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                                 ("ptmx", "pts/ptmx"), ("core", "/proc/kcore")):
                os.symlink(target, dev + "/" + name)
            for name in ("pts", "shm"):
                mkdirs(dev + "/" + name)
        elif kind == "devbind":
            bind(op[1], at(op[2]))  # keeps the source's flags (not nodev)
        elif kind == "bind":
            _, src, dst, ro = op
            bind(src, at(dst))
            if ro:
                ro_recursive(at(dst))
            else:  # a bind copies the source mount's read-only flag: clear it on the top mount
                mount(None, at(dst), None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
        elif kind == "remount_ro":
            mount(None, at(op[1]), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        else:
            die("unknown mount op %r" % (kind,))
    for fd in fds.values():
        os.close(fd)
    # pivot_root(".", "."): the old root ends up on top of the new one, then is detached
    os.chdir(STAGE)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(PIVOT_ROOT, b".", b".") != 0:
        die("pivot_root: %s" % os.strerror(ctypes.get_errno()))
    if libc.umount2(b".", 2) != 0:  # MNT_DETACH
        die("detach the old root: %s" % os.strerror(ctypes.get_errno()))
    os.chdir("/")

def load_seccomp(b64):
    """Load a BPF program (base64 of a ``struct sock_filter`` array) with prctl(PR_SET_SECCOMP)."""
    import base64
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    code = base64.b64decode(b64)
    if not code or len(code) % 8:
        die("seccomp: a program of %d bytes is not a BPF program" % len(code))
    prog = Prog(len(code) // 8, code)
    if libc.prctl(22, 2, ctypes.cast(ctypes.pointer(prog), ctypes.c_void_p).value, 0, 0) != 0:  # SECCOMP_MODE_FILTER
        die("seccomp: %s" % os.strerror(ctypes.get_errno()))

def lo_up():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ifr = struct.pack("16sH22x", b"lo", 0)
    flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, ifr))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1 | 0x40))
    s.close()

if spec.get("pass_cwd"):  # bwrap's outer helper: hand the working directory on, then exec
    try:
        os.environ[spec["pass_cwd"]] = os.getcwd()
    except OSError:
        pass
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        die("exec %s: %s" % (argv[0], exc))
if spec.get("pdeathsig"):
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != spec["pdeathsig"]:
        os._exit(137)
os.umask(0o022)
try:
    cwd = os.getcwd()
except OSError:
    cwd = "/"
if spec.get("cwd_env"):  # bwrap cannot enter a directory only the sandbox uid may: do it here
    cwd = os.environ.pop(spec["cwd_env"], None) or cwd
if spec.get("mounts"):
    os.umask(0)
    do_mounts(spec["mounts"], spec.get("root_bytes", 1 << 20), spec.get("dev_nodes", []))
    os.umask(0o022)
if spec.get("lo"):
    lo_up()
if spec.get("init"):
    # pid 1 of the new pid namespace: start the command, reap every orphan, exit with its status
    child = os.fork()
    if child:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, f: os.kill(child, signal.SIGKILL))
        code = 1
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                code = code if code >= 0 else 128 - code
                break
        os._exit(code)  # the namespace dies with its init: every other process is killed
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
if spec.get("setsid"):
    try:
        os.setsid()
    except OSError:
        pass
for res, value in spec.get("rlimits", []):
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError) as exc:
        die("setrlimit %d=%d: %s" % (res, value, exc))
for key, value in spec.get("env", {}).items():
    os.environ[key] = value
uid, gid = spec.get("uid"), spec.get("gid")
if spec.get("capbset"):
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last capability
if gid is not None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
if uid is not None:
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        die("could not drop to uid %d" % uid)
if spec.get("dropcaps"):
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(ctypes.byref(Hdr(0x20080522, 0)), data) != 0:
        die("capset: %s" % os.strerror(ctypes.get_errno()))
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    die("no_new_privs: %s" % os.strerror(ctypes.get_errno()))
if spec.get("seccomp"):  # the kernel-call filter libseccomp compiled in the parent (seccompfilter.py)
    load_seccomp(spec["seccomp"])
try:  # the working directory, where the sandbox has it (else /)
    os.chdir(spec.get("chdir") or cwd)
except OSError:
    os.chdir("/")
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    die("exec %s: %s" % (argv[0], exc))
