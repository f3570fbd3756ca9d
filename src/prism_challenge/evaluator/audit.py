"""Runtime audit hooks (PEP 578) in every process that runs submitted code.

:func:`arm` installs one ``sys.addaudithook`` hook after the harness's own imports and warm-up
and before the bundle is imported: in every rank (:mod:`~prism_challenge.evaluator.runner`), the
parameter-cap child (:mod:`~prism_challenge.gates.param_count`) and the held-out and blind-probe
children (:mod:`~prism_challenge.heldout`). CPython offers no way to remove an audit hook, so it
holds for the rest of the process, even where the static gate missed a path. It refuses:

* ``ctypes.*`` (``dlopen`` and the rest), extension modules loaded from outside the
  interpreter's install (the ``import`` event with a file name);
* sockets (``socket.*``) and the stdlib's network clients (``http.client``, ``urllib``, ...);
* processes: ``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.spawn*``,
  ``os.posix_spawn*``, ``os.fork``, ``os.forkpty``, ``os.kill``, ``pty.spawn``;
* opening a path for writing (``open``, ``os.mkdir``, ``os.rename``, ``shutil.*``, ...) outside
  the writable directories (``ctx.artifacts_dir``, the private ``/tmp``, ``/dev/shm``);
* opening or listing a path for reading outside the interpreter's install (its prefixes,
  ``sys.path``, this package), the bundle and the writable directories;
* from a bundle frame: importing a module the gate's import allow-list refuses
  (:func:`prism_challenge.gates.sandbox.module_rule`), and the code-generation, frame and heap
  introspection events (``compile``, ``exec``, ``marshal.loads``, ``code.__new__``,
  ``sys._getframe``, ``gc.get_objects``, ``sys.settrace``, ``object.__setattr__`` on objects
  the bundle did not define, ...). Imports made by torch or the harness on their own behalf
  (their transitive imports) are not the bundle's.

**What torch's compiler does is admitted, exactly.** ``torch.compile`` on CPU writes code under
its cache dir, runs ``g++`` and loads the library it built. An event is admitted as the
compiler's when, walking out from it, every frame up to a compile entry (dynamo's frame
conversion, AOTAutograd's lazy backward compile: :data:`COMPILE_ENTRIES`) belongs to the
interpreter's install (torch and the libraries it uses), never to the bundle, the harness or
code from elsewhere. Inductor's compile threads are fixed at one
(:func:`~prism_challenge.evaluator.launcher.compute_env`), so compilation runs in the thread
that asked for it, under its entry.

A refused event is final: the hook writes one line ``PRISM-AUDIT-REFUSED {json}`` (the event,
its argument, the rule, the origin ``file:line``) to file descriptor 2 and ends the process with
:data:`AUDIT_EXIT_CODE` through ``os._exit``, so no ``except`` in submitted code can swallow it.
The trusted parent reads that line (:func:`find_refusal`) and fails the run at stage
``contract``. A line written by the submission itself can only fail its own run.

The hooks see only what goes through Python. Native code, and what torch does in C++ (its file
writer, gloo's sockets), is the OS sandbox's to contain (:mod:`~prism_challenge.evaluator.isolation`).
"""

from __future__ import annotations

import _thread
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

AUDIT_EXIT_CODE = 86
"""Exit status of a process the hook stopped (torchrun, the parent and the tests look for it)."""

REFUSAL_TAG = "PRISM-AUDIT-REFUSED"
ENV_OFF = "PRISM_AUDIT_HOOKS"
"""Set to ``off`` by the trusted parent alone (:class:`~prism_challenge.evaluator.jail.Jail` with
``audit=False``: tests of the sandbox by itself); the jail's environment allow-list drops it
from anyone else's environment."""
"""The first word of the line the hook writes to stderr before it ends the process."""

