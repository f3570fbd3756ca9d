"""The multi-GPU contract over the training entrypoint (and the bundle modules it imports).

At world size > 1 a training loop must:

* initialize the process group (``init_process_group``) -> else ``prism:ddp-init``;
* wrap the model in ``DistributedDataParallel`` -> else ``prism:ddp-wrap`` (FSDP, ``fully_shard``
  and DTensor are refused by the sandbox gate as ``prism:sharded-model``);
* (not required: the harness shards the stream itself, each rank gets its slice of every
  global batch from ``ctx.iter_train_batches``, so no sampler is needed and none is asked for);
* guard every write (``torch.save`` and friends) with a rank-0 test: the write sits under
  ``if <rank> == 0`` / ``if not <rank>`` (an ``and`` with other tests is fine), in the ``else``
  of ``if <rank> != 0``, after an early ``if <rank> != 0: return``, or in a function every call
  of which is so guarded -> else ``prism:ddp-rank0-write`` at the write;
* destroy the process group (``destroy_process_group``) -> else ``prism:ddp-destroy``.

``<rank>`` is a name or attribute called ``rank``/``global_rank``/``local_rank`` or a
``get_rank()`` call. Requests for more than :data:`MAX_PROCS` processes or more than one node
are ``prism:launch-limit``, as is an ``init_process_group`` that asks for a larger world, a
non-``env://`` rendezvous or its own store.
"""

from __future__ import annotations

import ast

from prism_challenge.gates.astindex import BundleIndex
from prism_challenge.gates.ctxpath import may_call
from prism_challenge.gates.findings import Finding
from prism_challenge.gates.policy import TORCH_SAVES
from prism_challenge.gates.scopes import ModuleInfo

MAX_PROCS = 8
"""Most processes (GPUs) one run may ask for; always a single node."""

_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "fully_shard")  # the last two: prism:sharded-model
_RANK_NAMES = frozenset({"rank", "global_rank", "local_rank"})
_WORLD_NAMES = frozenset({"world_size", "num_replicas"})


