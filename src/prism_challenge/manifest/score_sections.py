"""The manifest's sections that record what a run measured and how it was checked.

The stream, the score and its curve, the reference codes, the timing, the held-out figures and
the verdict, the audit and the certificate: one pydantic model per section of
:class:`~prism_challenge.manifest.results.RunManifest`, as its JSON schema names them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from prism_challenge.manifest.fields import Count, Seconds, Sha256, StopReason, _Model


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
    page_cache: str | None = None  # emptied before the blind probe child, or why not (evaluator/pagecache.py)


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
    page_cache: str | None = None  # emptied before each blind probe child, or why not (evaluator/pagecache.py)


class Certificate(_Model):
    """The run certificate (:mod:`prism_challenge.manifest.certificate`): an ed25519 signature over the
    RFC 8785 canonical form of the manifest without this field."""

    alg: Literal["ed25519"]
    canonicalization: Literal["RFC 8785"]
    public_key: str  # base64 of the raw 32-byte public key
    key_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]  # sha256(public key)[:16 hex]
    signature: str  # base64 of the 64-byte signature
