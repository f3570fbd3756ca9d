"""One evaluation on the Ray node the cluster picked: the bundle's bytes in, the result out.

The dispatcher (:mod:`prism_challenge.service.dispatch`) creates one detached, named Ray actor
of :class:`Evaluation` per attempt (:func:`actor_name`: the attempt's fencing token, in the
:data:`NAMESPACE` namespace). Its constructor receives the :class:`Job` through Ray (the bundle
as zip bytes and the loaded profile: no shared filesystem is assumed) and starts the run in a
thread of the actor's process, so the run does not depend on any call of the driver that made
it: a restarted service finds the actor by name and asks it for the result. :func:`run_job`
extracts the bundle into the attempt's folder (:func:`~prism_challenge.service.archive.extract_bundle`),
runs :func:`prism_challenge.evaluate` with strict isolation under the job's profile and returns
the result as JSON (the manifest, with its learning curve); the folder is removed. The
attempt's folder, ``<work dir>/<token>``, holds every temporary folder of the run and is locked
while the run lives (:mod:`prism_challenge.scratch`): a SIGKILLed worker's folder is removed by
the next attempt's start on the node and by the dispatcher's reconcile.

This module imports neither torch nor Ray (the pipeline imports torch when the run starts).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_challenge import __version__, scratch
from prism_challenge.failures import EvalFailure
from prism_challenge.profiles import Profile, manifest_record, resolve
from prism_challenge.manifest.results import EvalResult, Failure, early_manifest

NAMESPACE = "prism"
ACTOR_PREFIX = "prism-eval-"


def actor_name(token: str) -> str:
    """The Ray actor name of the attempt with fencing token ``token``."""
    return ACTOR_PREFIX + token


@dataclass(frozen=True)
class Job:
    """What one attempt evaluates.

    Attributes:
        token: the attempt's fencing token (returned with the result).
        submission_id: the submission (for logs).
        bundle: the bundle as zip bytes (what the submitter sent, from the blob store).
        profile: the challenge profile, loaded by the dispatcher (its sha256 is the file's).
        data_dir: the prepared data directory on the node, or ``None`` for the profile's
            default (the embedded corpus of a ``builtin`` profile).
        seed: the attempt's secret seed (:func:`prism_challenge.service.confirm.draw_seed`);
            ``None`` only for an attempt made before migration 0006 (the profile's seed).
        work_dir: the folder of the node's attempt folders, or ``None`` for
            :func:`default_work_dir`.
    """

    token: str
    submission_id: int
    bundle: bytes
    profile: Profile
    data_dir: str | None = None
    seed: int | None = None
    work_dir: str | None = None


def options_for(profile: Profile, bundle: str | Path, out_dir: str | Path, data_dir: str | None = None,
                seed: int | None = None):
    """The :class:`~prism_challenge.options.EvalOptions` of a service run: the profile's settings
    (:func:`prism_challenge.profiles.resolve`, as ``prism eval --profile P --seed S`` makes them,
    with only ``data_dir`` and the attempt's secret ``seed`` given), strict isolation, signed by the operator's key
    (:func:`~prism_challenge.service.settings.default_signing_key_file`: ``$PRISM_SIGNING_KEY_FILE``
    on this node, which the service sets at start, else the state directory's).

    Raises:
        OptionsError: the profile's settings break a rule.
    """
    from prism_challenge.options import EvalOptions

    from prism_challenge.service.settings import default_signing_key_file

    settings, overridden = resolve(profile, {"data_dir": data_dir, "seed": seed})
    return EvalOptions(bundle=str(bundle), out_dir=str(out_dir), isolation="strict", profile=profile,
                       profile_overridden=overridden, signing_key_file=str(default_signing_key_file()), **settings)


def failure_result(failure: EvalFailure, *, profile: Profile | None = None, bundle: str = "<submission>") -> EvalResult:
    """The result of an attempt that never ran the pipeline (or was lost): its manifest exists only here."""
    record = manifest_record(profile, []) if profile is not None else None
    manifest = early_manifest(failure.to_dict(), bundle_path=bundle, seed=None, findings=[], profile=record,
                              version=__version__)
    return EvalResult(status=manifest.status, kind=failure.kind, failure=Failure.model_validate(failure.to_dict()),
                      run_dir=None, manifest_path=None, manifest=manifest)


def default_work_dir() -> Path:
    """Where a node's attempt folders go when the service names none:
    ``<platformdirs user_data_dir('prism-challenge')>/work`` (the state directory)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("prism-challenge")) / "work"


def run_job(job: Job, *, cancel: Any = None, on_progress: Any = None) -> dict:
    """Extract ``job.bundle`` into the attempt's folder, evaluate it, remove the folder.

    The attempt's folder is ``<job.work_dir>/<job.token>`` (:func:`prism_challenge.scratch.attempt`:
    locked while the run lives, the folder of every temporary folder the run makes; the work
    dir's folders of attempts whose process died are swept first).

    Returns:
        ``EvalResult`` as JSON (``model_dump(mode="json")``), ``run_dir`` and ``manifest_path``
        ``None`` (the folder is gone; the manifest and its curve travel back in the result).
        A zip refused by :func:`extract_bundle` is a ``submission`` failure at stage ``intake``.
    """
    from prism_challenge.api import evaluate
    from prism_challenge.service.archive import ArchiveError, extract_bundle

    with scratch.attempt(Path(job.work_dir) if job.work_dir else default_work_dir(), job.token) as owned:
        tmp = owned.mkdtemp("prism-eval-")
        try:
            root = extract_bundle(job.bundle, tmp / "bundle")
        except ArchiveError as exc:
            return failure_result(EvalFailure("intake", exc.message), profile=job.profile).model_dump(mode="json")
        result = evaluate(options_for(job.profile, root, tmp / "run", job.data_dir, job.seed), cancel=cancel,
                          on_progress=on_progress)
        return result.model_copy(update={"run_dir": None, "manifest_path": None}).model_dump(mode="json")


class Evaluation:
    """The Ray actor of one attempt (made remote by the dispatcher: ``ray.remote(Evaluation)``).

    The run starts in a thread as the actor is created; :meth:`result` waits for it. A Python
    exception of the harness becomes an ``infrastructure`` failure at stage ``dispatch`` (with
    the traceback's tail); a death of the actor's process (SIGKILL, the node lost) is seen by
    the dispatcher as a Ray actor error.

    Args:
        job: the attempt.
    """

    def __init__(self, job: Job):
        self._token = job.token
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._result: dict | None = None
        self._stage: str | None = None
        self._batches = 0
        self._started = time.time()
        threading.Thread(target=self._run, args=(job,), name="prism-eval", daemon=True).start()

    def _run(self, job: Job) -> None:
        try:
            self._result = run_job(job, cancel=self._cancel, on_progress=self._progress)
        except BaseException as exc:  # noqa: BLE001 - the harness raised: reported, retried
            tail = "".join(traceback.format_exception(exc)[-3:])
            failure = EvalFailure("dispatch", f"the harness raised {type(exc).__name__}: {exc}", tail)
            self._result = failure_result(failure, profile=job.profile).model_dump(mode="json")
        finally:
            self._done.set()

    def _progress(self, event: Any) -> None:
        kind = getattr(event, "event", None)
        if kind == "batch_scored":
            self._batches += 1
        elif kind == "stage_started":
            self._stage = event.stage

    def result(self, timeout: float | None = None) -> dict | None:
        """``{"token", "result"}`` once the run ended (``result``: :func:`run_job`'s JSON);
        ``None`` if it has not ended within ``timeout`` seconds (``None``: wait)."""
        if not self._done.wait(timeout):
            return None
        return {"token": self._token, "result": self._result}

    def where(self) -> dict:
        """The node and process running the attempt: ``{"node_id", "ip", "pid"}``."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def progress(self) -> dict:
        """``{"stage", "batches", "age_s", "done"}``: the last stage started, batches scored so far."""
        return {"stage": self._stage, "batches": self._batches, "age_s": time.time() - self._started,
                "done": self._done.is_set()}

    def cancel(self) -> None:
        """Stop the run (``evaluate``'s cancel hook: the tree is killed within 5 s)."""
        self._cancel.set()


__all__ = ["ACTOR_PREFIX", "Evaluation", "Job", "NAMESPACE", "actor_name", "default_work_dir", "failure_result",
           "options_for", "run_job"]
