"""Probe every allowed callable under an audit hook (run as a script by test_gates_allowlist_audit).

For every module and path on ``gates/allowlist.toml`` (resolved on the real modules) and every
attribute name on it (resolved on representative objects: a tensor, a parameter, a module, an
optimizer, a scheduler, builtin values), this process:

1. scans the Python source of each Python-level callable (docstrings and comments dropped) for
   calls that load libraries, open paths or sockets, or start processes;
2. installs a ``sys.addaudithook`` hook, then calls each callable with a few dummy argument
   patterns and records every audit event that opens a file, loads a library, opens a socket,
   starts a process or a thread, or imports a module that was not imported yet (after a
   warm-up that makes the first calls which import torch's own lazy modules, see _warm_up).

It prints one JSON object: ``resolved`` (callables), ``calls``, ``canary`` (the events a
deliberate ``open`` and a new import raised: proof the hook works), ``source_hits`` and
``events``.
"""

from __future__ import annotations

import ast
import collections
import importlib
import inspect
import json
import os
import re
import signal
import sys
import textwrap
import traceback
import warnings

EXEMPT = {
    "torch.save": "writes the path it is given: allowed only on ctx.artifacts_dir paths (prism:torch-io)",
    "torch.load": "reads the path it is given: allowed only on ctx.artifacts_dir paths (prism:torch-io)",
}
"""The only allowed callables that take a path by design; neither scanned nor called."""

SOURCE_PATTERN = re.compile(
    r"\bopen\(|ctypes|CDLL|load_library|subprocess|\bsocket\b|os\.system|Popen|dlopen|os\.exec|os\.fork|"
    r"os\.spawn|posix_spawn"
)
"""Calls the source scan refuses (in code, not docstrings)."""

DYNAMIC_IMPORTS = frozenset({"import_module", "__import__"})
"""Dynamic imports: refused in the scanned source unless they name a ``torch.`` module literally."""
WATCHED = ("open", "ctypes.", "socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn",
           "os.fork", "os.forkpty", "os.spawn", "os.startfile", "_thread.start_new_thread", "import")
PATTERNS = ("()", "(t,)", "(t, u)", "(2,)", "(t, 2)", "(2, 3)")


def _args(pattern: str):
    import torch

    gen = torch.Generator().manual_seed(0)
    t = torch.rand(2, 3, generator=gen)
    u = torch.rand(2, 3, generator=gen)
    return eval(pattern, {"t": t, "u": u})  # noqa: S307 - the probe's own fixed patterns


def _samples():
    import torch
    from torch import nn

    def optimizer():
        return torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)

    def scheduler():
        return torch.optim.lr_scheduler.LambdaLR(optimizer(), lambda step: 1.0)

    return {
        "tensor": lambda: torch.rand(2, 3),
        "parameter": lambda: nn.Parameter(torch.rand(2, 3)),
        "module": lambda: nn.Linear(3, 3),
        "optimizer": optimizer,
        "scheduler": scheduler,
        "dtype": lambda: torch.float32,
        "device": lambda: torch.device("cpu"),
        "finfo": lambda: torch.finfo(torch.float32),
        "str": lambda: "a b,c",
        "bytes": lambda: b"ab",
        "int": lambda: 3,
        "float": lambda: 1.5,
        "list": lambda: [1, 2],
        "tuple": lambda: (1, 2),
        "dict": lambda: {"a": 1},
        "set": lambda: {1, 2},
        "deque": lambda: collections.deque([1, 2]),
        "counter": lambda: collections.Counter("aab"),
        "slice": lambda: slice(1, 2),
    }


def _resolve(path: str):
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


