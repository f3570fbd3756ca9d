"""The AST sandbox: every ``.py`` in a bundle is parsed and checked before anything runs.

Nothing here executes bundle code. Each check yields a :class:`~prism_challenge.gates.Finding`
with a stable rule id (see :mod:`prism_challenge.gates.rules`). The checks:

* imports only from the allowlist (:data:`ALLOWED_ROOTS`, :data:`ALLOWED_MODULES` and the
  bundle's own modules); known network/process/filesystem/FFI/... modules get their specific
  rule (:data:`BLOCKED_MODULES`), reached by import or by attribute (``torch.hub.load``);
* the allow-list (``gates/allowlist.toml``, :mod:`prism_challenge.gates.allowlist`), after
  the deny rules: every path a bundle reaches on an allowed module (import, ``from`` import,
  attribute, ``getattr``/``hasattr`` literal) must be listed (:func:`module_rule`), so must
  every builtin it reaches, and every attribute name used on any other object must be listed
  or defined by the bundle itself
  (:mod:`prism_challenge.gates.allowcheck`, :mod:`prism_challenge.gates.owned`); else
  ``prism:not-allowlisted``, reported only on lines that break no deny rule;
* a file nested too deep for the gate (or that makes any check fail) is ``prism:too-complex``
  (:mod:`prism_challenge.gates.complexity`): the gate never crashes;
* builtins :data:`BLOCKED_BUILTINS` (``open``, ``eval``, ...) whenever the name is not a
  function-local variable (a module- or class-level rebinding does not count: a load before
  the rebinding still reaches the builtin);
* introspection attributes :data:`INTROSPECTION_ATTRS` on any object, also as ``getattr``
  literals and inside ``str.format`` fields; blocked attribute names :data:`BLOCKED_ATTRS`;
* ``getattr``/``setattr``/``delattr`` with a non-literal name, or passed around uncalled;
* ``torch.load``/``torch.save`` (and the ``jit``/``export`` variants) unless called directly on
  a path built from ``ctx.artifacts_dir`` (:func:`artifacts_path`); ``weights_only=False``;
* paths on allowed modules are looked up on the real modules (``torch.os`` is :mod:`os`,
  ``F.np`` is numpy, ``F.torch.load`` is ``torch.load``; :mod:`prism_challenge.gates.live`);
* monkeypatching: attribute or item assignment/deletion on anything that resolves to an
  imported module or object, ``type(x)``, ``ctx`` or the harness (also through aliases,
  containers, parameters and attributes of bundle objects); ``__torch_function__`` and
  ``__array_function__`` overrides, global module hooks, op ``py_impl``; ``torch.Tensor``
  subclasses (their methods would run inside the harness's scoring) and overrides of the
  ``nn.Module`` methods the harness relies on (:data:`HARNESS_FACING_METHODS`);
* private attributes of ``ctx`` and the harness; private torch modules and attributes;
* any attribute whose name starts with an underscore, on any expression (``next(iter([ctx]))
  ._runtime``), also as ``getattr``/``hasattr``/``setattr``/``delattr`` literals, ``from X import
  _name``, ``str.format`` fields and ``match`` class patterns (``prism:private-attr``); the only
  exceptions are the string dunders :data:`SAFE_DUNDER_READS`, ``super().__init__`` and names of
  the bundle's own modules. ``str.format``/``format_map`` only on string literals;
* allow-listed names only in ``typing``, ``dataclasses``, ``functools`` and ``torch.jit``
  (:data:`NAMESPACE_ALLOW`), so string-evaluating helpers are blocked by default; objects
  re-exported by allowed modules are judged where they were defined (:func:`origin_rule`);
* modules, and the classes whose methods the harness calls (``torch.Tensor``, ``nn.Module``,
  ``nn.Parameter``, ``type(x)``), used as values (returned, passed, stored): past a call the gate
  could no longer follow what is reached on them or assigned into them;
* classes the gate cannot see: ``type(name, bases, ns)``, computed bases, ``torch.Tensor``
  subclasses and metaclasses looked up on the real modules, dunder members other than the
  ordinary protocols (:data:`PROTOCOL_DUNDERS`); ``torch.compile`` with a callable backend or
  ``options``; ``DataLoader`` worker processes;
* forging a context: calling ``PrismContext``, ``dataclasses.replace``, defining an
  ``artifacts_dir`` of one's own (attribute, keyword, class member or string).

Name resolution is static (:mod:`prism_challenge.gates.astindex`); what it cannot see (objects
passed through calls to unknown functions, containers mutated by method calls) is left to the
runtime sandbox.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
import tokenize
from functools import lru_cache
from io import BytesIO
from types import ModuleType

from prism_challenge.gates.astindex import (
    CTX,
    TYPE,
    BundleIndex,
    ModuleInfo,
    absolute_module,
    lookup,
)
from prism_challenge.gates.allowcheck import AllowlistChecks
from prism_challenge.gates.artifactpath import template
from prism_challenge.gates.bindings import BindingChecks
from prism_challenge.gates.allowlist import ALLOWLIST_FILE, NOT_ALLOWLISTED, is_allowed_path, load_allowlist
from prism_challenge.gates.complexity import PARSER_LIMITS, busiest_line, describe, guarded, nesting_finding, too_complex
from prism_challenge.gates.reproducible import CLOCK_MODULES, WALL_CLOCK, SetOrderChecks
from prism_challenge.gates.determinism import DETERMINISM, determinism_rule
from prism_challenge.gates.findings import Finding
from prism_challenge.gates.live import live_name, live_object, live_origin

NET = "prism:no-network"
PROC = "prism:no-process"
FS = "prism:no-filesystem"
FFI = "prism:no-ffi"
DYN = "prism:no-dynamic-code"
INTRO = "prism:no-introspection"
INTER = "prism:no-interactive"
PICKLE = "prism:no-pickle"
PATCH = "prism:no-monkeypatch"
SHARDED = "prism:sharded-model"
SHARDED_WHY = ("sharded models are not supported: the harness hashes, audits and scores on held-out text the "
               "full state of rank 0's model; wrap the model in DistributedDataParallel")
TORCH_IO = "prism:torch-io"
TORCH_PRIVATE = "prism:torch-private"
CTX_PRIVATE = "prism:ctx-private"
CTX_FORGE = "prism:ctx-forge"
PRIVATE = "prism:private-attr"
DYN_ATTR = "prism:dynamic-attr"
NOT_ALLOWED = "prism:import-not-allowed"
NOT_LISTED = NOT_ALLOWLISTED
load_allowlist()  # read the data file at import: a runtime audit hook calling module_rule never opens it

ALLOWED_ROOTS = frozenset(
    {"torch", "math", "typing", "dataclasses", "collections", "functools", "itertools", "__future__"}
)
"""Top-level modules a bundle may import (with their submodules, minus :data:`BLOCKED_MODULES`)."""

ALLOWED_MODULES = frozenset({"prism_challenge.evaluator.interface"})
"""Harness modules a bundle may import, exactly."""


def _group(rule: str, names: str) -> dict[str, str]:
    return {n: rule for n in names.split()}


BLOCKED_MODULES: dict[str, str] = {
    **_group(
        NET,
        "socket ssl http urllib urllib2 urllib3 requests httpx aiohttp ftplib smtplib smtpd "
        "poplib imaplib nntplib telnetlib xmlrpc socketserver asyncio asyncore asynchat "
        "selectors select webbrowser email wsgiref cgi cgitb huggingface_hub websocket "
        "websockets grpc paramiko boto3 botocore torch.hub torch.utils.model_zoo "
        "torch.distributed.rpc torch.distributed.rendezvous torch.distributed.debug "
        "torch.distributed.nn.api.remote_module torch.distributed.nn.jit",
    ),
    **_group(
        PROC,
        "os posix nt subprocess _posixsubprocess multiprocessing signal pty tty termios "
        "threading _thread concurrent resource atexit sched faulthandler platform sysconfig pwd "
        "grp torch.multiprocessing torch.distributed.run torch.distributed.launch "
        "torch.distributed.launcher torch.distributed.elastic torch.utils.collect_env "
        "torch.backends.xeon torch.numa",
    ),
    **_group(
        FS,
        "pathlib shutil io _io tempfile glob fileinput zipfile tarfile gzip bz2 lzma zlib "
        "sqlite3 dbm mmap filecmp linecache posixpath ntpath genericpath fcntl stat logging "
        "torch.utils.tensorboard torch.onnx torch.distributed.checkpoint "
        "torch.utils.data.datapipes torch.utils.data.graph torch.utils.data.graph_settings "
        "torch.utils.hipify torch.utils.file_baton torch.utils.model_dump torch.utils.jit "
        "torch.cuda.gds torch.cuda.tunable torch.cuda.profiler torch.distributed.flight_recorder",
    ),
    **_group(
        FFI,
        "ctypes _ctypes cffi numba cython Cython distutils setuptools "
        "torch.utils.cpp_extension torch.cuda.jiterator torch.utils.benchmark torch.classes",
    ),
    **_group(
        DYN,
        "importlib imp runpy code codeop zipimport pkgutil types annotationlib "
        "torch.fx torch.export torch.nativert torch.distributed.pipelining "
        "torch.ao.quantization.fx torch.ao.quantization.quantize_fx torch.ao.quantization.quantize_jit "
        "torch.ao.quantization.pt2e torch.ao.quantization.quantize_pt2e torch.ao.ns "
        "torch.quantization.fx torch.quantization.quantize_fx torch.quantization.quantize_jit "
        "torch.utils.bundled_inputs torch.utils.mobile_optimizer",
    ),
    **_group(INTRO, "sys inspect gc builtins __builtin__ traceback dis symtable tracemalloc"),
    **_group(
        PICKLE,
        "pickle _pickle cPickle pickletools dill cloudpickle marshal shelve joblib copyreg "
        "torch.package torch.serialization torch.utils.show_pickle",
    ),
    **_group(
        PATCH,
        "torch.overrides torch.library unittest.mock torch.utils.backend_registration "
        "torch.utils.module_tracker torch.utils.flop_counter torch.distributed.tensor.debug "
        "torch.monitor",
    ),
    **_group(INTER, "pdb bdb pydoc readline rlcompleter getpass tkinter turtle curses cmd"),
    **_group(WALL_CLOCK, CLOCK_MODULES),
    # sharded models (FSDP, fully_shard, DTensor, device meshes): the harness takes the scored
    # model's full state from rank 0 (digests, held-out, audit) and does not gather shards
    **_group(
        SHARDED,
        "torch.distributed.fsdp torch.distributed.tensor torch.distributed.device_mesh "
        "torch.distributed.DeviceMesh torch.distributed.init_device_mesh torch.distributed.checkpoint.state_dict",
    ),
}
"""Module (or module prefix) -> the rule its import or use breaks."""

BLOCKED_BUILTINS: dict[str, str] = {
    **_group(FS, "open"),
    **_group(DYN, "eval exec compile __import__ __build_class__"),
    # id() and an object's default hash() are memory addresses: they differ between runs, so a
    # model built from them scores differently on the same seed (the score must be reproducible)
    **_group(INTRO, "globals locals vars id hash"),
    **_group(INTER, "breakpoint input help"),
    **_group(PROC, "exit quit"),
}
"""Builtin name -> rule, for loads of the name that reach the builtin."""

BLOCKED_NAMES: dict[str, str] = {
    **_group(INTRO, "__builtins__ __loader__ __spec__ __annotations__"),
    **_group(DYN, "__path__ __package__"),
}
"""Module globals that are blocked whatever they are bound to (``__annotations__`` feeds the
field names ``dataclass`` compiles into code; ``__path__``/``__package__`` redirect the bundle's
own and relative imports to any directory or package)."""

INTROSPECTION_ATTRS = frozenset(
    (
        "__globals__ __code__ __closure__ __builtins__ __subclasses__ __bases__ __base__ "
        "__mro__ __dict__ __class__ __getattribute__ __getattr__ __setattr__ __delattr__ "
        "__self__ __func__ __defaults__ __kwdefaults__ __traceback__ __loader__ __spec__ "
        "__import__ __wrapped__ __objclass__ __subclasshook__ __init_subclass__ __set_name__ "
        "mro gi_frame gi_code gi_yieldfrom gi_running cr_frame cr_code cr_await cr_origin "
        "ag_frame ag_code ag_await f_globals f_locals f_builtins f_back f_code f_trace "
        "f_lasti tb_frame tb_next tb_lasti co_code co_consts co_names co_varnames co_filename "
        "co_cellvars co_freevars func_globals func_code func_closure im_func im_self im_class "
        "_getframe currentframe __array_namespace__ __getstate__ __setstate__ __getnewargs__ "
        "__getnewargs_ex__"
    ).split()
)
"""Attributes that lead from an object to frames, code, globals, builtins or class hierarchies."""

BLOCKED_ATTRS: dict[str, str] = {
    **_group(FFI, "load_library CUDAPluggableAllocator change_current_allocator ctypes jiterator cpp_extension"),
    **_group(
        FS,
        "from_file tofile fromfile dump export_chrome_trace export_stacks export_memory_timeline "
        "tensorboard_trace_handler FileStore",
    ),
    **_group(NET, "TCPStore"),
    **_group(
        PICKLE,
        "all_gather_object broadcast_object_list gather_object scatter_object_list "
        "send_object_list recv_object_list __reduce__ __reduce_ex__ add_safe_globals",
    ),
    **_group(
        DYN,
        "get_type_hints ForwardRef CompilationUnit import_module evaluate_forward_ref "
        "evaluate_bound evaluate_constraints evaluate_default evaluate_value",
    ),
    **_group(FFI, "cudart caching_allocator_alloc caching_allocator_delete"),
    **_group(FS, "ExecutionTraceObserver load_nvprof"),
    **_group(INTER, "breakpoint set_trace"),
    **_group(
        PATCH,
        "__torch_function__ __torch_dispatch__ __array_function__ __array_ufunc__ py_impl "
        "register_torch_dispatch",
    ),
    **_group(PICKLE, "load_cache_artifacts"),
    # refused even where a bundle defines the name (the allow-list's own-name exemption):
    # shared-memory files, raw addresses, storages behind the tensor API, tensor subclasses
    **_group(FS, "share_memory_ share_memory untyped_storage _share_filename_"),
    **_group(INTRO, "data_ptr const_data_ptr"),
    **_group(PATCH, "as_subclass"),
    **_group(
        SHARDED,
        "FullyShardedDataParallel fully_shard FSDPModule DTensor distribute_tensor distribute_module "
        "DeviceMesh init_device_mesh",
    ),
}
"""Attribute names blocked on any object (they reach FFI, files, pickles, eval or patch ops)."""

SAFE_DUNDER_READS = frozenset({"__name__", "__qualname__", "__doc__", "__module__", "__version__"})
"""Dunder attributes a bundle may read (strings) on any object; every other attribute whose name
starts with an underscore is ``prism:private-attr`` (or the ctx/torch variant), except
``super().__init__``."""

NAMESPACE_ALLOW: dict[str, tuple[str, frozenset[str]]] = {
    "typing": (
        DYN,
        frozenset(
            (
                "Any Optional Union List Dict Tuple Set FrozenSet Type Callable Iterable Iterator "
                "Generator Sequence MutableSequence Mapping MutableMapping Collection Container "
                "Sized Hashable Reversible AbstractSet MutableSet KeysView ValuesView ItemsView "
                "DefaultDict OrderedDict Counter Deque ChainMap TYPE_CHECKING cast Literal Final "
                "final ClassVar Protocol runtime_checkable NamedTuple TypedDict TypeVar Generic "
                "ParamSpec Concatenate Annotated NoReturn Never Self TypeAlias TypeGuard AnyStr "
                "Text SupportsInt SupportsFloat SupportsIndex SupportsAbs SupportsRound overload "
                "override NewType Required NotRequired Unpack TypeVarTuple LiteralString "
                "assert_never assert_type reveal_type get_origin no_type_check dataclass_transform"
            ).split()
        ),
    ),
    "dataclasses": (
        DYN,
        frozenset("dataclass field is_dataclass KW_ONLY MISSING FrozenInstanceError".split()),
    ),
    "functools": (
        DYN,
        frozenset(
            (
                "partial partialmethod reduce lru_cache cache cached_property wraps update_wrapper "
                "total_ordering cmp_to_key WRAPPER_ASSIGNMENTS WRAPPER_UPDATES"
            ).split()
        ),
    ),
    "torch.jit": (
        DYN,
        frozenset("is_scripting is_tracing load save ignore unused annotate Final".split()),
    ),
}
"""Allowed modules whose names are allow-listed (everything else in them is blocked by default):
``typing`` (``get_type_hints``, ``ForwardRef``, ``get_args`` reach string evaluation),
``dataclasses`` (``make_dataclass`` builds classes from data, ``asdict``/``astuple`` copy private
fields such as ``ctx._runtime``, ``replace`` forges contexts, ``fields``/``InitVar`` hand out
annotation objects), ``functools``
(``singledispatch`` evaluates string annotations) and ``torch.jit`` (``script`` evaluates
``# type:`` comments and string annotations; ``fork`` runs threads)."""

NAMESPACE_RULES: dict[str, tuple[str, str]] = {
    "dataclasses.asdict": (PRIVATE, "copies every field of a dataclass, private ones (ctx._runtime) included"),
    "dataclasses.astuple": (PRIVATE, "copies every field of a dataclass, private ones (ctx._runtime) included"),
    "dataclasses.replace": (CTX_FORGE, "builds a copy of a context with fields of one's own"),
}
"""Specific reasons for some names outside :data:`NAMESPACE_ALLOW`."""

PROTOCOL_DUNDERS = frozenset(
    (
        "__init__ __post_init__ __repr__ __str__ __len__ __iter__ __next__ __reversed__ "
        "__getitem__ __setitem__ __delitem__ __contains__ __enter__ __exit__ __lt__ __le__ "
        "__gt__ __ge__ __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ "
        "__imul__ __matmul__ __rmatmul__ __imatmul__ __truediv__ __rtruediv__ __itruediv__ "
        "__floordiv__ __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __pow__ __rpow__ __neg__ "
        "__pos__ __abs__ __invert__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ "
        "__lshift__ __rshift__ __int__ __float__ __index__ __round__ __slots__ __constants__"
    ).split()
)
"""Dunder names a bundle class may define: the ordinary protocols. Every other dunder member
(``__eq__``/``__hash__`` that collapse the harness's module sets, ``__mro_entries__``,
``__class_getitem__``, ``__del__``, descriptors, ``__getstate__``, ``__dict__``, ...) is a hook
the interpreter or the harness calls outside the bundle's own code."""

BUILTIN_MATCH_TYPES = frozenset(
    "bool bytearray bytes dict float frozenset int list set str tuple".split()
)
"""Classes whose positional match pattern matches the subject itself (no ``__match_args__``)."""

COMPILE_BACKENDS = frozenset({"inductor", "eager", "aot_eager", "cudagraphs"})
"""``torch.compile`` backends a bundle may name (a callable backend receives the FX graph
module and can rewrite the code it generates)."""

HOOK_PREFIX = "register_module_"
"""``torch.nn.modules.module.register_module_*``: global hooks that would see the harness's calls."""

PATCH_DEFS: dict[str, str] = {
    "__torch_function__": PATCH,
    "__torch_dispatch__": PATCH,
    "__array_function__": PATCH,
    "__array_ufunc__": PATCH,
    "__reduce__": PICKLE,
    "__reduce_ex__": PICKLE,
}
"""Method names a bundle class may not define."""

HARNESS_FACING_METHODS = frozenset(
    (
        "parameters named_parameters buffers named_buffers modules named_modules children "
        "named_children state_dict _named_members _call_impl _wrapped_call_impl __call__ "
        "__getattr__ __getattribute__ __setattr__ __delattr__ __instancecheck__ "
        "__subclasscheck__ __eq__ __ne__ __hash__"
    ).split()
)
"""Methods a bundle class may not override: the harness calls them on the model (counting,
scoring, mode switches) or they intercept every attribute access."""

TENSOR_CLASSES = frozenset({"torch.Tensor", "torch._tensor.Tensor", TYPE})
"""Bases a bundle class may not have: a tensor subclass returned as logits would run its own
methods inside the harness's scoring (``logits[...]``, ``.float()``)."""

TORCH_LOADS = frozenset({"torch.load", "torch.jit.load", "torch.export.load"})
TORCH_SAVES = frozenset({"torch.save", "torch.jit.save", "torch.export.save"})
"""Serialization calls allowed only on a path built from ``ctx.artifacts_dir``."""

BLOCKED_QUALNAMES: dict[str, str] = {"dataclasses.replace": CTX_FORGE}
"""Specific objects whose every reference is blocked."""

BLOCKED_PREFIXES: dict[str, str] = {
    "torch.ops.aten.save": FS,
    "torch.ops.aten.from_file": FS,
    "torch.ops.debugprims": FS,
}
"""Operator paths (``torch.ops`` namespaces are not modules) that read or write files."""

CHECKED_CALLS: dict[str, tuple[str, str]] = {
    "torch.compile": (DYN, "its backend and options are checked at the call"),
    "functools.update_wrapper": (DYN_ATTR, "its attribute names are checked at the call"),
    "functools.wraps": (DYN_ATTR, "its attribute names are checked at the call"),
    "dataclasses.field": (DYN, "only a class-body default may hold a Field"),
}
"""Callables whose arguments are checked where they are called: other references (aliases,
``partial``) would hide those arguments. A bare decorator (``@torch.compile``) is fine."""

HARMLESS_CONSUMERS = frozenset(
    {"str", "repr", "print", "id", "hash", "callable", "format", "ascii", "isinstance", "issubclass"}
)
"""Builtins that may be handed a module or a harness class: they give back no object of it."""

WRAPPER_CALLS = frozenset({"functools.update_wrapper", "functools.wraps"})
DATALOADERS = frozenset({"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"})

PRISM_CONTEXT = "prism_challenge.evaluator.interface.PrismContext"
_BUILTIN_NAMES = frozenset(vars(builtins))
_FORMAT_FIELD = re.compile(r"\{([^{}]*)\}")
_FIELD_ATTR = re.compile(r"[.\[]\s*([A-Za-z_]\w*)")
_FIELD_DOT = re.compile(r"\.\s*([A-Za-z_]\w*)")
_ARTIFACTS_WORD = re.compile(r"\bartifacts_dir\b")


# ---------------------------------------------------------------------------------------------
# parsing


def parse_source(rel: str, data: bytes) -> tuple[str | None, ast.Module | None, list[Finding]]:
    """Decode and parse one bundle file.

    The encoding Python itself would use is detected (BOM, ``coding:`` cookie); anything but
    UTF-8 is refused, so the text checked is the text that runs.

    Returns:
        (source text, module tree, findings): text/tree are ``None`` with a ``prism:encoding``
        or ``prism:syntax`` finding (line and 1-based column of the error) when unreadable,
        and the tree is ``None`` with a ``prism:too-complex`` finding when the file nests too
        deep for the parser or the gate (:mod:`prism_challenge.gates.complexity`).
    """
    try:
        encoding, _ = tokenize.detect_encoding(BytesIO(data).readline)
    except SyntaxError as exc:
        return None, None, [Finding("prism:encoding", rel, 1, 0, f"bad encoding declaration: {exc.msg}")]
    if encoding not in ("utf-8", "utf-8-sig"):
        return None, None, [
            Finding("prism:encoding", rel, 1, 0, f"source declares encoding {encoding!r}; only UTF-8")
        ]
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return None, None, [Finding("prism:encoding", rel, line, 0, f"not valid UTF-8: {exc.reason}")]
    try:
        tree = ast.parse(text, filename=rel)
    except SyntaxError as exc:
        if any(limit in (exc.msg or "") for limit in PARSER_LIMITS):
            return text, None, [too_complex(rel, exc.lineno or 0, exc.msg)]
        return text, None, [
            Finding("prism:syntax", rel, exc.lineno or 0, exc.offset or 0, f"syntax error: {exc.msg}")
        ]
    except ValueError as exc:  # e.g. null bytes on older interpreters
        return text, None, [Finding("prism:syntax", rel, 0, 0, f"syntax error: {exc}")]
    except (RecursionError, MemoryError) as exc:  # the parser ran out of stack or memory
        return text, None, [too_complex(rel, busiest_line(text), describe(exc))]
    deep = nesting_finding(rel, tree)
    if deep is not None:
        return text, None, [deep]
    return text, tree, []


def defines_symbol(tree: ast.Module, symbol: str) -> bool:
    """Whether a module binds ``symbol`` at top level (def, class, assignment or import),
    looking inside top-level ``if``/``try``/``with`` blocks."""

    def scan(body: list[ast.stmt]) -> bool:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if stmt.name == symbol:
                    return True
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    if any(isinstance(n, ast.Name) and n.id == symbol for n in ast.walk(t)):
                        return True
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    if bound == symbol:
                        return True
            elif isinstance(stmt, (ast.If, ast.With, ast.Try)):
                blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])]
                blocks += [h.body for h in getattr(stmt, "handlers", [])]
                if any(scan(b) for b in blocks):
                    return True
        return False

    return scan(tree.body)


