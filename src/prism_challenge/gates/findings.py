"""Gate results: :class:`Finding` (one broken rule at one place) and :class:`GateReport`."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_challenge.intake.bundle import Bundle


@dataclass(frozen=True)
class Finding:
    """One broken rule at one place in the bundle.

    Attributes:
        rule: stable rule id, e.g. ``prism:no-network`` (see :data:`prism_challenge.gates.RULES`).
        file: bundle-relative POSIX path of the file, or ``""`` for a finding about the request
            (e.g. ``--nproc 16``).
        line: 1-based line; 0 when the finding is about the whole file or request.
        col: 1-based column in characters; 0 when there is no column.
        message: one line saying what was found (control characters shown as escapes:
            :func:`prism_challenge.terminal.printable`).
        blocking: whether the finding stops the run (advisories are ``False``).
    """

    rule: str
    file: str
    line: int
    col: int
    message: str
    blocking: bool = True

    def __post_init__(self) -> None:
        from prism_challenge.terminal import printable

        object.__setattr__(self, "message", printable(self.message))  # the bundle's text (terminal)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the same keys as the fields."""
        return {
            "rule": self.rule,
            "file": self.file,
            "line": self.line,
            "col": self.col,
            "message": self.message,
            "blocking": self.blocking,
        }

    @property
    def location(self) -> str:
        """``file:line:col`` (shorter when line or column is 0)."""
        if not self.file:
            return "-"
        if not self.line:
            return self.file
        return f"{self.file}:{self.line}:{self.col}" if self.col else f"{self.file}:{self.line}"


@dataclass
class GateReport:
    """The result of :func:`prism_challenge.gates.run_gates`.

    Attributes:
        bundle: the located bundle, or ``None`` when ``prism.yaml`` could not be read.
        findings: every finding, sorted by file, line, column and rule.
        param_count: unique storage elements of parameters and buffers after one forward, or
            ``None`` when the count did not run (a blocking sandbox finding, a failed build,
            or ``check_params=False``).
        max_parameters: the cap the count was compared with.
        extracted_dir: for a ``.zip`` bundle, the temporary directory it was extracted into
            (``bundle.root`` is it or a folder inside it). The caller owns it: call
            :meth:`cleanup` when done. ``None`` for a directory bundle.
        source: the bundle as the user named it (the ``.zip`` path or the directory), for
            display; ``None`` when unknown (then ``bundle.root``).
    """

    bundle: Bundle | None
    findings: list[Finding]
    param_count: int | None
    max_parameters: int | None = None
    extracted_dir: Path | None = field(default=None, repr=False)
    source: str | None = None
    _removal: Any = field(default=None, repr=False, compare=False)  # weakref.finalize of extracted_dir

    def own(self, extracted: Path) -> None:
        """Hold ``extracted`` (the frozen copy) as :attr:`extracted_dir`: removed by :meth:`cleanup`,
        or when the report is garbage-collected, or at interpreter exit, whichever comes first
        (``weakref.finalize``): a caller that forgets :meth:`cleanup` leaves no folder behind."""
        from prism_challenge.intake.frozen import remove_tree

        self.extracted_dir = extracted
        self._removal = weakref.finalize(self, remove_tree, extracted)

    @property
    def shown_source(self) -> str | None:
        """The bundle as the user named it: :attr:`source`, else ``bundle.root`` (``None``
        without a bundle); never a temporary extraction when the source is known."""
        if self.source is not None:
            return self.source
        return None if self.bundle is None else str(self.bundle.root)

    @property
    def blocking(self) -> bool:
        """Whether any finding blocks the run."""
        return any(f.blocking for f in self.findings)

    def cleanup(self) -> None:
        """Remove the bundle's frozen copy (:func:`prism_challenge.intake.frozen.freeze`)."""
        if self._removal is not None:
            self._removal()  # once: a finalizer that ran is dead
            self._removal = None
        elif self.extracted_dir is not None:
            from prism_challenge.intake.frozen import remove_tree

            remove_tree(self.extracted_dir)
        self.extracted_dir = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: bundle (source, root, entrypoints, tokenizer, sha256) or ``None``,
        findings, param_count, max_parameters and blocking.

        ``source`` is the path the user gave (a ``.zip`` or a directory); ``root`` is where the
        files were read (for a zip, a temporary extraction removed by :meth:`cleanup`)."""
        b = self.bundle
        bundle = None
        if b is not None:
            bundle = {
                "source": self.shown_source,
                "root": str(b.root),
                "architecture": f"{b.architecture.file}:{b.architecture.symbol}",
                "training": f"{b.training.file}:{b.training.symbol}",
                "tokenizer": b.tokenizer,
                "sha256": b.sha256,
                "files": sorted(b.file_hashes),
            }
        return {
            "bundle": bundle,
            "findings": [f.to_dict() for f in self.findings],
            "param_count": self.param_count,
            "max_parameters": self.max_parameters,
            "blocking": self.blocking,
        }
