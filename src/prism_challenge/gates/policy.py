"""The AST sandbox's policy as data: rule ids and the tables of what a bundle may reach.

Which top-level modules a bundle may import (:data:`ALLOWED_ROOTS`), which modules, builtins,
module globals, attribute names, objects and operator paths are blocked and under which rule
(:data:`BLOCKED_MODULES`, :data:`BLOCKED_BUILTINS`, ...), the allow-listed names of the modules
that hide string evaluation (:data:`NAMESPACE_ALLOW`), the dunders a bundle class may define or
read, and the calls whose arguments are checked where they are made. The checks that apply
these tables are the mixins of :class:`prism_challenge.gates.sandbox.Checker`; imports and
attribute paths are judged by :func:`prism_challenge.gates.modulerule.module_rule`.
"""

from __future__ import annotations

from prism_challenge.gates.allowlist import NOT_ALLOWLISTED
from prism_challenge.gates.astindex import TYPE
from prism_challenge.gates.reproducible import CLOCK_MODULES, WALL_CLOCK

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
