"""The pipeline's audit stage (after the stream, before the held-out stage): what ``prism eval``
does with the feeder's audited batches (:mod:`~prism_challenge.audit.rescore`), and what it leaves in
the run directory for ``prism verify``:

* ``bundle/``: a copy of the frozen bundle that ran (its sha256 is the manifest's);
* ``model/audit/step-<step>.snap``: rank 0's weight snapshot of each audited batch
  (:mod:`~prism_challenge.evaluator.snapfile`);
* ``model/audit/step-<step>.npz``: that batch's slices (``tokens_<rank>``), blind-probe batches
  (``probe_<rank>_<pass>``) and probed ``(row, k)`` (``picks_<rank>_<pass>``).

The children see ``ctx.artifacts_dir`` at the run's path, as an empty writable folder: the
loop's own files are moved aside while they run (:func:`empty_artifacts`), so nothing the loop
wrote can tell them which batch they score.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.evaluator.auditplan import AUDITED_BATCHES, RESCORE_RTOL, SCHEDULE_RULE
from prism_challenge.evaluator.snapfile import snapshot_dtypes
from prism_challenge.evaluator.snapshots import snapshot_name
from prism_challenge.evaluator.statedict import StateError
from prism_challenge.score.flops import shape_counts
from prism_challenge.audit.rescore import AuditReport, child_argv, plan, run_audit

AUDIT_DIR = Path("model") / "audit"
BUNDLE_COPY = "bundle"
FILLER_BYTES = 200_000
"""UTF-8 bytes of the val split's prefix whose tokens continue the blind probes' rows."""


@contextlib.contextmanager
def empty_artifacts(artifacts: Path) -> Iterator[Path]:
    """The run's artifacts folder, empty, at its own path, for the duration; the loop's files
    are moved aside to ``artifacts.loop`` meanwhile and put back after (what the children wrote
    is deleted)."""
    aside = artifacts.with_name(artifacts.name + ".loop")
    artifacts.rename(aside)
    artifacts.mkdir()
    try:
        yield artifacts
    finally:
        shutil.rmtree(artifacts, ignore_errors=True)
        aside.rename(artifacts)


def val_filler(data: Any, tokenizer: Any, max_bytes: int = FILLER_BYTES) -> tuple[np.ndarray | None, str | None]:
    """Token ids of the val split's first ``max_bytes`` bytes (the blind probes' real text), or
    ``None`` and why."""
    from prism_challenge.data.manifest import DataError
    from prism_challenge.data.stream import heldout_stream

    if "val" not in (data.data.get("splits") or {}):
        return None, f"the data directory {data.root} has no val split"
    try:
        ids = [np.asarray(c.ids, dtype=np.int64) for c in heldout_stream(data, tokenizer, split="val",
                                                                         max_bytes=max_bytes)]
    except DataError as exc:
        return None, f"the val split cannot be read: {exc}"
    return (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)), None


def drop_snapshots(run_dir: Path) -> None:
    """Delete the audit's snapshots of a run that was not scored (and ``model/`` when that leaves
    it empty)."""
    shutil.rmtree(run_dir / AUDIT_DIR, ignore_errors=True)
    try:
        (run_dir / AUDIT_DIR).parent.rmdir()
    except OSError:  # absent, or it holds the trained state
        pass


def keep_bundle(frozen_root: Path, run_dir: Path) -> Path:
    """Copy the frozen bundle into ``run_dir/bundle`` (for ``prism verify``)."""
    dest = run_dir / BUNDLE_COPY
    shutil.copytree(frozen_root, dest, copy_function=shutil.copyfile)
    for folder in [dest, *(p for p in dest.rglob("*") if p.is_dir())]:
        folder.chmod(0o755)  # copytree copied the frozen folders' 0555: the run directory stays removable
    return dest


def write_inputs(run_dir: Path, audits: dict[int, Any], world_size: int, filler: np.ndarray | None,
                 key: bytes) -> None:
    """Write each complete audited step's ``.npz`` (slices, probe batches, picks) beside its snapshot."""
    jobs, blind, _, _ = plan(audits, world_size, filler, key)
    by_step: dict[int, dict[str, np.ndarray]] = {}
    for j in jobs:
        by_step.setdefault(j.step, {})[f"tokens_{j.rank}"] = j.tokens
    passes: dict[tuple[int, int], int] = {}
    for j in blind:
        p = passes[(j.step, j.rank)] = passes.get((j.step, j.rank), -1) + 1
        by_step[j.step][f"probe_{j.rank}_{p}"] = j.probe
        by_step[j.step][f"picks_{j.rank}_{p}"] = np.asarray(j.picks, dtype=np.int64).reshape(-1, 2)
    for step, arrays in by_step.items():
        np.savez(run_dir / AUDIT_DIR / f"step-{step:06d}.npz", **arrays)


