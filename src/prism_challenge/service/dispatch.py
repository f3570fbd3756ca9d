"""The dispatcher: pending submissions to Ray, their results back into the store, exactly once.

A :class:`Dispatcher` runs one thread in the service. Each round it

1. refreshes its own heartbeat and that of every attempt it tracks (the watchdog's "owner",
   :mod:`prism_challenge.service.watch`), with the Ray node of each once known;
2. collects the attempts that ended: a result comes back through Ray
   (:class:`~prism_challenge.service.worker.Evaluation`), an actor that died (its process
   SIGKILLed, its node lost) becomes an ``infrastructure`` failure at stage ``dispatch``; each
   is written with :meth:`Store.record <prism_challenge.service.store.Store.record>` under the
   attempt's fencing token (a superseded attempt's result is discarded, a write retried after
   a dropped connection changes nothing), and only then is the actor killed;
3. launches the claims it kept from an earlier round, then claims pending submissions while
   fewer than ``slots`` attempts are in flight, and creates one detached, named actor per
   attempt on the node Ray picks, asking for the run's resources (:func:`resources_for`), with
   the bundle's bytes and the loaded profile as its argument.

Database errors (:mod:`prism_challenge.service.unstored`): while the database is unreachable a
round fails and is tried again, each collected result and each claim whose launch raised kept
(a kept claim is launched under its own token, not claimed again, and heartbeated meanwhile, so
the watchdog sees it owned). Any other failure of one attempt's write or launch is that
attempt's alone: the rest of the round goes on, and after
:data:`~prism_challenge.service.unstored.WRITE_TRIES` rounds the attempt ends as an
``infrastructure`` failure naming the error (retried per the retry policy).

An idle round waits ``poll_s`` for :meth:`Dispatcher.wake`, which the intake calls for each
submission it accepts: a new submission is claimed at once, not at the end of a poll.

Seeds and confirmation (:mod:`prism_challenge.service.confirm`): each claim carries its
attempt's secret seed, which the job runs on (never a profile's public seed: every profile this
dispatcher knows is passed to :meth:`Store.claim`); a submission confirmed at the top is pending
again after each scored run until its last, and each next run is claimed like any attempt.

Retries: an ``infrastructure`` failure puts the submission back to ``pending`` with a backoff
(:func:`backoff_s`) until ``max_attempts``; then it is ``failed``, every attempt's reason on its
row. A ``submission`` failure is final at once.

Recovery (:meth:`Dispatcher.reconcile`, run by :meth:`Dispatcher.start` and every
:data:`RECONCILE_S` seconds): :mod:`prism_challenge.service.recovery`.

One dispatcher per database: two would each adopt the other's running attempts (the fence keeps
each result single, but both would track, write and kill).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prism_challenge.failures import EvalFailure
from prism_challenge.profiles import DEFAULT_PROFILE, Profile, ProfileError, load_profile, profile_names
from prism_challenge.manifest.results import EvalResult
from prism_challenge.service.capacity import CannotEvaluate, check_capacity, expire_leases
from prism_challenge.service.recovery import Reconciled, kill_actor, reconcile
from prism_challenge.service.store import DEFAULT_MAX_ATTEMPTS, Claim, Store, TransitionError
from prism_challenge.service.unstored import LAUNCH_FAILED, WRITE_TRIES, first_line, reason, stand_in, unreachable
from prism_challenge.service.worker import (
    NAMESPACE,
    Evaluation,
    Job,
    actor_name,
    failure_result,
)

log = logging.getLogger("prism_challenge.service")

DEFAULT_SLOTS = 2
DEFAULT_BACKOFF_S = 10.0
MAX_BACKOFF_S = 600.0
POLL_S = 0.5  # how long a round waits for results when attempts are in flight
HEARTBEAT_S = 5.0  # how often the dispatcher's and its attempts' heartbeats are written
RECONCILE_S = 60.0  # how often a running dispatcher reconciles again
ACTOR_CONCURRENCY = 4  # an actor answers result(), where() and progress() while its run goes on
RESULT_WAIT_S = 30.0  # one result() call waits this long at most; the dispatcher then asks again


def backoff_s(attempt: int, base_s: float = DEFAULT_BACKOFF_S, cap_s: float = MAX_BACKOFF_S) -> float:
    """Seconds before a submission whose attempt ``attempt`` (1, 2, ...) failed for the
    infrastructure is claimed again: ``min(cap_s, base_s * 2 ** (attempt - 1))`` (exponential
    backoff)."""
    return min(cap_s, base_s * 2.0 ** max(0, attempt - 1))


def resources_for(profile: Profile, cluster_gpus: float) -> dict[str, float]:
    """The Ray resources one run of ``profile`` asks for.

    A GPU profile (``device = "cuda"``, or ``"auto"`` on a cluster with GPUs) asks for one GPU
    per process (``nproc``) and one CPU for the trusted parent (feeder, scoring); a CPU profile
    asks for one CPU per process. With the embedded Ray of ``slots`` CPUs, ``slots`` one-process
    CPU runs go at once.
    """
    nproc = int(profile.options["nproc"])
    device = profile.options["device"]
    if device == "cuda" or (device == "auto" and cluster_gpus > 0):
        return {"num_gpus": nproc, "num_cpus": 1}
    return {"num_cpus": nproc}


@dataclass
class _Track:
    """An attempt in flight: its claim, actor, pending ``result()`` and ``where()`` refs."""

    claim: Claim
    actor: Any
    ref: Any
    where: Any
    node: str | None = None
    node_sent: bool = False
    result: EvalResult | None = None  # collected, not yet written (the store unreachable, or refusing it)
    profile: Profile | None = field(default=None, repr=False)
    refused: int = 0  # rounds the write of ``result`` failed, the database reachable
    replaced: bool = False  # ``result`` is the stand-in of one the database refused (unstored.stand_in)
    asked: dict | None = None  # the Ray resources its actor asked for
    launched: float = field(default_factory=time.monotonic)  # when it was launched (or adopted), monotonic s
    final: bool = False  # its failure is not retried (its lease ran out)


@dataclass
class _Kept:
    """A claim whose launch raised: launched first next round under the same token."""

    claim: Claim
    refused: int = 0  # rounds its launch failed, the database reachable


def signing_env() -> dict[str, Any] | None:
    """The Ray job's ``runtime_env`` that hands ``$PRISM_SIGNING_KEY_FILE`` (the operator's key
    file, :func:`~prism_challenge.service.settings.publish_key`) to the workers of every node of
    a cluster; ``None`` when it is unset (each worker then finds the default key file)."""
    from prism_challenge.service.settings import SIGNING_KEY_ENV

    path = os.environ.get(SIGNING_KEY_ENV)
    return {"env_vars": {SIGNING_KEY_ENV: path}} if path else None


class Dispatcher:
    """Sends pending submissions to Ray and writes their results back (module docstring).

    Args:
        store: the service's database.
        blobs: the bundle bytes (``BlobStore``: ``get(sha256) -> bytes``).
        ray_address: a cluster's address (``ray start --head`` prints it); ``None``: start an
            embedded Ray with ``slots`` CPUs (or use the one this process already started).
        slots: the most attempts in flight at once.
        max_attempts: the most attempts of one submission (capped by the submission's own).
        backoff_base_s: the first retry's backoff (:func:`backoff_s`).
        data_dir: the prepared data directory on every node, or ``None`` (the profile's default).
        default_profile: the profile of a submission that names none.
        profiles: profiles known by name besides the shipped ones (name -> loaded profile: the
            operator's own TOML files); a submission's ``profile`` is looked up here first.
        poll_s: how long one round waits for results.
        check_resources: ``True``: at :meth:`start`, raise :class:`CannotEvaluate` when the
            default profile's resources or data are missing
            (:func:`~prism_challenge.service.capacity.missing`); ``False``: start anyway,
            :attr:`problem` naming what is missing; ``None``: no check.
        lease_timeout_s: an attempt whose actor has not started this many seconds after its
            launch (no node took its lease) ends ``failed``, ``infrastructure``, not retried;
            ``None``: it waits for ever.
        work_dir: the folder of the attempts' temporary folders on every node (one per attempt,
            named by its token: :func:`prism_challenge.scratch.attempt`), swept by the reconcile;
            ``None``: :func:`~prism_challenge.service.worker.default_work_dir`.

    Raises:
        CannotEvaluate: (from :meth:`start`) see ``check_resources``.
        ValueError: ``slots`` or ``max_attempts`` below 1.
    """

    def __init__(self, store: Store, blobs: Any, *, ray_address: str | None = None, slots: int = DEFAULT_SLOTS,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, backoff_base_s: float = DEFAULT_BACKOFF_S,
                 data_dir: str | None = None, default_profile: str = DEFAULT_PROFILE,
                 profiles: dict[str, Profile] | None = None, poll_s: float = POLL_S, check_resources: bool | None = None,
                 lease_timeout_s: float | None = None, work_dir: str | None = None):
        if slots < 1 or max_attempts < 1:
            raise ValueError(f"slots = {slots}, max_attempts = {max_attempts}: each must be at least 1")
        self.store, self.blobs, self.ray_address = store, blobs, ray_address
        self.slots, self.max_attempts, self.backoff_base_s = slots, max_attempts, backoff_base_s
        self.data_dir, self.default_profile, self.poll_s = data_dir, default_profile, poll_s
        self.work_dir = str(work_dir) if work_dir is not None else None
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._tracked: dict[str, _Track] = {}
        self._unlaunched: dict[str, _Kept] = {}  # claims whose launch raised, by token
        self._profiles: dict[str, Profile] = dict(profiles or {})
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by wake(): a submission arrived, claim now
        self._thread: threading.Thread | None = None
        self._owns_ray = False
        self._remote: Any = None
        self._gpus = 0.0
        self._last_beat = 0.0
        self._last_reconcile = 0.0
        self.reconciled: Reconciled | None = None  # what the reconcile of start() did
        self.check_resources, self.lease_timeout_s = check_resources, lease_timeout_s
        self.problem: str | None = None
        """Why this dispatcher cannot evaluate now (what :meth:`start` found missing, or the last
        attempt whose lease ran out), for ``/health``; ``None`` once an attempt's actor starts."""

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> Dispatcher:
        """Connect to Ray (or start the embedded one), reconcile, start the thread; returns ``self``."""
        import ray

        if not ray.is_initialized():
            if self.ray_address:  # every node's workers sign with the key file at the head's path
                ray.init(address=self.ray_address, namespace=NAMESPACE, log_to_driver=False,
                         runtime_env=signing_env())
            else:
                # "local": a new instance of our own, never a cluster someone `ray start`ed on this
                # machine (ray.init() without an address joins the newest one it finds in /tmp/ray)
                ray.init(address="local", num_cpus=self.slots, namespace=NAMESPACE, include_dashboard=False,
                         log_to_driver=False)
            self._owns_ray = True
        self._remote = ray.remote(Evaluation)
        self._gpus = float(ray.cluster_resources().get("GPU", 0.0))
        if self.check_resources is not None:
            check_capacity(self)  # raises CannotEvaluate (check_resources) or sets self.problem
        self.store.dispatcher_beat(self.name, ray_address=self.ray_address)
        self.reconciled = self.reconcile()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="prism-dispatcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (evaluations in flight keep running on the cluster: a later
        dispatcher reconciles them); shut the embedded Ray down if this dispatcher started it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.store.dispatcher_beat(self.name, stopped=True)
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    def wake(self) -> None:
        """A submission became pending (the intake calls this after storing it): an idle round
        claims at once instead of at the end of its ``poll_s`` wait. Polling stays, for
        submissions another process stored and for retries past their backoff."""
        self._wake.set()

    @property
    def in_flight(self) -> dict[str, Claim]:
        """The attempts this dispatcher tracks, by fencing token."""
        return {token: t.claim for token, t in list(self._tracked.items())}

    def actor(self, token: str) -> Any:
        """The Ray actor handle of a tracked attempt (``KeyError`` if not tracked)."""
        return self._tracked[token].actor

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the database or Ray unreachable: try again next round
                log.exception("dispatcher %s: a round failed; retrying", self.name)
                self._stop.wait(self.poll_s)

    def step(self) -> None:
        """One round: heartbeats, the reconcile when due, the kept claims launched, ended attempts
        collected, new claims launched while slots are free (module docstring).

        Raises:
            the database's or Ray's error when the round cannot go on (the loop logs it and runs
            the next round; what was collected or claimed is kept).
        """
        if time.monotonic() - self._last_beat >= HEARTBEAT_S:
            self._beat()
        if time.monotonic() - self._last_reconcile >= RECONCILE_S:
            self.reconcile()
        launched = False
        for kept in list(self._unlaunched.values()):  # raises while the store is unreachable: still kept
            launched |= self._try_launch(kept)
        self._collect(self.poll_s if self._tracked else 0.0)
        expire_leases(self)
        while len(self._tracked) + len(self._unlaunched) < self.slots and not self._stop.is_set():
            claim = self.store.claim(worker=self.name, public_seeds=self._public_seeds())
            if claim is None:
                break
            self._try_launch(self._unlaunched.setdefault(claim.token, _Kept(claim)))
            launched = True
        if not launched and not any(t.result is None for t in self._tracked.values()):  # ray.wait paced no one
            if self._tracked or self._unlaunched:  # writes or launches to try again: not before poll_s
                self._stop.wait(self.poll_s)
            else:
                self._wake.wait(self.poll_s)
                self._wake.clear()

    def _node(self, t: _Track) -> str | None:
        """The attempt's node (``ip node-id pid``) once its ``where()`` answered, else ``None``."""
        import ray

        if t.node is None and t.where is not None and ray.wait([t.where], timeout=0)[0]:
            try:
                w = ray.get(t.where)
                t.node = f"{w['ip']} {w['node_id'][:12]} pid {w['pid']}"
            except ray.exceptions.RayError:
                t.where = None
        return t.node

    def _beat(self) -> None:
        nodes = {tok: t.node for tok, t in self._tracked.items() if self._node(t) and not t.node_sent}
        self.store.dispatcher_beat(self.name)
        self.store.heartbeat(list(self._tracked) + list(self._unlaunched), node=nodes)
        for tok in nodes:
            self._tracked[tok].node_sent = True
        self._last_beat = time.monotonic()

    # -- dispatch -----------------------------------------------------------------------------
    def _profile(self, name: str | None) -> Profile:
        name = name or self.default_profile
        if name not in self._profiles:
            self._profiles[name] = load_profile(name)
        return self._profiles[name]

    def _policy_of(self, name: str | None) -> Any:
        """The verdict policy of profile ``name`` (its confirmation knobs), ``None`` when it cannot be read."""
        try:
            return self._profile(name).options["policy"]
        except ProfileError:
            return None

    def _public_seeds(self) -> set[int]:
        """The public seeds of every profile this dispatcher knows and of the shipped ones."""
        seeds = {int(p.options["seed"]) for p in self._profiles.values()}
        for name in profile_names():
            try:
                seeds.add(int(self._profile(name).options["seed"]))
            except ProfileError:
                pass
        return seeds

    def _try_launch(self, kept: _Kept) -> bool:
        """Launch a kept claim; whether it is done with (tracked, or its failure written).

        Raises:
            the database's error while it is unreachable (the claim stays kept).
        """
        claim = kept.claim
        try:
            self._launch(claim)
        except Exception as exc:  # noqa: BLE001 - see unstored: one claim's trouble is its own
            if unreachable(exc):
                raise
            kept.refused += 1
            log.warning("submission %d: attempt %d could not be launched (round %d of %d)", claim.submission_id,
                        claim.number, kept.refused, WRITE_TRIES, exc_info=True)
            if kept.refused < WRITE_TRIES:
                return False
            try:
                self._write(claim, failure_result(EvalFailure("dispatch", reason(LAUNCH_FAILED, exc))))
            except Exception as again:  # noqa: BLE001
                if unreachable(again):
                    raise
                log.exception("submission %d: attempt %d's launch failure could not be stored either: left to the "
                              "reconcile", claim.submission_id, claim.number)
        del self._unlaunched[claim.token]
        return True

    def _launch(self, claim: Claim) -> None:
        """Create the attempt's actor, or record why it could not be (an infrastructure failure)."""
        sub = self.store.submission(claim.submission_id)
        try:
            profile = self._profile(sub.profile)
        except ProfileError as exc:
            self._write(claim, failure_result(EvalFailure("config", str(exc))))
            return
        try:
            bundle = self.blobs.get(sub.bundle_sha256)
        except (KeyError, ValueError, OSError, RuntimeError) as exc:  # missing, bad name, unreadable, corrupt
            self._write(claim, failure_result(EvalFailure("dispatch", f"the bundle's bytes: {exc}"), profile=profile))
            return
        job = Job(token=claim.token, submission_id=claim.submission_id, bundle=bundle, profile=profile,
                  data_dir=self.data_dir, seed=claim.seed, work_dir=self.work_dir)
        try:
            asked = resources_for(profile, self._gpus)
            actor = self._remote.options(name=actor_name(claim.token), namespace=NAMESPACE, lifetime="detached",
                                         max_restarts=0, max_concurrency=ACTOR_CONCURRENCY, **asked).remote(job)
            self._track(claim, actor, profile, asked)
        except Exception as exc:  # noqa: BLE001 - Ray refused the actor: retried like a lost one
            self._write(claim, failure_result(EvalFailure("dispatch", f"Ray could not create the attempt's actor: "
                                                          f"{type(exc).__name__}: {exc}"), profile=profile))
            return
        log.info("submission %d: attempt %d dispatched (token %s)", claim.submission_id, claim.number, claim.token)

    def _track(self, claim: Claim, actor: Any, profile: Profile | None = None, asked: dict | None = None) -> None:
        self._tracked[claim.token] = _Track(claim, actor, actor.result.remote(RESULT_WAIT_S), actor.where.remote(),
                                            profile=profile, asked=asked)

    def _collect(self, timeout: float) -> None:
        """Write the result of every tracked attempt that ended (waiting up to ``timeout`` s)."""
        import ray

        pending = {t.ref: tok for tok, t in self._tracked.items() if t.result is None}
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
            for ref in ready:
                t = self._tracked[pending[ref]]
                t.result = self._outcome(t, ref)
        for tok, t in list(self._tracked.items()):
            if t.result is not None and self._store(t):  # raises while the store is unreachable: kept, retried
                del self._tracked[tok]
                kill_actor(t.actor)

    def _store(self, t: _Track) -> bool:
        """Write ``t.result``; whether the attempt is done with (written, discarded, or given up
        on: module docstring). A result refused on :data:`WRITE_TRIES` rounds is replaced by its
        stand-in (:func:`~prism_challenge.service.unstored.stand_in`), written at once.

        Raises:
            the database's error while it is unreachable (the result stays with ``t``).
        """
        claim = t.claim
        try:
            if not t.node_sent and self._node(t):
                self.store.heartbeat([claim.token], node={claim.token: t.node})
                t.node_sent = True
            self._write(claim, t.result, final=t.final)
            return True
        except TransitionError:  # no attempt has the token (the row was deleted): nothing to fence
            log.exception("submission %d: attempt %d's result has no attempt to go to", claim.submission_id,
                          claim.number)
            return True
        except Exception as exc:  # noqa: BLE001 - see unstored: one result's trouble is its own
            if unreachable(exc):
                raise
            t.refused += 1
            log.warning("submission %d: attempt %d's %s result could not be stored (round %d of %d)",
                        claim.submission_id, claim.number, t.result.status, t.refused, WRITE_TRIES, exc_info=True)
            if t.refused < WRITE_TRIES:
                return False
            if t.replaced:
                log.error("submission %d: attempt %d's stand-in failure could not be stored either (%s): left to "
                          "the reconcile", claim.submission_id, claim.number, first_line(exc))
                return True
            t.result, t.refused, t.replaced = stand_in(claim, t.result, exc, blobs=self.blobs,
                                                       profile=t.profile), 0, True
            return self._store(t)

    def _outcome(self, t: _Track, ref: Any) -> EvalResult | None:
        """The attempt's result from its ready ``result()`` ref; ``None`` (and a new call) while
        it runs on."""
        import ray

        try:
            payload = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the actor's process or node died
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            message = f"the Ray worker of attempt {t.claim.number} died ({type(exc).__name__}: {first[:300]})"
            return failure_result(EvalFailure("dispatch", message), profile=t.profile)
        if payload is None:  # still running: ask again (a bounded wait keeps no actor thread blocked for a dead caller)
            t.ref = t.actor.result.remote(RESULT_WAIT_S)
            return None
        try:
            if payload.get("token") != t.claim.token:
                raise ValueError(f"the actor answered for token {payload.get('token')!r}")
            return EvalResult.model_validate(payload["result"])
        except Exception as exc:  # noqa: BLE001 - a harness bug on the node: reported and retried
            return failure_result(EvalFailure("dispatch", f"the attempt's answer is not a result: "
                                              f"{type(exc).__name__}: {str(exc)[:300]}"), profile=t.profile)

    def _write(self, claim: Claim, result: EvalResult, final: bool = False) -> None:
        tries = claim.number - claim.run_base  # the attempts of this run
        done = self.store.record(claim.token, result, backoff_s=backoff_s(tries, self.backoff_base_s),
                                 max_attempts=tries if final else self.max_attempts, policy_of=self._policy_of)
        log.info("submission %d: attempt %d %s -> %s (%s)", claim.submission_id, claim.number, result.status,
                 done.status, done.reason)

    # -- recovery -----------------------------------------------------------------------------
    def reconcile(self) -> Reconciled:
        """Match every ``running`` submission this dispatcher does not track against the cluster
        (:func:`prism_challenge.service.recovery.reconcile`). Run at start, then every
        :data:`RECONCILE_S` seconds by the loop; not thread-safe: call it yourself only while the
        loop is stopped."""
        return reconcile(self)


def start(state: Any) -> Dispatcher:
    """Start the service's dispatcher from its app state (the hook ``prism serve``'s lifespan
    calls): ``state.store``, ``state.blobs``, ``state.profile`` (loaded) and ``state.settings``
    (``ray_address``, ``slots``, ``max_attempts``, ``data_dir``, ``profile``, and
    ``retry_backoff_s``, ``check_resources``, ``lease_timeout_s``, ``work_dir`` when it has them). Returns
    the started dispatcher (``stop()`` at shutdown).
    """
    settings, profile = state.settings, state.profile
    data_dir, work_dir = getattr(settings, "data_dir", None), getattr(settings, "work_dir", None)
    return Dispatcher(state.store, state.blobs, ray_address=settings.ray_address, slots=settings.slots,
                      max_attempts=settings.max_attempts, check_resources=getattr(settings, "check_resources", None),
                      lease_timeout_s=getattr(settings, "lease_timeout_s", None),
                      backoff_base_s=getattr(settings, "retry_backoff_s", DEFAULT_BACKOFF_S),
                      data_dir=str(data_dir) if data_dir is not None else None, default_profile=settings.profile,
                      profiles={settings.profile: profile, profile.name: profile},
                      work_dir=str(work_dir) if work_dir is not None else None).start()


__all__ = ["CannotEvaluate", "DEFAULT_BACKOFF_S", "DEFAULT_SLOTS", "Dispatcher", "MAX_BACKOFF_S", "Reconciled",
           "backoff_s", "resources_for", "start"]
