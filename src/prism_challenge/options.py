"""The settings of one scored run, and the one place they are validated.

:class:`EvalOptions` is what ``prism eval`` and library callers (``from prism_challenge import
evaluate, EvalOptions``) pass to the pipeline. Every value is checked when the options are built
(:meth:`EvalOptions.validate`, called by ``__post_init__`` and again by
:func:`prism_challenge.api.evaluate`) against :data:`RULES`, the one table of ranges, which the
command line's argparse types use too (:func:`check_field`). A bad value raises
:class:`OptionsError` naming the field and the rule; ``prism eval`` turns it into a usage error
(exit 2). What depends on the machine or the filesystem (``--device cuda`` without CUDA, a
non-empty ``--out``) is checked by the pipeline itself, at stage ``config``.

This module imports neither torch nor numpy.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from prism_challenge.evaluator.jail import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_OPEN_FILES,
    default_memory_limit,
)
from prism_challenge.evaluator.auditplan import AUDITED_BATCHES
from prism_challenge.evaluator.launcher import MAX_NPROC
from prism_challenge.evaluator.protocol import MAX_BATCH_TOKENS
from prism_challenge.intake.spec import SCORING_AUTOCAST
from prism_challenge.profiles import Profile
from prism_challenge.score.verdict import Policy

DEFAULT_SEED = 1234
DEFAULT_SEQ_LEN = 256
DEFAULT_MAX_PARAMETERS = 150_000_000
DEFAULT_THREADS = 2
DEFAULT_RANK_TIMEOUT_S = 120.0  # a rank silent this long while another rank is ahead fails the run
DEFAULT_IDLE_TIMEOUT_S = 1800.0  # world size 1: silent this long after a batch -> stopped, scored
DEFAULT_MEMORY_LIMIT = default_memory_limit()  # per process on CPU: 32 GiB, never above the host's memory
DEFAULT_ARTIFACTS_QUOTA = 4 << 30
DEFAULT_HELDOUT_BYTES = 200_000
DEFAULT_HELDOUT_TIMEOUT_S = 600.0
MAX_THREADS = 256  # CPU threads per rank (the sandbox allows 1024 tasks in all)
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a signed 64-bit seed
MAX_HELDOUT_BYTES = 1 << 40
DEVICES = ("auto", "cpu", "cuda")
ISOLATION_MODES = ("strict", "none")


class OptionsError(ValueError):
    """A setting of :class:`EvalOptions` breaks its rule.

    Attributes:
        field: the :class:`EvalOptions` field (``"seq_len"``).
        value: the value refused.
        rule: what the value must be (``"must be between 2 and 16777216"``).
    """

    def __init__(self, field_name: str, value: Any, rule: str):
        super().__init__(f"{field_name} = {value!r}: {rule}")
        self.field, self.value, self.rule = field_name, value, rule


@dataclass(frozen=True)
class Rule:
    """The range of one numeric setting.

    Attributes:
        kind: ``int`` or ``float`` (an ``int`` is accepted for a ``float`` and converted; a
            ``bool`` never is a number here).
        low: the smallest value allowed; ``None``: any positive finite number.
        high: the largest value allowed, or ``None``.
        unit: words after the range in the message (``" processes on one node"``).
        nullable: ``None`` is allowed (no budget, no limit).
    """

    kind: type
    low: float | None
    high: float | None = None
    unit: str = ""
    nullable: bool = False

    def text(self) -> str:
        """The rule in words: ``"must be between 2 and 16777216"``."""
        if self.low is None:
            return "must be a positive finite number"
        if self.high is None:
            return f"must be at least {self.low}{self.unit}"
        return f"must be between {self.low} and {self.high}{self.unit}"

    def check(self, value: Any) -> Any:
        """``value`` (a float for a float rule) when it obeys the rule.

        Raises:
            ValueError: with the rule's words (:meth:`text`, or the type that was expected).
        """
        if value is None and self.nullable:
            return None
        ok_types = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            raise ValueError("must be an integer" if self.kind is int else "must be a number")
        if self.low is None:
            if not (math.isfinite(value) and value > 0):
                raise ValueError(self.text())
        elif not (math.isfinite(value) and self.low <= value <= (self.high if self.high is not None else value)):
            raise ValueError(self.text())
        return float(value) if self.kind is float else value


RULES: dict[str, Rule] = {
    "seed": Rule(int, 0, MAX_SEED),
    "seq_len": Rule(int, 2, MAX_BATCH_TOKENS),
    "token_budget": Rule(int, 1, nullable=True),
    "byte_budget": Rule(int, 1, nullable=True),
    "step_budget": Rule(int, 1, nullable=True),
    "wall_clock_budget": Rule(float, None, nullable=True),  # finite: inf would reach the manifest as Infinity
    "nproc": Rule(int, 1, MAX_NPROC, " processes on one node"),
    "nnodes": Rule(int, 1, 1, " (PRISM runs on a single node)"),
    "threads": Rule(int, 1, MAX_THREADS),
    "max_parameters": Rule(int, 1),
    "rank_timeout": Rule(float, None),
    "idle_timeout": Rule(float, None),
    "memory_limit_bytes": Rule(int, 1, nullable=True),
    "max_processes": Rule(int, 1, nullable=True),
    "max_file_bytes": Rule(int, 1, nullable=True),
    "max_open_files": Rule(int, 1, nullable=True),
    "artifacts_quota_bytes": Rule(int, 1, nullable=True),
    "heldout_bytes": Rule(int, 0, MAX_HELDOUT_BYTES),
    "heldout_timeout": Rule(float, None),
    "audited_batches": Rule(int, 0, 100_000),
}
"""The range of every numeric field of :class:`EvalOptions` (defined once: the command line's
argparse types call :func:`check_field` with the same rules)."""

CHOICES: dict[str, tuple[str, ...]] = {"device": DEVICES, "isolation": ISOLATION_MODES,
                                       "scoring_autocast": SCORING_AUTOCAST}
FLAGS = ("run_gates", "static_gates", "audit_hooks", "warm_ranks", "profile_phases")


def check_field(name: str, value: Any) -> Any:
    """``value`` checked against the rule of field ``name`` (a float field's int made a float).

    Raises:
        OptionsError: naming the field and the rule.
    """
    try:
        if name in RULES:
            return RULES[name].check(value)
        if name in CHOICES:
            if value not in CHOICES[name]:
                raise ValueError(f"must be one of {', '.join(CHOICES[name])}")
            return value
        if name in FLAGS:
            if not isinstance(value, bool):
                raise ValueError("must be True or False")
            return value
    except ValueError as exc:
        raise OptionsError(name, value, str(exc)) from None
    return value


def _path(name: str, value: Any, *, nullable: bool) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise OptionsError(name, value, "must be a non-empty path" + (" or None" if nullable else ""))
    return os.fspath(value)


@dataclass
class EvalOptions:
    """Settings of one scored run (the challenge's side: data, seed, order, budgets).

    Budgets: ``token_budget`` (stream tokens), ``byte_budget`` (UTF-8 bytes: the stream stops at
    the first batch boundary at or past it, so runs with different tokenizers cover the same
    text), ``step_budget`` (global batches),
    ``wall_clock_budget`` (seconds from the gates' release; graceful: the stream stops and what
    was scored is scored; the tree is killed ``WATCHDOG_GRACE_S`` later if it has not ended).
    Stalls: at world size 1 a rank that took a batch and then sends nothing for
    ``idle_timeout`` s (an endless loop) is stopped and the run scored on what was scored; at
    world size > 1 a rank silent for ``rank_timeout`` s while another is ahead fails the run.

    Isolation: ``"strict"`` (default) runs torchrun and every rank in a sandbox (no network,
    read-only filesystem but the artifacts directory, data and caches hidden, resource limits:
    ``memory_limit_bytes`` per process, ``max_processes`` tasks (``None``: the layout's, from
    :func:`~prism_challenge.evaluator.sizing.run_sizes`, which also sizes ``/tmp`` and
    ``/dev/shm``), ``max_file_bytes`` per file,
    ``max_open_files``, ``artifacts_quota_bytes`` in all); ``"none"`` for local work only.
    Held-out: the first ``heldout_bytes`` UTF-8 bytes (whole documents) of the val split.
    ``audited_batches``: ``A`` of the harmonic audit schedule (batch 0, then batch ``k`` with
    probability ``min(1, A / k)``; a cheat on a fraction ``f`` of the batches escapes with
    probability at most ``(1 - f)^A``: :mod:`~prism_challenge.evaluator.auditplan`;
    ``heldout_timeout`` bounds the audit's children too); 0 turns the audit off (benchmarks
    only: an unaudited run takes the submission's word for its records).
    ``scoring_autocast``: the autocast dtype of the harness's scoring forwards (``fp32``: none,
    ``bf16``, ``fp16``) for a bundle whose ``prism.yaml`` declares no ``scoring_autocast`` (a
    declared one wins); the profile's ``[scoring] autocast``.
    ``warm_ranks``: start each rank's process (interpreter, ``import torch``) while the gates run:
    one rank under the single-rank agent (:mod:`~prism_challenge.evaluator.single`), several for
    torchrun's workers to claim (:mod:`~prism_challenge.evaluator.warm`); ``False`` starts
    every rank cold, after torchrun's agent (``bench/overhead.py --cold-ranks`` compares them).
    ``profile_phases``: benchmarks: each rank times its stream's phases
    (:mod:`~prism_challenge.evaluator.phases`), written with the parent's CPU time to the run's
    ``logs/phases.json``; the score is unchanged.
    ``profile``: the challenge profile the settings came from (:mod:`~prism_challenge.profiles`;
    its data pin and allowed tokenizers are checked), ``profile_overridden`` the fields set
    otherwise; both are recorded in the manifest's ``profile``.

    ``run_secret``: the run's 32-byte secret, which keys every draw the submission must not
    predict (the audit schedule, the causality probes, the blind probes); ``None`` (always, in
    the service) draws a fresh one from :mod:`secrets` after intake. It never enters the
    sandbox and is revealed in the manifest (``run_secret``) once the run has ended; pass a
    revealed one back only to repeat that run exactly (``prism verify --reexecute``).
    ``signing_key_file``: the ed25519 private key (PEM, mode 0600) that signs the manifest
    (:mod:`~prism_challenge.manifest.certificate`); ``None``: the user's own key, created on first use.

    Test-only switches (never exposed on the command line): ``run_gates=False`` skips every gate,
    ``static_gates=False`` only the static ones (the parameter child still runs, in the jail),
    ``audit_hooks=False`` leaves the children's audit hooks unarmed; they exist to show that each
    layer behind the gate (the audit hooks, the sandbox) stops a bundle the gate would have.

    Raises:
        OptionsError: on construction (and :meth:`validate`), a value that breaks its rule
            (:data:`RULES`, :data:`CHOICES`).
    """

    bundle: str
    data_dir: str | None = None
    out_dir: str | None = None
    seed: int = DEFAULT_SEED
    seq_len: int = DEFAULT_SEQ_LEN
    token_budget: int | None = None
    byte_budget: int | None = None
    step_budget: int | None = None
    wall_clock_budget: float | None = None
    nproc: int = 1
    nnodes: int = 1
    device: str = "auto"
    threads: int = DEFAULT_THREADS
    max_parameters: int = DEFAULT_MAX_PARAMETERS
    run_gates: bool = True
    static_gates: bool = True
    audit_hooks: bool = True
    rank_timeout: float = DEFAULT_RANK_TIMEOUT_S
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S
    isolation: str = "strict"
    memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT
    max_processes: int | None = None
    max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES
    max_open_files: int | None = DEFAULT_MAX_OPEN_FILES
    artifacts_quota_bytes: int | None = DEFAULT_ARTIFACTS_QUOTA
    heldout_bytes: int = DEFAULT_HELDOUT_BYTES
    heldout_timeout: float = DEFAULT_HELDOUT_TIMEOUT_S
    audited_batches: int = AUDITED_BATCHES
    policy: Policy = field(default_factory=Policy)
    scoring_autocast: str = "fp32"
    warm_ranks: bool = True
    profile_phases: bool = False
    profile: Profile | None = None
    profile_overridden: list[str] = field(default_factory=list)
    run_secret: bytes | None = None
    signing_key_file: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> EvalOptions:
        """Check every field (and normalize: paths to ``str``, float fields to ``float``);
        returns ``self``.

        Raises:
            OptionsError: the first field, in declaration order, that breaks its rule.
        """
        self.bundle = _path("bundle", self.bundle, nullable=False)
        self.data_dir = _path("data_dir", self.data_dir, nullable=True)
        self.out_dir = _path("out_dir", self.out_dir, nullable=True)
        for f in dataclasses.fields(self):
            if f.name in RULES or f.name in CHOICES or f.name in FLAGS:
                object.__setattr__(self, f.name, check_field(f.name, getattr(self, f.name)))
        if not isinstance(self.policy, Policy):
            raise OptionsError("policy", self.policy, "must be a prism_challenge.score.verdict.Policy")
        if self.profile is not None and not isinstance(self.profile, Profile):
            raise OptionsError("profile", self.profile, "must be a prism_challenge.profiles.Profile or None")
        if self.run_secret is not None and not (isinstance(self.run_secret, bytes) and len(self.run_secret) == 32):
            raise OptionsError("run_secret", self.run_secret, "must be 32 bytes or None (None: drawn from secrets per run)")
        self.signing_key_file = _path("signing_key_file", self.signing_key_file, nullable=True)
        if not isinstance(self.profile_overridden, list) or not all(isinstance(x, str) for x in self.profile_overridden):
            raise OptionsError("profile_overridden", self.profile_overridden, "must be a list of field names")
        return self
