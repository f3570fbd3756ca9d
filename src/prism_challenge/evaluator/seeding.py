"""Forced determinism: seeds, deterministic algorithms, a fixed thread count, source-only imports.

Applied by the runner before any submitted module is imported, and re-applied (seeds only)
right before every ``build_model`` call, so a loop cannot choose its initial weights by
re-seeding.
"""

from __future__ import annotations

import importlib.machinery
import os
import random
import sys
from typing import Any

import numpy as np
import torch


def force_seeds(seed: int) -> None:
    """Seed ``random``, ``numpy`` and ``torch`` (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles the module from its ``.py`` every time: no bytecode read, none written."""

    def get_code(self, fullname: str) -> Any:
        return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)

    def set_data(self, path: str, data: bytes, *, _mode: int = 0o666) -> None:  # noqa: ARG002
        return None


def force_source_imports(root: str | os.PathLike[str]) -> None:
    """Make every import from the directory tree ``root`` compile from its ``.py`` source.

    A bundle could ship a ``__pycache__/training.cpython-311.pyc`` compiled from other source
    (an unchecked-hash ``.pyc`` is loaded whatever the ``.py`` says), or a sourceless ``.pyc``:
    the gates read the source and intake does not hash ``__pycache__``, so that bytecode would
    run unchecked. A path hook placed first serves every folder under ``root`` with a finder
    that knows only ``.py`` files and a loader that never reads or writes bytecode; the rest of
    ``sys.path`` (torch and the standard library) keeps its bytecode caches.
    """
    base = os.path.realpath(root)

    def hook(path: str) -> importlib.machinery.FileFinder:
        real = os.path.realpath(path or ".")
        if real != base and not real.startswith(base + os.sep):
            raise ImportError("not in the bundle")
        return importlib.machinery.FileFinder(path, (_SourceOnlyLoader, importlib.machinery.SOURCE_SUFFIXES))

    sys.path_hooks.insert(0, hook)
    for path in list(sys.path_importer_cache):  # finders made before the hook would be reused
        real = os.path.realpath(path or ".")
        if real == base or real.startswith(base + os.sep):
            del sys.path_importer_cache[path]


def _deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)``, without its import of ``torch._inductor``.

    That call sets two things: the C++ flag, and ``torch._inductor.config.deterministic`` for
    compiled code; importing the inductor config pulls in ``torch._dynamo`` (about 1 s on CPU,
    on the path from a rank's start to its first batch). The same effect: the C++ flag now, and
    ``TORCHINDUCTOR_DETERMINISTIC=1``, from which the inductor config takes its default when a
    loop first compiles. When the config is already imported, or this torch lacks the flag's
    setter, the public call does it all.
    """
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if "torch._inductor.config" in sys.modules or setter is None:
        torch.use_deterministic_algorithms(True)
    else:
        setter(True, warn_only=False)


def force_determinism(seed: int, threads: int) -> None:
    """Seeds plus deterministic kernels and ``threads`` intra-op CPU threads.

    ``CUBLAS_WORKSPACE_CONFIG`` must already be in the environment before CUDA initializes (the
    launcher sets it); it is set here too for direct callers.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    _deterministic_algorithms()
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran in this process
        pass
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    force_seeds(seed)


def _fp32_precision(path: str) -> Any:
    """A reader of ``torch.backends[.path].fp32_precision``."""

    def read() -> Any:
        obj: Any = torch.backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
        return obj.fp32_precision

    return read


DETERMINISM_FLAGS: tuple[tuple[str, Any], ...] = (
    ("torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled),
    ("torch.is_deterministic_algorithms_warn_only_enabled()", torch.is_deterministic_algorithms_warn_only_enabled),
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision),
    ("torch.backends.cudnn.deterministic", lambda: torch.backends.cudnn.deterministic),
    ("torch.backends.cudnn.benchmark", lambda: torch.backends.cudnn.benchmark),
    ("torch.backends.cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
    ("torch.backends.cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
    ("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
     lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
    ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
     lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
    ("torch.backends.cuda.matmul.allow_fp16_accumulation", lambda: torch.backends.cuda.matmul.allow_fp16_accumulation),
    ("torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()",
     lambda: torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()),
    ("torch.backends.cuda.preferred_blas_library()", lambda: str(torch.backends.cuda.preferred_blas_library())),
    ("torch.backends.cudnn.enabled", lambda: torch.backends.cudnn.enabled),
    ("torch.backends.mkldnn.enabled", lambda: torch.backends.mkldnn.enabled),
    *(("torch.backends." + (path + "." if path else "") + "fp32_precision", _fp32_precision(path))
      for path in ("", "cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")),
)
"""The settings :func:`force_determinism` fixes, and the precision switches next to them: name
-> reader. The ``fp32_precision`` switches (torch 2.9's per-backend API: oneDNN's ``bf16`` on
CPU is one of them) are read beside the older flags, which do not all reflect them. Each of
these changes the numbers of the harness's scoring forward; the gate refuses them all
(``prism:determinism``). Reading all of them takes about 30 microseconds."""


def determinism_flags() -> dict[str, Any]:
    """The current value of each of :data:`DETERMINISM_FLAGS` (a reader that raises gives the
    exception's type name, so a changed failure is a change too)."""
    out: dict[str, Any] = {}
    for name, read in DETERMINISM_FLAGS:
        try:
            out[name] = read()
        except Exception as exc:  # noqa: BLE001 - a torch without the flag
            out[name] = f"unreadable ({type(exc).__name__})"
    return out


def determinism_change(expected: dict[str, Any]) -> str | None:
    """The first flag whose value differs from ``expected`` (a :func:`determinism_flags` taken
    right after :func:`force_determinism`), as ``"NAME is X, the run forces Y"``; ``None``
    when every flag holds. The runner calls it before scoring each batch."""
    now = determinism_flags()
    for name, value in expected.items():
        if now.get(name) != value:
            return f"{name} is {now.get(name)!r}, the run forces {value!r}"
    return None
