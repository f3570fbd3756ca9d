"""Parameter count in a bounded child process: ``python -m prism_challenge.gates.param_count``.

The parent (:func:`~prism_challenge.gates.param_parent.measure_parameters`) starts this module
in the run's jail (a wall-clock limit, the jail's memory limit, its own session so the whole
process group is killed on timeout) as ``python -s -m prism_challenge.gates.param_count --stdin``:
it imports torch and the harness modules it needs (:data:`PRELOADED`), then reads its arguments,
a JSON list of strings, on stdin's first line, so ``prism eval`` can start it early, as a spare
(:func:`~prism_challenge.gates.param_parent.warm_child`). The child:

1. moves its real stdout aside (bundle prints go to stderr), disables bytecode writing and points
   ``sys.pycache_prefix`` at an empty directory, so stale or planted ``__pycache__`` files in
   the bundle are never loaded;
2. imports the architecture entrypoint from the bundle root, builds a ``PrismContext``, forces
   the seeds and calls ``build_model(ctx)``;
3. runs one forward pass under ``torch.no_grad()`` on a ``[1, 8]`` batch of token ids so lazy
   modules and parameters created on first forward are realized;
4. counts unique storage elements (:func:`count_unique_elements`, plus tensors the bundle's
   own modules hold at module level, :func:`bundle_global_tensors`) and writes one JSON line to
   its real stdout: ``{"ok": true, "count": N, ...}`` or ``{"ok": false, "kind": K,
   "error": "...", "file": F, "line": L}`` with ``K`` in ``import``, ``symbol``, ``build``,
   ``forward``, ``lazy``, ``memory``, ``harness`` (``file`` and ``line``, when the exception's
   traceback passes through the bundle's own files: its innermost frame there,
   :func:`bundle_frame`); then leaves with ``os._exit`` so no bundle finalizer runs.

Only bundles that passed the AST sandbox reach this child.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from prism_challenge.evaluator import childgc
from prism_challenge.evaluator.childexit import exit_child

PARAM_COUNT_SEED = 0
"""Seed forced before ``build_model`` in the child (the count must not depend on it)."""

DUMMY_BATCH = (1, 8)
"""Shape of the token batch of the realizing forward pass."""


MAX_WALK_OBJECTS = 2_000_000
"""Objects :func:`module_tensors` visits at most; a model that holds more is refused."""


class ObjectGraphTooLarge(ValueError):
    """The model's object graph is too large to account for its tensors."""


def storage_key(t: Any) -> tuple[object, int]:
    """(dedup key, elements) of the storage a tensor or numpy array views.

    The key is (device, data pointer); the elements are the storage's bytes over the element
    size, so a small view of a large storage is charged for the whole storage. A complex element
    counts as two (its real and imaginary parts are two trainable numbers). Tensors without a
    data pointer (meta, zero-size, uninitialized) are keyed by identity and count ``numel()``.
    """
    import numpy as np

    if isinstance(t, np.ndarray):
        base = t
        while isinstance(base.base, np.ndarray):
            base = base.base
        per = 2 if base.dtype.kind == "c" else 1
        return ("cpu", base.__array_interface__["data"][0]), base.nbytes // max(base.itemsize, 1) * per
    per = 2 if t.is_complex() else 1
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        elements = storage.nbytes() // max(t.element_size(), 1) * per
    except (RuntimeError, NotImplementedError, TypeError):
        ptr, elements = 0, t.numel() * per
    if not ptr:
        return ("tensor", id(t)), max(elements, t.numel() * per)
    return (str(t.device), ptr), elements


def unique_elements(tensors: list) -> int:
    """Unique storage elements over ``tensors`` (torch tensors or numpy arrays): each storage
    once, charged at its largest element count among the views given (the smallest dtype it
    is read as), see :func:`storage_key`."""
    sizes: dict[object, int] = {}
    for t in tensors:
        key, elements = storage_key(t)
        sizes[key] = max(sizes.get(key, 0), elements)
    return sum(sizes.values())


_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None))


