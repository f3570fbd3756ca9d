"""Realized parameter count: unique storage elements of a module's parameters and buffers."""

from __future__ import annotations

from torch import nn


def unique_parameter_count(model: nn.Module) -> int:
    """Elements of the distinct storages behind ``model``'s parameters and buffers.

    Tied weights (two names, one storage) count once; a view counts its whole storage once.
    Meta and lazy (uninitialized) tensors contribute their element count, as they will once
    realized.

    Returns:
        The count in elements (not bytes).
    """
    seen: dict[tuple[str, int], int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta or isinstance(t, nn.parameter.UninitializedTensorMixin):
            seen[("anon", id(t))] = t.numel() if not isinstance(t, nn.parameter.UninitializedTensorMixin) else 0
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        elems = storage.nbytes() // max(t.element_size(), 1)
        seen[key] = max(seen.get(key, 0), elems)
    return sum(seen.values())
