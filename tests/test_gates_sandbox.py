"""AST sandbox details: legitimate model code must pass; resolution and positions are exact."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from prism_challenge.gates import run_gates
from prism_challenge.gates.astindex import BundleIndex
from prism_challenge.gates.modulerule import module_rule, namespace_rule, origin_rule
from prism_challenge.gates.parsing import parse_source
from prism_challenge.gates.sandbox import check_modules
from prism_challenge.gates.scopebuild import build_module
from prism_challenge.gates.scopes import lookup

REPO = Path(__file__).resolve().parents[1]
SEED_TRAINING = (REPO / "examples" / "tiny-1m" / "training.py").read_text(encoding="utf-8")


def scan(files: dict[str, str], entry: dict[str, str] | None = None):
    """Sandbox findings of in-memory modules (no bundle on disk, no child)."""
    modules = []
    for rel, src in files.items():
        src = textwrap.dedent(src)
        modules.append(build_module(rel, src, ast.parse(src), (entry or {}).get(rel, ())))
    index = BundleIndex(modules)
    return index, check_modules(index)


LEGIT = """
from __future__ import annotations

import functools
import itertools
import math
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x)
        ctx.scale = s
        return x * s

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.scale, None


class Net(nn.Module):
    def __init__(self, v: int, width: int = 8, act: Optional[str] = None):
        super().__init__()
        self.layers = nn.ModuleDict(OrderedDict(a=nn.Linear(width, width)))
        setattr(self, "extra", nn.Linear(width, width))
        self.emb = nn.Embedding(v, width)
        self.head = nn.Linear(width, v, bias=False)
        self.head.weight = self.emb.weight
        self.act = getattr(F, "gelu")
        self.compiled = torch.compile(self.extra) if hasattr(torch, "compile") else self.extra

    def forward(self, input):
        x = self.emb(input)
        for layer in itertools.chain(self.layers.values()):
            x = checkpoint(layer, x, use_reentrant=False)
        x = Scale.apply(x, 1.0 / math.sqrt(x.shape[-1]))
        compile = functools.reduce(lambda a, b: a + b, [x, x])
        label = "{0}x{1}".format(*x.shape[:2]) + f"{x.dtype}"
        del label
        return self.head(self.act(compile))


def build_model(ctx):
    model = Net(ctx.vocab_size)
    model.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) and m.bias is not None else None)
    return model
