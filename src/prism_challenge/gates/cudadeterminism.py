"""Ops that raise under forced determinism on CUDA only (``prism:cuda-determinism``, advisory).

The runner forces ``torch.use_deterministic_algorithms(True)`` for every run
(:func:`~prism_challenge.evaluator.seeding.force_determinism`). Some ops have no deterministic
CUDA kernel and then raise ``RuntimeError`` ("... does not have a deterministic
implementation"), on CUDA only: a loop that passes every CPU test fails at stage ``train`` on
the GPU. Under a CUDA device (``prism check --device cuda``, ``--profile prism-v2``, or
``prism eval`` on CUDA) the gate names each call of one of them, with its file and line, as an
advisory: it never blocks, since the op may run on CPU tensors, or in a mode that is fine.

The list is torch's own: the "will throw a RuntimeError" list of
``torch.use_deterministic_algorithms.__doc__`` (torch 2.13; ``tests/test_gates_cuda_determinism.py``
checks that every op named there is covered here). Ops the same docstring says act
deterministically on CUDA (``index_add_``, ``scatter_add_``, ``scatter_reduce`` with ``sum`` or
``mean``, ``index_put_`` with ``accumulate=True``, ``index_select`` and ``gather`` backwards) are
not named. Where the docstring's condition is an argument (a mode, ``weights``, ``dim``,
``reduce``), a literal that avoids it is not named; a value the gate cannot read is.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

CUDA_DETERMINISM = "prism:cuda-determinism"

_BACKWARD = "in its backward"
_INTERP = frozenset({"linear", "bilinear", "bicubic", "trilinear"})
Cond = Callable[[ast.Call, bool], bool]
"""(call, called as a tensor method) -> whether the call is named."""


def _arg(call: ast.Call, pos: int, name: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[pos] if pos < len(call.args) else None


def _mode_in(pos: int, name: str, bad: frozenset[str], default: str) -> Cond:
    def cond(call: ast.Call, method: bool) -> bool:
        value = _arg(call, pos, name)
        if value is None:
            return default in bad
        return not (isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value not in bad)
    return cond


def _given(pos: int, name: str, method_pos: int | None = None) -> Cond:
    """Named when the argument is passed and is not the literal ``None``."""
    def cond(call: ast.Call, method: bool) -> bool:
        value = _arg(call, method_pos if method and method_pos is not None else pos, name)
        return value is not None and not (isinstance(value, ast.Constant) and value.value is None)
    return cond


def _always(call: ast.Call, method: bool) -> bool:
    return True


def _prod(call: ast.Call, method: bool) -> bool:
    value = _arg(call, 3 if method else 4, "reduce")
    return value is None or not (isinstance(value, ast.Constant) and value.value != "prod")


F_ = "torch.nn.functional."
NN = "torch.nn."
OPS: dict[str, tuple[str, Cond]] = {
    **{NN + c: (_BACKWARD, _always) for c in (
        "AvgPool3d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool2d", "FractionalMaxPool2d",
        "FractionalMaxPool3d", "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "CTCLoss")},
    **{F_ + f: (_BACKWARD, _always) for f in (
        "avg_pool3d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
        "fractional_max_pool2d", "fractional_max_pool3d", "grid_sample", "ctc_loss")},
    **{NN + c: ("", _always) for c in ("MaxUnpool1d", "MaxUnpool2d", "MaxUnpool3d", "NLLLoss")},
    **{F_ + f: ("", _always) for f in ("max_unpool1d", "max_unpool2d", "max_unpool3d", "nll_loss")},
    F_ + "interpolate": ("in its backward, with mode linear, bilinear, bicubic or trilinear",
                         _mode_in(3, "mode", _INTERP, "nearest")),
    NN + "Upsample": ("in its backward, with mode linear, bilinear, bicubic or trilinear",
                      _mode_in(2, "mode", _INTERP, "nearest")),
    F_ + "pad": ("in its backward, with mode='reflect'", _mode_in(2, "mode", frozenset({"reflect"}), "constant")),
    NN + "EmbeddingBag": ("in its backward, with mode='max'", _mode_in(5, "mode", frozenset({"max"}), "mean")),
    F_ + "embedding_bag": ("in its backward, with mode='max'", _mode_in(6, "mode", frozenset({"max"}), "mean")),
    "torch.histc": ("", _always),
    "torch.bincount": ("with a weights tensor", _given(1, "weights", 0)),
    "torch.median": ("with a dim (the indices output)", _given(1, "dim", 0)),
    "torch.cumsum": ("on a floating-point or complex tensor (an integer cumsum is fine)", _always),
    "torch.scatter_reduce": ("with reduce='prod'", _prod),
    "torch.Tensor.put_": ("", _always),
}
"""Qualified name -> (when it raises, on CUDA; whether a given call is named)."""

METHODS: dict[str, str] = {
    "histc": "torch.histc", "bincount": "torch.bincount", "median": "torch.median",
    "cumsum": "torch.cumsum", "cumsum_": "torch.cumsum", "scatter_reduce": "torch.scatter_reduce",
    "scatter_reduce_": "torch.scatter_reduce", "put_": "torch.Tensor.put_",
}
"""Tensor method name -> the entry of :data:`OPS` it is judged by (``x.cumsum(1)``)."""


def cuda_determinism_findings(checker: Any, tree: ast.AST, rel: str) -> list[Any]:
    """Advisory findings (``blocking=False``) for each call in ``tree`` (the module ``rel``) of
    an op of :data:`OPS`/:data:`METHODS` whose condition holds.

    ``checker``: a :class:`prism_challenge.gates.sandbox.Checker` of that module (its ``q``
    resolves a call's target to qualified names). Returns
    :class:`~prism_challenge.gates.findings.Finding` objects, in source order."""
    from prism_challenge.gates.findings import Finding

    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        qs = checker.q(node.func)
        hit = next((q for q in sorted(qs) if q in OPS), None)
        method = hit is None and not qs and isinstance(node.func, ast.Attribute) and node.func.attr in METHODS
        if method:
            hit = METHODS[node.func.attr]  # type: ignore[union-attr]
        if hit is None:
            continue
        when, cond = OPS[hit]
        if not cond(node, method):
            continue
        name = f".{node.func.attr}()" if method else hit  # type: ignore[union-attr]
        out.append(Finding(
            CUDA_DETERMINISM, rel, node.lineno, node.col_offset + 1,
            f"{name} raises RuntimeError under forced determinism on CUDA{' ' + when if when else ''} "
            f"(torch.use_deterministic_algorithms(True), which PRISM forces): this bundle will fail at stage "
            f"train on the GPU; use an op with a deterministic CUDA kernel", blocking=False))
    return sorted(out, key=lambda f: (f.line, f.col))


def is_cuda(device: str | None) -> bool:
    """Whether a run on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"auto"``, ``None``)
    runs on CUDA: ``"auto"`` does when torch sees a GPU."""
    if device is None:
        return False
    if device == "auto":
        import torch

        return bool(torch.cuda.is_available())
    return device == "cuda" or device.startswith("cuda:")
