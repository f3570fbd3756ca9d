"""Hostile bundles: each must raise its rule id at the offending line; clean ones must pass.

Every case is the clean tiny bundle (``gatekit.arch()`` + the seed's training.py, which pass with
no finding at all, see ``test_clean_base_has_no_findings``) with one poisoned piece, so the
expected finding can only come from that piece. Parameter counting is off here (static gates
only); it has its own tests in tests/test_gates_params.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from gatekit import EXAMPLE, MODELS, SEED_TRAINING, arch, line_of, write_bundle

from prism_challenge.intake.tree import hash_tree
from prism_challenge.gates import RULES, run_gates


@dataclass
class Case:
    """One hostile bundle: files to override, the rule it must raise, where."""

    id: str
    files: dict[str, str | bytes | None]
    rule: str
    file: str = "architecture.py"
    needle: str | None = None  # text on the offending line; None for a whole-file finding
    kwargs: dict = field(default_factory=dict)


def A(id, rule, needle, top="", body="", **kw) -> Case:  # noqa: N802 - table shorthand
    """A case poisoning architecture.py (``top``: module level, ``body``: in build_model)."""
    return Case(id, {"architecture.py": arch(top, body)}, rule, "architecture.py", needle, **kw)


def T(id, rule, needle, old, new, nproc=2) -> Case:  # noqa: N802
    """A case editing the seed training.py (``old`` -> ``new``), checked at ``nproc``."""
    assert old in SEED_TRAINING, old
    return Case(id, {"training.py": SEED_TRAINING.replace(old, new)}, rule, "training.py", needle, {"nproc": nproc})


HELPER_LOAD = "import torch\nfrom torch import load\n"
CASES: list[Case] = [
    # --- network -------------------------------------------------------------------------
    A("socket", "prism:no-network", "import socket", top="import socket"),
    A("urllib", "prism:no-network", "urlopen", top="from urllib.request import urlopen"),
    A("torch-hub-attr", "prism:no-network", "torch.hub", body='model = torch.hub.load("a/b", "gpt2")'),
    A("torch-hub-from", "prism:no-network", "hub", top="from torch import hub"),
    A("dist-rpc", "prism:no-network", "rpc", top="import torch.distributed.rpc as rpc"),
    A("tcpstore", "prism:no-network", "TCPStore", body='s = torch.distributed.TCPStore("evil.example", 1)'),
    # --- process -------------------------------------------------------------------------
    A("subprocess", "prism:no-process", "subprocess", top="import subprocess"),
    A("os", "prism:no-process", "import os", top="import os"),
    A("multiprocessing", "prism:no-process", "multiprocessing", top="from multiprocessing import Process"),
    A("torch-mp", "prism:no-process", "torch.multiprocessing", top="import torch.multiprocessing as mp"),
    A("threading", "prism:no-process", "threading", top="import threading"),
    A("exit", "prism:no-process", "exit(", body="exit(0)"),
    # --- filesystem ----------------------------------------------------------------------
    A("open", "prism:no-filesystem", "open(", body='data = open("/etc/passwd").read()'),
    A("open-alias", "prism:no-filesystem", "reader = open", top="reader = open"),
    A("pathlib", "prism:no-filesystem", "pathlib", top="import pathlib"),
    A("shutil", "prism:no-filesystem", "shutil", top="import shutil"),
    A("from-file", "prism:no-filesystem", "from_file", body='w = torch.from_file("/data/w.bin", size=8)'),
    A("tofile", "prism:no-filesystem", "tofile", body='model.emb.weight.detach().numpy().tofile("/tmp/x")'),
    A("tensorboard", "prism:no-filesystem", "tensorboard", top="from torch.utils.tensorboard import SummaryWriter"),
    # --- FFI -----------------------------------------------------------------------------
    A("ctypes", "prism:no-ffi", "ctypes", top="import ctypes"),
    A("cpp-extension", "prism:no-ffi", "cpp_extension", top="from torch.utils.cpp_extension import load_inline"),
    A("load-library", "prism:no-ffi", "load_library", body='torch.ops.load_library("/tmp/evil.so")'),
    A("jiterator", "prism:no-ffi", "jiterator", body='fn = torch.cuda.jiterator._create_jit_fn("x")'),
    # --- dynamic code --------------------------------------------------------------------
    A("eval", "prism:no-dynamic-code", "eval(", body='eval("1 + 1")'),
    A("exec", "prism:no-dynamic-code", "exec(", body='exec("x = 1")'),
    A("compile", "prism:no-dynamic-code", "compile(", body='code = compile("1", "f", "eval")'),
    A("dunder-import", "prism:no-dynamic-code", "__import__", body='m = __import__("os")'),
    A("importlib", "prism:no-dynamic-code", "importlib", top="import importlib"),
    A("get-type-hints", "prism:no-dynamic-code", "get_type_hints", top="import typing", body="typing.get_type_hints(Tiny)"),
    A("comprehension-leak", "prism:no-dynamic-code", 'eval("1")', body='_ = [0 for eval in [1]]\neval("1")'),
    A("class-scope-leak", "prism:no-dynamic-code", 'return eval', top='class K:\n    eval = 1\n\n    def m(self):\n        return eval("1")'),
    A("default-arg", "prism:no-dynamic-code", "def g(", top="def g(e=eval):\n    return e"),
    # --- introspection -------------------------------------------------------------------
    A("globals", "prism:no-introspection", "globals()", body="g = globals()"),
    A("locals", "prism:no-introspection", "locals()", body="g = locals()"),
    # addresses differ between runs: a bias offset from id() made one bundle score 7.78 and 8.85
    A("id", "prism:no-introspection", "id(", body="s = (id(object()) // 16) % 97"),
    A("hash", "prism:no-introspection", "hash(", body="s = hash(object()) % 97"),
    A("vars", "prism:no-introspection", "vars(", body="g = vars(torch)"),
    A("func-globals", "prism:no-introspection", "__globals__", body="g = Tiny.forward.__globals__"),
    A("subclasses", "prism:no-introspection", "__subclasses__", body="s = ().__class__.__bases__[0].__subclasses__()"),
    A("code-object", "prism:no-introspection", "__code__", body="c = build_model.__code__"),
    A("frame-walk", "prism:no-introspection", "gi_frame", body="g = (i for i in [1])\nf = g.gi_frame.f_back"),
    A("builtins-name", "prism:no-introspection", "__builtins__", body="b = __builtins__"),
    A("module-dict", "prism:no-introspection", "__dict__", body='ld = torch.__dict__["load"]'),
    A("sys", "prism:no-introspection", "import sys", top="import sys"),
    A("inspect", "prism:no-introspection", "inspect", top="import inspect"),
    A("format-escape", "prism:no-introspection", "format", body='s = "{0.__globals__}".format(build_model)'),
    A("getattr-blocked-name", "prism:no-introspection", "getattr(", body='g = getattr(build_model, "__globals__")'),
    A("mro", "prism:no-introspection", "mro", body="m = type(model).mro()"),
    # --- interactive ---------------------------------------------------------------------
    A("breakpoint", "prism:no-interactive", "breakpoint", body="breakpoint()"),
    A("input", "prism:no-interactive", "input(", body="x = input()"),
    # --- getattr/setattr/delattr ---------------------------------------------------------
    A("getattr-computed", "prism:dynamic-attr", "getattr(", body='name = "lo" + "ad"\nfn = getattr(torch, name)'),
    A("setattr-computed", "prism:dynamic-attr", "setattr(", body='setattr(model, "x" + "y", 1)'),
    A("getattr-passed", "prism:dynamic-attr", "ga = getattr", body="ga = getattr"),
    # --- pickle --------------------------------------------------------------------------
    A("pickle", "prism:no-pickle", "pickle", top="import pickle"),
    A("marshal", "prism:no-pickle", "marshal", top="import marshal"),
    A("weights-only-false", "prism:no-pickle", "torch.load", body='sd = torch.load(ctx.artifacts_dir + "/w.pt", weights_only=False)'),
    A("object-collective", "prism:no-pickle", "all_gather_object", body="torch.distributed.all_gather_object([None], model)"),
    A("reduce", "prism:no-pickle", "__reduce__", top="class P:\n    def __reduce__(self):\n        return (print, ())"),
    # --- torch.load / torch.save ---------------------------------------------------------
    A("torch-load-abs", "prism:torch-io", "torch.load", body='model.load_state_dict(torch.load("/data/gpt2.pt"))'),
    A("torch-save-tmp", "prism:torch-io", "torch.save", body='torch.save(model.state_dict(), "/tmp/m.pt")'),
    A("torch-save-escape", "prism:torch-io", "torch.save", body='torch.save(model, ctx.artifacts_dir + "/../m.pt")'),
    A("torch-save-sibling", "prism:torch-io", "torch.save", body='torch.save(model, ctx.artifacts_dir + "2/m.pt")'),
    A("torch-load-alias", "prism:torch-io", "L = torch.load", body="L = torch.load"),
    A("jit-load", "prism:torch-io", "jit.load", body='m = torch.jit.load("/data/m.pt")'),
    A("getattr-load", "prism:torch-io", "getattr(", body='sd = getattr(torch, "load")("/data/w.pt")'),
    A("fake-ctx-path", "prism:torch-io", "torch.load", top="class C:\n    pass", body='c = C()\nsd = torch.load(c.weights + "/w.pt")'),
    Case(
        "reexport-load",
        {"helpers.py": HELPER_LOAD, "architecture.py": arch("from helpers import load", 'sd = load("/data/w.pt")')},
        "prism:torch-io",
        "architecture.py",
        'load("/data/w.pt")',
    ),
    # --- monkeypatching ------------------------------------------------------------------
    A("patch-F", "prism:no-monkeypatch", "F.cross_entropy", body="F.cross_entropy = lambda *a, **k: a[0].sum() * 0"),
    A("patch-tensor", "prism:no-monkeypatch", "backward", body="torch.Tensor.backward = lambda self, *a: None"),
    A("patch-full-path", "prism:no-monkeypatch", "log_softmax", body="torch.nn.functional.log_softmax = F.softmax"),
    A("patch-ctx", "prism:no-monkeypatch", "ctx.seed", body="ctx.seed = 1"),
    A("patch-setattr", "prism:no-monkeypatch", "setattr(", body='setattr(F, "cross_entropy", print)'),
    A("patch-del", "prism:no-monkeypatch", "del F", body="del F.cross_entropy"),
    A("patch-container", "prism:no-monkeypatch", "mods[0]", body="mods = [F]\nmods[0].cross_entropy = print"),
    A("patch-via-param", "prism:no-monkeypatch", "m.cross_entropy", top="def patch(m):\n    m.cross_entropy = print", body="patch(F)"),
    A("patch-alias", "prism:no-monkeypatch", "G.cross_entropy", top="G = F", body="G.cross_entropy = print"),
    A("patch-type", "prism:no-monkeypatch", "type(", body="type(model.emb.weight).add = print"),
    A("patch-module-class", "prism:no-monkeypatch", "nn.Module.__call__", body="nn.Module.__call__ = print"),
    A("torch-function", "prism:no-monkeypatch", "__torch_function__", top="class T(torch.Tensor):\n    @classmethod\n    def __torch_function__(cls, func, types, args=(), kwargs=None):\n        return 0"),
    A("global-hook", "prism:no-monkeypatch", "register_module_forward_hook", body="torch.nn.modules.module.register_module_forward_hook(print)"),
    A("overrides", "prism:no-monkeypatch", "overrides", top="import torch.overrides"),
    A("patch-harness", "prism:no-monkeypatch", "PrismContext.iter_train_batches", top="from prism_challenge.evaluator.interface import PrismContext", body="PrismContext.iter_train_batches = print"),
    A("torch-library", "prism:no-monkeypatch", "torch.library", top="import torch.library"),
    A("patch-via-field", "prism:no-monkeypatch", "self.f.cross_entropy", top="class Holder:\n    def __init__(self):\n        self.f = F\n\n    def go(self):\n        self.f.cross_entropy = print"),
    A("tensor-subclass", "prism:no-monkeypatch", "class Fake", top="class Fake(torch.Tensor):\n    def float(self):\n        return self"),
    A("hide-parameters", "prism:no-monkeypatch", "def named_parameters", top="class Hidden(nn.Module):\n    def named_parameters(self, *a, **k):\n        return iter(())"),
    # --- ctx private / torch private / forging -------------------------------------------
    A("ctx-runtime", "prism:ctx-private", "ctx._runtime", body="rt = ctx._runtime"),
    A("ctx-getattr-private", "prism:ctx-private", "getattr(", body='rt = getattr(ctx, "_runtime")'),
    A("ctx-via-helper", "prism:ctx-private", "c._runtime", top="def peek(c):\n    return c._runtime", body="peek(ctx)"),
    A("torch-C", "prism:torch-private", "torch._C", body="torch._C._set_grad_enabled(True)"),
    A("torch-dynamo", "prism:torch-private", "torch._dynamo", top="import torch._dynamo"),
    A("forge-ctx", "prism:ctx-forge", "PrismContext(", top="from prism_challenge.evaluator.interface import PrismContext", body="fake = PrismContext(seed=0, vocab_size=2, sequence_length=2, max_parameters=1)"),
    A("forge-replace", "prism:ctx-forge", "replace", top="import dataclasses", body="c2 = dataclasses.replace(ctx, seed=0)"),
    A("forge-class", "prism:ctx-forge", "artifacts_dir", top='class FakeCtx:\n    artifacts_dir = "/home"'),
    A("forge-type-call", "prism:ctx-forge", "type(ctx)", body="c2 = type(ctx)(0, 2, 2, 1)"),
    A("ctx-via-field", "prism:ctx-private", "self.c._runtime", top="class Keep:\n    def __init__(self, c):\n        self.c = c\n\n    def peek(self):\n        return self.c._runtime", body="Keep(ctx)"),
    A("fake-ctx-caller", "prism:torch-io", "torch.load", top="def grab(c):\n    return torch.load(c.artifacts_dir)\n\n\nclass Fake:\n    pass", body="grab(ctx)\ngrab(Fake())"),
    # --- modules reached as attributes of allowed modules (looked up on the real ones) ----
    A("torch-os", "prism:no-process", "torch.os", body='torch.os.system("id")'),
    A("F-numpy", "prism:import-not-allowed", "F.np", body='w = F.np.load("/data/w.npy", allow_pickle=True)'),
    A("dataclasses-builtins", "prism:no-dynamic-code", "builtins", top="import dataclasses", body='dataclasses.builtins.eval("1")'),
    A("from-torch-ctypes", "prism:no-ffi", "ctypes", top="from torch import ctypes"),
    A("F-torch-load", "prism:torch-io", "F.torch.load", body='sd = F.torch.load("/data/w.pt")'),
    A("collections-sys", "prism:no-introspection", "_sys", top="import collections", body="m = collections._sys.modules"),
    A("array-namespace", "prism:no-introspection", "__array_namespace__", body="np = model.emb.weight.detach().numpy().__array_namespace__()"),
    A("getstate-dict", "prism:no-introspection", "__getstate__", body='F.__getstate__()["cross_entropy"] = print'),
    A("op-py-impl", "prism:no-monkeypatch", "py_impl", body="torch.ops.aten.add.default.py_impl(print)"),
    # --- private attributes on any object (the red-team routes to ctx._runtime) -----------
    A("typing-eval-type", "prism:private-attr", "_eval_type", top="import typing", body='box = []\ntyping._eval_type(typing.List["box.append(1) or int"], {"box": box}, None)'),
    A("ctx-next-iter", "prism:private-attr", "._runtime", body="rt = next(iter([ctx]))._runtime"),
    A("ctx-box", "prism:private-attr", "box[0]._runtime", body="box = []\nbox.append(ctx)\nrt = box[0]._runtime"),
    A("ctx-dict-get", "prism:private-attr", "._runtime", body='rt = {"k": ctx}.get("k")._runtime'),
    A("ctx-lambda", "prism:private-attr", "._runtime", body="rt = (lambda z: z)(ctx)._runtime"),
    A("self-private-unbound", "prism:private-attr", "self._runtime", top="class Peek:\n    def peek(self):\n        return self._runtime", body="rt = Peek.peek(ctx)"),
    A("getattr-private", "prism:private-attr", "getattr(", body='p = getattr(model, "_parameters")'),
    A("hasattr-private", "prism:private-attr", "hasattr(", body='h = hasattr(next(iter([ctx])), "_runtime")'),
    A("setattr-private", "prism:private-attr", "setattr(", body='setattr(model, "_forward_hooks", {})'),
    A("import-private", "prism:private-attr", "import _lru_cache_wrapper", top="from functools import _lru_cache_wrapper"),
    A("dunder-init-call", "prism:private-attr", "nn.Module.__init__(model)", body="nn.Module.__init__(model)"),
    A("format-private", "prism:private-attr", "format", body='s = "{0._runtime}".format(next(iter([ctx])))'),
    A("format-map-private", "prism:private-attr", "format_map", body='s = "{c._runtime}".format_map({"c": next(iter([ctx]))})'),
    A("match-private-kw", "prism:private-attr", "case object", body="match next(iter([ctx])):\n    case object(_runtime=rt):\n        pass"),
    A("match-positional", "prism:private-attr", "case nn.Module", body="match model:\n    case nn.Module(a):\n        pass"),
    A("dataclasses-asdict", "prism:private-attr", "asdict", top="import dataclasses", body="d = dataclasses.asdict(ctx)"),
    # --- computed attribute names, modules used as values ---------------------------------
    A("format-computed", "prism:dynamic-attr", "fmt.format", body='fmt = "{0." + "_runtime}"\ns = fmt.format(ctx)'),
    A("format-augassign", "prism:dynamic-attr", "fmt.format", body='fmt = "{0."\nfmt += "_runtime}"\ns = fmt.format(ctx)'),
    A("str-format-unbound", "prism:dynamic-attr", "str.format", body='s = str.format("{0}", ctx)'),
    A("module-returned", "prism:dynamic-attr", "return torch", top="def get():\n    return torch", body='get().hub.load("a/b", "c")'),
    A("module-lambda", "prism:dynamic-attr", "lambda", top="import dataclasses", body='(lambda: dataclasses)().builtins.eval("1")'),
    A("module-through-call", "prism:dynamic-attr", "next(iter([torch]))", body='next(iter([torch])).hub.load("a/b", "c")'),
    A("computed-class-base", "prism:dynamic-attr", "class Fake", top="def ident(c):\n    return c\n\n\nclass Fake(ident(torch.Tensor)):\n    pass"),
    A("update-wrapper-names", "prism:dynamic-attr", "update_wrapper", top="import functools", body='functools.update_wrapper(model, ctx, assigned=("_runtime",), updated=())'),
    # --- string evaluation and code generation --------------------------------------------
    A("typing-get-args", "prism:no-dynamic-code", "get_args", top="import typing", body="a = typing.get_args(typing.List[int])"),
    A("typing-reexport", "prism:no-dynamic-code", "get_type_hints", top="from torch.utils.checkpoint import get_type_hints"),
    A("make-dataclass", "prism:no-dynamic-code", "make_dataclass", top="import dataclasses", body='C = dataclasses.make_dataclass("C", ["a"])'),
    A("singledispatch", "prism:no-dynamic-code", "singledispatch", top="import functools\n\n\n@functools.singledispatch\ndef f(x):\n    return x"),
    A("jit-script", "prism:no-dynamic-code", "jit.script", body="m = torch.jit.script(model)"),
    A("jit-fork", "prism:no-dynamic-code", "jit.fork", body="fut = torch.jit.fork(print, 1)"),
    A("fx-trace", "prism:no-dynamic-code", "symbolic_trace", body="g = torch.fx.symbolic_trace(model)"),
    A("export", "prism:no-dynamic-code", "torch.export", top="from torch.export import export"),
    A("quantize-fx", "prism:no-dynamic-code", "quantize_fx", top="from torch.ao.quantization.quantize_fx import prepare_fx"),
    A("compile-backend", "prism:no-dynamic-code", "torch.compile", top="def be(gm, example_inputs):\n    return gm", body="m = torch.compile(model, backend=be)"),
    A("compile-options", "prism:no-dynamic-code", "torch.compile", body='m = torch.compile(model, options={"cpp.cxx": ("sh",)})'),
    A("module-compile-backend", "prism:no-dynamic-code", "model.compile", top="def be(gm, example_inputs):\n    return gm", body="model.compile(backend=be)"),
    A("compile-alias", "prism:no-dynamic-code", "c = torch.compile", body='c = torch.compile\nm = c(model, backend="x")'),
    A("module-compile-alias", "prism:no-dynamic-code", "c = model.compile", top="def be(gm, example_inputs):\n    return gm", body="c = model.compile\nc(backend=be)"),
    A("ops-import-module", "prism:no-dynamic-code", "import_module", body='o = torch.ops.import_module("os")'),
    A("dunder-path", "prism:no-dynamic-code", "__path__", top='__path__ = ["/usr/lib/python3"]'),
    A("dunder-package", "prism:no-dynamic-code", "__package__", top='__package__ = "prism_challenge.evaluator"'),
    A("dunder-annotations", "prism:no-introspection", "__annotations__", top="from dataclasses import dataclass\n\n\n@dataclass\nclass C:\n    x: int\n    __annotations__[\"y=print(1)\"] = int"),
    # --- files, processes, network, FFI, interactive reached through torch -----------------
    A("datapipe-reexport", "prism:no-filesystem", "argument_validation", top="from torch.utils.data import argument_validation"),
    A("datapipe-base", "prism:no-filesystem", "IterDataPipe", top="class P(torch.utils.data.IterDataPipe):\n    pass"),
    A("ops-aten-save", "prism:no-filesystem", "aten.save", body='torch.ops.aten.save(model, "/tmp/m")'),
    A("cuda-gds", "prism:no-filesystem", "gds", body='f = torch.cuda.gds.GdsFile("/tmp/x", 0)'),
    A("cuda-tunable", "prism:no-filesystem", "tunable", body='torch.cuda.tunable.write_file("/tmp/x")'),
    A("trace-observer", "prism:no-filesystem", "ExecutionTraceObserver", body='o = torch.profiler.ExecutionTraceObserver().register_callback("/tmp/x")'),
    A("show-pickle", "prism:no-pickle", "show_pickle", top="from torch.utils import show_pickle"),
    A("dataloader-workers", "prism:no-process", "DataLoader", body="dl = torch.utils.data.DataLoader([1, 2], num_workers=2)"),
    A("xeon-launcher", "prism:no-process", "run_cpu", top="from torch.backends.xeon import run_cpu"),
    A("rendezvous-fn", "prism:no-network", "rendezvous", body='r = torch.distributed.distributed_c10d.rendezvous("tcp://10.0.0.1:1")'),
    A("debug-server", "prism:no-network", "debug", body="torch.distributed.debug.start_debug_server()"),
    A("global-alias", "prism:no-network", "T.hub", top="def setup():\n    global T\n    T = torch", body='setup()\nT.hub.load("a/b", "c")'),
    A("cudart", "prism:no-ffi", "cudart", body="rt = torch.cuda.cudart()"),
    A("allocator-delete", "prism:no-ffi", "caching_allocator_delete", body="torch.cuda.caching_allocator_delete(1234)"),
    A("dist-breakpoint", "prism:no-interactive", "breakpoint", body="torch.distributed.breakpoint()"),
    # --- classes built or hooked outside the gate's view ----------------------------------
    A("type-three-args", "prism:no-monkeypatch", "type(", body='T = type("T", (torch.Tensor,), {})'),
    A("metaclass-call", "prism:no-monkeypatch", "type(torch.Tensor)(", body='T = type(torch.Tensor)("T", (torch.Tensor,), {})'),
    A("type-passed", "prism:no-monkeypatch", "[type]", body='T = [type][0]("T", (torch.Tensor,), {})'),
    A("parameter-subclass", "prism:no-monkeypatch", "class P", top="class P(nn.Parameter):\n    def float(self):\n        return self"),
    A("hash-override", "prism:no-monkeypatch", "def __hash__", top="class H(nn.Module):\n    def __hash__(self):\n        return 0"),
    A("mro-entries", "prism:no-monkeypatch", "def __mro_entries__", top="class B:\n    def __mro_entries__(self, bases):\n        return (torch.Tensor,)"),
    A("harness-method-assigned", "prism:no-monkeypatch", "named_parameters =", top="class H(nn.Module):\n    named_parameters = None"),
    A("finalizer", "prism:no-monkeypatch", "def __del__", top="class H:\n    def __del__(self):\n        pass"),
    A("name-rebind", "prism:no-monkeypatch", "__name__ =", top='__name__ = "torch"'),
    A("flop-counter", "prism:no-monkeypatch", "flop_counter", top="from torch.utils.flop_counter import FlopCounterMode"),
    A("backend-registration", "prism:no-monkeypatch", "backend_registration", top="from torch.utils.backend_registration import rename_privateuse1_backend"),
    A("tensor-class-through-call", "prism:no-monkeypatch", "next(iter([torch.Tensor]))", body="next(iter([torch.Tensor])).gather = print"),
    A("tensor-class-partial", "prism:no-monkeypatch", "partial(torch.Tensor)", top="import functools", body="functools.partial(torch.Tensor).func.gather = print"),
    A("ctx-type-through-call", "prism:no-monkeypatch", "type(ctx)", body="c2 = next(iter([type(ctx)]))(0, 2, 2, 1)"),
    A("tensor-class-returned", "prism:no-monkeypatch", "return torch.Tensor", top="def get():\n    return torch.Tensor", body="get().gather = print"),
    A("annotated-forwards-store", "prism:no-monkeypatch", "typing.Annotated[torch.Tensor", top="import typing", body="next(iter([typing.Annotated[torch.Tensor, 0]])).gather = print"),
    A("dataclass-field-held", "prism:no-dynamic-code", "F0 = field", top="from dataclasses import dataclass, field\nF0 = field(default=None)\n\n\n@dataclass\nclass C:\n    t: torch.Tensor = F0", body="F0.type.gather = print"),
    A("dataclasses-fields", "prism:no-dynamic-code", "fields(", top="import dataclasses", body="fs = dataclasses.fields(model)"),
    # --- imports -------------------------------------------------------------------------
    A("numpy", "prism:import-not-allowed", "numpy", top="import numpy"),
    A("star", "prism:import-not-allowed", "import *", top="from torch.nn.functional import *"),
    A("harness-module", "prism:import-not-allowed", "seeding", top="from prism_challenge.evaluator.seeding import force_seeds"),
    # --- bundle shape --------------------------------------------------------------------
    Case("syntax", {"architecture.py": "def build_model(ctx):\n    return (\n"}, "prism:syntax", "architecture.py", None),
    Case("coding-cookie", {"architecture.py": "# -*- coding: latin-1 -*-\n" + arch()}, "prism:encoding", "architecture.py", None),
    Case("missing-symbol", {"architecture.py": arch().replace("def build_model", "def make_model")}, "prism:missing-symbol", "architecture.py", None),
    Case(
        "missing-declared-file",
        {"prism.yaml": "architecture:\n  entrypoint: model.py:make\n"},
        "prism:missing-entrypoint",
        "model.py",
        None,
    ),
    Case(
        "same-file",
        {"prism.yaml": "architecture:\n  entrypoint: training.py:train\n"},
        "prism:spec",
        "prism.yaml",
        None,
    ),
    Case("unknown-tokenizer", {"prism.yaml": "tokenizer: llama\n"}, "prism:spec", "prism.yaml", None),
    # --- multi-GPU contract (checked at nproc=2) -----------------------------------------
    T("no-init", "prism:ddp-init", None, "dist.init_process_group(backend=backend)", "pass"),
    T("no-wrap", "prism:ddp-wrap", None, "wrapped = DistributedDataParallel(model, device_ids=device_ids)", "wrapped = model"),
    T("unguarded-write", "prism:ddp-rank0-write", "torch.save", "if ctx.rank == 0 and ctx.artifacts_dir:", "if ctx.artifacts_dir:"),
    T("no-destroy", "prism:ddp-destroy", None, "dist.destroy_process_group()", "pass"),
    T("tcp-rendezvous", "prism:launch-limit", "init_process_group", "init_process_group(backend=backend)", 'init_process_group(backend=backend, init_method="tcp://10.0.0.1:23456")'),
    T("huge-world", "prism:launch-limit", "init_process_group", "init_process_group(backend=backend)", "init_process_group(backend=backend, world_size=64)"),
    T("positional-init-method", "prism:launch-limit", "init_process_group", "init_process_group(backend=backend)", 'init_process_group(backend, "tcp://10.0.0.1:23456")'),
    T("kwargs-init-method", "prism:launch-limit", "init_process_group", "init_process_group(backend=backend)", 'init_process_group(**{"backend": backend, "init_method": "tcp://10.0.0.1:1"})'),
    A("init-through-partial", "prism:launch-limit", "partial(", top="import functools", body='functools.partial(torch.distributed.init_process_group, init_method="tcp://10.0.0.1:1")()'),
    Case("nproc-9", {}, "prism:launch-limit", "", None, {"nproc": 9}),
    Case("two-nodes", {}, "prism:launch-limit", "", None, {"nnodes": 2}),
]


def test_at_least_forty_cases_and_every_finding_rule_is_known():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
    for c in CASES:
        assert c.rule in RULES, c.rule


def test_clean_base_has_no_findings(tmp_path):
    report = run_gates(write_bundle(tmp_path, {}), check_params=False, nproc=2)
    assert report.findings == []
    assert not report.blocking


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_bundle_raises_its_rule(tmp_path, case: Case):
    root = write_bundle(tmp_path, case.files)
    report = run_gates(root, check_params=False, **case.kwargs)
    hits = [f for f in report.findings if f.rule == case.rule and f.file == case.file]
    assert hits, f"expected {case.rule} in {case.file}; got {[(f.rule, f.location) for f in report.findings]}"
    assert all(f.blocking for f in hits)
    assert report.blocking
    assert report.param_count is None
    if case.needle is not None:
        text = (root / case.file).read_text(encoding="utf-8")
        want = line_of(text, case.needle)
        assert want in {f.line for f in hits}, (want, [(f.line, f.message) for f in hits])
        assert all(f.col >= 1 for f in hits if f.line == want)


def test_findings_carry_exact_position_and_message(tmp_path):
    src = arch(body='x = 1; data = open("/etc/passwd")')
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    (f,) = [f for f in report.findings if f.rule == "prism:no-filesystem"]
    line = line_of(src, "open(")
    assert (f.file, f.line, f.col) == ("architecture.py", line, src.splitlines()[line - 1].index("open") + 1)
    assert f.message == "builtin 'open' is blocked"
    assert f.to_dict() == {
        "rule": "prism:no-filesystem",
        "file": "architecture.py",
        "line": line,
        "col": f.col,
        "message": "builtin 'open' is blocked",
        "blocking": True,
    }


def test_a_path_escaping_the_artifacts_dir_is_refused_with_the_rule_spelled_out(tmp_path):
    src = arch(body='torch.save(model, ctx.artifacts_dir + "/../m.pt")')
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    (f,) = [f for f in report.findings if f.rule == "prism:torch-io"]
    assert f.message == ("torch.save writes a path the gate cannot prove is inside ctx.artifacts_dir (allowed: "
                         "ctx.artifacts_dir, optionally + string literals starting with '/' and holding no '..', "
                         "and integers: {step:06d}, str(int(step)))")


def test_syntax_error_reports_line_and_column(tmp_path):
    src = "import torch\n\ndef build_model(ctx):\n    return torch.nn.Linear(2, 2))\n"
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    (f,) = [f for f in report.findings if f.rule == "prism:syntax"]
    assert (f.file, f.line, f.col) == ("architecture.py", 4, src.splitlines()[3].rindex(")") + 1)


def test_contract_is_advisory_at_one_process(tmp_path):
    training = SEED_TRAINING.replace("dist.destroy_process_group()", "pass")
    report = run_gates(write_bundle(tmp_path, {"training.py": training}), check_params=False, nproc=1)
    (f,) = report.findings
    assert (f.rule, f.blocking) == ("prism:ddp-destroy", False)
    assert not report.blocking


def test_no_sampler_is_asked_for_the_harness_shards(tmp_path):
    # ctx.iter_train_batches hands each rank its slice of every global batch: a loop without a
    # DistributedSampler or rank-strided indexing is right, at any --nproc
    training = SEED_TRAINING.replace(
        "_ = DistributedSampler(\n        range(ctx.world_size * LOCAL_BATCH),\n        num_replicas=ctx.world_size,\n        rank=ctx.rank,\n    )",
        "_ = list(range(64))",
    ).replace("from torch.utils.data import DistributedSampler\n", "")
    assert "DistributedSampler(" not in training and "import DistributedSampler" not in training
    for nproc in (1, 2):
        report = run_gates(write_bundle(tmp_path / str(nproc), {"training.py": training}), check_params=False,
                           nproc=nproc)
        assert report.findings == []


def test_write_guarded_by_early_return_and_by_caller(tmp_path):
    helper = (
        "import torch\n\n\ndef save(ctx, model):\n"
        '    torch.save(model.state_dict(), ctx.artifacts_dir + "/m.pt")\n\n\n'
        "def save_if_main(ctx, model):\n    if ctx.rank != 0:\n        return\n"
        '    torch.save(model.state_dict(), f"{ctx.artifacts_dir}/n.pt")\n'
    )
    training = SEED_TRAINING.replace(
        '        torch.save(model.state_dict(), ctx.artifacts_dir + "/trained_state.pt")',
        "        save(ctx, model)\n    save_if_main(ctx, model)",
    ).replace("from architecture import build_model\n", "from architecture import build_model\nfrom ckpt import save, save_if_main\n")
    report = run_gates(write_bundle(tmp_path, {"training.py": training, "ckpt.py": helper}), check_params=False, nproc=2)
    assert report.findings == []
    # the same helper called once without the guard is flagged at the write
    training2 = training.replace("    save_if_main(ctx, model)", "    save_if_main(ctx, model)\n    save(ctx, model)")
    report = run_gates(write_bundle(tmp_path, {"training.py": training2}), check_params=False, nproc=2)
    assert [(f.rule, f.file, f.line) for f in report.findings] == [("prism:ddp-rank0-write", "ckpt.py", 5)]


# --- clean bundles ---------------------------------------------------------------------------


def test_example_passes_unchanged():
    report = run_gates(EXAMPLE, check_params=False, nproc=2)
    try:
        assert report.findings == []
        # the gates read the bundle's frozen copy: the same files, never the user's directory
        assert report.bundle is not None and report.bundle.root != EXAMPLE.resolve()
        assert report.bundle.file_hashes == hash_tree(EXAMPLE) and report.shown_source == str(EXAMPLE)
    finally:
        report.cleanup()


def test_bundle_importing_its_own_helper_passes(tmp_path):
    files = {
        "architecture.py": (MODELS / "helper_arch.py").read_text(),
        "layers/__init__.py": "",
        "layers/blocks.py": (MODELS / "helper_blocks.py").read_text(),
    }
    report = run_gates(write_bundle(tmp_path, files), check_params=False, nproc=2)
    assert report.findings == []


def test_tied_embedding_bundle_passes(tmp_path):
    files = {"architecture.py": (MODELS / "tied_arch.py").read_text()}
    report = run_gates(write_bundle(tmp_path, files), check_params=False, nproc=2)
    assert report.findings == []


def test_protocols_and_allowed_helpers_bundle_passes(tmp_path):
    files = {"architecture.py": (MODELS / "protocols_arch.py").read_text()}
    report = run_gates(write_bundle(tmp_path, files), check_params=False, nproc=2)
    assert report.findings == []


def test_bundle_private_names_of_its_own_modules_pass(tmp_path):
    helper = "_SCALE = 2.0\n\n\ndef _double(x):\n    return x * _SCALE\n"
    src = arch("import mytools\nfrom mytools import _SCALE, _double", "model.scale = mytools._double(_double(_SCALE))")
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src, "mytools.py": helper}), check_params=False, nproc=2)
    assert report.findings == []


def test_declared_entrypoints_are_honoured(tmp_path):
    files = {
        "architecture.py": None,
        "nets/model.py": arch().replace("def build_model(ctx):", "def make_model(ctx):"),
        "nets/__init__.py": "",
        "loop.py": SEED_TRAINING.replace("from architecture import build_model", "from nets.model import make_model as build_model").replace(
            "def train(", "def run("
        ),
        "training.py": None,
        "prism.yaml": "architecture:\n  entrypoint: nets/model.py:make_model\ntraining:\n  entrypoint: {file: loop.py, symbol: run}\ntokenizer: bytes\n",
    }
    report = run_gates(write_bundle(tmp_path, files), check_params=False, nproc=2)
    assert report.findings == []
    b = report.bundle
    assert (b.architecture.file, b.architecture.symbol, b.training.file, b.training.symbol, b.tokenizer) == (
        "nets/model.py",
        "make_model",
        "loop.py",
        "run",
        "bytes",
    )


def test_allowed_artifact_io_passes(tmp_path):
    body = (
        'torch.save(model.state_dict(), ctx.artifacts_dir + "/init.pt")\n'
        'path = f"{ctx.artifacts_dir}/init.pt"\n'
        "model.load_state_dict(torch.load(path, weights_only=True))"
    )
    report = run_gates(write_bundle(tmp_path, {"architecture.py": arch(body=body)}), check_params=False)
    # the only remark: at nproc > 1 an unguarded write in build_model would block
    assert [(f.rule, f.blocking) for f in report.findings] == [("prism:ddp-rank0-write", False)]