def module_tensors(module: Any) -> tuple[list, list, list]:
    """(parameters, buffers, other tensors) reachable from a model, read from the objects'
    ``__dict__`` and ``__slots__`` (never through attribute hooks the model defines).

    Module trees are read from ``_parameters``, ``_buffers``, ``_modules`` and plain attributes,
    so a module that overrides ``named_parameters`` or keeps layers in a plain list hides
    nothing. Beyond modules the walk enters lists, tuples, sets, dict values, plain objects
    (``self.bank = Bank()`` holding tensors), functions' closures and defaults and bound methods'
    objects; numpy arrays count as other tensors. The harness's own objects (``PrismContext``, a
    reference tokenizer) are not entered. An optimizer contributes only the parameters
    of its ``param_groups`` (its per-parameter state is not model capacity). Classes and
    modules (Python modules) are not entered: module-level tensors are
    :func:`bundle_global_tensors`. Uninitialized (lazy) parameters are included.

    Raises:
        ObjectGraphTooLarge: more than ``MAX_WALK_OBJECTS`` objects are reachable.
    """
    import types

    import numpy as np
    import torch

    from prism_challenge.evaluator.interface import PrismContext
    from prism_challenge.tokenizers import ReferenceTokenizer

    harness = (PrismContext, ReferenceTokenizer)  # the challenge's objects: a tokenizer's byte table is not capacity
    params: list = []
    buffers: list = []
    others: list = []
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(module, 0)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, _SCALARS) or id(obj) in seen or depth > 64:
            continue
        seen.add(id(obj))
        if len(seen) > MAX_WALK_OBJECTS:
            raise ObjectGraphTooLarge(f"the model reaches more than {MAX_WALK_OBJECTS:,} objects; "
                                      "its parameters cannot be accounted for")
        nxt = depth + 1
        if isinstance(obj, torch.nn.Parameter):
            params.append(obj)
        elif isinstance(obj, torch.Tensor):
            others.append(obj)
        elif isinstance(obj, np.ndarray):
            if obj.dtype.kind in "biufc":
                others.append(obj)
        elif isinstance(obj, torch.nn.Module):
            d = object.__getattribute__(obj, "__dict__")
            for slot, out in (("_parameters", params), ("_buffers", buffers)):
                table = d.get(slot)
                if isinstance(table, dict):
                    for t in dict.values(table):
                        if isinstance(t, torch.Tensor):
                            out.append(t)
                            seen.add(id(t))
            for key, value in dict.items(d):
                if key not in ("_parameters", "_buffers"):
                    stack.append((value, nxt))
        elif isinstance(obj, dict):
            stack.extend((v, nxt) for v in dict.values(obj))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, nxt) for v in obj)
        elif isinstance(obj, torch.optim.Optimizer):
            groups = object.__getattribute__(obj, "__dict__").get("param_groups")
            if isinstance(groups, list):
                stack.extend((g.get("params"), nxt) for g in groups if isinstance(g, dict))
        elif isinstance(obj, (types.ModuleType, type, *harness)):
            continue
        elif isinstance(obj, types.FunctionType):
            stack.extend((v, nxt) for v in _function_refs(obj))
        elif isinstance(obj, types.MethodType):
            stack.append((obj.__self__, nxt))
            stack.append((obj.__func__, nxt))
        elif isinstance(obj, functools.partial):
            stack.extend((v, nxt) for v in (obj.func, obj.args, obj.keywords))
        else:
            stack.extend((v, nxt) for v in _instance_values(obj))
    return params, buffers, others


def _instance_values(obj: object) -> list:
    """The values of a plain object's instance ``__dict__`` and ``__slots__`` (no hooks run)."""
    out: list = []
    try:
        d = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        d = None
    if isinstance(d, dict):
        out.extend(dict.values(d))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                try:
                    out.append(object.__getattribute__(obj, name))
                except (AttributeError, TypeError):
                    pass
    return out


