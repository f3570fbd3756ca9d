"""``prism runs prune [DIR...] [--dry-run] [--all] [--key KEY]...``: remove the audit's weight
snapshots (``model/audit/step-<k>.snap``, most of a run directory's bytes) of runs that are
already verified.

A run directory is verified when its manifest is a scored run's (:func:`~prism_challenge.manifest.verify.read_manifest`),
its audit ended and passed (``audit.error`` null, ``audit.passed`` true: every audited batch was
re-scored from its snapshot, equal to its record, and its blind probes passed), its certificate
verifies under a trusted key (:func:`~prism_challenge.manifest.certificate.check_certificate`: ``--key``,
default the user's own, ``prism eval``'s), and every snapshot on disk is one the manifest lists
and hashes to the sha256 it binds. Any other run is kept, with the reason: one whose audit did
not end, found a mismatch (its snapshots are the evidence), was never audited or has no manifest
(an interrupted run), unless ``--all``.

Before a snapshot goes, its name, sha256 and size are added to the run's prune record
(``model/audit/pruned.json``, :data:`RECORD_NAME`), so ``prism verify`` tells a pruned snapshot
from a missing one: it checks everything else and says which audited batches it could not
re-score (:mod:`prism_challenge.manifest.verify`). Everything else in the run directory is kept: the
audited inputs (``step-<k>.npz``), the bundle copy, the manifest, the logs.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RECORD_NAME = "pruned.json"
RECORD_FORMAT = "prism-pruned-1"
SNAPSHOT_RE = re.compile(r"^step-\d{6}\.snap$")
DEFAULT_RUNS_DIR = Path("prism-runs")
MAX_DEPTH = 3  # <runs>/<run>/seed-<S>/: run directories are found this deep under a folder given


@dataclass
class RunPrune:
    """One run directory's plan.

    Attributes:
        run_dir: the run directory.
        files: the snapshot files that go (when ``kept`` is ``None``) or that a prune would find.
        sizes: bytes of each file of ``files`` (``lstat``).
        digests: the sha256 of each file of ``files`` (hex), read once.
        kept: why the run keeps its snapshots (``None``: it is pruned).
    """

    run_dir: Path
    files: list[Path] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    kept: str | None = None

    @property
    def bytes(self) -> int:
        """Bytes the prune frees (0 for a kept run)."""
        return 0 if self.kept else sum(self.sizes)


def audit_dir(run_dir: Path) -> Path:
    """The run directory's audit folder (``model/audit``)."""
    from prism_challenge.audit.auditstage import AUDIT_DIR

    return run_dir / AUDIT_DIR


def snapshot_files(run_dir: Path) -> list[Path]:
    """The run's snapshot files: regular files (never a link) named ``step-<6 digits>.snap`` in its
    audit folder, sorted."""
    folder = audit_dir(run_dir)
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if SNAPSHOT_RE.match(p.name) and p.is_file() and not p.is_symlink())


