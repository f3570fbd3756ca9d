"""The tensor census: which tensors a scoring forward actually reads, wherever the model keeps them.

The parameter cap counts the tensors registered in the model tree
(:func:`~prism_challenge.gates.param_count.count_unique_elements`). A model can also read weights
it keeps out of that tree: in a plain Python object (``self.bank = Bank()`` holding
``nn.Parameter``s), in a closure, in a module of a library. Those are still model capacity, and
still trained by the loop. The census closes that gap by observing the forward itself: under a
``TorchDispatchMode`` every ATen operator call of ``model(tokens)`` is seen with its tensor
arguments, in order. A tensor argument whose storage was not produced by an earlier operator of
the same forward existed before the forward began: a parameter, a buffer, or a tensor held
anywhere else. The census charges each such storage once, in elements (storage bytes // element
size, as the cap does); the token batch itself is excluded.

The mode only observes: each operator runs unchanged (``func(*args, **kwargs)``), so logits are
bitwise the same as without it (``tests/test_census.py``). It costs a Python call per operator,
so the runner takes a census on the batches the feeder probes for causality (the first two and
a secret ~1/16 of the rest, see :mod:`prism_challenge.evaluator.feeder`), on the scored forward
itself; the loop cannot tell those batches from the others. A module the loop compiled with
``torch.compile`` runs eagerly under the mode (dynamo does not trace through a dispatch mode), so
on those batches the logits are the eager ones: the same in every run, within float rounding of
the compiled ones.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from prism_challenge.gates.param_count import storage_key, unique_elements

__all__ = ["TensorCensus", "unique_elements"]


class TensorCensus(TorchDispatchMode):
    """Records the tensors an operator sequence reads that it did not produce itself.

    Use as a context manager around ``model(tokens)``; then :meth:`tensors` gives one tensor per
    storage read from outside (for :func:`unique_elements`).

    * A storage counts as produced while a tensor that an operator of this forward returned on
      it is alive (weak references): memory freed and reused for a tensor built from Python data
      (``torch.tensor(values)``) is charged, not mistaken for an intermediate result.
    * Each read storage is charged at the smallest element size it is seen with in this forward
      (``view_as_real``, ``Tensor.view(dtype)``): a complex or float64 table read as float32 pays
      for every float32 it holds.
    * A tensor built from Python numbers during the forward (``torch.tensor(0.5)``) was not
      produced by an operator: it is charged like any other constant the model holds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.produced: dict[object, list[weakref.ref]] = {}  # storage key -> op outputs on it
        self.read: dict[object, torch.Tensor] = {}  # storage key -> its narrowest view read

    def _live(self, key: object) -> bool:
        refs = self.produced.get(key)
        if not refs:
            return False
        refs[:] = [r for r in refs if r() is not None]
        return bool(refs)

    def _note(self, key: object, t: torch.Tensor) -> None:
        if t.element_size() < self.read[key].element_size():
            self.read[key] = t

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)[0]
                if key in self.read:
                    self._note(key, t)
                elif not self._live(key):
                    self.read[key] = t
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)[0]
                if key in self.read:  # a view of (or in-place write to) a weight stays the weight
                    self._note(key, t)
                else:
                    self.produced.setdefault(key, []).append(weakref.ref(t))
        return out

    def tensors(self, exclude: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One tensor per storage read from outside the forward (``exclude``'s storage left out)."""
        skip = storage_key(exclude)[0] if exclude is not None else None
        return [t for key, t in self.read.items() if key != skip]
