"""The kind of every failure: whose fault it is, and whether a retry can help.

One table, :data:`FAILURE_KINDS`, maps each stage (and, where one stage has causes of both
kinds, the cause) to its kind:

- ``submission``: final. The bundle's fault (intake, gates, contract, an exception in its code,
  the audit hook, a resource limit it exceeded); the same bundle fails the same way again.
- ``infrastructure``: retryable. The machine's or the operator's (no sandbox, data missing,
  disk full, the run killed from outside); a retry elsewhere or later can succeed. A caller
  that retries must cap its attempts.
- ``cancelled``: the caller stopped the run (``evaluate(..., cancel=...)``).

A failure the runner reports from inside a rank is always ``submission``, whatever stage it
names (cause :data:`REPORTED`): that report comes from the submission's own process, so a
bundle that got past the gate could name any stage, and must not earn a retry by naming
``data``. The table of stages and kinds in docs/library.md is generated from this table
(:func:`markdown_table`; a test checks that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SUBMISSION = "submission"
INFRASTRUCTURE = "infrastructure"
CANCELLED = "cancelled"
FailureKind = Literal["submission", "infrastructure", "cancelled"]
KINDS: tuple[str, ...] = (SUBMISSION, INFRASTRUCTURE, CANCELLED)

USAGE_STAGE = "config"
"""The stage of a bad command line or an option the machine cannot honour (``--nproc 9``, a
non-empty ``--out``, ``--device cuda`` without CUDA); ``prism eval`` exits 2 for it, 1 for every
other failure."""
ANY_CAUSE = ""
REPORTED = "reported"  # the runner, inside a rank, reported the failure (any stage it names)
KILLED = "killed"  # the launcher (torchrun, or the single-rank agent) ended on a signal the harness did not send
TOKENIZER = "tokenizer"  # prism.yaml names a tokenizer the profile does not allow
DRIFT = "drift"  # the ranks' final states differ in their last bits only (feedchecks._check_states)
ANY_STAGE = "*"


@dataclass(frozen=True)
class StageKind:
    """One row of :data:`FAILURE_KINDS`.

    Attributes:
        stage: the failure's ``stage`` (:data:`ANY_STAGE` for a row keyed by cause alone).
        cause: the failure's ``cause``, or :data:`ANY_CAUSE` for every other cause.
        kind: ``submission``, ``infrastructure`` or ``cancelled``.
        meaning: what fails there, in words (docs/library.md's table).
    """

    stage: str
    cause: str
    kind: str
    meaning: str


FAILURE_KINDS: tuple[StageKind, ...] = (
    StageKind("config", ANY_CAUSE, INFRASTRUCTURE,
              "an option this machine or its filesystem cannot honour: `--device cuda` without CUDA, an `--out` "
              "that is not an empty directory, a profile that needs `--data`"),
    StageKind("config", TOKENIZER, SUBMISSION, "`prism.yaml` names a tokenizer the profile does not allow"),
    StageKind("intake", ANY_CAUSE, SUBMISSION,
              "the bundle cannot be read or holds what a bundle may not (file kinds, sizes, bytecode, module "
              "names, `prism.yaml`)"),
    StageKind("gates", ANY_CAUSE, SUBMISSION, "a blocking finding of the static gates or of the parameter cap"),
    StageKind("data", ANY_CAUSE, INFRASTRUCTURE, "the data directory is missing, fails its hashes or cannot be read"),
    StageKind("isolation", ANY_CAUSE, INFRASTRUCTURE, "strict isolation is not available on this host"),
    StageKind("contract", ANY_CAUSE, SUBMISSION,
              "the loop or the model broke the contract: the audit hook refused an event, no batch was scored, "
              "the scored model is over the cap, the frozen bundle changed"),
    StageKind("resources", ANY_CAUSE, SUBMISSION,
              "the bundle's processes reached a limit: memory, tasks, file size, the artifacts quota"),
    StageKind("consistency", ANY_CAUSE, SUBMISSION,
              "the ranks disagree: different final `state_dict` digests, or a rank out of step with the others"),
    StageKind("consistency", DRIFT, INFRASTRUCTURE,
              "the ranks' final states differ in their last bits only (each differing tensor's moments, the sums "
              "of x, of absolute values, of squares and a signed sum, agree to `statedict.DRIFT_RTOL`): the CPU's "
              "kernels, not the loop; a retry runs it again on the run's seed"),
    StageKind("budget", ANY_CAUSE, SUBMISSION, "no batch was scored before the wall-clock budget ran out"),
    StageKind("runner", ANY_CAUSE, SUBMISSION,
              "a rank ended, or broke the protocol, without a report: the submission's process died"),
    StageKind("runner", KILLED, INFRASTRUCTURE,
              "the launcher (torchrun, or the single-rank agent) ended on a signal the harness did not send: "
              "the run was killed from outside"),
    StageKind("scoring", ANY_CAUSE, SUBMISSION, "the records cannot be scored: no bytes covered, a non-finite total"),
    StageKind("storage", ANY_CAUSE, INFRASTRUCTURE,
              "the harness could not write the run directory or the scored state: disk full, quota, permissions"),
    StageKind("dispatch", ANY_CAUSE, INFRASTRUCTURE,
              "the service lost the evaluation: its Ray worker or node died, its actor was gone after a restart, "
              "the bundle's stored bytes could not be read, or the harness raised on the node"),
    StageKind("cancelled", ANY_CAUSE, CANCELLED, "the caller cancelled the run; its process tree was killed"),
    StageKind(ANY_STAGE, REPORTED, SUBMISSION,
              "a failure the runner reported from inside a rank (stages `setup`, `import`, `train`, `state`, ...): "
              "an exception in the submission's code"),
)
"""Every stage and cause a failure can have, with its kind (defined once)."""

_BY_KEY = {(row.stage, row.cause): row for row in FAILURE_KINDS}


class UnknownStage(KeyError):
    """A failure at a stage and cause :data:`FAILURE_KINDS` does not list (a harness bug)."""


def kind_of(stage: str, cause: str = ANY_CAUSE) -> str:
    """The kind of a failure at ``stage`` with ``cause``.

    Lookup order: ``(stage, cause)``, then ``(ANY_STAGE, cause)``, then ``(stage, ANY_CAUSE)``.

    Raises:
        UnknownStage: neither the stage nor the cause is in the table.
    """
    for key in ((stage, cause), (ANY_STAGE, cause), (stage, ANY_CAUSE)):
        if key in _BY_KEY:
            return _BY_KEY[key].kind
    raise UnknownStage(f"failure stage {stage!r} (cause {cause!r}) is not in prism_challenge.failures.FAILURE_KINDS")


def retryable(kind: str) -> bool:
    """Whether a failure of ``kind`` may succeed on a retry (``infrastructure`` only)."""
    return kind == INFRASTRUCTURE


def markdown_table() -> str:
    """:data:`FAILURE_KINDS` as docs/library.md's Markdown table (stage, cause, kind, meaning)."""
    lines = ["| stage | cause | kind | what failed |", "|---|---|---|---|"]
    for row in FAILURE_KINDS:
        stage = "any" if row.stage == ANY_STAGE else f"`{row.stage}`"
        cause = f"`{row.cause}`" if row.cause else "-"
        lines.append(f"| {stage} | {cause} | {row.kind} | {row.meaning} |")
    return "\n".join(lines)


class EvalFailure(RuntimeError):
    """A run that could not be scored.

    Attributes:
        stage: where it stopped (a stage of :data:`FAILURE_KINDS`; ``config``: a bad command
            line or an option the machine cannot honour, ``prism eval`` exits 2 for it).
        message: one line naming the reason.
        detail: more lines (blocking findings, a traceback tail), or ``""``. Both with control
            characters shown as escapes (:func:`prism_challenge.terminal.printable`).
        cause: the row of :data:`FAILURE_KINDS` within the stage (:data:`ANY_CAUSE`,
            :data:`REPORTED`, :data:`KILLED`, :data:`TOKENIZER`).
        findings: the gates' findings (``prism_challenge.gates.findings.Finding``) of a refusal.
    """

    def __init__(self, stage: str, message: str, detail: str = "", *, cause: str = ANY_CAUSE,
                 findings: list | None = None):
        from prism_challenge.terminal import printable

        message, detail = printable(message), printable(detail)  # often the submission's own text
        super().__init__(f"{stage}: {message}")
        self.stage, self.message, self.detail, self.cause = stage, message, detail, cause
        self.findings = list(findings or [])

    @property
    def kind(self) -> str:
        """``submission``, ``infrastructure`` or ``cancelled`` (:func:`kind_of`)."""
        return kind_of(self.stage, self.cause)

    def to_dict(self) -> dict[str, str]:
        """The manifest's ``failure``: ``{"stage", "message", "detail", "kind", "cause"}``."""
        return {"stage": self.stage, "message": self.message, "detail": self.detail, "kind": self.kind,
                "cause": self.cause}