COMPILE_ENTRIES = ("torch/_dynamo/convert_frame.py", "torch/_functorch/_aot_autograd/runtime_wrappers.py")
"""Files whose frames start a compilation on the submission's behalf: dynamo's frame conversion
(the first call of a ``torch.compile``d module or function) and AOTAutograd's backward, which
compiles the backward graph lazily on the first ``loss.backward()``."""

CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".so", ".pyd", ".pth")
"""Files read as code: never from a writable directory (outside a compilation the hook admits)."""

READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/full")
"""Device files any process may open (they hold no host data)."""

NETWORK_PREFIXES = ("socket.", "http.client.", "urllib.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
                    "nntplib.", "telnetlib.", "webbrowser.", "ssl.")
PROCESS_PREFIXES = ("os.exec", "os.spawn", "os.posix_spawn")
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg",
                            "pty.spawn", "os.startfile", "signal.pthread_kill"})
WRITE_EVENTS = frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.link", "os.symlink", "os.truncate",
                          "os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.utime", "os.setxattr",
                          "os.removexattr", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
                          "shutil.copytree", "shutil.move", "shutil.rmtree", "shutil.chown", "shutil.make_archive",
                          "shutil.unpack_archive", "tempfile.mkstemp", "tempfile.mkdtemp"})
READ_EVENTS = frozenset({"os.listdir", "os.scandir", "os.walk", "os.fwalk", "glob.glob", "glob.glob/2", "os.chdir",
                         "os.getxattr", "os.listxattr"})
BUNDLE_CALLER_EVENTS = frozenset({
    "compile", "exec", "marshal.loads", "marshal.load", "code.__new__", "function.__new__", "sys._getframe",
    "sys._current_frames", "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "object.__getattr__", "cpython.PyInterpreterState_Clear",
    "cpython._PySys_ClearAuditHooks", "sys.unraisablehook", "sys.excepthook", "pickle.find_class",
    "builtins.input", "builtins.breakpoint", "cpython.run_command", "cpython.run_file", "cpython.run_module",
    "cpython.run_stdin", "cpython.run_interactivehook", "cpython.run_startup",
})
"""Events refused when the frame that raised them is the bundle's own code (the innermost
frame: ``compile`` of a bundle module by importlib during its import is importlib's)."""
SET_ATTR_EVENTS = frozenset({"object.__setattr__", "object.__delattr__"})

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install_roots(writable: Iterable[str] = ()) -> list[str]:
    """The directories of this interpreter's install: its prefixes, the stdlib and site
    directories, this package's source directory, and every other directory on ``sys.path``
    that is not inside one of ``writable`` (absolute, symlinks resolved)."""
    base = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            *sysconfig.get_paths().values(), str(Path(__file__).resolve().parents[2])}
    write = _prefixes(writable)
    rest = {p for p in sys.path if p and os.path.isabs(p) and not _under(os.path.realpath(p), write)}
    return sorted({os.path.realpath(p) for p in base | rest if os.path.isdir(p)})


def _stdlib_roots() -> tuple[str, ...]:
    """The standard library's directory (``os.py`` lives there; in a venv ``sysconfig``'s
    ``platstdlib`` is the venv's own ``lib/pythonX.Y``, which holds site-packages)."""
    return _prefixes([os.path.dirname(os.__file__)])


def _site_roots() -> tuple[str, ...]:
    """Where installed packages live (they may lie under the stdlib's directory)."""
    paths = sysconfig.get_paths()
    site = {paths["purelib"], paths["platlib"]}
    site.update(p for p in sys.path if p and os.path.isabs(p) and os.path.basename(p) in ("site-packages", "dist-packages"))
    return _prefixes(p for p in site if os.path.isdir(p))