def find_runs(roots: list[Path]) -> list[Path]:
    """The run directories under ``roots`` (each a run directory itself, or a folder searched
    :data:`MAX_DEPTH` deep, links not followed): folders that hold a run manifest or an audit
    folder. Sorted, each once.

    Raises:
        ValueError: a root that is not a directory.
    """
    from prism_challenge.manifest.run_manifest import MANIFEST_NAME

    found: set[Path] = set()

    def walk(folder: Path, depth: int) -> None:
        if (folder / MANIFEST_NAME).is_file() or audit_dir(folder).is_dir():
            found.add(folder)
            return
        if depth < MAX_DEPTH:
            for child in sorted(folder.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    walk(child, depth + 1)

    for root in roots:
        if not root.is_dir():
            raise ValueError(f"{root}: " + ("not a directory" if root.exists() else "no such directory"))
        walk(root, 0)
    return sorted(found)


def why_kept(run_dir: Path, plan: RunPrune, keys: list[str] | None) -> str | None:
    """Why ``run_dir`` is not verified (its snapshots stay), or ``None`` (see the module docstring).
    ``plan``: its snapshot files, sizes and digests."""
    from prism_challenge.manifest.certificate import CertificateError, check_certificate
    from prism_challenge.manifest.run_manifest import MANIFEST_NAME
    from prism_challenge.manifest.verify import read_manifest

    if not (run_dir / MANIFEST_NAME).is_file():
        return f"no {MANIFEST_NAME}: the run did not end"
    try:
        m = read_manifest(run_dir)
    except ValueError as exc:
        return str(exc).replace(f"{run_dir}/", "").removeprefix(f"{run_dir}: ")
    audit = m["audit"]
    if audit["error"] or not audit["passed"]:
        return ("its audit did not end: " + str(audit["error"])[:200] if audit["error"]
                else "its audit did not pass (the snapshots are the evidence): " + str(audit["mismatch"])[:200])
    try:
        check_certificate(m, keys)
    except CertificateError as exc:
        return f"not certified by a trusted key ({exc})"
    bound = {f"step-{b['step']:06d}.snap": b["snapshot_sha256"] for b in audit["batches"]}
    for path, digest in zip(plan.files, plan.digests):
        if bound.get(path.name) != digest:
            return f"{path.name} is not the snapshot the manifest binds (prism verify names it)"
    return None


def plan_prune(roots: list[Path], keys: list[str] | None = None, everything: bool = False) -> list[RunPrune]:
    """A plan per run directory under ``roots`` (:func:`find_runs`) that holds snapshot files:
    pruned when verified (:func:`why_kept`), or with ``everything`` whatever its state.

    Raises:
        ValueError: a root that is not a directory.
        OSError: a snapshot that cannot be read.
    """
    from prism_challenge.evaluator.snapshots import file_sha256

    out = []
    for run_dir in find_runs(roots):
        files = snapshot_files(run_dir)
        if not files:
            continue
        plan = RunPrune(run_dir, files, [p.lstat().st_size for p in files], [file_sha256(p) for p in files])
        plan.kept = None if everything else why_kept(run_dir, plan, keys)
        out.append(plan)
    return out


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's prune record, ``{"format", "pruned_at", "snapshots": {name: {"sha256", "bytes"}}}``,
    or ``None`` when none of its snapshots was pruned.

    Raises:
        ValueError: a record that is not JSON of that form (named).
    """
    path = audit_dir(run_dir) / RECORD_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable prune record ({exc})") from None
    snaps = record.get("snapshots") if isinstance(record, dict) else None
    if (not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or not isinstance(snaps, dict)
            or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in snaps.values())):
        raise ValueError(f"{path}: not a prune record ({RECORD_FORMAT}: snapshots by name, each with its sha256)")
    return record


def prune(plan: RunPrune) -> int:
    """Remove a pruned run's snapshot files, after adding them to its prune record (written whole,
    then renamed over the old one); the bytes freed.

    Raises:
        ValueError: the run is kept, or its prune record cannot be read.
        OSError: the record cannot be written or a file removed.
    """
    if plan.kept:
        raise ValueError(f"{plan.run_dir}: kept ({plan.kept})")
    record = read_record(plan.run_dir) or {"format": RECORD_FORMAT, "snapshots": {}}
    record["pruned_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for path, size, digest in zip(plan.files, plan.sizes, plan.digests):
        record["snapshots"][path.name] = {"sha256": digest, "bytes": size}
    target = audit_dir(plan.run_dir) / RECORD_NAME
    partial = target.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(partial, target)
    for path in plan.files:
        path.unlink()
    return plan.bytes


def pruned_steps(run_dir: Path, manifest: dict[str, Any]) -> tuple[set[int], str | None]:
    """The audited steps of ``manifest`` whose snapshot is gone and named in the run's prune record
    with the sha256 the manifest binds (:func:`read_record`), and when they were pruned
    (``None``: no record). A snapshot gone and not so named is missing (``prism verify``'s
    mismatch), not pruned.

    Raises:
        ValueError: an unreadable record.
    """
    record = read_record(run_dir)
    if record is None:
        return set(), None
    snaps, folder = record["snapshots"], audit_dir(run_dir)
    steps = set()
    for b in manifest["audit"]["batches"]:
        name = f"step-{b['step']:06d}.snap"
        if snaps.get(name, {}).get("sha256") == b["snapshot_sha256"] and not (folder / name).exists():
            steps.add(b["step"])
    return steps, str(record.get("pruned_at"))