def count_unique_elements(module: Any) -> tuple[int, int, int]:
    """Unique storage elements of a module's parameters and buffers: the parameter cap's count.

    Parameters and buffers are found with :func:`module_tensors`: every tensor reachable from
    the model (plain tensor attributes, tensors in plain objects, closures and numpy arrays
    count as buffers). Every tensor is charged for the whole storage it views, once per storage:
    tied weights (one ``Parameter`` registered twice, or two parameters viewing one storage)
    count once, and a small view into a large hidden storage counts the large storage, since
    that memory travels with the model. Storages are keyed by (device, data pointer); tensors
    without a data pointer (meta, zero-size, uninitialized) count their own ``numel()`` each.
    Elements are ``storage bytes // element size`` (the largest such count when tensors of
    different dtypes share a storage; a complex element counts two).

    Returns:
        (unique elements of parameters and buffers together, of parameters, of buffers) — each
        deduplicated on its own; the first is not the sum of the other two when they share.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
        ObjectGraphTooLarge: see :func:`module_tensors`.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    params, buffers, others = module_tensors(module)
    buffers = buffers + others
    return unique_elements(params + buffers), unique_elements(params), unique_elements(buffers)


def bundle_global_tensors(root: Path) -> list:
    """Tensors (and module trees' tensors) held at module level by the bundle's own modules:
    globals, class attributes, function defaults and closures of bundle code. A model that keeps
    weights there instead of in itself still pays for them."""
    import types

    import torch

    root = root.resolve()
    own = []
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if isinstance(mod, types.ModuleType) and f and Path(f).resolve().is_relative_to(root):
            own.append(mod)
    names = {m.__name__ for m in own}
    found: list = []
    seen: set[int] = set()
    stack: list[object] = [vars(m) for m in own]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, torch.nn.Module):
            p, b, o = module_tensors(obj)
            found += p + b + o
        elif isinstance(obj, dict):
            stack.extend(dict.values(obj))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.FunctionType) and obj.__module__ in names:
            stack.extend(_function_refs(obj))
        elif isinstance(obj, type) and obj.__module__ in names:
            stack.extend(vars(obj).values())
        elif isinstance(obj, (staticmethod, classmethod)):
            stack.append(obj.__func__)
    return found


def _function_refs(fn: Any) -> list:
    """What a function holds: its closure cells' contents, defaults and keyword defaults."""
    out = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
    out += list(fn.__defaults__ or ())
    out += list((fn.__kwdefaults__ or {}).values())
    return out


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - empty cells raise
    except ValueError:
        return False
    return True


def uninitialized(module: Any) -> list[str]:
    """Names (``attr.attr`` paths) of parameters and buffers still uninitialized (lazy)."""
    from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

    out = [n for n, p in _named_params(module) if isinstance(p, UninitializedParameter)]
    out += [n for n, b in _named_buffers(module) if isinstance(b, UninitializedBuffer)]
    return out


def _named(module: Any, slot: str, prefix: str = "", seen: set[int] | None = None):
    import torch

    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    d = object.__getattribute__(module, "__dict__")
    table = d.get(slot)
    if isinstance(table, dict):
        for k, v in dict.items(table):
            if v is not None:
                yield prefix + k, v
    subs = d.get("_modules")
    if isinstance(subs, dict):
        for k, sub in dict.items(subs):
            if isinstance(sub, torch.nn.Module):
                yield from _named(sub, slot, f"{prefix}{k}.", seen)


def _named_params(module: Any):
    return _named(module, "_parameters")


def _named_buffers(module: Any):
    return _named(module, "_buffers")


# ---------------------------------------------------------------------------------------------
# child


def _child(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root).resolve()
    started = time.perf_counter()
    try:
        import torch

        from prism_challenge.evaluator.audit import arm
        from prism_challenge.evaluator.interface import PrismContext, run_context
        from prism_challenge.evaluator.seeding import force_seeds, force_source_imports

        force_source_imports(root)  # the source the gates read, never bytecode planted beside it
        sys.path.insert(0, str(root))
        arm(str(root), [args.artifacts_dir], hidden=json.loads(args.hidden))  # before the bundle's first line, for good

        ctx = run_context(json.loads(args.context), rank=0, device="cpu", runtime=None) if args.context else PrismContext(
            seed=args.seed,
            vocab_size=args.vocab_size,
            sequence_length=args.seq_len,
            max_parameters=args.max_parameters,
            device="cpu",
            rank=0,
            local_rank=0,
            world_size=1,
            artifacts_dir=args.artifacts_dir,
            token_budget=None,
            step_budget=None,
            tokenizer_name=args.tokenizer,
        )
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return {"ok": False, "kind": "harness", "error": f"{type(exc).__name__}: {exc}"}
    import importlib

    try:
        mod = importlib.import_module(args.module)
    except MemoryError:
        return {"ok": False, "kind": "memory", "error": "MemoryError while importing"}
    except BaseException as exc:  # noqa: BLE001 - bundle code may raise anything
        return {"ok": False, "kind": "import", "error": _describe(exc), **bundle_frame(exc, root)}
    fn = mod.__dict__.get(args.symbol)
    if not callable(fn):
        return {"ok": False, "kind": "symbol", "error": f"{args.module} has no callable {args.symbol!r}"}
    try:
        force_seeds(args.seed)
        model = fn(ctx)
        if not isinstance(model, torch.nn.Module):
            return {
                "ok": False,
                "kind": "build",
                "error": f"{args.symbol}(ctx) returned {type(model).__name__}, not a torch.nn.Module",
            }
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, "kind": _kind(exc, "build"), "error": _describe(exc), **bundle_frame(exc, root)}
    try:
        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, max(args.vocab_size, 1), DUMMY_BATCH, generator=gen)
        with torch.no_grad():
            model(tokens)
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, "kind": _kind(exc, "forward"), "error": _describe(exc), **bundle_frame(exc, root)}
    lazy = uninitialized(model)
    if lazy:
        return {"ok": False, "kind": "lazy", "error": f"still uninitialized after one forward: {', '.join(lazy[:5])}"}
    try:
        params, buffers, others = module_tensors(model)
    except ObjectGraphTooLarge as exc:
        return {"ok": False, "kind": "build", "error": str(exc)}
    held = bundle_global_tensors(root)
    total = unique_elements(params + buffers + others + held)
    return {
        "ok": True,
        "count": total,
        "parameters": unique_elements(params),
        "buffers": unique_elements(buffers + others),
        "module_level": unique_elements(held),
        "seconds": round(time.perf_counter() - started, 3),
    }


