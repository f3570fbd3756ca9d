"""Rank 0 sends an audited batch's snapshot, while the loop trains.

The snapshot is the copy of the scored module's ``state_dict`` that rank 0 took before the
batch's scoring forward (:meth:`~prism_challenge.evaluator.runner.Runtime._state_before`). Once
the feeder's answer says the batch is audited, the batch's
:class:`~prism_challenge.evaluator.reporter.Reporter` copies it to the CPU one tensor at a time
and sends each as a SNAPSHOT frame, then SNAPSHOT_END, then the request for the next batch, on
its own thread. The loop gets its batch at once: the copy, the transfer and the trusted side's
write and hash (:class:`~prism_challenge.evaluator.snapshots.SnapshotStore`) overlap its
training step instead of preceding it.

What stays as it was:

* the snapshot is the state before the scoring forward, taken before the answer existed;
* the request for the next batch leaves after SNAPSHOT_END on the same socket, so the feeder
  holds the whole snapshot, written and hashed, before it serves batch ``k + 1``: the snapshot
  of batch ``k`` cannot depend on any later batch;
* while a sender runs it owns the socket: the runner sends nothing else until
  :meth:`~prism_challenge.evaluator.reporter.Reporter.settle` returned (before it reads the next batch, reports an error or
  leaves the stream), so frames never interleave; at most one snapshot is in flight, and the
  rank's next copy is taken only after the sender ended (one snapshot plus one CPU tensor).
"""

from __future__ import annotations

import socket

import torch

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.statedict import DTYPES, StateError, tensor_bytes


def aliases_of(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: first}`` for every entry of ``state`` that is the same tensor object as an earlier
    entry ``first`` (in the dict's order; ``first`` is itself never an alias): the copy
    :meth:`~prism_challenge.evaluator.runner.Runtime._state_before` takes once for a tied tensor
    (two names, one storage, offset, shape, stride and dtype: an exact alias) and gives every name
    of. Computed while every entry is alive, so no ``id`` can have been reused."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in state.items():
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def send_snapshot(sock: socket.socket, step: int, state: dict[str, torch.Tensor]) -> int:
    """Send ``state`` as SNAPSHOT frames of batch ``step`` and SNAPSHOT_END, one tensor copied to
    contiguous CPU memory at a time; the bytes sent. A name whose tensor is the object an earlier
    name's is (:func:`aliases_of`) goes as an alias frame: the header names the earlier one
    (``alias``) and carries no payload, so a tied weight crosses the socket and lands on the
    trusted disk once (:class:`~prism_challenge.evaluator.snapshots.SnapshotStore`). ``state`` is
    left whole: the caller frees it on the loop's thread at a fixed point
    (:meth:`~prism_challenge.evaluator.reporter.Reporter.settle`). Freed here, on the sending
    thread, its memory would go back to the allocator at moments that depend on the machine's
    load, and the loop's allocations with it: the harness keeps what it can of the rank's work in
    one sequence, whatever the load (issue 27). The host holds
    one CPU copy at a time (none on the CPU, where the copy is the state's own tensor).

    Raises:
        StateError: a dtype the harness cannot store.
        OSError: the socket closed.
    """
    sent, count, aliases = 0, len(state), aliases_of(state)
    for name, t in state.items():
        if str(t.dtype) not in DTYPES:
            raise StateError(f"state tensor {name!r} has dtype {t.dtype}, which the harness cannot store")
        head = {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "step": step}
        if name in aliases:
            protocol.send(sock, Kind.SNAPSHOT, {**head, "alias": aliases[name]})
            continue
        cpu = t.detach().to("cpu").contiguous()
        payload = tensor_bytes(cpu)
        protocol.send(sock, Kind.SNAPSHOT, head, payload)
        sent += len(payload)
        del cpu, payload
    protocol.send(sock, Kind.SNAPSHOT_END, {"step": step, "tensors": count})
    return sent
