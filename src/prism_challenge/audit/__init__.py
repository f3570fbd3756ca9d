"""The audit, after the stream: fresh, sandboxed processes check what the stream recorded.

* :mod:`~prism_challenge.audit.auditstage`: the pipeline's audit stage, and what it keeps for
  ``prism verify``;
* :mod:`~prism_challenge.audit.rescore` and :mod:`~prism_challenge.audit.rescore_child`: the
  audited batches re-scored from rank 0's weight snapshots, and blind probes with real text;
* :mod:`~prism_challenge.audit.heldout`: the held-out delta (trained against its random-init
  twin) in its own bounded process; its trusted side :mod:`~prism_challenge.audit.heldout_parent`,
  the child's work :mod:`~prism_challenge.audit.heldout_child`, and the frames between them
  :mod:`~prism_challenge.audit.heldout_wire`;
* :mod:`~prism_challenge.audit.blindprobe`: the held-out stage's blind causality probe.

The audit's schedule and its snapshots on the trusted side are the isolated run's
(:mod:`~prism_challenge.evaluator.auditplan`, :mod:`~prism_challenge.evaluator.snapshots`):
they are taken while the stream runs.
"""
