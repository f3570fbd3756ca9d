"""Typed run manifest and the library's result type (pydantic v2).

:class:`RunManifest` is ``prism_run_manifest.v2.json`` (schema ``prism.run.v2``) field by
field: the file the pipeline writes validates against it, and its JSON schema is checked into
the repository (:data:`SCHEMA_PATH`; regenerate with ``python -m prism_challenge.manifest.results
--write-schema``, a test checks the file equals :func:`manifest_schema`).

Extra keys: refused everywhere (``extra="forbid"``), so a key the harness adds without
declaring it here fails the tests and the schema cannot drift from the file. One exception:
``data.source``, a copy of the data MANIFEST's self-describing ``source`` record, whose keys
depend on the source kind (``fineweb-edu``, ``files``, ``builtin``) and are defined by
:mod:`prism_challenge.data.prepare`; the whole record is already pinned by
``data.manifest_sha256``. Maps keyed by rank (``"0"``, ``"1"``...) and by file path are typed
maps, not open objects.

A manifest of a run stopped before its run directory existed (a refused bundle, a bad option,
a cancel during the gates) is never written to disk; :func:`early_manifest` builds it for the
result, with ``null`` for every section the run never reached. A ``scored`` manifest must have
every section (a model validator checks it).

The sections' models are defined by what they record, in
:mod:`~prism_challenge.manifest.run_sections` (what the run was given, where it ran) and
:mod:`~prism_challenge.manifest.score_sections` (what it measured, how it was checked), on the
shared base and field types of :mod:`~prism_challenge.manifest.fields`; this module re-exports
them (``__all__``) with the manifest itself, the result type and the schema generator.

Units: bytes are UTF-8 bytes of text unless named ``*_bytes`` of memory or files; ``*_s`` are
seconds of wall clock; nats and bits are code lengths (``bits = nats / ln 2``).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AwareDatetime, ConfigDict, Field, model_validator

from prism_challenge.failures import FailureKind
from prism_challenge.manifest.fields import Sha256, Status, _Model
from prism_challenge.manifest.run_manifest import SCHEMA as SCHEMA_ID
from prism_challenge.manifest.run_sections import (  # re-exported: the results types
    Budgets,
    BundleInfo,
    Compute,
    DataInfo,
    DataSource,
    Failure,
    Finding,
    Gates,
    GpuStack,
    GuardInfo,
    Isolation,
    Limits,
    ModelInfo,
    ProfileRecord,
    RunConfig,
    TokenizerInfo,
    Tool,
    VerdictPolicy,
)
from prism_challenge.manifest.score_sections import (  # re-exported: the results types
    Audit,
    AuditBatch,
    AuditSchedule,
    Certificate,
    Curve,
    Heldout,
    MemorizationNoise,
    ReferenceCodes,
    Score,
    Stream,
    Timing,
    Verdict,
)

SCHEMA_PATH = Path(__file__).parent / "schema" / "manifest.schema.json"
REGENERATE = "python -m prism_challenge.manifest.results --write-schema"

__all__ = [  # the results types: the sections' models are defined in run_sections and score_sections
    "SCHEMA_PATH", "REGENERATE", "SCORED_SECTIONS", "RunManifest", "EvalResult", "early_manifest",
    "manifest_schema", "schema_text", "Tool", "Failure", "BundleInfo", "Finding", "Gates", "DataSource",
    "DataInfo", "TokenizerInfo", "VerdictPolicy", "RunConfig", "GpuStack", "Budgets", "Compute", "ModelInfo",
    "ProfileRecord", "Limits", "GuardInfo", "Isolation", "Stream", "Score", "ReferenceCodes", "Curve",
    "Timing", "Heldout", "MemorizationNoise", "Verdict", "AuditBatch", "AuditSchedule", "Audit",
    "Certificate",
]


SCORED_SECTIONS = ("gates", "data", "tokenizer", "config", "budgets", "compute", "model", "stream", "score",
                   "curve", "timing", "isolation", "verdict")


class RunManifest(_Model):
    """``prism_run_manifest.v2.json``. ``status`` is ``scored`` exactly when ``failure`` is
    ``None``; ``cancelled`` exactly when ``failure.kind`` is ``cancelled``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_id: Literal[SCHEMA_ID] = Field(alias="schema")
    created_at: AwareDatetime
    tool: Tool
    status: Status
    failure: Failure | None
    bundle: BundleInfo | None
    gates: Gates | None = None
    data: DataInfo | None = None
    tokenizer: TokenizerInfo | None = None
    seed: Annotated[int, Field(ge=0)] | None = None
    config: RunConfig | None = None
    budgets: Budgets | None = None
    compute: Compute | None = None
    model: ModelInfo | None = None
    stream: Stream | None = None
    score: Score | None = None
    reference_codes: ReferenceCodes | None = None  # scored runs; absent before issue 29
    curve: Curve | None = None
    timing: Timing | None = None
    discarded_files: list[str] = Field(default_factory=list)
    profile: ProfileRecord | None = None
    isolation: Isolation | None = None
    verdict: Verdict | None = None
    audit: Audit | None = None
    run_secret: Sha256 | None = None  # the run's secret (hex), revealed at the end; absent before issue 25
    certificate: Certificate | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RunManifest:
        if (self.status == "scored") != (self.failure is None):
            raise ValueError(f"status {self.status!r} with failure {self.failure!r}: scored exactly when no failure")
        if self.failure is not None and (self.status == "cancelled") != (self.failure.kind == "cancelled"):
            raise ValueError(f"status {self.status!r} with failure kind {self.failure.kind!r}")
        if self.status == "scored":
            missing = [k for k in SCORED_SECTIONS if getattr(self, k) is None]
            if missing or self.bundle is None or self.bundle.sha256 is None:
                raise ValueError(f"a scored manifest lacks {', '.join(missing) or 'bundle.sha256'}")
        return self

    def to_json_dict(self) -> dict:
        """The manifest as the JSON object written to disk (``schema`` key, ``null`` kept)."""
        return self.model_dump(mode="json", by_alias=True)


