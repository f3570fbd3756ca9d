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

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from prism_challenge.gates.param_count import _storage_key, _unique


class TensorCensus(TorchDispatchMode):
    """Records the tensors an operator sequence reads that it did not produce itself.

    Use as a context manager around ``model(tokens)``; then :meth:`elements` gives the unique
    storage elements of what the forward read, beyond ``exclude`` (the token batch).
    """

    def __init__(self) -> None:
        super().__init__()
        self.produced: set[object] = set()  # storage keys of operator outputs
        self.read: dict[object, torch.Tensor] = {}  # storage key -> a tensor viewing it

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)[0]
                if key not in self.produced and key not in self.read:
                    self.read[key] = t
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)[0]
                if key not in self.read:  # an in-place write to a weight keeps it a weight
                    self.produced.add(key)
        return out

    def tensors(self, exclude: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One tensor per storage read from outside the forward (``exclude``'s storage left out)."""
        skip = _storage_key(exclude)[0] if exclude is not None else None
        return [t for key, t in self.read.items() if key != skip]


def unique_elements(*groups: list[torch.Tensor]) -> int:
    """Unique storage elements over several tensor lists (each storage charged once, whole)."""
    return _unique([t for g in groups for t in g])