# ---------------------------------------------------------------------------------------------
# module-level rules


def module_rule(modname: str, own: set[str]) -> tuple[str, str] | None:
    """The (rule, reason) an import of ``modname`` breaks, or ``None`` when it is allowed.

    Also judges attribute paths (``torch.nn.functional.gelu``): the deny rules first
    (:data:`BLOCKED_MODULES`, :data:`NAMESPACE_ALLOW`, private names), then, on the allowed
    modules, the allow-list (:func:`prism_challenge.gates.allowlist.is_allowed_path`,
    ``prism:not-allowlisted``)."""
    parts = modname.split(".")
    if parts[0] in own:
        return None
    for i in range(len(parts), 0, -1):
        rule = BLOCKED_MODULES.get(".".join(parts[:i]))
        if rule:
            return rule, f"module '{modname}' is blocked"
    hit = determinism_rule(modname) or namespace_rule(modname)
    if hit:
        return hit
    if any(p.startswith("_") and p not in SAFE_DUNDER_READS for p in parts[1:]):
        if parts[0] == "torch" and any(_private(p) for p in parts[1:]):
            return TORCH_PRIVATE, f"private torch module '{modname}'"
        return PRIVATE, f"private module or name '{modname}'"
    if parts[0] in ALLOWED_ROOTS or modname in ALLOWED_MODULES or _harness_path(modname):
        if is_allowed_path(modname):
            return None
        return NOT_LISTED, f"'{modname}' is not on the allow-list ({ALLOWLIST_FILE})"
    return NOT_ALLOWED, f"module '{modname}' is not on the import allowlist"


