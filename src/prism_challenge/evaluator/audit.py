"""Runtime audit hooks (PEP 578) in every process that runs submitted code.

:func:`arm` installs one ``sys.addaudithook`` hook after the harness's own imports and warm-up
and before the bundle is imported: in every rank (:mod:`~prism_challenge.evaluator.runner`), the
parameter-cap child (:mod:`~prism_challenge.gates.param_count`) and the held-out and blind-probe
children (:mod:`~prism_challenge.audit.heldout`). CPython offers no way to remove an audit hook, so it
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
  (:func:`prism_challenge.gates.modulerule.module_rule`), and the code-generation, frame and heap
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
that asked for it, under its entry. On CUDA the same holds for Triton's programs (``ldconfig -p``,
its bundled ``ptxas``) and its cache (``TRITON_CACHE_DIR``, set by the harness), and torch's own
NVML load is admitted from torch's own frames (:mod:`~prism_challenge.evaluator.gpuadmit`).

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
import re
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prism_challenge.evaluator import gpuadmit
from prism_challenge.evaluator.childgc import resume as resume_gc

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

COMPILERS = frozenset({"g++", "gcc", "c++", "cc", "clang", "clang++"})
"""The only programs a compilation may start (inductor's C++ compiler)."""

ISA_PROBE = re.compile(
    r'\nimport sys\nif sys\.platform != "linux":\n    import torch  # noqa: F401\nfrom ctypes import cdll\n'
    r'cdll\.LoadLibrary\("(?P<path>[^"\\\n]+\.so)"\)\n')
"""The program inductor's ``cpu_vec_isa`` runs with ``python -c`` to check that the ISA test
library it built under its cache loads (torch 2.x, ``_probe_load``)."""

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


class _SetAfterImport:
    """A ``sys.meta_path`` finder that sets attributes of one module right after it executes,
    whoever imports it first (it removes itself then)."""

    def __init__(self, name: str, values: dict[str, Any]):
        self.name, self.values = name, values

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run, values, me = spec.loader.exec_module, self.values, self

        def exec_module(module: Any) -> None:
            run(module)
            for key, value in values.items():
                setattr(module, key, value)
            if me in sys.meta_path:
                sys.meta_path.remove(me)

        spec.loader.exec_module = exec_module
        return spec


COMPILER_SETTINGS = {"torch._dynamo.config": {"rewrite_assert_with_torch_assert": False}}
"""Compiler settings fixed in every child before the bundle runs. Dynamo rewrites ``assert cond,
msg`` into ``torch._assert_async(cond, msg)`` and inductor pastes ``msg`` unescaped into the C++
and Python source it generates and then loads (a red team ran ``os.system`` from an assert
message); with the rewrite off an assert graph-breaks and runs as the bundle's own Python."""


def harden_compiler() -> None:
    """Apply :data:`COMPILER_SETTINGS` now (module already imported) or when the module is first
    imported (a ``sys.meta_path`` hook: importing dynamo costs seconds a child may never need)."""
    for name, values in COMPILER_SETTINGS.items():
        module = sys.modules.get(name)
        if module is not None:
            for key, value in values.items():
                setattr(module, key, value)
        else:
            sys.meta_path.insert(0, _SetAfterImport(name, values))


def compiler_cache_roots() -> tuple[str, ...]:
    """Where inductor writes the modules it generates: ``$TORCHINDUCTOR_CACHE_DIR``, else its
    default ``torchinductor_<user>`` under the temporary directory, and Triton's cache
    ``$TRITON_CACHE_DIR`` (the harness sets it: :data:`~prism_challenge.evaluator.gpuadmit.TRITON_CACHE_DIR`)
    (prefixes, as strings).

    Frames of those modules count as the compiler's own while a compilation runs (a generated
    wrapper builds its kernels with ``g++`` as it is imported), never as an entry."""
    roots = [os.path.join(os.path.realpath(tempfile.gettempdir()), "torchinductor")]
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        roots.append(os.path.realpath(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rstrip(os.sep) + os.sep)
    if os.environ.get("TRITON_CACHE_DIR"):
        roots.append(os.path.realpath(os.environ["TRITON_CACHE_DIR"]).rstrip(os.sep) + os.sep)
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


def _plain(value: Any) -> str | int | None:
    """``value`` as an exact ``str`` (bytes decoded) or ``int`` without calling any method it defines
    (a subclass's ``__getitem__`` or ``__fspath__`` would run submitted code inside the hook, with
    its guard up); ``None`` for anything else."""
    if type(value) in (str, int):
        return value
    if type(value) is bytes:
        return os.fsdecode(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return os.fsdecode(bytes.__getitem__(value, slice(None)))
    return None


def _int(value: Any) -> int:
    return value if type(value) is int else 0


def _short(value: Any) -> str:
    """The event's argument for the report, without calling submitted ``__repr__`` methods."""
    if type(value) in (str, bytes, int, float, bool) or value is None:
        text = repr(value)
    elif type(value) in (list, tuple) and all(type(v) in (str, bytes, int) for v in value[:8]):
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
            default: the static gate's rule (:func:`prism_challenge.gates.modulerule.module_rule`).

    Raises:
        OSError: ``bundle_dir`` cannot be listed.
    """
    resume_gc()  # the collector is back before the bundle's first line (childgc)
    if os.environ.get(ENV_OFF) == "off":
        return
    policy = build_policy(bundle_dir, writable, hidden=hidden, allowed_import=allowed_import)
    # code is imported from the install and the bundle only: the working directory (``-m``
    # puts it first) and anything writable leave the import path, so nothing written can shadow
    # a module torch imports later
    inside = policy.install + policy.bundle
    sys.path[:] = [p for p in sys.path if p and _under(os.path.realpath(p), inside)]
    harden_compiler()
    sys.addaudithook(policy.hook())


def build_policy(bundle_dir: str, writable: Iterable[str], *, hidden: Iterable[str] = (),
                 allowed_import: Callable[[str, frozenset[str]], bool] | None = None) -> _Policy:
    """The hook's policy for this process (:func:`arm`'s arguments), without installing it: its
    :meth:`_Policy.rule` says which rule an event breaks (the tests feed it synthetic events).

    Raises:
        OSError: ``bundle_dir`` cannot be listed.
    """
    if allowed_import is None:
        from prism_challenge.gates.modulerule import module_rule

        def allowed_import(name: str, own: frozenset[str]) -> bool:
            return module_rule(name, set(own)) is None

    bundle = _prefixes([bundle_dir])
    harness = _prefixes([str(Path(__file__).resolve().parents[1])])
    writable = [*writable, tempfile.gettempdir(), "/dev/shm"]
    install = tuple(r for r in _prefixes(install_roots(writable)) if not _under(r.rstrip(os.sep), bundle))
    write = _prefixes([*writable, *READABLE_DEVICES])
    readable = install + bundle + write + _prefixes([f"/proc/{os.getpid()}", "/proc/self",
                                                     "/sys/devices/system/cpu"])
    return _Policy(bundle, harness, install, write, readable, _stdlib_roots(), own_modules(bundle_dir),
                   allowed_import, _site_roots(), compiler_cache_roots(), _prefixes(hidden))


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
    def path_rule(self, path: Any, writing: bool, compiling: bool = False, torch_itself: bool = False) -> str | None:
        """The rule opening ``path`` breaks, or ``None``. ``compiling``: torch's compiler at work
        (it may also read outside the install, and read and write its cache, never more);
        ``torch_itself``: the innermost frame outside the stdlib is the install's (it may make its
        cache directory)."""
        path = _plain(path)
        if path is None:
            return "no-odd-path"  # a str or bytes subclass would run its own methods in the hook
        if isinstance(path, int):
            return "no-fd-open"  # an fd the harness holds (the feeder's socket) is not a file to open
        real = os.path.realpath(path)
        if _under(real, self.hidden):
            return "no-hidden-path"
        if writing:  # the frozen bundle and the install are never writable, wherever they lie
            ok = _under(real, self.write) and not _under(real, self.bundle) and not _under(real, self.install)
            if ok and real.startswith(self.cache) and not (compiling or torch_itself):
                return "no-write-to-compiler-cache"  # what inductor loads as code is inductor's to write
            return None if ok else "no-write-outside-artifacts"
        code = real.endswith(CODE_SUFFIXES) and _under(real, self.write) and not _under(real, self.install + self.bundle)
        if code and not (compiling and real.startswith(self.cache)):
            return "no-code-outside-install"  # what was written is data, never code to import
        return None if compiling or _under(real, self.readable) else "no-read-outside-install"

    def rule(self, event: str, args: tuple, frame: Any) -> str | None:
        """The rule ``event`` breaks, or ``None``."""
        if event in BUNDLE_CALLER_EVENTS or event in SET_ATTR_EVENTS:  # the frequent ones: no stack walk
            if frame is None or self.kind(frame.f_code.co_filename) not in ("bundle", "compiled", "other"):
                return None  # only when submitted or generated code raised it (not importlib, not torch)
            if event in SET_ATTR_EVENTS:
                return None if self.own_class(args[0] if args else None) else "no-monkeypatch"
            return "no-introspection"
        kind, first = self.origin(frame)
        compiling = self.compiling(frame) if kind != "bundle" else False
        if event == "open":
            mode, flags = (args[1], args[2]) if len(args) >= 3 else ("r", 0)
            writing = (type(mode) is str and any(c in mode for c in "wax+")) or bool(_int(flags) & _WRITE_FLAGS)
            if type(args[0]) is int and kind != "bundle":
                return None
            if kind == "bundle" and type(args[0]) in (str, bytes) and not os.path.isabs(args[0]):
                return "no-relative-path"  # relative to a dir_fd the event does not show, perhaps
            if compiling and not writing and kind == "install" and self.triton_build_read(args[0], first):
                return None
            return self.path_rule(args[0], writing, compiling, kind == "install")
        if event == "import":
            filename = _plain(args[1]) if len(args) > 1 and args[1] is not None else None
            if len(args) > 1 and args[1] is not None and (filename is None or not (
                    self.installed(filename) or (compiling and os.path.realpath(filename).startswith(self.cache)))):
                return "no-native-load"  # an extension module, or a file named to the loader
            name = args[0] if type(args[0]) is str else None
            if self.importer(frame) == "bundle" and (name is None or not self.allowed_import(name, self.own)):
                return "import-not-allowed"  # the bundle's own import statement (not the stdlib's, torch's)
            return None
        if event.startswith("ctypes."):
            target = _plain(args[0]) if event == "ctypes.dlopen" and args else None
            cached = type(target) is str and os.path.realpath(target).startswith(self.cache)
            return None if (compiling and cached) or self.torch_nvml(event, args, kind, first) else "no-ffi"
        if event.startswith(NETWORK_PREFIXES):
            return "no-network"
        if event in PROCESS_EVENTS or event.startswith(PROCESS_PREFIXES):
            ok = compiling and event == "subprocess.Popen" and self.compiler_process(args, kind, first)
            return None if ok else "no-process"
        if event in WRITE_EVENTS or event in READ_EVENTS:
            two = event in ("os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.copytree", "shutil.move")
            for p in (args[:2] if two else args[:1]):
                if type(p) is int and kind != "bundle":
                    continue  # a directory fd torch or the stdlib holds (shutil.rmtree walks by fd)
                why = self.path_rule(p, event in WRITE_EVENTS, compiling, kind == "install")
                if why is not None:
                    return why
            return None
        return None

    def torch_nvml(self, event: str, args: tuple, kind: str, first: Any) -> bool:
        """Whether a ``ctypes`` event is torch's own NVML load from torch's own frame ``first``
        (the innermost outside the stdlib, of kind ``kind``): :func:`~prism_challenge.evaluator.
        gpuadmit.torch_nvml`."""
        if kind != "install" or first is None:
            return False
        return gpuadmit.torch_nvml(event, args, self.in_site(first.f_code.co_filename), first.f_code.co_name)

    def triton_build_read(self, path: Any, first: Any) -> bool:
        """Whether opening ``path`` for reading is Triton copying the launcher it just built in a
        temporary folder into its cache, from its own frame ``first``:
        :func:`~prism_challenge.evaluator.gpuadmit.triton_build_output`."""
        path = _plain(path)
        if type(path) is not str or first is None:
            return False
        real = os.path.realpath(path)
        if _under(real, self.hidden) or real.startswith(self.cache):
            return False
        temp = os.path.realpath(tempfile.gettempdir()).rstrip(os.sep) + os.sep
        return gpuadmit.triton_build_output(real, self.in_site(first.f_code.co_filename), temp)

    def in_site(self, path: str) -> str | None:
        """``path`` (resolved) relative to the site directory that holds it, with ``/``
        separators; ``None`` when no site directory holds it, or it lies in the bundle or in a
        writable directory inside the site directory."""
        real = os.path.realpath(path)
        if _under(real, self.bundle):
            return None
        for root in self.site:
            if real.startswith(root):
                if any(real.startswith(w) and not root.startswith(w) for w in self.write):
                    return None  # a writable folder inside the install is never the install's
                # (a site directory under a writable one, e.g. a venv under /tmp, is bound
                # read-only in the sandbox: the install all the same)
                return real[len(root):].replace(os.sep, "/")
        return None

    def compiler_process(self, args: tuple, kind: str = "", first: Any = None) -> bool:
        """Whether a ``subprocess.Popen`` event starts what inductor starts: its C++ compiler
        (:data:`COMPILERS`), ``openssl sha512 FILE`` (a precompiled header's checksum), its one
        probe that loads the ISA test library it just built in its cache (:data:`ISA_PROBE`), or
        one of Triton's programs started from Triton's frame ``first`` (of kind ``kind``:
        :func:`~prism_challenge.evaluator.gpuadmit.triton_process`)."""
        program = _plain(args[0]) if args else None
        if type(program) is not str:
            return False
        argv = args[1] if len(args) > 1 else None
        if kind == "install" and first is not None and gpuadmit.triton_process(
                program, argv, self.in_site(first.f_code.co_filename), self.in_site(program)):
            return True
        if os.path.basename(program) in COMPILERS:
            return True
        if os.path.basename(program) == "openssl":  # the checksum of a precompiled header
            return type(argv) is list and len(argv) == 3 and argv[:2] == ["openssl", "sha512"]
        if program != sys.executable or type(argv) is not list or len(argv) != 3 or argv[1] != "-c":
            return False
        probe = ISA_PROBE.fullmatch(argv[2]) if type(argv[2]) is str else None
        return probe is not None and os.path.realpath(probe.group("path")).startswith(self.cache)

    def installed(self, path: Any) -> bool:
        """Whether ``path`` lies in the interpreter's install (not the bundle, not a writable dir)."""
        path = _plain(path)
        return type(path) is str and _under(os.path.realpath(path), self.install)

    def own_class(self, obj: Any) -> bool:
        """Whether ``obj`` is a class one of the bundle's modules defined (read from the type's
        own dictionary: no attribute lookup that could run submitted code)."""
        if not isinstance(obj, type):
            return False
        module = type.__dict__["__module__"].__get__(obj, type)
        return type(module) is str and module.partition(".")[0] in self.own

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
        except (ValueError, RecursionError):  # not JSON, a number too long, nested too deep
            continue
        if isinstance(found, dict) and {"event", "arg", "rule"} <= set(found):
            return {k: str(found.get(k, "")) for k in ("event", "arg", "rule", "origin")}
    return None


def describe_refusal(found: dict[str, Any]) -> str:
    """One line for the user: ``the audit hook refused <event>(<arg>) [rule] at file:line``."""
    return (f"the runtime audit hook refused {found['event']}({found['arg']}) [{found['rule']}] "
            f"at {found.get('origin') or '?'}")
