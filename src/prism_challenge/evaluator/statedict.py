"""Moving the scored model's ``state_dict`` out of the sandbox without pickle.

Rank 0 sends each tensor as one STATE frame: a JSON header ``{name, dtype, shape}`` and the
tensor's raw bytes (contiguous, CPU). The trusted side rebuilds tensors with
``torch.frombuffer`` from an allow-list of dtypes, so nothing the submission controls is ever
unpickled. Every rank also reports :func:`state_digest` of its own ``state_dict``; the trusted
side compares them to catch ranks that drifted apart.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
from collections.abc import Iterable, Mapping

import torch

DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


class StateError(ValueError):
    """A state tensor the trusted side refuses (unknown dtype, size mismatch, duplicate name)."""


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``build_model`` made, through the wrappers a loop puts around it, however deeply
    nested and in any order: ``torch.compile``'s ``OptimizedModule`` (its state names are prefixed
    ``_orig_mod.``), ``DistributedDataParallel`` and ``DataParallel`` (prefixed ``module.``).
    ``model`` itself when it is none of them. Its ``state_dict`` has the names ``build_model``'s
    module has, so the held-out stage can load it. The wrapped module is read from the wrapper's
    registered submodules (``_modules``), never through an attribute a subclass could override."""
    while True:
        dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
        optimized = getattr(dynamo, "OptimizedModule", None)
        if optimized is not None and isinstance(model, optimized):
            inner = model._modules.get("_orig_mod")
        elif isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            inner = model._modules.get("module")
        else:
            return model
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as detached, contiguous CPU tensors (non-tensor entries dropped);
    of the wrapped module when ``model`` is a ``torch.compile`` or DDP wrapper (:func:`uncompiled`)."""
    return {
        k: v.detach().to("cpu").contiguous()
        for k, v in uncompiled(model).state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def state_digests(state: Mapping[str, torch.Tensor]) -> tuple[str, dict[str, str]]:
    """``(whole, per_tensor)``: sha256 over ``name, dtype, shape, raw bytes`` of every tensor in
    sorted name order (:func:`state_digest`), and each tensor's own sha256 over ``dtype, shape,
    raw bytes`` (the first 16 hex digits: enough to name which tensors two ranks disagree on).
    One pass over the bytes."""
    whole, each = hashlib.sha256(), {}
    for name in sorted(state):
        t = state[name]
        meta = f"{t.dtype}\0{tuple(t.shape)}\0".encode()
        data = tensor_bytes(t.contiguous())
        whole.update(f"{name}\0".encode() + meta)
        whole.update(data)
        own = hashlib.sha256(meta)
        own.update(data)
        each[name] = own.hexdigest()[:16]
    return whole.hexdigest(), each


SIGNS_PERIOD = 4096
"""The length of the fixed pseudo-random ``+-1`` pattern that :func:`state_moments` tiles over
a flattened tensor for its signed sum."""


@functools.lru_cache(maxsize=1)
def _signs() -> torch.Tensor:
    """:data:`SIGNS_PERIOD` float64 values, each ``+1`` or ``-1``, the same in every process (a
    fixed generator seed: a rank and its peers compute the same signed sums)."""
    bits = torch.randint(0, 2, (SIGNS_PERIOD,), generator=torch.Generator().manual_seed(27))
    return bits.to(torch.float64) * 2 - 1


def signed_sum(x: torch.Tensor) -> float:
    """``sum_i s[i % SIGNS_PERIOD] * x_i`` over the flattened float64 tensor ``x`` (``s``:
    :func:`_signs`). For two tensors differing by ``d``, the signed sums differ by about
    ``||d||_2`` (a random +-1 projection keeps the norm: Johnson-Lindenstrauss, one
    dimension), where plain sums of a difference with mixed signs cancel to ``~||d||_2`` but
    are compared to ``sum |x|``, ``sqrt(n)`` times larger."""
    flat, s = x.reshape(-1), _signs()
    full = flat.numel() // SIGNS_PERIOD * SIGNS_PERIOD
    head = float((flat[:full].view(-1, SIGNS_PERIOD) @ s).sum()) if full else 0.0
    return head + float((flat[full:] * s[: flat.numel() - full]).sum())


def state_moments(state: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """``name -> [sum, sum of |x|, sum of x**2, signed sum]`` of every floating-point tensor,
    all in float64 (:func:`signed_sum`; a tensor of ``n`` elements gives four numbers). Two
    ranks whose digests differ but whose moments agree to :data:`DRIFT_RTOL` (:func:`drift_only`)
    differ in their last bits only; integer and bool tensors have none (any difference there
    is real)."""
    out = {}
    for name in sorted(state):
        t = state[name]
        if t.is_floating_point() and t.numel():
            x = t.detach().to(torch.float64)
            flat = x.reshape(-1)
            out[name] = [float(x.sum()), float(x.abs().sum()), float(torch.dot(flat, flat)), signed_sum(x)]
    return out


def tensors_header_bytes(names: Iterable[str]) -> int:
    """At most how many bytes a DONE header's ``state_tensors`` and ``state_moments`` take for
    the tensors ``names`` (compact JSON, :mod:`~prism_challenge.evaluator.protocol`): per name,
    its JSON string twice (``json.dumps``: a non-ASCII character takes up to 12 bytes), with
    ``:"<64 hex digits>",`` (68 bytes) and ``:[f,f,f,f],`` (four floats of at most 24
    characters, ``-2.2250738585072014e-308``: 102 bytes), and a few spare."""
    return sum(2 * len(json.dumps(k)) + 176 for k in names)


DRIFT_RTOL = 1e-4
"""How far two ranks' moments of one tensor may lie apart and still count as drift in the last
bits (:func:`drift_only`): the sums relative to the sum of ``|x|``, the signed sums relative to
the L2 norm (so about the relative L2 distance of the two tensors). A float32 rounding
difference in one step, carried through a short run, moves them by about 1e-7; ranks that
trained on other data (a loop without DDP), or skipped a step, by far more than 1e-4, however
large the tensor."""


def drift_only(a: Mapping[str, str], b: Mapping[str, str], ma: Mapping[str, list[float]],
               mb: Mapping[str, list[float]]) -> tuple[bool, float]:
    """Whether two ranks' states that hash differently differ in their last bits only:
    ``(verdict, largest relative difference)``.

    ``a``, ``b``: name -> per-tensor digest (:func:`state_digests`); ``ma``, ``mb``: name ->
    moments (:func:`state_moments`). True when both name the same tensors and every tensor
    whose digest differs is floating-point on both sides with its sums within
    ``DRIFT_RTOL * max(sum |x|)`` and its signed sums within ``DRIFT_RTOL * max(||x||_2)`` of
    the other's. False for anything else (a tensor only one rank has, an integer tensor that
    differs, moments missing, malformed or not finite)."""
    if set(a) != set(b):
        return False, float("inf")
    worst = 0.0
    for name in (n for n in a if a[n] != b[n]):
        x, y = ma.get(name), mb.get(name)
        if not (isinstance(x, list) and isinstance(y, list) and len(x) == len(y) == 4):
            return False, float("inf")
        try:
            (s1, a1, q1, p1), (s2, a2, q2, p2) = ([float(v) for v in m] for m in (x, y))
            rel = max(max(abs(s1 - s2), abs(a1 - a2)) / max(abs(a1), abs(a2), 1e-30),
                      abs(p1 - p2) / max(math.sqrt(abs(q1)), math.sqrt(abs(q2)), 1e-30))
        except (TypeError, ValueError, OverflowError):
            return False, float("inf")
        if not rel <= DRIFT_RTOL:  # NaN: not drift
            return False, float("inf") if rel != rel else rel
        worst = max(worst, rel)
    return True, worst


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over ``name, dtype, shape, raw bytes`` of every tensor, in sorted name order."""
    return state_digests(state)[0]