def compiler_cache_roots() -> tuple[str, ...]:
    """Where inductor writes the modules it generates: ``$TORCHINDUCTOR_CACHE_DIR``, else its
    default ``torchinductor_<user>`` under the temporary directory (prefixes, as strings).

    Frames of those modules count as the compiler's own while a compilation runs (a generated
    wrapper builds its kernels with ``g++`` as it is imported), never as an entry."""
    roots = [os.path.join(os.path.realpath(tempfile.gettempdir()), "torchinductor")]
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        roots.append(os.path.realpath(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rstrip(os.sep) + os.sep)
    return tuple(roots)


def own_modules(bundle_dir: str) -> frozenset[str]:
    """Top-level module names a bundle defines: its ``*.py`` files and its packages (folders
    with an ``__init__.py``)."""
    names = set()
    for entry in os.scandir(bundle_dir):
        if entry.is_file() and entry.name.endswith(".py"):
            names.add(entry.name[:-3])
        elif entry.is_dir() and os.path.isfile(os.path.join(entry.path, "__init__.py")):
            names.add(entry.name)
    return frozenset(names)


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r[:-1] or path.startswith(r) for r in roots)


def _prefixes(paths: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted({os.path.realpath(p).rstrip(os.sep) + os.sep for p in paths}))


def _short(value: Any) -> str:
    """The event's argument for the report, without calling submitted ``__repr__`` methods."""
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        text = repr(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, bytes, int)) for v in value[:8]):
        text = repr(list(value[:8]))
    else:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."


def _report(event: str, args: tuple, rule: str, origin: str) -> None:
    """Write the refusal line to fd 2 and end the process (never returns)."""
    line = json.dumps({"event": event, "arg": _short(args[0]) if args else "", "rule": rule, "origin": origin})
    try:
        os.write(2, f"\n{REFUSAL_TAG} {line}\n".encode())
    finally:
        os._exit(AUDIT_EXIT_CODE)


def arm(bundle_dir: str, writable: Iterable[str], *, hidden: Iterable[str] = (),
        allowed_import: Callable[[str, frozenset[str]], bool] | None = None) -> None:
    """Install the audit hook in this process (it cannot be removed).

    Args:
        bundle_dir: the frozen bundle copy the process imports the submission from.
        writable: directories the submission may write (``ctx.artifacts_dir``); the temporary
            directory (``tempfile.gettempdir()``: the sandbox's private ``/tmp``) and ``/dev/shm``
            are added.
        hidden: paths never opened, even inside the directories above (the data directory,
            its salt, PRISM's caches: the jail's hidden paths, which may lie under the host's
            ``/tmp`` when there is no sandbox).
        allowed_import: ``(module, own_modules) -> bool`` for imports made by bundle frames;
            default: the static gate's rule (:func:`prism_challenge.gates.sandbox.module_rule`).

    Raises:
        OSError: ``bundle_dir`` cannot be listed.
    """
    if os.environ.get(ENV_OFF) == "off":
        return
    if allowed_import is None:
        from prism_challenge.gates.sandbox import module_rule

        def allowed_import(name: str, own: frozenset[str]) -> bool:
            return module_rule(name, set(own)) is None

    bundle = _prefixes([bundle_dir])
    harness = _prefixes([str(Path(__file__).resolve().parents[1])])
    writable = [*writable, tempfile.gettempdir(), "/dev/shm"]
    install = tuple(r for r in _prefixes(install_roots(writable)) if not _under(r.rstrip(os.sep), bundle))
    # code is imported from the install and the bundle only: the working directory (``-m``
    # puts it first) and anything writable leave the import path, so nothing written can shadow
    # a module torch imports later
    sys.path[:] = [p for p in sys.path if p and (_under(os.path.realpath(p), install) or _under(os.path.realpath(p), bundle))]
    write = _prefixes([*writable, *READABLE_DEVICES])
    readable = install + bundle + write + _prefixes([f"/proc/{os.getpid()}", "/proc/self",
                                                     "/sys/devices/system/cpu"])
    policy = _Policy(bundle, harness, install, write, readable, _stdlib_roots(), own_modules(bundle_dir),
                     allowed_import, _site_roots(), compiler_cache_roots(), _prefixes(hidden))
    sys.addaudithook(policy.hook())


