"""Parameter cap: build_model(ctx) + one [1, 8] forward in a bounded child; unique storages."""

from __future__ import annotations

import py_compile
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import prism_challenge.gates.param_parent as param_parent
from prism_challenge.intake.bundle import BundleError, load_bundle
from prism_challenge.gates import parameter_gate, run_gates
from prism_challenge.gates.param_count import count_unique_elements, uninitialized

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-1m"
SEED_TRAINING = (EXAMPLE / "training.py").read_text(encoding="utf-8")
V = 257  # the bytes tokenizer: small embeddings keep the arithmetic readable

HEADER = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n"


def bundle(tmp_path: Path, arch_body: str) -> Path:
    root = tmp_path / "bundle"
    root.mkdir(exist_ok=True)
    (root / "architecture.py").write_text(HEADER + textwrap.dedent(arch_body), encoding="utf-8")
    (root / "training.py").write_text(SEED_TRAINING, encoding="utf-8")
    return root


def gate(root: Path, **kw):
    kw.setdefault("vocab_size", V)
    kw.setdefault("param_timeout_s", 60.0)
    return run_gates(root, **kw)


TIED = """
class Tied(nn.Module):
    def __init__(self, v, tie):
        super().__init__()
        self.emb = nn.Embedding(v, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, v, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm(self.emb(tokens)))


def build_model(ctx):
    return Tied(ctx.vocab_size, TIE)
"""


def test_tied_weights_are_counted_once(tmp_path):
    tied = gate(bundle(tmp_path, TIED.replace("TIE", "True")))
    assert tied.findings == []
    assert tied.param_count == V * 8 + 2 * 8  # embedding (= head) + LayerNorm weight and bias
    untied = gate(bundle(tmp_path, TIED.replace("TIE", "False")))
    assert untied.param_count == 2 * V * 8 + 2 * 8


def test_lazy_linear_realized_by_the_forward_is_over_the_cap(tmp_path):
    src = """
    class Lazy(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.emb = nn.Embedding(v, 8)
            self.wide = nn.LazyLinear(4096)
            self.head = nn.Linear(4096, v)

        def forward(self, tokens):
            return self.head(self.wide(self.emb(tokens)))


    def build_model(ctx):
        return Lazy(ctx.vocab_size)
    """
    expected = V * 8 + (8 * 4096 + 4096) + (4096 * V + V)
    report = gate(bundle(tmp_path, src), max_parameters=expected - 1)
    assert report.param_count == expected
    (f,) = report.findings
    assert (f.rule, f.file, f.blocking) == ("prism:param-cap", "architecture.py", True)
    assert f"{expected:,}" in f.message and f"{expected - 1:,}" in f.message
    assert f.line == (HEADER + textwrap.dedent(src)).splitlines().index("def build_model(ctx):") + 1


def test_parameter_created_in_first_forward_is_counted(tmp_path):
    src = """
    class Grow(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.emb = nn.Embedding(v, 8)

        def forward(self, tokens):
            if not hasattr(self, "extra"):
                self.extra = nn.Parameter(torch.zeros(50_000))
            return self.emb(tokens) @ self.emb.weight.T + self.extra[:1]


    def build_model(ctx):
        return Grow(ctx.vocab_size)
    """
    report = gate(bundle(tmp_path, src), max_parameters=40_000)
    assert report.param_count == V * 8 + 50_000
    assert [f.rule for f in report.findings] == ["prism:param-cap"]


def test_large_buffer_table_counts_against_the_cap(tmp_path):
    src = """
    class Table(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.emb = nn.Embedding(v, 8)
            self.register_buffer("table", torch.zeros(1000, 1000), persistent=False)

        def forward(self, tokens):
            return self.emb(tokens) @ self.emb.weight.T + self.table[0, 0]


    def build_model(ctx):
        return Table(ctx.vocab_size)
    """
    report = gate(bundle(tmp_path, src), max_parameters=500_000)
    assert report.param_count == V * 8 + 1_000_000
    assert [f.rule for f in report.findings] == ["prism:param-cap"]


def test_lazy_module_never_used_is_refused(tmp_path):
    src = """
    class Sleeper(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.emb = nn.Embedding(v, 8)
            self.later = nn.LazyLinear(10)

        def forward(self, tokens):
            return self.emb(tokens) @ self.emb.weight.T


    def build_model(ctx):
        return Sleeper(ctx.vocab_size)
    """
    report = gate(bundle(tmp_path, src))
    assert report.param_count is None
    (f,) = report.findings
    assert f.rule == "prism:param-lazy" and "later.weight" in f.message


