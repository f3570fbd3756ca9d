"""A Ray cluster of several nodes on one machine (Ray's ``ray.cluster_utils.Cluster``: a head
with no CPUs and two worker nodes of one CPU each), joined by address as ``prism serve
--ray-address`` does (issue 18, item 3): a worker node lost mid-run, and the attempt retried on
the other node with exactly one result, equal to ``evaluate()`` run directly. First, the
embedded default: a dispatcher without an address starts its own Ray and shuts it down."""

from __future__ import annotations

import pytest
from fleet_fixtures import (  # noqa: F401 - world and service are fixtures
    assert_same_as_direct,
    counts,
    final,
    ray,
    service,
    stage,
    submit,
    wait,
    world,
)

from prism_challenge.service.worker import NAMESPACE

pytestmark = [pytest.mark.slow, pytest.mark.fleet]


def test_the_embedded_ray_is_started_and_shut_down_by_the_dispatcher(world, service):
    store, blobs, make = service  # runs first in this module: no Ray in this process yet
    assert not ray.is_initialized()
    sid = submit(store, blobs, world["zip"])
    d = make(slots=1).start()
    assert ray.cluster_resources()["CPU"] == 1.0
    final(store, sid)
    d.stop()
    assert not ray.is_initialized()
    assert counts(store, sid) == (2, 2)  # confirmed: the test profile's 2 runs
    assert_same_as_direct(store, sid, world["direct"], exact=(1,))


@pytest.fixture(scope="module")
def cluster(world):
    """Head (0 CPUs: nothing runs there) and two 1-CPU worker nodes; this process joins it."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def test_a_lost_worker_node_mid_run_is_retried_on_the_other_node(world, service, cluster):
    c, nodes = cluster
    store, blobs, make = service
    sid = submit(store, blobs, world["zip"])
    d = make(ray_address=c.address).start()
    token = wait(lambda: next(iter(d.in_flight), None), "the attempt to be dispatched")
    actor = d.actor(token)
    wait(lambda: stage(actor) in ("gates", "stream", "heldout"), "the run to reach the gates")
    where = ray.get(actor.where.remote())
    (victim,) = [n for n in nodes if n.node_id == where["node_id"]]
    (other,) = [n for n in nodes if n is not victim]
    c.remove_node(victim, allow_graceful=False)  # the node's raylet and workers are killed
    final(store, sid, timeout=300)
    nodes.remove(victim)  # the module's cluster keeps two worker nodes for the next case (the other database)
    nodes.append(c.add_node(num_cpus=1))
    attempts = store.attempts(sid)
    run0 = [a for a in attempts if a.run_index == 0]
    run1 = [a for a in attempts if a.run_index == 1]
    first = run0[0]
    assert (first.outcome, first.failure_stage, first.failure_kind) == ("retry", "dispatch", "infrastructure")
    assert first.node.split()[1] == where["node_id"][:12]
    assert [a.outcome for a in run0] == ["retry", "completed"] and run0[1].node.split()[1] == other.node_id[:12]
    # the confirmation run: it may itself have been struck by the node's loss; it ends with one result
    assert run1[-1].outcome == "completed" and all(a.outcome == "retry" for a in run1[:-1])
    assert len(run0) + len(run1) == len(attempts) and counts(store, sid) == (len(attempts), 2)
    assert_same_as_direct(store, sid, world["direct"], exact=(0,))