def seconds_per_batch(result: Any) -> float | None:
    """The run's own wall seconds per batch, from the first batch served to the last record
    (``(last_record_at - first_batch_at) / (batches - 1)``); ``None`` below two batches."""
    n = len(result.steps)
    if n < 2 or result.first_batch_at is None or result.last_record_at is None:
        return None
    return max(0.0, result.last_record_at - result.first_batch_at) / (n - 1)


def child_config(model_config: dict[str, Any], run_config: dict[str, Any], world_size: int,
                 hidden: list[str]) -> dict[str, Any]:
    """What the audit's children need: the model configuration, the run's context values, and
    what they may not read."""
    from prism_challenge.evaluator.protocol import context_values

    return {**model_config, "context": context_values(run_config, world_size), "hidden": hidden}


def audit_run(*, jail: Any, config: dict[str, Any], result: Any, world_size: int, data: Any, tokenizer: Any,
              key: bytes, artifacts: Path, run_dir: Path, timeout_s: float,
              audited_batches: int = AUDITED_BATCHES) -> AuditReport:
    """The audit of a scored run: re-scoring and blind probes in fresh jailed children, inputs
    written for ``prism verify``. Never raises for the submission's failures (the report says).

    The first child starts (:meth:`~prism_challenge.evaluator.jail.Jail.warm`: the interpreter
    and ``import torch``, no submitted code) as soon as the empty folder exists, so its start-up
    overlaps the tokenizing of the probes' text; ``wall_s`` is the whole stage's, from before the
    folder is emptied until the inputs are written (``audited_batches``: the run's ``A``, for the
    manifest). The first re-scoring child also counts the forward FLOPs of every rank slice shape
    the stream scored (``report.flops``, :mod:`~prism_challenge.score.flops`).
    """
    from prism_challenge.evaluator.isolation import IsolationError

    t0 = time.monotonic()
    meta = {"audited_batches_target": audited_batches,
            "schedule": {"rule": SCHEDULE_RULE, "audited_batches": audited_batches},
            "rtol": RESCORE_RTOL["cuda" if str(config.get("device", "")).startswith("cuda") else "cpu"],
            "shape": list(result.shape) if result.shape else None, "context": dict(config["context"])}
    argv = child_argv(str(config.get("device", "cpu")))  # on CUDA the spare starts CUDA while it waits
    with empty_artifacts(artifacts) as empty:
        writable = [str(empty)]
        try:
            with contextlib.suppress(OSError, IsolationError):  # no spare: the first child starts when fed
                jail.warm(argv, writable=writable)
            filler, skipped = val_filler(data, tokenizer)
            if filler is not None and result.shape is not None and len(filler) < result.shape[1]:
                filler, skipped = None, f"the val prefix ({len(filler)} tokens) is shorter than a row"
            shapes = list(shape_counts(s.shapes for s in result.steps))  # counted by the first re-scoring child
            report = run_audit({**config, "flop_shapes": shapes}, result.audits, jail=jail, world_size=world_size,
                               filler=filler, key=key, batch_s=seconds_per_batch(result),
                               timeout_s=timeout_s - (time.monotonic() - t0), artifacts_dir=str(empty), meta=meta)
        finally:
            jail.drop_spare(argv, writable=writable)  # no audited batch had a snapshot: never fed
    report.probe_skipped = skipped
    try:
        write_inputs(run_dir, result.audits, world_size, filler, key)
    except OSError as exc:
        report.error = report.error or f"audit: cannot write the audited inputs: {exc}"
    report.wall_s = time.monotonic() - t0
    return report


def apply(verdict: Any, report: AuditReport) -> Any:
    """The verdict with the audit's outcome: a mismatch or an audit that could not run zeroes it
    (flag ``audit``)."""
    if report.passed:
        return verdict
    return dataclasses.replace(verdict, anti_cheat_multiplier=0.0, final_score=0.0, flags=[*verdict.flags, "audit"])


def twin_dtypes(run_dir: Path) -> dict[str, str] | None:
    """The dtypes of the model that scored batch 0, by name: those of the audit's snapshot of step
    0 (always audited; its record was re-scored from it), or ``None`` without one (no audit: the
    twin keeps ``build_model``'s own dtypes). The held-out twin takes these, not the trained
    model's: a dtype the loop changed after batch 0 must not reach the twin, which is the model
    as it scored batch 0 (a twin cast to later dtypes never scored anything, and a forward can
    turn that rounding into a twin as bad as it likes: a forged ``heldout_delta``)."""
    path = run_dir / AUDIT_DIR / snapshot_name(0)
    if not path.is_file():
        return None
    try:
        return snapshot_dtypes(path)
    except (StateError, OSError):
        return None  # the audit names a bad snapshot; the twin keeps its own dtypes