class EvalResult(_Model):
    """What :func:`prism_challenge.evaluate` returns for every run, scored or not.

    Attributes:
        status: ``scored``, ``failed`` or ``cancelled`` (as the manifest).
        kind: the failure's kind (``submission``, ``infrastructure``, ``cancelled``), ``None`` when scored.
        failure: the failure (stage, message, detail, kind, cause), ``None`` when scored.
        run_dir: the run directory, ``None`` when the run stopped before it was made (then the
            manifest exists only here, not on disk).
        manifest_path: ``run_dir/prism_run_manifest.v2.json``, or ``None`` (see ``run_dir``).
        manifest: the typed manifest.
    """

    status: Status
    kind: FailureKind | None
    failure: Failure | None
    run_dir: str | None
    manifest_path: str | None
    manifest: RunManifest

    @property
    def ok(self) -> bool:
        """Whether the run was scored."""
        return self.status == "scored"

    @property
    def final_score(self) -> float | None:
        """The verdict's ``final_score`` (higher is better), or ``None``."""
        return self.manifest.verdict.final_score if self.manifest.verdict is not None else None

    @property
    def prequential_bpb(self) -> float | None:
        """The run's prequential bits per byte (lower is better), or ``None``."""
        return self.manifest.score.prequential_bpb if self.manifest.score is not None else None


def early_manifest(failure: dict, *, bundle_path: str, seed: int | None, findings: list[dict],
                   profile: dict | None, version: str) -> RunManifest:
    """The manifest of a run stopped before its run directory existed.

    Args:
        failure: ``EvalFailure.to_dict()``.
        bundle_path: the bundle as given, resolved.
        seed: the run's seed.
        findings: the gates' findings (``Finding.to_dict()``) of a refusal, else ``[]``.
        profile: the manifest's ``profile`` record, or ``None``.
        version: the harness version.
    """
    status = "cancelled" if failure["kind"] == "cancelled" else "failed"
    return RunManifest.model_validate({
        "schema": SCHEMA_ID, "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool": {"name": "prism-challenge", "version": version}, "status": status, "failure": failure,
        "bundle": {"path": bundle_path}, "seed": seed, "profile": profile,
        "gates": {"findings": findings, "parameter_count": None} if findings else None,
    })


def manifest_schema() -> dict:
    """The JSON schema of :class:`RunManifest` (validation mode: what a file may hold)."""
    return RunManifest.model_json_schema(by_alias=True, mode="validation")


def schema_text() -> str:
    """:func:`manifest_schema` as the checked-in file's text (sorted keys, 2-space indent)."""
    return json.dumps(manifest_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m prism_challenge.manifest.results --write-schema``: rewrite :data:`SCHEMA_PATH`."""
    parser = argparse.ArgumentParser(prog="python -m prism_challenge.manifest.results")
    parser.add_argument("--write-schema", action="store_true", help=f"write {SCHEMA_PATH}")
    args = parser.parse_args(argv)
    if not args.write_schema:
        sys.stdout.write(schema_text())
        return 0
    SCHEMA_PATH.parent.mkdir(parents=True, exist_ok=True)
    SCHEMA_PATH.write_text(schema_text())
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