@pytest.mark.parametrize(
    "body,needle",
    [
        ('raise ValueError("no model for you")', "ValueError: no model for you"),
        ("return 3", "returned int, not a torch.nn.Module"),
        ("return nn.Linear(3, 3)", "RuntimeError"),  # forward on [1, 8] token ids fails
    ],
)
def test_build_and_forward_failures_are_findings(tmp_path, body, needle):
    report = gate(bundle(tmp_path, f"def build_model(ctx):\n    {body}\n"))
    assert report.param_count is None
    (f,) = report.findings
    assert f.rule == "prism:build-error" and needle in f.message, f.message


def test_time_limit(tmp_path):
    src = "def build_model(ctx):\n    while True:\n        pass\n"
    report = gate(bundle(tmp_path, src), param_timeout_s=5.0)
    assert [f.rule for f in report.findings] == ["prism:build-timeout"]
    assert report.param_count is None


def test_memory_limit(tmp_path):
    src = "def build_model(ctx):\n    return nn.Linear(1 << 16, 1 << 15)\n"  # 8 GiB of float32
    report = gate(bundle(tmp_path, src), param_memory_bytes=3 << 30)
    assert [f.rule for f in report.findings] == ["prism:build-memory"]


def test_bundle_output_cannot_fake_the_result(tmp_path):
    src = TIED.replace("TIE", "True").replace(
        "def build_model(ctx):", 'def build_model(ctx):\n    print(\'{"ok": true, "count": 1}\')'
    )
    report = gate(bundle(tmp_path, src))
    assert report.param_count == V * 8 + 2 * 8