def _harness_path(qualname: str) -> bool:
    """Whether ``qualname`` is a path inside one of :data:`ALLOWED_MODULES`."""
    return any(qualname.startswith(m + ".") for m in ALLOWED_MODULES)


def namespace_rule(qualname: str) -> tuple[str, str] | None:
    """The (rule, reason) of a name outside the allow-list of its module
    (:data:`NAMESPACE_ALLOW`), or ``None``."""
    if qualname in NAMESPACE_RULES:
        return NAMESPACE_RULES[qualname]
    for prefix, (rule, allowed) in NAMESPACE_ALLOW.items():
        if qualname.startswith(prefix + "."):
            name = qualname[len(prefix) + 1 :].split(".")[0]
            if name not in allowed and not name.startswith("_"):
                return rule, f"'{prefix}.{name}' is not on the {prefix} allow-list"
    return None


def origin_rule(qualname: str) -> tuple[str, str] | None:
    """The (rule, reason) when the function or class ``qualname`` names on the trusted modules
    was defined in a blocked module or is a blocked name of an allow-listed one (a re-export:
    ``torch.utils.data.IterDataPipe`` is defined in ``torch.utils.data.datapipes``)."""
    if qualname in TORCH_LOADS or qualname in TORCH_SAVES or qualname.startswith("<"):
        return None
    origin = live_origin(qualname)
    if origin is None or _root(origin) == "builtins":  # builtins have rules of their own
        return None
    hit = namespace_rule(origin)
    if hit:
        return hit[0], f"'{qualname}' is {origin}: {hit[1]}"
    parts = origin.split(".")
    for i in range(len(parts) - 1, 0, -1):
        rule = BLOCKED_MODULES.get(".".join(parts[:i]))
        if rule:
            return rule, f"'{qualname}' is defined in the blocked module '{'.'.join(parts[:i])}'"
    return None


