"""The caller's handle on one running evaluation: cancellation and progress events.

:class:`RunControl` is made by :func:`prism_challenge.api.evaluate` from its ``cancel`` and
``on_progress`` arguments and handed down the pipeline. Cancellation is checked from outside
the pipeline's own control flow: a watcher thread polls the cancel source every
:data:`POLL_S` seconds and, once it is set, calls every kill function the pipeline registered
(:meth:`RunControl.on_cancel`: the jail's children, i.e. torchrun, its ranks, the warm pool, the
parameter and held-out children; the sandbox uid's processes), so a child blocked in a wait
dies at once; the pipeline then sees :attr:`RunControl.cancelled` at its next check and ends
the run with stage ``cancelled``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from prism_challenge.events import ProgressEvent, StageFinished, StageStarted
from prism_challenge.failures import EvalFailure

POLL_S = 0.1  # how often the watcher reads a cancel source (the kill follows within this)
CANCELLED_MESSAGE = "the run was cancelled by the caller; its process tree was killed"


class CancelEvent(Protocol):
    """What ``cancel`` may be besides a callable: anything with ``is_set()`` (``threading.Event``,
    ``multiprocessing.Event``)."""

    def is_set(self) -> bool: ...


CancelSource = CancelEvent | Callable[[], bool]


def _reader(cancel: Any) -> Callable[[], bool] | None:
    """A zero-argument predicate for ``cancel``.

    Raises:
        TypeError: ``cancel`` has no ``is_set()`` and is not callable.
    """
    if cancel is None:
        return None
    if callable(getattr(cancel, "is_set", None)):
        return lambda: bool(cancel.is_set())
    if callable(cancel):
        return lambda: bool(cancel())
    raise TypeError(f"cancel: {cancel!r} must have is_set() (threading.Event) or be a callable returning bool")


class RunControl:
    """Cancellation and progress of one run.

    Args:
        cancel: a ``threading.Event``-like object (``is_set()``) or a callable returning
            ``True`` once the run must stop; ``None``: never cancelled.
        on_progress: called with each :mod:`~prism_challenge.events` event; ``None``: none.

    Raises:
        TypeError: ``cancel`` or ``on_progress`` is of the wrong type.
    """

    def __init__(self, cancel: CancelSource | None = None,
                 on_progress: Callable[[ProgressEvent], Any] | None = None):
        if on_progress is not None and not callable(on_progress):
            raise TypeError(f"on_progress: {on_progress!r} must be callable or None")
        self._read = _reader(cancel)
        self._on_progress = on_progress
        self._cancelled = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._kills: list[Callable[[], Any]] = []
        self._warned = False
        self.cancelled_at: float | None = None  # time.monotonic() when the cancel was seen
        self._thread: threading.Thread | None = None

    # -- cancellation ---------------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        """Whether the cancel was seen (the watcher saw it, or :meth:`check` did)."""
        if not self._cancelled.is_set() and self._read is not None and self._read():
            self._trip()
        return self._cancelled.is_set()

    def start(self) -> RunControl:
        """Start the watcher thread (no-op without a cancel source); returns ``self``."""
        if self._read is not None and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="prism-cancel", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watcher thread (the run is over)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._read is not None and self._read():
                self._trip()
                return

    def _trip(self) -> None:
        with self._lock:
            if self._cancelled.is_set():
                return
            self.cancelled_at = time.monotonic()
            self._cancelled.set()
            kills = list(self._kills)
        for kill in kills:
            _quietly(kill)

    def on_cancel(self, kill: Callable[[], Any]) -> None:
        """Register ``kill`` to run once the run is cancelled (at once when it already is)."""
        with self._lock:
            self._kills.append(kill)
            now = self._cancelled.is_set()
        if now:
            _quietly(kill)

    def check(self) -> None:
        """Raise at a stage boundary once the run is cancelled.

        Raises:
            EvalFailure: stage ``cancelled``.
        """
        if self.cancelled:
            raise EvalFailure("cancelled", CANCELLED_MESSAGE)

    # -- progress ---------------------------------------------------------------------------
    def emit(self, event: ProgressEvent) -> None:
        """Deliver ``event`` to the callback; an exception there is warned about once, never raised."""
        if self._on_progress is None:
            return
        try:
            self._on_progress(event)
        except Exception as exc:  # noqa: BLE001 - the caller's display must not fail the run
            if not self._warned:
                self._warned = True
                warnings.warn(f"on_progress raised {type(exc).__name__}: {exc} (further errors are not shown)",
                              RuntimeWarning, stacklevel=2)

    @contextmanager
    def stage(self, name: str, total: int | None = None, unit: str | None = None, *,
              check: bool = True) -> Iterator[StageMark]:
        """Emit ``stage_started``, then ``stage_finished`` (``ok=False`` when the block raised or
        set ``mark.failed``); with ``check``, first raises if the run was cancelled.

        Raises:
            EvalFailure: stage ``cancelled`` when the run was cancelled before the stage.
        """
        if check:
            self.check()
        self.emit(StageStarted(stage=name, total=total, unit=unit))
        t0 = time.monotonic()
        mark, ok = StageMark(), False
        try:
            yield mark
            ok = not mark.failed
        finally:
            self.emit(StageFinished(stage=name, seconds=time.monotonic() - t0, ok=ok))


class StageMark:
    """Set ``failed = True`` inside :meth:`RunControl.stage` for a stage that ended without raising
    but failed (the stream, judged after it ended)."""

    failed: bool = False


def _quietly(kill: Callable[[], Any]) -> None:
    try:
        kill()
    except Exception:  # noqa: BLE001 - a process already gone; the other kills still run
        pass
