"""The gate's reproducibility rules: no wall clock or profiler, no iteration in set order."""

from __future__ import annotations

import pytest

from prism_challenge.gates import RULES
from test_gates_sandbox import scan

HEAD = "import torch\nfrom torch import nn\n\n"


def findings(body: str) -> list[tuple[str, int]]:
    """(rule, line) of every finding of ``architecture.py`` = HEAD + body (body's lines start at 4)."""
    _, found = scan({"architecture.py": HEAD + body})
    return sorted((f.rule, f.line) for f in found)


@pytest.mark.parametrize("line", [
    "import time",
    "from time import perf_counter",
    "import datetime",
    "from datetime import datetime",
    "import timeit",
    "import torch.profiler",
    "from torch.profiler import profile",
    "from torch.autograd.profiler import record_function",
    "from torch.autograd import profiler",
])
def test_wall_clock_and_profiler_imports_are_refused(line):
    assert findings(line + "\n") == [("prism:wall-clock", 4)]


@pytest.mark.parametrize("expr", [
    "torch.profiler.profile()",
    "torch.autograd.profiler.profile()",
    "torch.cuda.Event(enable_timing=True)",
    "torch.Event()",
])
def test_wall_clock_and_profiler_paths_are_refused(expr):
    assert findings(f"def f():\n    return {expr}\n") == [("prism:wall-clock", 5)]


@pytest.mark.parametrize("body, line", [
    ("def f(m):\n    return torch.optim.AdamW(set(m.parameters()))\n", 5),
    ("def f(m):\n    return torch.optim.SGD({*m.parameters()}, lr=0.1)\n", 5),
    ("def f(m):\n    ps = set(m.parameters())\n    for p in ps:\n        p.grad = None\n", 6),
    ("def f(m):\n    ps = frozenset(m.modules())\n    return [p for p in ps]\n", 6),
    ("def f(m):\n    ps = {p for p in m.parameters()}\n    return list(ps)\n", 6),
    ("def f(m):\n    ps = set(m.parameters())\n    return sum(p.sum() for p in ps)\n", 6),
    ("def f(m):\n    ps = set(m.parameters())\n    return (*ps,)\n", 6),
    ("def f(m):\n    ps = set(m.parameters())\n    return ps.pop()\n", 6),
    ("def f(m):\n    ps = set()\n    ps.add(m)\n    yield from ps\n", 7),
    ("def f(m, extra):\n    ps = set(m.parameters()) | set(extra)\n    return enumerate(ps)\n", 6),
    ("def f(m, d):\n    rest = d.keys() - set(m.parameters())\n    for k in rest:\n        pass\n", 6),
    ("def f(m):\n    a = set(m.parameters())\n    return tuple(a.union([m]))\n", 6),
    ("class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.seen = set()\n"
     "    def g(self):\n        return [x for x in self.seen]\n", 9),
])
def test_order_dependent_uses_of_a_set_are_refused_on_their_line(body, line):
    assert findings(body) == [("prism:set-order", line)]


@pytest.mark.parametrize("body", [
    # minGPT-style weight-decay split: sets of names, checked with algebra, iterated sorted
    "def f(m):\n    decay = set()\n    no_decay = set()\n    for n, p in m.named_parameters():\n"
    "        (decay if p.dim() >= 2 else no_decay).add(n)\n    assert len(decay & no_decay) == 0\n"
    "    params = dict(m.named_parameters())\n    return [params[n] for n in sorted(decay)]\n",
    "def f(m, p):\n    ps = set(m.parameters())\n    return p in ps and len(ps) > 1 and bool(ps)\n",
    "def f(m):\n    ps = set(m.parameters())\n    ps.update(m.buffers())\n    return ps.issubset(set(m.parameters()))\n",
    "def f(x):\n    for k in {'a', 'b', 3}:\n        x = x + 1\n    return x\n",
    "def f(m):\n    return list(m.parameters()) + [p for p in m.buffers()]\n",
    "def f(m):\n    groups = {}\n    for p in m.parameters():\n        groups.setdefault(p.dim(), []).append(p)\n    return [groups[k] for k in sorted(groups)]\n",
])
def test_order_free_uses_and_lists_pass(body):
    assert findings(body) == []


def test_rules_are_described():
    assert "set" in RULES["prism:set-order"] and "time" in RULES["prism:wall-clock"]


@pytest.mark.parametrize("expr", [
    "sorted(list(s))", "sorted(tuple(s))", "len(list(s))", "set(tuple(s))", "sorted(list(tuple(s)))",
    "sorted(list(s), reverse=True)", "bool(list(s))", "sorted(s)", "len(s)", "m in s",
])
def test_an_order_free_wrapper_around_a_copy_of_a_set_passes(expr):
    # minGPT: [param_dict[pn] for pn in sorted(list(decay))]
    assert findings(f"def f(m):\n    s = set(m.parameters())\n    return {expr}\n") == []


@pytest.mark.parametrize("expr", [
    "list(s)", "tuple(s)", "[p for p in s]", "sorted([p for p in s])", "sorted(s, key=lambda p: p.numel())",
    "sorted(list(s), key=lambda p: p.numel())", "enumerate(list(s))", "sum(list(s))", "max(s)",
])
def test_a_copy_of_a_set_whose_order_is_seen_is_refused(expr):
    assert findings(f"def f(m):\n    s = set(m.parameters())\n    return {expr}\n") == [("prism:set-order", 6)]


ASSERTED = ("def f(m, names):\n    decay = set(names)\n"
            "    assert not decay & {'x'}, 'both: %s' % (str(decay & {'x'}),)\n    return sorted(decay)\n")


def test_a_set_in_an_assert_message_passes_unless_the_module_catches_assertion_errors():
    assert findings(ASSERTED) == []  # the message is built only when the run ends with the error
    catch = "def g():\n    try:\n        pass\n    except {}:\n        pass\n"
    assert findings(ASSERTED + catch.format("ValueError")) == []
    for kind in ("AssertionError", "Exception", "(KeyError, BaseException)", "ERRORS"):
        assert findings(ASSERTED + catch.format(kind)) == [("prism:set-order", 6)], kind
    assert findings(ASSERTED + "def g():\n    try:\n        pass\n    except:\n        pass\n") == [("prism:set-order", 6)]


def test_a_set_in_an_assert_message_is_refused_when_another_module_or_a_context_manager_may_see_the_error():
    _, found = scan({"architecture.py": HEAD + ASSERTED,
                     "training.py": "def train(ctx):\n    try:\n        pass\n    except Exception:\n        pass\n"})
    assert [(f.rule, f.file, f.line) for f in found] == [("prism:set-order", "architecture.py", 6)]
    swallow = "class Quiet:\n    def __enter__(self):\n        return self\n    def __exit__(self, *exc):\n        return True\n"
    assert findings(ASSERTED + swallow) == [("prism:set-order", 6)]


@pytest.mark.parametrize("swallower", [
    # red team F3: an error raised in a generator's finally as the generator is collected is ignored
    "def g():\n    try:\n        yield 1\n    finally:\n        pass\n",
    "def g(cm):\n    with cm:\n        yield 1\n",
    "class K:\n    def __del__(self):\n        pass\n",
])
def test_a_set_in_an_assert_message_is_refused_where_python_ignores_what_is_raised(swallower):
    assert ("prism:set-order", 6) in findings(ASSERTED + swallower)  # (a __del__ is refused on its own too)
    assert findings(ASSERTED + "def g():\n    yield 1\n") == []  # a generator with nothing run at collection
