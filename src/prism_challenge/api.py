"""The pipeline as a library: ``from prism_challenge import evaluate, EvalOptions``.

:func:`evaluate` runs exactly what ``prism eval`` runs (:func:`prism_challenge.pipeline.evaluate`)
and returns one result type, :class:`~prism_challenge.manifest.results.EvalResult`, for every outcome:
scored, failed (with the failure's stage and kind, :mod:`prism_challenge.failures`) or
cancelled. It raises only for a caller's bug (:class:`~prism_challenge.options.OptionsError`, a
``cancel`` or ``on_progress`` of the wrong type).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism_challenge import __version__
from prism_challenge.control import CANCELLED_MESSAGE, CancelSource, RunControl
from prism_challenge.events import ProgressEvent, RunFinished
from prism_challenge.failures import EvalFailure
from prism_challenge.options import EvalOptions
from prism_challenge.manifest.results import EvalResult, Failure, RunManifest, early_manifest
from prism_challenge.manifest.run_manifest import MANIFEST_NAME


def evaluate(options: EvalOptions, *, cancel: CancelSource | None = None,
             on_progress: Callable[[ProgressEvent], Any] | None = None) -> EvalResult:
    """Gate, re-execute and score one bundle; write its run manifest.

    Args:
        options: the run's settings (validated again here: a field changed after construction
            is checked too).
        cancel: a ``threading.Event``-like object (``is_set()``) or a callable returning
            ``True`` to stop the run. Within :data:`~prism_challenge.control.POLL_S` of it being
            set, every process of the run (torchrun, its ranks, the warm pool, the parameter and
            held-out children) is killed; the result and the manifest say ``cancelled``.
            Known limit: work done in this process (building the embedded corpus on first use,
            hashing the data shards, the AST gates) is not interrupted; the cancel takes effect
            when it ends.
        on_progress: called with each :mod:`~prism_challenge.events` event (stages, scored
            batches with the bpb so far, the run's end), from the pipeline's threads.

    Returns:
        The result. ``result.run_dir`` is ``None`` when the run stopped before its directory
        was made (a refused bundle, an option the machine cannot honour); its manifest then
        exists only in ``result.manifest``.

    Raises:
        OptionsError: a setting breaks its rule (the field and the rule are named).
        TypeError: ``cancel`` or ``on_progress`` is of the wrong type.
        pydantic.ValidationError: the pipeline wrote a manifest the models refuse (a harness bug).
    """
    options.validate()
    control = RunControl(cancel, on_progress)
    t0 = time.monotonic()
    control.start()
    try:
        result = _run(options, control)
    finally:
        control.stop()
    control.emit(RunFinished(
        status=result.status, kind=result.kind, stage=result.failure.stage if result.failure else None,
        prequential_bpb=result.prequential_bpb, final_score=result.final_score,
        seconds=time.monotonic() - t0, run_dir=result.run_dir))
    return result


def _run(options: EvalOptions, control: RunControl) -> EvalResult:
    from prism_challenge import pipeline  # torch: imported only when a run starts

    try:
        outcome = pipeline.evaluate(options, control)
    except EvalFailure as exc:
        return _early(options, _cancelled_or(exc, control))
    except OSError as exc:  # the harness's own files: disk full, quota, permissions
        where = f" ({exc.filename})" if exc.filename else ""
        failure = EvalFailure("storage", f"{type(exc).__name__}: {exc.strerror or exc}{where}")
        return _early(options, _cancelled_or(failure, control))
    except Exception:
        if control.cancelled:  # the kill made a step fail (a child refused by the killed jail)
            return _early(options, EvalFailure("cancelled", CANCELLED_MESSAGE))
        raise
    manifest = RunManifest.model_validate(outcome.manifest)
    failure = manifest.failure
    return EvalResult(status=manifest.status, kind=failure.kind if failure else None, failure=failure,
                      run_dir=str(outcome.run_dir), manifest_path=str(Path(outcome.run_dir) / MANIFEST_NAME),
                      manifest=manifest)


def _cancelled_or(exc: EvalFailure, control: RunControl) -> EvalFailure:
    """A failure raised after the cancel is the kill's doing (a gate child killed mid-build)."""
    if control.cancelled and exc.stage != "cancelled":
        return EvalFailure("cancelled", CANCELLED_MESSAGE)
    return exc


def _early(options: EvalOptions, exc: EvalFailure) -> EvalResult:
    """The result of a run stopped before its run directory existed."""
    profile = None
    if options.profile is not None:
        from prism_challenge.profiles import manifest_record

        profile = manifest_record(options.profile, list(options.profile_overridden))
    failure = exc.to_dict()
    manifest = early_manifest(failure, bundle_path=str(Path(options.bundle).resolve()), seed=options.seed,
                              findings=[f.to_dict() for f in exc.findings], profile=profile, version=__version__)
    return EvalResult(status=manifest.status, kind=exc.kind, failure=Failure.model_validate(failure), run_dir=None,
                      manifest_path=None, manifest=manifest)
