"""The run manifest ``prism_run_manifest.v2.json``: a versioned, self-describing record of a run.

Written by the trusted parent only, atomically, after the run; any file of that name that the
submission wrote is discarded first.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA = "prism.run.v2"
MANIFEST_NAME = "prism_run_manifest.v2.json"


def discard_planted(artifacts_dir: Path) -> list[str]:
    """Delete every file called ``prism_run_manifest.v2.json`` below ``artifacts_dir``.

    Returns the relative paths removed (recorded in the manifest).
    """
    removed = []
    if artifacts_dir.is_dir():
        for p in artifacts_dir.rglob(MANIFEST_NAME):
            if p.is_file() or p.is_symlink():
                removed.append(p.relative_to(artifacts_dir).as_posix())
                p.unlink()
    return removed


def write_run_manifest(run_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write ``run_dir/prism_run_manifest.v2.json`` atomically (temp file + rename)."""
    path = run_dir / MANIFEST_NAME
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", dir=run_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_run_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a run manifest (a file, or a run directory holding one).

    Raises:
        ValueError: not a PRISM v2 run manifest.
    """
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    data = json.loads(p.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{p}: not a {SCHEMA} run manifest")
    return data
