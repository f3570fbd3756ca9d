"""Progress bars (rich, on stderr) for the data plane's long steps: documents and bytes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

ProgressFn = Callable[[int, int], None]
"""``progress(documents, utf8_bytes)``: running totals while documents are read or tokenized."""


@contextmanager
def progress_bar(description: str, total_bytes: int | None = None) -> Iterator[ProgressFn]:
    """A rich progress bar on stderr; yields ``update(documents, utf8_bytes)`` (running totals).

    With ``total_bytes`` the bar fills towards it; without, it pulses and shows the counts.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[docs]:>10,} docs"),
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total_bytes, docs=0)

        def update(docs: int, nbytes: int) -> None:
            bar.update(task, completed=nbytes, docs=docs)

        yield update


@contextmanager
def progress_callback(progress: Any, description: str, total_bytes: int | None = None) -> Iterator[ProgressFn | None]:
    """Turn a ``progress`` argument into a callback: ``"auto"`` (a bar when stderr is a
    terminal), True (a bar), False/None (nothing), or a callable (used as is)."""
    if callable(progress):
        yield progress
        return
    show = sys.stderr.isatty() if progress == "auto" else bool(progress)
    if not show:
        yield None
        return
    with progress_bar(description, total_bytes) as update:
        yield update