def launch_findings(nproc: int, nnodes: int) -> list[Finding]:
    """``prism:launch-limit`` findings for a launch request.

    Raises:
        ValueError: ``nproc`` or ``nnodes`` below 1.
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be >= 1, got {nproc} and {nnodes}")
    out = []
    if nproc > MAX_PROCS:
        out.append(
            Finding("prism:launch-limit", "", 0, 0, f"{nproc} processes requested; at most {MAX_PROCS}")
        )
    if nnodes > 1:
        out.append(Finding("prism:launch-limit", "", 0, 0, f"{nnodes} nodes requested; one node only"))
    return out


def reachable_modules(index: BundleIndex, start: str) -> list[ModuleInfo]:
    """``start`` and every bundle module it imports, transitively (sorted by path)."""
    seen: dict[str, ModuleInfo] = {}
    todo = [start]
    while todo:
        name = todo.pop()
        info = index.modules.get(name)
        if info is None or name in seen:
            continue
        seen[name] = info
        for q in _imported_names(info):
            parts = q.split(".")
            for i in range(len(parts), 0, -1):
                prefix = ".".join(parts[:i])
                if prefix in index.modules:
                    todo.append(prefix)
                    break
    return sorted(seen.values(), key=lambda m: m.rel)


def _imported_names(info: ModuleInfo) -> list[str]:
    out = []
    for scope_bindings in _all_bindings(info):
        for b in scope_bindings:
            if b[0] == "import":
                out.append(b[1])
    return out


def _all_bindings(info: ModuleInfo):
    seen = set()
    for scope in info.scope_of.values():
        if id(scope) in seen:
            continue
        seen.add(id(scope))
        for bindings in scope.bindings.values():
            yield bindings


class _Facts:
    def __init__(self) -> None:
        self.init = self.wrap = self.destroy = False
        self.writes: list[tuple[ModuleInfo, ast.Call, str]] = []
        self.launch: list[Finding] = []


def check_contract(
    index: BundleIndex, training_module: str, training_file: str, symbol: str, blocking: bool
) -> list[Finding]:
    """The multi-GPU contract findings for the training entrypoint.

    Args:
        index: the indexed bundle.
        training_module: dotted name of the training entrypoint module.
        training_file: its bundle-relative path (where whole-file findings point).
        symbol: the training entrypoint function (whole-file findings point at its ``def``).
        blocking: whether ``ddp-*`` findings block (``nproc > 1``) or are advisories.
            ``launch-limit`` findings from the source always block.
    """
    facts = _Facts()
    modules = reachable_modules(index, training_module)
    for info in modules:
        _collect(index, info, facts)
    for info in sorted(index.modules.values(), key=lambda m: m.rel):  # every module may launch
        _launch_requests(index, info, facts)
    anchor_line = 0
    main = index.modules.get(training_module)
    if main is not None:
        for stmt in main.tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == symbol:
                anchor_line = stmt.lineno
    out = list(facts.launch)

    def missing(rule: str, message: str) -> None:
        out.append(Finding(rule, training_file, anchor_line, 0, message, blocking))

    if not facts.init:
        missing("prism:ddp-init", "never calls init_process_group (needed at world size > 1)")
    if not facts.wrap:
        missing("prism:ddp-wrap", "never wraps the model in DistributedDataParallel (at world size > 1 "
                                  "the ranks' states must stay identical)")
    if not facts.destroy:
        missing("prism:ddp-destroy", "never calls destroy_process_group")
    guard_cache: dict[int, bool] = {}
    for info, call, q in facts.writes:
        if not _guarded(index, modules, info, call, guard_cache, 0):
            line, col = info.position(call)
            out.append(
                Finding("prism:ddp-rank0-write", info.rel, line, col, f"{q} is not guarded by a rank-0 test", blocking)
            )
    return out


def _names_of(index: BundleIndex, info: ModuleInfo, node: ast.AST) -> set[str]:
    """Last components a reference may stand for: its own name plus resolved qualnames."""
    out = set()
    if isinstance(node, ast.Name):
        out.add(node.id)
    elif isinstance(node, ast.Attribute):
        out.add(node.attr)
    else:
        return out
    for q in index.canonical(index.resolve(node, info.scope_for(node))):
        out.add(q.rsplit(".", 1)[-1])
    return out


def _collect(index: BundleIndex, info: ModuleInfo, facts: _Facts) -> None:
    for node in info.walk():
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            names = _names_of(index, info, node)
            facts.init |= "init_process_group" in names
            facts.destroy |= "destroy_process_group" in names
            facts.wrap |= any(w in names for w in _WRAPPERS)
        if isinstance(node, ast.Call):
            qs = index.canonical(index.resolve(node.func, info.scope_for(node)))
            for q in sorted(qs & TORCH_SAVES):
                facts.writes.append((info, node, q))
                break


def _launch_requests(index: BundleIndex, info: ModuleInfo, facts: _Facts) -> None:
    """``launch-limit`` findings of every ``init_process_group`` call in ``info``, and of every
    reference to it that is not a direct call (an alias or ``partial`` would hide its arguments)."""
    for node in info.walk():
        if isinstance(node, ast.Call) and "init_process_group" in _names_of(index, info, node.func):
            _launch_request(info, node, facts)
        elif (
            isinstance(node, (ast.Name, ast.Attribute))
            and isinstance(node.ctx, ast.Load)
            and "init_process_group" in _names_of(index, info, node)
        ):
            parent = info.parents.get(id(node))
            if not (isinstance(parent, ast.Call) and parent.func is node):
                line, col = info.position(node)
                facts.launch.append(
                    Finding("prism:launch-limit", info.rel, line, col, "init_process_group referenced without calling it directly (its arguments are checked at the call)")
                )


def _launch_request(info: ModuleInfo, call: ast.Call, facts: _Facts) -> None:
    line, col = info.position(call)
    if len(call.args) > 1 or any(isinstance(a, ast.Starred) for a in call.args) or any(
        kw.arg is None for kw in call.keywords
    ):
        facts.launch.append(
            Finding("prism:launch-limit", info.rel, line, col, "init_process_group with positional or ** arguments past the backend; pass keywords")
        )
    for kw in call.keywords:
        v = kw.value
        if kw.arg == "world_size" and isinstance(v, ast.Constant) and isinstance(v.value, int):
            if v.value > MAX_PROCS:
                facts.launch.append(
                    Finding("prism:launch-limit", info.rel, line, col, f"init_process_group asks for world_size={v.value}; at most {MAX_PROCS}")
                )
        elif kw.arg == "init_method":
            if not (isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith("env://")):
                facts.launch.append(
                    Finding("prism:launch-limit", info.rel, line, col, "init_process_group with its own init_method; only the launcher's env:// rendezvous")
                )
        elif kw.arg == "store":
            facts.launch.append(
                Finding("prism:launch-limit", info.rel, line, col, "init_process_group with its own store; only the launcher's rendezvous")
            )


def _mentions(node: ast.AST | None, names: frozenset[str]) -> bool:
    if node is None:
        return False
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in names:
            return True
        if isinstance(n, ast.Attribute) and n.attr in names:
            return True
        if isinstance(n, ast.Call):
            f = n.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if fname in {f"get_{x}" for x in names}:
                return True
    return False


def _is_rank(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _RANK_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in _RANK_NAMES
    if isinstance(node, ast.Call):
        f = node.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return fname == "get_rank"
    return False


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _rank_cmp(test: ast.AST, ops: tuple[type, ...]) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ops)):
        return False
    a, b = test.left, test.comparators[0]
    return (_is_rank(a) and _is_zero(b)) or (_is_zero(a) and _is_rank(b))


def _rank0_true(test: ast.AST) -> bool:
    """Whether ``test`` being true implies rank 0."""
    if _rank_cmp(test, (ast.Eq, ast.Is)):
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _is_rank(test.operand) or _rank0_false(test.operand)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_rank0_true(v) for v in test.values)
    return False


def _rank0_false(test: ast.AST) -> bool:
    """Whether ``test`` being false implies rank 0."""
    if _rank_cmp(test, (ast.NotEq, ast.Gt, ast.IsNot)):
        return True
    if _is_rank(test):
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _rank0_true(test.operand)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return any(_rank0_false(v) for v in test.values)
    return False


def _exits(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue))


def _guarded(
    index: BundleIndex,
    modules: list[ModuleInfo],
    info: ModuleInfo,
    node: ast.AST,
    cache: dict[int, bool],
    depth: int,
) -> bool:
    child: ast.AST = node
    parent = info.parents.get(id(child))
    while parent is not None:
        if isinstance(parent, ast.If):
            if child in parent.body and _rank0_true(parent.test):
                return True
            if child in parent.orelse and _rank0_false(parent.test):
                return True
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.For, ast.While, ast.With, ast.Try, ast.Module, ast.If)):
            for body in _bodies(parent):
                if child in body:
                    for stmt in body[: body.index(child)]:
                        if isinstance(stmt, ast.If) and _rank0_false(stmt.test) and _exits(stmt.body):
                            return True
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _calls_guarded(index, modules, parent, cache, depth)
        if isinstance(parent, ast.Lambda):
            return False
        child, parent = parent, info.parents.get(id(parent))
    return False


def _bodies(node: ast.AST) -> list[list[ast.stmt]]:
    out = []
    for name in ("body", "orelse", "finalbody"):
        b = getattr(node, name, None)
        if isinstance(b, list):
            out.append(b)
    for h in getattr(node, "handlers", []):
        out.append(h.body)
    return out


def _calls_guarded(
    index: BundleIndex,
    modules: list[ModuleInfo],
    fn: ast.FunctionDef | ast.AsyncFunctionDef,
    cache: dict[int, bool],
    depth: int,
) -> bool:
    if id(fn) in cache:
        return cache[id(fn)]
    if depth > 4:
        return False
    cache[id(fn)] = False  # recursion: not guarded unless proven
    sites = [
        (c, m) for c, m in index.calls.get(fn.name, ()) if m in modules and may_call(index, fn, c, m)
    ]
    result = bool(sites) and all(_guarded(index, modules, m, c, cache, depth + 1) for c, m in sites)
    cache[id(fn)] = result
    return result

