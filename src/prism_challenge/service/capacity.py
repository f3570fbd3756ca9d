"""What a dispatcher can run (issue 27, item 3): the profile's device, GPU count and data directory
checked where it will evaluate, before the service takes work, and the lease deadline of an
attempt whose Ray actor never starts.

:func:`missing` compares the run's Ray resources
(:func:`~prism_challenge.service.dispatch.resources_for`) with each alive node's
(``ray.nodes()``: one attempt is one actor, so one node must hold all of them), and the data
directory with the profile's data: the embedded corpus needs none; a prepared one needs
``data_dir``, a directory holding its ``MANIFEST.json`` (checked on this machine for the
embedded Ray; on a cluster the path is each node's, so the worker's own check fails an attempt
on a node without it, as an infrastructure failure).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from prism_challenge.data.manifest import MANIFEST_NAME
from prism_challenge.profiles import Profile, prepare_hint

log = logging.getLogger("prism_challenge.service")


class CannotEvaluate(RuntimeError):
    """The dispatcher cannot evaluate the profile here; ``missing`` names each thing lacking."""

    def __init__(self, profile: str, missing: list[str]):
        super().__init__(f"cannot evaluate profile {profile} here: " + "; ".join(missing) + " (run with "
                         "--no-dispatch to serve intake and reading only, or PRISM_CHECK_RESOURCES=false for a "
                         "cluster that adds nodes on demand)")
        self.missing = list(missing)


def node_resources(nodes: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The total resources (``{"CPU": 16.0, "GPU": 1.0, ...}``) of each alive node of ``ray.nodes()``."""
    return [dict(n.get("Resources") or {}) for n in nodes if n.get("Alive", n.get("alive", False))]


def missing(profile: Profile, need: dict[str, float], nodes: list[dict[str, float]], data_dir: str | None, *,
            local: bool) -> list[str]:
    """What ``profile`` needs that is not there (empty: nothing).

    Args:
        need: one attempt's Ray resources (``{"num_gpus": 1, "num_cpus": 1}``).
        nodes: each alive node's total resources (:func:`node_resources`).
        data_dir: the settings' data directory (``None``: none given).
        local: the embedded Ray on this machine (the data directory is checked here).
    """
    out = []
    device, nproc = profile.options["device"], int(profile.options["nproc"])
    for key, ray_name, what in (("num_gpus", "GPU", "GPU"), ("num_cpus", "CPU", "CPU")):
        want = float(need.get(key, 0))
        best = max((n.get(ray_name, 0.0) for n in nodes), default=0.0)
        if want > best:
            total = sum(n.get(ray_name, 0.0) for n in nodes)
            out.append(f"{what}: one attempt (device {device}, nproc {nproc}) needs {want:g} on one Ray node; the "
                       f"largest has {best:g} ({len(nodes)} node(s), {total:g} in all)")
    if profile.data.source != "builtin":
        hint = prepare_hint(profile.data)
        if data_dir is None:
            out.append(f"data: profile {profile.name} evaluates on prepared {profile.data.source} data and no data "
                       f"directory is set (--data, PRISM_DATA_DIR); make it with: {hint}")
        elif local and not (Path(data_dir) / MANIFEST_NAME).is_file():
            what = "no such directory" if not Path(data_dir).is_dir() else f"it holds no {MANIFEST_NAME}"
            out.append(f"data: {data_dir}: {what}; make it with: {hint}")
    return out


def check_capacity(d: Any) -> None:
    """At a dispatcher's start (Ray connected): :func:`missing` for its default profile; raise
    :class:`CannotEvaluate` (the embedded Ray shut down first) when ``d.check_resources``, else
    log it and keep it as ``d.problem``."""
    import ray

    from prism_challenge.service.dispatch import resources_for

    profile = d._profile(d.default_profile)
    lacking = missing(profile, resources_for(profile, d._gpus), node_resources(ray.nodes()), d.data_dir,
                      local=not d.ray_address)
    if not lacking:
        return
    error = CannotEvaluate(profile.name, lacking)
    if d.check_resources:
        if d._owns_ray:
            ray.shutdown()
            d._owns_ray = False
        raise error
    d.problem = str(error)
    log.warning("dispatcher %s: %s; starting anyway (check_resources is off)", d.name, error)


LEASE_PROBLEM = "no Ray node started"
"""How a lease failure's message (and the dispatcher's ``problem`` it sets) begins."""


def expire_leases(d: Any) -> None:
    """One dispatcher round's lease check: every tracked attempt whose actor has not started
    (``where()`` unanswered) ``d.lease_timeout_s`` after its launch gets a final
    ``infrastructure`` failure at stage ``dispatch`` (written, and its actor killed, by the
    round's collect); ``d.problem`` names it until an actor starts again (which also clears
    what :func:`check_capacity` found missing: a node that has it came)."""
    from prism_challenge.failures import EvalFailure
    from prism_challenge.service.worker import failure_result

    now = time.monotonic()
    for t in list(d._tracked.values()):
        if t.result is not None:
            continue
        if t.node is not None or d._node(t) is not None:
            d.problem = None  # an actor started: leases are met again (a node with what was missing came)
            continue
        if d.lease_timeout_s is None or t.where is None or now - t.launched < d.lease_timeout_s:
            continue
        message = lease_message(t.claim, t.asked, d.lease_timeout_s)
        t.final, t.result = True, failure_result(EvalFailure("dispatch", message), profile=t.profile)
        d.problem = message
        log.error("submission %d: %s", t.claim.submission_id, message)


def lease_message(claim: Any, asked: dict[str, float] | None, timeout_s: float) -> str:
    """The failure message of an attempt whose actor no node started within ``timeout_s``."""
    import ray

    try:
        totals = ray.cluster_resources()
    except Exception:  # noqa: BLE001 - Ray gone: the message says so
        totals = {}
    have = ", ".join(f"{k} {v:g}" for k, v in sorted(totals.items()) if k in ("CPU", "GPU"))
    wants = ", ".join(f"{k} {v:g}" for k, v in sorted((asked or {}).items()))
    return (f"{LEASE_PROBLEM} attempt {claim.number}'s actor within lease_timeout_s = {timeout_s:g} s: it asks "
            f"for {wants or 'its resources'}; the cluster has {have or 'none'} in all (busy, or lacking them)")


__all__ = ["CannotEvaluate", "LEASE_PROBLEM", "check_capacity", "expire_leases", "lease_message", "missing",
           "node_resources"]
