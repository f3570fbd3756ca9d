"""The run's typed context: :class:`Run`, which every stage of :func:`~prism_challenge.pipeline.evaluate`
reads and fills in turn, the :class:`Sandbox` of one run, and the :class:`EvalOutcome` it returns.

Imports nothing that imports torch: :mod:`prism_challenge.pipeline` launches the ranks before the
parent process imports torch (:mod:`~prism_challenge.pipeline.start`).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge.control import RunControl
from prism_challenge.evaluator.isolation import Guard
from prism_challenge.evaluator.jail import Jail
from prism_challenge.failures import EvalFailure
from prism_challenge.gates.stage import Gated
from prism_challenge.intake.bundle import Bundle
from prism_challenge.intake.frozen import FrozenBundle
from prism_challenge.options import EvalOptions

if TYPE_CHECKING:  # these import torch; the annotations are strings (PEP 563)
    from prism_challenge.evaluator.feeder import Feeder, FeederResult
    from prism_challenge.evaluator.gpu import CudaCheck
    from prism_challenge.score.scoring import Score


@dataclass
class EvalOutcome:
    """What ``prism eval`` produced: the manifest (written to ``run_dir``) and the score."""

    run_dir: Path
    manifest: dict[str, Any]
    score: Score | None
    failure: EvalFailure | None = None
    gate_findings: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None



NO_ISOLATION_WARNING = (
    "--isolation none: the submission ran unsandboxed, with this user's network, files and privileges; "
    "this run is not tamper-resistant and must not be ranked"
)


@dataclass
class Sandbox:
    """The isolation of one run: the jail every child starts in, and the parent's guard."""

    jail: Jail
    guard: Guard

    @property
    def mode(self) -> str:
        return self.jail.mode

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.jail.summary(), "guard": self.guard.summary()}
        if self.mode == "none":
            out["warning"] = NO_ISOLATION_WARNING
        return out


@dataclass
class Run:
    """One run's shared state, filled in stage by stage (:func:`prism_challenge.pipeline._run_bundle`): what intake gave,
    what each stage made, and the times the manifest's ``timing`` reads."""

    opts: EvalOptions
    control: RunControl
    bundle: Bundle
    frozen: FrozenBundle
    device: str
    t_start: float
    signing_key: Ed25519PrivateKey
    # the data stage
    tokenizer: Any = None
    data: Any = None
    chunks: Any = None
    profile_record: dict[str, Any] | None = None
    # the launch
    run_dir: Path = Path()
    fresh_dir: bool = False
    artifacts: Path = Path()
    sock_path: str = ""
    sock_tmp: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    key: bytes = b""
    server: socket.socket | None = None  # the feeder's listening socket, until the feeder owns it
    token: str = ""  # the token every rank's HELLO carries
    imports: threading.Thread | None = None  # torch and the later stages, imported meanwhile
    feeder: Feeder | None = None
    sandbox: Sandbox | None = None
    proc: Any = None
    log_path: Path = Path()
    t_launch: float = 0.0
    cuda_check: CudaCheck | None = None
    # the gates and the stream
    gated: Gated = field(default_factory=lambda: Gated([], None, 0.0))
    stack: Any = None
    t_release: float = 0.0
    cpu_release: Any = None
    t_end: float = 0.0
    result: FeederResult | None = None
    killed_by: str | None = None
    harness_killed: bool = False
    # the score and after
    failure: EvalFailure | None = None
    score: Score | None = None
    state_path: Path | None = None
    audit: Any = None
    verdict: Any = None
    reference_codes: Any = None