"""


def test_legitimate_model_code_passes():
    _, findings = scan({"architecture.py": LEGIT}, {"architecture.py": {"build_model"}})
    assert findings == []


def test_seed_training_passes_unchanged():
    arch = "def build_model(ctx):\n    return None\n"
    _, findings = scan({"training.py": SEED_TRAINING, "architecture.py": arch}, {"training.py": {"train"}})
    assert findings == []


def test_resolution_follows_aliases_params_and_reexports():
    helpers = "from torch import load as L\nimport torch.nn.functional as F\n"
    arch = """
    import helpers
    from helpers import L, F as G

    def use(mod):
        return mod

    def build_model(ctx):
        H = G
        use(H)
        return L
    """
    index, _ = scan({"helpers.py": helpers, "architecture.py": arch}, {"architecture.py": {"build_model"}})
    info = index.modules["architecture"]
    fn = {n.name: n for n in ast.walk(info.tree) if isinstance(n, ast.FunctionDef)}
    ret = fn["build_model"].body[-1].value  # `L`
    qs = index.canonical(index.resolve(ret, info.scope_for(ret)))
    assert "torch.load" in qs
    mod = fn["use"].body[0].value  # `mod`, passed H = G = helpers.F
    assert "torch.nn.functional" in index.canonical(index.resolve(mod, info.scope_for(mod)))
    ctx = fn["build_model"].args.args[0]
    assert lookup("ctx", info.scope_for(fn["build_model"].body[0])).kind == "function"
    name = ast.Name("ctx", ast.Load())
    info.scope_of[id(name)] = info.scope_for(fn["build_model"].body[0])
    assert index.resolve(name, info.scope_of[id(name)]) == frozenset({"<ctx>"})
    assert ctx.arg == "ctx"


def test_comprehension_and_class_scopes_do_not_hide_builtins():
    src = """
    class K:
        open = None

        def m(self):
            return open("x")

    def f():
        [0 for open in [1]]
        return open("y")

    def g(open):
        return open("fine")
    """
    _, findings = scan({"m.py": src})
    assert sorted((f.rule, f.line) for f in findings) == [("prism:no-filesystem", 6), ("prism:no-filesystem", 10)]


def test_column_is_in_characters():
    src = 'x = "\u00e9\u00e9\u00e9"; y = eval("1")\n'
    _, findings = scan({"m.py": src})
    (f,) = findings
    assert (f.line, f.col) == (1, src.index("eval") + 1)


@pytest.mark.parametrize(
    "mod,rule",
    [
        ("torch", None),
        ("torch.nn.functional", None),
        ("torch.distributed", None),
        ("torch.hub", "prism:no-network"),
        ("torch.utils.cpp_extension", "prism:no-ffi"),
        ("torch._C", "prism:torch-private"),
        ("collections.abc", None),
        ("prism_challenge.evaluator.interface", None),
        ("prism_challenge.evaluator.feeder", "prism:import-not-allowed"),
        ("numpy", "prism:import-not-allowed"),
        ("os.path", "prism:no-process"),
        ("helpers", None),
        ("helpers._private", None),
        ("torch.fx", "prism:no-dynamic-code"),
        ("torch.export", "prism:no-dynamic-code"),
        ("torch.jit", None),
        ("torch.jit.frontend", "prism:no-dynamic-code"),
        ("torch.cuda.gds", "prism:no-filesystem"),
        ("collections._sys", "prism:private-attr"),
        ("typing.get_type_hints", "prism:no-dynamic-code"),
        ("dataclasses.asdict", "prism:private-attr"),
        ("functools.singledispatch", "prism:no-dynamic-code"),
    ],
)
def test_module_rules(mod, rule):
    hit = module_rule(mod, {"helpers"})
    assert (hit[0] if hit else None) == rule


def test_parse_source_reports_encoding_and_syntax():
    assert parse_source("a.py", b"x = 1\n")[2] == []
    _, _, (f,) = parse_source("a.py", b"x = 1\ny = '\xff'\n")
    assert (f.rule, f.line) == ("prism:encoding", 2)
    _, _, (f,) = parse_source("a.py", b"# coding: utf-7\nx = 1\n")
    assert f.rule == "prism:encoding" and "utf-7" in f.message
    _, _, (f,) = parse_source("a.py", b"\xef\xbb\xbfx = (\n")  # BOM is fine, the paren is not
    assert (f.rule, f.line) == ("prism:syntax", 1)


def test_helper_module_code_is_scanned_too(tmp_path):
    (tmp_path / "architecture.py").write_text(
        "from tools import make\n\n\ndef build_model(ctx):\n    return make(ctx.vocab_size)\n"
    )
    (tmp_path / "tools.py").write_text(
        "from torch import nn\n\n\ndef make(v):\n    nn.Linear.forward = print\n    return nn.Linear(v, v)\n"
    )
    (tmp_path / "training.py").write_text(SEED_TRAINING)
    report = run_gates(tmp_path, check_params=False)
    assert [(f.rule, f.file, f.line) for f in report.findings] == [("prism:no-monkeypatch", "tools.py", 5)]


def test_dunders_and_builtin_types_are_not_private_or_blocked():
    src = """
    import torch
    from torch import nn

    V = torch.__version__
    keys = dict.fromkeys(["a"])
    n = int.from_bytes(b"\\x01", "little")
    name = nn.Linear.__name__
    doc = nn.Linear.__doc__

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.forward_name = type(self).__name__
    """
    _, findings = scan({"m.py": src})
    assert findings == []
    # any other dunder is a private attribute: only the ones above are read
    _, findings = scan({"m.py": "from torch import nn\ncall = nn.Module.__call__\n"})
    assert [(f.rule, f.line) for f in findings] == [("prism:private-attr", 2)]


@pytest.mark.parametrize(
    "name,rule",
    [
        ("typing.Optional", None),
        ("typing.get_type_hints", "prism:no-dynamic-code"),
        ("typing.evaluate_forward_ref", "prism:no-dynamic-code"),
        ("dataclasses.dataclass", None),
        ("dataclasses.make_dataclass", "prism:no-dynamic-code"),
        ("dataclasses.replace", "prism:ctx-forge"),
        ("functools.partial", None),
        ("functools.singledispatchmethod", "prism:no-dynamic-code"),
        ("torch.jit.is_scripting", None),
        ("torch.jit.script", "prism:no-dynamic-code"),
        ("torch.jit.CompilationUnit", "prism:no-dynamic-code"),
    ],
)
def test_allow_listed_namespaces(name, rule):
    hit = namespace_rule(name)
    assert (hit[0] if hit else None) == rule


@pytest.mark.parametrize(
    "name,rule",
    [
        ("torch.utils.data.IterDataPipe", "prism:no-filesystem"),
        ("torch.utils.data.runtime_validation", "prism:no-filesystem"),
        ("torch.utils.checkpoint.get_type_hints", "prism:no-dynamic-code"),
        ("torch.distributed.distributed_c10d.rendezvous", "prism:no-network"),
        ("torch.load", None),
        ("torch.nn.Linear", None),
        ("torch.utils.data.DistributedSampler", None),
        ("typing.Text", None),
    ],
)
def test_re_exports_are_judged_where_they_were_defined(name, rule):
    hit = origin_rule(name)
    assert (hit[0] if hit else None) == rule


def test_global_and_nonlocal_bindings_land_where_python_puts_them():
    src = """
    import torch

    def setup():
        global T
        T = torch

    def outer():
        U = None

        def inner():
            nonlocal U
            U = torch.hub
        inner()
        return U.load("a/b", "c")

    def use():
        return T.hub.load("a/b", "c")
    """
    _, findings = scan({"m.py": src})
    assert sorted((f.rule, f.line) for f in findings) == [
        ("prism:no-network", 13),  # U = torch.hub, reached again through U.load
        ("prism:no-network", 18),
    ]


def test_private_attribute_exceptions_are_exactly_super_init_and_own_modules():
    src = """
    from torch import nn
    import tools
    from tools import _scale


    class Net(nn.Module):
        def __init__(self):
            super(Net, self).__init__()
            self.k = tools._scale + _scale


    class Other(nn.Module):
        def __init__(self):
            nn.Module.__init__(self)
            self._cache = {}
            super(type(self), self).__init__()
    """
    tools = "_scale = 2\n"
    _, findings = scan({"m.py": src, "tools.py": tools})
    assert sorted((f.rule, f.line) for f in findings) == [
        ("prism:no-monkeypatch", 17),  # type(self) handed to a call
        ("prism:private-attr", 15),
        ("prism:private-attr", 16),
        ("prism:private-attr", 17),
    ]
