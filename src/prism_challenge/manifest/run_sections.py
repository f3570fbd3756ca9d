"""The manifest's sections that record what a run was given and where it ran.

The tool, the failure, the bundle, the gates, the data and tokenizer, the configuration and
budgets, the compute and the model, the profile and the isolation: one pydantic model per
section of :class:`~prism_challenge.manifest.results.RunManifest`, as its JSON schema names them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from prism_challenge.failures import FailureKind
from prism_challenge.manifest.fields import Count, Seconds, Sha256, ShapeKey, _Model


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
