"""The allow-list: what is not on gates/allowlist.toml is refused; natural model code passes."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from prism_challenge.intake.bundle import BundleError

from prism_challenge.cli import main
from prism_challenge.gates import RULES, run_gates
from prism_challenge.gates.allowlist import (
    NOT_ALLOWLISTED,
    is_allowed_attr,
    is_allowed_module,
    is_allowed_path,
    load_allowlist,
    parse_allowlist,
)
from prism_challenge.gates.modulerule import module_rule

sys.path.insert(0, str(Path(__file__).resolve().parent / "adversarial"))
from gatekit import arch, line_of, write_bundle  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KITCHEN_SINK = REPO / "tests" / "clean_bundles" / "kitchen_sink"
ELF = b"\x7fELF\x02\x01\x01" + bytes(57)


def test_kitchen_sink_gpt_passes_check_with_no_finding(tmp_path, capsys):
    bundle = shutil.copytree(KITCHEN_SINK, tmp_path / "ks")
    report = run_gates(bundle, nproc=2)
    assert report.findings == []
    assert report.param_count is not None and report.param_count > 0
    assert main(["check", str(bundle), "--nproc", "2"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_red_team_library_loaded_by_path_is_refused(tmp_path):
    # the red team's route: an ELF named .txt, handed by path to a public torch function that
    # loads a library (XPUPluggableAllocator is on no deny-list: the allow-list refuses it)
    body = 'a = torch.xpu.memory.XPUPluggableAllocator(ctx.artifacts_dir + "/w.txt", "alloc", "free")'
    src = arch(body=body)
    with pytest.raises(BundleError, match="weights.txt line 1: NUL byte") as refused:  # intake stops the ELF itself
        run_gates(write_bundle(tmp_path / "elf", {"architecture.py": src, "weights.txt": ELF}), check_params=False)
    assert refused.value.rule == "prism:binary-file"
    root = write_bundle(tmp_path / "text", {"architecture.py": src, "weights.txt": "a text file no loader may reach"})
    report = run_gates(root, check_params=False)
    (f,) = [f for f in report.findings if f.blocking]
    line = line_of(src, "XPUPluggableAllocator")
    assert (f.rule, f.file, f.line) == (NOT_ALLOWLISTED, "architecture.py", line)
    assert f.col == src.splitlines()[line - 1].index("xpu") + 1
    assert f.message == "'torch.xpu' is not on the allow-list (allowlist.toml)"
    assert report.param_count is None


@pytest.mark.parametrize(
    "top,body,needle,named",
    [
        ("", "n = torch.ops.aten.add(1, 2)", "ops", "'torch.ops'"),
        ("", "v = torch.backends.mps.is_built()", "is_built", "'torch.backends.mps.is_built'"),
        ("", "m = torch.nn.DataParallel(model)", "DataParallel", "'torch.nn.DataParallel'"),
        ("", "s = model.emb.weight.set_()", "set_", "attribute 'set_'"),
        ("", "p = model.emb.weight.as_strided((1,), (1,))", "as_strided", "attribute 'as_strided'"),
        ("", 'n = getattr(model.emb.weight, "numpy")()', "numpy", "attribute 'numpy'"),
        ("", "t = F.torch.ops", "F.torch", "'torch.nn.functional.torch'"),
        ("from torch.utils.data import DataLoader", "", "DataLoader", "'torch.utils.data.DataLoader'"),
        ("import torch.xpu", "", "import torch.xpu", "'torch.xpu'"),
        ("from torch.nn.modules import linear", "", "linear", "'torch.nn.modules'"),
        ("", 'u = "{0.set_}".format(model.emb.weight)', "format", "attribute 'set_'"),
        ("", "license()", "license", "builtin 'license'"),
        ("", "names = dir(model)", "dir(", "builtin 'dir'"),
        ("", 'm = memoryview(b"ab")', "memoryview", "builtin 'memoryview'"),
        ("def late():\n    return copyright", "", "return copyright", "builtin 'copyright'"),
    ],
)
def test_paths_and_names_off_the_list_are_refused(tmp_path, top, body, needle, named):
    src = arch(top=top, body=body)
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    hits = [f for f in report.findings if f.rule == NOT_ALLOWLISTED]
    assert [(f.file, f.line) for f in hits] == [("architecture.py", line_of(src, needle))]
    assert named in hits[0].message and "allow-list (allowlist.toml)" in hits[0].message
    assert hits[0].col >= 1
    assert [f.rule for f in report.findings if f.blocking] == [NOT_ALLOWLISTED]


def test_names_the_bundle_defines_itself_pass(tmp_path):
    top = '''
    from collections import namedtuple
    from dataclasses import dataclass

    Pair = namedtuple("Pair", "left right")


    @dataclass
    class Cfg:
        depth: int = 2


    class Holder(nn.Module):
        scale_factor = 2.0

        def __init__(self):
            super().__init__()
            self.register_buffer("lookup_table", torch.zeros(2))
            self.bank = nn.ModuleDict({"first": nn.Linear(2, 2)})
            self.custom_field = 1

        def helper_method(self):
            return self.lookup_table + self.scale_factor + self.custom_field + self.bank.first.weight.sum()
    '''
    body = '''
    h = Holder()
    y = h.helper_method() + Pair(1, 2).left + Cfg().depth
    other = Holder()
    other.late_name = 3
    z = other.late_name
    '''
    report = run_gates(write_bundle(tmp_path, {"architecture.py": arch(top, body)}), check_params=False)
    assert report.findings == []


@pytest.mark.parametrize(
    "name,rule",
    [("share_memory_", "prism:no-filesystem"), ("untyped_storage", "prism:no-filesystem"),
     ("data_ptr", "prism:no-introspection"), ("as_subclass", "prism:no-monkeypatch")],
)
def test_names_off_the_list_that_are_denied_stay_refused_when_the_bundle_defines_them(tmp_path, name, rule):
    top = f"class Fake:\n    def {name}(self):\n        return 0"
    src = arch(top=top, body=f"x = model.emb.weight.{name}()")
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    assert (rule, line_of(src, f"weight.{name}")) in {(f.rule, f.line) for f in report.findings}
    assert NOT_ALLOWLISTED not in {f.rule for f in report.findings}


def test_a_deny_rule_keeps_its_own_id_on_its_line(tmp_path):
    src = arch(body='torch.ops.load_library(ctx.artifacts_dir + "/w.txt")')
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src, "w.txt": "text"}), check_params=False)
    assert [(f.rule, f.line) for f in report.findings] == [("prism:no-ffi", line_of(src, "load_library"))]


@pytest.mark.parametrize(
    "mod,rule",
    [
        ("torch.nn.functional", None),
        ("torch.utils.checkpoint", None),
        ("torch.optim.lr_scheduler", None),
        ("torch.xpu", NOT_ALLOWLISTED),
        ("torch.backends.cudnn", "prism:determinism"),
        ("torch.backends.mps.is_built", NOT_ALLOWLISTED),
        ("torch.ops", NOT_ALLOWLISTED),
        ("torch.nn.functional.gelu", None),
        ("torch.nn.functional.has_torch_function", NOT_ALLOWLISTED),
        ("torch.hub", "prism:no-network"),
        ("torch._C", "prism:torch-private"),
        ("prism_challenge.evaluator.interface.PrismContext", None),
        ("numpy", "prism:import-not-allowed"),
        ("mine.anything", None),
    ],
)
def test_module_rule_applies_the_allow_list_after_the_deny_rules(mod, rule):
    hit = module_rule(mod, {"mine"})
    assert (hit[0] if hit else None) == rule
    if rule == NOT_ALLOWLISTED:
        assert f"'{mod}'" in hit[1]


def test_api_answers_paths_and_names():
    assert is_allowed_path("torch.nn.functional.scaled_dot_product_attention")
    assert is_allowed_path("torch.nn.Module.train")  # a listed object + allowed attribute names
    assert is_allowed_path("itertools.chain.from_iterable")
    assert is_allowed_path("torch.distributed.ReduceOp.SUM")
    assert not is_allowed_path("torch.ops")  # a module's attributes are listed one by one
    assert not is_allowed_path("torch.nn.Module.untyped_storage")
    assert not is_allowed_path("torch.utils.cpp_extension.load")
    assert is_allowed_module("torch.nn") and not is_allowed_module("torch.nn.functional.gelu")
    assert is_allowed_attr("view") and is_allowed_attr("vocab_size") and is_allowed_attr("join")
    assert not is_allowed_attr("numpy") and not is_allowed_attr("load_library")
    assert NOT_ALLOWLISTED in RULES and "prism:too-complex" in RULES


def test_every_group_has_a_reason_and_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="one-line reason"):
        parse_allowlist('[groups.x]\npaths = ["math.pi"]\n')
    with pytest.raises(ValueError, match="unknown key"):
        parse_allowlist('[groups.x]\nreason = "r"\nnames = ["math.pi"]\n')
    al = load_allowlist()
    assert len(al.reasons) >= 20 and all(r.strip() for r in al.reasons.values())
    assert len(al.modules) + len(al.paths) + len(al.attrs) > 900


def test_every_entry_is_listed_once():
    data = tomllib.loads((REPO / "src" / "prism_challenge" / "gates" / "allowlist.toml").read_text())
    entries = [e for g in data["groups"].values() for k, v in g.items() if k != "reason" for e in v]
    assert len(entries) == len(set(entries))


def _resolve(path: str) -> object:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise LookupError(path)


def test_every_entry_exists_and_hangs_off_a_listed_parent():
    al = load_allowlist()
    for mod in sorted(al.modules):
        importlib.import_module(mod)
        parent = mod.rpartition(".")[0]
        assert not parent or parent in al.modules or parent == "prism_challenge.evaluator", mod
    for path in sorted(al.paths):
        # a listed object's attributes are allowed by name: it must not be a module
        assert not isinstance(_resolve(path), ModuleType), path
        parent = path.rpartition(".")[0]
        assert parent in al.modules or parent in al.paths or parent == "builtins", path


def test_nothing_that_loads_runs_or_evaluates_is_listed():
    al = load_allowlist()
    forbidden = {
        "load_library", "CDLL", "cpp_extension", "from_file", "untyped_storage", "storage",
        "share_memory_", "numpy", "data_ptr", "set_", "as_strided", "as_subclass", "DataParallel",
        "DataLoader", "jit.script", "jit.load", "jit.save", "ops", "hub", "fork", "Popen",
        "get_type_hints", "make_dataclass", "singledispatch", "import_module", "use_deterministic_algorithms",
    }
    entries = {*al.paths, *al.modules, *al.attrs}
    for entry in entries:
        assert not any(entry == f or entry.endswith("." + f) for f in forbidden), entry


def test_the_allow_list_ships_with_the_package():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "gates/allowlist.toml" in data["tool"]["setuptools"]["package-data"]["prism_challenge"]


def test_module_rule_opens_no_file_once_its_module_is_imported():
    # the ranks' runtime audit hook calls module_rule: the allow-list is read at import, not then
    code = (
        "import sys\n"
        "import prism_challenge.gates.modulerule as sb\n"
        "seen = []\n"
        "sys.addaudithook(lambda e, a: seen.append(a[0]) if e == 'open' else None)\n"
        "print(sb.module_rule('torch.nn.functional', set()), sb.module_rule('torch.xpu', set())[0], seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", NOT_ALLOWLISTED, "[]"], out.stderr[-2000:]