def test_planted_bytecode_is_not_loaded(tmp_path):
    root = bundle(tmp_path, TIED.replace("TIE", "True"))
    fake = tmp_path / "fake.py"
    fake.write_text("from torch import nn\n\ndef build_model(ctx):\n    return nn.Linear(1, 1)\n")
    tag = sys.implementation.cache_tag
    py_compile.compile(
        str(fake),
        cfile=str(root / "__pycache__" / f"architecture.{tag}.pyc"),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    with pytest.raises(BundleError) as err:  # intake refuses a bundle that ships bytecode ...
        gate(root)
    assert err.value.rule == "prism:bytecode"
    # ... and bytecode planted after intake is never loaded by the child: it reads the source
    found, count = parameter_gate(load_bundle(root), vocab_size=V)
    assert (found, count) == ([], V * 8 + 2 * 8)  # not the planted .pyc's 2 elements


def test_child_is_not_started_when_the_sandbox_blocks(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("bundle code must not run")

    monkeypatch.setattr(param_parent, "measure_parameters", boom)
    report = gate(bundle(tmp_path, TIED.replace("TIE", "True") + "\nimport os\n"))
    assert report.param_count is None
    assert [f.rule for f in report.findings] == ["prism:no-process"]


def test_example_count_is_reported_under_the_cap():
    report = run_gates(EXAMPLE)
    assert report.findings == []
    # GPT-2 vocabulary (50257) x 20 tied embedding, 256 x 20 positions, 2 blocks, final norm
    blocks = 2 * (2 * 40 + (20 * 60 + 60) + (20 * 20 + 20) + (20 * 80 + 80) + (80 * 20 + 20))
    assert report.param_count == 50257 * 20 + 256 * 20 + blocks + 40


# --- counting, in process ------------------------------------------------------------------


def test_count_views_and_hidden_storage():
    base = torch.zeros(100)
    m = nn.Module()
    m.a = nn.Parameter(base[:50])
    m.b = nn.Parameter(base[50:])  # same storage as a: counted once, 100 elements
    m.register_buffer("hidden", torch.zeros(1_000_000)[:10])  # a small view of a large storage
    total, params, buffers = count_unique_elements(m)
    assert (total, params, buffers) == (100 + 1_000_000, 100, 1_000_000)


def test_count_rejects_non_modules_and_lists_lazy_names():
    with pytest.raises(TypeError):
        count_unique_elements(torch.zeros(3))
    m = nn.Sequential(nn.LazyLinear(4))
    assert uninitialized(m) == ["0.weight", "0.bias"]
    m(torch.zeros(2, 3))
    assert uninitialized(m) == []
    assert count_unique_elements(m)[0] == 3 * 4 + 4


@pytest.mark.parametrize(
    "hide",
    [
        "self.hidden = [nn.Linear(200, 200)]",  # layers in a plain list are not registered
        "global STASH\n        STASH = nn.Linear(200, 200)",  # a module-level global
        "Stash.table = torch.zeros(200 * 200 + 200)",  # a class attribute
    ],
)
def test_weights_hidden_outside_the_module_tree_still_count(tmp_path, hide):
    src = f"""
    STASH = None


    class Stash:
        pass


    class M(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.emb = nn.Embedding(v, 8)
            {hide}

        def forward(self, tokens):
            return self.emb(tokens) @ self.emb.weight.T


    def build_model(ctx):
        return M(ctx.vocab_size)
    """
    report = gate(bundle(tmp_path, src))
    assert report.findings == []
    assert report.param_count == V * 8 + 200 * 200 + 200


def test_count_ignores_overridden_accessors():
    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Linear(100, 100)

        def named_parameters(self, *a, **k):  # hides everything from the usual accessors
            return iter(())

    assert count_unique_elements(Sneaky())[0] == 100 * 100 + 100


def test_tensors_held_in_plain_objects_closures_and_optimizers_are_counted():
    import torch
    from torch import nn

    class Bank:  # a plain object, not a Module
        def __init__(self):
            self.rows = [torch.zeros(10) for _ in range(30)]  # 300, one storage per row

    class Slotted:
        __slots__ = ("w",)

        def __init__(self):
            self.w = torch.zeros(7)

    def make(table):
        return lambda tokens: table[tokens]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 3)  # 6 + 3
            self.bank = Bank()
            self.slot = Slotted()
            self.lookup = make(torch.zeros(11))  # in a closure
            self.opt = torch.optim.Adam(self.lin.parameters())  # its params only, never its state

    m = Model()
    m.lin(torch.zeros(1, 2)).sum().backward()
    m.opt.step()  # Adam state: 2 x 9 more elements, not capacity
    assert count_unique_elements(m)[0] == 9 + 300 + 7 + 11


def test_a_model_reaching_too_many_objects_is_refused_not_walked_forever(monkeypatch):
    import pytest
    import torch

    from prism_challenge.gates import param_count

    monkeypatch.setattr(param_count, "MAX_WALK_OBJECTS", 1000)
    m = torch.nn.Linear(2, 2)
    m.junk = [[i] for i in range(1200)]  # 1,200 small lists (their ints are scalars, not counted)
    with pytest.raises(param_count.ObjectGraphTooLarge, match="more than 1,000 objects"):
        count_unique_elements(m)


def test_a_failure_is_placed_at_the_bundle_line_that_raised(tmp_path):
    """The finding names the innermost frame in the bundle's own files: the forward's raise in a
    helper module, the raise inside build_model, and the def line when torch itself raised."""
    root = bundle(tmp_path, """
    from blocks import Net


    def build_model(ctx):
        return Net(ctx.vocab_size)
    """)
    (root / "blocks.py").write_text("from torch import nn\n\n\nclass Net(nn.Module):\n"
                                    "    def __init__(self, v):\n        super().__init__()\n"
                                    "        self.emb = nn.Embedding(v, 8)\n\n"
                                    "    def forward(self, tokens):\n"
                                    "        raise ValueError('no forward today')\n", encoding="utf-8")
    (f,) = gate(root).findings
    assert (f.rule, f.file, f.line) == ("prism:build-error", "blocks.py", 10)
    assert f.message == ("the first forward pass (model(tokens), tokens [1, 8], under torch.no_grad()): "
                         "ValueError: no forward today")
    head = HEADER.count("\n")
    (f,) = gate(bundle(tmp_path, "def build_model(ctx):\n    x = 1\n    raise ValueError('no model')\n")).findings
    assert (f.file, f.line, f.message) == ("architecture.py", head + 3, "build_model(ctx): ValueError: no model")
    (f,) = gate(bundle(tmp_path, "\ndef build_model(ctx):\n    return nn.Linear(3, 3)\n")).findings
    assert (f.file, f.line) == ("architecture.py", head + 2)  # raised inside torch, called from harness code


def test_a_childs_place_is_checked_before_it_is_believed(tmp_path):
    from prism_challenge.gates.core import raised_at

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.py").write_text("x = 1\n")
    assert raised_at(tmp_path, {"file": "sub/m.py", "line": 7}, "architecture.py", 3) == ("sub/m.py", 7)
    for bad in [{"file": "/etc/passwd", "line": 1}, {"file": "../x.py", "line": 1}, {"file": "sub", "line": 1},
                {"file": "sub/m.py", "line": 0}, {"file": "sub/m.py", "line": True}, {"file": "sub/m.py", "line": "7"},
                {"file": 5, "line": 7}, {"file": "", "line": 7}, {"file": "nope.py", "line": 2}, {}]:
        assert raised_at(tmp_path, bad, "architecture.py", 3) == ("architecture.py", 3), bad
