"""The sandbox's checks of calls.

Calling the context's type, ``getattr``/``setattr``/``delattr``/``hasattr`` with a literal name
(judged like the attribute), ``type(name, bases, ns)``, ``dataclasses.field`` outside a class
body, ``torch.compile``'s backend and options, ``update_wrapper``/``wraps`` with names of one's own,
``DataLoader`` worker processes, and ``torch.load``/``torch.save`` on a path the gate cannot prove
is inside ``ctx.artifacts_dir`` (:func:`prism_challenge.gates.ctxpath.artifacts_path`).
"""

from __future__ import annotations

import ast

from prism_challenge.gates.astindex import CTX, TYPE
from prism_challenge.gates.ctxpath import artifacts_path
from prism_challenge.gates.policy import (
    COMPILE_BACKENDS,
    CTX_FORGE,
    DATALOADERS,
    DYN,
    DYN_ATTR,
    PATCH,
    PICKLE,
    PROC,
    TORCH_IO,
    TORCH_SAVES,
    WRAPPER_CALLS,
)
from prism_challenge.gates.qualnames import _live_class_kind


class CallChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: calls.

    Its host's contract is in :class:`~prism_challenge.gates.sandbox.Checker`'s docstring."""

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


def _arg(call: ast.Call, pos: int, name: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if pos < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: pos + 1]):
        return call.args[pos]
    return None
