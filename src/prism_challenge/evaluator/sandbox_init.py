"""The in-sandbox init of the ``unshare`` backend (standard library only).

Run by :mod:`prism_challenge.evaluator.isolation` as ``python -I -S sandbox_init.py SPEC --
argv...`` inside fresh namespaces made by ``unshare(1)``: no ``site``, nothing imported from the
bundle or the package, so it starts in about 10 ms. ``SPEC`` is a JSON object: ``mounts`` (the
bind/tmpfs/remount operations that build the read-only view), ``lo`` (bring loopback up),
``init`` (act as pid 1 of the new pid namespace, reaping orphans), ``setsid``, ``rlimits``,
``env``, ``uid``/``gid`` (drop to the sandbox identity), ``capbset``/``dropcaps`` (drop every
capability), ``chdir``, ``pdeathsig``. It then sets ``no_new_privs`` and execs ``argv``; any
failure exits with status 126 and a ``prism-sandbox:`` line on stderr (fail closed).
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

def do_mounts(ops):
    fds, isdir = {}, {}
    for op in ops:  # open every bind source before anything is covered
        if op[0] == "bind" and op[1] not in fds:
            fds[op[1]] = os.open(op[1], os.O_PATH | os.O_CLOEXEC)
            isdir[op[1]] = os.path.isdir(op[1])
    for op in ops:
        kind = op[0]
        if kind == "ro_all":
            ro_recursive("/")
        elif kind == "proc":
            mount("proc", op[1], "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif kind == "tmpfs":
            _, path, size, mode = op
            mkdirs(path)
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=%o" % (size, mode))
        elif kind == "dir":
            mkdirs(op[1])
            os.chmod(op[1], op[2])
        elif kind == "bind":
            _, src, dst, ro = op
            if isdir[src]:
                mkdirs(dst)
            elif not os.path.lexists(dst):
                mkdirs(os.path.dirname(dst))
                os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))
            mount("/proc/self/fd/%d" % fds[src], dst, None, MS_BIND | MS_REC)
            if ro:
                ro_recursive(dst)
            else:  # a bind copies the source mount's read-only flag: clear it on the top mount
                mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
        else:
            die("unknown mount op %r" % (kind,))
    for fd in fds.values():
        os.close(fd)

def lo_up():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ifr = struct.pack("16sH22x", b"lo", 0)
    flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, ifr))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1 | 0x40))
    s.close()

if spec.get("pdeathsig"):
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != spec["pdeathsig"]:
        os._exit(137)
os.umask(0o022)
if spec.get("mounts"):
    os.umask(0)
    do_mounts(spec["mounts"])
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
try:
    os.chdir(spec.get("chdir") or os.getcwd())
except OSError:
    os.chdir("/")
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    die("exec %s: %s" % (argv[0], exc))