def _source_hits(name: str, obj) -> list[str]:
    target = getattr(obj, "__func__", obj)
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        return []
    try:
        src = textwrap.dedent(inspect.getsource(target))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError):
        return []
    for node in ast.walk(tree):  # drop docstrings: their examples are not code
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
            getattr(body[0], "value", None), ast.Constant
        ) and isinstance(body[0].value.value, str):
            body[0].value.value = ""
    code = ast.unparse(tree)
    hits = [f"{name}: source mentions {m!r}" for m in sorted(set(SOURCE_PATTERN.findall(code)))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            first = node.args[0] if node.args else None
            literal = isinstance(first, ast.Constant) and str(first.value).startswith("torch.")
            if fname in DYNAMIC_IMPORTS and not literal:
                hits.append(f"{name}: source calls {fname} with a computed module name")
    return hits


def _warm_up() -> None:
    """First calls that import trusted torch modules lazily, made before the hook (a loop that
    uses these pays the same imports): ``torch.compile`` imports its compiler stack and reads
    installed packages' entry points for named backends; the first optimizer step imports a
    profiler helper; printing a tensor and ``Tensor.index`` (first-class dims) import theirs;
    ``torch.manual_seed`` reads its own source once torch._dynamo is loaded."""
    import functorch.dim  # noqa: F401
    import functorch.dim._getsetitem  # noqa: F401
    import torch
    from torch import nn

    torch.manual_seed(0)
    str(torch.rand(2))
    layer = nn.Linear(2, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.rand(1, 2)).sum().backward()
    opt.step()
    torch.compile(lambda x: x)


class _Timeout(Exception):
    pass


def _new_modules(known: set[str], events: list[dict], current: dict) -> None:
    """Record modules that appeared in ``sys.modules`` since the last look (``importlib.
    import_module`` raises no ``import`` audit event; the ``import`` statement does)."""
    if len(sys.modules) == current.get("modules"):
        return
    current["modules"] = len(sys.modules)
    for name in sorted(set(sys.modules) - known):
        known.add(name)
        events.append({"callable": current["name"], "args": current["pattern"], "event": "import",
                       "detail": repr((name, None)), "stack": []})


def main() -> None:
    warnings.simplefilter("ignore")
    sys.path.insert(0, sys.argv[1])
    from prism_challenge.gates.allowlist import load_allowlist

    import torch

    al = load_allowlist()
    for mod in sorted(al.modules):
        importlib.import_module(mod)
    _warm_up()
    callables: list[tuple[str, object]] = []
    for path in sorted(al.modules | al.paths):
        if path in EXEMPT:
            continue
        obj = _resolve(path)
        if callable(obj):
            callables.append((path, obj))
    samples = _samples()
    for attr in sorted(al.attrs):
        for kind, make in samples.items():
            try:
                obj = getattr(make(), attr, None)
            except Exception:  # noqa: BLE001 - a property that refuses this sample
                continue
            if callable(obj):
                callables.append((f"<{kind}>.{attr}", (make, attr)))
    hits: list[str] = []
    for name, obj in callables:
        if isinstance(obj, tuple):
            obj = getattr(obj[0](), obj[1])
        hits.extend(_source_hits(name, obj))

    events: list[dict] = []
    current = {"name": "", "pattern": ""}
    known = set(sys.modules)

    def hook(event: str, args: tuple) -> None:
        if not event.startswith(WATCHED):
            return
        if event == "import":
            if args[0] in known or args[0] in sys.modules:
                return
            known.add(args[0])
        if event == "open" and isinstance(args[0], int):
            return  # os.fdopen on an already open descriptor
        frames = traceback.StackSummary.extract(traceback.walk_stack(None), limit=8, lookup_lines=False)
        where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}:{f.name}" for f in frames]
        if event == "open" and any(w.startswith("linecache.py:") for w in where):
            return  # source lines of the frames on the stack, for a traceback (torch.cuda's lazy calls)
        events.append({"callable": current["name"], "args": current["pattern"], "event": event,
                       "detail": repr(args[:2])[:200], "stack": where})

    def alarm(signum, frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, alarm)
    devnull = open(os.devnull, "w")
    sys.addaudithook(hook)
    current["name"] = "<canary>"  # the hook sees what it is after: a file opened, a new import
    open(os.devnull).close()
    importlib.import_module(next(m for m in ("colorsys", "tabnanny", "pyclbr", "wave") if m not in sys.modules))
    _new_modules(known, events, current)
    canary = sorted({e["event"] for e in events if e["callable"] == "<canary>"})
    events.clear()
    calls = 0
    real_stdout, sys.stdout = sys.stdout, devnull  # print() and friends are called too
    for name, obj in callables:
        for pattern in PATTERNS:
            args = _args(pattern)
            target = getattr(obj[0](), obj[1]) if isinstance(obj, tuple) else obj
            current["name"], current["pattern"] = name, pattern
            signal.setitimer(signal.ITIMER_REAL, 10)
            try:
                target(*args)
            except _Timeout:
                events.append({"callable": name, "args": pattern, "event": "timeout", "detail": ""})
            except BaseException:  # noqa: BLE001 - dummy arguments: most calls raise
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            _new_modules(known, events, current)
            calls += 1
    current["name"] = ""
    sys.stdout = real_stdout
    print(json.dumps({"resolved": len(callables), "calls": calls, "canary": canary, "source_hits": hits,
                      "events": events}))


if __name__ == "__main__":
    main()