def frames(state: Mapping[str, torch.Tensor]) -> Iterable[tuple[dict, memoryview]]:
    """(header, payload) per tensor, for the STATE frames."""
    for name, t in state.items():
        if str(t.dtype) not in DTYPES:
            raise StateError(f"state tensor {name!r} has dtype {t.dtype}, which the harness cannot store")
        yield {"name": name, "dtype": str(t.dtype), "shape": list(t.shape)}, tensor_bytes(t)


def check_frame(header: dict, payload: bytes | bytearray | memoryview) -> tuple[str, str, list[int]]:
    """``(name, dtype, shape)`` of a STATE or SNAPSHOT frame whose payload holds exactly that
    tensor's raw bytes (trusted side; nothing is built).

    Raises:
        StateError: bad name, dtype or shape, or a payload of the wrong size.
    """
    name, dtype, shape = header.get("name"), header.get("dtype"), header.get("shape")
    if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in DTYPES or not isinstance(shape, list) \
            or not all(type(s) is int and s >= 0 for s in shape):  # a JSON true is no dimension
        raise StateError(f"malformed state frame header {str(header)[:200]}")
    dt = DTYPES[dtype]
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dt).element_size()
    if len(payload) != numel * itemsize:
        raise StateError(f"state tensor {name!r}: {len(payload)} bytes for shape {shape} of {dtype}")
    return name, dtype, shape


