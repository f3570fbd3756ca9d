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

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from prism_challenge.failures import FailureKind
from prism_challenge.manifest.run_manifest import SCHEMA as SCHEMA_ID

SCHEMA_PATH = Path(__file__).parent / "schema" / "manifest.schema.json"
REGENERATE = "python -m prism_challenge.manifest.results --write-schema"

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]
ShapeKey = Annotated[str, Field(pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")]  # a rank slice's "BxT" (prism_challenge.score.flops)
Status = Literal["scored", "failed", "cancelled"]
StopReason = Literal["", "token_budget", "byte_budget", "step_budget", "wall_clock_budget", "stream_exhausted",
                     "loop_stopped", "stalled", "failed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Tool(_Model):
    """The harness that wrote the manifest."""

    name: Literal["prism-challenge"]
    version: str


class Failure(_Model):
    """Why the run was not scored: ``stage`` and ``cause`` select the row of
    :data:`prism_challenge.failures.FAILURE_KINDS` that gives ``kind``."""

    stage: str
    message: str
    detail: str = ""
    kind: FailureKind
    cause: str = ""


class BundleInfo(_Model):
    """The bundle as given (``path``) and as frozen at intake (hashes of the code that ran);
    only ``path`` is known for a bundle refused at intake."""

    path: str
    sha256: Sha256 | None = None
    files: dict[str, Sha256] | None = None
    architecture: str | None = None  # "file.py:symbol"
    training: str | None = None


class Finding(_Model):
    """One gate finding (``prism_challenge.gates.findings.Finding``)."""

    rule: str
    file: str
    line: Count
    col: Count
    message: str
    blocking: bool


class Gates(_Model):
    """The static gates' findings and the parameter cap's count (``None``: the gate did not run)."""

    findings: list[Finding]
    parameter_count: Count | None


class DataSource(BaseModel):
    """The data MANIFEST's ``source`` record: ``kind`` plus keys of that kind (extra allowed)."""

    model_config = ConfigDict(extra="allow")
    kind: str


class DataInfo(_Model):
    """The locked data directory the stream was cut from."""

    dir: str
    manifest_sha256: Sha256
    source: DataSource | None
    split: Literal["train"]


class TokenizerInfo(_Model):
    """The reference tokenizer (``sha256`` of its pinned files)."""

    name: str
    sha256: Sha256
    vocab_size: Annotated[int, Field(gt=0)]
    eot_token: Count


class VerdictPolicy(_Model):
    """The :class:`~prism_challenge.score.verdict.Policy` the run's verdict was computed under (its
    fields, as the dataclass names them), so ``prism verify`` recomputes the verdict with it."""

    tail_fraction: float
    gap_z: float
    gap_floor_bpb: float
    gap_penalty: float
    anomaly_ratio: float
    significance_p: float | None = None  # the crown rule's level (absent before issue 29)
    rank_epsilon_bpb: float | None = None  # the tie width before issue 29 (never a verdict figure)
    confirm_top_n: Annotated[int, Field(ge=0)] | None = None  # absent before issue 29
    confirm_runs: Annotated[int, Field(ge=1)] | None = None


class RunConfig(_Model):
    """What the model was built with: ``ctx.max_seq_len``, the parameter cap, threads per rank,
    and the scoring precision (:mod:`prism_challenge.score.scoringprecision`): ``scoring_autocast``
    (the autocast dtype of the scoring forwards; absent before it existed), where it came from
    (``scoring_autocast_source``: ``prism.yaml``'s, or the profile's) and the attention kernels
    of the scoring forwards (``scoring_sdpa``, in priority order); the last two absent before
    issue 26."""

    sequence_length: Annotated[int, Field(ge=2)]
    max_parameters: Annotated[int, Field(ge=1)]
    threads: Annotated[int, Field(ge=1)]
    scoring_autocast: Literal["fp32", "bf16", "fp16"] | None = None
    scoring_autocast_source: Literal["bundle", "profile"] | None = None
    scoring_sdpa: list[str] | None = None
    policy: VerdictPolicy | None = None  # the verdict's policy (absent before issue 25's verify recomputed it)


class GpuStack(_Model):
    """``compute.gpu``: the GPU stack the jailed CUDA check saw (every field ``None`` on CPU),
    and each rank's peak allocated and reserved device bytes (keys ``"0"``, ``"1"``...)."""

    device: Literal["cpu", "cuda"]
    gpu_model: str | None = None
    gpu_models: list[str] | None = None
    gpu_count: Count | None = None
    compute_capability: str | None = None
    memory_bytes: Count | None = None
    driver: str | None = None
    cuda_runtime: str | None = None
    cudnn: int | None = None
    nccl: str | None = None
    peak_allocated_bytes: dict[str, Count | None] = Field(default_factory=dict)
    peak_reserved_bytes: dict[str, Count | None] = Field(default_factory=dict)


class Budgets(_Model):
    """The stream's budgets (``None``: none); ``wall_clock_budget_s`` counts from the gates' release."""

    token_budget: Count | None = None
    byte_budget: Count | None = None
    step_budget: Count | None = None
    wall_clock_budget_s: Seconds | None = None


class Compute(_Model):
    """Where it ran; ``peak_*_bytes`` of memory per rank (keys ``"0"``, ``"1"``...); ``launcher``:
    the agent that started the ranks (``"single"``: one rank under
    :mod:`~prism_challenge.evaluator.single`; ``"torchrun"``, also every manifest written before
    that agent existed). What the run spent (:mod:`~prism_challenge.score.flops`): FLOPs per rank
    slice shape ``"BxT"``, the training estimate, wall seconds and device-seconds (``None``
    before issue 29; ``flops_error`` says why a count is missing)."""

    torch_version: str
    python: str
    platform: str
    device: Literal["cpu", "cuda"]
    world_size: Annotated[int, Field(ge=1)]
    nproc_per_node: Annotated[int, Field(ge=1)]
    nnodes: Literal[1]
    warm_ranks: bool
    launcher: Literal["single", "torchrun"] = "torchrun"
    device_name: str | None
    peak_rss_bytes: dict[str, Count | None]
    peak_device_bytes: dict[str, Count | None]
    parent_peak_rss_bytes: Count
    # what the run spent (prism_challenge.score.flops; absent before issue 29): FLOPs of one scoring
    # forward per rank slice shape "BxT", counted in the audit's re-scoring child; slices scored per
    # shape; 3 x their forward FLOPs; seconds of the stream (release to last record) and of the run;
    # stream seconds x ranks; the count's own seconds; how it was counted; why there is no count
    forward_flops_per_batch: dict[ShapeKey, Count] | None = None
    batches_per_shape: dict[ShapeKey, Count] | None = None
    training_flops_estimate: Count | None = None
    stream_wall_s: Seconds | None = None
    run_wall_s: Seconds | None = None
    device_seconds: Seconds | None = None
    flops_count_s: Seconds | None = None
    flops_method: str | None = None
    flops_error: str | None = None
    gpu: GpuStack | None = None


class ModelInfo(_Model):
    """The scored model: unique parameter and buffer elements, its ``state_dict``'s sha256 per rank."""

    parameter_count: Count | None
    state_sha256: Sha256 | None
    state_sha256_per_rank: dict[str, Sha256 | None]
    state_path: str | None


class Stream(_Model):
    """What the feeder served and recorded: global batches, stream tokens, scored targets, bytes."""

    stop_reason: StopReason
    batches: Count
    tokens: Count
    targets: Count
    bytes: Count


class Score(_Model):
    """The prequential score: ``prequential_bpb = total_bits / bytes`` (bits per UTF-8 byte)."""

    total_nats: float
    total_bits: float
    targets: Count
    bytes: Count
    prequential_bpb: float
    nonfinite_batches: Count


class ReferenceCodes(_Model):
    """What general-purpose compressors make of the text the run scored
    (:mod:`prism_challenge.data.refcodes`): the first ``bytes`` bytes (``score.bytes``) of the
    concatenation of the train split's documents' UTF-8 bytes in stream order, its sha256, and
    each compressor's code length in bits per byte (``8 * compressed bytes / bytes``, the
    prequential bpb's denominator): zstd at level 19, xz at preset ``9 | PRESET_EXTREME``, gzip
    at level 9."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    bytes: Annotated[int, Field(gt=0)]
    text_sha256: Sha256
    zstd_19: Annotated[float, Field(ge=0, alias="zstd-19")]
    xz_9e: Annotated[float, Field(ge=0, alias="xz-9e")]
    gzip_9: Annotated[float, Field(ge=0, alias="gzip-9")]


class Curve(_Model):
    """Per scored batch: nats per target, cumulative targets, cumulative bytes (equal lengths)."""

    nats_per_target: list[float]
    cumulative_targets: list[Count]
    cumulative_bytes: list[Count]

    @model_validator(mode="after")
    def _same_length(self) -> Curve:
        if not len(self.nats_per_target) == len(self.cumulative_targets) == len(self.cumulative_bytes):
            raise ValueError("curve: nats_per_target, cumulative_targets and cumulative_bytes differ in length")
        return self


class Timing(_Model):
    """Wall-clock figures (s) from torchrun's launch, the gates' release and the call's start;
    ``last_record_unix`` is a Unix time (s)."""

    gates_s: Seconds
    launch_to_release_s: Seconds
    launch_to_ready_s: Seconds | None
    launch_to_first_batch_s: Seconds | None
    launch_to_last_record_s: Seconds | None
    release_to_first_batch_s: float | None
    release_to_last_record_s: float | None
    start_to_last_record_s: Seconds | None = None
    last_record_unix: float | None = None
    after_stream_s: float | None
    heldout_s: Seconds
    wall_s: Seconds


class ProfileRecord(_Model):
    """The challenge profile (``sha256`` of its TOML file) and the fields set otherwise."""

    name: str
    version: int
    sha256: Sha256
    overridden: list[str]
    data_mismatch: list[str] | None = None


class Limits(_Model):
    """rlimits of every jailed process (``None``: not limited)."""

    address_space_bytes: Count | None
    max_processes: Count | None
    max_file_bytes: Count | None
    max_open_files: Count | None
    memory_bytes: Count | None = None  # the cgroup's memory.max per jailed tree (CPU and CUDA)


class GuardInfo(_Model):
    """The parent's guard: artifacts quota and peak, task cap and peak, why it stopped the run."""

    uid: int | None
    quota_bytes: Count | None
    peak_bytes: Count
    max_processes: Count | None
    peak_tasks: Count
    reason: str | None


class Isolation(_Model):
    """The jail of the run (``evaluator/jail.py``) and the guard; ``warning`` only without a sandbox."""

    mode: Literal["strict", "none"]
    isolated: bool
    backend: str | None
    uid: int | None = None
    hidden: list[str]
    limits: Limits
    tmp_bytes: Count | None = None  # the sandbox's private /tmp and /dev/shm sizes
    shm_bytes: Count | None = None
    memory_limit_by: Literal["rlimit", "cgroup", "none"] = "rlimit"
    memory_warning: str | None = None  # only when nothing held the memory (CUDA without a cgroup v2 memory controller)
    audit_hooks: bool = True
    audit_exit_code: int | None = None
    guard: GuardInfo
    warning: str | None = None


class Heldout(_Model):
    """The held-out figures (``heldout_delta = val_bpb_twin - val_bpb_trained``, bpb)."""

    val_bpb_twin: float | None
    val_bpb_trained: float | None
    heldout_delta: float | None
    targets: Count
    bytes: Count
    nats_twin: float | None
    nats_trained: float | None
    nonfinite_batches_twin: Count
    nonfinite_batches_trained: Count
    batches: Count
    split: str
    max_bytes: Count
    parameter_count: Count | None
    blind_probes: Count
    wall_s: Seconds
    batch_bytes: list[Count] | None = None  # per val batch (absent in manifests before the measured gap threshold)
    batch_nats_twin: list[float | None] | None = None
    batch_nats_trained: list[float | None] | None = None


class MemorizationNoise(_Model):
    """``prism_challenge.score.gapnoise.GapNoise`` plus ``gap_over_se``: the gap's measured standard
    error and the threshold ``max(floor_bpb, z * se_gap_bpb)`` it set (bpb)."""

    se_tail_bpb: float | None
    se_val_bpb: float | None
    se_gap_bpb: float | None
    tail_units: Count
    val_units: Count
    rule: str
    z: float
    floor_bpb: float
    threshold_bpb: float
    gap_over_se: float | None


class Verdict(_Model):
    """``prism_challenge.score.verdict.Verdict`` (non-finite floats written as ``null``):
    ``final_score = anti_cheat_multiplier * memorization_penalty / (1 + prequential_bpb)``;
    ``memorization_threshold`` is the run's own (a fixed policy value in older manifests)."""

    prequential_bpb: float
    tail_bpb: float | None
    tail_fraction: float
    first_batch_nats_per_target: float | None
    anomaly_threshold_nats: float
    anomaly_flagged: bool
    anti_cheat_multiplier: float
    heldout: Heldout | None
    heldout_error: str | None
    memorization_gap: float | None
    memorization_threshold: float
    memorization_flagged: bool
    memorization_penalty: float
    final_score: float
    flags: list[str]
    memorization_se_bpb: float | None = None  # absent in manifests before the measured threshold
    memorization_noise: MemorizationNoise | None = None


class AuditBatch(_Model):
    """One audited batch: its recorded and re-scored nats, per rank (``null``: not finite)."""

    step: Count
    snapshot_sha256: Sha256 | None
    inputs_sha256: Sha256
    recorded_nats: list[float | None]
    rescored_nats: list[float | None]
    match: bool


class AuditSchedule(_Model):
    """How the audited batches were drawn (:mod:`prism_challenge.evaluator.auditplan`): rule
    ``harmonic``: batch 0, then batch ``k`` with probability ``min(1, A / k)``, keyed on the
    manifest's ``run_secret``; ``audited_batches`` is ``A``."""

    rule: Literal["harmonic"]
    audited_batches: Count


class Audit(_Model):
    """The audit (:mod:`prism_challenge.audit.rescore`): audited batches re-scored from their weight
    snapshots in fresh processes, and their blind probes. ``passed`` false zeroes the run.
    ``schedule``: absent in manifests before issue 25, which hold instead the budget-derived
    ``rate`` and ``expected_batches`` (both absent or ``null`` since)."""

    audited_batches_target: Count
    schedule: AuditSchedule | None = None
    rate: float | None = None
    expected_batches: Count | None = None
    rtol: float
    shape: list[Count] | None
    context: dict[str, int | str | None]
    batches: list[AuditBatch]
    blind_probes: Count
    probe_skipped: str | None
    mismatch: str | None
    error: str | None
    passed: bool
    wall_s: Seconds


class Certificate(_Model):
    """The run certificate (:mod:`prism_challenge.manifest.certificate`): an ed25519 signature over the
    RFC 8785 canonical form of the manifest without this field."""

    alg: Literal["ed25519"]
    canonicalization: Literal["RFC 8785"]
    public_key: str  # base64 of the raw 32-byte public key
    key_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]  # sha256(public key)[:16 hex]
    signature: str  # base64 of the 64-byte signature


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
