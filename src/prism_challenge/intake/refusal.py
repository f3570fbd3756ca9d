"""What an intake refusal is and the limits intake applies.

:class:`BundleError` carries the stable rule id (``prism:...``) of the broken intake rule and the
line it names; :class:`IntakeLimits` holds the caps on files, source size and zip archives that
every intake path (:mod:`~prism_challenge.intake.tree`, :mod:`~prism_challenge.intake.ziparchive`,
:mod:`~prism_challenge.intake.readable`) applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_challenge.intake.bundlefiles import Problem, kind_problem


class BundleError(ValueError):
    """A bundle cannot be read: the message names the file and the rule broken.

    Attributes:
        rule: stable rule id (``prism:...``) of the broken intake rule; ``prism:bundle`` when the
            raiser did not name one.
        line: 1-based line of the problem in the file the message names (``prism.yaml``), or 0.
    """

    def __init__(self, message: str, rule: str = "prism:bundle", line: int = 0) -> None:
        super().__init__(message)
        self.rule = rule
        self.line = line


@dataclass(frozen=True)
class IntakeLimits:
    """Limits applied at intake, before any source is read.

    Attributes:
        max_files: most regular files (zip: members, directories included) in a bundle.
        max_source_bytes: cap on the summed size of all bundle files in bytes (default 512 KiB:
            large literal tables are a way to smuggle pretrained knowledge).
        max_archive_bytes: cap on the summed *declared* uncompressed size of a zip's members.
        max_ratio: largest uncompressed/compressed size ratio of one zip member ...
        ratio_floor_bytes: ... checked for members whose uncompressed size exceeds this.
    """

    max_files: int = 256
    max_source_bytes: int = 512 * 1024
    max_archive_bytes: int = 4 * 1024 * 1024
    max_ratio: float = 100.0
    ratio_floor_bytes: int = 1024


def _refuse(problem: Problem | None) -> None:
    """Raise ``problem`` (rule, message) as a :class:`BundleError`; nothing when ``None``."""
    if problem is not None:
        raise BundleError(problem[1], problem[0])


def _check_kind(rel: str) -> None:
    _refuse(kind_problem(rel))