def rebuild(header: dict, payload: bytes | bytearray) -> tuple[str, torch.Tensor]:
    """One tensor from a STATE frame (trusted side).

    Raises:
        StateError: as :func:`check_frame`.
    """
    name, dtype, shape = check_frame(header, payload)
    dt = DTYPES[dtype]
    if not len(payload):
        return name, torch.empty(shape, dtype=dt)
    return name, torch.frombuffer(bytearray(payload), dtype=dt).reshape(shape).clone()


def load_scored_state(model: torch.nn.Module, state: object) -> None:
    """Load ``state`` (a ``state_dict`` read with ``torch.load(..., weights_only=True)``) into
    ``model`` as the scored model held it: the names and shapes strictly ``model``'s (a missing,
    unexpected or mis-shaped entry raises), and every tensor in **its own dtype**
    (``load_state_dict(..., assign=True)``): a loop that cast its model to bf16 is re-scored in
    bf16, not copied into ``build_model``'s float32 parameters (issue 26). Scoring the snapshot
    as it is, is scoring the model that made the record; a dtype the loop chose changes nothing
    else. The floating buffers that are not in any ``state_dict`` (``persistent=False``: a RoPE
    or mask cache ``build_model`` makes again) follow :func:`cast_unsaved_buffers`. Names that
    are one tensor object in ``state`` (a tied weight) are one object in ``model``
    (:func:`tie_aliases`).

    Raises:
        StateError: ``state`` is not a mapping of names to tensors.
        RuntimeError: ``load_state_dict``'s own (missing or unexpected keys, a size mismatch).
    """
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise StateError(f"the state is a {type(state).__name__}, not a state_dict of named tensors")
    built = _dtypes(model)
    model.load_state_dict(state, strict=True, assign=True)
    tie_aliases(model, state)
    cast_unsaved_buffers(model, state, built)


def tie_aliases(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """After ``load_state_dict(state, assign=True)``: every name of ``state`` whose tensor is the
    same object as an earlier name's (a tied weight, stored once in a snapshot:
    :func:`~prism_challenge.evaluator.snapfile.read_snapshot`) gets that name's parameter (or
    buffer) object itself in ``model``, as ``self.head.weight = self.tok.weight`` made it: the
    loaded pair shares its storage but is two objects, which ``model.to(device)`` would copy
    apart (one object is moved once, for both names). A name that is not a parameter (buffer)
    of ``model`` where the first is one (a module's own ``_load_from_state_dict`` names) keeps
    what ``load_state_dict`` gave it."""
    first: dict[int, str] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, t in state.items():
        of = first.setdefault(id(t), name)
        if of == name:
            continue
        for slots, kind in ((params, "_parameters"), (buffers, "_buffers")):
            if name in slots and of in slots:
                owner, _, leaf = name.rpartition(".")
                getattr(model.get_submodule(owner) if owner else model, kind)[leaf] = slots[of]


def _dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    return {k: v.dtype for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def floating_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """The one dtype of every floating tensor of ``state``, or ``None`` when they have several (or
    there is none)."""
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def cast_unsaved_buffers(model: torch.nn.Module, state: Mapping[str, torch.Tensor],
                         built: Mapping[str, torch.dtype]) -> None:
    """Give ``model``'s floating buffers that no ``state_dict`` holds the dtype ``model.to(D)``
    would have given them, when ``state`` shows that cast: every floating tensor of ``state`` is
    of one dtype ``D`` (:func:`floating_dtype`) and at least one of them was built (``built``:
    the dtypes ``build_model``'s module had, by name) in another dtype. ``build_model`` made
    those buffers again with their values as they were built; a loop's
    ``model.to(torch.bfloat16)`` (or ``.half()``, ``.bfloat16()``) had cast them too. Otherwise
    (nothing was cast: a float32 RoPE table beside bf16 weights that ``build_model`` made so
    stays float32; or a model cast in parts) they are left as built. In place, on their device."""
    dtype = floating_dtype(state)
    if dtype is None or all(built.get(k, dtype) == dtype for k, v in state.items() if v.is_floating_point()):
        return
    saved = set(model.state_dict())
    for name, buf in list(model.named_buffers()):
        if name not in saved and buf.is_floating_point() and buf.dtype != dtype:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[leaf] = buf.to(dtype)


def in_dtypes_of(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Cast ``model``'s floating state entries to the dtypes of the same names in ``state`` (the
    held-out twin, in the trained model's dtypes: the loop's own model as it stood before its
    first step), then its unsaved buffers (:func:`cast_unsaved_buffers`). Names ``state`` lacks
    keep their dtype."""
    own, built = {}, _dtypes(model)
    for name, value in model.state_dict().items():
        other = state.get(name)
        if (isinstance(value, torch.Tensor) and other is not None and value.is_floating_point()
                and other.is_floating_point()):
            value = value.detach().to(other.dtype)
        own[name] = value
    model.load_state_dict(own, strict=True, assign=True)
    cast_unsaved_buffers(model, state, built)
