"""Python's cyclic garbage collector in the harness's children: paused over their start.

A child of the harness (a rank, the parameter child, the audit's re-scoring children, the
held-out and blind-probe children) starts by importing torch and the harness's modules and
warming up (``torch._dynamo``, ``torch.optim``): about 300,000 objects, none of them garbage
that matters. The collector runs hundreds of times while they are made: on this 2-core VM a
rank's warm start (``import prism_challenge.evaluator.runner, torch._dynamo, torch.optim``)
takes 1.95 s with it and 1.52 s without, and a plain ``import torch`` 1.22 s and 1.11 s.

So each child calls :func:`pause` first, and :func:`~prism_challenge.evaluator.audit.arm`
calls :func:`resume` before the bundle's first line runs: the collector is back with its
default thresholds for every line of submitted code, and the objects made until then are
moved to the permanent generation (:func:`gc.freeze`), so the bundle's own full collections
no longer walk them. The few thousand cyclic objects the imports left unreachable (8,871
after the rank's imports, a collection that costs 0.18 s) stay allocated for the child's
life. Nothing of the scoring depends on when a collection runs. A process that never paused
(``bench/bare_loop.py``) is left as it is. The trusted parent of ``prism eval`` imports torch
under :func:`paused` (1.22 s against 1.11 s here), which freezes nothing: it may be a service's
long-lived worker, whose objects must stay collectable.

``python bench/child_gc.py`` times each child's start both ways.

Standard library only: :mod:`prism_challenge.evaluator.rank` pauses before it imports torch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_paused = [False]


def pause() -> None:
    """Disable the cyclic collector for this child's start (until :func:`resume`)."""
    if gc.isenabled():
        gc.disable()
        _paused[0] = True


def resume() -> None:
    """Undo :func:`pause`, if this process paused: freeze what exists, enable the collector."""
    if _paused[0]:
        _paused[0] = False
        gc.freeze()
        gc.enable()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector disabled inside the block (imports), then enabled again if it was on;
    nothing is frozen."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