class Checker(AllowlistChecks, BindingChecks, SetOrderChecks):
    """Runs every sandbox rule over one module of an indexed bundle.

    Args:
        index: the whole bundle (for cross-module resolution).
        info: the module to check.
    """

    def __init__(self, index: BundleIndex, info: ModuleInfo) -> None:
        self.index = index
        self.info = info
        self.own = index.top_level_names
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._seen_messages: set[tuple[str, int, str]] = set()
        self._docstrings = _docstring_ids(info.tree)
        self.current: ast.AST = info.tree

    # -- helpers ---------------------------------------------------------------------------
    def add(self, rule: str, node: ast.AST, message: str) -> None:
        """Record a finding at ``node`` (one per rule and position)."""
        line, col = self.info.position(node)
        key = (rule, line, col)
        if key in self._seen:
            return
        self._seen.add(key)
        if rule == SHARDED:
            message += f" ({SHARDED_WHY})"
        self.findings.append(Finding(rule, self.info.rel, line, col, message))

    def q(self, node: ast.AST, containers: bool = True) -> frozenset[str]:
        """Canonical qualified names of an expression (see :class:`BundleIndex`)."""
        scope = self.info.scope_for(node)
        return self.index.canonical(self.index.resolve(node, scope, containers))

    def parent(self, node: ast.AST) -> ast.AST | None:
        """The parent node, or ``None`` for the module."""
        return self.info.parents.get(id(node))

    def is_builtin(self, name: str, node: ast.AST) -> bool:
        """Whether a load of ``name`` at ``node`` may reach the builtin (not a function local)."""
        where = lookup(name, self.info.scope_for(node))
        return where is None or where.kind in ("module", "class")

    # -- driver ----------------------------------------------------------------------------
    def run(self) -> list[Finding]:
        """Check the module; return its findings."""
        for node in self.info.walk():
            self.current = node
            handler = getattr(self, "_on_" + type(node).__name__, None)
            if handler is not None:
                handler(node)
            self.order_check(node)
        self.drop_redundant()
        return self.findings

    def is_library(self, q: str) -> bool:
        """Whether ``q`` is a path on an allowed (trusted) module rather than a bundle object."""
        if q.startswith("<") or _root(q) in self.own or _root(q) == "builtins":
            return False
        return _root(q) in ALLOWED_ROOTS or q in ALLOWED_MODULES or _harness_path(q)

    # -- imports ---------------------------------------------------------------------------
    def _on_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            hit = module_rule(alias.name, self.own)
            if hit:
                self.add(hit[0], node, f"import {alias.name}: {hit[1]}")
            elif alias.name.startswith("prism_challenge") and not alias.asname:
                self.add(NOT_ALLOWED, node, f"import {alias.name}: use 'from {alias.name} import ...'")
            self._class_member(node, alias.asname or alias.name.split(".")[0])

    def _on_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = absolute_module(node, self.info)
        relative = node.level > 0
        for alias in node.names:
            if alias.name == "*":
                self.add(NOT_ALLOWED, node, f"from {base or '.'} import *: star imports hide names from the gate")
                continue
            self._class_member(node, alias.asname or alias.name)
            full = f"{base}.{alias.name}" if base else alias.name
            if not relative:
                hit = module_rule(base, self.own)
                if hit and module_rule(full, self.own) is None and full in ALLOWED_MODULES:
                    hit = None
                if hit is None:
                    hit = self._from_name_rule(full, alias.name)
                if hit:
                    self.add(hit[0], node, f"from {base} import {alias.name}: {hit[1]}")
                    continue
            own = relative or _root(base) in self.own
            self._attr_name_rules(node, alias.name, frozenset({base}), own=own)

    def _from_name_rule(self, full: str, name: str) -> tuple[str, str] | None:
        parts = full.split(".")
        if parts[0] in self.own:
            return None
        for i in range(len(parts), 1, -1):
            rule = BLOCKED_MODULES.get(".".join(parts[:i]))
            if rule:
                return rule, f"'{full}' is blocked"
        rule = BLOCKED_QUALNAMES.get(full)
        if rule:
            return rule, f"'{full}' is blocked"
        hit = namespace_rule(full) or origin_rule(full)
        if hit:
            return hit
        live = live_name(full)
        if live is not None and live.startswith("builtins."):
            rule = BLOCKED_BUILTINS.get(live[len("builtins.") :])
            if rule:
                return rule, f"'{full}' is {live}"
        elif live is not None:
            hit = module_rule(live, self.own)
            if hit:
                return hit[0], f"'{full}' is {live}"
        return module_rule(full, self.own)  # the allow-list judges the name as spelled

    # -- names -----------------------------------------------------------------------------
    def _on_Name(self, node: ast.Name) -> None:
        if node.id in BLOCKED_NAMES:
            self.add(BLOCKED_NAMES[node.id], node, f"'{node.id}' reaches the interpreter's internals")
            return
        if isinstance(node.ctx, ast.Store):
            scope = self.info.scope_for(node)
            if scope.kind == "class":
                self._class_member(node, node.id)
            elif node.id == "__name__":
                self.add(PATCH, node, "rebinds the module's '__name__'")
            return
        if not isinstance(node.ctx, ast.Load):
            return
        if node.id in BLOCKED_BUILTINS and self.is_builtin(node.id, node):
            self.add(BLOCKED_BUILTINS[node.id], node, f"builtin '{node.id}' is blocked")
            return
        if node.id in _BUILTIN_NAMES and self.is_builtin(node.id, node) and not is_allowed_path(f"builtins.{node.id}"):
            self.add(NOT_LISTED, node, f"builtin '{node.id}' is not on the allow-list ({ALLOWLIST_FILE})")
        if node.id in ("getattr", "setattr", "delattr", "hasattr") and self.is_builtin(node.id, node):
            if not self._is_call_func(node) and node.id != "hasattr":
                self.add(DYN_ATTR, node, f"'{node.id}' passed around uncalled hides attribute names")
            return
        if node.id == "type" and self.is_builtin(node.id, node):
            if not (self._is_call_func(node) or self._type_test_use(node)):
                self.add(PATCH, node, "builtin 'type' passed around uncalled (type(name, bases, ns) builds classes)")
            return
        qs = self.q(node)
        self._module_value(node, qs)
        self._class_value(node, qs)
        self._reference(node, qs)

    def _class_member(self, node: ast.AST, name: str) -> None:
        in_class = self.info.scope_for(node).kind == "class"
        if not (in_class or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            return
        if name in PATCH_DEFS:
            self.add(PATCH_DEFS[name], node, f"a bundle class may not define '{name}'")
        if name == "artifacts_dir":
            self.add(CTX_FORGE, node, "defines an 'artifacts_dir' of its own")
        if not in_class or name in PATCH_DEFS:
            return
        if name in HARNESS_FACING_METHODS:
            self.add(PATCH, node, f"a bundle class may not override '{name}' (the harness relies on it)")
        elif _dunder(name) and name not in PROTOCOL_DUNDERS:
            self.add(PATCH, node, f"a bundle class may not define '{name}' (not a standard protocol method)")

    def _on_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._class_member(node, node.name)
        self.module_level_def(node)

    def _on_ClassDef(self, node: ast.ClassDef) -> None:
        self.module_level_def(node)
        for base in node.bases:
            if isinstance(base, ast.Starred):
                self.add(DYN_ATTR, node, "class bases from a starred expression hide the base classes")
                continue
            qs = self.q(base)
            if qs & TENSOR_CLASSES:
                self.add(PATCH, node, "a torch.Tensor subclass would run its own methods inside the harness")
                continue
            if not self._static_base(base, 0):
                self.add(DYN_ATTR, node, "a class base the gate cannot name (computed or passed in)")
                continue
            for q in sorted(qs):
                what = _live_class_kind(q)
                if what == "tensor":
                    self.add(PATCH, node, f"'{q}' is a torch.Tensor subclass: its methods would run inside the harness")
                elif what == "meta":
                    self.add(PATCH, node, f"'{q}' is a metaclass: a subclass can intercept class and instance checks")
        for kw in node.keywords:
            if kw.arg == "metaclass":
                self.add(PATCH, node, "a custom metaclass can intercept class and instance checks")

    _on_AsyncFunctionDef = _on_FunctionDef

    def _static_base(self, expr: ast.AST, depth: int) -> bool:
        """Whether a class base is a name the gate can follow: a bundle class, an imported name,
        a builtin, an attribute path on one of those, a subscript of one (``Generic[T]``) or a
        ``collections.namedtuple(...)`` call."""
        if depth > 8:
            return False
        if isinstance(expr, ast.Name):
            where = lookup(expr.id, self.info.scope_for(expr))
            if where is None:
                return True
            bindings = where.bindings.get(expr.id, [])
            if not bindings:
                return False
            for b in bindings:
                if b[0] == "def" and isinstance(b[1], ast.ClassDef) or b[0] == "import":
                    continue
                if b[0] == "expr" and self._static_base(b[1], depth + 1):
                    continue
                return False
            return True
        if isinstance(expr, ast.Attribute):
            return self._static_base(expr.value, depth + 1)
        if isinstance(expr, ast.Subscript):
            return self._static_base(expr.value, depth + 1)
        if isinstance(expr, ast.Call):
            return "collections.namedtuple" in self.q(expr.func)
        return False

    def _on_MatchClass(self, node: ast.MatchClass) -> None:
        for attr in node.kwd_attrs:
            if attr.startswith("_"):
                self.add(PRIVATE, node, f"class pattern reads the private attribute '{attr}'")
            self.listed_attr(node, attr, frozenset())
        if node.patterns:
            qs = self.q(node.cls)
            if not qs or not all(q[len("builtins.") :] in BUILTIN_MATCH_TYPES for q in qs if q.startswith("builtins.")) or any(
                not q.startswith("builtins.") for q in qs
            ):
                self.add(PRIVATE, node, "positional class pattern reads the attributes named by __match_args__")

    def _on_keyword(self, node: ast.keyword) -> None:
        if node.arg == "artifacts_dir":
            self.add(CTX_FORGE, self.parent(node) or node, "passes an 'artifacts_dir' of its own")

    def _on_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str) or id(node) in self._docstrings:
            return
        text = node.value
        for fld in _FORMAT_FIELD.findall(text):
            for attr in _FIELD_ATTR.findall(fld):
                if attr in INTROSPECTION_ATTRS:
                    self.add(INTRO, node, f"format field reaches '{attr}'")
            for attr in _FIELD_DOT.findall(fld):
                if attr.startswith("_") and attr not in SAFE_DUNDER_READS and attr not in INTROSPECTION_ATTRS:
                    self.add(PRIVATE, node, f"format field reads the private attribute '{attr}'")
        if _ARTIFACTS_WORD.search(text) and not self._is_attr_literal(node):
            self.add(CTX_FORGE, node, "string names 'artifacts_dir' (building a context of one's own)")

    def _is_attr_literal(self, node: ast.Constant) -> bool:
        p = self.parent(node)
        return (
            isinstance(p, ast.Call)
            and isinstance(p.func, ast.Name)
            and p.func.id in ("getattr", "hasattr")
            and len(p.args) >= 2
            and p.args[1] is node
        )

    # -- attributes ------------------------------------------------------------------------
    def _on_Attribute(self, node: ast.Attribute) -> None:
        base_q = self.q(node.value)
        store = isinstance(node.ctx, (ast.Store, ast.Del))
        self._attr_name_rules(node, node.attr, base_q, node.value, store=store)
        if store:
            self._store(node, node.attr, base_q, isinstance(node.ctx, ast.Del))
            return
        if node.attr in ("format", "format_map") and not self._literal_str(node.value):
            self.add(DYN_ATTR, node, f"str.{node.attr} on a string that is not a literal can read any attribute")
        elif node.attr in ("format", "format_map"):
            self.format_fields(node)
        if node.attr == "compile" and self._call_of(node) is None and not self._is_decorator(node):
            self.add(DYN, node, "'.compile' referenced without calling it directly (its backend and options are checked at the call)")
        full = self.q(node)
        self._blocked_prefix(node, base_q, full)
        self._module_value(node, full)
        self._class_value(node, full)
        self._reference(node, full)
        self.listed_attr(node, node.attr, base_q)

    def _attr_name_rules(
        self,
        node: ast.AST,
        attr: str,
        base_q: frozenset[str],
        base: ast.AST | None = None,
        *,
        store: bool = False,
        own: bool = False,
    ) -> None:
        flagged = True
        if attr in INTROSPECTION_ATTRS:
            self.add(INTRO, node, f"attribute '{attr}' reaches the interpreter's internals")
        elif attr in BLOCKED_ATTRS:
            self.add(BLOCKED_ATTRS[attr], node, f"attribute '{attr}' is blocked")
        elif attr.startswith(HOOK_PREFIX):
            self.add(PATCH, node, f"'{attr}' installs a global hook over every module")
        else:
            flagged = False
        if not attr.startswith("_"):
            return
        if any(_root(b) in (CTX, "prism_challenge") for b in base_q):
            self.add(CTX_PRIVATE, node, f"private attribute '{attr}' of the context or harness")
            return
        if own or (base is not None and self._own_module(base, 0)):
            return
        if not store and attr in SAFE_DUNDER_READS:
            return
        if not store and attr == "__init__" and base is not None and self._is_super(base):
            return
        if _private(attr) and any(_root(b) == "torch" for b in base_q):
            self.add(TORCH_PRIVATE, node, f"private torch attribute '{attr}'")
        elif not flagged:
            self.add(PRIVATE, node, f"attribute '{attr}' starts with an underscore (private or interpreter hook; rename bundle attributes)")

    def _own_module(self, expr: ast.AST, depth: int) -> bool:
        """Whether ``expr`` is certainly one of the bundle's own modules (``helpers``,
        ``layers.blocks``): names bound only by imports of bundle modules."""
        if depth > 8:
            return False
        if isinstance(expr, ast.Attribute):
            return self._own_module(expr.value, depth + 1) and all(
                q in self.index.modules for q in self.q(expr)
            )
        if not isinstance(expr, ast.Name):
            return False
        where = lookup(expr.id, self.info.scope_for(expr))
        if where is None:
            return False
        bindings = where.bindings.get(expr.id, [])
        return bool(bindings) and all(
            b[0] == "import" and (b[1] in self.index.modules or b[1] in self.own) for b in bindings
        )

    def _is_super(self, expr: ast.AST) -> bool:
        """``super()`` or ``super(C, x)`` with ``C`` a bundle class: its ``__init__`` is the next
        class's in the MRO of a bundle class (never the harness's)."""
        if not (
            isinstance(expr, ast.Call)
            and isinstance(expr.func, ast.Name)
            and expr.func.id == "super"
            and self.is_builtin("super", expr.func)
            and not expr.keywords
        ):
            return False
        if not expr.args:
            return True
        if len(expr.args) != 2 or not isinstance(expr.args[0], ast.Name):
            return False
        where = lookup(expr.args[0].id, self.info.scope_for(expr))
        bindings = where.bindings.get(expr.args[0].id, []) if where is not None else []
        return bool(bindings) and all(b[0] == "def" and isinstance(b[1], ast.ClassDef) for b in bindings)

    def _literal_str(self, expr: ast.AST) -> bool:
        """Whether ``expr`` is a string literal, or a name bound only to string literals."""
        if isinstance(expr, ast.Constant):
            return isinstance(expr.value, str)
        if not isinstance(expr, ast.Name):
            return False
        where = lookup(expr.id, self.info.scope_for(expr))
        bindings = where.bindings.get(expr.id, []) if where is not None else []
        for b in bindings:
            if not (b[0] == "expr" and isinstance(b[1], ast.Constant) and isinstance(b[1].value, str)):
                return False
            parents = self.index.info_of(b[2]).parents
            if not isinstance(parents.get(id(b[1])), (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                return False  # fmt += "..." joins literals into a format string of its own
        return bool(bindings)

    def _module_value(self, node: ast.AST, qs: frozenset[str]) -> None:
        """A module used as a value (passed, returned, stored, put in a container, annotated):
        past a call the gate can no longer follow what is reached on it, so only ``mod.attr``,
        ``getattr(mod, "lit")`` and plain aliases (``G = F``) may use a module."""
        mods = sorted(q for q in qs if self._is_module(q))
        if mods and not self._followed(node):
            self.add(DYN_ATTR, node, f"module '{mods[0]}' used as a value hides what is reached on it")

    def _class_value(self, node: ast.AST, qs: frozenset[str]) -> None:
        """``torch.Tensor``, ``nn.Module``, ``nn.Parameter`` and ``type(x)`` (the classes whose
        methods the harness calls) used as a value: past a call the gate could no longer see an
        assignment into them (``next(iter([torch.Tensor])).gather = f``). Allowed: attribute
        access, calls, type tests, annotations, class bases and plain aliases."""
        hit = sorted(q for q in qs if q == TYPE or _harness_class(q))
        if not hit or self._followed(node):
            return
        p = self.parent(node)
        if self._type_use(node) or (isinstance(p, ast.ClassDef) and node in p.bases):
            return
        if isinstance(p, ast.BinOp) and isinstance(p.op, ast.BitOr):
            return  # X | None (a types.UnionType: read-only, its __args__ out of reach)
        if isinstance(p, ast.Tuple):
            p = self.parent(p)
        if isinstance(p, ast.Subscript) and p.value is not node:
            gq = self.q(p.value)
            if gq and all(
                (_root(q) == "typing" and q != "typing.Annotated") or q.startswith("builtins.") for q in gq
            ):
                # Optional[torch.Tensor]: a typing alias forwards attribute stores to its origin
                # (Union, list), never to its arguments; Annotated's origin is its argument
                return
        what = "type(...)" if hit[0] == TYPE else f"'{hit[0]}'"
        self.add(PATCH, node, f"{what} used as a value: an assignment into it could no longer be seen")

    def _followed(self, node: ast.AST) -> bool:
        """Whether the gate keeps following the value of ``node``: ``node.attr``, ``node(...)``,
        ``getattr(node, "lit")``, ``G = node``, a comparison."""
        p = self.parent(node)
        if isinstance(p, ast.Attribute) and p.value is node:
            return True
        if isinstance(p, ast.Call) and p.func is node:
            return True
        if (
            isinstance(p, ast.Call)
            and isinstance(p.func, ast.Name)
            and p.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and self.is_builtin(p.func.id, p.func)
            and len(p.args) >= 2
            and p.args[0] is node
            and isinstance(p.args[1], ast.Constant)
            and isinstance(p.args[1].value, str)
        ):
            return True
        if isinstance(p, (ast.Assign, ast.AnnAssign)) and p.value is node:
            targets = p.targets if isinstance(p, ast.Assign) else [p.target]
            return all(isinstance(t, ast.Name) for t in targets)
        if isinstance(p, ast.Call) and node in p.args and isinstance(p.func, ast.Name):
            if p.func.id in HARMLESS_CONSUMERS and self.is_builtin(p.func.id, p.func):
                return True  # str(x), print(x): nothing comes back but text
        return isinstance(p, (ast.Compare, ast.FormattedValue))

    def _is_module(self, q: str) -> bool:
        if q.startswith("<"):
            return False
        if _root(q) in self.own:
            return q in self.index.modules or q in self.own
        return _is_live_module(q)

    def _store(self, node: ast.AST, attr: str, base_q: frozenset[str], delete: bool) -> None:
        if attr == "artifacts_dir":
            self.add(CTX_FORGE, node, "sets an 'artifacts_dir' of its own")
        if base_q:
            what = _describe(base_q)
            verb = "deletes" if delete else "assigns"
            self.add(PATCH, node, f"{verb} attribute '{attr}' of {what}")

    def _on_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            base_q = self.q(node.value, containers=False)
            if base_q:
                self.add(PATCH, node, f"assigns an item of {_describe(base_q)}")

    def _blocked_prefix(self, node: ast.AST, base_q: frozenset[str], full: frozenset[str]) -> None:
        def rule_of(q: str) -> str | None:
            if _root(q) in self.own or q.startswith("<") or _root(q) == "builtins":
                return None
            hit = module_rule(q, self.own)
            return hit[0] if hit else None

        if any(rule_of(b) for b in base_q):
            return  # already reported where the path first left the allowlist
        hits = [(q, rule_of(q)) for q in sorted(full)]
        hits = [h for h in hits if h[1]]
        if hits:  # what the path really is (its live name) before its spelling (a private name)
            q, rule = min(hits, key=lambda h: (h[1] in (PRIVATE, TORCH_PRIVATE), h[1] == NOT_LISTED))
            if rule == NOT_LISTED:
                attr = q.rsplit(".", 1)[-1]
                line, col = self.name_position(node, attr)
                self.add_at(rule, line, col, f"'{q}' is not on the allow-list ({ALLOWLIST_FILE})")
            elif rule == DETERMINISM:  # its reason names what the path switches
                self.add(rule, node, module_rule(q, self.own)[1])
            else:
                self.add(rule, node, f"'{q}' is blocked")

    def _reference(self, node: ast.AST, qs: frozenset[str]) -> None:
        """Rules about what an expression *is*: torch.load/save, blocked objects, ctx forging."""
        call = self._call_of(node)
        for q in sorted(qs):
            if q.startswith("builtins.") and not isinstance(node, ast.Name):
                name = q[len("builtins.") :]
                if name in BLOCKED_BUILTINS:
                    self.add(BLOCKED_BUILTINS[name], node, f"'{q}' is blocked")
                elif name in ("getattr", "setattr", "delattr"):
                    self.add(DYN_ATTR, node, f"'{q}' reached through a module")
            if q in TORCH_LOADS or q in TORCH_SAVES:
                if call is None:
                    self.add(TORCH_IO, node, f"'{q}' referenced without calling it directly")
                else:
                    self._torch_io_call(call, q)
            if q in CHECKED_CALLS and call is None and not self._is_decorator(node):
                rule, what = CHECKED_CALLS[q]
                self.add(rule, node, f"'{q}' referenced without calling it directly ({what})")
            rule = BLOCKED_QUALNAMES.get(q)
            if rule:
                self.add(rule, node, f"'{q}' is blocked")
            for prefix, rule in BLOCKED_PREFIXES.items():
                if q == prefix or q.startswith(prefix + "."):
                    self.add(rule, node, f"'{q}' is blocked")
            if not q.startswith("<") and _root(q) not in self.own:
                hit = namespace_rule(q) or origin_rule(q)
                if hit:
                    self.add(hit[0], node, hit[1])
            if q == PRISM_CONTEXT and not self._type_use(node):
                self.add(CTX_FORGE, node, "PrismContext used other than as a type (forging a context)")
            if call is not None and q.startswith(CTX + ".__class__"):
                self.add(CTX_FORGE, node, "calls the context's type (forging a context)")

    def _is_decorator(self, node: ast.AST) -> bool:
        p = self.parent(node)
        return isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in p.decorator_list

    def _type_use(self, node: ast.AST) -> bool:
        if id(node) in self.info.annotation_nodes:
            return True
        p = self.parent(node)
        if isinstance(p, ast.Tuple):
            p = self.parent(p)
        return (
            isinstance(p, ast.Call)
            and isinstance(p.func, ast.Name)
            and p.func.id in ("isinstance", "issubclass")
            and len(p.args) == 2
            and node is not p.args[0]
        )

    def _type_test_use(self, node: ast.AST) -> bool:
        return self._type_use(node) or isinstance(self.parent(node), ast.Compare)

    def _is_call_func(self, node: ast.AST) -> bool:
        p = self.parent(node)
        return isinstance(p, ast.Call) and p.func is node

    def _call_of(self, node: ast.AST) -> ast.Call | None:
        p = self.parent(node)
        return p if isinstance(p, ast.Call) and p.func is node else None

    # -- calls -----------------------------------------------------------------------------
    def _on_Call(self, node: ast.Call) -> None:
        func = node.func
        fq = self.q(func)
        if isinstance(func, ast.Call) and any(q.startswith(CTX + ".__class__") for q in self.q(func)):
            self.add(CTX_FORGE, node, "calls the context's type (forging a context)")
        if isinstance(func, ast.Name) and func.id in ("getattr", "setattr", "delattr", "hasattr"):
            if self.is_builtin(func.id, func):
                self._dynamic_attr(node, func.id)
        starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        if isinstance(func, ast.Name) and func.id == "type" and len(node.args) == 1 and self.is_builtin("type", func):
            self._class_value(node, frozenset({TYPE}))
        if "dataclasses.field" in fq:
            p = self.parent(node)
            if not (
                isinstance(p, ast.AnnAssign) and p.value is node and self.info.scope_for(p).kind == "class"
            ):
                self.add(DYN, node, "dataclasses.field() other than as a class-body default keeps its .type in reach")
        if any(_live_class_kind(q) == "meta" for q in fq) or TYPE in fq:
            if len(node.args) == 3 or starred:
                self.add(PATCH, node, "type(name, bases, namespace) builds a class the gate cannot see")
        if "torch.compile" in fq or (isinstance(func, ast.Attribute) and func.attr == "compile"):
            self._compile_call(node, starred)
        if fq & WRAPPER_CALLS:
            limit = 2 if "functools.update_wrapper" in fq else 1
            if len(node.args) > limit or node.keywords or starred:
                self.add(DYN_ATTR, node, "update_wrapper/wraps with attribute names of one's own (assigned/updated)")
        if fq & DATALOADERS:
            workers = _arg(node, 5, "num_workers")
            if starred or (workers is not None and not (isinstance(workers, ast.Constant) and workers.value == 0)) or any(
                k.arg in ("multiprocessing_context", "worker_init_fn") for k in node.keywords
            ):
                self.add(PROC, node, "DataLoader worker processes (num_workers > 0)")

    def _compile_call(self, node: ast.Call, starred: bool) -> None:
        if starred:
            self.add(DYN, node, "torch.compile with *args/**kwargs may pass a backend or options of its own")
        for kw in node.keywords:
            if kw.arg == "options":
                self.add(DYN, node, "torch.compile options override compiler paths and debug outputs")
            elif kw.arg == "backend" and not (
                isinstance(kw.value, ast.Constant) and kw.value.value in COMPILE_BACKENDS
            ):
                self.add(DYN, node, "torch.compile backend other than " + "/".join(sorted(COMPILE_BACKENDS)))

    def _dynamic_attr(self, node: ast.Call, which: str) -> None:
        if len(node.args) < 2 or not (
            isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
        ):
            if which != "hasattr":
                self.add(DYN_ATTR, node, f"{which}() with a name that is not a string literal")
            return
        attr = node.args[1].value
        base_q = self.q(node.args[0])
        self._attr_name_rules(node, attr, base_q, node.args[0], store=which in ("setattr", "delattr"))
        if which in ("getattr", "hasattr"):
            self.listed_attr(node, attr, base_q)
            if which == "hasattr":
                self._blocked_prefix(node, base_q, frozenset(f"{q}.{attr}" for q in base_q))
        if which == "getattr":
            full = self.q(node)
            self._blocked_prefix(node, base_q, full)
            self._module_value(node, full)
            self._class_value(node, full)
            self._reference(node, full)
        elif which != "hasattr":
            self._store(node, attr, base_q, which == "delattr")

    def _torch_io_call(self, call: ast.Call, q: str) -> None:
        is_save = q in TORCH_SAVES
        path = _arg(call, 1 if is_save else 0, "f")
        if path is None or not artifacts_path(path, self):
            verb = "writes" if is_save else "reads"
            self.add(TORCH_IO, call, f"{q} {verb} a path the gate cannot prove is inside ctx.artifacts_dir "
                                     f"(allowed: ctx.artifacts_dir, optionally + string literals starting with "
                                     f"'/' and holding no '..', and integers: {{step:06d}}, str(int(step)))")
        if not is_save:
            for kw in call.keywords:
                if kw.arg == "weights_only" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is True
                ):
                    self.add(PICKLE, call, f"{q} with weights_only other than True unpickles code")
                if kw.arg == "pickle_module" or kw.arg is None:
                    self.add(PICKLE, call, f"{q} with a custom pickle module or **kwargs")


def artifacts_path(node: ast.AST, checker: Checker, depth: int = 0) -> bool:
    """Whether a path expression is built from ``ctx.artifacts_dir``.

    Accepted: ``ctx.artifacts_dir`` itself (``ctx`` resolving to the context and nothing else),
    optionally followed (``+`` or an f-string) by string literals and integers
    (:mod:`prism_challenge.gates.artifactpath`: ``{step:06d}``, ``str(int(x))``, a loop index
    over ``range``) that together, each integer read as ``0``, start with ``/`` and hold no
    ``..``; or a function-local name every binding of which is accepted.
    """
    if depth > 8:
        return False
    if isinstance(node, ast.Attribute) and node.attr == "artifacts_dir":
        return is_context(node.value, checker)
    if isinstance(node, ast.Name):
        where = lookup(node.id, checker.info.scope_for(node))
        if where is None or where.kind not in ("function", "comprehension"):
            return False
        bindings = where.bindings.get(node.id, [])
        return bool(bindings) and all(
            b[0] == "expr" and artifacts_path(b[1], checker, depth + 1) for b in bindings
        )
    parts: list[ast.AST]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        parts = _flatten_add(node)
    elif isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if not (
            isinstance(head, ast.FormattedValue)
            and head.conversion == -1
            and head.format_spec is None
        ):
            return False
        parts = [head.value, *node.values[1:]]
    else:
        return False
    if not artifacts_path(parts[0], checker, depth + 1):
        return False
    suffix = template(parts[1:], checker)  # integers as "0": they hold no '/' and no '.'
    if suffix is None:
        return False
    return not suffix or (suffix.startswith("/") and ".." not in suffix and "\0" not in suffix)


def is_context(node: ast.AST, checker: Checker, depth: int = 0) -> bool:
    """Whether ``node`` is certainly the harness context: a function parameter that is the
    first parameter of an entrypoint (or annotated with ``PrismContext``), every call of whose
    function in the bundle passes a name that is itself certainly the context."""
    if depth > 6 or not isinstance(node, ast.Name):
        return False
    index = checker.index
    where = lookup(node.id, checker.info.scope_for(node))
    if where is None or where.kind != "function":
        return False
    bindings = where.bindings.get(node.id, [])
    if not bindings or any(b[0] != "param" for b in bindings):
        return False
    for _, fn, name, pos, is_method in bindings:
        if index.resolve(node, where) != frozenset({CTX}):
            return False
        fn_name = getattr(fn, "name", None)
        for call, info in index.calls.get(fn_name or "", ()):
            if not may_call(index, fn, call, info):
                continue
            shift = 1 if is_method and isinstance(call.func, ast.Attribute) else 0
            args = [kw.value for kw in call.keywords if kw.arg == name]
            if 0 <= pos - shift < len(call.args):
                args.append(call.args[pos - shift])
            if any(isinstance(a, ast.Starred) for a in call.args) or any(
                kw.arg is None for kw in call.keywords
            ):
                return False
            sub = Checker(index, info) if info is not checker.info else checker
            if not args or not all(is_context(a, sub, depth + 1) for a in args):
                return False
    return True


def may_call(index: BundleIndex, fn: ast.AST, call: ast.Call, info: ModuleInfo) -> bool:
    """Whether ``call`` (matched by name) may call the bundle function ``fn``.

    A method call on an object the gate cannot name (``model.train()``) may call a top-level
    function of that name only when the bundle stores something under that attribute name
    (modules used as values are refused, so the object is not a bundle module)."""
    qs = index.canonical(index.resolve(call.func, info.scope_for(call)))
    scope = index.scope_of_def(fn)
    if not qs:
        return not (
            isinstance(call.func, ast.Attribute)
            and call.func.attr not in index.fields
            and scope is not None
            and scope.kind == "module"
        )
    if scope is None or scope.kind != "module":
        return False
    return f"{index.info_of(scope).name}.{getattr(fn, 'name', '')}" in qs


def _flatten_add(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [*_flatten_add(node.left), *_flatten_add(node.right)]
    return [node]


def _arg(call: ast.Call, pos: int, name: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if pos < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: pos + 1]):
        return call.args[pos]
    return None


def _root(q: str) -> str:
    return q.split(".")[0]


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


@lru_cache(maxsize=4096)
def _is_live_module(q: str) -> bool:
    return isinstance(live_object(q), ModuleType)


@lru_cache(maxsize=4096)
def _harness_class(q: str) -> bool:
    """Whether ``q`` names ``torch.Tensor``, ``torch.nn.Module`` or ``torch.nn.Parameter``."""
    if q.startswith("<") or _root(q) != "torch":
        return False
    torch = sys.modules.get("torch")
    obj = live_object(q)
    return torch is not None and isinstance(obj, type) and obj in (torch.Tensor, torch.nn.Module, torch.nn.Parameter)


@lru_cache(maxsize=4096)
def _live_class_kind(q: str) -> str | None:
    """``"tensor"`` when ``q`` names a ``torch.Tensor`` subclass on the trusted modules,
    ``"meta"`` when it names ``type`` or a metaclass, else ``None``."""
    if q.startswith("<"):
        return None
    obj = live_object(q)
    if not isinstance(obj, type):
        return None
    if issubclass(obj, type):
        return "meta"
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(obj, torch.Tensor):
        return "tensor"
    return None


def _describe(qs: frozenset[str]) -> str:
    named = sorted(q for q in qs if not q.startswith("<"))
    if CTX in qs or any(q.startswith(CTX + ".") for q in qs):
        return "the context (ctx)"
    if TYPE in qs:
        return "a type (type(x))"
    return f"'{min(named, key=len)}'" if named else "an imported object"


def _docstring_ids(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def check_modules(index: BundleIndex) -> list[Finding]:
    """Run the sandbox over every module of ``index``; findings in file order. A module whose
    check raises (a recursion too deep for the gate) gets a ``prism:too-complex`` finding at
    the node being checked, after what was found before."""
    out: list[Finding] = []
    for name in sorted(index.modules, key=lambda n: index.modules[n].rel):
        checker = Checker(index, index.modules[name])
        found, failed = guarded(checker.info.rel, lambda: checker.info.position(checker.current)[0], checker.run)
        out.extend(checker.findings if found is None else found)
        if failed is not None:  # what was found before the failure stands
            out.append(failed)
    return out


__all__ = [
    "ALLOWED_MODULES",
    "ALLOWED_ROOTS",
    "BLOCKED_ATTRS",
    "BLOCKED_BUILTINS",
    "BLOCKED_MODULES",
    "INTROSPECTION_ATTRS",
    "HARNESS_FACING_METHODS",
    "TENSOR_CLASSES",
    "Checker",
    "artifacts_path",
    "is_context",
    "may_call",
    "check_modules",
    "defines_symbol",
    "module_rule",
    "parse_source",
]