class _Policy:
    """The hook's fixed view of the process: which files are whose, which paths are open to it."""

    def __init__(self, bundle, harness, install, write, readable, stdlib, own, allowed_import, site, cache, hidden):
        self.bundle, self.harness, self.install = bundle, harness, install
        self.write, self.readable, self.stdlib = write, readable, stdlib
        self.own, self.allowed_import, self.site, self.cache = own, allowed_import, site, cache
        self.hidden = hidden
        self.kinds: dict[str, str] = {}
        self.entries = tuple(os.sep + e for e in COMPILE_ENTRIES)

    # -- frames -------------------------------------------------------------------------------
    def kind(self, filename: str) -> str:
        """``stdlib``, ``pseudo`` (``<frozen ...>``, ``<string>``), ``bundle``, ``harness``,
        ``install`` (torch and the other installed packages), ``compiled`` (a module inductor
        generated in its cache dir) or ``other``."""
        k = self.kinds.get(filename)
        if k is None:
            real = os.path.realpath(filename) if filename[:1] != "<" else filename
            if filename[:1] == "<":
                k = "pseudo"
            elif _under(real, self.bundle):
                k = "bundle"
            elif _under(real, self.harness):
                k = "harness"
            elif _under(real, self.site):
                k = "install"
            elif real.startswith(self.cache):
                k = "compiled"
            elif _under(real, self.stdlib):
                k = "stdlib"
            elif _under(real, self.install):
                k = "install"
            else:
                k = "other"
            self.kinds[filename] = k
        return k

    def origin(self, frame: Any) -> tuple[str, Any]:
        """The kind of the innermost frame that is not the stdlib's, and that frame."""
        while frame is not None:
            k = self.kind(frame.f_code.co_filename)
            if k not in ("stdlib", "pseudo", "compiled"):
                return k, frame
            frame = frame.f_back
        return "stdlib", None

    def importer(self, frame: Any) -> str:
        """The kind of the frame whose import statement raised an ``import`` event (the first
        frame outside importlib's frozen machinery)."""
        while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
        return self.kind(frame.f_code.co_filename) if frame is not None else "stdlib"

    def where(self, frame: Any) -> str:
        """``file:line`` of the innermost bundle frame on the stack (the submission's line that
        led to the event), else of the innermost frame outside the stdlib."""
        first = self.origin(frame)[1]
        while frame is not None and self.kind(frame.f_code.co_filename) != "bundle":
            frame = frame.f_back
        frame = frame or first
        return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"

    def compiling(self, frame: Any) -> bool:
        """Whether the event comes from torch's compiler working for a compile entry."""
        while frame is not None:
            filename = frame.f_code.co_filename
            k = self.kind(filename)
            if k in ("bundle", "harness", "other"):
                return False
            if k == "install" and filename.endswith(self.entries):
                return True
            frame = frame.f_back
        return False

    # -- rules --------------------------------------------------------------------------------
    def path_rule(self, path: Any, writing: bool) -> str | None:
        if isinstance(path, int):
            return "no-fd-open"  # an fd the harness holds (the feeder's socket) is not a file to open
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return None
        real = os.path.realpath(path)
        if _under(real, self.hidden):
            return "no-hidden-path"
        if writing:  # the frozen bundle and the install are never writable, wherever they lie
            ok = _under(real, self.write) and not _under(real, self.bundle) and not _under(real, self.install)
            return None if ok else "no-write-outside-artifacts"
        if real.endswith(CODE_SUFFIXES) and _under(real, self.write) and not _under(real, self.install + self.bundle):
            return "no-code-outside-install"  # what was written is data, never code to import
        return None if _under(real, self.readable) else "no-read-outside-install"

    def installed(self, path: Any) -> bool:
        """Whether ``path`` lies in the interpreter's install (not the bundle, not a writable dir)."""
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return isinstance(path, str) and _under(os.path.realpath(path), self.install)

    def rule(self, event: str, args: tuple, frame: Any) -> str | None:
        """The rule ``event`` breaks, or ``None``."""
        kind, _ = self.origin(frame)
        if event == "open":
            mode, flags = (args[1], args[2]) if len(args) >= 3 else ("r", 0)
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if isinstance(args[0], int) and kind != "bundle":
                return None
            why = self.path_rule(args[0], writing)
            return None if why is None or self.compiling(frame) else why
        if event == "import":
            filename = args[1] if len(args) > 1 else None
            if filename and not self.installed(filename) and not self.compiling(frame):
                return "no-native-load"  # an extension module, or a file named to the loader
            if self.importer(frame) == "bundle" and not self.allowed_import(str(args[0]), self.own):
                return "import-not-allowed"  # the bundle's own import statement (not the stdlib's, torch's)
            return None
        if event.startswith("ctypes."):
            return None if self.compiling(frame) else "no-ffi"
        if event.startswith(NETWORK_PREFIXES):
            return "no-network"
        if event in PROCESS_EVENTS or event.startswith(PROCESS_PREFIXES):
            return None if self.compiling(frame) else "no-process"
        if event in WRITE_EVENTS or event in READ_EVENTS:
            paths = [a for a in args[:2] if isinstance(a, (str, bytes))] if event in (
                "os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.copytree", "shutil.move") else args[:1]
            for p in paths:
                why = self.path_rule(p, event in WRITE_EVENTS)
                if why is not None and not self.compiling(frame):
                    return why
            return None
        if frame is None or self.kind(frame.f_code.co_filename) != "bundle":
            return None  # the rest only when the bundle's own frame raised it (not importlib's, say)
        if event in SET_ATTR_EVENTS:
            module = getattr(args[0], "__module__", None) if args else None
            return None if isinstance(module, str) and module.partition(".")[0] in self.own else "no-monkeypatch"
        return "no-introspection" if event in BUNDLE_CALLER_EVENTS else None

    def hook(self) -> Callable[[str, tuple], None]:
        """The audit hook: dispatches on the event name, cheaply skips the rest."""
        relevant: dict[str, bool] = {}
        busy = [0]
        get_ident, getframe = _thread.get_ident, sys._getframe

        def classify(event: str) -> bool:
            hit = (event in ("open", "import") or event in PROCESS_EVENTS or event in WRITE_EVENTS
                   or event in READ_EVENTS or event in BUNDLE_CALLER_EVENTS or event in SET_ATTR_EVENTS
                   or event.startswith(("ctypes.", *NETWORK_PREFIXES, *PROCESS_PREFIXES)))
            relevant[event] = hit
            return hit

        def hook(event: str, args: tuple) -> None:
            hit = relevant.get(event)
            if hit is False or (hit is None and not classify(event)):
                return
            me = get_ident()
            if busy[0] == me:
                return  # an event raised by the hook's own work (realpath, _getframe)
            busy[0] = me
            try:
                frame = getframe(1)
                why = self.rule(event, args, frame)
                if why is not None:
                    _report(event, args, f"prism:audit-{why}", self.where(frame))
            finally:
                busy[0] = 0

        return hook


def find_refusal(text: str) -> dict[str, Any] | None:
    """The first refusal line in a child's stderr or log, parsed: ``{"event", "arg", "rule",
    "origin"}``; ``None`` when there is none (or it is malformed)."""
    for line in text.splitlines():
        head, _, body = line.strip().partition(" ")
        if head != REFUSAL_TAG:
            continue
        try:
            found = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(found, dict) and {"event", "arg", "rule"} <= set(found):
            return {k: str(found.get(k, "")) for k in ("event", "arg", "rule", "origin")}
    return None


def describe_refusal(found: dict[str, Any]) -> str:
    """One line for the user: ``the audit hook refused <event>(<arg>) [rule] at file:line``."""
    return (f"the runtime audit hook refused {found['event']}({found['arg']}) [{found['rule']}] "
            f"at {found.get('origin') or '?'}")
