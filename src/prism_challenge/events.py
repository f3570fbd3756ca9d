"""Typed progress events of one run, delivered to ``evaluate(..., on_progress=callback)``.

The same events drive ``prism eval``'s progress bar (:mod:`prism_challenge.cli_eval`) and reach
a library caller (a service streaming them, an operator's script). Each event has a constant
``event`` field naming its type, so ``model_dump(mode="json")`` is self-describing.

Order: ``stage_started``/``stage_finished`` pairs for the stages of :data:`STAGES` that run (a
run refused at the gates has no ``stream``), ``batch_scored`` for every scored global batch
while the stream runs, ``stage_count`` within ``heldout`` (each part at its start and its end),
and one ``run_finished`` last, whatever the outcome.

Callbacks run on the pipeline's own threads (``batch_scored`` on the feeder's): they must
return quickly and not block. An exception in the callback is reported once as a warning and
never changes the run.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

Stage = Literal["intake", "data", "gates", "stream", "heldout", "manifest"]
STAGES: tuple[str, ...] = ("intake", "data", "gates", "stream", "heldout", "manifest")
"""The stages a run reports, in order: ``intake`` (bundle frozen and read), ``data`` (tokenizer,
data MANIFEST and shard hashes verified), ``gates`` (static gates and parameter cap, while
torchrun starts), ``stream`` (the scored re-execution), ``heldout`` (the held-out child and the
verdict), ``manifest`` (the run manifest written)."""


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StageStarted(_Event):
    """A stage began. For ``stream``: ``total`` and ``unit`` size a progress bar (``tokens``
    under a token budget, else ``bytes``; ``total`` is ``None`` when unknown)."""

    event: Literal["stage_started"] = "stage_started"
    stage: Stage
    total: int | None = None
    unit: Literal["tokens", "bytes"] | None = None


class StageFinished(_Event):
    """A stage ended: ``ok`` is ``False`` when the run failed in it; ``seconds`` of wall clock."""

    event: Literal["stage_finished"] = "stage_finished"
    stage: Stage
    seconds: float = Field(ge=0)
    ok: bool


class BatchScored(_Event):
    """One global batch was scored by the trusted side (summed over ranks).

    ``batch``: its index from 0; ``targets``/``bytes``/``nats``: this batch's scored targets,
    UTF-8 bytes and code length (nats); the ``*_so_far`` figures are cumulative over the run,
    and ``bpb_so_far = nats_so_far / ln 2 / bytes_so_far`` (``None`` while no byte was scored);
    ``tokens_so_far``: the stream's tokens consumed up to this batch, the token budget's unit
    (a row's first token too, which is no target).
    """

    event: Literal["batch_scored"] = "batch_scored"
    batch: int = Field(ge=0)
    targets: int = Field(ge=0)
    bytes: int = Field(ge=0)
    nats: float
    targets_so_far: int = Field(ge=0)
    bytes_so_far: int = Field(ge=0)
    nats_so_far: float
    bpb_so_far: float | None
    tokens_so_far: int | None = Field(default=None, ge=0)


class StageCount(_Event):
    """A part of a stage after the stream, with its count. Emitted with ``done`` None when the
    part starts (``re-scored`` and ``held-out batches``; the blind probes run in the re-scoring
    child), and with its count when it ends. The parts of ``heldout``: ``re-scored``
    (audited batches re-scored in a fresh process, :mod:`prism_challenge.audit.rescore`), ``blind
    probes`` (rows probed blind, the same child), ``held-out batches`` (batches of val text
    scored by the trained model and its twin, :mod:`prism_challenge.audit.heldout`)."""

    event: Literal["stage_count"] = "stage_count"
    stage: Stage
    part: Literal["re-scored", "blind probes", "held-out batches"]
    done: int | None = Field(default=None, ge=0)


class RunFinished(_Event):
    """The run ended: ``status`` as in the manifest; ``kind``/``stage`` of the failure (``None``
    when scored); ``seconds`` from the call of ``evaluate``; ``run_dir`` is ``None`` for a run
    stopped before its directory was made (a refused bundle)."""

    event: Literal["run_finished"] = "run_finished"
    status: Literal["scored", "failed", "cancelled"]
    kind: Literal["submission", "infrastructure", "cancelled"] | None
    stage: str | None
    prequential_bpb: float | None
    final_score: float | None
    seconds: float = Field(ge=0)
    run_dir: str | None


ProgressEvent = Union[StageStarted, StageFinished, StageCount, BatchScored, RunFinished]