def _kind(exc: BaseException, default: str) -> str:
    text = str(exc).lower()
    if isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text:
        return "memory"
    return default


def bundle_frame(exc: BaseException, root: Path) -> dict[str, Any]:
    """Where in the bundle ``exc`` was raised: ``{"file": path relative to ``root`` (POSIX),
    "line": n}`` for the innermost frame of its traceback in a file under ``root``, or ``{}``
    when no frame is (the error came from the harness or a library called at the top). Reads no
    source file (the frames' lines are not looked up)."""
    import traceback

    frames = traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__), lookup_lines=False)
    for frame in reversed(frames):
        try:
            rel = Path(frame.filename).resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        return {"file": rel.as_posix(), "line": int(frame.lineno or 0)}
    return {}


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


PRELOADED = ("torch", "prism_challenge.evaluator.audit", "prism_challenge.evaluator.interface",
             "prism_challenge.evaluator.seeding")
"""What the stdin mode imports before it reads its arguments (:func:`_preload`): what
:func:`_child` imports first."""


def _preload() -> list[str]:
    """The stdin mode's start: torch and the harness modules :func:`_child` needs, imported
    before the arguments are read (none of them runs submitted code), then the arguments: one
    JSON list of strings on stdin's first line.

    Raises:
        SystemExit: stdin's first line is not a JSON list of strings (argparse's usage error).
    """
    import importlib

    for name in PRELOADED:  # while the parent's gates run
        importlib.import_module(name)

    try:
        argv = json.loads(sys.stdin.readline())
    except ValueError:
        argv = None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise SystemExit("prism_challenge.gates.param_count --stdin: stdin's first line must be a JSON list of strings")
    return argv


def main(argv: list[str] | None = None) -> None:
    """Child entry point; see the module docstring. With ``--stdin`` alone
    (:data:`~prism_challenge.gates.param_parent.CHILD_ARGV_TAIL`)
    the arguments are read from stdin after the imports (:func:`_preload`). Never returns
    (``os._exit``)."""
    childgc.pause()  # until arm() (childgc)
    if argv is None and sys.argv[1:] == ["--stdin"]:
        argv = _preload()
    parser = argparse.ArgumentParser(prog="python -m prism_challenge.gates.param_count")
    parser.add_argument("--root", required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--symbol", required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--max-parameters", type=int, required=True)
    parser.add_argument("--artifacts-dir", required=True)
    parser.add_argument("--context", default=None)
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--seed", type=int, default=PARAM_COUNT_SEED)
    parser.add_argument("--hidden", default="[]", help="JSON list of paths the audit hook refuses")
    args = parser.parse_args(argv)
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # whatever the bundle prints goes to stderr
    try:
        result = _child(args)
    except BaseException as exc:  # noqa: BLE001
        result = {"ok": False, "kind": _kind(exc, "build"), "error": _describe(exc)}
    os.write(real_stdout, (json.dumps(result) + "\n").encode())
    exit_child(0)  # the bundle's buffered output flushed to stderr, no interpreter teardown


if __name__ == "__main__":
    main()
