"""What rank 0 sends the feeder besides its losses: the scored model's state and the audited
batches' snapshots, written to the trusted side's disk.

:class:`StateReceiver` (a base of :class:`~prism_challenge.evaluator.feeder.Feeder`) rebuilds
the state's tensors within the byte cap and hands the snapshots to the run's
:class:`~prism_challenge.evaluator.snapshots.SnapshotStore`; :class:`SnapshotDiskError` says
whose fault a failed snapshot write is.
"""

from __future__ import annotations

from typing import Any

from prism_challenge.evaluator.feedlink import RankState
from prism_challenge.evaluator.protocol import Kind, ProtocolError
from prism_challenge.evaluator.statedict import StateError, rebuild


class SnapshotDiskError(Exception):
    """The trusted side could not write an audited batch's snapshot. Its failure stage says whose
    fault: ``resources`` (the submission's) when the run's snapshots outgrew the float32 size of
    a model at the parameter cap (:meth:`SnapshotStore.outgrew_fp32`: a loop could otherwise fill
    the disk on purpose, once it saw a cheated batch audited, to earn a retry under a new
    secret), else ``storage`` (the host's, retried)."""

    def __init__(self, step: int | None, exc: OSError, outgrown: bool):
        self.stage = "resources" if outgrown else "storage"
        why = (": its snapshots carry more than 4 bytes per element of a model at the parameter cap" if outgrown
               else "")
        super().__init__(f"the snapshot of audited batch {step} cannot be written: {exc}{why}")


class StateReceiver:
    """Receives rank 0's STATE, SNAPSHOT and SNAPSHOT_END frames (a base of
    :class:`~prism_challenge.evaluator.feeder.Feeder`)."""

    def _on_state(self, st: RankState, header: dict[str, Any], payload: bytearray) -> None:
        st.state_bytes += len(payload)
        if st.state_bytes > self.max_state_bytes:
            raise ProtocolError(f"the scored model's state exceeds {self.max_state_bytes} bytes")
        try:
            name, tensor = rebuild(header, payload)
        except StateError as exc:
            raise ProtocolError(str(exc)) from None
        if name in self.result.state:
            raise ProtocolError(f"state tensor {name!r} sent twice")
        self.result.state[name] = tensor

    def _on_snapshot(self, st: RankState, kind: Kind, header: dict[str, Any], payload: bytearray) -> None:
        store = st.snapshots
        assert store is not None
        try:
            if kind == Kind.SNAPSHOT:
                store.add(header, payload)
                return
            step = store.expected
            with self._lock:
                audited = self.result.audits.get(step) if step is not None else None
            if audited is None:
                raise StateError(f"a snapshot's end for batch {header.get('step')!r}, which was not audited")
            store.end(header, audited)
        except StateError as exc:
            raise ProtocolError(str(exc)) from None
        except OSError as exc:  # the trusted side's disk, never silent; whose fault: SnapshotDiskError
            raise SnapshotDiskError(store.expected, exc, store.outgrew_fp32()) from None
