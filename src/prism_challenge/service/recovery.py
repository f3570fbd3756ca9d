"""A dispatcher's recovery: the database's running attempts matched against the Ray cluster.

:func:`reconcile` (:meth:`Dispatcher.reconcile <prism_challenge.service.dispatch.Dispatcher.reconcile>`,
run at start and every :data:`~prism_challenge.service.dispatch.RECONCILE_S` seconds): every
``running`` submission's current attempt that the dispatcher neither tracks nor keeps to launch
is looked up by its actor's name; a live actor is tracked again (its running evaluation is left
alone, a finished one's result collected), a missing one is recorded as lost (``dispatch``) and
so re-dispatched. A lost attempt whose record the database refuses (not an unreachable database:
:func:`~prism_challenge.service.unstored.unreachable`) is logged and left to the next reconcile;
the others go on. Actors of attempts that have ended (a superseded attempt's included) are
killed; actors whose token this database does not know are left alone. Detached actors outlive
the driver that made them on a cluster started with ``ray start`` (``ray_address``); the
embedded Ray (``ray_address=None``) is the service's own child and ends with it, so its running
attempts are re-dispatched after a restart.

Temporary folders: every reconcile sweeps this node's work dir (:func:`prism_challenge.scratch.sweep`:
the folders of attempts whose process died: ended, fenced off, lost or SIGKILLed, whose lock is
free; a live attempt's folder is locked and left) and the temp directory's ``prism-run-*``
folders of dead processes. Other nodes' work dirs are swept by each attempt's start there.
"""

from __future__ import annotations

import logging
import time
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_challenge import scratch
from prism_challenge.failures import EvalFailure
from prism_challenge.service.store import Claim
from prism_challenge.service.unstored import unreachable
from prism_challenge.service.worker import ACTOR_PREFIX, NAMESPACE, actor_name, default_work_dir, failure_result

if TYPE_CHECKING:
    from prism_challenge.service.dispatch import Dispatcher

log = logging.getLogger("prism_challenge.service")


@dataclass(frozen=True)
class Reconciled:
    """What :func:`reconcile` did: submission ids whose live attempt is tracked again, submission
    ids whose attempt was gone (recorded as lost: retried or failed), the number of actors
    killed because their attempt has ended, and the temporary folders of dead processes removed."""

    adopted: list[int]
    lost: list[int]
    killed: int
    swept: list[str] = field(default_factory=list)


def reconcile(d: Dispatcher) -> Reconciled:
    """Reconcile dispatcher ``d``'s database with the cluster (module docstring).

    Raises:
        the database's error while it is unreachable.
    """
    import ray

    adopted, lost = [], []
    for claim in d.store.running():
        if claim.token in d._tracked or claim.token in d._unlaunched:
            continue
        if not claim.token:  # an attempt made before fencing existed: nothing on Ray to find
            if _lost(d, claim, "an attempt from before migration 0003 was running when the service restarted"):
                lost.append(claim.submission_id)
            continue
        try:
            actor = ray.get_actor(actor_name(claim.token), namespace=NAMESPACE)
        except ValueError:
            if _lost(d, claim, f"attempt {claim.number}'s Ray actor was gone when the dispatcher reconciled"):
                lost.append(claim.submission_id)
            continue
        d._track(claim, actor)
        adopted.append(claim.submission_id)
    killed = 0
    untracked = [e["name"][len(ACTOR_PREFIX):] for e in ray.util.list_named_actors(all_namespaces=True)
                 if e["namespace"] == NAMESPACE and e["name"].startswith(ACTOR_PREFIX)
                 and e["name"][len(ACTOR_PREFIX):] not in d._tracked]
    for token in sorted(d.store.ended(untracked)):  # another database's actors are left alone
        try:
            kill_actor(ray.get_actor(actor_name(token), namespace=NAMESPACE))
            killed += 1
            log.warning("killed the actor of attempt token %s, which has ended (its result was written)", token)
        except ValueError:
            pass
    swept = sweep_folders(d.work_dir)
    d._last_reconcile = time.monotonic()
    if adopted or lost or killed or swept:
        log.info("dispatcher %s reconciled: adopted %s, lost %s, killed %d orphan actors, removed %d temporary "
                 "folders of dead processes", d.name, adopted, lost, killed, len(swept))
    return Reconciled(adopted, lost, killed, swept)


def sweep_folders(work_dir: str | None) -> list[str]:
    """Remove this node's temporary folders of dead processes: the attempt folders in
    ``work_dir`` (``None``: :func:`~prism_challenge.service.worker.default_work_dir`) and the
    ``prism-run-*`` folders in the temp directory (:func:`prism_challenge.scratch.sweep`)."""
    base = Path(work_dir) if work_dir else default_work_dir()
    removed = scratch.sweep(base) + scratch.sweep(tempfile.gettempdir(), scratch.RUN_PREFIX)
    return [str(p) for p in removed]


def _lost(d: Dispatcher, claim: Claim, message: str) -> bool:
    """Record a running attempt found gone; whether it was written (a record the database refuses
    is logged: the next reconcile tries again).

    Raises:
        the database's error while it is unreachable.
    """
    result = failure_result(EvalFailure("dispatch", message))
    try:
        if claim.token:
            d._write(claim, result)
        else:
            d.store.finish(claim.attempt_id, result)
        return True
    except Exception as exc:  # noqa: BLE001 - one attempt's trouble is its own
        if unreachable(exc):
            raise
        log.exception("submission %d: attempt %d is gone, but that could not be stored: the next reconcile "
                      "tries again", claim.submission_id, claim.number)
        return False


def kill_actor(actor: Any) -> None:
    """Kill a Ray actor for good (``no_restart``); one already gone is no error."""
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


__all__ = ["Reconciled", "kill_actor", "reconcile", "sweep_folders"]
